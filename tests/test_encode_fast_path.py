"""The put-side encoder (``records.prepare_entry``, ``S3TokenStore._encode_object``).

``prepare_entry`` validates an entry once and returns a private copy plus its canonical bytes. Its
fast path (s3capture entries, NeMo Gym's pydantic entries, dicts) must give exactly what the
reference path (``coerce_entry``'s general conversion, then ``encode_entry``) gives, and the bytes
must be Gym's canonical bytes; whatever the caller does to its entry after ``put`` must not reach
the cached or the stored entry.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import threading
from typing import Any

import orjson
import pytest
import zstandard
from gymcompat import require_gym
from helpers import simple_entry
from hypothesis import HealthCheck, given, settings
from test_records import _base, finite_floats, valid_entry_dicts

from s3capture.records import (
    RecordError,
    TokenEntry,
    _coerce_general,
    _fast_copy,
    coerce_entry,
    decode_entry,
    encode_entry,
    prepare_entry,
)
from s3capture.store import S3TokenStore

MEDIUM = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
from helpers import EXAMPLE_DATA  # noqa: E402

DATA = EXAMPLE_DATA


@pytest.fixture(scope="module")
def gym() -> Any:
    return require_gym()


def _gym_bytes(gym: Any, d: dict) -> bytes:
    return orjson.dumps(gym.TokenEntry.model_validate(d).model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


def _inputs(gym: Any, d: dict) -> dict[str, Any]:
    """The three kinds of entry a sink is handed, all holding the record ``d``."""
    return {
        "dict": copy.deepcopy(d),
        "gym": gym.TokenEntry.model_validate(d),
        "s3capture": coerce_entry(copy.deepcopy(d)),
    }


def _same_record(a: TokenEntry, b: TokenEntry) -> None:
    assert a.model_dump() == b.model_dump()
    assert a.extra_fields == b.extra_fields
    assert type(a.parent_resolution) is type(b.parent_resolution)


@MEDIUM
@given(valid_entry_dicts(floats=finite_floats))
def test_prepare_entry_gives_gym_bytes_and_the_reference_record_for_every_input_kind(gym: Any, d: dict) -> None:
    expected = _gym_bytes(gym, d)
    for kind, entry in _inputs(gym, d).items():
        record, payload = prepare_entry(entry)
        assert payload == expected, kind
        assert payload == encode_entry(record), kind
        _same_record(record, _coerce_general(entry))
        # What put stores, every reader decodes to the same entry and re-encodes byte for byte.
        assert encode_entry(decode_entry(payload)) == payload


def test_the_fast_path_serves_ordinary_entries_of_every_kind(gym: Any) -> None:
    d = _base(
        output_items=[{"type": "message", "content": [{"text": "hi", "logprobs": [-0.25]}]}],
        token_item_index=0,
        routed_experts=[[1, 2], [3, 4]],
        parent_resolution="root",
        note={"k": [1, 2.5]},
    )
    for kind, entry in _inputs(gym, d).items():
        assert _fast_copy(entry) is not None, kind
        assert prepare_entry(entry)[1] == _gym_bytes(gym, d), kind


@pytest.mark.parametrize(
    "overrides",
    [
        dict(prompt_token_ids=[2**63, 2**64 - 1]),  # beyond the fast path's int64 check, still Gym-valid
        dict(generation_token_ids=[1], generation_log_probs=[-1e20]),  # orjson spells it 1e+20
        dict(created_at=1e16),
        dict(routed_experts=[[1e300]]),
        dict(note={"b": [1, 2.5e30]}),
        dict(output_items=[{"n": (1, 2)}]),
    ],
)
def test_what_the_fast_path_leaves_to_the_general_path_still_matches_gym(gym: Any, overrides: dict) -> None:
    d = _base(**overrides)
    for kind, entry in [("dict", d), ("s3capture", TokenEntry(**{k: v for k, v in d.items() if k != "note"}))]:
        expected = _gym_bytes(gym, {k: v for k, v in d.items() if kind == "dict" or k != "note"})
        record, payload = prepare_entry(entry)
        assert payload == expected, kind
        assert encode_entry(decode_entry(payload)) == payload


def _outcome(fn: Any, entry: Any) -> tuple[Any, Any]:
    try:
        return "ok", fn(entry)
    except (RecordError, TypeError) as error:
        return type(error), str(error)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(prompt_token_ids=[-1]), ">= 0"),
        (dict(prompt_token_ids=[2**64]), "2**64"),
        (dict(generation_log_probs=[-0.5, math.nan]), "generation_log_probs[1]"),
        (dict(generation_log_probs=[-0.5, -math.inf]), "generation_log_probs[1]"),
        (dict(created_at=math.inf), "created_at"),
        (dict(prompt_token_ids=[True]), "Expected `int`"),
        (dict(generation_log_probs=[-0.5]), "same length"),
        (dict(output_items=[{"b": b"x"}]), None),  # refused from a dict; a struct's dump base64-encodes it
    ],
)
def test_refusals_are_the_general_paths_refusals(overrides: dict, fragment: str | None) -> None:
    for entry in (_base(**overrides), TokenEntry(**_base(**overrides))):
        fast = _outcome(lambda e: prepare_entry(e)[1], entry)
        reference = _outcome(lambda e: encode_entry(_coerce_general(e)), entry)
        assert fast == reference
        if fragment is not None:
            assert fast[0] is RecordError and fragment in fast[1]


def _nested(d: dict) -> dict:
    d = _base(**d)
    d.update(
        output_items=[{"type": "message", "content": [{"type": "output_text", "text": "a", "annotations": []}]}],
        token_item_index=0,
        routed_experts=[[1, 2], [3, 4]],
        harness={"tags": ["a"]},
    )
    return d


def _mutate(entry: Any) -> None:
    """Everything a caller could change in place after handing ``entry`` to put."""
    get = entry.get if isinstance(entry, dict) else lambda name: getattr(entry, name)
    get("prompt_token_ids").append(99)
    get("generation_token_ids")[0] = 98
    get("generation_log_probs")[0] = -9.0
    get("output_items")[0]["content"][0]["text"] = "mutated"
    get("output_items")[0]["content"][0]["annotations"].append({"x": 1})
    get("output_items").append({"type": "late"})
    get("routed_experts")[0].append(7)
    extra = (
        entry
        if isinstance(entry, dict)
        else (entry.extra_fields if isinstance(entry, TokenEntry) else entry.model_extra)
    )
    extra["harness"]["tags"].append("mutated")


def test_mutating_the_callers_entry_after_prepare_changes_nothing(gym: Any) -> None:
    d = _nested({})
    expected = _gym_bytes(gym, d)
    for kind, entry in _inputs(gym, d).items():
        record, payload = prepare_entry(entry)
        _mutate(entry)
        assert encode_entry(record) == payload == expected, kind


async def test_mutating_the_callers_entry_after_put_changes_neither_cache_nor_store(gym: Any, fresh: Any) -> None:
    store = fresh()
    d = _nested({})
    expected = _gym_bytes(gym, d)
    for kind, entry in _inputs(gym, d).items():
        rollout = f"r-mutate-{kind}"
        if isinstance(entry, dict):
            entry["rollout_id"] = rollout
        else:
            entry.rollout_id = rollout
        await store.put(entry)
        _mutate(entry)
        cached = await store.freeze(rollout)  # served from this client's cache
        stored = await fresh().freeze(rollout)  # what the bucket holds
        for snapshot in (cached, stored):
            (got,) = snapshot.entries
            again = encode_entry(got)
            assert json.loads(again) == {**json.loads(expected), "rollout_id": rollout}, kind


@pytest.mark.skipif(
    not (DATA / "competitive_coding.jsonl").exists(),
    reason=f"shared example rollouts not found at {DATA} (set S3CAPTURE_EXAMPLE_DATA)",
)
def test_real_competitive_coding_entries_take_the_fast_path_and_match_gym(gym: Any) -> None:
    from helpers import example_entries

    entries = example_entries(DATA / "competitive_coding.jsonl")
    assert len(entries) >= 5
    for entry in entries:
        d = json.loads(encode_entry(entry))
        for kind, item in _inputs(gym, d).items():
            assert _fast_copy(item) is not None, kind
            assert prepare_entry(item)[1] == _gym_bytes(gym, d), kind


def test_encode_object_is_safe_from_several_threads() -> None:
    """Each thread compresses with its own ZstdCompressor (one must not be shared across threads)."""
    store = S3TokenStore("s3://bucket/threads")
    payloads = [json.dumps({"i": i, "pad": [i] * 20_000}).encode() for i in range(8)]
    errors: list[BaseException] = []
    compressors: set[int] = set()
    together = threading.Barrier(len(payloads))

    def work(payload: bytes) -> None:
        try:
            compressors.add(id(store._compressor()))
            together.wait(timeout=30)  # every thread alive at once: ids cannot be reused
            for _ in range(20):
                body = store._encode_object(payload, ("a/b",))
                raw = zstandard.ZstdDecompressor().decompress(body)
                assert raw == b'{"chain":["a/b"],"entry":' + payload + b',"format":"s3capture.entry/1"}'
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(p,)) for p in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(compressors) == len(payloads)


@pytest.mark.parametrize("level", [1, 3, 19, -1])
def test_objects_written_at_any_level_or_uncompressed_decode_with_the_default_reader(level: int) -> None:
    entry = simple_entry("r-level", "c1", generation=list(range(300)), log_probs=[-0.5] * 300)
    payload = encode_entry(entry)
    sha = hashlib.sha256(payload).hexdigest()
    writer = S3TokenStore("s3://bucket/levels", compression_level=level)
    reader = S3TokenStore("s3://bucket/levels")
    body = writer._encode_object(payload, ())
    assert encode_entry(reader._decode_object(body, sha).entry) == payload
    uncompressed = zstandard.ZstdDecompressor().decompress(body)  # what a writer without zstd would store
    assert encode_entry(reader._decode_object(uncompressed, sha).entry) == payload


def test_the_default_level_is_one() -> None:
    store = S3TokenStore("s3://bucket/default")
    assert store._compression_level == 1
    frame = store._encode_object(b"{}", ())
    assert zstandard.ZstdDecompressor().decompress(frame).endswith(b'"format":"s3capture.entry/1"}')
