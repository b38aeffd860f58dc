"""``S3TokenStore``'s end of a rollout: the conditional ``drop`` of a consumed snapshot and
``retire`` (``delete`` and the retire machinery they share are ``s3capture.rollouts``').

``_StoreLifecycle`` is a private mixin of ``s3capture.store.S3TokenStore``.
"""

from __future__ import annotations

import asyncio
import operator
import uuid
from collections.abc import Sequence

from s3capture.clocks import awake_clock
from s3capture.protocols import RolloutRemovalPayload
from s3capture.rollouts import FENCE_FROZEN, FENCE_RETIRED
from s3capture.store_core import _StoreCore

_CLOCK_SLACK = 0.1
"""Seconds ``drop`` adds to ``fence_grace``: monotonic clocks of two hosts may run at slightly
different rates, and a put measures its own duration on its host's clock."""


class _StoreLifecycle(_StoreCore):
    """``drop`` and ``retire`` of ``S3TokenStore`` (private mixin)."""

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire the exact frozen snapshot that was consumed; False if anything changed since.

        Contract: ``TokenSource.drop`` (a conditional drop: it fails, keeping the evidence, when a
        write raced the freeze). Steps: LIST; unless the rollout is frozen at exactly ``version``
        and ``snapshot_id``, return False. Wait until ``fence_grace`` has passed, on this client's
        monotonic clock, since it knew the fence existed (its own freeze's fence PUT returned, or
        this LIST showed the fence) — never by comparing timestamps of different machines. Then PUT
        a unique drop tombstone and the retired fence, and LIST again (the decisive LIST, which must
        show that tombstone): if the version or id changed, restore the frozen fence, delete only
        its own tombstone and return False; else write the retire tombstone and delete the records
        (drop tombstones included, all after the retire tombstone: ``mark_incomplete`` relies on
        that order, as no fence read can be trusted once a late-delivered fence PUT may overwrite it).
        So every acknowledged put or marker is in the snapshot or fails the drop.

        Requests: one LIST page per 1,000 keys of the rollout and one LIST after its last key
        (confirming its end); when it matches, a wait of up to ``fence_grace`` seconds, a PUT of
        the drop tombstone, a PUT of the fence, the decisive LIST (confirmed the same way); then
        either a PUT of the fence and a DELETE of the tombstone (False), or PUTs of the retire
        tombstone and the fence and one DeleteObjects per 1,000 records (True). A rollout that
        does not match at the first listing returns False after those two LISTs, writing nothing.

        Returns True when the snapshot was retired (its records are deleted), False when the
        rollout is not frozen at exactly ``version`` and ``snapshot_id`` (changed, open, or retired
        already); nothing is removed then.

        Raises:
            TypeError: ``snapshot_id`` not a str or ``version`` not an int (before any request:
                swapped or mistyped arguments answered False, "changed since the freeze", and a
                caller then retired the rollout without ever hearing of its mistake).
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request; ``ListingError`` (a ``StoreError``) for a
                decisive listing without the tombstone, after retries.
        """
        if not isinstance(snapshot_id, str):
            raise TypeError(
                f"snapshot_id must be the str FrozenSnapshot.snapshot_id, got {type(snapshot_id).__name__}"
                " (drop takes rollout_id, snapshot_id, version in that order)"
            )
        if isinstance(version, bool):
            raise TypeError("version must be the int FrozenSnapshot.version, got bool")
        try:
            version = operator.index(version)
        except TypeError:
            raise TypeError(
                f"version must be the int FrozenSnapshot.version, got {type(version).__name__} {version!r}"
                " (drop takes rollout_id, snapshot_id, version in that order)"
            ) from None
        prefix = self.layout.rollout(rollout_id)
        scan = await self._scan(rollout_id)
        if not scan.fence or scan.retired or scan.version_and_id() != (version, snapshot_id):
            self._fence_seen.pop(rollout_id, None)
            return False
        # Wait from when this client's own freeze of exactly this snapshot had its fence in place,
        # else from this LIST (which showed the fence, so it returned after the fence existed).
        seen_at, seen_version, seen_id = self._fence_seen.get(rollout_id, (scan.seen_at, version, snapshot_id))
        if (seen_version, seen_id) != (version, snapshot_id):
            seen_at = scan.seen_at
        wait = seen_at + self._fence_grace + _CLOCK_SLACK - awake_clock()
        if wait > 0:
            await asyncio.sleep(wait)
        tombstone = f"drop/{uuid.uuid4().hex}"
        await self._put(prefix + tombstone, b"")
        await self._put(prefix + "fence", FENCE_RETIRED)
        # A marker may land after the first LIST having read the fence before it said retired (it
        # must succeed after freeze); this LIST, after the retired fence, sees every such marker.
        # Our tombstone may be gone only because a drop (or retire) beside this one decided
        # first: it writes the retire tombstone before it deletes anything, ours included. A
        # listing that shows the retire tombstone answers False at once; any other listing
        # without our tombstone cannot be trusted (retried, then ListingError).
        after = await self._scan(rollout_id, require=[tombstone], unless=["retired"])
        if after.retired or not after.fence or after.version_and_id() != (version, snapshot_id):
            if not after.retired:
                await self._put(prefix + "fence", FENCE_FROZEN)
            await self._delete_one(prefix + tombstone)  # ours alone: a unique key
            return False
        await self._write_retired(prefix)  # before any delete: a drop tombstone goes only after it
        await self._delete_keys([i.key for i in after.records])
        self._cache.discard_prefix(prefix)
        self._forget_rollout(rollout_id)
        return True

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and keep a fence, whatever their state (idempotent).

        Returns ``{"removed": [...], "absent": [...]}``: removed are ids that had records or an
        unretired fence (including refused late writes a retired rollout kept, which no reader
        uses); absent are ids with nothing to remove (never written, or retired already). Later
        writes to a retired rollout raise ``TokenCaptureRetiredError``. Contract:
        ``TokenSource.retire`` in the protocol reference.

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
        # Its call keys and fence time go with each rollout it removes, however that ends
        # (RolloutObjects._each).
        return await super().retire(rollout_ids)
