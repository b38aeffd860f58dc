"""One HTTP client per event loop and per process, and ``close``: ``LoopClientsMixin``, whose
methods ``Transport`` inherits (``closed``, ``opened``, the opening of a loop's client, and the
closing behind ``Transport.close``), and ``_LoopState``, the client and bounds of one event loop.

Part of the transport seam (``s3capture.transport``). ``close`` reads ``_CANCELLED_REQUESTS_WAIT``
and a loop's end ``_LOOP_END_WAIT`` here: a test that shortens them patches this module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from s3capture.errors import StoreError

log = logging.getLogger("s3capture")

_CANCELLED_REQUESTS_WAIT = 10.0
"""Seconds ``close`` waits for requests it cancelled (after its timeout) to leave, before closing
their client under them."""


@dataclass
class _LoopState:
    """The HTTP client and its bounds for one event loop."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    client: Any = None
    stack: AsyncExitStack | None = None
    generation: int = 0
    sem: asyncio.Semaphore | None = None
    inflight: set[asyncio.Task] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    retired: list[AsyncExitStack] = field(default_factory=list)
    loop_end: Any = None
    """``Transport._loop_end`` of this state, first iterated on its loop (``None`` once closed)."""


_ABANDONED: list[Any] = []
"""The ``_loop_end`` generators of a parent's states in a forked child, kept so that they are
never finalized there: a finalizer would schedule their clean-up on the parent's loop object and
close the parent's clients (whose sockets the child shares) from the child."""
_LOOP_END_WAIT = 1.0
"""Seconds of one wait of a loop's end for its requests in flight (``asyncio.run`` has cancelled
its tasks; another async generator's clean-up may still send one)."""
_LOOP_END_ROUNDS = 10
"""Waits of ``_LOOP_END_WAIT`` a loop's end makes before leaving its client open."""


class LoopClientsMixin:
    """The client per event loop and per process of ``Transport``, and how ``close`` closes them."""

    if TYPE_CHECKING:  # provided by Transport
        bucket: str
        _max_concurrency: int
        _states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState]
        _pid: int
        _closed: bool
        _closing: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task]

    # ------------------------------------------------------------------ client per loop and process
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def opened(self) -> bool:
        """Whether an HTTP client is open in any event loop of this process."""
        return os.getpid() == self._pid and any(s.client is not None for s in self._states.values())

    def _state(self) -> _LoopState:
        if os.getpid() != self._pid:
            self._forked(self._states)
            _ABANDONED.extend(s.loop_end for s in list(self._states.values()) if s.loop_end is not None)
            self._states = weakref.WeakKeyDictionary()
            self._pid = os.getpid()
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None:
            for other in [lp for lp in self._states if lp.is_closed()]:
                # A finished loop's client cannot be closed any more; forget it.
                del self._states[other]
            state = self._states[loop] = _LoopState()
            state.idle.set()
        return state

    def _forked(self, states: Any) -> None:
        """In a forked child, before the parent's clients are forgotten (never closed from here)."""

    async def _client(self, state: _LoopState) -> tuple[Any, int]:
        if state.client is not None and not self._closed:
            return state.client, state.generation
        async with state.lock:
            if self._closed:
                raise StoreError(f"this s3capture client for s3://{self.bucket} is closed")
            if state.client is None:
                stack = AsyncExitStack()
                client = await self._open(stack)
                state.sem = asyncio.Semaphore(self._max_concurrency)
                state.stack, state.client = stack, client
                state.generation += 1
                # Not after the loop's shutdown_asyncgens began (a request from another async
                # generator's clean-up): a generator first iterated then is never closed.
                loop = asyncio.get_running_loop()
                if state.loop_end is None and not getattr(loop, "_asyncgens_shutdown_called", False):
                    state.loop_end = self._loop_end(state)
                    await state.loop_end.__anext__()  # registers it with this loop's shutdown_asyncgens
            return state.client, state.generation

    async def _loop_end(self, state: _LoopState) -> Any:
        """An async generator first iterated on the state's loop: ``asyncio.run`` (any loop's
        ``shutdown_asyncgens``) closes it as the loop ends, and it closes that loop's client then.
        A store used through ``asyncio.run`` per operation, or from a thread's own loop, otherwise
        left each loop's client to the garbage collector, which logged an asyncio ERROR
        "Unclosed client session" per loop (an API breaker, 2026-12-03); a closed loop cannot
        close it any more. ``_close_state`` closes it first when the store is closed."""
        try:
            yield
        finally:
            if state.loop_end is not None:  # the loop is ending (or the transport was dropped)
                state.loop_end = None
                await self._close_at_loop_end(state)

    async def _close_at_loop_end(self, state: _LoopState) -> None:
        """Close a loop's client as the loop ends, never under a request: ``shutdown_asyncgens``
        closes every async generator at once, so another one's clean-up may send a request on
        this client right now (a review, 2026-12-03: closing it under that PUT turned it into a
        connection error and a retry on a second client nobody closed). Nothing is cancelled;
        the client is taken only at a moment no request holds it (checked under the lock, with no
        await between the check and the take), after at most ``_LOOP_END_ROUNDS`` waits of
        ``_LOOP_END_WAIT`` s; past them it is left to the garbage collector, as before."""
        for _ in range(_LOOP_END_ROUNDS):
            # Yield first: the other generators' clean-ups, started beside this one, then reach
            # their first request (and count as in flight) before the check below, in whatever
            # order shutdown_asyncgens started them (Python 3.12's wait_for does not yield on an
            # event already set).
            await asyncio.sleep(0)
            try:
                await asyncio.wait_for(state.idle.wait(), _LOOP_END_WAIT)
            except asyncio.TimeoutError:
                continue
            async with state.lock:
                if state.inflight:
                    continue  # a request took the client after the wait: wait for it too
                stacks = _take_clients(state)
            for stack in stacks:
                await stack.aclose()
            return
        log.debug("a loop ended with requests of s3://%s still in flight: its client is left open", self.bucket)

    async def _open(self, stack: AsyncExitStack) -> Any:
        """Open this loop's client; register its clean-up on ``stack``."""
        raise NotImplementedError

    async def _close_all(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        states = list(self._states.items())
        self._states = weakref.WeakKeyDictionary()
        jobs: list[Awaitable[None]] = []
        for other, state in states:
            if other is loop:
                jobs.append(self._close_state(state, timeout))
            elif other.is_running() and not other.is_closed():
                future = asyncio.run_coroutine_threadsafe(self._close_state(state, timeout), other)
                jobs.append(self._await_other_loop(asyncio.wrap_future(future), timeout))
        for result in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("close(): %r", result)

    @staticmethod
    async def _await_other_loop(closed: Awaitable[None], timeout: float) -> None:
        """Wait for another thread's loop to close its client, at most as long as that close may
        take (``timeout`` plus the wait for cancelled requests) and 5 s for the loop to get to it.
        A loop blocked in synchronous code held ``close`` for as long as it stayed blocked, for
        ever when it waited on the closing thread (an API breaker, 2026-12-03); its close stays
        scheduled there and runs when the loop does."""
        limit = timeout + _CANCELLED_REQUESTS_WAIT + 5.0
        try:
            await asyncio.wait_for(asyncio.shield(closed), limit)
        except asyncio.TimeoutError:
            log.warning(
                "close(): the event loop of another thread did not run for %.0f s (blocked?); its client is "
                "closed when it runs again, and it sends no new request",
                limit,
            )

    async def _close_state(self, state: _LoopState, timeout: float) -> None:
        """Close one loop's client, on that loop, after its requests in flight.

        The wait holds no lock: a request in flight may need ``state.lock`` to finish (a credential
        refresh after ``ExpiredToken``), and holding it here stalled ``close`` for ``timeout`` and
        turned that request's ``StoreError`` into a ``CancelledError``. After ``timeout`` the tasks
        still inside a request are cancelled, and ``close`` waits until they have left their request
        (``state.idle``, set by ``_call`` as the cancellation passes it), not until the tasks end: a
        cancelled task may go on to await this same ``close`` (``async with store:``, or a
        ``finally: await store.close()``), and waiting for it to end deadlocked both for ever
        (a breaker, 2026-12-02)."""
        mine = state.loop_end  # closed last; a generator of a client opened meanwhile is not ours
        try:
            await asyncio.wait_for(state.idle.wait(), timeout)
        except asyncio.TimeoutError:
            stuck = [t for t in state.inflight if t is not asyncio.current_task()]
            log.warning("close(): cancelling %d requests still in flight after %.0f s", len(stuck), timeout)
            for task in stuck:
                task.cancel()
            try:
                await asyncio.wait_for(state.idle.wait(), _CANCELLED_REQUESTS_WAIT)
            except asyncio.TimeoutError:
                log.warning(
                    "close(): %d requests did not stop within %.0f s of being cancelled; closing their client anyway",
                    len(state.inflight),
                    _CANCELLED_REQUESTS_WAIT,
                )
        async with state.lock:  # waits for a client being opened or rebuilt right now
            stacks = _take_clients(state)
        for stack in stacks:
            await stack.aclose()
        if mine is not None and state.loop_end is mine:  # still registered: it has nothing left to do
            state.loop_end = None
            await mine.aclose()


def _take_clients(state: _LoopState) -> list[AsyncExitStack]:
    """Take a loop's clients (the current one and those a credential refresh retired) for closing:
    after this, a request opens a new one. Called under ``state.lock``."""
    stacks = [*state.retired, *([state.stack] if state.stack is not None else [])]
    state.client, state.stack, state.retired = None, None, []
    return stacks
