"""``settle_each`` and ``gather_settled``: waves of writes and deletes settle before an error is
raised, and a long wave starts nothing after its first failure (reliability.md, finding 30). No
S3 server: asyncio alone (the wire-level tests are in ``tests/test_settled_waves.py``)."""

from __future__ import annotations

import asyncio

import pytest

from s3capture.transport import gather_settled, settle_each


async def test_settle_each_starts_nothing_after_a_failure_and_lets_the_started_finish() -> None:
    started: list[int] = []
    finished: list[int] = []

    async def fn(i: int) -> None:
        started.append(i)
        if i in (1, 2):
            await asyncio.sleep(0.02 if i == 1 else 0.0)
            raise OSError(f"item {i} failed")
        await asyncio.sleep(0.05)
        finished.append(i)

    with pytest.raises(OSError, match="item 1 failed") as failed:  # first in order, not first in time
        await settle_each(list(range(10)), fn, limit=4, what="items", then="Run it again.")
    assert sorted(started) == [0, 1, 2, 3] and sorted(finished) == [0, 3]  # none cancelled, none more
    (note,) = failed.value.__notes__
    assert note == (
        "2 of 10 items failed (the first in order: 1), 2 finished, 6 not started after the failure; "
        "none is still running. Run it again."
    )


async def test_gather_settled_awaits_every_request_before_it_raises() -> None:
    landed: list[str] = []

    async def write(name: str, delay: float) -> str:
        await asyncio.sleep(delay)
        landed.append(name)
        return name

    async def fail() -> str:
        raise OSError("fence unreadable")

    with pytest.raises(OSError, match="fence unreadable"):
        await gather_settled([write("entry", 0.05), fail()])
    assert landed == ["entry"]  # not still on its way after the error
    assert await gather_settled([write("a", 0.01), write("b", 0.0)]) == ["a", "b"]


async def test_settle_each_treats_an_item_that_raises_cancelled_error_as_a_failure() -> None:
    """A breaker (2026-12-04): only ``Exception`` was caught, so a ``CancelledError`` (or any
    ``BaseException``) raised by one item went straight up through ``gather`` and left the others
    running, and starting, after the call had raised."""
    started: list[int] = []

    async def fn(i: int) -> None:
        started.append(i)
        if i == 0:
            await asyncio.sleep(0.005)  # item 1 is under way by then
            raise asyncio.CancelledError()
        await asyncio.sleep(0.02)

    with pytest.raises(asyncio.CancelledError):
        await settle_each(list(range(6)), fn, limit=2, what="items")
    await asyncio.sleep(0.05)
    assert sorted(started) == [0, 1]  # the one under way finished; none started after


async def test_a_cancelled_caller_cancels_the_items_under_way_and_starts_no_more() -> None:
    started: list[int] = []
    cancelled: list[int] = []

    async def fn(i: int) -> None:
        started.append(i)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    caller = asyncio.ensure_future(settle_each(list(range(6)), fn, limit=2, what="items"))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0.05)
    assert sorted(started) == sorted(cancelled) == [0, 1]
