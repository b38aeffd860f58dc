"""The API reference pages whose members are listed by hand (``members:`` under a ``:::`` block of
``docs/reference/*.md``) list every public name, so a new method or export cannot go missing from
the docs: packages re-export names from submodules and S3TokenStore inherits its methods from
private mixins, where mkdocstrings' own order would reshuffle the page. No S3 involved."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reference"


def _listed_blocks() -> list[tuple[str, str, list[str]]]:
    """``(page, dotted name, listed members)`` for every ``:::`` block with a ``members:`` list."""
    blocks = []
    for page in sorted(DOCS.glob("*.md")):
        lines = page.read_text().splitlines()
        for index, line in enumerate(lines):
            match = re.match(r":::\s+(\S+)", line)
            if not match:
                continue
            members: list[str] | None = None
            for follow in lines[index + 1 :]:
                if follow.startswith(":::") or (follow.strip() and not follow.startswith(" ")):
                    break
                if follow.strip() == "members:":
                    members = []
                elif members is not None and follow.strip().startswith("- "):
                    members.append(follow.strip()[2:].strip())
            if members is not None:
                blocks.append((page.name, match.group(1), members))
    return blocks


def _resolve(dotted: str):
    module_name, _, attribute = dotted.rpartition(".")
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return getattr(importlib.import_module(module_name), attribute)


def _public(obj) -> set[str]:
    if inspect.ismodule(obj):
        return set(getattr(obj, "__all__", ()))
    return {name for name in dir(obj) if not name.startswith("_")}


BLOCKS = _listed_blocks()


def test_the_hand_kept_pages_are_found():
    assert {name for _, name, _ in BLOCKS} >= {
        "s3capture.store.S3TokenStore",
        "s3capture.trajectory",
        "s3capture.export",
    }


@pytest.mark.parametrize(("page", "dotted", "members"), BLOCKS, ids=[f"{p}:{d}" for p, d, _ in BLOCKS])
def test_a_listed_reference_block_names_every_public_member(page, dotted, members):
    obj = _resolve(dotted)
    missing = sorted(_public(obj) - set(members))
    assert not missing, f"docs/reference/{page}: add {missing} to the members of {dotted}"
    unknown = sorted(name for name in members if not hasattr(obj, name))
    assert not unknown, f"docs/reference/{page}: {dotted} has no {unknown}"
