"""Adversarial: the fence_grace argument of docs/design.md (stale-drop window) and markers racing drop.

A stalled request is produced by an awaiting ``before`` request hook of the client's transport:
the request is really sent to the server when released (the same technique as
tests/test_concurrency.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from helpers import (
    assistant_output,
    make_entry,
    system,
    user,
)

from s3capture.protocols import TokenCaptureFrozenError
from s3capture.store import S3TokenStore

REQ = [system("Be brief."), user("Count.")]
GRACE = 2.0  # twice the default, for a loaded machine; every client of the bucket uses it


def entry(rollout_id: str, cid: str) -> Any:
    # Same request and output for every call: one fingerprint directory, keys ordered by call id.
    return make_entry(rollout_id, cid, REQ, assistant_output("same"), [1, 2, 3], [4, 5])


class Hold:
    """Holds requests of one client that match ``predicate(key, continuation)`` until released
    (a ``before`` request hook of its transport)."""

    def __init__(self, predicate: Any) -> None:
        self.predicate = predicate
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.answered: list[str] = []

    async def attach(self, store: S3TokenStore, operation: str) -> None:
        self.operation = operation
        store.transport.add_hook(before=self._before, after=self._after)

    async def _before(self, operation: str, key: str, continuation: str | None) -> None:
        if operation == self.operation and self.predicate(key, continuation):
            self.held.set()
            await self.release.wait()

    def _after(self, operation: str, key: str, continuation: str | None) -> None:
        self.answered.append(operation)


# Regression test (found by the adversarial review, fixed in 0d86cd4): drop's grace check uses the Date of the
# LAST page of a paginated LIST; an acknowledged put that lands between the first and last page is missed and
# the drop succeeds
async def test_acknowledged_put_is_not_lost_by_a_drop_whose_list_spans_pages(fresh, s3_client, bucket_url):
    rid = "r-pages"
    builder = fresh(fence_grace=GRACE)
    limit = asyncio.Semaphore(32)

    async def put(e: Any) -> None:
        async with limit:
            await builder.put(e)

    # 1,000 calls: with the fence and a manifest the rollout's LIST takes two pages.
    await asyncio.gather(*(put(entry(rid, f"c-{i:04d}")) for i in range(1000)))

    # A worker's put of call "b-late" (sorts into the first page) reads the fence "open" ...
    writer = fresh(fence_grace=GRACE)
    stall = Hold(lambda key, _: "/log/e/" in key)
    await stall.attach(writer, "PutObject")
    started = time.monotonic()
    late = asyncio.create_task(writer.put(entry(rid, "b-late")))
    await asyncio.wait_for(stall.held.wait(), 30)
    while "GetObject" not in stall.answered:
        await asyncio.sleep(0.01)

    # ... the builder freezes (the late entry is not there yet) ...
    snapshot = await builder.freeze(rid)
    assert not snapshot.incomplete and len(snapshot.entries) == 1000

    # ... and drops at once. Its LIST's first page is served; the second page is slow.
    dropper = fresh(fence_grace=GRACE)
    page2 = Hold(lambda _, continuation: continuation is not None)
    await page2.attach(dropper, "ListObjectsV2")
    drop = asyncio.create_task(dropper.drop(rid, snapshot.snapshot_id, snapshot.version))
    await asyncio.wait_for(page2.held.wait(), 30)

    # Meanwhile the put lands (after the first page), normally well within fence_grace: acknowledged.
    # (On a loaded machine it may outlast the grace, re-read the fence and be refused as frozen,
    # which keeps the promise too; then the drop must still not lose anything acknowledged.)
    stall.release.set()
    try:
        await asyncio.wait_for(late, 30)
        acknowledged = True
    except TokenCaptureFrozenError:
        acknowledged = time.monotonic() - started < GRACE
        assert not acknowledged, "put('b-late') was refused as frozen although it finished within fence_grace"

    # The second page is answered after the fence is fence_grace + 1 s old by the store's clock.
    await asyncio.sleep(GRACE + 1.2)
    page2.release.set()
    dropped = await asyncio.wait_for(drop, 30)

    assert "b-late" not in {e.model_call_id for e in snapshot.entries}
    # put('b-late') was acknowledged and is not in the consumed snapshot: its drop must fail.
    # (Today the drop succeeds; the entry is left behind as an orphan in a retired rollout.)
    assert not (acknowledged and dropped), "acknowledged put('b-late') is missing from a snapshot whose drop succeeded"


# Regression test (found by the adversarial review, fixed in 0d86cd4): a slow mark_incomplete that read the
# fence before drop retired the rollout returns success although its marker landed after the drop's final LIST
# (no fence_grace re-read)
async def test_acknowledged_marker_is_not_silently_outlived_by_a_drop(fresh, s3_client, bucket_url):
    """The protocol: a marker "must change the observable version; that is what invalidates a
    stale retirement". ``put`` closes the stale-drop window by re-reading the fence when it was
    slower than ``fence_grace``; ``mark_incomplete`` does not, so a marker whose PUT stalls past
    the drop's final LIST is acknowledged while the drop it should have invalidated succeeds
    (and the marker is left as an orphan in the retired rollout)."""
    rid = "r-marker"
    builder = fresh(fence_grace=GRACE)
    await builder.put(entry(rid, "c-0"))
    snapshot = await builder.freeze(rid)
    assert not snapshot.incomplete

    worker = fresh(fence_grace=GRACE)
    stall = Hold(lambda key, _: "/log/x/" in key)
    await stall.attach(worker, "PutObject")
    marking = asyncio.create_task(worker.mark_incomplete(rid, "c-1"))
    await asyncio.wait_for(stall.held.wait(), 30)
    while "GetObject" not in stall.answered:  # its fence read ("frozen") is answered
        await asyncio.sleep(0.01)

    dropped = await fresh(fence_grace=GRACE).drop(rid, snapshot.snapshot_id, snapshot.version)
    stall.release.set()
    try:
        await asyncio.wait_for(marking, 30)
        acknowledged = True
    except TokenCaptureFrozenError:  # TokenCaptureRetiredError included
        acknowledged = False
    assert not (dropped and acknowledged), (
        "mark_incomplete succeeded, yet the snapshot it should invalidate was dropped"
    )


class HoldSecond(Hold):
    """Lets the first matching request through and holds the second until released."""

    def __init__(self, predicate: Any) -> None:
        super().__init__(predicate)
        self.passed = 0

    async def _before(self, operation: str, key: str, continuation: str | None) -> None:
        if operation == self.operation and self.predicate(key, continuation):
            self.passed += 1
            if self.passed == 2:
                self.held.set()
                await self.release.wait()


# Regression test (found by the adversarial review, fixed in 0d86cd4): retire writes the retired fence and the
# tombstone in parallel; a freeze whose fence PUT lands between them overwrites 'retired' with 'frozen' and
# does not see the tombstone, leaving a retired rollout whose fence says frozen: late writes raise the wrong
# error and stay behind
async def test_freeze_racing_retire_never_leaves_a_retired_rollout_unretired(fresh, s3_client, bucket_url):
    """Whatever order retire writes its fence and tombstone in, a freeze that runs after the first
    of them landed and before the second must not leave the rollout looking merely frozen."""
    from s3capture.protocols import TokenCaptureRetiredError

    rid = "r-fr"
    await fresh().put(entry(rid, "c-0"))
    retirer = fresh()

    def fence_or_tombstone(key: str, continuation: str | None) -> bool:
        return key.endswith(("/retired", "/fence"))

    hold = HoldSecond(fence_or_tombstone)
    await hold.attach(retirer, "PutObject")
    retiring = asyncio.create_task(retirer.retire([rid]))
    await asyncio.wait_for(hold.held.wait(), 30)  # the first of the two has landed (sequential) or is in flight
    await asyncio.sleep(0.2)
    try:
        await fresh().freeze(rid)
    except TokenCaptureRetiredError:
        pass  # the freeze saw the retirement: fine
    hold.release.set()
    await retiring
    with pytest.raises(TokenCaptureRetiredError):
        await fresh().put(entry(rid, "c-late"))


# Fixed: was a strict xfail (BUG) until the fix landed; now a regression test.
async def test_marker_landing_between_drops_list_and_its_fence_fails_the_drop(fresh):
    """The protocol: mark_incomplete "must change the observable version; that is what
    invalidates a stale retirement". Drop is check (LIST) then act (tombstone, fence, deletes);
    a marker landing in between is acknowledged (its fence re-read still says frozen) while the
    drop goes ahead, and the marker is left behind as an orphan in the retired rollout."""
    rid = "r-marker2"
    builder = fresh(fence_grace=GRACE)
    await builder.put(entry(rid, "c-0"))
    snapshot = await builder.freeze(rid)
    dropper = fresh(fence_grace=GRACE)
    # Hold drop's first write after its final LIST (tombstone or fence, whichever comes first).
    hold = Hold(lambda key, _: key.endswith(("/retired", "/fence")))
    await hold.attach(dropper, "PutObject")
    dropping = asyncio.create_task(dropper.drop(rid, snapshot.snapshot_id, snapshot.version))
    await asyncio.wait_for(hold.held.wait(), 30)
    try:
        await fresh(fence_grace=GRACE).mark_incomplete(rid, "c-1")
        acknowledged = True
    except TokenCaptureFrozenError:
        acknowledged = False
    hold.release.set()
    dropped = await asyncio.wait_for(dropping, 30)
    assert not (dropped and acknowledged), (
        "mark_incomplete succeeded, yet the snapshot it should invalidate was dropped"
    )
