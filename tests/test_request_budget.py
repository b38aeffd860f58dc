"""Request budgets of S3TokenStore operations, counted on the wire.

Every count comes from our own handlers on the store's aiobotocore client events
(``before-send.s3`` / ``response-received.s3``, see ``helpers.RequestRecorder``), against real
local servers (moto and SeaweedFS). Budgets are exact where the design fixes them: a put is one
PutObject and one fence GetObject sent together (one sequential round trip); a resolve is one
LIST of the request fingerprint's prefix plus GETs of uncached candidates and ancestors, whatever
the rollout holds; a freeze is one LIST page per 1,000 keys (and the LIST confirming its end),
one GET per uncached entry, one GET of the retire tombstone and at most two PUTs (fence, manifest).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from helpers import (
    RequestRecorder,
    assistant_output,
    build_conversation,
    make_entry,
    next_request,
    round_trips,
    system,
    turn_entry,
    user,
)
from s3capture.protocols import TokenCaptureFrozenError
from s3capture.records import ParentResolutionStatus
from s3capture.store import CHAIN_KEYS, S3TokenStore

pytestmark = pytest.mark.all_transports  # every test runs on aioboto3 and obstore (tests/conftest.py)

RESOLVED = ParentResolutionStatus.RESOLVED
PUT, GET, LIST = "PutObject", "GetObject", "ListObjectsV2"

REQ = [system("Be brief."), user("Name a colour.")]


def entry_key(store: S3TokenStore, entry: Any) -> str:
    import hashlib

    from s3capture.records import encode_entry

    prefix = store.layout.rollout(entry.rollout_id)
    sha = hashlib.sha256(encode_entry(entry)).hexdigest()
    return prefix + store.layout.entry_rel(prefix, entry.continuation_fingerprint, entry.model_call_id, sha)


async def put_all(store: S3TokenStore, entries: list[Any], concurrency: int = 48) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def one(entry: Any) -> None:
        async with limit:
            await store.put(entry)

    await asyncio.gather(*(one(e) for e in entries))


# --------------------------------------------------------------------------- put


async def test_put_is_one_put_and_one_fence_get_sent_together(fresh, bucket_url):
    # A put slower than fence_grace reads the fence once more (the documented slow path, tested in
    # test_faults.py); a loaded CI machine once took the first put over the default 1 s. This test
    # is about the normal put, so its grace is far above any such stall.
    store = fresh(fence_grace=30.0)
    rec = await RequestRecorder.attach(store)
    first = make_entry("r", "call-1", REQ, assistant_output("red"), [1, 2], [3])
    await store.put(first)
    assert rec.counts() == {PUT: 1, GET: 1}
    assert rec.keys(PUT) == [entry_key(store, first)]
    assert rec.keys(GET) == [store.layout.rollout("r") + "fence"]
    # Our hook and the store's own counter agree.
    assert dict(store.request_counts) == {PUT: 1, GET: 1}

    # Warm client: the two requests overlap, i.e. both are sent before either answer arrives.
    for index in range(2, 6):
        rec.reset()
        entry = make_entry("r", f"call-{index}", REQ, assistant_output(f"colour {index}"), [1, 2], [3])
        await store.put(entry)
        assert rec.counts() == {PUT: 1, GET: 1}
        assert rec.max_in_flight == 2
        assert [kind for kind, _ in rec.sequence] == ["send", "send", "recv", "recv"], rec.sequence
        assert {op for _, op in rec.sequence[:2]} == {PUT, GET}


async def test_put_budget_is_the_same_for_retries_and_frozen_rollouts(fresh):
    store = fresh()
    entry = make_entry("r", "call-1", REQ, assistant_output("red"), [1, 2], [3])
    await store.put(entry)
    rec = await RequestRecorder.attach(store)
    await store.put(entry)  # identical retry: rewrites the same key
    assert rec.counts() == {PUT: 1, GET: 1}

    await fresh().freeze("r")
    rec.reset()
    late = make_entry("r", "call-2", REQ, assistant_output("blue"), [1, 2], [3])
    with pytest.raises(TokenCaptureFrozenError):
        await store.put(late)
    assert rec.counts() == {PUT: 1, GET: 1}


async def test_delta_put_budget(fresh):
    """A delta put from the client that resolved its parent costs the same single round trip; from
    a client that never saw the parent it first LISTs the rollout's entries and GETs the parent."""
    turns = build_conversation("r", 3)
    writer = fresh()
    await writer.put(turn_entry("r", turns[0]))
    await writer.put(turn_entry("r", turns[1], delta=True, parent_cumulative=turns[0].cumulative))

    worker = fresh()
    resolution = await worker.resolve("r", turns[2].request_items)
    assert resolution.status == RESOLVED
    rec = await RequestRecorder.attach(worker)
    child = turn_entry("r", turns[2], delta=True, parent_cumulative=list(resolution.match.cumulative_token_ids))
    await worker.put(child)
    assert rec.counts() == {PUT: 1, GET: 1}
    assert rec.max_in_flight == 2

    cold = fresh()
    rec = await RequestRecorder.attach(cold)
    await cold.put(child)
    assert rec.counts() == {LIST: 1, GET: 2, PUT: 1}


async def test_begin_call_is_put_then_fence_get(fresh):
    store = fresh()
    rec = await RequestRecorder.attach(store)
    await store.begin_call("r", "call-1")
    assert rec.counts() == {PUT: 1, GET: 1}
    # The intent lands before the fence is read (sequential, unlike put).
    assert rec.sequence == [("send", PUT), ("recv", PUT), ("send", GET), ("recv", GET)]


# --------------------------------------------------------------------------- resolve


async def test_resolve_is_one_list_and_one_get_whatever_the_rollout_holds(fresh, bucket_url):
    writer = fresh(max_concurrency=48)
    target = make_entry("r", "target", REQ, assistant_output("green"), [1, 2, 3], [4])
    others = [make_entry("r", f"other-{i:02d}", REQ, assistant_output(f"other {i}"), [1, 2], [i]) for i in range(50)]
    await put_all(writer, [target, *others])
    await writer.begin_call("r", "in-flight")
    request = [*REQ, *assistant_output("green"), user("another")]

    resolver = fresh()
    rec = await RequestRecorder.attach(resolver)
    resolution = await resolver.resolve("r", request)
    assert resolution.status == RESOLVED and resolution.match.model_call_id == "target"
    assert rec.counts() == {LIST: 1, GET: 1}
    assert rec.keys(GET) == [entry_key(resolver, target)]
    assert rec.max_in_flight == 1

    # The same request again from the same client: the candidate is cached.
    rec.reset()
    again = await resolver.resolve("r", request)
    assert again == resolution
    assert rec.counts() == {LIST: 1}

    # A rollout holding only the target costs the same.
    await fresh().put(make_entry("r-small", "target", REQ, assistant_output("green"), [1, 2, 3], [4]))
    small = fresh()
    rec = await RequestRecorder.attach(small)
    assert (await small.resolve("r-small", request)).status == RESOLVED
    assert rec.counts() == {LIST: 1, GET: 1}


async def test_root_and_no_match_resolves_are_cheap(fresh):
    await fresh().put(make_entry("r", "call-1", REQ, assistant_output("red"), [1], [2]))
    resolver = fresh()
    rec = await RequestRecorder.attach(resolver)
    assert (await resolver.resolve("r", REQ)).status == ParentResolutionStatus.ROOT
    assert rec.counts() == {}
    assert (
        await resolver.resolve("r", [{"role": "assistant", "content": 7}])
    ).status == ParentResolutionStatus.UNRESOLVED
    assert rec.counts() == {}
    resolution = await resolver.resolve("r", [*REQ, *assistant_output("never said"), user("?")])
    assert (resolution.status, resolution.reason) == (ParentResolutionStatus.UNRESOLVED, "no_match")
    assert rec.counts() == {LIST: 1}


async def test_delta_resolve_gets_only_uncached_ancestors(fresh):
    turns = build_conversation("r", 6)
    writer = fresh()
    entries = []
    for index, turn in enumerate(turns):
        entry = turn_entry(
            "r", turn, delta=bool(index), parent_cumulative=turns[index - 1].cumulative if index else None
        )
        await writer.put(entry)
        entries.append(entry)
    keys = [entry_key(writer, e) for e in entries]

    resolver = fresh()
    rec = await RequestRecorder.attach(resolver)
    resolution = await resolver.resolve("r", next_request(turns[2]))
    assert resolution.match.model_call_id == turns[2].call_id
    assert list(resolution.match.cumulative_token_ids) == turns[2].cumulative
    assert rec.counts() == {LIST: 1, GET: 3}
    assert sorted(rec.keys(GET)) == sorted(keys[:3])

    rec.reset()
    resolution = await resolver.resolve("r", next_request(turns[5]))
    assert list(resolution.match.cumulative_token_ids) == turns[5].cumulative
    assert rec.counts() == {LIST: 1, GET: 3}
    assert sorted(rec.keys(GET)) == sorted(keys[3:6])  # calls 0-2 were cached

    for turn in (turns[5], turns[4], turns[1]):
        rec.reset()
        resolution = await resolver.resolve("r", next_request(turn))
        assert list(resolution.match.cumulative_token_ids) == turn.cumulative
        assert rec.counts() == {LIST: 1}


async def test_deep_delta_resolve_fetches_one_checkpoint_and_the_deltas_after_it(fresh):
    depth = 2 * CHAIN_KEYS + 8
    turns = build_conversation("r", depth)
    writer = fresh()
    entries = []
    for index, turn in enumerate(turns):
        entries.append(
            turn_entry("r", turn, delta=bool(index), parent_cumulative=turns[index - 1].cumulative if index else None)
        )
        await writer.put(entries[-1])
    resolver = fresh()
    rec = await RequestRecorder.attach(resolver)
    resolution = await resolver.resolve("r", next_request(turns[-1]))
    assert list(resolution.match.cumulative_token_ids) == turns[-1].cumulative
    # The last checkpoint sits beside call 2K; the deepest call needs it and the calls after it.
    base = 2 * CHAIN_KEYS
    checkpoint = writer.layout.rollout("r") + f"cum/{entries[base].digest}.zst"
    assert rec.counts() == {LIST: 1, GET: 1 + (depth - base)}
    assert sorted(rec.keys(GET)) == sorted([checkpoint, *(entry_key(resolver, e) for e in entries[base:])])
    assert rec.max_in_flight == depth - base


# --------------------------------------------------------------------------- freeze

BIG = 1100


# One server, both transports: the budget is the client's (each transport's own LIST paging and
# GETs); each server's LIST paging past 1,000 keys is covered on every server elsewhere
# (test_store_source.py's >1,000-object rollout, test_adversarial_fence.py's two-page drop), and
# 1,100 puts take ~25 s per server x transport in CI. SeaweedFS: a real S3 implementation, the
# quickest of the three here.
@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
async def test_freeze_budget_large_rollout(fresh, bucket_url):
    writers = [fresh(max_concurrency=32) for _ in range(2)]
    entries = [make_entry("r", f"c{i:05d}", REQ, assistant_output(f"c {i}"), [1, 2], [i]) for i in range(BIG)]
    await asyncio.gather(*(put_all(w, entries[k::2], 32) for k, w in enumerate(writers)))

    freezer = fresh(max_concurrency=32)
    rec = await RequestRecorder.attach(freezer)
    snapshot = await freezer.freeze("r")
    assert not snapshot.incomplete and len(snapshot.entries) == BIG and snapshot.version == BIG
    counts = rec.counts()
    pages = math.ceil((BIG + 1) / 1000)  # entries + the fence
    assert pages == 2
    assert counts[LIST] == pages + 1  # + the LIST after the last key that confirms the end
    assert counts[GET] == BIG + 1  # + the retire tombstone's, beside the LIST
    tombstone = freezer.layout.rollout("r") + "retired"
    assert sorted(rec.keys(GET)) == sorted([tombstone, *(entry_key(freezer, e) for e in entries)])
    assert 1 <= counts[PUT] <= 2  # the fence and the sealed manifest
    assert set(counts) == {LIST, GET, PUT}

    # Again from the same client: the entries are cached and the manifest exists.
    rec.reset()
    again = await freezer.freeze("r")
    assert (again.snapshot_id, again.version) == (snapshot.snapshot_id, snapshot.version)
    counts = rec.counts()
    assert counts[LIST] == math.ceil((BIG + 2) / 1000) + 1  # + the manifest; + the confirming LIST
    assert counts[GET] == 1 and rec.keys(GET) == [tombstone]
    assert counts[PUT] <= 1
    assert set(counts) <= {LIST, PUT, GET}


async def test_freeze_budget_small_rollout(fresh):
    writer = fresh()
    entries = [make_entry("r", f"c{i}", REQ, assistant_output(f"c {i}"), [1, 2], [i]) for i in range(5)]
    await put_all(writer, entries)

    freezer = fresh()
    rec = await RequestRecorder.attach(freezer)
    snapshot = await freezer.freeze("r")
    assert len(snapshot.entries) == 5
    assert rec.counts() == {PUT: 2, LIST: 2, GET: 6}
    # In sequence: the fence PUT, the LIST with the GET of the retire tombstone, the GETs with the
    # LIST after its last key that confirms its end (together), the manifest PUT.
    assert round_trips(rec) == 4, rec.sequence

    rec.reset()
    await freezer.freeze("r")
    assert rec.counts() == {PUT: 1, LIST: 2, GET: 1}
    # the fence PUT, the LIST (and the tombstone's GET), the confirming LIST (cached entries; the
    # manifest exists)
    assert round_trips(rec) == 3, rec.sequence

    # A read-only reader: the LIST, then the entry GETs beside the sealed manifest's GET and the
    # confirming LIST.
    reader = fresh()
    rec = await RequestRecorder.attach(reader)
    assert len((await reader.read_snapshot("r")).entries) == 5
    assert rec.counts() == {LIST: 2, GET: 6}
    assert round_trips(rec) == 2, rec.sequence

    # The writer cached its own entries: its first freeze GETs no entry (the manifest exists).
    rec = await RequestRecorder.attach(writer)
    await writer.freeze("r")
    assert rec.counts() == {PUT: 1, LIST: 2, GET: 1}


async def test_a_freeze_refetches_entries_a_caller_changed_in_one_wave(fresh):
    # A caller that edits a nested part of the entries a freeze handed out (output_items) makes
    # the next hand-out GET those entries again (the cached copies are shared with it). Those GETs
    # go out together, beside the confirming LIST: one round trip, not one per entry (an audit,
    # 2026-12-04: a repeat freeze of 40 such entries took 42 round trips).
    writer = fresh()
    entries = [make_entry("r", f"c{i}", REQ, assistant_output(f"c {i}"), [1, 2], [i]) for i in range(12)]
    await put_all(writer, entries)
    freezer = fresh()
    first = await freezer.freeze("r")
    for entry in first.entries:
        entry.output_items[0]["annotated_by_caller"] = True
    rec = await RequestRecorder.attach(freezer)
    again = await freezer.freeze("r")
    assert rec.counts() == {PUT: 1, LIST: 2, GET: 13}
    # the fence PUT, the LIST (and the tombstone's GET), then the 12 GETs beside the confirming LIST
    assert round_trips(rec) == 3, rec.sequence
    assert all("annotated_by_caller" not in e.output_items[0] for e in again.entries)
    assert again.snapshot_id == first.snapshot_id
