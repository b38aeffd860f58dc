"""``close()`` while another task's request is in flight (a breaker, 2026-12-02).

1. A request that never answers, in a task that awaits ``close()`` itself once cancelled (``async
   with store:``, or ``finally: await store.close()``), while a shutdown task calls ``close()``:
   ``close`` cancelled the task after its timeout and then waited for the task to *end*, which
   waited for the same ``close``: both hung for ever. Now ``close`` returns about its timeout later
   and the task ends with ``CancelledError``.
2. A request in flight answered with ``ExpiredToken`` while ``close`` waits: ``close`` held the
   lock the request's credential refresh needs, so it stalled for its whole timeout and the caller
   got a ``CancelledError`` nobody had asked for. Now ``close`` returns when the request does, and
   the caller gets ``StoreError``.

Both run on each transport, through the fault proxy, on every test server.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from faultproxy import s3_error
from s3capture.errors import StoreError

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
