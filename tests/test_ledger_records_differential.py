"""Differential test: ``s3capture.ledger_records`` against NeMo Gym 0.7.0's pydantic ledger records.

The contract: on JSON-shaped input (dicts, lists, str, int including huge ints, float including NaN
and infinity, bool, None) every record Gym's models accept (``Model.model_validate(d)``) s3capture
accepts with the same values (``to_wire(validate_x(d)) == model.model_dump(mode="json")``, compared
type-strictly: ``2`` is not ``2.0``), and every record Gym rejects s3capture rejects with
``RecordError``. The JSON path is checked the same way (``validate_x(text)`` against
``Model.model_validate_json(text)``) on valid JSON, as bytes and as ``str``.

Generated inputs are half valid records (obeying ``CallRecord``'s cross-field rules) and half
mutations that break, or probe, exactly one thing: a wrong type, a bool or float for an int, ``2.0``
or ``"2"`` for a literal version, negative and huge ints, empty and non-UTF-8-encodable strings, bad
digests, unknown and missing fields, non-finite or int or bool ``admitted_at``, ``None`` for a field,
a bad mode, a broken length rule, a bad ``staging_chain`` or ``request_items`` element, a bad nested
record, and manifests holding a bad record or failure. Some mutations are accepted by both (``2.0``
for ``schema_version``, an int ``admitted_at``): the test never assumes the verdict, it compares it.

Not compared, on purpose: a top-level ``str`` in the Python path (``validate_x`` reads a str as
JSON text, Gym's ``model_validate`` refuses it; the JSON tests cover str input); ``NaN``/``Infinity``
literals in JSON text (not JSON: Gym's parser takes them in free-form items, s3capture refuses
them); JSON nested deeper than Gym's parser limit (~200 levels); Python ints over CPython's
4300-digit str limit (``to_wire`` cannot encode them; no JSON text can carry them to either side).

Gym comes from ``require_gym()`` (skip without it locally, fail under ``CI``), resolved in a
module-scoped fixture before hypothesis draws anything. Hypothesis: ``max_examples`` 400 per Python
property and 200 per model for JSON text, ``deadline=None``; the whole file takes ~10 s of CPU.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from gymcompat import require_gym
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s3capture.ledger_records import (
    to_wire,
    validate_call_record,
    validate_commit,
    validate_failure,
    validate_manifest,
)
from s3capture.records import RecordError


@pytest.fixture(scope="module")
def gym_records() -> Any:
    """Gym's ``staging.records`` module via ``require_gym()``, resolved before hypothesis draws."""
    gym = require_gym()
    return importlib.import_module(f"{gym.__name__}.staging.records")


SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NESTED_SETTINGS = settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

JSON_SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

VALIDATORS: dict[str, Callable[[Any], Any]] = {
    "CallRecord": validate_call_record,
    "CaptureLedgerCommit": validate_commit,
    "ManifestFailure": validate_failure,
    "RolloutManifest": validate_manifest,
}

# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


class Rejected:
    """A verdict: the implementation refused the input (``error`` says why)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"Rejected({type(self.error).__name__}: {str(self.error)[:300]})"


def gym_verdict(model: Any, value: Any, *, from_json: bool = False) -> Any:
    """Gym's dump of ``value``, or ``Rejected`` (pydantic's ``ValidationError`` is a ``ValueError``)."""
    try:
        obj = model.model_validate_json(value) if from_json else model.model_validate(value)
    except ValueError as error:
        return Rejected(error)
    return obj.model_dump(mode="json")


def ours_verdict(name: str, value: Any) -> Any:
    """s3capture's wire dump of ``value``, or ``Rejected``; any exception but ``RecordError`` propagates."""
    try:
        record = VALIDATORS[name](value)
    except RecordError as error:
        return Rejected(error)
    return to_wire(record)


def same_data(a: Any, b: Any) -> bool:
    """Type-strict deep equality of JSON-compatible data (``2 != 2.0``, ``0.0 != -0.0``, NaN == NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_data(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_data(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


def assert_same_verdict(gym_records: Any, name: str, value: Any, *, from_json: bool = False) -> Any:
    """Assert both accept with type-identical dumps, or both reject; return Gym's verdict."""
    theirs = gym_verdict(getattr(gym_records, name), value, from_json=from_json)
    ours = ours_verdict(name, value)
    if isinstance(theirs, Rejected) or isinstance(ours, Rejected):
        assert isinstance(theirs, Rejected) and isinstance(ours, Rejected), (
            f"{name}: acceptance differs for {value!r}\n  gym:       {theirs!r}\n  s3capture: {ours!r}"
        )
    else:
        assert same_data(ours, theirs), (
            f"{name}: values differ for {value!r}\n  gym:       {theirs!r}\n  s3capture: {ours!r}"
        )
    return theirs


# ---------------------------------------------------------------------------------------------
# Valid records
# ---------------------------------------------------------------------------------------------

HUGE_INTS = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, 10**30, 10**400]
identifiers = st.text(min_size=1, max_size=10)
hex_digests = st.binary(min_size=32, max_size=32).map(bytes.hex)
counts = st.one_of(st.integers(0, 2**20), st.sampled_from([0, *HUGE_INTS]))
positive_counts = st.one_of(st.integers(1, 2**20), st.sampled_from(HUGE_INTS))


@functools.cache
def finite_floats() -> st.SearchStrategy[float]:
    return st.one_of(
        st.floats(allow_nan=False, allow_infinity=False),
        st.floats(min_value=1e9, max_value=2e9),  # epoch seconds
        st.sampled_from([0.0, -0.0, 5e-324, 1.7976931348623157e308]),
    )


@functools.cache
def json_values(*, nan: bool) -> st.SearchStrategy[Any]:
    """Arbitrary JSON-shaped data for ``request_items``; NaN/infinity only when ``nan``."""
    floats = st.floats(allow_nan=nan, allow_infinity=nan)
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.sampled_from(HUGE_INTS),
        floats,
        st.text(max_size=8),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
        max_leaves=8,
    )


CALL_OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    "schema_version": st.sampled_from([2, 2.0]),
    "digest_version": st.sampled_from([2, 2.0]),
    "extras_digest_version": st.sampled_from([1, 1.0]),
    "admitted_at": st.one_of(st.none(), finite_floats(), st.integers(-(2**70), 2**70)),
    "output_fingerprint": st.one_of(st.none(), hex_digests),
    "continuation_fingerprint": st.one_of(st.none(), hex_digests),
    "fingerprint_version": counts,
}


@st.composite
def call_records(draw: st.DrawFn, root: bool | None = None) -> dict[str, Any]:
    """A valid ``CallRecord`` dict (a root, a child, or either); optional fields present or absent."""
    if root is None:
        root = draw(st.booleans())
    prev_len = 0 if root else draw(positive_counts)
    delta_len = draw(positive_counts)
    record: dict[str, Any] = {
        "model_call_id": draw(identifiers),
        "prev_len": prev_len,
        "delta_len": delta_len,
        "cum_len": prev_len + delta_len,
        "weight_version": draw(counts),
        "digest": draw(hex_digests),
        "extras_digest": draw(hex_digests),
        "staging_key": draw(identifiers),
        "chain_hash": draw(hex_digests),
        "cumulative_hash": draw(hex_digests),
        "response_id": draw(identifiers),
    }
    if root:
        record["mode"] = "text"
        if draw(st.booleans()):
            record["parent_call_id"] = None
    else:
        record["parent_call_id"] = draw(identifiers)
        if draw(st.booleans()):  # the default mode is token_in
            record["mode"] = "token_in"
    for name, values in CALL_OPTIONAL.items():
        if draw(st.booleans()):
            record[name] = draw(values)
    keys = list(record)
    order = draw(st.permutations(keys))
    return {key: record[key] for key in order}


@functools.cache
def item_lists(*, nan: bool) -> st.SearchStrategy[list[dict]]:
    return st.lists(st.dictionaries(st.text(max_size=6), json_values(nan=nan), max_size=3), max_size=3)


@st.composite
def commits(draw: st.DrawFn, *, nan: bool = True) -> dict[str, Any]:
    commit: dict[str, Any] = {
        "rollout_id": draw(identifiers),
        "record": draw(call_records()),
        "request_items": draw(item_lists(nan=nan)),
        "response_items": draw(item_lists(nan=nan)),
    }
    if draw(st.booleans()):
        commit["staging_chain"] = draw(st.lists(identifiers, max_size=4))
    if draw(st.booleans()):
        commit["schema_version"] = draw(st.sampled_from([2, 2.0]))
    return commit


@st.composite
def failures(draw: st.DrawFn) -> dict[str, Any]:
    failure: dict[str, Any] = {"model_call_id": draw(identifiers), "reason": draw(identifiers)}
    if draw(st.booleans()):
        failure["schema_version"] = draw(st.sampled_from([2, 2.0]))
    return failure


@st.composite
def manifests(draw: st.DrawFn) -> dict[str, Any]:
    manifest: dict[str, Any] = {"rollout_id": draw(identifiers)}
    if draw(st.booleans()):
        manifest["records"] = draw(st.lists(call_records(), max_size=3))
    if draw(st.booleans()):
        manifest["failures"] = draw(st.lists(failures(), max_size=3))
    if draw(st.booleans()):
        manifest["schema_version"] = draw(st.sampled_from([2, 2.0]))
    return manifest


# ---------------------------------------------------------------------------------------------
# Mutations: each breaks (or probes) exactly one thing of a valid record
# ---------------------------------------------------------------------------------------------

LONE_SURROGATES = ["\ud800", "a\udfff", "\udc80id", "\ud83d\ude00"]  # the last: a pair, as two code points
CALL_IDENTIFIERS = ["model_call_id", "parent_call_id", "staging_key", "response_id"]
CALL_COUNTS = ["prev_len", "delta_len", "cum_len", "weight_version", "fingerprint_version"]
CALL_DIGESTS = [
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
    "output_fingerprint",
    "continuation_fingerprint",
]
CALL_FIELDS = [
    "schema_version",
    "digest_version",
    "extras_digest_version",
    *CALL_IDENTIFIERS,
    *CALL_COUNTS,
    *CALL_DIGESTS,
    "mode",
    "admitted_at",
]
COMMIT_FIELDS = ["schema_version", "rollout_id", "record", "staging_chain", "request_items", "response_items"]
FAILURE_FIELDS = ["schema_version", "model_call_id", "reason"]
MANIFEST_FIELDS = ["schema_version", "rollout_id", "records", "failures"]


@functools.cache
def literal_quirks(expected: int) -> st.SearchStrategy[Any]:
    """Values pydantic's ``Literal[expected]`` accepts besides the int: an equal float, and ``True`` for 1."""
    return st.sampled_from([float(expected), True] if expected == 1 else [float(expected), float(expected)])


@functools.cache
def literal_refused(expected: int, *, nan: bool) -> st.SearchStrategy[Any]:
    """Near misses and wrong types for ``Literal[expected]``."""
    probes: list[Any] = [
        str(expected),
        f"{expected}.0",
        True,
        False,
        None,
        0,
        expected + 1,
        -expected,
        expected + 2**64,
        float(expected) + 2**-50,
        float(expected) - 2**-50,
        [expected],
        {"v": expected},
    ]
    if nan:
        probes += [math.nan, math.inf]
    return st.sampled_from(probes)


@functools.cache
def integral_floats(*, nan: bool) -> st.SearchStrategy[float]:
    """Floats for an int field: integral ones (``3.0``, refused by StrictInt) and any others."""
    return st.one_of(
        st.integers(0, 2**70).map(float),
        st.sampled_from([0.0, -0.0, 1.0, 2.0**64]),
        st.floats(allow_nan=nan, allow_infinity=nan),
    )


negative_ints = st.one_of(st.integers(-(2**70), -1), st.sampled_from([-1, -(2**63), -(2**64), -(10**400)]))
other_counts = st.sampled_from(["1", "0", "", None, [1], {"n": 1}, *HUGE_INTS])
refused_identifiers = st.sampled_from(["", None, 0, 1, True, [], ["id"], {"id": "x"}, 1.5, *LONE_SURROGATES])
odd_identifiers = st.sampled_from([" ", "\n", "\x00", "id\n", "é", "🦀", "\u200b", *LONE_SURROGATES])


@st.composite
def digest_probes(draw: st.DrawFn) -> Any:
    good = draw(hex_digests)
    return draw(
        st.sampled_from(
            [
                good.upper(),
                "A" + good[1:],
                good[:63],
                good + "0",
                good + "\n",
                good[:63] + "\n",
                "\n" + good,
                good + "\r\n",
                good + " ",
                good[:63] + "g",
                good[:63] + "\u0663",  # ARABIC-INDIC DIGIT THREE: a digit, not [0-9]
                good[:63] + "\uff41",  # FULLWIDTH a
                "0x" + good[:62],
                good[:63] + "\ud800",
                "",
                None,
                0,
                int(good, 16),
                [good],
                good.encode().hex()[:64],  # valid: still 64 lowercase hex characters
            ]
        )
    )


mode_probes = st.sampled_from(["TEXT", "Text", "token-in", "token_in ", " text", "tokens", "", None, 0, True, ["text"]])
non_finite = st.sampled_from([math.nan, -math.nan, math.inf, -math.inf])
admitted_at_numbers = st.one_of(
    st.integers(-(2**64), 2**64),
    st.sampled_from([2**70, -(2**70), 10**400, -(10**400), 2**1023, 2**1024, 0, -0.0, 5e-324, 1.7976931348623157e308]),
)
admitted_at_refused = st.sampled_from([True, False, "1.5", "1700000000", "", [1.0], {"t": 1.0}])


@functools.cache
def top_level_probes(*, nan: bool) -> st.SearchStrategy[Any]:
    """A non-dict in a record's place (no str: ``validate_x(str)`` reads JSON by design; see the JSON tests)."""
    floats = st.floats(allow_nan=nan, allow_infinity=nan)
    return st.one_of(
        st.none(), st.booleans(), st.integers(), floats, st.lists(st.integers(), max_size=2), st.just([{}])
    )


@st.composite
def set_field(
    draw: st.DrawFn, valid: st.SearchStrategy[dict], names: list[str], values: st.SearchStrategy[Any]
) -> dict:
    """A valid record with one of ``names`` set (added if absent) to a drawn value."""
    record = dict(draw(valid))
    record[draw(st.sampled_from(names))] = draw(values)
    return record


@st.composite
def drop_field(draw: st.DrawFn, valid: st.SearchStrategy[dict]) -> dict:
    """A valid record missing one of its fields (required or optional)."""
    record = dict(draw(valid))
    if record:
        del record[draw(st.sampled_from(sorted(record)))]
    return record


@st.composite
def extra_field(draw: st.DrawFn, valid: st.SearchStrategy[dict], fields: list[str], *, nan: bool) -> dict:
    """A valid record with one unknown field."""
    record = dict(draw(valid))
    near_misses = [n.upper() for n in fields] + [n + " " for n in fields] + ["extras", "tokens", "_", ""]
    name = draw(st.one_of(st.text(max_size=8), st.sampled_from(near_misses)).filter(lambda n: n not in fields))
    record[name] = draw(json_values(nan=nan))
    return record


def with_one_bad_element(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[list]:
    """A list of ``good`` elements with one ``bad`` element at a drawn position."""
    return st.tuples(st.lists(good, max_size=2), bad, st.lists(good, max_size=1)).map(
        lambda parts: [*parts[0], parts[1], *parts[2]]
    )


def generic_mutations(
    valid: st.SearchStrategy[dict], fields: list[str], identifier_fields: list[str], *, nan: bool
) -> list[st.SearchStrategy[Any]]:
    """The mutations every model gets: versions, identifiers, None, wrong type, missing, extra, non-dict."""
    return [
        set_field(valid, ["schema_version"], literal_quirks(2)),
        set_field(valid, ["schema_version"], literal_refused(2, nan=nan)),
        set_field(valid, identifier_fields, refused_identifiers),
        set_field(valid, identifier_fields, odd_identifiers),
        set_field(valid, fields, st.none()),
        set_field(valid, fields, json_values(nan=nan)),
        drop_field(valid),
        extra_field(valid, fields, nan=nan),
        top_level_probes(nan=nan),
    ]


@st.composite
def length_rule_mutation(draw: st.DrawFn, rule: str) -> dict[str, Any]:
    """A ``CallRecord`` breaking one cross-field rule (or, for ``child_mode_default``, relying on a default)."""
    root = rule.startswith("root")
    record = dict(draw(call_records(root=root)))
    if rule.endswith("empty_delta"):
        record["delta_len"] = 0
        record["cum_len"] = record["prev_len"]
    elif rule.endswith("cum_off"):
        record["cum_len"] = max(0, record["cum_len"] + draw(st.sampled_from([-1, 1, 2**64])))
    elif rule == "child_negative_delta":
        record["delta_len"] = -draw(st.integers(1, record["prev_len"]))  # sums still match: only ge=0 refuses
        record["cum_len"] = record["prev_len"] + record["delta_len"]
    elif rule == "root_prev":
        record["prev_len"] = draw(positive_counts)
        record["cum_len"] = record["prev_len"] + record["delta_len"]
    elif rule == "child_prev0":
        record["prev_len"] = 0
        record["cum_len"] = record["delta_len"]
    elif rule == "root_parent":
        record["parent_call_id"] = draw(identifiers)
    elif rule == "child_orphan":
        if draw(st.booleans()):
            record["parent_call_id"] = None
        else:
            del record["parent_call_id"]
    elif rule.endswith("mode_default"):
        record.pop("mode", None)  # the default token_in: wrong for a root, right for a child
    elif rule.endswith("mode_swap"):
        record["mode"] = "token_in" if root else "text"
    else:
        raise AssertionError(rule)
    return record


LENGTH_RULES = [
    "root_empty_delta",
    "child_empty_delta",
    "root_cum_off",
    "child_cum_off",
    "child_negative_delta",
    "root_prev",
    "child_prev0",
    "root_parent",
    "child_orphan",
    "root_mode_default",
    "child_mode_default",
    "root_mode_swap",
    "child_mode_swap",
]


@functools.cache
def mutated_call_records(*, nan: bool = True) -> st.SearchStrategy[Any]:
    valid = call_records()
    return st.one_of(
        *generic_mutations(valid, CALL_FIELDS, CALL_IDENTIFIERS, nan=nan),
        set_field(valid, ["digest_version"], st.one_of(literal_quirks(2), literal_refused(2, nan=nan))),
        set_field(valid, ["extras_digest_version"], literal_quirks(1)),
        set_field(valid, ["extras_digest_version"], literal_refused(1, nan=nan)),
        set_field(valid, CALL_COUNTS, st.booleans()),
        set_field(valid, CALL_COUNTS, integral_floats(nan=nan)),
        set_field(valid, CALL_COUNTS, negative_ints),
        set_field(valid, ["weight_version", "fingerprint_version"], negative_ints),
        set_field(valid, CALL_COUNTS, other_counts),
        set_field(valid, CALL_DIGESTS, digest_probes()),
        # Python's ``$`` matches before a trailing newline; pydantic's (Rust) pattern does not.
        set_field(valid, CALL_DIGESTS, hex_digests.map(lambda good: good + "\n")),
        set_field(valid, ["mode"], mode_probes),
        *([set_field(valid, ["admitted_at"], non_finite)] if nan else []),
        set_field(valid, ["admitted_at"], admitted_at_numbers),
        set_field(valid, ["admitted_at"], admitted_at_refused),
        set_field(
            valid, ["output_fingerprint", "continuation_fingerprint", "admitted_at", "parent_call_id"], st.none()
        ),
        *(length_rule_mutation(rule) for rule in LENGTH_RULES),
    )


@functools.cache
def mutated_failures(*, nan: bool = True) -> st.SearchStrategy[Any]:
    return st.one_of(*generic_mutations(failures(), FAILURE_FIELDS, ["model_call_id", "reason"], nan=nan))


@functools.cache
def mutated_commits(*, nan: bool = True) -> st.SearchStrategy[Any]:
    valid = commits(nan=nan)
    items = ["request_items", "response_items"]
    not_a_dict = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2))
    return st.one_of(
        *generic_mutations(valid, COMMIT_FIELDS, ["rollout_id"], nan=nan),
        set_field(valid, ["record"], mutated_call_records(nan=nan)),
        set_field(valid, ["record"], st.one_of(top_level_probes(nan=nan), st.just("{}"))),
        set_field(valid, ["staging_chain"], with_one_bad_element(identifiers, refused_identifiers)),
        set_field(valid, ["staging_chain"], with_one_bad_element(identifiers, odd_identifiers)),
        set_field(valid, ["staging_chain"], st.sampled_from([None, "a", "", {"a": "b"}, 1, True])),
        set_field(
            valid,
            items,
            with_one_bad_element(st.dictionaries(st.text(max_size=4), json_values(nan=nan), max_size=2), not_a_dict),
        ),
        set_field(valid, items, st.sampled_from([None, {}, {"a": 1}, "[]", 0, True])),
    )


@functools.cache
def mutated_manifests(*, nan: bool = True) -> st.SearchStrategy[Any]:
    valid = manifests()
    return st.one_of(
        *generic_mutations(valid, MANIFEST_FIELDS, ["rollout_id"], nan=nan),
        set_field(valid, ["records"], with_one_bad_element(call_records(), mutated_call_records(nan=nan))),
        set_field(valid, ["failures"], with_one_bad_element(failures(), mutated_failures(nan=nan))),
        set_field(valid, ["records", "failures"], st.sampled_from([None, {}, "[]", 0, [None], [[]], ["x"]])),
    )


VALID = {
    "CallRecord": lambda nan: call_records(),
    "CaptureLedgerCommit": lambda nan: commits(nan=nan),
    "ManifestFailure": lambda nan: failures(),
    "RolloutManifest": lambda nan: manifests(),
}
MUTATED = {
    "CallRecord": mutated_call_records,
    "CaptureLedgerCommit": mutated_commits,
    "ManifestFailure": mutated_failures,
    "RolloutManifest": mutated_manifests,
}


def inputs(name: str, *, nan: bool = True) -> st.SearchStrategy[Any]:
    """Half valid records of model ``name``, half single mutations of one."""
    return st.one_of(VALID[name](nan), MUTATED[name](nan=nan))


# ---------------------------------------------------------------------------------------------
# Differential properties: Python values
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(value=inputs("CallRecord"))
def test_call_record_matches_gym(gym_records: Any, value: Any) -> None:
    assert_same_verdict(gym_records, "CallRecord", value)


@NESTED_SETTINGS
@given(value=inputs("CaptureLedgerCommit"))
def test_commit_matches_gym(gym_records: Any, value: Any) -> None:
    assert_same_verdict(gym_records, "CaptureLedgerCommit", value)


@SETTINGS
@given(value=inputs("ManifestFailure"))
def test_failure_matches_gym(gym_records: Any, value: Any) -> None:
    assert_same_verdict(gym_records, "ManifestFailure", value)


@NESTED_SETTINGS
@given(value=inputs("RolloutManifest"))
def test_manifest_matches_gym(gym_records: Any, value: Any) -> None:
    assert_same_verdict(gym_records, "RolloutManifest", value)


# ---------------------------------------------------------------------------------------------
# Differential properties: JSON text
# ---------------------------------------------------------------------------------------------

# JSON spellings json.dumps never writes, substituted for one value of a valid record.
NUMBER_TOKENS = [
    "2",
    "2.0",
    "2e0",
    "20e-1",
    "2.00000000000000001",
    "1",
    "1.0",
    "1E0",
    "-0",
    "-0.0",
    "0",
    "1e2",
    "100.0",
    "-1",
    "1" + "0" * 30,
    "1" + "0" * 400,
    "1" + "0" * 5000,  # an int past CPython's and jiter's 4300-digit limit
    "1e-400",
    "1700000000.5",
]
OTHER_TOKENS = [
    "true",
    "false",
    "null",
    '""',
    '"\\u0000"',
    '"a\\nb"',
    '"\\ud83d\\ude00"',
    '"\\ud800"',
    '"\\u0030"',
    "[]",
    "{}",
    '"text"',
    '"token_in"',
]
# Valid JSON numbers beyond a double: pydantic reads them as infinity (kept in items, refused in floats).
OVERFLOW_TOKENS = ["1e400", "-1e400", "1" + "0" * 500 + ".5", "-1.0e309"]
raw_tokens = st.one_of(st.sampled_from(NUMBER_TOKENS), st.sampled_from(OVERFLOW_TOKENS), st.sampled_from(OTHER_TOKENS))
PLACEHOLDER = "\u2603placeholder\u2603"


@st.composite
def with_placeholder(draw: st.DrawFn, name: str) -> dict:
    """A valid record of model ``name`` with ``PLACEHOLDER`` at one of its fields, nested fields or items."""
    record = dict(draw(VALID[name](False)))
    target, fields = (
        record,
        {
            "CallRecord": CALL_FIELDS,
            "CaptureLedgerCommit": COMMIT_FIELDS,
            "ManifestFailure": FAILURE_FIELDS,
            "RolloutManifest": MANIFEST_FIELDS,
        }[name],
    )
    where = draw(st.sampled_from(["top", "nested", "item"]))
    if name == "CaptureLedgerCommit" and where == "nested":
        target = record["record"] = dict(record["record"])
        fields = CALL_FIELDS
    elif name == "CaptureLedgerCommit" and where == "item":
        target = {}
        record["request_items"] = [*record["request_items"], target]
        fields = ["x"]
    elif name == "RolloutManifest" and where != "top":
        nested, strategy, fields = (
            ("records", call_records(), CALL_FIELDS) if where == "nested" else ("failures", failures(), FAILURE_FIELDS)
        )
        target = dict(draw(strategy))
        record[nested] = [*record.get(nested, []), target]
    target[draw(st.sampled_from(fields))] = PLACEHOLDER
    return record


@st.composite
def json_texts(draw: st.DrawFn, name: str) -> str | bytes:
    """JSON text (str or UTF-8 bytes) of a valid or mutated record of model ``name``; no NaN or infinity."""
    raw = None
    if draw(st.integers(0, 2)) == 0:
        value = draw(with_placeholder(name))
        raw = draw(raw_tokens)
    else:
        value = draw(inputs(name, nan=False))
    text = json.dumps(
        value, allow_nan=False, ensure_ascii=draw(st.booleans()), separators=draw(st.sampled_from([None, (",", ":")]))
    )
    if raw is not None:
        text = text.replace(json.dumps(PLACEHOLDER, ensure_ascii=False), raw).replace(json.dumps(PLACEHOLDER), raw)
    if draw(st.booleans()):
        return text.encode("utf-8", "surrogatepass")  # a lone surrogate becomes invalid UTF-8
    return text


@JSON_SETTINGS
@pytest.mark.parametrize("name", sorted(VALIDATORS))
@given(data=st.data())
def test_json_text_matches_gym(gym_records: Any, name: str, data: st.DataObject) -> None:
    text = data.draw(json_texts(name), label="json_text")
    assert_same_verdict(gym_records, name, text, from_json=True)


# ---------------------------------------------------------------------------------------------
# Pinned examples: the trickiest cases, each checked against Gym and against the expected verdict
# ---------------------------------------------------------------------------------------------

HEX = "0123456789abcdef" * 4


def root_record(**changes: Any) -> dict[str, Any]:
    record = {
        "model_call_id": "call-1",
        "prev_len": 0,
        "delta_len": 3,
        "cum_len": 3,
        "weight_version": 0,
        "digest": HEX,
        "extras_digest": HEX,
        "staging_key": "rollout/call-1",
        "mode": "text",
        "chain_hash": HEX,
        "cumulative_hash": HEX,
        "response_id": "resp-1",
    }
    record.update(changes)
    return record


def both_reject(gym_records: Any, name: str, value: Any, *, from_json: bool = False) -> None:
    assert isinstance(assert_same_verdict(gym_records, name, value, from_json=from_json), Rejected)


def both_accept(gym_records: Any, name: str, value: Any, *, from_json: bool = False) -> dict:
    dump = assert_same_verdict(gym_records, name, value, from_json=from_json)
    assert not isinstance(dump, Rejected), dump
    return dump


@pytest.mark.parametrize("field", ["digest", "extras_digest", "chain_hash", "cumulative_hash", "output_fingerprint"])
def test_digest_with_trailing_newline_rejected_by_both(gym_records: Any, field: str) -> None:
    record = root_record(**{field: HEX + "\n"})
    both_reject(gym_records, "CallRecord", record)
    both_reject(gym_records, "CallRecord", json.dumps(record).encode(), from_json=True)


def test_float_schema_version_accepted_by_both_and_dumped_as_int(gym_records: Any) -> None:
    record = root_record(schema_version=2.0, digest_version=2.0, extras_digest_version=1.0)
    dump = both_accept(gym_records, "CallRecord", record)
    assert [(dump[k], type(dump[k])) for k in ("schema_version", "digest_version", "extras_digest_version")] == [
        (2, int),
        (2, int),
        (1, int),
    ]
    commit = {"schema_version": 2.0, "rollout_id": "r", "record": record, "request_items": [], "response_items": []}
    assert type(both_accept(gym_records, "CaptureLedgerCommit", commit)["schema_version"]) is int
    manifest = {
        "schema_version": 2.0,
        "rollout_id": "r",
        "records": [record],
        "failures": [{"schema_version": 2.0, "model_call_id": "c", "reason": "x"}],
    }
    dump = both_accept(gym_records, "RolloutManifest", manifest)
    assert type(dump["records"][0]["schema_version"]) is int and type(dump["failures"][0]["schema_version"]) is int
    both_accept(gym_records, "CallRecord", json.dumps(record).encode(), from_json=True)


def test_string_schema_version_rejected_by_both(gym_records: Any) -> None:
    both_reject(gym_records, "CallRecord", root_record(schema_version="2"))
    both_reject(gym_records, "ManifestFailure", {"schema_version": "2", "model_call_id": "c", "reason": "x"})


def test_true_for_literal_one_accepted_by_both(gym_records: Any) -> None:
    """pydantic's ``Literal[1]`` takes ``True`` (``True == 1``) and stores 1; ``Literal[2]`` refuses it."""
    dump = both_accept(gym_records, "CallRecord", root_record(extras_digest_version=True))
    assert dump["extras_digest_version"] == 1 and type(dump["extras_digest_version"]) is int
    both_accept(gym_records, "CallRecord", json.dumps(root_record(extras_digest_version=True)), from_json=True)
    both_reject(gym_records, "CallRecord", root_record(schema_version=True))
    both_reject(gym_records, "CallRecord", root_record(extras_digest_version=False))


@pytest.mark.parametrize("admitted_at", [1_700_000_000, 0, -5, 2**70])
def test_int_admitted_at_accepted_by_both_as_float(gym_records: Any, admitted_at: int) -> None:
    dump = both_accept(gym_records, "CallRecord", root_record(admitted_at=admitted_at))
    assert dump["admitted_at"] == float(admitted_at) and type(dump["admitted_at"]) is float
    dump = both_accept(gym_records, "CallRecord", json.dumps(root_record(admitted_at=admitted_at)), from_json=True)
    assert type(dump["admitted_at"]) is float


@pytest.mark.parametrize("admitted_at", [math.nan, math.inf, -math.inf, 10**400, True, "1.5"])
def test_bad_admitted_at_rejected_by_both(gym_records: Any, admitted_at: Any) -> None:
    both_reject(gym_records, "CallRecord", root_record(admitted_at=admitted_at))


@pytest.mark.parametrize("field", ["prev_len", "delta_len", "cum_len", "weight_version", "fingerprint_version"])
@pytest.mark.parametrize("value", [True, False, 3.0, 0.0])
def test_bool_or_float_for_int_rejected_by_both(gym_records: Any, field: str, value: Any) -> None:
    both_reject(gym_records, "CallRecord", root_record(**{field: value}))


@pytest.mark.parametrize("huge", [2**63, 2**64, 2**70, 10**400])
def test_huge_int_accepted_by_both(gym_records: Any, huge: int) -> None:
    record = root_record(delta_len=huge, cum_len=huge, weight_version=huge, fingerprint_version=huge)
    dump = both_accept(gym_records, "CallRecord", record)
    assert dump["cum_len"] == huge and type(dump["cum_len"]) is int
    child = root_record(parent_call_id="p", mode="token_in", prev_len=huge, delta_len=huge, cum_len=2 * huge)
    both_accept(gym_records, "CallRecord", child)
    if huge < 10**100:
        both_accept(gym_records, "CallRecord", json.dumps(child).encode(), from_json=True)


@pytest.mark.parametrize("surrogate", LONE_SURROGATES)
def test_unencodable_identifier_rejected_by_both(gym_records: Any, surrogate: str) -> None:
    """pydantic refuses a str that is not valid Unicode (a lone surrogate); so must s3capture."""
    both_reject(gym_records, "CallRecord", root_record(response_id=surrogate))
    both_reject(gym_records, "ManifestFailure", {"model_call_id": "c", "reason": surrogate})
    commit = {
        "rollout_id": "r",
        "record": root_record(),
        "staging_chain": ["a", surrogate],
        "request_items": [],
        "response_items": [],
    }
    both_reject(gym_records, "CaptureLedgerCommit", commit)
    # As JSON text passed as str, the surrogate cannot even be encoded: a RecordError, not a UnicodeEncodeError.
    both_reject(
        gym_records, "CallRecord", json.dumps(root_record(response_id=surrogate), ensure_ascii=False), from_json=True
    )


def test_overflowing_json_number_in_items_accepted_by_both(gym_records: Any) -> None:
    """``1e400`` is valid JSON; pydantic reads it as infinity, which a free-form item keeps (dumped as null)."""
    commit = {"rollout_id": "r", "record": root_record(), "request_items": [{"x": PLACEHOLDER}], "response_items": []}
    text = json.dumps(commit).replace(json.dumps(PLACEHOLDER), "1e400").encode()
    dump = both_accept(gym_records, "CaptureLedgerCommit", text, from_json=True)
    assert dump["request_items"] == [{"x": None}]
    # ... but not in admitted_at, which must be finite.
    text = json.dumps(root_record(admitted_at=PLACEHOLDER)).replace(json.dumps(PLACEHOLDER), "-1e400").encode()
    both_reject(gym_records, "CallRecord", text, from_json=True)


def test_cross_field_rules_rejected_by_both(gym_records: Any) -> None:
    both_reject(gym_records, "CallRecord", root_record(delta_len=0, cum_len=0))
    both_reject(gym_records, "CallRecord", root_record(cum_len=4))
    both_reject(gym_records, "CallRecord", root_record(prev_len=1, cum_len=4))
    both_reject(gym_records, "CallRecord", root_record(mode="token_in"))
    both_reject(gym_records, "CallRecord", {k: v for k, v in root_record().items() if k != "mode"})
    both_reject(gym_records, "CallRecord", root_record(parent_call_id="p"))
    both_reject(gym_records, "CallRecord", root_record(parent_call_id="p", mode="token_in"))  # prev_len 0
    both_reject(gym_records, "CallRecord", root_record(parent_call_id="p", prev_len=2, cum_len=5))  # text mode
    child = root_record(parent_call_id="p", prev_len=2, cum_len=5)
    del child["mode"]
    both_accept(gym_records, "CallRecord", child)


def test_differential_check_detects_a_difference(gym_records: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: a validator too lenient, or one whose dump differs only in type, is caught."""
    assert not same_data({"a": 2}, {"a": 2.0})
    assert not same_data({"a": 0.0}, {"a": -0.0})
    assert not same_data([{"a": 1}], [{"a": 1, "b": None}])

    def lenient(value: Any) -> Any:  # strips the newline pydantic refuses
        return validate_call_record({**value, "digest": value["digest"].rstrip("\n")})

    monkeypatch.setitem(VALIDATORS, "CallRecord", lenient)
    with pytest.raises(AssertionError, match="acceptance differs"):
        assert_same_verdict(gym_records, "CallRecord", root_record(digest=HEX + "\n"))

    def int_timestamps(value: Any) -> Any:  # keeps an int admitted_at an int
        return msgspec.structs.replace(validate_call_record(value), admitted_at=value["admitted_at"])

    monkeypatch.setitem(VALIDATORS, "CallRecord", int_timestamps)
    with pytest.raises(AssertionError, match="values differ"):
        assert_same_verdict(gym_records, "CallRecord", root_record(admitted_at=1_700_000_000))
