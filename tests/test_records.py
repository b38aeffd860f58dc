"""Records: canonical encoding, validation and NeMo Gym ``TokenEntry`` compatibility (no S3).

Gym-dependent tests call ``require_gym()`` (skip without Gym, fail under ``CI``). Hypothesis
settings: ``deadline=None`` (first calls import pydantic models) and ``max_examples`` between 120 and
200 so every property stays well under ~5 s on a 2-core machine.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import msgspec
import orjson
import pytest

from s3capture.fingerprint import canonical_json
from gymcompat import require_gym
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s3capture.records import (
    TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    ParentResolutionStatus,
    RecordError,
    TokenEntry,
    UnsupportedSchemaError,
    coerce_entry,
    compute_digest,
    cumulative_tokens,
    decode_entry,
    encode_entry,
    to_gym,
)


@pytest.fixture(scope="module")
def gym() -> Any:
    """``nemo_gym.token_id_capture`` via ``require_gym()``, resolved before hypothesis starts drawing."""
    return require_gym()


MEDIUM = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

KNOWN_FIELDS = frozenset(TokenEntry.__struct_fields__)
U64_MAX = 2**64 - 1

# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

# Finite floats. msgspec and orjson agree on every finite float's digits; they differ only in how a
# positive exponent is spelled (msgspec ``1e16``, orjson ``1e+16``), which starts at |x| >= 1e16.
# The differential test against Gym's orjson bytes therefore draws below that bound; the
# exponent case is pinned separately by ``test_encode_entry_positive_exponent_matches_gym``.
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
plain_floats = st.floats(min_value=-(1e16 - 2), max_value=1e16 - 2, allow_nan=False, allow_infinity=False)
small_floats = st.floats(min_value=-1e-3, max_value=1e-3, allow_nan=False, allow_infinity=False)
logprobs = st.one_of(plain_floats, small_floats, st.floats(max_value=0.0, min_value=-1e4, allow_nan=False))
token_ids = st.one_of(st.integers(0, 300_000), st.integers(0, U64_MAX))
short_text = st.text(max_size=12)
ids = st.text(min_size=1, max_size=16)


def json_values(floats: st.SearchStrategy[float] = plain_floats) -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        floats,
        short_text,
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(short_text, inner, max_size=4),
        ),
        max_leaves=12,
    )


extra_keys = short_text.filter(lambda k: k not in KNOWN_FIELDS)


@st.composite
def valid_entry_dicts(draw: Any, floats: st.SearchStrategy[float] = plain_floats, extras: bool = True) -> dict:
    """A dict Gym's ``TokenEntry`` accepts (and s3capture must accept), some optional keys omitted."""
    gen_len = draw(st.integers(0, 6))
    output_items = draw(st.lists(st.dictionaries(short_text, json_values(floats), max_size=3), max_size=3))
    status = draw(st.sampled_from([None, *ParentResolutionStatus]))
    d: dict[str, Any] = {
        "rollout_id": draw(ids),
        "model_call_id": draw(ids),
        "prompt_token_ids": draw(st.lists(token_ids, max_size=8)),
        "generation_token_ids": draw(st.lists(token_ids, min_size=gen_len, max_size=gen_len)),
        "generation_log_probs": draw(st.lists(st.one_of(logprobs, floats), min_size=gen_len, max_size=gen_len)),
    }
    optional: dict[str, Any] = {
        "schema_version": TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
        "model": draw(short_text),
        "routed_experts": draw(st.one_of(st.none(), json_values(floats))),
        "output_items": output_items,
        "token_item_index": draw(st.none() | st.integers(0, len(output_items) - 1)) if output_items else None,
        "response_id": draw(st.none() | short_text),
        "created_at": draw(st.one_of(floats, st.integers(0, 2**31))),
        "cum_len": draw(st.none() | st.integers(0, 2**40)),
        "digest": draw(st.none() | st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)),
        "parent_resolution": None if status is None else status.value,
        "continuation_fingerprint": draw(st.sampled_from(["", "a" * 64]) | short_text),
        "continuation_context_len": draw(st.integers(0, 1000)),
        "continuation_context_digest": draw(short_text),
        "parent_resolution_reason": draw(short_text),
        "fingerprint_version": draw(st.none() | st.integers(0, 5)),
        "prefix_requested": draw(st.booleans()),
        "prefix_supplied": draw(st.booleans()),
    }
    if status is ParentResolutionStatus.RESOLVED:
        optional["parent_call_id"] = draw(ids)
        optional["prompt_is_delta"] = draw(st.booleans())
    elif status is None:
        optional["parent_call_id"] = draw(st.none() | short_text)
        optional["prompt_is_delta"] = False
    else:
        optional["parent_call_id"] = None
        optional["prompt_is_delta"] = False
    keep = draw(st.sets(st.sampled_from(sorted(optional))))
    if keep & {"parent_resolution", "parent_call_id", "prompt_is_delta"}:  # lineage keys stay consistent
        keep |= {"parent_resolution", "parent_call_id", "prompt_is_delta"}
    if "token_item_index" in keep:
        keep.add("output_items")
    d.update({k: v for k, v in optional.items() if k in keep})
    if extras:
        d.update(draw(st.dictionaries(extra_keys, json_values(floats), max_size=3)))
    return d


def _set_status(d: dict, status: ParentResolutionStatus | None, parent: Any) -> dict:
    d["parent_resolution"] = None if status is None else status.value
    d["parent_call_id"] = parent
    return d


# Each mutation targets one rule of Gym's validator; the resulting dict is usually invalid, and the
# differential test only requires that Gym and s3capture agree on every one of them.
MUTATIONS = {
    "length_mismatch": lambda d, n: d.update(
        generation_log_probs=list(d.get("generation_log_probs", [])) + [-0.5] * (n % 3 + 1)
    ),
    "length_mismatch_shorter": lambda d, n: d.update(
        generation_token_ids=list(d["generation_token_ids"]) + [7], generation_log_probs=list(d["generation_log_probs"])
    ),
    "index_out_of_range": lambda d, n: d.update(token_item_index=len(d.get("output_items", [])) + n % 4),
    "index_negative": lambda d, n: d.update(token_item_index=-(n % 4) - 1),
    "newer_schema": lambda d, n: d.update(schema_version=TOKEN_ENTRY_RECORD_SCHEMA_VERSION + 1 + n % 1000),
    "older_schema": lambda d, n: d.update(schema_version=-(n % 5)),
    "resolved_without_parent": lambda d, n: _set_status(d, ParentResolutionStatus.RESOLVED, [None, ""][n % 2]),
    "root_with_parent": lambda d, n: _set_status(d, ParentResolutionStatus.ROOT, ["", "p", "parent-1"][n % 3]),
    "unresolved_with_parent": lambda d, n: _set_status(d, ParentResolutionStatus.UNRESOLVED, ["", "p"][n % 2]),
    "delta_without_resolved_parent": lambda d, n: _set_status(
        d, [None, ParentResolutionStatus.ROOT, ParentResolutionStatus.UNRESOLVED][n % 3], None
    ).update(prompt_is_delta=True),
    "delta_none_status_with_parent": lambda d, n: _set_status(d, None, "p").update(prompt_is_delta=True),
    "delta_resolved_ok": lambda d, n: _set_status(d, ParentResolutionStatus.RESOLVED, "p").update(prompt_is_delta=True),
    "missing_required": lambda d, n: d.pop(
        ["rollout_id", "model_call_id", "prompt_token_ids", "generation_token_ids", "generation_log_probs"][n % 5]
    ),
    "bad_status": lambda d, n: d.update(parent_resolution=["ROOT", "parent", "", "Resolved"][n % 4]),
    "null_string_field": lambda d, n: d.update(
        {["rollout_id", "model_call_id", "model", "continuation_fingerprint"][n % 4]: None}
    ),
    "string_for_list": lambda d, n: d.update(
        {["prompt_token_ids", "generation_token_ids", "output_items"][n % 3]: "12"}
    ),
    "non_object_output_item": lambda d, n: d.update(output_items=[1, "x", None, []][n % 4 : n % 4 + 1]),
    "fractional_int": lambda d, n: d.update({["cum_len", "token_item_index", "continuation_context_len"][n % 3]: 1.5}),
    "null_bool": lambda d, n: d.update({["prompt_is_delta", "prefix_requested", "prefix_supplied"][n % 3]: None}),
    "null_created_at": lambda d, n: d.update(created_at=None),
}


@st.composite
def mutated_entry_dicts(draw: Any) -> tuple[str, dict]:
    d = draw(valid_entry_dicts(extras=False))
    name = draw(st.sampled_from(sorted(MUTATIONS)))
    MUTATIONS[name](d, draw(st.integers(0, 10_000)))
    return name, d


def _accepts(fn: Any, value: Any) -> bool:
    try:
        fn(value)
    except (RecordError, ValueError, TypeError, msgspec.ValidationError):
        return False
    return True


def _gym_accepts(gym_entry_cls: Any, d: dict) -> bool:
    from pydantic import ValidationError

    try:
        gym_entry_cls.model_validate(d)
    except ValidationError:
        return False
    return True


def _json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _gym_canonical(gym: Any, d: dict) -> bytes:
    return _json(gym.TokenEntry.model_validate(d).model_dump(mode="json"))


def _base(**overrides: Any) -> dict:
    d = {
        "rollout_id": "r",
        "model_call_id": "c",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3, 4],
        "generation_log_probs": [-0.5, -1.25],
    }
    d.update(overrides)
    return d


# ---------------------------------------------------------------------------------------------
# Canonical encoding
# ---------------------------------------------------------------------------------------------


@MEDIUM
@given(valid_entry_dicts(floats=finite_floats))
def test_canonical_encoding_round_trips(d: dict) -> None:
    entry = coerce_entry(d)
    data = encode_entry(entry)
    again = decode_entry(data)
    assert encode_entry(again) == data
    assert again.model_dump() == entry.model_dump()
    # Canonical form: compact, keys sorted, every known field present.
    parsed = json.loads(data)
    assert list(parsed) == sorted(parsed)
    assert KNOWN_FIELDS <= set(parsed)
    # Compact, sorted, shortest floats, with orjson's "e+NN" spelling of large exponents.
    assert data == canonical_json(parsed).encode()


@MEDIUM
@given(valid_entry_dicts(floats=finite_floats), st.randoms(use_true_random=False))
def test_non_canonical_input_decodes_to_the_same_canonical_bytes(d: dict, rnd: Any) -> None:
    """Key order, whitespace and integer-valued floats in the input do not change the identity."""
    canonical = encode_entry(coerce_entry(d))
    items = list(json.loads(canonical).items())
    rnd.shuffle(items)
    pretty = json.dumps(dict(items), indent=rnd.choice([None, 1, 4]), ensure_ascii=rnd.choice([True, False]))
    assert encode_entry(decode_entry(pretty)) == canonical
    assert encode_entry(decode_entry(pretty.encode())) == canonical


@MEDIUM
@given(
    valid_entry_dicts(floats=finite_floats, extras=False),
    st.dictionaries(extra_keys, json_values(finite_floats), min_size=1, max_size=5),
)
def test_unknown_extra_fields_round_trip_unchanged(d: dict, extras: dict) -> None:
    original = {**d, **copy.deepcopy(extras)}
    entry = decode_entry(json.dumps(original))
    assert entry.extra_fields == extras
    data = encode_entry(entry)
    parsed = json.loads(data)
    for key, value in extras.items():
        assert parsed[key] == value
        # Byte-level: nested values are written back exactly as canonical JSON of the original.
        assert msgspec.json.encode(parsed[key], order="sorted") == msgspec.json.encode(value, order="sorted")
    again = decode_entry(data)
    assert again.extra_fields == extras
    assert encode_entry(again) == data
    # coerce_entry on the dict keeps them too, and model_dump exposes them.
    assert coerce_entry(original).extra_fields == extras
    assert {k: v for k, v in coerce_entry(original).model_dump().items() if k in extras} == extras


def test_extra_field_values_change_the_canonical_bytes() -> None:
    a = encode_entry(coerce_entry(_base(note={"x": [1, 2]})))
    b = encode_entry(coerce_entry(_base(note={"x": [1, 3]})))
    c = encode_entry(coerce_entry(_base()))
    assert len({a, b, c}) == 3
    assert json.loads(a)["note"] == {"x": [1, 2]}


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("bad", [float("-inf"), float("inf"), float("nan")])
def test_non_finite_log_probs_are_refused_not_nulled(index: int, bad: float) -> None:
    probs = [-0.5, -1.0, -2.0]
    probs[index] = bad
    entry = coerce_entry(_base(generation_token_ids=[1, 2, 3], generation_log_probs=probs))
    with pytest.raises(RecordError, match=re.escape(f"generation_log_probs[{index}]")):
        encode_entry(entry)
    # The same entry built directly is refused as well (no silent ``null``).
    direct = TokenEntry(
        rollout_id="r",
        model_call_id="c",
        prompt_token_ids=[],
        generation_token_ids=[1, 2, 3],
        generation_log_probs=probs,
    )
    with pytest.raises(RecordError, match=re.escape(f"generation_log_probs[{index}]")):
        encode_entry(direct)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_created_at_is_refused(bad: float) -> None:
    entry = coerce_entry(_base(created_at=bad))
    with pytest.raises(RecordError, match="created_at"):
        encode_entry(entry)


def test_json_non_finite_literals_are_not_valid_entries() -> None:
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        data = (
            b'{"rollout_id":"r","model_call_id":"c","prompt_token_ids":[],"generation_token_ids":[1],"generation_log_probs":['
            + literal
            + b"]}"
        )
        with pytest.raises(RecordError):
            decode_entry(data)


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b'"x"', b"null", b"1", '{"rollout_id": }'])
def test_decode_entry_refuses_non_entries_with_record_error(data: Any) -> None:
    with pytest.raises(RecordError):
        decode_entry(data)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [2, 3, 100, 2**40])
def test_newer_schema_version_is_refused_naming_the_supported_version(version: int) -> None:
    for attempt in (
        lambda: coerce_entry(_base(schema_version=version)),
        lambda: decode_entry(json.dumps(_base(schema_version=version))),
    ):
        with pytest.raises(UnsupportedSchemaError) as info:
            attempt()
        message = str(info.value)
        assert str(version) in message
        assert re.search(r"supports?\D*\b1\b", message), message
    assert issubclass(UnsupportedSchemaError, RecordError) and issubclass(RecordError, ValueError)


@pytest.mark.parametrize("version", [0, -1])
def test_older_schema_version_is_refused(version: int) -> None:
    with pytest.raises(UnsupportedSchemaError):
        coerce_entry(_base(schema_version=version))


def test_schema_version_defaults_to_one_and_accepts_one() -> None:
    assert coerce_entry(_base()).schema_version == 1
    assert coerce_entry(_base(schema_version=1)).schema_version == 1


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(generation_log_probs=[-0.5]), "same length"),
        (dict(generation_token_ids=[1, 2, 3]), "same length"),
        (dict(token_item_index=0), "token_item_index"),
        (dict(output_items=[{"a": 1}], token_item_index=1), "token_item_index"),
        (dict(output_items=[{"a": 1}], token_item_index=-1), "token_item_index"),
        (dict(parent_resolution="resolved"), "parent_call_id"),
        (dict(parent_resolution="resolved", parent_call_id=""), "parent_call_id"),
        (dict(parent_resolution="root", parent_call_id="p"), "root"),
        (dict(parent_resolution="root", parent_call_id=""), "root"),
        (dict(parent_resolution="unresolved", parent_call_id="p"), "unresolved"),
        (dict(prompt_is_delta=True), "delta"),
        (dict(prompt_is_delta=True, parent_call_id="p"), "delta"),
        (dict(prompt_is_delta=True, parent_resolution="root"), "delta"),
        (dict(prompt_is_delta=True, parent_resolution="unresolved"), "delta"),
        (dict(prompt_token_ids=[-1]), "prompt_token_ids"),
        (dict(generation_token_ids=[-5, 1]), "generation_token_ids"),
    ],
)
def test_contract_violations_are_refused(overrides: dict, fragment: str) -> None:
    d = _base(**overrides)
    with pytest.raises(RecordError, match=re.escape(fragment)):
        coerce_entry(d)
    with pytest.raises(RecordError, match=re.escape(fragment)):
        decode_entry(json.dumps(d))


def test_delta_with_resolved_parent_is_accepted() -> None:
    entry = coerce_entry(_base(prompt_is_delta=True, parent_call_id="p", parent_resolution="resolved"))
    assert entry.parent_resolution is ParentResolutionStatus.RESOLVED
    with pytest.raises(ValueError, match="delta"):
        cumulative_tokens(entry)
    assert cumulative_tokens(coerce_entry(_base())) == [1, 2, 3, 4]


def test_coerce_entry_refuses_other_objects() -> None:
    for value in (None, 1, "x", [1], object()):
        with pytest.raises(TypeError):
            coerce_entry(value)


def test_coerce_entry_validates_a_directly_built_entry() -> None:
    bad = TokenEntry(
        rollout_id="r", model_call_id="c", prompt_token_ids=[], generation_token_ids=[1], generation_log_probs=[]
    )
    with pytest.raises(RecordError, match="same length"):
        coerce_entry(bad)


# Entries built directly (the TokenEntry constructor checks no types) at the edges of what the
# contract allows: coerce_entry must accept each, and what put() stores from it, freeze() must read
# back as the same entry.
ACCEPTED_DIRECT = {
    "largest-token-id": dict(
        prompt_token_ids=[0, 2**64 - 1], generation_token_ids=[2**64 - 1], generation_log_probs=[-0.0]
    ),
    "no-tokens": dict(prompt_token_ids=[], generation_token_ids=[], generation_log_probs=[]),
    "big-floats": dict(
        generation_log_probs=[-1e300, -1e16], created_at=1e17, routed_experts=[[1e16, -2.5e-300], {"w": 1e22}]
    ),
    "tiny-floats": dict(generation_log_probs=[-5e-324, -1e-7], created_at=0.0),
    "unicode-and-output-items": dict(
        rollout_id="r\u00e9/\u65e5\U0001f600",
        model_call_id=".%2E~",
        model="m\u00fc",
        output_items=[{"type": "message", "content": "\u0000\u2028\ud7ff", "n": [1, 2.5, None, True]}],
        token_item_index=0,
        response_id="",
    ),
    "resolved-delta": dict(
        parent_call_id="p",
        parent_resolution="resolved",
        prompt_is_delta=True,
        cum_len=2**40,
        digest="f" * 64,
        continuation_fingerprint="a" * 64,
        continuation_context_len=3,
        continuation_context_digest="b" * 64,
        fingerprint_version=2,
        prefix_requested=True,
        prefix_supplied=True,
    ),
    "unresolved-with-reason": dict(
        parent_resolution="unresolved", parent_resolution_reason="ambiguous", created_at=1700000000
    ),
}
# Directly built entries with a wrong type or a contract violation: coerce_entry refuses each, so
# put() never stores bytes that decode_entry would refuse.
REFUSED_DIRECT = {
    "negative-prompt-id": dict(prompt_token_ids=[-1]),
    "negative-generation-id": dict(generation_token_ids=[-3], generation_log_probs=[-0.5]),
    "token-id-over-u64": dict(prompt_token_ids=[2**64]),
    "none-model": dict(model=None),
    "float-token-id": dict(prompt_token_ids=[1.5]),
    "str-token-ids": dict(generation_token_ids="12", generation_log_probs=[-0.5, -0.5]),
    "log-prob-count-mismatch": dict(generation_log_probs=[-0.5]),
    "output-item-not-object": dict(output_items=[1]),
    "index-outside-output": dict(output_items=[{}], token_item_index=1),
    "none-created-at": dict(created_at=None),
    "newer-schema": dict(schema_version=2),
}


@pytest.mark.parametrize("overrides", list(ACCEPTED_DIRECT.values()), ids=list(ACCEPTED_DIRECT))
def test_everything_coerce_entry_accepts_decodes_again(overrides: dict) -> None:
    entry = TokenEntry(**_base(**overrides))
    accepted = coerce_entry(entry)  # each of these is a valid entry: refusing it is a bug
    stored = encode_entry(accepted)
    # What put() stores, freeze() must be able to read back, as the same entry and the same bytes.
    again = decode_entry(stored)
    assert again.model_dump() == accepted.model_dump() == entry.model_dump()
    assert encode_entry(again) == stored
    assert json.loads(stored) == json.loads(json.dumps(entry.model_dump()))


def test_everything_coerce_entry_accepts_keeps_extra_fields() -> None:
    entry = TokenEntry(**_base())
    entry.extra_fields.update({"zz_extra": {"nested": [1, 1e16, "\u00e9"]}, "a_first": None})
    accepted = coerce_entry(entry)
    again = decode_entry(encode_entry(accepted))
    assert again.extra_fields == accepted.extra_fields == {"zz_extra": {"nested": [1, 1e16, "\u00e9"]}, "a_first": None}
    assert encode_entry(again) == encode_entry(accepted)


@pytest.mark.parametrize("overrides", list(REFUSED_DIRECT.values()), ids=list(REFUSED_DIRECT))
def test_what_decode_entry_refuses_coerce_entry_refuses_too(overrides: dict) -> None:
    fields = _base(**overrides)
    with pytest.raises(RecordError):
        coerce_entry(TokenEntry(**fields))
    with pytest.raises(RecordError):
        coerce_entry(fields)
    with pytest.raises(RecordError):
        decode_entry(json.dumps(fields))


@MEDIUM
@given(valid_entry_dicts(floats=finite_floats))
def test_whatever_coerce_entry_accepts_from_a_dict_decodes_again(d: dict) -> None:
    entry = coerce_entry(d)
    assert decode_entry(encode_entry(entry)).model_dump() == entry.model_dump()


# ---------------------------------------------------------------------------------------------
# Differential against NeMo Gym
# ---------------------------------------------------------------------------------------------


@MEDIUM
@given(valid_entry_dicts())
def test_encode_entry_equals_gym_sorted_orjson_dump(gym: Any, d: dict) -> None:
    assert encode_entry(coerce_entry(d)) == _gym_canonical(gym, d)
    assert encode_entry(decode_entry(orjson.dumps(d))) == _gym_canonical(gym, d)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(created_at=1e16),
        dict(generation_token_ids=[1], generation_log_probs=[-1e20]),
        dict(note={"b": [1, 2.5e30]}),
        dict(routed_experts=[[1e300]]),
    ],
)
def test_encode_entry_positive_exponent_matches_gym(gym: Any, overrides: dict) -> None:
    d = _base(**overrides)
    assert encode_entry(coerce_entry(d)) == _gym_canonical(gym, d)


@MEDIUM
@given(valid_entry_dicts(floats=finite_floats))
def test_model_dump_matches_gym_json_dump(gym: Any, d: dict) -> None:
    assert coerce_entry(d).model_dump() == gym.TokenEntry.model_validate(d).model_dump(mode="json")
    assert coerce_entry(d).model_dump(mode="json") == gym.TokenEntry.model_validate(d).model_dump(mode="json")


@MEDIUM
@given(valid_entry_dicts(floats=finite_floats))
def test_to_gym_and_coerce_from_gym_are_inverse(gym: Any, d: dict) -> None:
    original = gym.TokenEntry.model_validate(d)
    ours = coerce_entry(original)
    assert isinstance(ours, TokenEntry)
    extras = {k: v for k, v in d.items() if k not in KNOWN_FIELDS}
    assert ours.extra_fields == extras
    back = to_gym(ours)
    assert isinstance(back, gym.TokenEntry)
    assert back == original
    assert back.model_dump(mode="json") == original.model_dump(mode="json")
    assert (back.model_extra or {}) == extras
    # coerce from a dict gives the same entry as coerce from the Gym object.
    assert encode_entry(coerce_entry(d)) == encode_entry(ours)


def test_coerce_entry_accepts_gym_python_mode_dump_with_gym_enum() -> None:
    gym = require_gym()
    g = gym.TokenEntry(**_base(parent_resolution=gym.ParentResolutionStatus.ROOT, side={"k": [1, 2]}))
    ours = coerce_entry(g.model_dump())  # python mode: Gym's StrEnum member, not a plain string
    assert ours.parent_resolution is ParentResolutionStatus.ROOT
    assert ours.extra_fields == {"side": {"k": [1, 2]}}
    assert to_gym(ours) == g


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_entry_dicts())
def test_gym_and_s3capture_accept_and_reject_the_same_records(gym: Any, case: tuple[str, dict]) -> None:
    name, d = case
    gym_ok = _gym_accepts(gym.TokenEntry, d)
    assert _accepts(coerce_entry, d) == gym_ok, (name, d)
    assert _accepts(decode_entry, orjson.dumps(d)) == gym_ok, (name, d)
    if gym_ok:
        assert encode_entry(coerce_entry(d)) == _gym_canonical(gym, d)


@MEDIUM
@given(valid_entry_dicts(extras=False))
def test_every_generated_valid_record_is_accepted_by_both(gym: Any, d: dict) -> None:
    assert _gym_accepts(gym.TokenEntry, d)
    assert _accepts(coerce_entry, d) and _accepts(decode_entry, orjson.dumps(d))


def _perturb(d: dict, key: str, value: Any) -> dict:
    out = dict(d)
    out[key] = value
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_entry_dicts(extras=False), st.sampled_from(sorted(KNOWN_FIELDS)), json_values())
def test_s3capture_never_accepts_a_record_gym_rejects(gym: Any, d: dict, key: str, value: Any) -> None:
    """Arbitrary type perturbations: Gym-invalid implies s3capture-invalid (the safe direction).

    The converse does not hold for a few lax coercions s3capture deliberately refuses (booleans as
    token ids or floats, ``"1"``/``1.0`` as schema_version) and for negative token ids.
    """
    bad = _perturb(d, key, value)
    if not _gym_accepts(gym.TokenEntry, bad):
        assert not _accepts(coerce_entry, bad), (key, value)
        assert not _accepts(decode_entry, orjson.dumps(bad)), (key, value)


def test_negative_token_ids_are_refused_although_gym_accepts_them() -> None:
    """A deliberate tightening: negative ids cannot be digested (Gym's compute_digest raises too)."""
    gym = require_gym()
    d = _base(prompt_token_ids=[-1, 2])
    assert _gym_accepts(gym.TokenEntry, d)
    with pytest.raises(ValueError):
        gym.compute_digest([-1, 2])
    assert not _accepts(coerce_entry, d)


# ---------------------------------------------------------------------------------------------
# Token digests
# ---------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**17), st.integers(0, U64_MAX)), max_size=64))
def test_compute_digest_equals_gym(gym: Any, tokens: list[int]) -> None:
    assert compute_digest(tokens) == gym.compute_digest(tokens)
    assert compute_digest(tuple(tokens)) == gym.compute_digest(tokens)


def test_compute_digest_known_values() -> None:
    import hashlib
    import struct

    assert compute_digest([]) == hashlib.sha256(b"nemo-gym-tokens").hexdigest()
    assert compute_digest([5, 6]) == hashlib.sha256(b"nemo-gym-tokens" + struct.pack(">BQQQ", 1, 2, 5, 6)).hexdigest()
    assert compute_digest([1, 2]) != compute_digest([2, 1])
    assert compute_digest([0]) != compute_digest([])


@pytest.mark.parametrize("tokens", [[-1], [1, -2], [2**64], [3, 2**70]])
def test_compute_digest_refuses_ids_outside_u64(tokens: list[int]) -> None:
    with pytest.raises(ValueError):
        compute_digest(tokens)


def test_parent_resolution_status_values_match_gym() -> None:
    gym = require_gym()
    assert {s.value for s in ParentResolutionStatus} == {s.value for s in gym.ParentResolutionStatus}
    assert str(ParentResolutionStatus.RESOLVED) == "resolved"
    assert TOKEN_ENTRY_RECORD_SCHEMA_VERSION == gym.TOKEN_ENTRY_RECORD_SCHEMA_VERSION
    assert set(KNOWN_FIELDS) == set(gym.TokenEntry.model_fields)
    for name, info in gym.TokenEntry.model_fields.items():
        if not info.is_required():
            default = info.get_default(call_default_factory=True)
            ours = TokenEntry(
                rollout_id="r", model_call_id="c", prompt_token_ids=[], generation_token_ids=[], generation_log_probs=[]
            )
            assert getattr(ours, name) == default, name


def test_stamp_lineage_matches_gym_and_delta_keeps_the_full_sequence_digest() -> None:
    from gymcompat import require_gym

    from s3capture.records import stamp_lineage, store_prompt_as_delta, to_gym

    gym = require_gym()
    entry = coerce_entry(
        {
            "rollout_id": "r",
            "model_call_id": "c2",
            "prompt_token_ids": [1, 2, 3, 4],
            "generation_token_ids": [5],
            "generation_log_probs": [-0.5],
        }
    )
    gym_entry = to_gym(entry)
    stamp_lineage(entry, "c1", parent_resolution=ParentResolutionStatus.RESOLVED)
    gym.records.stamp_lineage(gym_entry, "c1", parent_resolution=gym.records.ParentResolutionStatus.RESOLVED)
    assert encode_entry(entry) == canonical_json(gym_entry.model_dump(mode="json")).encode()
    with pytest.raises(RecordError):
        store_prompt_as_delta(entry, [1, 9])
    store_prompt_as_delta(entry, [1, 2])
    assert entry.prompt_token_ids == [3, 4] and entry.prompt_is_delta
    assert entry.cum_len == 5 and entry.digest == gym_entry.digest
    root = coerce_entry(
        {
            "rollout_id": "r",
            "model_call_id": "c0",
            "prompt_token_ids": [1],
            "generation_token_ids": [],
            "generation_log_probs": [],
        }
    )
    with pytest.raises(RecordError):
        stamp_lineage(root, "c9", parent_resolution=ParentResolutionStatus.ROOT)
    with pytest.raises(RecordError):
        store_prompt_as_delta(stamp_lineage(root, None, parent_resolution=ParentResolutionStatus.ROOT), [1])


@MEDIUM
@given(st.lists(st.one_of(st.integers(0, 300_000), st.integers(0, U64_MAX)), max_size=300))
def test_digest_encoding_equals_gyms_and_struct_packing(ids: list[int]) -> None:
    import struct

    from s3capture.records import compute_digest, encode_token_ids

    expected = struct.pack(f">BQ{len(ids)}Q", 1, len(ids), *ids)
    assert encode_token_ids(ids) == expected
    assert encode_token_ids(tuple(ids)) == expected
    gym_records = pytest.importorskip("nemo_gym.token_id_capture.records")
    assert compute_digest(ids) == gym_records.compute_digest(ids)


@pytest.mark.parametrize("bad", [[-1], [U64_MAX + 1], [1.5], ["7"], [None]])
def test_digest_encoding_refuses_what_gym_cannot_encode(bad: list) -> None:
    from s3capture.records import encode_token_ids

    with pytest.raises(ValueError, match="non-negative integers below 2\\*\\*64"):
        encode_token_ids(bad)


@pytest.mark.parametrize("ids", [bytes(range(1, 9)), bytearray(b"\x07" * 16), b"\x01\x02\x03"])
def test_digest_of_bytes_is_gyms_not_the_raw_machine_words(ids: bytes) -> None:
    # array.array("Q", b) reads b as raw 8-byte words (8 bytes -> 1 id) where Gym's struct path
    # takes each byte as an id: the length header and the ids would disagree.
    import struct

    from s3capture.records import compute_digest, encode_token_ids

    assert encode_token_ids(ids) == struct.pack(f">BQ{len(ids)}Q", 1, len(ids), *ids)
    gym_records = pytest.importorskip("nemo_gym.token_id_capture.records")
    assert compute_digest(ids) == gym_records.compute_digest(ids)


@pytest.mark.parametrize("bad", ["ROOT", "bogus", 3])
def test_validate_checks_field_types_as_put_does(bad: Any) -> None:
    """A msgspec Struct's constructor checks no types: ``validate()`` must, or an entry it passes is
    refused by ``put`` (found by a new user's walkthrough, 2026-12-02: ``parent_resolution="ROOT"``,
    the spelling the README's comments and the demo's output show). The error lists the values."""
    from s3capture.records import ParentResolutionStatus, TokenEntry, coerce_entry

    entry = TokenEntry(
        rollout_id="r", model_call_id="c1", prompt_token_ids=[1], generation_token_ids=[2], generation_log_probs=[-0.5]
    )
    entry.parent_resolution = bad
    with pytest.raises(RecordError, match=r"parent_resolution.*'root', 'resolved', 'unresolved'"):
        entry.validate()
    with pytest.raises(RecordError):
        coerce_entry(entry)  # what put runs: the two agree
    entry.parent_resolution = "root"  # Gym's value spelling is accepted, as pydantic accepts it
    assert entry.validate() is entry
    assert coerce_entry(entry).parent_resolution is ParentResolutionStatus.ROOT
    entry.prompt_token_ids = ["x"]  # any field's type, not only the enum
    with pytest.raises(RecordError, match="prompt_token_ids"):
        entry.validate()
