"""docs/reasons.md lists every reason code the code can produce, and nothing else.

The codes are not constants in one place (the snapshot builder, the ledger, the trajectory
builder and the exporter each spell their own), so the codes are read from the source with ``ast``,
by the forms the code produces them in:

- ``reasons.append(X)`` / ``reasons.extend(X)`` (any list named ``reasons``);
- ``reason=X`` in a call (``LineageResolution(..., reason=...)``);
- ``fail(kind, cid[, reason])`` in the trajectory builder (the code is ``reason`` or ``kind``);
- ``return None, X`` (a loader that reports its problem as a reason);
- any name ending in ``_REASON`` (the ledger's manifest failure codes, in ``ledger_records``);

where ``X`` is a string literal or an f-string (the code is its text up to the first ``:``), a
conditional of two of them, a generator of them, or a local variable assigned one of them. An
f-string that starts with a loop variable over a tuple of literals (``f"{name}:..."`` for ``name``
in ``("roots", "chains")``) gives each literal. A reason built any other way is invisible to this
test: ``test_extractor_sees_known_forms`` pins the codes each form yields, so a refactor that
changes a form fails there first.

Both directions are checked: a code the source produces that the table lacks, and a row of the
table that no code produces any more. Gym's own manifest failure codes (written by Gym's workers or
a caller through ``record_failure``) are checked against ``nemo_gym.token_id_capture``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "s3capture"
DOC = ROOT / "docs" / "reasons.md"
MODULES = (
    sorted(path.name for path in SRC.glob("store*.py"))  # s3capture.store and its store_* parts
    + sorted(path.name for path in SRC.glob("ledger*.py"))  # s3capture.ledger and its ledger_* parts
    + sorted(path.name for path in SRC.glob("records*.py"))  # s3capture.records and records_coerce
    + sorted(f"rollouts/{path.name}" for path in (SRC / "rollouts").glob("*.py"))
    + sorted(f"trajectory/{path.name}" for path in (SRC / "trajectory").glob("*.py"))
    + sorted(f"export/{path.name}" for path in (SRC / "export").glob("*.py"))
)
_CODE = re.compile(r"[a-z][a-z0-9_]*\Z")


def _head(text: str) -> str:
    return text.split(":", 1)[0].strip()


class _Extractor:
    def __init__(self, path: pathlib.Path) -> None:
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.codes: dict[str, set[str]] = {}  # code -> forms that produced it
        self.constants = importlib.import_module("s3capture.ledger_records")

    def _enclosing(self, node: ast.AST, kinds: tuple[type, ...]):
        node = self.parents.get(node)
        while node is not None:
            if isinstance(node, kinds):
                yield node
            node = self.parents.get(node)

    def _loop_values(self, name: str, node: ast.AST) -> list[str] | None:
        for loop in self._enclosing(node, (ast.For, ast.AsyncFor)):
            if (
                isinstance(loop.target, ast.Name)
                and loop.target.id == name
                and isinstance(loop.iter, (ast.Tuple, ast.List))
            ):
                values = [e.value for e in loop.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if len(values) == len(loop.iter.elts):
                    return values
        return None

    def _local_value(self, name: str, node: ast.AST) -> ast.AST | None:
        for function in self._enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(function):
                if isinstance(sub, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in sub.targets):
                    return sub.value
            return None
        return None

    def heads(self, node: ast.AST) -> list[str]:
        """The reason codes an expression can evaluate to (empty when it cannot be told)."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [_head(node.value)]
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant):
                return [_head(first.value)]
            if isinstance(first, ast.FormattedValue) and isinstance(first.value, ast.Name) and len(node.values) > 1:
                after = node.values[1]
                if isinstance(after, ast.Constant) and after.value.startswith(":"):
                    return self._loop_values(first.value.id, node) or []
            return []
        if isinstance(node, ast.IfExp):
            return self.heads(node.body) + self.heads(node.orelse)
        if isinstance(node, (ast.GeneratorExp, ast.ListComp)):
            return self.heads(node.elt)
        if isinstance(node, ast.Name):
            if node.id.endswith("_REASON"):
                return [getattr(self.constants, node.id)]
            value = self._local_value(node.id, node)
            return self.heads(value) if value is not None else []
        return []

    def _add(self, form: str, node: ast.AST) -> None:
        for code in self.heads(node):
            self.codes.setdefault(code, set()).add(form)

    def run(self) -> dict[str, set[str]]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                func = node.func
                if (
                    isinstance(func, ast.Attribute)
                    and func.attr in ("append", "extend")
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "reasons"
                    and node.args
                ):
                    self._add("reasons.append", node.args[0])
                if isinstance(func, ast.Name) and func.id == "fail" and node.args:
                    self._add("fail", node.args[2] if len(node.args) > 2 else node.args[0])
                for keyword in node.keywords:
                    if keyword.arg == "reason":
                        self._add("reason=", keyword.value)
            elif isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) == 2:
                first, second = node.value.elts
                if isinstance(first, ast.Constant) and first.value is None:
                    self._add("return None, reason", second)
            elif isinstance(node, ast.Name) and node.id.endswith("_REASON") and isinstance(node.ctx, ast.Load):
                self._add("_REASON", node)
        return self.codes


@functools.lru_cache(maxsize=None)
def source_codes() -> dict[str, dict[str, set[str]]]:
    """module -> code -> forms, for every module that produces reason codes."""
    out = {}
    for name in MODULES:
        codes = _Extractor(SRC / name).run()
        if codes:
            out[name] = codes
    return out


def _section_of(module: str, form: str) -> str:
    """The section of docs/reasons.md a code produced by ``form`` in ``module`` belongs to."""
    if module.startswith(("trajectory/", "export/")):
        return "mask"
    if form == "reason=" and module.startswith(("store", "ledger")):
        return "lineage"
    if module.startswith("store"):
        return "snapshot"
    if module.startswith("ledger") and form == "_REASON":
        return "manifest"
    raise AssertionError(f"{module} produces reason codes by {form}: say which section of docs/reasons.md they go in")


def produced_codes() -> dict[tuple[str, str], list[str]]:
    """(section, code) -> modules producing it."""
    out: dict[tuple[str, str], list[str]] = {}
    for module, codes in source_codes().items():
        for code, forms in codes.items():
            for form in forms:
                out.setdefault((_section_of(module, form), code), []).append(module)
    return out


_SECTIONS = [
    ("Snapshot reasons", "snapshot"),
    ("Ledger manifest failures", "manifest"),
    ("Mask reasons", "mask"),
    ("Unresolved lineage reasons", "lineage"),
    ("Gym's own manifest failure codes", "gym"),
]


def doc_codes() -> dict[tuple[str, str], str]:
    """(section, code) -> its table row, for every row of docs/reasons.md.

    A row is a table line whose first cell is a backticked code (``broken_chain:<cid>``); the
    code is its text up to the first ``:`` or ``<``. The section is the ``##`` heading above it."""
    out: dict[tuple[str, str], str] = {}
    section = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            titles = dict(_SECTIONS)
            assert line[3:].strip() in titles, f"unknown section heading in docs/reasons.md: {line!r}"
            section = titles[line[3:].strip()]
            continue
        match = re.match(r"\|\s*`([^`]+)`\s*\|", line)
        if match:
            assert section, f"a table row before the first section: {line!r}"
            code = re.split(r"[:<]", match.group(1), maxsplit=1)[0].strip()
            assert (section, code) not in out, f"listed twice in one section: {code}"
            out[(section, code)] = line
    return out


def test_extractor_sees_known_forms():
    """Each production form yields the codes it is known to produce (so the scan cannot go blind)."""
    codes = source_codes()
    ledger: dict[str, set[str]] = {}
    for m, found in codes.items():
        if m.startswith("ledger"):
            for code, forms in found.items():
                ledger.setdefault(code, set()).update(forms)
    store: dict[str, set[str]] = {}
    for m, found in codes.items():
        if m.startswith("store"):
            for code, forms in found.items():
                store.setdefault(code, set()).update(forms)
    trajectory: dict[str, set[str]] = {}
    for m, found in codes.items():
        if m.startswith("trajectory/"):
            for code, forms in found.items():
                trajectory.setdefault(code, set()).update(forms)
    export = {code: forms for m, found in codes.items() if m.startswith("export/") for code, forms in found.items()}
    # f-strings appended to ``reasons``, and problems returned by the loader
    assert {
        "broken_chain",
        "dangling_intent",
        "missing_parent",
        "marked_incomplete",
        "conflicting_payloads",
    } <= store.keys()
    assert {"unreadable", "vanished"} <= store.keys()
    assert store["unreadable"] == {"return None, reason"}
    # lineage answers, a conditional included
    assert {"no_match", "ambiguous", "malformed_request", "digest_mismatch"} <= store.keys()
    assert {"retired", "no_match", "ambiguous"} <= ledger.keys()
    # the ledger's constants
    assert {
        "conflicting_ledger_rows",
        "missing_parent_row",
        "request_finished_without_staged_coordinates",
    } <= ledger.keys()
    # the trajectory builder: fail(kind, cid[, reason]) and a loop over ("roots", "chains")
    assert {
        "duplicate_call_id_conflict",
        "not_contiguous",
        "missing_resolution",
        "roots",
        "chains",
    } <= trajectory.keys()
    assert "parent_digest_mismatch" not in trajectory  # a metrics kind, reported as not_contiguous
    assert {"capture_incomplete", "gym_output_unmatched", "no_generated_tokens"} <= trajectory.keys()
    assert {"no_trajectory", "misaligned_trajectory", "masked"} <= export.keys()
    for module in codes.values():
        for code in module:
            assert _CODE.match(code), code


def test_table_lists_every_reason_code():
    listed = {key for key in doc_codes() if key[0] != "gym"}
    produced = produced_codes()
    missing = sorted(
        f"{section}: {code} (from {', '.join(produced[section, code])})" for section, code in produced.keys() - listed
    )
    assert not missing, f"docs/reasons.md lacks reason codes the code produces: {missing}"
    stale = sorted(f"{section}: {code}" for section, code in listed - produced.keys())
    assert not stale, f"docs/reasons.md lists codes nothing produces any more: {stale}"


def test_table_lists_gyms_manifest_reason_codes():
    records = pytest.importorskip("nemo_gym.token_id_capture.records")
    staging = pytest.importorskip("nemo_gym.token_id_capture.staging.records")
    theirs = {
        value
        for module in (records, staging)
        for name, value in vars(module).items()
        if name.endswith("_REASON") and isinstance(value, str)
    }
    listed = {code for section, code in doc_codes() if section == "gym"}
    assert sorted(theirs - listed) == [] and sorted(listed - theirs) == []
    # s3capture reproduces the ones it writes itself
    ours = importlib.import_module("s3capture.ledger_records")
    assert ours.UNCOMMITTED_CALL_REASON in theirs


def test_doc_parser_sees_every_table():
    """The parser reads every section's rows (a table it could not parse would pass silently)."""
    sections = {section for section, _ in doc_codes()}
    assert sections == {tag for _, tag in _SECTIONS}
