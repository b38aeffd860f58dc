"""``RolloutObjects``, the base of ``S3TokenStore`` and ``S3CaptureLedger``: the rollout fences
(``FENCE_FROZEN``, ``FENCE_RETIRED``), the verified scan of one rollout and the removals ``retire``
and ``delete``. The client plumbing (``s3capture.rollouts.client``) and the listing of the root's
rollouts (``s3capture.rollouts.listing``) it inherits, in that order (the order of its members)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from s3capture.clocks import awake_clock
from s3capture.errors import ListingError, StoreError
from s3capture.protocols import RolloutRemovalPayload
from s3capture.records import RecordError
from s3capture.rollouts.listing import _RootListing
from s3capture.rollouts.scan import RolloutScan, scan_listing
from s3capture.transport import settle_each

__all__ = ["RolloutObjects", "FENCE_FROZEN", "FENCE_RETIRED"]

FENCE_FROZEN = b'{"format":"s3capture.fence/1","state":"frozen"}'
FENCE_RETIRED = b'{"format":"s3capture.fence/1","state":"retired"}'

log = logging.getLogger("s3capture")

_MARKER_READ_LIMIT = 64 * 1024
"""Largest fence or retire tombstone a client reads (the ones s3capture writes are under 100
bytes): a foreign object in their place is never downloaded whole on every write."""


class RolloutObjects(_RootListing):
    """Client plumbing and rollout fences shared by ``S3TokenStore`` and ``S3CaptureLedger``."""

    _probe_listing: bool = False
    """Whether listings are proved fresh with a probe key (the ``probe_listing`` option)."""

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

    async def _removal_scan(self, rollout_id: str) -> RolloutScan:
        """The listing ``retire`` and ``delete`` act on (``_scan``). With ``probe_listing``, behind
        a probe PUT first (``ledger/.probe/<uuid>``, which ``scan_listing`` files with the folder
        markers, so the removal deletes it with the rest): a listing that lags creations then
        still shows every key written before the call, and the removal leaves none of them behind
        (docs/reliability.md, "Listings that lag")."""
        if not self._probe_listing:
            return await self._scan(rollout_id)
        prefix = self.layout.rollout(rollout_id)
        for attempt in range(2):
            probe = f"ledger/.probe/{uuid.uuid4().hex}"
            await self._put(prefix + probe, b"")
            try:
                return await self._scan(rollout_id, require=[probe])
            except Exception as error:
                # A removal of the same id racing this one listed the probe and deleted it with the
                # rest, so no listing shows it: probe once more, and answer for what that removal
                # left (a breaker, 2026-12-04: it raised ListingError where plain clients return).
                if isinstance(error, ListingError) and not attempt and not await self._present(prefix + probe):
                    continue
                await self._remove_probe(prefix + probe)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _remove_probe(self, key: str) -> None:
        """Delete a listing probe whose call failed (a leftover one holds nothing: ``scan_listing``
        files it with the folder markers)."""
        try:
            await self.transport.delete_one(key)
        except StoreError as error:
            log.warning("could not delete the listing probe %s: %s", key, error)

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

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and keep a fence, whatever their state (idempotent).

        Returns ``{"removed": [...], "absent": [...]}``: removed are ids that had records or an
        unretired fence (including refused late writes a retired rollout kept, which no reader uses);
        absent are ids with nothing to remove (never written, or retired already).
        Later writes to a retired rollout raise ``TokenCaptureRetiredError``. Contract:
        ``TokenSource.retire`` / ``CaptureLedger.retire`` in the protocol reference.

        Requests per rollout (up to 8 rollouts at a time): one LIST page per 1,000 keys and one
        LIST after the last key (confirming the end), PUTs of the retired fence (for an open
        rollout, first), the retire tombstone and the retired fence, one DeleteObjects per 1,000
        records (none when there are none).

        Raises:
            TypeError: ``rollout_ids`` is a single str.
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request. No rollout is started after the first failure,
                and the ones under way finish before it is raised (its note counts them); run it
                again to finish.
        """
        ids = self._check_ids(rollout_ids)
        removed: list[str] = []
        absent: list[str] = []

        async def one(rollout_id: str) -> None:
            scan = await self._removal_scan(rollout_id)
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
        to 8 at a time): one LIST page per 1,000 keys and one LIST after the last key (confirming
        the end), for a rollout not yet retired up to three PUTs, one DeleteObjects per 1,000
        records (none when there are none), then a DELETE of the tombstone and one of the fence.

        Raises:
            TypeError: ``rollout_ids`` is a single str.
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request. No rollout is started after the first failure,
                and the ones under way finish before it is raised (its note counts them): when
                it raises, nothing of this delete is still running; a second ``delete`` finishes.
        """
        ids = self._check_ids(rollout_ids)
        removed: set[str] = set()

        async def one(rollout_id: str) -> None:
            scan = await self._removal_scan(rollout_id)
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

    async def _each(self, ids: Sequence[str], fn: Any) -> None:
        """``fn(rollout_id)`` for each id, eight at a time (``settle_each``): after the first
        failure no rollout is started, the ones under way finish (a removal is never cancelled
        midway), then the first error in order is raised with a note of what finished. Plain
        ``gather`` left them running, and a removal that outlived its failed ``delete`` deleted the
        acknowledged entry of an attempt that reused the id after a second ``delete`` had finished
        (a review, 2026-12-04). However a started removal ends, this client forgets what it cached
        and mapped of the rollout: objects it names may be gone (a retire or delete that failed
        midway kept them, and a reused id's delta puts from this client then failed)."""

        async def removal(rollout_id: str) -> None:
            try:
                await fn(rollout_id)
            finally:
                self._cache.discard_prefix(self.layout.rollout(rollout_id))
                self._forget_rollout(rollout_id)

        await settle_each(
            ids,
            removal,
            limit=8,
            what="rollouts",
            then="Run it again to finish (the rollouts it finished then read as absent).",
        )
