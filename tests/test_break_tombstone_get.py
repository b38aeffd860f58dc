"""Breaking commit c8560c6: ``freeze`` sends its GET of the retire tombstone once the listing is
in, beside the LIST that confirms its end and the entries' GETs (``_freeze_fenced``), and refuses
a snapshot whose GET finds the tombstone (docs/reliability.md, findings 32 and 37)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from faultproxy import ListHideYoung, internal_error
from helpers import RequestRecorder, put_chain, round_trips, simple_entry

# The default transport only (aioboto3), except where a test says otherwise: the transports' own
# differences are covered by tests/test_store_probe_listing.py (every transport); these matrices
# cost CI minutes on three servers.

pytestmark = pytest.mark.usefixtures("not_on_the_ceph_gateway")


PUT, GET, LIST = "PutObject", "GetObject", "ListObjectsV2"


async def _settled(proxy: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while proxy.in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


class _TombstoneTimes(dict):
    """Put times the proxy keeps for its ``ListHideYoung``: retire tombstones only."""

    def __setitem__(self, key: str, value: float) -> None:
        if key.endswith("/retired"):
            super().__setitem__(key, value)


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("max_concurrency, entries", [(2, 1), (4, 2), (4, 3), (8, 6), (8, 7)])
async def test_the_tombstone_get_shares_the_wave_of_the_entries_and_the_confirming_list(
    fresh, max_concurrency: int, entries: int
):
    """docs/design.md's row for ``freeze``: 3 + LIST pages + ceil((uncached + 2) / max_concurrency)
    round trips with the manifest PUT. The tombstone GET goes in the wave of the entries' GETs and
    the confirming LIST (c8560c6); it costs a round trip more than beside the first LIST only where
    it overflows ``max_concurrency`` (a breaker found the commit's "no round trip more" wrong for
    uncached entries + 1 == ``max_concurrency``: with the default 32, 31 entries)."""
    import math

    writer = fresh()
    for index in range(entries):
        await writer.put(simple_entry("r", f"c{index}"))
    freezer = fresh(max_concurrency=max_concurrency)
    rec = await RequestRecorder.attach(freezer)
    snapshot = await freezer.freeze("r")
    assert len(snapshot.entries) == entries
    assert rec.counts() == {PUT: 2, LIST: 2, GET: entries + 1}
    # the fence PUT, the LIST, the waves of GETs and the confirming LIST, the manifest PUT
    assert round_trips(rec) == 3 + math.ceil((entries + 2) / max_concurrency), rec.sequence


# --------------------------------------------------------------------------- a retire under way
@pytest.mark.parametrize("probe_listing", [False, True])
async def test_a_freeze_of_a_rollout_being_retired_whose_entry_get_fails_is_refused(fresh, proxy, probe_listing: bool):
    """A retire has written its tombstone and retired fence and not yet deleted the entries; the
    freeze's listing lags the tombstone's creation (it hides keys 250 ms after their first PUT).
    Before the commit the tombstone's GET (beside the first LIST) refused the rollout without a
    GET of any entry. Now the entries' GETs go first, beside the tombstone's: an entry GET that
    fails makes the freeze raise ``StoreError``, not ``TokenCaptureRetiredError``, and leaves the
    retired rollout's fence "frozen"."""
    from s3capture.protocols import TokenCaptureRetiredError

    await put_chain(fresh(), "r", 2)
    retiring = fresh(endpoint_url=proxy.endpoint)
    prefix = retiring.layout.rollout("r")

    async def rule(request: Any) -> Any:
        if request.is_list:
            return ListHideYoung(60_000.0)
        if request.method == "GET" and "/log/" in request.path:
            return internal_error()
        return None

    proxy.put_times = _TombstoneTimes()  # listings hide the tombstone only
    proxy.rule = rule
    # The state of a retire between its _write_retired and its _delete_keys.
    await retiring._write_retired(prefix)
    freezer = fresh(endpoint_url=proxy.endpoint, probe_listing=probe_listing)
    with pytest.raises(TokenCaptureRetiredError):
        await freezer.freeze("r")
    proxy.rule = None
    assert await fresh()._fence_state(prefix) == "retired"


# --------------------------------------------------------------------------- a failing tombstone GET
def _tombstone_get(request: Any) -> bool:
    return request.method == "GET" and not request.is_list and request.path.endswith("/r/retired")


@pytest.mark.parametrize("fault", ["500", "403", "lost"])
@pytest.mark.parametrize("probe_listing", [False, True])
async def test_a_live_rollout_whose_tombstone_get_fails_is_frozen(
    fresh, proxy, caplog, fault: str, probe_listing: bool
):
    """Every GET of the tombstone fails: the freeze logs a warning and the listing decides (a live
    rollout: its snapshot), within a bounded time, on a first freeze and a re-freeze."""
    from faultproxy import DropResponse, s3_error

    await put_chain(fresh(), "r", 2)
    action = {
        "500": internal_error(),
        "403": s3_error(403, "AccessDenied", "Access Denied", "Forbidden"),
        "lost": DropResponse(),
    }[fault]

    async def rule(request: Any) -> Any:
        return action if _tombstone_get(request) else None

    proxy.rule = rule
    freezer = fresh(endpoint_url=proxy.endpoint, probe_listing=probe_listing)
    for _ in range(2):
        started = time.monotonic()
        snapshot = await asyncio.wait_for(freezer.freeze("r"), 60)
        assert len(snapshot.entries) == 2 and not snapshot.incomplete
        assert time.monotonic() - started < 30
    assert "GET of the retire tombstone failed" in caplog.text
    proxy.rule = None
    assert await fresh()._fence_state(freezer.layout.rollout("r")) == "frozen"


@pytest.mark.parametrize("probe_listing", [False, True])
async def test_a_slow_tombstone_get_delays_but_decides(fresh, proxy, probe_listing: bool):
    """A rollout retired through the proxy, whose listings never show its tombstone (only that key
    counts as young): the tombstone GET answers after 0.5 s; the freeze waits for it and refuses the
    rollout, fence restored to retired."""
    from s3capture.protocols import TokenCaptureRetiredError

    await put_chain(fresh(), "r", 2)
    await fresh().freeze("r")
    proxy.put_times = _TombstoneTimes()
    proxy.rule = _lag
    await fresh(endpoint_url=proxy.endpoint).retire(["r"])

    async def rule(request: Any) -> Any:
        if request.is_list:
            return ListHideYoung(60_000.0)  # listings never show what the proxy saw created
        if _tombstone_get(request):
            await asyncio.sleep(0.5)
        return None

    proxy.rule = rule
    freezer = fresh(endpoint_url=proxy.endpoint, probe_listing=probe_listing)
    with pytest.raises(TokenCaptureRetiredError):
        await asyncio.wait_for(freezer.freeze("r"), 60)
    proxy.rule = None
    assert await fresh()._fence_state(freezer.layout.rollout("r")) == "retired"


# --------------------------------------------------------------------------- a reused id
@pytest.mark.parametrize("probe_listing", [False, True])
async def test_a_reused_id_after_delete_is_not_refused_for_the_old_tombstone(
    fresh, proxy, s3_client, probe_listing: bool
):
    """Generation 1 is frozen, retired (through the proxy: its tombstone is young there) and
    deleted; generation 2 reuses the id and freezes through a listing that lags creations: a
    snapshot of generation 2, never TokenCaptureRetiredError."""
    old = fresh()
    await put_chain(old, "r", 2)
    await old.freeze("r")
    await old.retire(["r"])
    assert (await old.delete(["r"]))["removed"] == ["r"]
    proxy.rule = _lag
    writer = fresh(endpoint_url=proxy.endpoint)
    await writer.put(simple_entry("r", "new"))
    freezer = fresh(endpoint_url=proxy.endpoint, probe_listing=probe_listing)
    snapshot = await freezer.freeze("r")
    assert [e.model_call_id for e in snapshot.entries] == ["new"]


async def _lag(request: Any) -> Any:
    return ListHideYoung(150.0) if request.is_list else None


# --------------------------------------------------------------------------- cancellation
@pytest.mark.parametrize("after_ms", [0, 30, 100, 400])
@pytest.mark.parametrize("probe_listing", [False, True])
async def test_a_freeze_of_a_retired_rollout_cancelled_anywhere_hands_out_nothing_and_seals_nothing(
    fresh, proxy, s3_client, bucket_url, after_ms: int, probe_listing: bool
):
    """A retired rollout (tombstone young for the proxy's listings) frozen through slow requests,
    cancelled at 0-400 ms: CancelledError or TokenCaptureRetiredError, never a snapshot; no
    manifest and no probe under the rollout once its requests settled."""
    from helpers import list_keys, split_bucket_url
    from s3capture.protocols import TokenCaptureRetiredError

    await put_chain(fresh(), "r", 2)
    retirer = fresh(endpoint_url=proxy.endpoint)

    async def rule(request: Any) -> Any:
        if request.is_list:
            return ListHideYoung(60_000.0)
        if request.method in ("GET", "PUT"):
            await asyncio.sleep(0.03)
        return None

    proxy.put_times = _TombstoneTimes()
    proxy.rule = rule
    await retirer.retire(["r"])
    freezer = fresh(endpoint_url=proxy.endpoint, probe_listing=probe_listing)
    task = asyncio.ensure_future(freezer.freeze("r"))
    await asyncio.sleep(after_ms / 1000)
    task.cancel()
    with pytest.raises((asyncio.CancelledError, TokenCaptureRetiredError)):
        await asyncio.wait_for(task, 30)
    await _settled(proxy)
    bucket, root = split_bucket_url(bucket_url)
    left = [k for k in list_keys(s3_client, bucket, root) if "/snap/" in k or "/.probe/" in k]
    assert left == []


# --------------------------------------------------------------------------- a racing drop
@pytest.mark.parametrize("delay_ms", [0, 50, 200])
@pytest.mark.parametrize("probe_listing", [False, True])
async def test_a_freeze_racing_a_drop_leaves_no_manifest_and_no_frozen_fence_under_the_retired_rollout(
    fresh, proxy, s3_client, bucket_url, delay_ms: int, probe_listing: bool
):
    """A frozen rollout is dropped by one client while another freezes it again through a listing
    that lags the tombstones' creation, with slow requests. Whatever each returns, once both have
    settled: a dropped rollout keeps no sealed manifest, and its fence is retired."""
    from helpers import list_keys, split_bucket_url
    from s3capture.protocols import TokenCaptureRetiredError

    await put_chain(fresh(), "r", 3)
    first = await fresh().freeze("r")
    proxy.put_times = _TombstoneTimes()

    async def rule(request: Any) -> Any:
        if request.is_list:
            return ListHideYoung(60_000.0)
        if request.method in ("GET", "PUT", "DELETE", "POST"):
            await asyncio.sleep(0.02)
        return None

    proxy.rule = rule
    dropper = fresh(endpoint_url=proxy.endpoint, fence_grace=0.05)
    freezer = fresh(endpoint_url=proxy.endpoint, probe_listing=probe_listing)

    async def freeze_later() -> Any:
        await asyncio.sleep(delay_ms / 1000)
        try:
            return await freezer.freeze("r")
        except TokenCaptureRetiredError as error:
            return error

    dropped, frozen = await asyncio.gather(dropper.drop("r", first.snapshot_id, first.version), freeze_later())
    await _settled(proxy)
    proxy.rule = None
    bucket, root = split_bucket_url(bucket_url)
    keys = list_keys(s3_client, bucket, root)
    if dropped:
        assert [k for k in keys if "/snap/" in k or "/.probe/" in k] == [], (frozen, keys)
        assert await fresh()._fence_state(freezer.layout.rollout("r")) == "retired", (frozen, keys)
