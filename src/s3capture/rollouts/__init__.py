"""Rollout prefixes: the scan, version and snapshot-id derivation, fences, retire and delete.

``RolloutObjects`` is the base of ``S3TokenStore`` and ``S3CaptureLedger``: both keep a rollout's
objects under ``rollouts/<rid>/`` (``s3capture.layout``) and share its fence and removal rules.
It also owns the client-side pieces both need: the transport (``s3capture.transport``), the cache
(``s3capture.cache``) and the local spill (``s3capture.spill``).

Removal rules (``docs/design.md``): no *write* path ever deletes a key. Objects are deleted only
by ``retire``, ``delete`` and ``drop``, and only keys that a verified listing of the rollout's own
prefix returned.

``RolloutObjects.rollouts`` lists a root's rollouts (``RolloutInfo``: state, objects, bytes, and for
the token store the version and snapshot id a freeze would give) from one streaming listing of
``<root>/rollouts/``; it never writes (``docs/permissions.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import logging
import math
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlparse

import msgspec

from s3capture.cache import LRU
from s3capture.clocks import awake_clock, store_time
from s3capture.errors import ListingError, StoreError
from s3capture.layout import (
    MAX_KEY_BYTES,
    Layout,
    check_url_characters,
    escape_id,
    is_checkpoint_rel,
    is_folder_marker,
    parse_log_key,
    unescape_id,
)
from s3capture.protocols import RolloutRemovalPayload
from s3capture.records import RecordError
from s3capture.spill import Spill
from s3capture.transport import (
    ListedObject,
    ListPage,
    Transport,
    _backoff,
    cancel_unfinished,
    checked_endpoint,
    make_transport,
    warn_start_after_ignored,
)

_T = TypeVar("_T")

__all__ = [
    "RolloutObjects",
    "RolloutInfo",
    "RolloutScan",
    "ROLLOUT_STATES",
    "parse_s3_url",
    "scan_listing",
    "FENCE_FROZEN",
    "FENCE_RETIRED",
]

log = logging.getLogger("s3capture")

FENCE_FROZEN = b'{"format":"s3capture.fence/1","state":"frozen"}'
FENCE_RETIRED = b'{"format":"s3capture.fence/1","state":"retired"}'

_MARKER_READ_LIMIT = 64 * 1024
"""Largest fence or retire tombstone a client reads (the ones s3capture writes are under 100
bytes): a foreign object in their place is never downloaded whole on every write."""

ROLLOUT_STATES = ("open", "frozen", "retired")
"""The states ``RolloutObjects.rollouts`` reports, from the listing alone: ``"open"`` (no fence),
``"frozen"`` (a fence, no retire tombstone) and ``"retired"`` (the retire tombstone ``retired``)."""


class RolloutInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One rollout of a root as a streaming listing shows it (``RolloutObjects.rollouts``).

    Everything is derived from the listed keys and their sizes and LastModified times; nothing is
    read or written. ``version``, ``snapshot_id`` and ``sealed`` are the token store's
    (``S3TokenStore.rollouts``); a ledger leaves them at their defaults.
    """

    rollout_id: str
    state: str
    """``"open"`` (fence absent), ``"frozen"`` (fence, no retire tombstone) or ``"retired"``
    (retire tombstone). A frozen fence a drop is deciding on still reads ``"frozen"``, as ``freeze``
    reads it."""
    objects: int
    """Objects under the rollout's prefix counted for this client, fence and tombstone excluded.
    Token store: every object its freeze's listing sorts into the log (entries, intents, markers),
    sealed manifests, delta checkpoints, drop tombstones and foreign objects (any other key,
    capture-ledger keys included). Ledger: every key under ``ledger/`` and ``ledger-index/``."""
    bytes: int
    """Total size of those objects in bytes (as listed: stored, i.e. compressed, sizes)."""
    last_write: datetime.datetime | None
    """Newest LastModified among those objects (UTC, tz-aware, by the store's clock); ``None`` when
    none is counted or the store reports no times."""
    listed_at: float | None = None
    """When the LIST page that first showed the rollout's keys was answered, in seconds since the
    epoch at ``s3capture.clocks.store_time`` (the earlier of the store's clock and this
    machine's): the moment the listed state is known to hold, so its age is ``listed_at -
    last_write`` however long a caller took to get to it. ``None`` from listings that predate it."""
    version: int = 0
    """Token store: the ``version`` a freeze of the listed state would give (log plus foreign objects)."""
    snapshot_id: str = ""
    """Token store: the ``snapshot_id`` a freeze of the listed state would give (32 hex digits)."""
    sealed: bool = False
    """Token store: the sealed manifest ``snap/<version:020d>-<snapshot_id>`` of exactly the listed
    state is listed, i.e. the rollout was frozen and nothing changed since (``read_snapshot``)."""


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into ``(bucket, prefix)``; raises ``ValueError`` otherwise.

    Refuses control characters, U+FFFE, U+FFFF and lone surrogates first
    (``s3capture.layout.check_url_characters`` says why)."""
    check_url_characters(url)
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"expected an s3://bucket/prefix URL, got {url!r}")
    if parsed.query or parsed.fragment:
        raise ValueError(f"an s3:// URL takes no query or fragment: {url!r}")
    return parsed.netloc, parsed.path.strip("/")


@dataclass
class RolloutScan:
    """What a verified LIST of one rollout prefix shows."""

    prefix: str
    fence: bool = False
    retired: bool = False
    """The retire tombstone (``retired``) exists."""
    drops: list[ListedObject] = field(default_factory=list)
    """Tentative tombstones of drops in progress (``drop/<token>``); a leftover one (a drop that
    crashed) reads as retired."""
    log: list[ListedObject] = field(default_factory=list)
    parsed: list[tuple[str, str, str, str]] = field(default_factory=list)
    """``parse_log_key`` of each key of ``log`` (same order): every key is parsed once, here."""
    snaps: list[ListedObject] = field(default_factory=list)
    foreign: list[ListedObject] = field(default_factory=list)
    checkpoints: list[ListedObject] = field(default_factory=list)
    """Delta checkpoints (``cum/<digest>.zst``): derived from entries, so outside the version and
    the snapshot id, but removed with the rest."""
    folders: list[ListedObject] = field(default_factory=list)
    """Folder markers (``layout.is_folder_marker``): the rollout prefix itself (what a console's
    "Create folder" writes), or an empty object whose key ends in ``/`` inside it (s3fs, ``rclone
    mkdir``). They hold nothing of the rollout's, so they are outside the version and the snapshot
    id, like a checkpoint, and removed with the rest."""
    seen_at: float = 0.0
    """``s3capture.clocks.awake_clock()`` when the listing returned (this client's clock)."""

    @property
    def contents(self) -> list[ListedObject]:
        """The rollout's own objects besides the fence and tombstone: log, manifests, foreign keys,
        drop tombstones and checkpoints (what ``rollouts`` counts; a folder marker alone is no
        rollout)."""
        return self.log + self.snaps + self.foreign + self.drops + self.checkpoints

    @property
    def records(self) -> list[ListedObject]:
        """Every object a retire removes: ``contents`` and a folder marker."""
        return self.contents + self.folders

    @property
    def all_keys(self) -> list[str]:
        keys = [item.key for item in self.records]
        if self.fence:
            keys.append(self.prefix + "fence")
        if self.retired:
            keys.append(self.prefix + "retired")
        return keys

    def version_and_id(self) -> tuple[int, str]:
        """``version`` = number of log and foreign objects; ``snapshot_id`` = digest of their keys.

        s3capture's log keys name their content (an entry's key holds the SHA-256 of its canonical
        bytes; intents and markers are empty), so their ETags, which depend on the writer's zstd
        level and build, stay out of the id. Foreign objects contribute their ETag too.
        """
        hasher = hashlib.sha256(b"s3capture.snapshot/2\n")
        for item in sorted(self.log, key=lambda i: i.key):
            hasher.update(f"{item.key[len(self.prefix) :]}\n".encode())
        for item in sorted(self.foreign, key=lambda i: i.key):
            hasher.update(f"{item.key[len(self.prefix) :]}\t{item.etag}\n".encode())
        return len(self.log) + len(self.foreign), hasher.hexdigest()[:32]


def _check_prefix(prefix: Any) -> str:
    """A rollout id prefix of ``rollouts``: text (``TypeError``) that encodes as UTF-8 (``ValueError``)."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    try:
        prefix.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"prefix {prefix!r} is not valid Unicode text (it contains a lone surrogate)") from None
    return prefix


def scan_listing(prefix: str, listing: Iterable[ListedObject], *, seen_at: float = 0.0) -> RolloutScan:
    """Sort the listed objects of one rollout prefix by kind: the one classification that ``freeze``,
    ``drop``, ``retire``, ``delete`` and ``rollouts`` share, so a listing and a freeze of the same
    keys always agree on the version and snapshot id. ``prefix`` ends in ``/``; every item's key
    starts with it."""
    scan = RolloutScan(prefix, seen_at=seen_at)
    plen = len(prefix)
    for item in listing:
        rel = item.key[plen:]
        if rel == "fence":
            scan.fence = True
        elif rel == "retired":
            scan.retired = True
        elif is_folder_marker(rel, item.size):
            scan.folders.append(item)
        elif rel.startswith("drop/") and rel.count("/") == 1 and len(rel) > 5:
            scan.drops.append(item)
        elif rel.startswith("snap/"):
            scan.snaps.append(item)
        elif rel.startswith("log/") and (parsed := parse_log_key(rel)) is not None:
            scan.log.append(item)
            scan.parsed.append(parsed)
        elif rel.startswith("cum/") and is_checkpoint_rel(rel):
            scan.checkpoints.append(item)
        else:
            scan.foreign.append(item)
    return scan


_QUIET_REPLAY_WAIT = 0.5
"""Seconds a successful write waits for the spill replay it starts (``_replay_spill_quietly``)."""
_CLOSE_REPLAY_SECONDS = 10.0
"""Seconds ``close`` gives the spill replay before it leaves the rest spilled for the next one."""

_CONFIRM_ROUNDS = 5
"""LISTs after a root listing's last key before it ends without a confirmed end (each that shows
more keys moves the end; writers adding keys there faster than a LIST answers would otherwise keep
a listing going for as long as they write)."""


def _check_states(state: str | Iterable[str] | None) -> frozenset[str]:
    """The states ``rollouts`` keeps; ``ValueError``/``TypeError`` for anything else."""
    if state is None:
        return frozenset(ROLLOUT_STATES)
    if isinstance(state, str):
        wanted = [state]
    else:
        try:
            wanted = list(state)
        except TypeError:
            raise TypeError(f"state must be a str, an iterable of str or None, got {type(state).__name__}") from None
    unknown = [s for s in wanted if not isinstance(s, str) or s not in ROLLOUT_STATES]
    if unknown:
        raise ValueError(f"unknown rollout state {unknown[0]!r}; choose from {', '.join(ROLLOUT_STATES)}")
    if not wanted:
        raise ValueError(f"state names no state; choose from {', '.join(ROLLOUT_STATES)} (or None for all)")
    return frozenset(wanted)


def _segment_after(previous: str, segment: str) -> bool:
    """Whether rollout segment ``segment`` may follow ``previous`` in one listing. S3 (and Ceph,
    moto) list in byte order of whole keys, so segments come in the order of ``segment + "/"``;
    SeaweedFS walks a directory tree, so they come in the order of the segments themselves. The
    two differ only where one segment is the other followed by ``-`` or ``.``; either is accepted.
    A repeated segment (a paging cycle, a key listed twice) is never after itself."""
    return segment > previous or segment + "/" > previous + "/"


def _last_write(objects: Iterable[ListedObject]) -> datetime.datetime | None:
    newest = max((item.modified for item in objects), default=0.0)
    return datetime.datetime.fromtimestamp(newest, tz=datetime.timezone.utc) if newest > 0 else None


class RolloutObjects:
    """Client plumbing and rollout fences shared by ``S3TokenStore`` and ``S3CaptureLedger``."""

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
        spilled again. Requests: one PUT per spilled object, in parallel.

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

    # ------------------------------------------------------------------ listing the root's rollouts
    _rollouts_page_keys = 1000
    """Keys asked for per LIST page by ``rollouts`` (S3's maximum; tests lower it to page cheaply)."""

    def rollouts(self, state: str | Iterable[str] | None = None, *, prefix: str = "") -> AsyncIterator[RolloutInfo]:
        """The root's rollouts with their state, sizes and (token store) version, streamed.

        Returns an async iterator of ``RolloutInfo``, one per rollout that has any of this client's
        objects (the token store's or the ledger's, see ``RolloutInfo.objects``) or a fence or
        retire tombstone, in listing order (key order; SeaweedFS: directory order), each yielded
        as soon as its keys end. ``state``: ``"open"``, ``"frozen"``, ``"retired"``, an iterable of
        them, or ``None`` for all. ``prefix``: only rollout ids that start with it (a prefix of the
        ids, not of keys; ``""`` for all).

        Requests: one streaming LIST of ``<root>/rollouts/<escaped prefix>``, one page per 1,000
        keys (the next page is asked while the current one is consumed), then one LIST after the
        last key that confirms the listing's end (more, at most five, when it shows keys: a listing
        cut short, or writes at its end), and nothing else: no GET, no per-rollout request, and
        never a write, so LIST permission (``s3:ListBucket``) is
        all it needs. Memory: one page and the keys of one rollout at a time, whatever the number
        of rollouts. Keys that are not inside a rollout prefix s3capture could have written (no
        rollout segment, or one that is not an escaped storable id) are skipped.

        ``version`` and ``snapshot_id`` are what ``freeze`` would give for the listed keys (the
        same classification: ``scan_listing``), and ``sealed`` says whether the freeze of exactly
        that state left its manifest. A listing is a moment's view: a rollout written meanwhile may
        show an older state.

        Raises ``ValueError`` (before any request) for an unknown state or a ``prefix`` that is
        not text, and, while iterating, ``StoreError`` when the store fails (``ListingError`` for a
        page that cannot be trusted after retries, or a rollout listed again after its keys ended:
        the listing cannot be resumed, start again).
        """
        return self._rollouts(_check_states(state), _check_prefix(prefix))

    def rollouts_listed(
        self, state: str | Iterable[str] | None = None, *, prefix: str = ""
    ) -> AsyncGenerator[tuple[RolloutInfo, list[ListedObject]], None]:
        """``rollouts``, each ``RolloutInfo`` with the objects listed under its rollout prefix
        (fence and tombstones included): what ``S3TokenStore.read_snapshot(listing=...)`` takes
        to read that listed state without listing the rollout again (``s3capture export`` does).
        Same arguments, requests, memory and errors as ``rollouts``."""
        return self._listed_rollouts(_check_states(state), _check_prefix(prefix))

    async def _rollouts(self, states: frozenset[str], prefix: str) -> AsyncIterator[RolloutInfo]:
        async with contextlib.aclosing(self._listed_rollouts(states, prefix)) as listed:
            async for info, _ in listed:
                yield info

    async def _listed_rollouts(
        self, states: frozenset[str], prefix: str
    ) -> AsyncGenerator[tuple[RolloutInfo, list[ListedObject]], None]:
        base = f"{self.layout.root}rollouts/"
        list_prefix = base + (escape_id(prefix) if prefix else "")
        if len(list_prefix.encode()) > MAX_KEY_BYTES:
            return  # no key can be that long: nothing to list
        async with contextlib.aclosing(self._rollout_groups(base, list_prefix)) as groups:
            async for segment, items, listed_at in groups:
                try:
                    rollout_id = unescape_id(segment)
                except ValueError:
                    continue  # not an escaped id: nothing s3capture wrote
                rollout_prefix = base + segment + "/"
                try:
                    if self.layout.rollout(rollout_id) != rollout_prefix:
                        continue
                except ValueError:
                    continue  # an id no client could store (empty, or too long): foreign keys
                if not rollout_id.startswith(prefix):
                    continue
                info = self._rollout_info(rollout_id, scan_listing(rollout_prefix, items), listed_at=listed_at)
                if info is not None and info.state in states:
                    yield info, items

    async def _rollout_groups(
        self, base: str, list_prefix: str
    ) -> AsyncGenerator[tuple[str, list[ListedObject], float], None]:
        """``(escaped segment, its listed objects, listed_at)`` per rollout prefix under ``base``
        (``listed_at``: ``store_time`` when the page holding its first key arrived), from one
        paged LIST of ``list_prefix`` (each page verified and retried by the transport), one page
        fetched ahead. A rollout's keys are consecutive in every listing order, so a rollout ends
        where the next begins; a segment that is not after the previous one (``_segment_after``) or
        a key repeated within a rollout is a listing that cannot be trusted: ``ListingError``."""
        page_keys = self._rollouts_page_keys
        blen = len(base)
        segment: str | None = None
        items: list[ListedObject] = []
        seen: set[str] = set()
        listed_at = 0.0
        previous_token: str | None = None
        first_key: str | None = None
        last_key: str | None = None
        confirmed: str | None = None  # the last key a LIST after it showed to be the end
        confirming = False
        rounds = 0  # LISTs after the last key sent so far
        pending: asyncio.Future[tuple[ListPage, float]] | None = asyncio.ensure_future(
            self._timed_page(list_prefix, page_keys, None)
        )
        try:
            while pending is not None:
                page, page_time = await pending  # page_time: RolloutInfo.listed_at of its rollouts
                pending = None
                if confirming and page.objects:
                    key = page.objects[0].key
                    again = key[blen:].partition("/")[0]
                    if key in (first_key, last_key) or (
                        segment is not None and again != segment and not _segment_after(segment, again)
                    ):
                        # Keys it listed already (or before them): this store ignores StartAfter.
                        warn_start_after_ignored(list_prefix, key)
                        break
                confirming = False
                if page.objects:
                    first_key = first_key or page.objects[0].key
                    last_key = page.objects[-1].key
                if page.next_token is not None:
                    if page.next_token == previous_token:
                        raise ListingError(
                            f"LIST {list_prefix!r} returned continuation token {page.next_token[:40]!r} twice (a paging cycle)",
                            operation="LIST",
                            key=list_prefix,
                        )
                    previous_token = page.next_token
                    pending = asyncio.ensure_future(self._timed_page(list_prefix, page_keys, page.next_token))
                elif last_key is not None and last_key != confirmed and rounds >= _CONFIRM_ROUNDS:
                    # Writers keep adding keys after the end faster than a LIST answers: a listing
                    # is a moment's view, so it ends here (the last rollout is being written to).
                    log.warning(
                        "LIST %r: keys kept appearing after its end (%d LISTs after it); the listing "
                        "ends at %r without a confirmed end",
                        list_prefix,
                        rounds,
                        last_key,
                    )
                elif last_key is not None and last_key != confirmed:
                    # A page that says it is the last may not be (Transport._rest_of_listing): one
                    # LIST after its last key must show nothing, or the listing goes on from there.
                    # Only the last rollout of a listing cut short looks whole; it may be read
                    # unsealed (an export's quiet open rollouts), so its end must be sure.
                    confirmed, confirming, rounds = last_key, True, rounds + 1
                    pending = asyncio.ensure_future(
                        self._timed_page(list_prefix, page_keys, None, start_after=last_key)
                    )
                for item in page.objects:
                    current, slash, rel = item.key[blen:].partition("/")
                    if not slash:
                        continue  # directly under rollouts/: in no rollout (``<rid>/``, a folder marker, is in it)
                    if current != segment:
                        if segment is not None:
                            if not _segment_after(segment, current):
                                raise ListingError(
                                    f"LIST {list_prefix!r} listed rollout prefix {current!r} after {segment!r} "
                                    "(out of order, or listed again): the listing cannot be trusted",
                                    operation="LIST",
                                    key=list_prefix,
                                )
                            yield segment, items, listed_at
                        segment, items, seen, listed_at = current, [], set(), page_time
                    if item.key in seen:
                        raise ListingError(
                            f"LIST {list_prefix!r} returned key {item.key!r} twice", operation="LIST", key=list_prefix
                        )
                    seen.add(item.key)
                    items.append(item)
            if segment is not None:
                yield segment, items, listed_at
        finally:
            if pending is not None:
                await cancel_unfinished(pending)  # the page nobody will read

    async def _timed_page(
        self, prefix: str, max_keys: int, token: str | None, start_after: str | None = None
    ) -> tuple[ListPage, float]:
        """A LIST page and ``store_time`` when it was answered (its ``Date`` noted): taken here,
        in the task that fetched it, not when a consumer gets to it (pages are fetched ahead, and
        an export or gc may take minutes over the rollouts of the page before)."""
        page = await self._list_page(prefix, max_keys, token, start_after)
        return page, store_time(self)

    def _owned(self, scan: RolloutScan) -> list[ListedObject]:
        """The objects of a scanned rollout that ``rollouts`` counts for this client: the token
        store's (everything but the fence, the retire tombstone and a folder marker); the ledger
        overrides it."""
        return scan.contents

    def _snapshot_fields(self, scan: RolloutScan) -> dict[str, Any]:
        """Extra ``RolloutInfo`` fields (the token store adds version, snapshot id and sealed)."""
        return {}

    def _rollout_info(
        self, rollout_id: str, scan: RolloutScan, *, listed_at: float | None = None
    ) -> RolloutInfo | None:
        """The ``RolloutInfo`` of one listed rollout; ``None`` when nothing of this client's is there."""
        owned = self._owned(scan)
        if not owned and not scan.fence and not scan.retired:
            return None
        state = "retired" if scan.retired else "frozen" if scan.fence else "open"
        return RolloutInfo(
            rollout_id=rollout_id,
            state=state,
            objects=len(owned),
            bytes=sum(item.size for item in owned),
            last_write=_last_write(owned),
            listed_at=listed_at,
            **self._snapshot_fields(scan),
        )

    # ------------------------------------------------------------------ rollout fences and removal
    async def _scan(self, rollout_id: str, *, require: Iterable[str] = (), unless: Iterable[str] = ()) -> RolloutScan:
        """One verified listing of the rollout, split by kind (``scan_listing``). ``require``: keys
        (relative to the rollout prefix) that this client has just written; a listing without them
        is retried, then ``ListingError``, unless it shows one of the keys ``unless`` names (also
        relative). Its end is confirmed (``Transport.list``'s
        ``confirm_end``: one more LIST): the keys a listing cut short would hide are a rollout's
        last ones, its intents and markers (``log/i/``, ``log/x/`` sort after every entry) and
        its retire tombstone."""
        prefix = self.layout.rollout(rollout_id)
        listing = await self._list(
            prefix,
            require=[prefix + rel for rel in require],
            unless=[prefix + rel for rel in unless],
            confirm_end=True,
        )
        return scan_listing(prefix, listing, seen_at=awake_clock())

    async def _present(self, key: str) -> bool:
        """Whether the fence or tombstone ``key`` exists (one GET, at most ``_MARKER_READ_LIMIT``
        bytes read: a larger object exists all the same)."""
        try:
            return await self._get(key, _MARKER_READ_LIMIT) is not None
        except RecordError:
            return True

    async def _fence_state(self, prefix: str) -> str:
        """``"open"``, ``"frozen"`` or ``"retired"`` from one GET of the rollout's fence."""
        try:
            body = await self._get(prefix + "fence", _MARKER_READ_LIMIT)
        except RecordError:  # larger than any fence s3capture writes: foreign, and it fences
            return "frozen"
        if body is None:
            return "open"
        try:
            state = json.loads(body).get("state")
        except (ValueError, AttributeError, RecursionError):
            state = None
        # An unreadable fence still fences: fail closed.
        return "retired" if state == "retired" else "frozen"

    async def _write_retired(self, prefix: str) -> None:
        # Tombstone first, then the fence: a freeze whose frozen fence lands between or after them
        # lists afterwards, sees the tombstone and restores the retired fence. (A fence exists
        # already: an open rollout's retire writes the retired fence before this, _retire_scanned.)
        await self._put(prefix + "retired", b"")
        await self._put(prefix + "fence", FENCE_RETIRED)

    async def _mark_retired(self, scan: RolloutScan) -> None:
        """Write the retire tombstone and the retired fence of a scanned rollout (retire, and
        delete of a rollout not retired yet), before any of its records is deleted."""
        if not scan.fence:
            # An open rollout: the retired fence first. Writers read only the fence, readers the
            # tombstone: a tombstone without a fence (a failure or crash between the two PUTs) would
            # be a rollout writers take for open (acknowledging their puts) and readers for retired
            # (gc would delete those puts as stragglers). A fence without a tombstone is safe:
            # writers are refused, and a freeze takes the rollout back (the retire did not happen).
            await self._put(scan.prefix + "fence", FENCE_RETIRED)
        await self._write_retired(scan.prefix)

    async def _retire_scanned(self, scan: RolloutScan) -> None:
        await self._mark_retired(scan)
        await self._delete_keys([i.key for i in scan.records])
        self._cache.discard_prefix(scan.prefix)

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and keep a fence, whatever their state (idempotent).

        Returns ``{"removed": [...], "absent": [...]}``: removed are ids that had records or an
        unretired fence (including refused late writes a retired rollout kept, which no reader uses);
        absent are ids with nothing to remove (never written, or retired already).
        Later writes to a retired rollout raise ``TokenCaptureRetiredError``. Contract:
        ``TokenSource.retire`` / ``CaptureLedger.retire`` in the protocol reference.

        Requests per rollout (up to 8 rollouts at a time): one LIST page per 1,000 keys, PUTs of
        the retired fence (for an open rollout, first), the retire tombstone and the retired fence,
        one DeleteObjects per 1,000 records.

        Raises:
            TypeError: ``rollout_ids`` is a single str.
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request.
        """
        ids = self._check_ids(rollout_ids)
        removed: list[str] = []
        absent: list[str] = []

        async def one(rollout_id: str) -> None:
            scan = await self._scan(rollout_id)
            had = bool(scan.contents) or (scan.fence and not scan.retired)  # a folder marker alone is no rollout
            await self._retire_scanned(scan)
            (removed if had else absent).append(rollout_id)

        await self._each(ids, one)
        return {"removed": [r for r in ids if r in set(removed)], "absent": [r for r in ids if r in set(absent)]}

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and fences, after which an id reads as unused (idempotent).

        Returns ``{"removed": [...], "absent": [...]}`` (absent: nothing was stored for the id).
        A rollout not yet retired is retired first (the retired fence, the tombstone, the fence
        again); then the records go, then the retire tombstone, then the fence, each after the
        previous request answered: a crash or a failed request mid-delete leaves a retired or at
        least fenced rollout, which refuses writes and which no reader takes for live, and which a
        second ``delete`` finishes. (Never a tombstone without a fence: writers read only the
        fence, so they would take such a rollout for open while ``freeze``, ``ls`` and ``gc`` read
        it retired. A ``retire``, ``gc`` or ``drop`` of the same id running at the same time, or a
        request of this delete or of one of them that the network delivers late, can still land a
        tombstone after this delete returned: delete only ids that nothing writes, reads or
        removes any more, and prefer new ids to reuse, ``docs/design.md`` race 8; after a
        *cancelled* delete nothing tells when its requests have settled, so use a new id.) Requests per rollout (up
        to 8 at a time): one LIST page per 1,000 keys, for a rollout not yet retired up to three
        PUTs, one DeleteObjects per 1,000 records, then a DELETE of the tombstone and one of the
        fence.

        Raises:
            TypeError: ``rollout_ids`` is a single str.
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request.
        """
        ids = self._check_ids(rollout_ids)
        removed: set[str] = set()

        async def one(rollout_id: str) -> None:
            scan = await self._scan(rollout_id)
            keys = scan.all_keys
            if scan.folders and not (scan.contents or scan.fence or scan.retired):
                await self._delete_keys([item.key for item in scan.folders])  # a folder marker alone: no rollout
            elif keys:
                if not (scan.fence and scan.retired):
                    # Retire first, as retire does: a delete that fails or crashes among the records
                    # then leaves a retired rollout, never a live one with a hole (its intents and
                    # some entries gone, the rest readable as open or as a whole ledger).
                    await self._mark_retired(scan)
                last = [scan.prefix + "retired", scan.prefix + "fence"]  # in this order, one by one
                await self._delete_keys([k for k in keys if k not in last])
                for key in last:
                    # Listed or not: a listing that skipped the tombstone must not leave it behind
                    # once the fence is gone (DELETE of an absent key is a no-op).
                    await self._delete_one(key)
                removed.add(rollout_id)
            self._cache.discard_prefix(scan.prefix)
            self._forget_rollout(rollout_id)

        await self._each(ids, one)
        return {"removed": [r for r in ids if r in removed], "absent": [r for r in ids if r not in removed]}

    def _forget_rollout(self, rollout_id: str) -> None:
        """Drop per-rollout client state after a delete (subclasses keep some)."""

    def _check_ids(self, rollout_ids: Sequence[str]) -> list[str]:
        if isinstance(rollout_ids, str):
            raise TypeError("rollout_ids must be a sequence of ids, not a single str")
        ids = list(dict.fromkeys(rollout_ids))
        for rollout_id in ids:
            self.layout.rollout(rollout_id)
        return ids

    async def _each(self, ids: Iterable[str], fn: Any) -> None:
        limit = asyncio.Semaphore(8)

        async def run(rollout_id: str) -> None:
            async with limit:
                await fn(rollout_id)

        await asyncio.gather(*(run(r) for r in ids))


__all__ += ["StoreError"]
