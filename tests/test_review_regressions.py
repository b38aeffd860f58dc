"""Regressions from the adversarial review of the issue-7 hardening, through the fault proxy.

Each test replays a sequence the reviewer found breaking an invariant of docs/design.md:
- a drop trusting a stale record of when its client froze the rollout (the id was deleted and
  reused by another client) skipped its wait and lost an acknowledged put (I1);
- a marker whose fence re-read failed after landing was acknowledged though a drop may already
  have consumed the rollout (I1);
- close() cancelling a marker's PUT after its timeout did not spill it;
- a second concurrent close() returned while a PUT was still in flight;
- a caller's own aioboto3 session had its credentials cleared by a refresh;
- a LIST that repeats its continuation token paged for ever.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from faultproxy import FaultProxy, Respond, not_implemented_xml
from helpers import simple_entry

from s3capture.store import StoreError

GRACE = 0.6


async def _proxy(s3_server: Any) -> FaultProxy:
    return await FaultProxy.for_server(s3_server).start()


def _put_of(request: Any, fragment: str) -> bool:
    return request.method == "PUT" and fragment in request.path


async def test_a_stale_freeze_record_never_shortens_a_later_drop(fresh, s3_server):
    """Builder B froze and dropped attempt 1; another client deleted the id and the id was reused.
    B's record of its own old freeze must not let it skip the wait when it drops attempt 2, whose
    fence another client wrote while a put (acknowledged within fence_grace) was in flight."""
    proxy = await _proxy(s3_server)
    try:
        builder = fresh(fence_grace=GRACE)
        await fresh(fence_grace=GRACE).put(simple_entry("r", "c0"))
        first = await builder.freeze("r")
        assert await builder.drop("r", first.snapshot_id, first.version)
        await fresh(fence_grace=GRACE).delete(["r"])

        await fresh(fence_grace=GRACE).put(simple_entry("r", "c0"))
        landed = asyncio.Event()

        async def rule(request: Any) -> Any:
            if _put_of(request, "/c1/"):
                await landed.wait()  # the PUT reaches the store only after the freeze's LIST
            return None

        proxy.rule = rule
        writer = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
        put = asyncio.create_task(writer.put(simple_entry("r", "c1")))
        await asyncio.sleep(0.15)  # its fence GET has answered "open"
        snapshot = await fresh(fence_grace=GRACE).freeze("r")  # another client freezes attempt 2
        drop = asyncio.create_task(builder.drop("r", snapshot.snapshot_id, snapshot.version))
        await asyncio.sleep(0.05)
        landed.set()
        put_result: Any
        try:
            await put
            put_result = "ok"
        except Exception as error:  # noqa: BLE001
            put_result = error
        dropped = await drop
        assert [e.model_call_id for e in snapshot.entries] == ["c0"]
        assert not (put_result == "ok" and dropped), (
            "an acknowledged put is missing from a snapshot whose drop succeeded"
        )
    finally:
        await proxy.stop()


async def test_a_marker_whose_fence_re_read_fails_is_never_acknowledged(fresh, s3_server, tmp_path):
    proxy = await _proxy(s3_server)
    try:
        await fresh(fence_grace=GRACE).put(simple_entry("r", "c0"))
        snapshot = await fresh(fence_grace=GRACE).freeze("r")
        fence_gets = 0

        async def rule(request: Any) -> Any:
            nonlocal fence_gets
            if request.method == "GET" and (request.path.endswith("/fence") or request.path.endswith("/retired")):
                fence_gets += 1
                if fence_gets > 1:  # the first read says "frozen"; every re-read after landing fails
                    return Respond(503, not_implemented_xml("ServiceUnavailable", "down"), "Service Unavailable")
            return None

        proxy.rule = rule
        from s3capture.store import default_botocore_config

        config = default_botocore_config(
            16, retries={"mode": "standard", "max_attempts": 1}, s3={"addressing_style": "path"}
        )
        marker = fresh(endpoint_url=proxy.endpoint, botocore_config=config, fence_grace=GRACE)
        try:
            await marker.mark_incomplete("r", "c1")
            acknowledged = True
        except StoreError:
            acknowledged = False
        dropped = await fresh(fence_grace=GRACE).drop("r", snapshot.snapshot_id, snapshot.version)
        assert not acknowledged, (
            "mark_incomplete returned although it could not tell whether a drop consumed the rollout"
        )
        assert not dropped  # the marker landed after the freeze: the drop sees it
    finally:
        await proxy.stop()


async def test_close_cancelling_a_marker_still_spills_it(fresh, s3_server, tmp_path):
    proxy = await _proxy(s3_server)
    try:

        async def rule(request: Any) -> Any:
            if _put_of(request, "/log/x/"):
                await asyncio.sleep(3600)  # the store takes the PUT and never answers
            return None

        proxy.rule = rule
        store = fresh(endpoint_url=proxy.endpoint, spill_dir=tmp_path, fence_grace=GRACE)
        await store.put(simple_entry("r", "c0"))
        marker = asyncio.create_task(store.mark_incomplete("r", "c1"))
        await asyncio.sleep(0.3)
        await store.transport.close(timeout=0.5)
        try:
            await marker
        except BaseException:  # noqa: BLE001 - cancelled by close; what matters is the spill
            pass
        spilled = b"".join(p.read_bytes() for p in tmp_path.glob("spill-*.jsonl*") if not p.name.endswith(".lock"))
        assert b"/log/x/c1/" in spilled, "close() cancelled the marker's PUT and nothing was spilled"
    finally:
        await proxy.stop()


async def test_a_second_close_waits_for_the_first(fresh, s3_server):
    proxy = await _proxy(s3_server)
    try:
        release = asyncio.Event()

        async def rule(request: Any) -> Any:
            if _put_of(request, "/log/e/"):
                await release.wait()
            return None

        proxy.rule = rule
        store = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
        put = asyncio.create_task(store.put(simple_entry("r", "c0")))
        await asyncio.sleep(0.3)
        first = asyncio.create_task(store.close())
        await asyncio.sleep(0.05)
        second = asyncio.create_task(store.close())
        await asyncio.sleep(0.3)
        assert not second.done(), "a second close() returned while a PUT was still in flight"
        release.set()
        await asyncio.gather(first, second, return_exceptions=True)
        assert put.done()
        put.exception() if not put.cancelled() else None
    finally:
        await proxy.stop()


async def test_a_refresh_never_touches_a_callers_session(fresh, s3_server, monkeypatch):
    import aioboto3

    proxy = await _proxy(s3_server)
    try:
        session = aioboto3.Session(aws_access_key_id="CALLERKEY", aws_secret_access_key="caller-secret")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "OTHERIDENTITY")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "other-secret")
        store = fresh(endpoint_url=proxy.endpoint, session=session, fence_grace=GRACE)
        await store.put(simple_entry("r", "c0"))
        proxy.expired_keys = {"CALLERKEY"}
        started = time.monotonic()
        for i in range(5):
            try:
                await store.put(simple_entry("r", f"c{i + 1}"))
            except StoreError as error:
                assert "ExpiredToken" in str(error)
        assert time.monotonic() - started < 30
        assert not any(r.client_key == "OTHERIDENTITY" for r in proxy.requests), (
            "requests went out under another identity"
        )
        frozen = await session._session.get_credentials()
        assert frozen is not None and frozen.access_key == "CALLERKEY"
    finally:
        await proxy.stop()


async def test_a_listing_that_repeats_its_continuation_token_is_a_store_error(fresh, s3_server):
    proxy = await _proxy(s3_server)
    try:
        cycle = (
            b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            b"<Name>b</Name><Prefix>p</Prefix><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>"
            b"<NextContinuationToken>same-token</NextContinuationToken></ListBucketResult>"
        )

        async def rule(request: Any) -> Any:
            if request.method == "GET" and "list-type=2" in request.query:
                return Respond(200, cycle, "OK")
            return None

        await fresh(fence_grace=GRACE).put(simple_entry("r", "c0"))
        proxy.rule = rule
        store = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
        started = time.monotonic()
        try:
            await store.freeze("r")
            raised = None
        except StoreError as error:
            raised = error
        assert raised is not None and "twice" in str(raised), raised
        assert time.monotonic() - started < 30
    finally:
        await proxy.stop()
