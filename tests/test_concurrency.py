"""Concurrent writers, retries and freezes against real local S3 servers (moto and SeaweedFS).

Multi-process tests spawn worker processes (``multiprocessing`` spawn), each with its own
``S3TokenStore``, that start their puts together behind a barrier. Races with freeze run in one
process with several independent clients. A stalled write is produced deterministically by an
awaiting handler on the writer's own ``before-send`` event (the request still goes to the server).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from helpers import (
    assistant_output,
    build_conversation,
    list_keys,
    make_entry,
    run_put_processes,
    split_bucket_url,
    system,
    turn_entry,
    user,
)

from s3capture.layout import Layout
from s3capture.protocols import TokenCaptureFrozenError, TokenCaptureRetiredError
from s3capture.records import encode_entry
from s3capture.store import S3TokenStore

REQ = [system("Be brief."), user("Count.")]
PROCESSES = 4


def entry_keys(s3_client: Any, bucket_url: str, rollout_id: str) -> list[str]:
    bucket, root = split_bucket_url(bucket_url)
    return [k for k in list_keys(s3_client, bucket, Layout(root).rollout(rollout_id)) if "/log/e/" in k]


def numbered_entries(rollout_id: str, count: int, prefix: str = "call") -> list[Any]:
    return [
        make_entry(rollout_id, f"{prefix}-{i:04d}", REQ, assistant_output(f"{prefix} {i}"), [1, 2, 3], [i, i + 1])
        for i in range(count)
    ]


# --------------------------------------------------------------------------- many processes


async def test_200_puts_from_4_processes_lose_nothing(s3_server, fresh, bucket_url, s3_client):
    entries = numbered_entries("r-mp", 200)
    payloads = [encode_entry(e) for e in entries]
    per_process = [payloads[w::PROCESSES] for w in range(PROCESSES)]
    outcomes = await asyncio.to_thread(run_put_processes, bucket_url, s3_server.env(), per_process)

    results = [o for w in range(PROCESSES) for o in outcomes[w]]
    assert [o for o in results if o[1] != "ok"] == []
    assert sorted(cid for cid, _, _ in results) == sorted(e.model_call_id for e in entries)

    snapshot = await fresh().freeze("r-mp")
    assert not snapshot.incomplete, snapshot.reasons
    assert snapshot.version == 200
    assert sorted(encode_entry(e) for e in snapshot.entries) == sorted(payloads)
    assert len(entry_keys(s3_client, bucket_url, "r-mp")) == 200


async def test_identical_retries_racing_from_4_processes_dedupe(s3_server, fresh, bucket_url, s3_client):
    entries = numbered_entries("r-retry", 25)
    payloads = [encode_entry(e) for e in entries]
    per_process = []
    for w in range(PROCESSES):
        order = list(payloads)
        random.Random(w).shuffle(order)
        per_process.append(order)
    outcomes = await asyncio.to_thread(run_put_processes, bucket_url, s3_server.env(), per_process)

    results = [o for w in range(PROCESSES) for o in outcomes[w]]
    assert len(results) == PROCESSES * 25
    assert [o for o in results if o[1] != "ok"] == []

    snapshot = await fresh().freeze("r-retry")
    assert not snapshot.incomplete, snapshot.reasons
    assert snapshot.version == 25
    assert sorted(encode_entry(e) for e in snapshot.entries) == sorted(payloads)
    assert len(entry_keys(s3_client, bucket_url, "r-retry")) == 25


async def test_conflicting_retries_racing_from_4_processes_mask_the_rollout(s3_server, fresh, bucket_url):
    """Each process sends its own payload for the same call ids: every call id is conflicted."""
    per_process = []
    for w in range(PROCESSES):
        per_process.append(
            [
                encode_entry(
                    make_entry("r-conf", f"call-{i}", REQ, assistant_output("x"), [1], [w], created_at=float(w))
                )
                for i in range(5)
            ]
        )
    outcomes = await asyncio.to_thread(run_put_processes, bucket_url, s3_server.env(), per_process)
    assert [o for w in outcomes for o in outcomes[w] if o[1] != "ok"] == []

    snapshot = await fresh().freeze("r-conf")
    assert snapshot.incomplete
    assert snapshot.entries == ()
    assert snapshot.version == 5 * PROCESSES
    assert sorted(snapshot.reasons) == sorted(f"conflicting_payloads:call-{i}" for i in range(5))


# --------------------------------------------------------------------------- writes racing freeze


@pytest.mark.parametrize("freeze_after", [0, 25, 80])
async def test_late_writes_racing_freeze_never_drop_an_acknowledged_entry(fresh, freeze_after):
    """Invariant: every put that returned is in the snapshot, or the snapshot's drop fails."""
    rollout_id = f"r-race-{freeze_after}"
    entries = numbered_entries(rollout_id, 120)
    make = lambda: fresh(fence_grace=0.5)  # noqa: E731 - one value for every client of the bucket
    writers = [make() for _ in range(4)]
    acked: set[str] = set()
    refused: set[str] = set()
    trigger = asyncio.Event()
    if freeze_after == 0:
        trigger.set()

    async def put(writer: S3TokenStore, limit: asyncio.Semaphore, entry: Any) -> None:
        async with limit:
            try:
                await writer.put(entry)
                acked.add(entry.model_call_id)
            except TokenCaptureFrozenError:
                refused.add(entry.model_call_id)  # landed, and reported as late
        if len(acked) >= freeze_after:
            trigger.set()

    async def freezer() -> Any:
        await trigger.wait()
        return await make().freeze(rollout_id)

    limits = [asyncio.Semaphore(6) for _ in writers]
    snapshot, *_ = await asyncio.gather(
        freezer(), *(put(writers[i % 4], limits[i % 4], e) for i, e in enumerate(entries))
    )
    assert acked | refused == {e.model_call_id for e in entries}
    assert not acked & refused
    assert len(acked) >= freeze_after

    in_snapshot = {e.model_call_id for e in snapshot.entries}
    assert in_snapshot <= acked | refused
    assert not snapshot.incomplete
    assert snapshot.version == len(in_snapshot)

    dropped = await make().drop(rollout_id, snapshot.snapshot_id, snapshot.version)
    if acked - in_snapshot:
        assert not dropped, (
            f"drop succeeded although acknowledged entries {sorted(acked - in_snapshot)[:5]} are missing"
        )
    # Stronger: every entry that landed (acknowledged or reported late) is in a snapshot that drops.
    if (acked | refused) - in_snapshot:
        assert not dropped
    if not dropped:
        # The evidence is kept: a new freeze sees every landed entry and can be consumed.
        again = await make().freeze(rollout_id)
        assert {e.model_call_id for e in again.entries} == acked | refused
        assert not again.incomplete
        assert await make().drop(rollout_id, again.snapshot_id, again.version)


async def test_two_fresh_clients_freezing_concurrently_agree(fresh):
    make = lambda: fresh(fence_grace=0.5)  # noqa: E731 - one value for every client of the bucket
    for rollout_id, masked in (("r-clean", False), ("r-masked", True)):
        writer = make()
        for entry in numbered_entries(rollout_id, 30):
            await writer.put(entry)
        if masked:
            await writer.begin_call(rollout_id, "dangling")
            await writer.mark_incomplete(rollout_id, "call-0003")
        first, second = await asyncio.gather(make().freeze(rollout_id), make().freeze(rollout_id))
        assert (first.snapshot_id, first.version) == (second.snapshot_id, second.version)
        assert first.incomplete == second.incomplete == masked
        assert first.reasons == second.reasons
        assert sorted(map(encode_entry, first.entries)) == sorted(map(encode_entry, second.entries))
        assert len(first.entries) == 30
        # A third client, later, agrees too; exactly one drop wins.
        third = await make().freeze(rollout_id)
        assert (third.snapshot_id, third.version) == (first.snapshot_id, first.version)
        results = await asyncio.gather(
            make().drop(rollout_id, first.snapshot_id, first.version),
            make().drop(rollout_id, second.snapshot_id, second.version),
        )
        assert True in results


async def test_a_drop_whose_tombstone_a_concurrent_drop_deleted_says_false(fresh):
    """Two drops of one snapshot: the one that decides first writes the retire tombstone and then
    deletes the records, the other drop's tombstone among them. That other drop's decisive LIST
    then lacked its own tombstone, and it raised ListingError after five listings (seen in CI once
    the confirming LIST made the first LIST slower); it answers False, as a drop of a rollout
    retired already does, from that one decisive listing (which shows the retire tombstone), not
    after the listing's retries with backoff."""
    make = lambda: fresh(fence_grace=0.2)  # noqa: E731 - one value for every client of the bucket
    writer = make()
    for entry in numbered_entries("r", 3):
        await writer.put(entry)
    snapshot = await writer.freeze("r")
    first, second = make(), make()
    state = {"tombstone": False, "ran": False, "lists_after": 0}

    async def before(operation: str, key: str, continuation: Any) -> None:
        # The second drop's decisive LIST comes after its tombstone PUT: the first drop runs then.
        if operation == "PutObject" and "/drop/" in key:
            state["tombstone"] = True
        elif operation == "ListObjectsV2" and state["tombstone"]:
            state["lists_after"] += 1
            if not state["ran"]:
                state["ran"] = True
                assert await first.drop("r", snapshot.snapshot_id, snapshot.version) is True

    second.transport.add_hook(before=before)
    assert await second.drop("r", snapshot.snapshot_id, snapshot.version) is False
    assert state["ran"]
    # The decisive LIST and the LIST that confirms its end; a retried listing would send more.
    assert state["lists_after"] == 2


# --------------------------------------------------------------------------- a stalled write


class Stall:
    """Holds the writer's entry PutObject (a ``before`` request hook) until released, and notes when the
    writer's fence GET has been answered. The request is sent to the server when released."""

    def __init__(self) -> None:
        self.put_held = asyncio.Event()
        self.fence_answered = asyncio.Event()
        self.release = asyncio.Event()

    async def attach(self, store: S3TokenStore) -> None:
        store.transport.add_hook(before=self._before_put, after=self._after_get)

    async def _before_put(self, operation: str, key: str, continuation: str | None) -> None:
        if operation == "PutObject" and "/log/e/" in key:
            self.put_held.set()
            await self.release.wait()

    def _after_get(self, operation: str, key: str, continuation: str | None) -> None:
        if operation == "GetObject":
            self.fence_answered.set()


async def start_stalled_put(fresh: Any, rollout_id: str, entry: Any, *, intent: bool) -> tuple[asyncio.Task, Stall]:
    writer = fresh()
    if intent:
        await writer.begin_call(rollout_id, entry.model_call_id)
    stall = Stall()
    await stall.attach(writer)
    task = asyncio.create_task(writer.put(entry))
    await asyncio.wait_for(stall.put_held.wait(), 30)
    await asyncio.wait_for(stall.fence_answered.wait(), 30)  # the fence read "open"
    return task, stall


GRACE = 0.5
"""``fence_grace`` for every client of the stalled-write tests (short, to keep drop's wait short)."""


async def test_stalled_put_with_begin_call_masks_the_frozen_rollout(fresh):
    """With the custody intent, a put that is still in flight when freeze lists the rollout leaves
    a dangling intent: the snapshot is incomplete (masked), whatever the put reports later."""
    make = lambda: fresh(fence_grace=GRACE)  # noqa: E731
    turns = build_conversation("r-stall", 3)
    writer = make()
    await writer.put(turn_entry("r-stall", turns[0]))
    await writer.put(turn_entry("r-stall", turns[1]))
    last = turn_entry("r-stall", turns[2])
    task, stall = await start_stalled_put(make, "r-stall", last, intent=True)

    snapshot = await make().freeze("r-stall")
    assert snapshot.incomplete
    assert f"dangling_intent:{last.model_call_id}" in snapshot.reasons
    assert last.model_call_id not in {e.model_call_id for e in snapshot.entries}

    stall.release.set()
    try:
        await asyncio.wait_for(task, 30)
    except TokenCaptureFrozenError:
        pass  # also acceptable: reported as late
    # The late entry changed the version: the snapshot cannot be dropped as consumed.
    assert not await make().drop("r-stall", snapshot.snapshot_id, snapshot.version)


@pytest.mark.parametrize("release", ["before_drop", "during_drop", "after_drop"])
async def test_stalled_put_is_never_acknowledged_and_lost(fresh, s3_client, bucket_url, release):
    """The stale-drop window: a put whose fence read said "open" before the freeze, but whose entry
    PUT lands after the freeze's LIST. Without an intent the snapshot looks complete; the invariant
    is that such a put is either refused (frozen/retired) or the snapshot's drop fails."""
    make = lambda: fresh(fence_grace=GRACE)  # noqa: E731
    turns = build_conversation("r-stall", 3)
    writer = make()
    await writer.put(turn_entry("r-stall", turns[0]))
    await writer.put(turn_entry("r-stall", turns[1]))
    last = turn_entry("r-stall", turns[2])
    task, stall = await start_stalled_put(make, "r-stall", last, intent=False)

    snapshot = await make().freeze("r-stall")
    assert not snapshot.incomplete
    assert last.model_call_id not in {e.model_call_id for e in snapshot.entries}

    async def finish_put() -> str:
        try:
            await asyncio.wait_for(task, 30)
            return "ok"
        except TokenCaptureRetiredError:  # a subclass of TokenCaptureFrozenError
            return "retired"
        except TokenCaptureFrozenError:
            return "frozen"

    if release == "before_drop":
        stall.release.set()
        outcome = await finish_put()
        dropped = await make().drop("r-stall", snapshot.snapshot_id, snapshot.version)
    elif release == "during_drop":
        drop_task = asyncio.create_task(make().drop("r-stall", snapshot.snapshot_id, snapshot.version))
        await asyncio.sleep(0)  # let drop send its first LIST
        stall.release.set()
        outcome = await finish_put()
        dropped = await drop_task
    else:
        dropped = await make().drop("r-stall", snapshot.snapshot_id, snapshot.version)
        stall.release.set()
        outcome = await finish_put()

    assert not (outcome == "ok" and dropped), "put() acknowledged an entry missing from a snapshot whose drop succeeded"
    if release == "after_drop":
        # drop waited until the fence was fence_grace old, so the stalled put ran longer than the
        # grace, read the fence again after landing, and was refused. Its object stays (a write path
        # never deletes a key) as an unused leftover of a retired rollout, until retire removes it.
        assert dropped
        assert outcome == "retired"
        assert len(entry_keys(s3_client, bucket_url, "r-stall")) == 1
        await make().retire(["r-stall"])
        assert not entry_keys(s3_client, bucket_url, "r-stall")
    if release == "before_drop":
        # The entry landed before drop's LIST: the drop fails and the evidence is kept.
        assert not dropped
        assert outcome in ("ok", "frozen")
    if dropped:
        assert outcome == "retired"
