"""``_RolloutClient``, the first base of ``RolloutObjects`` (so of ``S3TokenStore`` and
``S3CaptureLedger``): the client plumbing both need, the constructor (transport, cache, spill),
the transport shorthands, ``close`` and the local spill with its replay."""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from s3capture.cache import LRU
from s3capture.layout import Layout
from s3capture.records import OversizeRecordError, RecordError
from s3capture.rollouts.urls import parse_s3_url
from s3capture.spill import Spill
from s3capture.transport import (
    ListedObject,
    ListPage,
    Transport,
    _backoff,
    checked_endpoint,
    make_transport,
)

_T = TypeVar("_T")

log = logging.getLogger("s3capture")

_QUIET_REPLAY_WAIT = 0.5
"""Seconds a successful write waits for the spill replay it starts (``_replay_spill_quietly``)."""
_CLOSE_REPLAY_SECONDS = 10.0
"""Seconds ``close`` gives the spill replay before it leaves the rest spilled for the next one."""


class _RolloutClient:
    """The client plumbing of ``RolloutObjects`` (its first base): constructor, transport
    shorthands, ``close`` and the local spill. ``RolloutObjects`` provides ``_fence_state``."""

    if TYPE_CHECKING:

        async def _fence_state(self, prefix: str) -> str: ...

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        botocore_config: Any = None,
        session: Any = None,
        cache_bytes: int = 256 * 1024 * 1024,
        max_concurrency: int = 32,
        spill_dir: str | os.PathLike | None = None,
        transport: str | Transport | None = None,
    ) -> None:
        if (
            isinstance(cache_bytes, bool)
            or not isinstance(cache_bytes, (int, float))
            or not 0 <= cache_bytes < math.inf
        ):
            raise ValueError(f"cache_bytes must be a number of bytes >= 0 (0: no cache), got {cache_bytes!r}")
        cache_bytes = int(cache_bytes)  # 1e9 is a fine bound
        self.bucket, prefix = parse_s3_url(url)
        self.url = url
        self.layout = Layout(prefix)
        self.endpoint_url = checked_endpoint(endpoint_url, self.bucket)
        self.transport = make_transport(
            transport,
            self.bucket,
            endpoint_url=self.endpoint_url,
            botocore_config=botocore_config,
            session=session,
            max_concurrency=max_concurrency,
        )
        self._cache = LRU(cache_bytes)
        self._spill_dir = os.fspath(spill_dir) if spill_dir is not None else None
        self._spill_file = (
            Spill(
                self._spill_dir,
                endpoint=self.transport.configured_endpoint_url() or None,
                bucket=self.bucket,
                root=self.layout.root,
                # An endpoint from the AWS config was named "aws" before 2026-12-02: replay those too.
                legacy_endpoints=(None,) if not self.endpoint_url else (),
            )
            if self._spill_dir is not None
            else None
        )
        self._replay_task: asyncio.Future[None] | None = None
        """The spill replay a write started (``_replay_spill_quietly``); it may outlive the write."""

    def __reduce__(self) -> Any:
        # pickle, copy.deepcopy, multiprocessing's spawn and Ray's argument shipping all come here;
        # they failed on a weakref deep inside (an API breaker, 2026-12-03).
        name = type(self).__name__
        raise TypeError(
            f"a {name} cannot be pickled or copied: it holds HTTP clients bound to this process's event "
            f"loops. Build one in each process (or Ray actor) from its URL: {name}({self.url!r}, ...)"
        )

    # ------------------------------------------------------------------ transport shorthands
    @property
    def request_counts(self) -> Any:
        """HTTP requests sent by this client, by S3 operation (retries included)."""
        return self.transport.request_counts

    @property
    def _client(self) -> Any:
        """Whether an HTTP client is open (``None`` until the first request)."""
        return True if self.transport.opened else None

    async def _s3(self) -> Any:
        """The underlying client of the running loop (aiobotocore's, or obstore's store and the
        listing session); opens it. Request hooks belong on ``transport.add_hook``."""
        return await self.transport.client()

    async def _put(self, key: str, body: bytes) -> None:
        await self.transport.put(key, body)

    async def _get(self, key: str, limit: int | None = None) -> bytes | None:
        return await self.transport.get(key, limit)

    async def _get_checked(self, key: str, limit: int | None, check: Callable[[bytes], _T]) -> _T | None:
        """GET ``key`` and ``check`` its bytes (decode and verify them against the digest in the key,
        raising ``RecordError``); ``None`` when it is absent. Bytes that fail are read again,
        ``read_attempts`` reads in all, before the failure stands: a body cut short with a
        matching ``Content-Length`` is well-formed, and where the store's ETags are not MD5s (or
        a proxy cut it the same way twice) only the content's own digest tells (a breaker made a
        healthy ledger row read as damage with two short bodies in a row)."""
        attempts = max(1, int(getattr(self.transport, "_read_attempts", 1)))
        for attempt in range(attempts):
            data = await self._get(key, limit)
            if data is None:
                return None
            try:
                return check(data)
            except OversizeRecordError:
                raise  # over the limit: the same bytes again would be too (a zstd bomb cost 4 expansions)
            except RecordError:
                if attempt + 1 >= attempts:
                    raise
            await asyncio.sleep(_backoff(attempt + 1))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _list(
        self, prefix: str, *, require: Iterable[str] = (), unless: Iterable[str] = (), confirm_end: bool = False
    ) -> list[ListedObject]:
        return await self.transport.list(prefix, require=require, unless=unless, confirm_end=confirm_end)

    async def _list_page(
        self, prefix: str, max_keys: int = 1000, token: str | None = None, start_after: str | None = None
    ) -> ListPage:
        return await self.transport.list_page(prefix, max_keys, token, start_after)

    async def _delete_keys(self, keys: list[str]) -> None:
        if keys:
            await self.transport.delete(keys)

    async def _delete_one(self, key: str) -> None:
        await self.transport.delete_one(key)

    async def close(self) -> None:
        """Replay spilled objects (best effort, for at most ``_CLOSE_REPLAY_SECONDS``: what is not
        stored by then stays spilled for the next replay), wait for requests in flight (cancelling
        them after 30 s), release the HTTP client. Idempotent; a cancelled ``close`` still releases
        the client. After it returns nothing is open and nothing more lands."""
        try:
            await self._replay_at_close()
        finally:
            await self.transport.close()

    async def _replay_at_close(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None and (task.done() or task.get_loop() is not asyncio.get_running_loop()):
            task = None  # finished, or of another event loop (which cannot be awaited here)
        try:
            if self._spill_file is None or not self.transport.opened or self.transport.closed:
                return
            async with asyncio.timeout(_CLOSE_REPLAY_SECONDS):
                if task is not None:
                    await asyncio.wait({task})  # a write's replay still running; it logs its own errors
                await self.replay_spill()
        except TimeoutError:
            log.warning(
                "spilled objects were not all replayed within %.0f s at close (the store does not answer); "
                "they stay in %s for the next replay",
                _CLOSE_REPLAY_SECONDS,
                self._spill_dir,
            )
        except Exception:  # replay is best effort at close; the spill file stays
            log.warning("could not replay spilled objects at close", exc_info=True)
        finally:
            if task is not None and not task.done():
                task.cancel()  # what it had not stored is spilled again
                await asyncio.wait({task})

    def __enter__(self) -> Any:
        # A plain ``with`` said only "does not support the context manager protocol".
        raise TypeError(f"use 'async with {type(self).__name__}(...)': its methods are coroutines")

    def __exit__(self, *exc: Any) -> None:  # pragma: no cover - __enter__ never succeeds
        pass

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def is_process_shared(self) -> bool:
        """True: every client of the bucket sees every committed entry."""
        return True

    # ------------------------------------------------------------------ local spill
    def _spill(self, key: str, body: bytes = b"") -> None:
        """Append one object to the local spill (fsynced); see ``s3capture.spill``."""
        assert self._spill_file is not None
        self._spill_file.append(key, body)

    async def replay_spill(self) -> int:
        """Store the objects spilled by earlier failures; returns how many were replayed.

        The spill file belongs to this client's ``(endpoint, bucket, prefix)`` and is shared by
        every client of it on this host, token stores and ledgers alike. What cannot be stored is
        spilled again. Requests: one PUT per spilled object, in parallel, then one GET of the fence
        per rollout they belong to, in parallel (a write replayed into a retired rollout is
        logged as an error).

        Raises:
            StoreError: the store still fails (the objects stay spilled for the next replay).
        """
        spill = self._spill_file
        if spill is None or not spill.pending():
            return 0
        claims = spill.claim()
        if not claims:
            return 0
        try:
            objects = spill.read(claims)
        except BaseException:
            for claim in claims:
                claim.lock.close()  # leave the claims for the next replay
            raise
        stored = False
        try:
            await asyncio.gather(*(self._put(key, body) for key, body in objects.items()))
            stored = True
        finally:
            if not stored:
                try:
                    for key, body in objects.items():  # keep them; duplicates are harmless
                        spill.append(key, body)
                except BaseException:
                    for claim in claims:
                        claim.lock.close()
                    raise
            for claim in claims:
                claim.release()
        await self._report_late_replays(objects)
        return len(objects)

    async def _report_late_replays(self, objects: dict[str, bytes]) -> None:
        """Log an error for each replayed object whose rollout was retired meanwhile: a drop
        consumed a snapshot without this capture failure (the spill's documented exception,
        docs/design.md, I1), which its owner must hear about. One fence GET per such rollout;
        never raises (the objects are stored)."""
        base = f"{self.layout.root}rollouts/"
        prefixes = sorted({base + key[len(base) :].split("/", 1)[0] + "/" for key in objects if key.startswith(base)})
        states = await asyncio.gather(*(self._fence_state(prefix) for prefix in prefixes), return_exceptions=True)
        for prefix, state in zip(prefixes, states):
            if state == "retired":
                keys = sorted(key[len(prefix) :] for key in objects if key.startswith(prefix))
                log.error(
                    "replayed %d spilled object(s) into %s after it was retired: the snapshot its drop "
                    "consumed did not see these capture failures (%s)",
                    len(keys),
                    prefix,
                    ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else ""),
                )

    def _spill_on_cancel(self, key: str, body: bytes, what: str) -> None:
        """A write the caller cancelled may or may not have landed: spill it (synchronously,
        fsynced) so that it lands for sure; replaying an object that did land is a no-op. Never
        raises: the caller's cancellation propagates whatever the spill does (a spill that fails
        is logged as an error)."""
        if self._spill_file is None:
            log.error("%s was cancelled before the store answered and no spill_dir is set: it may be lost", what)
            return
        try:
            self._spill(key, body)
        except OSError as error:
            log.error(
                "%s was cancelled before the store answered and could not be spilled to %s (%s): it may be lost",
                what,
                self._spill_dir,
                error,
            )
            return
        log.warning("%s was cancelled; spilled to %s for replay", what, self._spill_dir)

    def _spill_after_failure(self, key: str, body: bytes, error: BaseException, what: str) -> None:
        """A write failed with ``error`` and may or may not have landed: spill it for replay. Raises
        ``error`` itself when no ``spill_dir`` is set, or, with a note naming the spill's own
        ``OSError`` (read-only, full or missing folder), when the spill fails too."""
        if not self._spill_dir:
            raise error
        try:
            self._spill(key, body)
        except OSError as spill_error:
            log.error("%s failed (%r) and could not be spilled to %s (%s)", what, error, self._spill_dir, spill_error)
            error.add_note(f"s3capture: it could not be spilled to {self._spill_dir} either: {spill_error}")
            raise error from spill_error
        log.warning("%s spilled to %s: %r", what, self._spill_dir, error)

    async def _replay_spill_quietly(self) -> None:
        """After a successful write: the store answers again, so spilled objects must not wait.
        The write waits for the replay at most ``_QUIET_REPLAY_WAIT`` seconds (a store that holds
        the spilled keys' PUTs delayed every write by minutes, a cancellation breaker, 2026-12-03);
        after that the replay goes on in the background, one at a time per client, and ``close``
        waits for it (bounded)."""
        if self._spill_file is None or not self._spill_file.pending():
            return
        task = self._replay_task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            task = self._replay_task = asyncio.ensure_future(self._replay_logged())
        await asyncio.wait({task}, timeout=_QUIET_REPLAY_WAIT)  # a cancelled write leaves it running

    async def _replay_logged(self) -> None:
        try:
            await self.replay_spill()
        except Exception:  # the spill stays for the next replay
            log.warning("spilled objects could not be replayed yet", exc_info=True)
