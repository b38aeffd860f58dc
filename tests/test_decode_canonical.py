"""The read-side decoder (``records.decode_canonical_entry``) against its reference.

Every reader of a stored entry (freeze, resolve, read_snapshot, export) accepts only the canonical
encoding of the entry the bytes decode to. The reference check is ``decode_entry`` followed by
``encode_entry(entry) == data``; ``decode_canonical_entry`` has a fast path (one typed decode, one
encode) and must give exactly the reference's answer for every input: the same entry, or a
``RecordError`` (``UnsupportedSchemaError``) where the reference raises one.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_records import _base, finite_floats, valid_entry_dicts

from s3capture.records import (
    RecordError,
    TokenEntry,
    UnsupportedSchemaError,
    _has_msgspec_only_float,
    coerce_entry,
    decode_canonical_entry,
    decode_entry,
    encode_entry,
)

MEDIUM = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
from helpers import EXAMPLE_DATA  # noqa: E402

DATA = EXAMPLE_DATA


def _reference(data: bytes) -> TokenEntry:
    entry = decode_entry(data)
    if encode_entry(entry) != data:
        raise RecordError("not canonical")
    return entry


def _outcome(fn, data: bytes) -> tuple[str, object]:
    try:
        entry = fn(data)
    except UnsupportedSchemaError:
        return ("unsupported", None)
    except RecordError:
        return ("refused", None)
    return ("entry", (entry.model_dump(), entry.extra_fields, type(entry.parent_resolution)))


def _same(data: bytes) -> tuple[str, object]:
    fast, reference = _outcome(decode_canonical_entry, data), _outcome(_reference, data)
    assert fast == reference
    return fast


@MEDIUM
@given(valid_entry_dicts(floats=finite_floats))
def test_canonical_bytes_decode_to_the_reference_entry(d: dict) -> None:
    data = encode_entry(coerce_entry(d))
    kind, _ = _same(data)
    assert kind == "entry"


@MEDIUM
@given(valid_entry_dicts(floats=finite_floats), st.sampled_from(["msgspec", "pretty", "reordered", "repeated"]))
def test_non_canonical_spellings_are_refused_like_the_reference(d: dict, spelling: str) -> None:
    entry = coerce_entry(d)
    canonical = encode_entry(entry)
    if spelling == "msgspec":
        # msgspec's own encoding: equal to the canonical bytes except for floats >= 1e16 ("1e16").
        data = msgspec.json.encode(msgspec.to_builtins(entry) | entry.extra_fields, order="sorted")
    elif spelling == "pretty":
        data = json.dumps(json.loads(canonical), indent=1, sort_keys=True).encode()
    elif spelling == "reordered":
        data = json.dumps(dict(reversed(list(json.loads(canonical).items()))), separators=(",", ":")).encode()
    else:
        data = b'{"model":"x",' + canonical[1:]  # "model" twice: decodes last-wins
    kind, _ = _same(data)
    assert kind == ("entry" if data == canonical else "refused")


def test_a_float_spelled_the_msgspec_way_is_refused() -> None:
    for fields, gym, msgspec_spelling in (
        ({"created_at": 1e16}, b"1e+16", b"1e16"),
        ({"generation_log_probs": [-2.5e17, -1.0]}, b"-2.5e+17", b"-2.5e17"),
    ):
        canonical = encode_entry(coerce_entry(_base(**fields)))
        assert gym in canonical
        assert _same(canonical)[0] == "entry"
        assert _same(canonical.replace(gym, msgspec_spelling))[0] == "refused"


def test_big_floats_inside_nested_fields_are_judged_by_the_general_path() -> None:
    for fields, gym, msgspec_spelling in (
        ({"output_items": [{"x": [1.5e20, "1e5", "5e2ab"]}]}, b"1.5e+20", b"1.5e20"),
        ({"routed_experts": [[3e30, 1]]}, b"3e+30", b"3e30"),
    ):
        canonical = encode_entry(coerce_entry(_base(**fields)))
        assert gym in canonical
        assert _same(canonical)[0] == "entry"
        assert _same(canonical.replace(gym, msgspec_spelling))[0] == "refused"


def test_token_ids_beyond_64_bits_and_newer_schemas_are_refused() -> None:
    canonical = encode_entry(coerce_entry(_base(prompt_token_ids=[2**64 - 1, 7])))
    assert _same(canonical)[0] == "entry"
    with pytest.raises(RecordError, match="2\\*\\*64"):
        decode_canonical_entry(canonical.replace(b"18446744073709551615", b"18446744073709551616"))
    newer = canonical.replace(b'"schema_version":1', b'"schema_version":2')
    assert _same(newer)[0] == "unsupported"
    with pytest.raises(UnsupportedSchemaError):
        decode_canonical_entry(newer)


def test_extra_fields_are_kept() -> None:
    entry = coerce_entry(_base(future_field={"a": [1, 2.5]}))
    kind, (_, extra, _) = _same(encode_entry(entry))
    assert kind == "entry" and extra == {"future_field": {"a": [1, 2.5]}}


@pytest.mark.parametrize(
    "data",
    [b"", b"[]", b"null", b"{", b'{"rollout_id":"r"}', b"\xff\xfe", b'{"schema_version":true}'],
)
def test_garbage_is_refused(data: bytes) -> None:
    assert _same(data)[0] in ("refused", "unsupported")
    with pytest.raises(RecordError):
        decode_canonical_entry(data)


def test_contract_violations_are_refused() -> None:
    good = encode_entry(coerce_entry(_base()))
    broken = good.replace(b'"generation_log_probs":[-0.5,-1.25]', b'"generation_log_probs":[-0.5]')
    assert _same(broken)[0] == "refused"
    negative = good.replace(b'"prompt_token_ids":[1,2]', b'"prompt_token_ids":[-1,2]')
    assert _same(negative)[0] == "refused"


def test_the_scan_for_msgspec_spelled_floats() -> None:
    assert _has_msgspec_only_float(b'{"a":1e16}')
    assert _has_msgspec_only_float(b'{"a":[1,2,-3.5e20]}')
    assert _has_msgspec_only_float(b"1e16")
    assert not _has_msgspec_only_float(b'{"a":1e+16,"b":1e-7,"c":"5e2ab","d":"x12e4"}')
    assert not _has_msgspec_only_float(b'{"digest":"0a5e2f7e9"}')


@pytest.mark.skipif(
    not (DATA / "competitive_coding.jsonl").exists(),
    reason=f"shared example rollouts not found at {DATA} (set S3CAPTURE_EXAMPLE_DATA)",
)
def test_real_entries_decode_like_the_reference() -> None:
    from helpers import example_entries

    entries = example_entries(DATA / "competitive_coding.jsonl")
    assert len(entries) >= 5
    for entry in entries:
        assert _same(encode_entry(entry))[0] == "entry"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"routed_experts":null', b'"routed_experts":[18446744073709551616]'),
        (b'"routed_experts":null', b'"routed_experts":[[1,-9223372036854775809]]'),
        (b'"output_items":[]', b'"output_items":[{"n":123456789012345678901234567890}]'),
        # The shortest out-of-range integers (19 digits; the fast path skips its walk below 19 in a row).
        (b'"output_items":[]', b'"output_items":[{"n":[-9223372036854775809]}]'),
        (b'"cum_len":null', b'"cum_len":1180591620717411303424'),
        (b'"continuation_context_len":0', b'"continuation_context_len":18446744073709551616'),
        (b'"fingerprint_version":null', b'"fingerprint_version":-9223372036854775809'),
    ],
)
def test_integers_beyond_64_bits_are_refused_anywhere(old: bytes, new: bytes) -> None:
    # orjson (Gym's encoder) cannot write these, so no canonical encoding holds them; msgspec
    # decodes and re-encodes them unchanged, so the byte comparison alone proves nothing.
    good = encode_entry(coerce_entry(_base()))
    assert old in good
    data = good.replace(old, new)
    assert _same(data)[0] == "refused"
    with pytest.raises(RecordError):
        decode_canonical_entry(data)


def test_64_bit_edges_in_nested_fields_are_kept() -> None:
    for value in (2**64 - 1, -(2**63)):
        entry = coerce_entry(_base(routed_experts=[value], output_items=[{"n": value}], cum_len=value))
        kind, (dump, _, _) = _same(encode_entry(entry))
        assert kind == "entry" and dump["routed_experts"] == [value] and dump["cum_len"] == value


def test_writers_refuse_integers_gym_cannot_encode() -> None:
    from s3capture.records import prepare_entry

    for field in ("cum_len", "continuation_context_len", "fingerprint_version"):
        with pytest.raises(RecordError, match="64 bits"):
            prepare_entry(_base(**{field: 2**64}))


def test_small_log_probs_and_u64_token_ids_stay_on_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # -0.00012345678901234567 is spelled with a run of 20 digits: a check for integers beyond 64
    # bits must not mistake it for one (nor the 64-bit integers in the free-form fields).
    import s3capture.records as records

    data = encode_entry(
        coerce_entry(
            _base(
                generation_log_probs=[-0.00012345678901234567, -1.2e-5],
                cum_len=2**40,
                routed_experts=[[2**64 - 1, -(2**63)]],
                output_items=[{"n": 12345678901234567890}],
            )
        )
    )
    assert b"00012345678901234567" in data

    def general(_: bytes) -> TokenEntry:
        raise AssertionError("took the general path")

    monkeypatch.setattr(records, "decode_entry", general)
    assert decode_canonical_entry(data).generation_log_probs == [-0.00012345678901234567, -1.2e-5]
