"""``status``: counts and bytes by state, the oldest open rollout, masked counts from the newest
manifests and retired leftovers (``StoreStatus`` and the structs in it)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime

import msgspec

from s3capture.layout import is_drop_tombstone_rel, is_manifest_rel
from s3capture.ops.common import _clock, _progress, _rollout_prefix, _when
from s3capture.rollouts import ROLLOUT_STATES, RolloutObjects

_MANIFEST_CONCURRENCY = 16
_MANIFEST_LIMIT = 64 * 1024 * 1024


class StateCounts(msgspec.Struct, kw_only=True):
    """Rollouts of one state and what ``RolloutInfo`` counts for them (fence and tombstone excluded)."""

    rollouts: int = 0
    objects: int = 0
    bytes: int = 0


class OldestOpen(msgspec.Struct, kw_only=True):
    """The open rollout whose newest object is oldest."""

    rollout_id: str
    last_write: datetime.datetime
    age_seconds: float
    """The time its listing was answered (``RolloutInfo.listed_at``, or the ``now`` given) minus
    ``last_write`` (the store's clock), in seconds; negative when the store stamped the write
    after that time (its nodes' clocks disagree)."""


class StoreStatus(msgspec.Struct, kw_only=True):
    """``status``: one streaming listing of a root, plus one GET per frozen rollout's manifest.

    Masked counts come from the newest sealed manifest of each frozen rollout: the one of exactly
    the listed state when it is sealed (``RolloutInfo.sealed``), else the one with the highest
    version (the rollout changed since that freeze: ``frozen_changed``).
    """

    url: str
    states: dict[str, StateCounts]
    """``"open"``, ``"frozen"``, ``"retired"`` -> counts."""
    oldest_open: OldestOpen | None = None
    frozen_sealed: int = 0
    """Frozen rollouts whose sealed manifest matches the listing (nothing changed since freeze)."""
    frozen_changed: int = 0
    """Frozen rollouts with a manifest that is not of the listed state (a late write landed)."""
    frozen_without_manifest: int = 0
    """Frozen rollouts with no manifest at all (a freeze that did not finish, or a bare fence)."""
    manifests_read: bool = True
    """Whether the manifests were read (``status(manifests=False)``, ``--no-manifests``: the
    counts below are then all 0, not "nothing masked")."""
    complete: int = 0
    """Frozen rollouts whose newest manifest is complete (not masked by the snapshot). A builder
    can still mask one (a chain with a missing parent decision, no generated token): what
    ``export`` writes as trainable is at most this many. (Named ``trainable`` before 2026-12-03.)"""
    empty: int = 0
    """Of ``complete``, sealed rollouts whose manifest holds no object (version 0): a freeze of an id
    nothing was written to, e.g. a mistyped or removed id given to Gym's consumer, which freezes
    it. A builder masks them (no token records), so they are counted here too."""
    complete_changed: int = 0
    """Of ``complete``, rollouts changed since that manifest's freeze (``frozen_changed``): a write
    landed after it, a marker say, so its verdict is stale; a freeze or an export reads the
    rollout again (a walkthrough read "2 complete" for a rollout a late marker had masked)."""
    masked: int = 0
    """Frozen rollouts whose newest manifest is ``incomplete`` (masked, not trainable)."""
    masked_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    """Reason code (the text of a manifest reason before its first ``:``, e.g. ``dangling_intent``)
    -> masked rollouts with at least one reason of that code."""
    manifest_errors: int = 0
    """Manifests that could not be read or decoded (counted neither complete nor masked)."""
    retired_leftover_objects: int = 0
    """Every object under retired rollouts' prefixes: fence and tombstone (2 per rollout) plus
    objects of stragglers; what ``gc`` can remove."""
    retired_leftover_bytes: int = 0
    bare_fences: int = 0
    """Rollout prefixes holding only a fence (a delete or gc that crashed midway)."""
    unfinished_retires: int = 0
    """Retired rollouts (a retire tombstone) without a fence: a retire that failed or crashed before
    its fence PUT. Writers read only the fence, so they take these for open and their writes are
    acknowledged, while ``freeze`` and ``export`` refuse them as retired; retire or delete them to
    finish (``gc`` leaves them alone)."""
    dropping: int = 0
    """Frozen rollouts holding a drop's own tombstone (``drop/<token>``) and no retire tombstone: a
    drop deciding now, or one that crashed. Such a rollout stays fenced and nothing of it is gone;
    ``mark_incomplete`` on it lands but raises ``TokenCaptureRetiredError`` (not acknowledged) until a
    builder freezes and drops it again, or it is retired or deleted (``docs/design.md``, race 10)."""


def _reason_code(reason: str) -> str:
    return reason.split(":", 1)[0].strip() or "unknown"


class _ManifestHead(msgspec.Struct):
    incomplete: bool
    reasons: list[str] = []


# --------------------------------------------------------------------------- status
async def status(
    store: RolloutObjects,
    *,
    prefix: str = "",
    manifests: bool = True,
    now: float | None = None,
    progress: bool = False,
) -> StoreStatus:
    """Counts and bytes by state, the oldest open rollout, masked counts and retired leftovers.

    ``store``: an ``S3TokenStore`` (a ``S3CaptureLedger`` works too, without manifests: it has
    none). ``prefix``: only rollout ids starting with it. ``manifests``: read the newest sealed
    manifest of each frozen rollout (one GET each, at most 16 in flight; needs ``s3:GetObject``);
    ``False`` sends nothing but LIST requests. ``now``: seconds since the epoch for ages (default
    ``store_time``: the earlier of the store's clock, from the ``Date`` of its LIST answers, and
    this machine's; ages compare it with the store's LastModified). ``progress``: a counter
    of listed rollouts on stderr.

    Memory: one LIST page, one rollout's keys and at most 16 manifests at a time. Raises
    ``StoreError`` when the store fails the listing (a manifest that cannot be read only counts in
    ``manifest_errors``), ``TypeError``/``ValueError`` for a bad ``prefix``.
    """
    clock = _clock(store, now)
    result = StoreStatus(
        url=store.url, states={state: StateCounts() for state in ROLLOUT_STATES}, manifests_read=manifests
    )
    oldest: tuple[float, str, float] | None = None  # (LastModified, rollout id, listed at)
    pending: set[asyncio.Task[None]] = set()
    limit = asyncio.Semaphore(_MANIFEST_CONCURRENCY)

    async def read_manifest(key: str, empty: bool, changed: bool) -> None:
        try:
            async with limit:
                body = await store._get(key, _MANIFEST_LIMIT)
            if body is None:
                raise ValueError("vanished")
            head = msgspec.json.decode(body, type=_ManifestHead)
        except Exception:  # noqa: BLE001 - counted, never fatal to a status report
            result.manifest_errors += 1
            return
        if head.incomplete:
            result.masked += 1
            for code in sorted({_reason_code(reason) for reason in head.reasons} or {"unknown"}):
                result.masked_by_reason[code] = result.masked_by_reason.get(code, 0) + 1
        else:
            result.complete += 1
            result.empty += empty
            result.complete_changed += changed

    bar = _progress(progress, "status")
    try:
        async with contextlib.aclosing(store.rollouts_listed(prefix=prefix)) as listed:
            async for info, items in listed:
                bar.update(1)
                counts = result.states[info.state]
                counts.rollouts += 1
                counts.objects += info.objects
                counts.bytes += info.bytes
                rollout_prefix = _rollout_prefix(store, info.rollout_id)
                rels = [item.key[len(rollout_prefix) :] for item in items]
                if info.state == "retired":
                    result.retired_leftover_objects += len(items)
                    result.retired_leftover_bytes += sum(item.size for item in items)
                    if "fence" not in rels:
                        result.unfinished_retires += 1
                elif info.state == "open":
                    if info.last_write is not None:
                        stamp = info.last_write.timestamp()
                        if oldest is None or stamp < oldest[0]:
                            oldest = (stamp, info.rollout_id, clock(info))
                elif info.state == "frozen":
                    if rels == ["fence"]:
                        result.bare_fences += 1
                    if any(is_drop_tombstone_rel(rel) for rel in rels):
                        result.dropping += 1
                    snaps = sorted(rel for rel in rels if is_manifest_rel(rel))
                    if not snaps:
                        result.frozen_without_manifest += 1
                        continue
                    if info.sealed:
                        result.frozen_sealed += 1
                        key = f"{rollout_prefix}snap/{info.version:020d}-{info.snapshot_id}"
                    else:
                        result.frozen_changed += 1
                        key = rollout_prefix + snaps[-1]  # zero-padded versions: the highest sorts last
                    if manifests:
                        while len(pending) >= 4 * _MANIFEST_CONCURRENCY:
                            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                        # Empty: sealed at version 0 (nothing written). Not from an older manifest of
                        # nothing, which a late write has made stale (a breaker, 2026-12-04).
                        pending.add(
                            asyncio.ensure_future(
                                read_manifest(key, info.sealed and info.version == 0, not info.sealed)
                            )
                        )
        if pending:
            await asyncio.gather(*pending)
            pending = set()
    finally:
        bar.close()
        for task in pending:
            task.cancel()
    if oldest is not None:
        result.oldest_open = OldestOpen(
            rollout_id=oldest[1],
            last_write=_when(oldest[0]) or datetime.datetime.now(datetime.timezone.utc),
            age_seconds=round(oldest[2] - oldest[0], 3),
        )
    result.masked_by_reason = dict(sorted(result.masked_by_reason.items(), key=lambda kv: (-kv[1], kv[0])))
    return result
