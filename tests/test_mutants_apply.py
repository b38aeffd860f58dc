"""Every mutant of ``tools/mutation.py`` still applies to ``src/``: its snippets occur exactly once.

A refactor that moves a snippet turns its mutant into ``not found``, and the tests that mutant
proved able to fail are then unproven until someone reruns the tool. Eight mutants had drifted that
way unnoticed (found on 2026-12-02); this test fails at once instead, naming the mutant and the
snippet to move to the code's new home (``docs/mutation.md``, "When the source changes").
No S3 and no pytest runs of the mutants: only the text of the sources is read.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mutation_module():
    spec = importlib.util.spec_from_file_location("s3capture_mutation_tool", ROOT / "tools" / "mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


MUTATION = _mutation_module()


@pytest.mark.parametrize("mutant", MUTATION.MUTANTS, ids=[m.name for m in MUTATION.MUTANTS])
def test_mutant_applies_to_the_sources(mutant, tmp_path: Path) -> None:
    copy = tmp_path / mutant.file
    copy.parent.mkdir(parents=True)
    original = (ROOT / mutant.file).read_text(encoding="utf-8")
    copy.write_text(original, encoding="utf-8")
    assert MUTATION.apply(tmp_path, mutant) == "", f"update {mutant.name!r} in tools/mutation.py"
    assert copy.read_text(encoding="utf-8") != original, f"{mutant.name!r} changes nothing"


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in MUTATION.MUTANTS]
    assert len(names) == len(set(names))
