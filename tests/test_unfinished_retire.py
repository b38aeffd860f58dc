"""A retire tombstone without a fence: writers take the rollout for open, readers for retired.

Writers (``put``, ``begin_call``, ``mark_incomplete``) read only the fence; ``freeze``, ``ls``,
``status`` and ``gc`` read the retire tombstone. A breaker session (2026-12-02) reached the state
where the two disagree, on the wire:

- ``delete`` sent the fence and the tombstone in one DeleteObjects (or as two concurrent DELETEs
  where the store lacks DeleteObjects); a failed DELETE of the tombstone left it without a fence,
  the reusing attempt's puts were acknowledged, and ``gc --yes`` deleted them as stragglers;
- a ``retire`` whose fence PUT fails after its tombstone PUT leaves the same state.

``delete`` now removes the tombstone, then the fence, one request after the other, so a failure
leaves a fenced rollout (writes refused) that a second ``delete`` finishes. ``gc`` leaves a
tombstone without a fence alone and ``status`` counts it. Faults are injected by ``FaultProxy`` in
front of the real test server; every test runs on both transports.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from faultproxy import FaultProxy, ListSkip, Respond, internal_error, not_implemented_xml
from helpers import list_keys, simple_entry, split_bucket_url

from s3capture.layout import Layout
from s3capture.ops import gc, status
from s3capture.protocols import TokenCaptureRetiredError
from s3capture.store import StoreError, default_botocore_config

pytestmark = pytest.mark.all_transports

# One attempt per request, so an injected 500 fails the call at once on either transport (the
# obstore transport takes its attempts from the same botocore Config).
NO_RETRIES = default_botocore_config(
    16, retries={"mode": "standard", "max_attempts": 1}, s3={"addressing_style": "path"}
)


def _left(s3_client: Any, bucket_url: str, rollout_id: str) -> list[str]:
    bucket, root = split_bucket_url(bucket_url)
    prefix = Layout(root.rstrip("/")).rollout(rollout_id)
    return sorted(key[len(prefix) :] for key in list_keys(s3_client, bucket, prefix))


async def _proxy(s3_server: Any) -> FaultProxy:
    return await FaultProxy(s3_server.port, credentials=(s3_server.access_key, s3_server.secret_key)).start()


async def _retired_rollout(store: Any, rollout_id: str) -> None:
    """A rollout captured, frozen and dropped: its fence and tombstone are all that is left."""
    await store.put(simple_entry(rollout_id, "old-1"))
    snapshot = await store.freeze(rollout_id)
    assert await store.drop(rollout_id, snapshot.snapshot_id, snapshot.version)


@pytest.mark.parametrize("failing", ["retired", "fence"])
async def test_a_delete_that_fails_midway_leaves_the_rollout_fenced(
    s3_server, fresh, s3_client, bucket_url, failing
) -> None:
    """Whichever of the two DELETEs fails, the rollout keeps its fence: a reusing attempt's put
    raises (nothing is acknowledged), and a second delete finishes."""
    proxy = await _proxy(s3_server)
    try:
        store = fresh(endpoint_url=proxy.endpoint, botocore_config=NO_RETRIES)
        await _retired_rollout(store, "reused")
        assert _left(s3_client, bucket_url, "reused") == ["fence", "retired"]

        async def rule(request: Any) -> Any:
            # A store without DeleteObjects (GCS's XML API), where one DELETE fails: the old code
            # sent the fence's and the tombstone's DELETEs together, so the fence could go alone.
            if request.method == "POST" and "delete" in request.params:
                return Respond(501, not_implemented_xml(), "Not Implemented")
            if request.method == "DELETE" and request.key.endswith("/reused/" + failing):
                return internal_error()
            return None

        proxy.rule = rule
        with pytest.raises(StoreError):
            await store.delete(["reused"])
        left = _left(s3_client, bucket_url, "reused")
        assert "fence" in left, left  # never a tombstone without a fence
        with pytest.raises(TokenCaptureRetiredError):
            await fresh().put(simple_entry("reused", "new-1"))
        proxy.rule = None
        assert (await store.delete(["reused"]))["removed"] == ["reused"]
        assert _left(s3_client, bucket_url, "reused") == []
        await fresh().put(simple_entry("reused", "new-1"))  # the id now reads as unused
    finally:
        await proxy.stop()


async def test_delete_removes_the_tombstone_before_the_fence(s3_server, fresh, s3_client, bucket_url) -> None:
    """The order on the wire: the tombstone's DELETE is answered before the fence's is sent."""
    proxy = await _proxy(s3_server)
    try:
        store = fresh(endpoint_url=proxy.endpoint)
        await _retired_rollout(store, "ordered")
        proxy.requests.clear()
        assert (await store.delete(["ordered"]))["removed"] == ["ordered"]
        deletes = [r for r in proxy.requests if r.method == "DELETE"]
        assert [r.key.rsplit("/", 1)[-1] for r in deletes] == ["retired", "fence"]
        # the fence's DELETE arrived after the tombstone's had been forwarded (and answered)
        assert deletes[1].arrived >= (deletes[0].forwarded or 0)
        assert not any(r.method == "POST" and b"/ordered/fence" in r.body for r in proxy.requests)
    finally:
        await proxy.stop()


async def test_a_retire_that_fails_midway_leaves_writers_refused(s3_server, fresh, s3_client, bucket_url) -> None:
    """An open rollout's retire writes the retired fence first, then the tombstone: when the
    tombstone's PUT fails, writers are refused (nothing more is acknowledged), no reader takes the
    rollout for retired, and a freeze takes it back complete (the retire did not happen). The old
    order (tombstone first) left a tombstone without a fence, whose later puts were acknowledged
    and then deleted by gc, directly or after a freeze rewrote the fence (a breaker, 2026-12-02)."""
    proxy = await _proxy(s3_server)
    try:
        store = fresh(endpoint_url=proxy.endpoint, botocore_config=NO_RETRIES)
        await store.put(simple_entry("half", "c1"))

        async def rule(request: Any) -> Any:
            if request.method == "PUT" and request.key.endswith("/half/retired"):
                return internal_error()
            return None

        proxy.rule = rule
        with pytest.raises(StoreError):
            await store.retire(["half"])
        proxy.rule = None
        left = _left(s3_client, bucket_url, "half")
        assert "fence" in left and "retired" not in left, left
        with pytest.raises(TokenCaptureRetiredError):
            await fresh().put(simple_entry("half", "c2"))  # refused: never acknowledged
        assert (await status(fresh())).unfinished_retires == 0
        snapshot = await fresh().freeze("half")  # the retire did not happen
        assert [e.model_call_id for e in snapshot.entries if e.model_call_id == "c1"] == ["c1"]
        assert (await fresh().retire(["half"]))["removed"] == ["half"]  # a second retire finishes
        assert _left(s3_client, bucket_url, "half") == ["fence", "retired"]
    finally:
        await proxy.stop()


@pytest.mark.parametrize("then_freeze", [False, True], ids=["gc", "freeze-then-gc"])
async def test_gc_leaves_a_tombstone_without_a_fence_alone(
    s3_server, fresh, s3_client, bucket_url, then_freeze
) -> None:
    """The state a retire or delete of a release before 2026-12-02 could leave: a retire tombstone
    and no fence. A later put is acknowledged (writers read the fence, which is absent), so gc must
    not delete it as a straggler; status counts the rollout; a second retire finishes (and
    discards it, as retire does).

    With ``then_freeze``, a freeze meets the tombstone, raises TokenCaptureRetiredError and writes
    the retired fence back, which makes the state look like a finished retire with stragglers:
    gc then deletes the acknowledged put. That is the documented limit of this guard (a breaker,
    2026-12-02): today's retire and delete never leave the state, and operations.md says to retire
    or delete such rollouts of older releases again."""
    writer = fresh()
    await writer.put(simple_entry("half", "c1"))
    bucket, root = split_bucket_url(bucket_url)
    s3_client.put_object(Bucket=bucket, Key=Layout(root.rstrip("/")).rollout("half") + "retired", Body=b"")
    await writer.put(simple_entry("half", "c2"))  # acknowledged: the fence is absent
    acknowledged = [k for k in _left(s3_client, bucket_url, "half") if "/c2/" in k]
    assert len(acknowledged) == 1
    reader = fresh()
    assert (await status(reader)).unfinished_retires == 1
    if then_freeze:
        with pytest.raises(TokenCaptureRetiredError):
            await fresh().freeze("half")
        assert "fence" in _left(s3_client, bucket_url, "half")
        return  # from here gc sees a retired rollout with stragglers (rule 5): the documented limit
    actions: list[Any] = []
    # "now" an hour ahead: every key is old enough whatever the store's clock resolution
    done = await gc(reader, 0.0, now=time.time() + 3600, dry_run=False, on_action=actions.append)
    assert done.unfinished == 1 and done.retired_again == 0 and done.deleted_rollouts == 0
    assert [a.action for a in actions if a.rollout_id == "half"] == ["skipped"]
    assert "did not finish" in actions[0].reason
    assert acknowledged[0] in _left(s3_client, bucket_url, "half")  # gc deleted nothing

    # The owner's call: a second retire finishes (fence written first, objects discarded).
    assert (await fresh().retire(["half"]))["removed"] == ["half"]
    assert _left(s3_client, bucket_url, "half") == ["fence", "retired"]
    assert (await status(fresh())).unfinished_retires == 0
    with pytest.raises(TokenCaptureRetiredError):
        await writer.put(simple_entry("half", "c3"))


async def test_delete_removes_a_tombstone_its_listing_skipped(s3_server, fresh, s3_client, bucket_url) -> None:
    """A listing that skips the retire tombstone must not make delete leave it without a fence:
    the tombstone's DELETE is sent whether or not it was listed (a breaker, 2026-12-02)."""
    proxy = await _proxy(s3_server)
    try:
        store = fresh(endpoint_url=proxy.endpoint)
        await _retired_rollout(store, "skipped")

        async def rule(request: Any) -> Any:
            if request.is_list and "/skipped/" in request.params.get("prefix", ""):
                return ListSkip(match="/skipped/retired")
            return None

        proxy.rule = rule
        assert (await store.delete(["skipped"]))["removed"] == ["skipped"]
        proxy.rule = None
        assert _left(s3_client, bucket_url, "skipped") == []
    finally:
        await proxy.stop()


async def test_gc_deletes_only_listed_keys_of_a_bare_tombstone(s3_server, fresh, s3_client, bucket_url) -> None:
    """A tombstone alone (no fence, no records): gc deletes the tombstone and sends no DELETE for
    the fence it did not list (rule 3)."""
    proxy = await _proxy(s3_server)
    try:
        store = fresh(endpoint_url=proxy.endpoint)
        await _retired_rollout(store, "bare")
        bucket, root = split_bucket_url(bucket_url)
        s3_client.delete_object(Bucket=bucket, Key=Layout(root.rstrip("/")).rollout("bare") + "fence")
        assert _left(s3_client, bucket_url, "bare") == ["retired"]
        proxy.requests.clear()
        done = await gc(store, 0.0, now=time.time() + 3600, dry_run=False)
        assert done.deleted_rollouts == 1
        assert _left(s3_client, bucket_url, "bare") == []
        deleted = [r.key.rsplit("/", 1)[-1] for r in proxy.requests if r.method == "DELETE"]
        assert deleted == ["retired"]
    finally:
        await proxy.stop()


async def test_a_delete_of_a_live_rollout_that_fails_midway_leaves_it_retired(
    s3_server, fresh, ledgers, s3_client, bucket_url
) -> None:
    """delete removed an open rollout's (or a live ledger's) records with nothing fencing it: a
    failure among them left some entries and no intents, which a freeze took for a complete
    rollout and a ledger manifest for a whole ledger (a breaker, 2026-12-02). delete now retires
    first, so the leftovers read as retired, and a second delete finishes."""
    from s3capture.protocols import RolloutRetiredError

    from helpers import assistant_output, make_commit, system, user

    proxy = await _proxy(s3_server)
    try:
        store = fresh(endpoint_url=proxy.endpoint, botocore_config=NO_RETRIES)
        ledger = ledgers(endpoint_url=proxy.endpoint, botocore_config=NO_RETRIES)
        for cid in ("c0", "c1"):
            await store.begin_call("live", cid)
            await store.put(simple_entry("live", cid))
        request = [system("Be brief."), user("Hi")]
        for cid in ("call-0", "call-1"):
            await ledger.record(make_commit("live-ledger", cid, request, assistant_output(cid)))

        async def rule(request: Any) -> Any:
            # A store without DeleteObjects, and one record's DELETE failing.
            if request.method == "POST" and "delete" in request.params:
                return Respond(501, not_implemented_xml(), "Not Implemented")
            if request.method == "DELETE" and ("/c1/" in request.key or "/call-1/" in request.key):
                return internal_error()
            return None

        proxy.rule = rule
        with pytest.raises(StoreError):
            await store.delete(["live"])
        with pytest.raises(StoreError):
            await ledger.delete(["live-ledger"])
        proxy.rule = None
        with pytest.raises(TokenCaptureRetiredError):
            await fresh().freeze("live")  # never a rollout with a hole that looks complete
        with pytest.raises(RolloutRetiredError):
            await ledgers().manifest("live-ledger")  # never a half-deleted ledger that reads as live
        with pytest.raises(TokenCaptureRetiredError):
            await fresh().put(simple_entry("live", "c2"))  # writers refused meanwhile
        assert (await fresh().delete(["live"]))["removed"] == ["live"]
        assert (await ledgers().delete(["live-ledger"]))["removed"] == ["live-ledger"]
        assert _left(s3_client, bucket_url, "live") == []
        assert _left(s3_client, bucket_url, "live-ledger") == []
    finally:
        await proxy.stop()
