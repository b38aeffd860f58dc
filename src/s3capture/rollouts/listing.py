"""The listing of a root's rollouts: ``RolloutInfo`` (one rollout as a streaming listing shows it),
``ROLLOUT_STATES``, and ``_RootListing``, the part of ``RolloutObjects`` behind
``rollouts``/``rollouts_listed``: one streaming, paged LIST of ``<root>/rollouts/`` cut into rollouts
(``_rollout_groups``, with its order checks, ``_segment_after``) whose end is confirmed by a LIST
after its last key (at most ``_CONFIRM_ROUNDS``). It never writes (``docs/permissions.md``)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

import msgspec

from s3capture.clocks import store_time
from s3capture.errors import ListingError
from s3capture.layout import MAX_KEY_BYTES, escape_id, is_folder_marker, unescape_id
from s3capture.rollouts.client import _RolloutClient
from s3capture.rollouts.scan import RolloutScan, scan_listing
from s3capture.transport import ListedObject, ListPage, cancel_unfinished, warn_start_after_ignored

__all__ = ["RolloutInfo", "ROLLOUT_STATES"]

log = logging.getLogger("s3capture")

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


def _check_prefix(prefix: Any) -> str:
    """A rollout id prefix of ``rollouts``: text (``TypeError``) that encodes as UTF-8 (``ValueError``)."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    try:
        prefix.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"prefix {prefix!r} is not valid Unicode text (it contains a lone surrogate)") from None
    return prefix


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


def _resumes(key: str, last_key: str, blen: int) -> bool:
    """Whether ``key`` of a listing that started over (a store that ignores ``StartAfter``) is
    where the listing that ended at ``last_key`` goes on: that key itself, or the first key of a
    rollout after its rollout (``last_key`` may have been deleted since)."""
    if key == last_key:
        return True
    last_segment, segment = last_key[blen:].partition("/")[0], key[blen:].partition("/")[0]
    return segment != last_segment and _segment_after(last_segment, segment)


def _last_write(objects: Iterable[ListedObject]) -> datetime.datetime | None:
    newest = max((item.modified for item in objects), default=0.0)
    return datetime.datetime.fromtimestamp(newest, tz=datetime.timezone.utc) if newest > 0 else None


class _RootListing(_RolloutClient):
    """``RolloutObjects.rollouts`` and ``rollouts_listed``: the listing of the root's rollouts (the
    base of ``RolloutObjects`` between its client plumbing and its fences)."""

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
        async with contextlib.aclosing(self._listed_prefixes(prefix)) as listed:
            async for _, info, items, _ in listed:
                if info is not None and info.state in states:
                    yield info, items

    async def _listed_prefixes(
        self, prefix: str
    ) -> AsyncGenerator[tuple[str, RolloutInfo | None, list[ListedObject], float], None]:
        """``(rollout_id, info, items, listed_at)`` for every rollout prefix s3capture could have
        written under the root (ids starting with ``prefix``), in listing order: ``info`` is
        ``None`` where none of this client's objects, no fence and no retire tombstone are there
        (folder markers or leftover listing probes alone, which ``rollouts`` never shows; ``gc``
        removes a prefix of probes alone). Same requests, memory and errors as ``rollouts``."""
        base = f"{self.layout.root}rollouts/"
        list_prefix = base + (escape_id(prefix) if prefix else "")
        if len(list_prefix.encode()) > MAX_KEY_BYTES:
            return  # no key can be that long: nothing to list
        skipped: list[str] = []  # keys in no rollout prefix s3capture writes (folder markers aside)
        async with contextlib.aclosing(self._rollout_groups(base, list_prefix)) as groups:
            async for segment, items, listed_at in groups:
                rollout_prefix = base + segment + "/"
                try:
                    rollout_id = unescape_id(segment)
                    stored = self.layout.rollout(rollout_id) == rollout_prefix
                except ValueError:  # not an escaped id, or one no client could store (empty, too long)
                    stored = False
                if not stored:
                    skipped += [i.key for i in items if not is_folder_marker(i.key[len(base) :], i.size)][:1]
                    continue  # nothing s3capture wrote
                if not rollout_id.startswith(prefix):
                    continue
                info = self._rollout_info(rollout_id, scan_listing(rollout_prefix, items), listed_at=listed_at)
                yield rollout_id, info, items, listed_at
        if skipped:
            # Never counted, masked or deleted; said once a listing, so that ls and status do not
            # pass over a polluted root in silence.
            log.warning(
                "%d prefix%s under %s hold%s keys s3capture did not write (e.g. %r): not rollouts, skipped",
                len(skipped),
                "" if len(skipped) == 1 else "es",
                base or "/",
                "s" if len(skipped) == 1 else "",
                skipped[0],
            )

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
        ignored = False  # the store ignores StartAfter: the confirming LIST started over
        skipping = False  # ... and has not yet passed the last key listed before it
        relist: set[str] = set()  # segments listed on their own prefix before they are yielded
        rounds = 0  # LISTs after the last key sent so far
        pending: asyncio.Future[tuple[ListPage, float]] | None = asyncio.ensure_future(
            self._timed_page(list_prefix, page_keys, None)
        )
        try:
            while pending is not None:
                page, page_time = await pending  # page_time: RolloutInfo.listed_at of its rollouts
                pending = None
                objects = page.objects
                if confirming and objects and objects[0].key == last_key:
                    objects = objects[1:]  # an inclusive StartAfter: the key it names, then what follows
                elif confirming and objects:
                    key = objects[0].key
                    again = key[blen:].partition("/")[0]
                    if (
                        key == first_key
                        or any(item.key in seen for item in objects)
                        or (segment is not None and again != segment and not _segment_after(segment, again))
                    ):
                        # Keys it listed already (or before them): this store ignores StartAfter,
                        # and this LIST is the root's whole listing again. What follows the last
                        # key listed before is read on as the listing's continuation; the rollout
                        # that key belongs to, and the last one, are listed on their own prefix
                        # (breakers, 2026-12-04: the keys such a page showed after a cut listing's
                        # end were dropped, and the rollouts after it with them).
                        warn_start_after_ignored(list_prefix, key)
                        ignored = skipping = True
                        if segment is not None:
                            relist.add(segment)
                if skipping and last_key is not None:
                    # Until the last key listed before shows up again, or a rollout after its own
                    # (that key may have been deleted since), every key was listed already.
                    at = next((i for i, item in enumerate(objects) if _resumes(item.key, last_key, blen)), None)
                    if at is None:
                        objects = []
                    else:
                        objects = objects[at + 1 :] if objects[at].key == last_key else objects[at:]
                        skipping = False
                confirming = False
                if objects:
                    first_key = first_key or objects[0].key
                    last_key = objects[-1].key
                if page.next_token is not None:
                    if page.next_token == previous_token:
                        raise ListingError(
                            f"LIST {list_prefix!r} returned continuation token {page.next_token[:40]!r} twice (a paging cycle)",
                            operation="LIST",
                            key=list_prefix,
                        )
                    previous_token = page.next_token
                    pending = asyncio.ensure_future(self._timed_page(list_prefix, page_keys, page.next_token))
                elif ignored:
                    pass  # the whole listing again was the confirmation: no LIST after its end
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
                    previous_token = None  # a new LIST: its tokens may repeat the first one's
                    pending = asyncio.ensure_future(
                        self._timed_page(list_prefix, page_keys, None, start_after=last_key)
                    )
                for item in objects:
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
                            yield segment, *(await self._relisted(base, segment, items, listed_at, relist))
                        segment, items, seen, listed_at = current, [], set(), page_time
                    if item.key in seen:
                        raise ListingError(
                            f"LIST {list_prefix!r} returned key {item.key!r} twice", operation="LIST", key=list_prefix
                        )
                    seen.add(item.key)
                    items.append(item)
            if segment is not None:
                if ignored:
                    relist.add(segment)
                yield segment, *(await self._relisted(base, segment, items, listed_at, relist))
        finally:
            if pending is not None:
                await cancel_unfinished(pending)  # the page nobody will read

    async def _relisted(
        self, base: str, segment: str, items: list[ListedObject], listed_at: float, relist: set[str]
    ) -> tuple[list[ListedObject], float]:
        """``(items, listed_at)`` of a rollout, or, where ``relist`` names it (a store that ignores
        ``StartAfter`` left its end unconfirmed in the root's listing), one listing of its own
        prefix with its end confirmed."""
        if segment not in relist:
            return items, listed_at
        at = store_time(self)
        return await self.transport.list(f"{base}{segment}/", confirm_end=True), at

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
