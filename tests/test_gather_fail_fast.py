"""``gather_fail_fast``: the parallel waves of freeze's GETs, the re-fetch of entries a caller
changed and an ``s3://`` export destination's scan fail at their first error, cancel the rest and
leave nothing running (a review, 2026-12-04: with ``gather(return_exceptions=True)`` a failing
store was reported only after every request of a 256-GET batch had failed; with plain ``gather``
the others ran on unobserved). No S3 server: asyncio alone."""

from __future__ import annotations

import asyncio

import pytest

from s3capture.transport import gather_fail_fast


async def test_results_come_in_the_order_of_the_awaitables() -> None:
    async def after(delay: float, value: int) -> int:
        await asyncio.sleep(delay)
        return value

    assert await gather_fail_fast(after(d, i) for i, d in enumerate((0.03, 0.0, 0.01))) == [0, 1, 2]
    assert await gather_fail_fast([]) == []


async def test_the_first_error_cancels_the_rest_at_once() -> None:
    started: list[int] = []
    cancelled: list[int] = []

    async def slow(i: int) -> int:
        started.append(i)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    async def failing() -> int:
        await asyncio.sleep(0.01)
        raise OSError("store down")

    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(OSError, match="store down"):
        await gather_fail_fast([slow(0), failing(), slow(2)])
    assert loop.time() - began < 5  # not the 30 s the others would take
    assert sorted(started) == sorted(cancelled) == [0, 2]  # every other one cancelled and finished


async def test_of_two_errors_the_first_in_order_is_raised() -> None:
    async def fail(delay: float, message: str) -> None:
        await asyncio.sleep(delay)
        raise ValueError(message)

    async def both_at_once(message: str) -> None:
        raise ValueError(message)

    # Both have failed by the time the wait returns: the earlier awaitable's error wins.
    with pytest.raises(ValueError, match="first"):
        await gather_fail_fast([both_at_once("first"), both_at_once("second")])
    with pytest.raises(ValueError, match="late"):
        await gather_fail_fast([fail(0.05, "late"), asyncio.sleep(10)])


async def test_a_cancelled_caller_leaves_nothing_running() -> None:
    cancelled: list[int] = []

    async def slow(i: int) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    caller = asyncio.ensure_future(gather_fail_fast(slow(i) for i in range(3)))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert sorted(cancelled) == [0, 1, 2]
