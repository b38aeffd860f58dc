"""Adversarial: delta chains (forged cycles, deep chains) and the memo's place in the cache bound."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import zstandard
from helpers import (
    assistant_output,
    build_conversation,
    make_entry,
    next_request,
    put_bytes,
    split_bucket_url,
    system,
    turn_entry,
    user,
)

from s3capture.layout import Layout
from s3capture.records import ParentResolutionStatus, encode_entry
from s3capture.store import S3TokenStore

REQ = [system("Be brief."), user("Loop?")]


def _envelope(payload: bytes, chain: list[str]) -> bytes:
    import json

    body = b'{"chain":' + json.dumps(chain, separators=(",", ":")).encode() + b',"entry":' + payload
    body += b',"format":"s3capture.entry/1"}'
    return zstandard.ZstdCompressor().compress(body)


# Regression test (found by the adversarial review, fixed in 0d86cd4): a cyclic delta chain in the bucket
# crashes resolve with RecursionError
async def test_forged_cyclic_delta_chain_does_not_crash_resolve(fresh, s3_client, bucket_url):
    """Two foreign (forged) entry objects whose envelopes name each other as ancestors.

    Each object is well formed (its key's SHA-256 matches the entry bytes; the envelope's chain is
    not covered by the hash) and each names the other as RESOLVED parent. design.md promises
    "Nothing in a rollout's prefix can crash a reader" and ``_cumulative`` has an explicit
    "too deep or cyclic" guard, but the guard (depth > 6,250) sits above Python's recursion
    limit, so resolve dies with RecursionError instead of answering UNRESOLVED.
    """
    bucket, root = split_bucket_url(bucket_url)
    layout = Layout(root.rstrip("/"))
    prefix = layout.rollout("r-cycle")

    def entry(cid: str, parent: str, text: str) -> Any:
        e = make_entry("r-cycle", cid, REQ, assistant_output(text), [1, 2], [3], parent_call_id=parent)
        e.prompt_token_ids = [2]
        e.prompt_is_delta = True
        return e.validate()

    a, b = entry("A", "B", "alpha"), entry("B", "A", "beta")
    rel = {}
    payload = {}
    for e in (a, b):
        payload[e.model_call_id] = encode_entry(e)
        sha = hashlib.sha256(payload[e.model_call_id]).hexdigest()
        rel[e.model_call_id] = layout.entry_rel(prefix, e.continuation_fingerprint, e.model_call_id, sha)
    put_bytes(s3_client, bucket, prefix + rel["A"], _envelope(payload["A"], [rel["B"]]))
    put_bytes(s3_client, bucket, prefix + rel["B"], _envelope(payload["B"], [rel["A"]]))

    request = REQ + assistant_output("alpha") + [user("next")]
    resolution = await fresh().resolve("r-cycle", request)  # RecursionError today
    assert resolution.status == ParentResolutionStatus.UNRESOLVED


# Regression test (found by the adversarial review, fixed in 0d86cd4): memoized cumulative tokens are added to
# an entry's nbytes after it is in the LRU, so the LRU's byte count drifts below the truth and cache_bytes no
# longer bounds memory
async def test_cache_stays_within_cache_bytes_after_delta_resolves(fresh):
    """``cache_bytes`` must bound the cache. ``_cumulative`` does ``stored.nbytes += 8*len(tokens)``
    on an object already inside the LRU; the LRU never adds that to its total but subtracts it on
    eviction, so its total goes negative and eviction stops."""
    turns = build_conversation("r-mem", 40)
    writer = fresh()
    cum = None
    for turn in turns:
        await writer.put(turn_entry("r-mem", turn, delta=cum is not None, parent_cumulative=cum))
        cum = turn.cumulative
    limit = 20_000
    reader: S3TokenStore = fresh(cache_bytes=limit)
    for turn in turns:
        resolution = await reader.resolve("r-mem", next_request(turn))
        assert resolution.status == ParentResolutionStatus.RESOLVED, resolution
    held = sum(v.nbytes for v in reader._cache._data.values())
    # The LRU's own bookkeeping and the real content both must respect the bound.
    assert reader._cache.nbytes >= 0, f"LRU byte count went negative: {reader._cache.nbytes}"
    assert held <= limit, f"cache holds {held} bytes with cache_bytes={limit}"


# Regression test (found by the adversarial review, fixed in 0d86cd4): readers GET a whole object into memory
# before applying max_entry_bytes; an oversize (foreign/corrupt) object in a rollout costs its full size in
# RAM
async def test_oversize_object_is_not_read_into_memory(fresh, s3_client, bucket_url):
    """The LIST already reports each object's size; a reader configured with max_entry_bytes=64 KiB
    should refuse a 24 MiB object at an entry-shaped key without downloading it. Today ``_get``
    reads the whole body, and only ``_decompress``/``_decode_object`` compare with the limit."""
    import os
    import tracemalloc

    bucket, root = split_bucket_url(bucket_url)
    key = f"{Layout(root.rstrip('/')).rollout('r-big')}log/e/~/c1/{'0' * 64}.zst"
    size = 24 * 1024 * 1024
    put_bytes(s3_client, bucket, key, os.urandom(size))
    store = fresh(max_entry_bytes=64 * 1024)
    await store._s3()
    tracemalloc.start()
    try:
        snapshot = await store.freeze("r-big")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert snapshot.incomplete and any(r.startswith("unreadable:") for r in snapshot.reasons), snapshot.reasons
    assert peak < size // 4, f"freeze peaked at {peak / 2**20:.1f} MiB of Python memory for a 64 KiB entry limit"


async def test_an_object_that_decompresses_past_the_limit_is_read_once(fresh, s3_client, bucket_url):
    """A planted zstd bomb (small object, decompressing past ``max_entry_bytes``) was read and
    expanded ``read_attempts`` (4) times, as if a body cut short could grow: 1.4-1.8 s each at the
    default 256 MiB limit (a scale breaker, 2026-12-03). Over the limit is final: one GET."""
    import zstandard

    bucket, root = split_bucket_url(bucket_url)
    key = f"{Layout(root.rstrip('/')).rollout('r-bomb')}log/e/~/c1/{'0' * 64}.zst"
    put_bytes(s3_client, bucket, key, zstandard.ZstdCompressor().compress(b"\0" * (1024 * 1024)))
    store = fresh(max_entry_bytes=64 * 1024)
    snapshot = await store.freeze("r-bomb")
    assert snapshot.incomplete and any("decompresses beyond" in r for r in snapshot.reasons), snapshot.reasons
    # the entry once, and the retire tombstone freeze reads beside its LIST
    assert store.request_counts["GetObject"] == 2, dict(store.request_counts)


async def test_a_kilobyte_entry_that_holds_a_quarter_gigabyte_of_json_is_bounded_by_the_environment(
    fresh, s3_client, bucket_url, monkeypatch
):
    """A memory breaker planted a well-formed entry (its SHA-256 right) of 250 MiB of canonical JSON
    in 22 KB of zstd: every reader at the default 256 MiB limit decoded it into 37 M Python ints
    (2.2 GiB each; an export worker reached 7.4 GB with three). ``S3CAPTURE_MAX_ENTRY_BYTES``
    bounds every store built without ``max_entry_bytes`` (the command line's readers, export
    workers, Gym's YAML-built stores): the entry is refused after decompressing past the bound,
    before any int exists. Here 64 KiB against 1 MiB of JSON keeps the test small."""
    import hashlib
    import json
    import tracemalloc

    import zstandard

    from s3capture.records import TokenEntry, encode_entry

    ids = [100000] * (1024 * 1024 // 7)
    entry = TokenEntry(
        rollout_id="r-big",
        model_call_id="c1",
        prompt_token_ids=ids,
        generation_token_ids=[1],
        generation_log_probs=[-0.5],
        created_at=1.0,
    )
    payload = encode_entry(entry)
    assert len(payload) > 1024 * 1024
    body = zstandard.ZstdCompressor().compress(b'{"chain":[],"entry":' + payload + b',"format":"s3capture.entry/1"}')
    assert len(body) < 64 * 1024
    bucket, root = split_bucket_url(bucket_url)
    key = f"{Layout(root.rstrip('/')).rollout('r-big')}log/e/~/c1/{hashlib.sha256(payload).hexdigest()}.zst"
    put_bytes(s3_client, bucket, key, body)
    assert (await fresh().freeze("r-big")).entries[0].prompt_token_ids == ids  # at the default: read whole

    monkeypatch.setenv("S3CAPTURE_MAX_ENTRY_BYTES", str(64 * 1024))
    store = fresh()
    tracemalloc.start()
    try:
        snapshot = await store.read_snapshot("r-big", sealed=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert snapshot.incomplete and not snapshot.entries
    assert any("decompresses beyond max_entry_bytes=65536" in r for r in snapshot.reasons), snapshot.reasons
    assert peak < 4 * 1024 * 1024, f"{peak / 2**20:.1f} MiB"
    assert json.loads(json.dumps(snapshot.reasons))  # plain strings
    for bad in ("16 MiB", "0", "nan"):
        monkeypatch.setenv("S3CAPTURE_MAX_ENTRY_BYTES", bad)
        with pytest.raises(ValueError, match="S3CAPTURE_MAX_ENTRY_BYTES="):
            fresh()


# Regression test (found by the adversarial review, fixed in 0d86cd4): resolve silently drops a candidate it
# cannot read, so a sibling with the same output and context wins by elimination instead of UNRESOLVED
@pytest.mark.parametrize("damage", ["newer_schema", "bit_rot"])
async def test_unreadable_sibling_candidate_does_not_let_another_win(fresh, s3_client, bucket_url, damage):
    """Calls A and B of one rollout answered the same request with the same text but different
    tokens (a retried/sibling call): a request continuing that text cannot be attributed to one
    of them, so resolve answers UNRESOLVED ambiguous while both are readable. When B's object is
    unreadable to this reader (written by a newer schema during a rolling upgrade, or damaged),
    resolve skips it and RESOLVES A - a guess design.md rule 3 forbids ("anything a reader cannot
    prove ... makes resolution UNRESOLVED") and the conflicted-call rule avoids ("so that no other
    call wins by elimination")."""
    import json

    bucket, root = split_bucket_url(bucket_url)
    layout = Layout(root.rstrip("/"))
    prefix = layout.rollout("r-sib")
    a = make_entry("r-sib", "A", REQ, assistant_output("same"), [1, 2], [3, 4])
    b = make_entry("r-sib", "B", REQ, assistant_output("same"), [1, 2], [5, 6])
    store = fresh()
    await store.put(a)
    await store.put(b)
    request = REQ + assistant_output("same") + [user("next")]
    assert (await fresh().resolve("r-sib", request)).reason == "ambiguous"

    # Replace B by an object this reader cannot decode (same key shape, its own valid SHA-256).
    if damage == "newer_schema":
        raw = json.loads(encode_entry(b))
        raw["schema_version"] = 2
        payload = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
        sha = hashlib.sha256(payload).hexdigest()
        s3_client.delete_object(
            Bucket=bucket,
            Key=prefix
            + layout.entry_rel(prefix, b.continuation_fingerprint, "B", hashlib.sha256(encode_entry(b)).hexdigest()),
        )
        put_bytes(
            s3_client,
            bucket,
            prefix + layout.entry_rel(prefix, b.continuation_fingerprint, "B", sha),
            _envelope(payload, []),
        )
    else:
        key = prefix + layout.entry_rel(
            prefix, b.continuation_fingerprint, "B", hashlib.sha256(encode_entry(b)).hexdigest()
        )
        put_bytes(s3_client, bucket, key, b"\x28\xb5\x2f\xfd garbage")

    resolution = await fresh().resolve("r-sib", request)
    assert resolution.status == ParentResolutionStatus.UNRESOLVED, resolution


# Regression test (found by the adversarial review, fixed in 0d86cd4): freeze never checks that a delta
# entry's parent is in the snapshot, so a rollout whose chain is broken (parent object gone) freezes complete
async def test_delta_entry_without_its_parent_masks_the_snapshot(fresh, s3_client, bucket_url):
    """A delta entry stores only the suffix after its parent's tokens: without the parent its
    prompt cannot be rebuilt. If the parent's object disappears (a bucket lifecycle rule, an
    operator's cleanup, a straggler's self-delete), freeze has every fact it needs to see the
    broken chain but returns incomplete=False."""
    turns = build_conversation("r-broken", 3)
    writer = fresh()
    cum = None
    for turn in turns:
        await writer.put(turn_entry("r-broken", turn, delta=cum is not None, parent_cumulative=cum))
        cum = turn.cumulative
    bucket, root = split_bucket_url(bucket_url)
    from helpers import list_keys

    (parent_key,) = [
        k
        for k in list_keys(s3_client, bucket, Layout(root.rstrip("/")).rollout("r-broken"))
        if f"/{turns[1].call_id}/" in k
    ]
    s3_client.delete_object(Bucket=bucket, Key=parent_key)
    snapshot = await fresh().freeze("r-broken")
    assert {e.model_call_id for e in snapshot.entries} == {turns[0].call_id, turns[2].call_id}
    assert snapshot.incomplete, "a delta entry whose parent is missing froze as trainable"


# Fixed: was a strict xfail (BUG) until the fix landed; now a regression test.
async def test_cache_heap_stays_near_cache_bytes_for_full_prompt_entries(fresh):
    import gc
    import random
    import tracemalloc

    rng = random.Random(7)
    writer = fresh()
    for i in range(24):
        prompt = [rng.randrange(1000, 150_000) for _ in range(10_000)]
        await writer.put(make_entry("r-heap", f"c{i:02d}", REQ, assistant_output(f"a{i}"), prompt, [7, 8, 9]))
    limit = 2 * 1024 * 1024
    reader = fresh(cache_bytes=limit)
    await reader._s3()
    # gc.freeze first: the collections then walk only objects made from here on, not the whole heap
    # of a long CI process; the full collection still empties the free lists, so the freeze's
    # objects are fresh (traced) allocations. Older objects are not traced either way.
    gc.freeze()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        snapshot = await reader.freeze("r-heap")
        assert len(snapshot.entries) == 24
        del snapshot
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.unfreeze()
    assert retained <= 1.25 * limit, (
        f"the cache retains {retained / 2**20:.1f} MiB with cache_bytes={limit / 2**20:.1f} MiB"
    )


# Found by the adversarial review of the lazy chain check (f85bcd4): writers never build a chain of
# more than CHAIN_KEYS keys, but a reader accepted any number of entry-shaped keys from a hint that
# is outside the key's SHA-256, and GETs them all at once: one forged envelope made one resolve send
# thousands of parallel requests.
async def test_forged_overlong_chain_hint_is_not_fetched(fresh, s3_client, bucket_url):
    from helpers import RequestRecorder, entry_key, put_chain, read_envelope, rollout_prefix, write_envelope

    from s3capture.store import CHAIN_KEYS

    turns, entries = await put_chain(fresh(), "r-long", 4)
    bucket, prefix = rollout_prefix(bucket_url, "r-long")
    key = entry_key(prefix, entries[-1])
    envelope = read_envelope(s3_client, bucket, key)
    genuine = envelope["chain"]
    assert 0 < len(genuine) <= CHAIN_KEYS
    # Keys of an entry's shape (in this rollout), named by SHA-256s that no object has.
    fake = genuine[-1].rsplit("/", 1)[0]
    forged = [f"{fake}/{hashlib.sha256(str(i).encode()).hexdigest()}.zst" for i in range(1000)]
    envelope["chain"] = forged + genuine
    envelope.pop("cum_base", None)
    envelope.pop("cum_self", None)
    write_envelope(s3_client, bucket, key, envelope)
    resolver = fresh()
    rec = await RequestRecorder.attach(resolver)
    resolution = await resolver.resolve("r-long", next_request(turns[-1]))
    assert resolution.status == ParentResolutionStatus.UNRESOLVED, resolution
    assert not any(
        k.startswith(prefix + fake + "/") and k not in {prefix + r for r in genuine} for k in rec.keys("GetObject")
    )
    assert len(rec.keys("GetObject")) <= 2 * CHAIN_KEYS
