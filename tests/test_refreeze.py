"""A client's second freeze of a rollout reads the fence beside its LIST instead of writing it first.

``S3TokenStore.freeze`` of a rollout this client froze before GETs the fence together with the LIST
(one round trip) and writes nothing when that GET reads the frozen fence and the listing shows it,
with no retire or drop tombstone. Every other state falls back to the first freeze's order (PUT the
fence, then a LIST that must show it): a fence deleted or retired meanwhile, a drop deciding, a
listing that lags. These tests drive each of those states on every server and transport, and check
the promises the fence keeps: a put after the freeze raises, a write racing it fails the drop, a
retired rollout stays retired (``docs/design.md``, races 1 and 2).
"""

from __future__ import annotations

from typing import Any

import pytest

from faultproxy import FaultProxy, ListSkip
from helpers import get_bytes, list_keys, put_bytes, simple_entry, split_bucket_url
from s3capture.protocols import TokenCaptureFrozenError, TokenCaptureRetiredError
from s3capture.rollouts import FENCE_FROZEN, FENCE_RETIRED

pytestmark = pytest.mark.all_transports

GRACE = 0.2
"""fence_grace of every client here (all clients of a bucket must agree)."""


@pytest.fixture
async def proxy(s3_server: Any):
    started = await FaultProxy.for_server(s3_server).start()
    try:
        yield started
    finally:
        await started.stop()


def fence_puts(proxy: FaultProxy, rollout: str) -> int:
    return sum(1 for r in proxy.seen_ops("PUT", f"/rollouts/{rollout}/fence"))


def cids(snapshot: Any) -> list[str]:
    return sorted(e.model_call_id for e in snapshot.entries)


async def test_a_second_freeze_writes_nothing_and_still_sees_a_late_write(fresh, proxy):
    builder = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
    writer = fresh(fence_grace=GRACE)
    await writer.put(simple_entry("r", "c1"))
    first = await builder.freeze("r")
    assert fence_puts(proxy, "r") == 1

    again = await builder.freeze("r")
    assert (again.version, again.snapshot_id) == (first.version, first.snapshot_id)
    assert fence_puts(proxy, "r") == 1, "the second freeze wrote the fence again"
    assert len(proxy.seen_ops("GET", "/rollouts/r/fence")) == 1

    # The fence is still in force: a put raises, and its entry (which lands anyway) is in the next
    # freeze and fails the drop of the first snapshot.
    with pytest.raises(TokenCaptureFrozenError):
        await writer.put(simple_entry("r", "c2"))
    later = await builder.freeze("r")
    assert fence_puts(proxy, "r") == 1
    assert cids(later) == ["c1", "c2"] and later.version == first.version + 1
    assert await builder.drop("r", first.snapshot_id, first.version) is False
    assert await builder.drop("r", later.snapshot_id, later.version) is True


async def test_a_rollout_deleted_and_reused_is_fenced_again(fresh, proxy):
    builder = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
    other = fresh(fence_grace=GRACE)
    await other.put(simple_entry("r", "c1"))
    await builder.freeze("r")
    # Another client deletes the rollout and the id is captured again: no fence any more.
    await other.delete(["r"])
    await other.put(simple_entry("r", "c9"))

    snapshot = await builder.freeze("r")
    assert cids(snapshot) == ["c9"] and not snapshot.incomplete
    assert fence_puts(proxy, "r") == 2, "the fence was not written again after the delete"
    with pytest.raises(TokenCaptureFrozenError):
        await other.put(simple_entry("r", "c10"))


async def test_a_retired_rollout_stays_retired(fresh, proxy, s3_client, bucket_url):
    builder = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
    other = fresh(fence_grace=GRACE)
    await other.put(simple_entry("r", "c1"))
    await builder.freeze("r")
    snapshot = await other.freeze("r")
    assert await other.drop("r", snapshot.snapshot_id, snapshot.version) is True

    with pytest.raises(TokenCaptureRetiredError):
        await builder.freeze("r")
    bucket, root = split_bucket_url(bucket_url)
    assert get_bytes(s3_client, bucket, root + "rollouts/r/fence") == FENCE_RETIRED
    with pytest.raises(TokenCaptureRetiredError):
        await other.put(simple_entry("r", "c2"))


async def test_a_crashed_drop_makes_the_freeze_write_the_frozen_fence(fresh, proxy, s3_client, bucket_url):
    """A drop that crashed after its tombstone and the retired fence (no retire tombstone: it had not
    decided) leaves a fence that reads retired; the freeze must not take the rollout as frozen
    without writing the frozen fence, or the rollout could never be consumed again."""
    builder = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
    await builder.put(simple_entry("r", "c1"))
    first = await builder.freeze("r")
    bucket, root = split_bucket_url(bucket_url)
    put_bytes(s3_client, bucket, root + "rollouts/r/drop/crashed-token", b"")
    put_bytes(s3_client, bucket, root + "rollouts/r/fence", FENCE_RETIRED)

    again = await builder.freeze("r")
    assert (again.version, again.snapshot_id) == (first.version, first.snapshot_id)
    assert fence_puts(proxy, "r") == 2
    assert get_bytes(s3_client, bucket, root + "rollouts/r/fence") == FENCE_FROZEN
    assert await builder.drop("r", again.snapshot_id, again.version) is True
    assert list_keys(s3_client, bucket, root + "rollouts/r/log/") == []


async def test_a_listing_that_hides_the_fence_is_not_built_on(fresh, proxy):
    builder = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
    writer = fresh(fence_grace=GRACE)
    await writer.put(simple_entry("r", "c1"))
    first = await builder.freeze("r")
    hidden = 0

    async def rule(request: Any) -> Any:
        nonlocal hidden
        if request.is_list and "/rollouts/r/" in request.params.get("prefix", "") and hidden == 0:
            hidden += 1
            return ListSkip(match="/fence")
        return None

    proxy.rule = rule
    again = await builder.freeze("r")
    assert hidden == 1
    assert (again.version, again.snapshot_id) == (first.version, first.snapshot_id)
    assert fence_puts(proxy, "r") == 2, "a listing without the fence was trusted"
