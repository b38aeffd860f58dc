"""``close()`` while another task's request is in flight (breakers, 2026-12-02 and 12-03).

1. A request that never answers, in a task that awaits ``close()`` itself once cancelled (``async
   with store:``, or ``finally: await store.close()``), while a shutdown task calls ``close()``:
   ``close`` cancelled the task after its timeout and then waited for the task to *end*, which
   waited for the same ``close``: both hung for ever. Now ``close`` returns about its timeout later
   and the task ends with ``CancelledError``.
2. A request in flight answered with ``ExpiredToken`` while ``close`` waits: ``close`` held the
   lock the request's credential refresh needs, so it stalled for its whole timeout and the caller
   got a ``CancelledError`` nobody had asked for. Now ``close`` returns when the request does, and
   the caller gets ``StoreError``.

3. The spill replay (2026-12-03): a write waited for it however long the store held it, and so
   did ``close``, which a cancellation left with its HTTP client open.

All run on each transport, through the fault proxy, on every test server.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from faultproxy import s3_error
from helpers import simple_entry
from s3capture.errors import StoreError
from s3capture.rollouts import client as rollouts_client

pytestmark = pytest.mark.all_transports

TIMEOUT = 1.0
"""The ``close`` timeout these tests use (the library's default is 30 s)."""


async def test_close_does_not_deadlock_with_a_cancelled_task_that_closes_the_store(fresh, proxy):
    answer = asyncio.Event()

    async def rule(request: Any) -> Any:
        if request.method == "PUT" and "/log/i/" in request.path:
            await answer.wait()  # a store that took the request and does not answer
        return None

    proxy.rule = rule
    store = fresh(endpoint_url=proxy.endpoint)
    entered = asyncio.Event()

    async def worker() -> None:
        async with store:  # its exit awaits store.close()
            entered.set()
            await store.begin_call("r", "c1")

    working = asyncio.ensure_future(worker())
    try:
        await entered.wait()
        while not any("/log/i/" in r.path for r in proxy.requests):
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await asyncio.wait_for(store.transport.close(timeout=TIMEOUT), TIMEOUT + 15)
        took = time.monotonic() - started
        assert took < TIMEOUT + 5, f"close() took {took:.1f} s"
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(working, 5)
    finally:
        answer.set()
        working.cancel()
        await asyncio.gather(working, return_exceptions=True)


async def test_close_lets_a_request_answered_with_expired_token_fail_as_store_error(fresh, proxy):
    closing = asyncio.Event()

    async def rule(request: Any) -> Any:
        if request.method == "PUT" and "/log/i/" in request.path:
            await closing.wait()
            await asyncio.sleep(0.2)  # answered while close() waits for it
            return s3_error(403, "ExpiredToken", "The provided token has expired.", "Forbidden")
        return None

    proxy.rule = rule
    store = fresh(endpoint_url=proxy.endpoint, session=None)  # its own session: it refreshes credentials
    calling = asyncio.ensure_future(store.begin_call("r", "c1"))
    while not any("/log/i/" in r.path for r in proxy.requests):
        await asyncio.sleep(0.01)
    closing.set()
    started = time.monotonic()
    await asyncio.wait_for(store.transport.close(timeout=10), 30)
    took = time.monotonic() - started
    assert took < 5, f"close() took {took:.1f} s: it waited for a request that could not finish"
    with pytest.raises(StoreError, match="ExpiredToken"):
        await calling


# --------------------------------------------------------------------------- the spill replay
# A cancellation breaker (2026-12-03): with a spilled marker pending and a store that takes its
# PUT and never answers, every successful write waited for the replay (200 s on aioboto3's
# default retries), close() did too, and a close() cancelled meanwhile left the HTTP client open.


async def _spilled_marker_and_a_held_replay(fresh: Any, proxy: Any, tmp_path: Any) -> tuple[Any, asyncio.Event]:
    """A store with one spilled marker (its PUT refused), then a proxy that holds that PUT."""
    phase = {"refuse": True}
    release = asyncio.Event()

    async def rule(request: Any) -> Any:
        if request.method == "PUT" and "/log/x/" in request.path:
            if phase["refuse"]:
                return s3_error(403, "AccessDenied", "refused", "Forbidden")
            await release.wait()  # a store that took the request and does not answer
        return None

    proxy.rule = rule
    store = fresh(endpoint_url=proxy.endpoint, spill_dir=tmp_path / "spill")
    await store.put(simple_entry("r1", "c1"))
    await store.mark_incomplete("r1", "c1")  # refused, spilled, acknowledged
    assert store._spill_file.pending()
    phase["refuse"] = False
    return store, release


async def test_a_write_does_not_wait_for_a_spill_replay_the_store_holds(fresh, proxy, tmp_path, monkeypatch):
    monkeypatch.setattr(rollouts_client, "_CLOSE_REPLAY_SECONDS", 0.5)  # read by RolloutObjects._replay_at_close
    store, release = await _spilled_marker_and_a_held_replay(fresh, proxy, tmp_path)
    try:
        # Completes while the replay's PUT is still held (never released during the put).
        await asyncio.wait_for(store.put(simple_entry("r2", "c1")), 20)
        assert not release.is_set() and any(r.method == "PUT" and "/log/x/" in r.path for r in proxy.requests)
        await asyncio.wait_for(store.close(), 20)  # gives the held replay up, keeps it spilled
        assert store.transport.closed and not store.transport.opened
    finally:
        release.set()
    replayer = fresh(endpoint_url=proxy.endpoint, spill_dir=tmp_path / "spill")  # the same spill file
    assert await replayer.replay_spill() == 1
    assert (await replayer.freeze("r1")).incomplete  # the acknowledged marker landed


async def test_a_cancelled_close_still_releases_the_client(fresh, proxy, tmp_path):
    store, release = await _spilled_marker_and_a_held_replay(fresh, proxy, tmp_path)
    try:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(store.close(), 1.0)  # cancelled inside the held replay
        assert store.transport.closed and not store.transport.opened
    finally:
        release.set()
    assert await fresh(endpoint_url=proxy.endpoint, spill_dir=tmp_path / "spill").replay_spill() == 1  # not lost
