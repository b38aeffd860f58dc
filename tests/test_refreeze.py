"""A client's second freeze of a rollout must see what landed since its first one, under a listing
that lags writes.

A freeze PUTs the fence and then LISTs until the listing shows that fence: the write is also the
listing's freshness check (``docs/design.md``, "Read-after-write and list-after-write
consistency"). A shortcut tried on 2026-12-02 (a second freeze by the same client GETting the fence
beside its LIST and building on any listing that showed the old fence) returned the first snapshot
unchanged here, under FaultProxy's ``ListHideYoung`` (keys PUT less than 0.6 s ago are left out of
listings): an acknowledged marker, an acknowledged put and a retire tombstone were all missed. A
breaker session wrote these three cases; each passes when the freeze either sees the write or
refuses the lagging listing (``ListingError``), never when it hands out the stale snapshot.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from faultproxy import FaultProxy, ListHideYoung, internal_error
from helpers import get_bytes, list_keys, simple_entry, split_bucket_url
from s3capture.errors import ListingError, StoreError
from s3capture.protocols import TokenCaptureRetiredError
from s3capture.rollouts import FENCE_FROZEN

pytestmark = pytest.mark.all_transports

GRACE = 0.2
LAG_MS = 600.0
"""How long a new key stays out of listings (an index that lags writes by < 1 s)."""


def lags(request: Any) -> bool:
    return request.is_list and "/rollouts/r/" in request.params.get("prefix", "")


def fence_puts(proxy: FaultProxy) -> int:
    return len(proxy.seen_ops("PUT", "/rollouts/r/fence"))


async def test_1_marker_acknowledged_before_a_second_freeze_is_hidden_and_the_freeze_looks_complete(fresh, proxy):
    """Promise 4 (and freeze's contract: "incomplete when ... a marker exists").

    worker puts c1; builder freezes (complete); later a worker's call of that rollout fails and
    mark_incomplete returns (acknowledged: the rollout is masked). The builder freezes again (a
    re-check before its drop). The listing lags by LAG_MS: it shows the old fence but not the new
    marker. Old path: its fresh fence PUT is not listed until the marker is, so the snapshot is
    incomplete (or ListingError). New path: a complete snapshot identical to the first one."""
    builder = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
    worker = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
    await worker.put(simple_entry("r", "c1"))
    first = await builder.freeze("r")
    assert not first.incomplete
    await asyncio.sleep(LAG_MS / 1000 + 0.3)  # everything so far is listed

    async def rule(request: Any) -> Any:
        return ListHideYoung(LAG_MS) if lags(request) else None

    proxy.rule = rule
    await worker.mark_incomplete("r", "c2")  # returned: acknowledged
    try:
        again = await builder.freeze("r")
    except ListingError:
        return  # no snapshot built on a lagging listing: held
    written = fence_puts(proxy) - 1
    complete = not again.incomplete
    # What the consumer's conditional drop of that snapshot does (promise 1's last resort).
    try:
        dropped: Any = await builder.drop("r", again.snapshot_id, again.version)
    except StoreError as error:  # its decisive LIST may outlast the lag's retries
        dropped = f"raised {type(error).__name__}"
    assert not complete, (
        f"an acknowledged marker is not in the second freeze: complete snapshot, version {again.version} "
        f"(first {first.version}, same id: {again.snapshot_id == first.snapshot_id}), "
        f"fence PUTs by the second freeze: {written}; its drop returned {dropped}"
    )


async def test_2_a_retire_that_crashed_before_its_fence_is_hidden_and_the_freeze_hands_out_the_rollout(
    fresh, proxy, s3_client, bucket_url
):
    """Promise 3 (a retired rollout stays retired: freeze raises TokenCaptureRetiredError).

    builder puts c1 and freezes. An operator retires the rollout: its retire tombstone lands, and
    then the operator is cancelled/crashes while its retired-fence PUT is in flight (the PUT never
    reaches the server). The rollout now has the `retired` tombstone (rollouts() reports it
    retired; mark_incomplete raises Retired) and a frozen fence. The builder freezes again while
    the listing lags by LAG_MS. Old path: its fence PUT is listed only after `retired` is, so it
    restores the retired fence and raises. New path: GET reads the (old) frozen fence, the lagging
    listing shows the old fence and hides `retired`: a complete snapshot of the retired rollout."""
    builder = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
    operator = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
    await builder.put(simple_entry("r", "c1"))
    first = await builder.freeze("r")
    await asyncio.sleep(LAG_MS / 1000 + 0.3)

    arrived, release = asyncio.Event(), asyncio.Event()
    held = [0]

    async def rule(request: Any) -> Any:
        if request.method == "PUT" and request.path.endswith("/rollouts/r/fence") and held[0] == 0:
            held[0] += 1  # the operator's retired fence: held, then never applied
            arrived.set()
            await release.wait()
            return internal_error()
        return ListHideYoung(LAG_MS) if lags(request) else None

    proxy.rule = rule
    retiring = asyncio.create_task(operator.retire(["r"]))
    await asyncio.wait_for(arrived.wait(), 30)
    retiring.cancel()  # the operator is cancelled (or killed) with its fence PUT in flight
    with pytest.raises(asyncio.CancelledError):
        await retiring
    release.set()
    bucket, root = split_bucket_url(bucket_url)
    assert "retired" in [k.rsplit("/", 1)[-1] for k in list_keys(s3_client, bucket, root + "rollouts/r/")]
    assert get_bytes(s3_client, bucket, root + "rollouts/r/fence") == FENCE_FROZEN

    before = fence_puts(proxy)
    try:
        snapshot = await builder.freeze("r")
    except (TokenCaptureRetiredError, ListingError):
        return  # held
    written = fence_puts(proxy) - before
    try:
        dropped: Any = await builder.drop("r", snapshot.snapshot_id, snapshot.version)
    except StoreError as error:  # its decisive LIST may outlast the lag's retries
        dropped = f"raised {type(error).__name__}"
    pytest.fail(
        f"freeze of a rollout with the retire tombstone returned a snapshot: {len(snapshot.entries)} entries, "
        f"incomplete={snapshot.incomplete}, same as first: {snapshot.snapshot_id == first.snapshot_id}; "
        f"fence PUTs by the builder's second freeze: {written}; its drop returned {dropped}"
    )


async def test_3_a_put_acknowledged_before_a_second_freeze_is_not_in_it(fresh, proxy):
    """put's contract: "When it returns, the entry is durable and visible to every client's resolve
    and freeze". A put racing the first freeze (its fence GET came before the fence; its entry PUT
    lands after that freeze's LIST, within fence_grace) is acknowledged. The builder's second freeze
    (the listing lags by LAG_MS) returns the first snapshot again, same version and id, without it.
    Old path: the second freeze lists the put (version + 1). Promise 1 still holds here: the drop
    of that snapshot fails (its decisive LIST needs its fresh tombstone)."""
    grace = 5.0  # well over LAG_MS and a loaded CI host: the racing put is acknowledged although its PUT lands late
    builder = fresh(endpoint_url=proxy.endpoint, fence_grace=grace)
    writer = fresh(endpoint_url=proxy.endpoint, fence_grace=grace)
    await writer.put(simple_entry("r", "c1"))
    arrived, release = asyncio.Event(), asyncio.Event()
    lagging = [False]

    async def rule(request: Any) -> Any:
        if request.method == "PUT" and "/rollouts/r/log/" in request.path and "c2" in request.path:
            arrived.set()
            await release.wait()
            return None
        return ListHideYoung(LAG_MS) if lagging[0] and lags(request) else None

    proxy.rule = rule
    racing = asyncio.create_task(writer.put(simple_entry("r", "c2", text="b")))
    await asyncio.wait_for(arrived.wait(), 30)
    await asyncio.sleep(0.1)  # its fence GET (sent with the PUT) has read "open"
    first = await builder.freeze("r")
    assert [e.model_call_id for e in first.entries] == ["c1"]
    await asyncio.sleep(LAG_MS / 1000 + 0.1)  # the fence is now old enough to be listed
    lagging[0] = True  # from now on the listing lags writes by LAG_MS
    release.set()
    await racing  # acknowledged
    try:
        again = await builder.freeze("r")
    except ListingError:
        return  # no snapshot built on a lagging listing: held
    assert "c2" in [e.model_call_id for e in again.entries], (
        f"an acknowledged put is not in a freeze that started after it returned: version {again.version} "
        f"(first {first.version}, same id: {again.snapshot_id == first.snapshot_id})"
    )


async def test_a_changed_entry_whose_object_was_damaged_since_raises_a_store_error(fresh, bucket_url, s3_client):
    """A hand-out GETs again the entries a caller changed in place; bytes that no longer match the
    key's SHA-256 are read again (as every entry read is), then raise ``StoreError`` naming the key
    (not ``RecordError``, a ``ValueError``: the snapshot's id and reasons are decided by then, so
    this is the store failing). A review, 2026-12-04."""
    writer = fresh()
    for cid in ("c1", "c2"):
        await writer.put(simple_entry("r", cid))
    freezer = fresh()
    first = await freezer.freeze("r")
    for entry in first.entries:
        entry.output_items[0]["annotated_by_caller"] = True  # the items are shared with the cache
    bucket, root = split_bucket_url(bucket_url)
    damaged = list_keys(s3_client, bucket, f"{root}rollouts/r/log/e/")[0]
    s3_client.put_object(Bucket=bucket, Key=damaged, Body=b"not an entry")
    with pytest.raises(StoreError, match="no longer reads as the entry") as raised:
        await freezer.freeze("r")
    assert raised.value.key == damaged


async def test_a_freeze_whose_listing_lags_a_retire_still_refuses_the_retired_rollout(
    fresh, proxy, bucket_url, s3_client
):
    """The model with listings that lag (2026-12-04): a drop consumed the rollout, and a freeze
    whose listing did not show the drop's retire tombstone yet (a new key; the fence existed
    already, so its showing proved nothing) handed out an empty snapshot and left the retired
    rollout's fence "frozen". The freeze now also GETs the tombstone beside its LIST."""
    from faultproxy import ListSkip

    writer = fresh(fence_grace=GRACE)
    await writer.put(simple_entry("r", "c1"))
    snapshot = await writer.freeze("r")
    await asyncio.sleep(GRACE + 0.1)
    assert await writer.drop("r", snapshot.snapshot_id, snapshot.version)

    async def rule(request: Any) -> Any:
        return ListSkip(match="/rollouts/r/retired") if lags(request) else None

    proxy.rule = rule
    with pytest.raises(TokenCaptureRetiredError):
        await fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE).freeze("r")
    bucket, root = split_bucket_url(bucket_url)
    assert get_bytes(s3_client, bucket, f"{root}rollouts/r/fence") != FENCE_FROZEN  # retired, as the drop left it
    with pytest.raises(TokenCaptureRetiredError):
        await writer.put(simple_entry("r", "c2"))
