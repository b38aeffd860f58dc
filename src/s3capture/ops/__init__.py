"""Operations on a capture root: ``ls``, ``status`` and ``gc`` (library API and ``s3capture`` commands).

Everything here starts from one streaming listing of ``<root>/rollouts/``
(``S3TokenStore.rollouts_listed``), so memory stays bounded by one LIST page and one rollout's keys
whatever the number of rollouts::

    store = S3TokenStore("s3://bucket/capture")
    async for info in store.rollouts("open"):                # what `s3capture ls` prints
        ...
    report = await status(store)                              # StoreStatus: counts, masked reasons, leftovers
    plan = await gc(store, older_than=7 * 86400)              # GcReport of a dry run: nothing is deleted
    done = await gc(store, older_than=7 * 86400, dry_run=False)

What ``gc`` removes, and why it cannot lose an acknowledged entry (``docs/operations.md``):

* A retired rollout keeps its fence (``fence``, ``{"state": "retired"}``) and its retire tombstone
  (``retired``) forever, plus, rarely, objects of stragglers that landed after the retire (never
  acknowledged as captured). ``gc`` handles a retired rollout only when **every** key under its
  prefix, fence and tombstone included, is older than ``older_than`` (the store's LastModified
  against ``store_time``: the earlier of the store's clock, read from the ``Date`` of its LIST
  answers, and this machine's), as the streaming listing *and* a second listing of the rollout
  taken right before any write or delete both show, unchanged (same keys, ETags, sizes, times).
* A rollout holding nothing but its fence and tombstone loses them: the tombstone first, then the
  fence (a crash in between leaves a fence alone, which the next run removes: see below). Only
  those two keys are deleted, never a key the second listing did not show, so a write landing
  meanwhile stays where it landed (it re-opens the id, see "id reuse" in the docs).
* A retired rollout that still holds other objects is *retired again*: the tombstone and the
  retired fence are rewritten, then exactly the listed objects are deleted, the fence staying in
  place. Rewriting refreshes their LastModified, so the fence outlives every deleted object by at
  least ``older_than``: a straggler retrying one of those keys reads "retired" for that long and is
  never acknowledged. A later run removes the fence and tombstone.
* A key alone at a rollout prefix that is exactly ``fence`` (a delete or gc that crashed between
  its two deletes), older than ``older_than``, is deleted.
* Open rollouts quiet for longer than ``abandoned_after`` are *reported*, never deleted; frozen
  rollouts are never touched (their consumer drops them).

One gc per root at a time; do not ``retire`` or ``delete`` a rollout while a gc may be removing
its fence. Ages are taken at ``store_time``, the earlier of the store's clock (the ``Date`` of its newest
LIST answer) and this machine's, so a clock running ahead never makes a key look older; ``older_than`` must exceed the
longest a ``put`` can stay in flight (retries included); ``MIN_SAFE_AGE`` (1 hour) is the least the
command line takes without a warning; tests use 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from s3capture.clocks import store_time
from s3capture.layout import escape_controls, printable_id
from s3capture.rollouts import ROLLOUT_STATES, RolloutInfo, RolloutObjects
from s3capture.transport import ListedObject

__all__ = [
    "MIN_SAFE_AGE",
    "StateCounts",
    "OldestOpen",
    "StoreStatus",
    "GcAction",
    "GcReport",
    "status",
    "gc",
    "format_status",
    "format_gc",
    "format_rollout_row",
    "format_action",
    "roots_below",
    "roots_beside",
    "roots_hint",
    "roots_near",
    "register",
    "LS_HEADER",
]

MIN_SAFE_AGE = 3600.0
"""Seconds: the smallest ``--retired-older-than`` the command line takes without a warning."""

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


class GcAction(msgspec.Struct, kw_only=True):
    """One rollout ``gc`` acted on (or, in a dry run, would act on)."""

    rollout_id: str
    action: str
    """``"delete"`` (fence and tombstone, or a bare fence, removed: the id reads as unused),
    ``"retire_again"`` (straggler objects removed, fence and tombstone rewritten and kept),
    ``"skipped"`` (changed between the listing and its re-check; nothing done) or ``"abandoned"``
    (an open rollout quiet for ``abandoned_after``: reported only)."""
    keys: list[str]
    """Keys relative to the rollout prefix that were (would be) deleted; for ``abandoned``, none."""
    objects: int = 0
    bytes: int = 0
    last_write: datetime.datetime | None = None
    """Newest LastModified under the rollout prefix (store's clock)."""
    reason: str = ""


class GcReport(msgspec.Struct, kw_only=True):
    """What ``gc`` did (or would do with ``dry_run=True``). Per-rollout details go to ``on_action``."""

    url: str
    dry_run: bool
    older_than: float
    abandoned_after: float
    retired_seen: int = 0
    """Retired rollouts listed."""
    deleted_rollouts: int = 0
    """Rollouts whose fence and tombstone (or bare fence) were (would be) removed."""
    retired_again: int = 0
    """Retired rollouts whose straggler objects were (would be) removed, fence kept."""
    deleted_objects: int = 0
    deleted_bytes: int = 0
    skipped: int = 0
    """Rollouts left alone because the re-check listing differed from the streaming one."""
    unfinished: int = 0
    """Retired rollouts left alone because they hold objects and a retire tombstone but no fence (a
    retire that failed or crashed before its fence PUT): writers take them for open, so their
    objects may be acknowledged writes; retire or delete them to finish (``docs/operations.md``)."""
    too_young: int = 0
    """Retired rollouts (or bare fences) with a key newer than ``older_than``."""
    abandoned: int = 0
    """Open rollouts quiet for longer than ``abandoned_after`` (reported, not deleted)."""
    abandoned_bytes: int = 0


# --------------------------------------------------------------------------- helpers
def _age(now: float, modified: float) -> float:
    return now - modified


def _clock(store: Any, now: float | None) -> Callable[..., float]:
    """Seconds since the epoch to take ages at: ``now`` when given, else the time the listing of
    ``info`` (an optional argument) was answered (``RolloutInfo.listed_at``), else
    ``store_time(store)``. An age taken when a listed rollout's turn comes would grow by however
    long the work before it took, and make a rollout written just before its listing look old."""
    if now is not None:
        return lambda info=None: now

    def clock(info: RolloutInfo | None = None) -> float:
        listed_at = getattr(info, "listed_at", None)
        return listed_at if listed_at else store_time(store)

    return clock


def _newest(items: Iterable[ListedObject]) -> float:
    return max((item.modified for item in items), default=0.0)


def _when(modified: float) -> datetime.datetime | None:
    return datetime.datetime.fromtimestamp(modified, tz=datetime.timezone.utc) if modified > 0 else None


def _progress(enabled: bool, what: str) -> Any:
    """A tqdm counter of listed rollouts on stderr (disabled: a no-op with the same methods)."""
    from tqdm import tqdm

    return tqdm(desc=what, unit=" rollouts", file=sys.stderr, disable=not enabled, leave=False, mininterval=0.5)


def _rollout_prefix(store: RolloutObjects, rollout_id: str) -> str:
    return store.layout.rollout(rollout_id)


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

    async def read_manifest(key: str) -> None:
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
                    if any(rel.startswith("drop/") for rel in rels):
                        result.dropping += 1
                    snaps = sorted(rel for rel in rels if rel.startswith("snap/"))
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
                        pending.add(asyncio.ensure_future(read_manifest(key)))
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


# --------------------------------------------------------------------------- gc
def _same_listing(first: list[ListedObject], second: list[ListedObject]) -> bool:
    """Whether two listings of one prefix show the same objects (keys, ETags, sizes, times)."""

    def view(items: list[ListedObject]) -> set[tuple[str, str, int, float]]:
        return {(i.key, i.etag, i.size, round(i.modified, 3)) for i in items}

    return len(first) == len(second) and view(first) == view(second)


async def gc(
    store: RolloutObjects,
    older_than: float,
    *,
    dry_run: bool = True,
    abandoned_after: float | None = None,
    prefix: str = "",
    now: float | None = None,
    on_action: Callable[[GcAction], None] | None = None,
    progress: bool = False,
) -> GcReport:
    """Remove what retired rollouts leave behind; report abandoned open rollouts.

    ``older_than``: seconds; a retired rollout (or a bare fence) is handled only when every key
    under its prefix is at least this old (``now`` minus the store's LastModified). ``dry_run``
    (default ``True``): send nothing but LIST requests and report what would be done.
    ``abandoned_after``: seconds an open rollout must be quiet to be reported as abandoned (default
    ``older_than``). ``prefix``: only rollout ids starting with it. ``now``: seconds since the epoch
    (default ``store_time``: the earlier of the store's clock, from the ``Date`` of its LIST answers,
    and this machine's, so a clock running ahead never makes a rollout look older). ``on_action``: called with each ``GcAction`` as it is decided
    (dry run) or done, so a caller can print them without ``gc`` keeping a list.

    The rules (module docstring and ``docs/operations.md``): a rollout is changed only after a
    second listing of its own prefix, right before the first write or delete, shows exactly what
    the streaming listing showed; only listed keys are deleted; a retired rollout with straggler
    objects is retired again (fence rewritten and kept) instead of losing its fence; open and
    frozen rollouts are never written to or deleted from.

    Requests: one streaming LIST of the root; without ``dry_run``, per rollout acted on one LIST
    plus two DELETEs (fence and tombstone) or two PUTs and DeleteObjects (retire again).
    Raises ``ValueError`` for a negative age, ``StoreError`` when the store fails (what was done
    before stays done; a re-run continues).
    """
    for name, value in (("older_than", older_than), ("abandoned_after", abandoned_after)):
        if value is not None and (not isinstance(value, (int, float)) or math.isnan(value) or value < 0):
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    abandoned_after = older_than if abandoned_after is None else abandoned_after
    clock = _clock(store, now)
    report = GcReport(
        url=store.url, dry_run=dry_run, older_than=float(older_than), abandoned_after=float(abandoned_after)
    )

    def emit(action: GcAction) -> None:
        if on_action is not None:
            on_action(action)

    bar = _progress(progress, "gc")
    try:
        async with contextlib.aclosing(store.rollouts_listed(prefix=prefix)) as listed:
            async for info, items in listed:
                bar.update(1)
                if info.state == "open":
                    if (
                        info.last_write is not None
                        and _age(clock(info), info.last_write.timestamp()) >= abandoned_after
                    ):
                        report.abandoned += 1
                        report.abandoned_bytes += info.bytes
                        emit(
                            GcAction(
                                rollout_id=info.rollout_id,
                                action="abandoned",
                                keys=[],
                                objects=info.objects,
                                bytes=info.bytes,
                                last_write=info.last_write,
                                reason=f"open, quiet for {_age(clock(info), info.last_write.timestamp()):.0f}s",
                            )
                        )
                    continue
                rollout_prefix = _rollout_prefix(store, info.rollout_id)
                rels = sorted(item.key[len(rollout_prefix) :] for item in items)
                bare_fence = info.state == "frozen" and rels == ["fence"]  # a folder marker too: left alone
                if info.state == "retired":
                    report.retired_seen += 1
                elif not bare_fence:
                    continue  # frozen: its consumer drops it
                newest = _newest(items)
                if newest <= 0 or _age(clock(info), newest) < older_than:
                    report.too_young += 1
                    continue
                await _collect_one(store, info, items, rollout_prefix, bare_fence, dry_run, report, emit)
    finally:
        bar.close()
    return report


async def _collect_one(
    store: RolloutObjects,
    info: RolloutInfo,
    items: list[ListedObject],
    rollout_prefix: str,
    bare_fence: bool,
    dry_run: bool,
    report: GcReport,
    emit: Callable[[GcAction], None],
) -> None:
    fences = {rollout_prefix + "fence", rollout_prefix + "retired"}
    records = [item for item in items if item.key not in fences]
    listed = {item.key for item in items}
    if records and rollout_prefix + "fence" not in listed:
        # A retire tombstone without a fence (an older release's failed retire or delete, or a
        # retire beside a delete of the id: docs/operations.md, rule 6). Writers read only the
        # fence, so to them the rollout is open and their puts since were acknowledged; whether
        # those are wanted is the owner's call (retire again discards them), never gc's. Decided
        # from the streaming listing: a skip changes nothing, so it needs no re-check.
        report.unfinished += 1
        emit(
            GcAction(
                rollout_id=info.rollout_id,
                action="skipped",
                keys=[],
                objects=len(records),
                bytes=sum(item.size for item in records),
                last_write=_when(_newest(items)),
                reason=(
                    "a retire that did not finish: a retire tombstone and no fence, so writers still take the "
                    "rollout for open; retire it again to discard its objects, or delete it"
                ),
            )
        )
        return
    if not dry_run:
        # The re-check: a listing of the rollout's own prefix right before anything is changed must
        # show exactly what the streaming listing showed; anything new, gone or rewritten leaves
        # the rollout alone (a writer or another tool is active there).
        # A "folder" object named like the prefix itself (S3 consoles, s3fs, rclone) is in both
        # listings (``scan_listing`` keeps it outside the version) and is removed with the rest.
        again = await store._list(rollout_prefix)
        if not _same_listing(items, again):
            report.skipped += 1
            emit(
                GcAction(
                    rollout_id=info.rollout_id,
                    action="skipped",
                    keys=[],
                    last_write=_when(_newest(again)),
                    reason="changed since the listing",
                )
            )
            return
    if records:
        # Retire again: the fence stays, rewritten, so every straggler retrying one of these keys
        # keeps reading "retired"; tombstone first, as retire writes it.
        rels = sorted(item.key[len(rollout_prefix) :] for item in records)
        action = GcAction(
            rollout_id=info.rollout_id,
            action="retire_again",
            keys=rels,
            objects=len(records),
            bytes=sum(item.size for item in records),
            last_write=_when(_newest(items)),
            reason="straggler objects of a retired rollout; fence and tombstone kept (rewritten)",
        )
        if not dry_run:
            await store._write_retired(rollout_prefix)
            await store._delete_keys([item.key for item in records])
            store._cache.discard_prefix(rollout_prefix)
        report.retired_again += 1
    else:
        present = [item for item in items if item.key in fences]
        rels = sorted(item.key[len(rollout_prefix) :] for item in present)
        action = GcAction(
            rollout_id=info.rollout_id,
            action="delete",
            keys=rels,
            objects=len(present),
            bytes=sum(item.size for item in present),
            last_write=_when(_newest(items)),
            reason="bare fence" if bare_fence else "retired",
        )
        if not dry_run:
            # Tombstone first, fence last: a crash in between leaves a bare fence, which still
            # refuses writes and which the next gc removes.
            # Only listed keys are deleted (rule 3).
            if rollout_prefix + "retired" in listed:
                await store._delete_one(rollout_prefix + "retired")
            if rollout_prefix + "fence" in listed:
                await store._delete_one(rollout_prefix + "fence")
            store._cache.discard_prefix(rollout_prefix)
            store._forget_rollout(info.rollout_id)
        report.deleted_rollouts += 1
    report.deleted_objects += action.objects
    report.deleted_bytes += action.bytes
    emit(action)


# --------------------------------------------------------------------------- formatting
LS_HEADER = ("rollout_id", "state", "objects", "bytes", "last_write")
_LS_WIDTHS = (40, 8, 8, 12, 20)


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _stamp(value: datetime.datetime | None) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ") if value is not None else "-"


def format_rollout_row(info: RolloutInfo | None, *, table: bool) -> str:
    """One ``s3capture ls`` line (``None``: the header). ``table``: fixed-width columns with
    human-readable sizes (a terminal), the rollout id last so that ids of any length keep the
    columns aligned; otherwise tab-separated exact values in ``LS_HEADER`` order. An id with a
    control character is quoted (``s3capture.layout.printable_id``) so that it cannot split a row."""
    if info is None:
        cells = list(LS_HEADER)
    else:
        size = _human_bytes(info.bytes) if table else str(info.bytes)
        cells = [printable_id(info.rollout_id), info.state, str(info.objects), size, _stamp(info.last_write)]
    if not table:
        return "\t".join(cells)
    rid, state, objects, size, last = cells
    return "  ".join(
        [
            state.ljust(_LS_WIDTHS[1]),
            objects.rjust(_LS_WIDTHS[2]),
            size.rjust(_LS_WIDTHS[3]),
            last.ljust(_LS_WIDTHS[4]),
            rid,
        ]
    )


def _ago(seconds: float) -> str:
    """An age for people: ``"5.0m ago"``; a negative one (a write stamped after the listing's
    time: the clocks of the store's nodes disagree) says so instead of "0s ago"."""
    if seconds < 0:
        return f"{_duration(-seconds)} in the future by the store's clock: its nodes' clocks disagree"
    return f"{_duration(seconds)} ago"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


async def roots_below(store: RolloutObjects, limit: int = 5) -> list[str]:
    """``s3://`` URLs of s3capture roots inside ``store``'s root: prefixes under it that hold a
    ``rollouts/`` folder, from one LIST page (the first 1,000 keys under the root).

    A hint for a URL that names a parent of the root its user meant (``s3://b/capture`` for
    ``s3://b/capture/run-42``), whose own listing of rollouts is empty. At most ``limit`` URLs, in
    key order; empty when nothing under the root looks like another root, and when the LIST fails
    (a hint: a role allowed to list only ``ROOT/rollouts/`` gets none, and no error).
    """
    return await _roots_under(store, store.layout.root, limit)


async def roots_beside(store: RolloutObjects, limit: int = 5) -> list[str]:
    """``s3://`` URLs of s3capture roots beside ``store``'s root: other prefixes under its parent
    that hold a ``rollouts/`` folder, from one LIST page (the parent's first 1,000 keys).

    A hint for a URL with a typo in its last segment (``run-43`` for ``run-42``), whose listing of
    rollouts is empty. At most ``limit`` URLs, in key order; empty for a root at the top of its
    bucket's own key space (``s3://b``) and when the LIST fails (a hint, never an error)."""
    root = store.layout.root
    if not root:
        return []
    return await _roots_under(store, root[: root.rstrip("/").rfind("/") + 1], limit, skip=root)


async def _roots_under(store: RolloutObjects, prefix: str, limit: int, skip: str = "") -> list[str]:
    """``s3://`` URLs of the prefixes under ``prefix`` (but ``skip``) that hold a ``rollouts/``
    folder, among the first 1,000 keys; ``prefix``'s own rollouts (an id or call id named
    "rollouts" included) are not another root. ``[]`` when the LIST fails: a hint, never an error."""
    from s3capture.errors import StoreError

    try:
        page = await store._list_page(prefix, 1000)
    except StoreError:
        return []
    found: dict[str, None] = {}
    for item in page.objects:
        rel = item.key[len(prefix) :]
        if rel.startswith("rollouts/"):
            continue
        cut = rel.find("/rollouts/")
        if cut > 0 and prefix + rel[:cut] + "/" != skip:
            found.setdefault(rel[:cut], None)
            if len(found) >= limit:
                break
    return [f"s3://{store.bucket}/{prefix}{rel}" for rel in found]


def roots_hint(below: list[str], beside: list[str]) -> str:
    """The hint for a root without rollouts: the roots inside it (a URL one level too high), else
    the roots beside it (a typo in its last segment); ``""`` when there are neither."""
    if below:
        return f"roots inside this URL (among its first 1,000 keys): {', '.join(below)}"
    if beside:
        return f"roots beside this URL (among its parent's first 1,000 keys): {', '.join(beside)}"
    return ""


async def roots_near(store: RolloutObjects) -> str:
    """``roots_hint`` for ``store``'s root: one LIST page, two when nothing is inside it."""
    below = await roots_below(store)
    return roots_hint(below, [] if below else await roots_beside(store))


def format_status(s: StoreStatus) -> str:
    """``StoreStatus`` as the lines ``s3capture status`` prints."""
    lines = [f"rollouts under {s.url}:"]
    for state, counts in s.states.items():
        lines.append(
            f"  {state:<8} {counts.rollouts:>8} rollouts  {counts.objects:>10} objects  {_human_bytes(counts.bytes):>12}"
        )
    if s.oldest_open is not None:
        o = s.oldest_open
        lines.append(
            f"oldest open rollout: {printable_id(o.rollout_id)} (last write {_stamp(o.last_write)}, {_ago(o.age_seconds)})"
        )
    else:
        lines.append("oldest open rollout: none")
    frozen = s.states["frozen"].rollouts
    if frozen:
        lines.append(
            f"frozen: {s.frozen_sealed} sealed, {s.frozen_changed} changed since freeze, "
            f"{s.frozen_without_manifest} without a manifest"
        )
        if not s.manifests_read:
            lines.append("newest manifests: not read (--no-manifests)")
        else:
            lines.append(
                f"newest manifests: {s.complete} complete, {s.masked} masked, {s.manifest_errors} unreadable "
                "(complete: the snapshot masks nothing; the builder may still mask)"
            )
        for code, count in s.masked_by_reason.items():
            lines.append(f"  masked by {code}: {count}")
    retired = s.states["retired"].rollouts
    lines.append(
        f"retired leftovers: {_counted(s.retired_leftover_objects, 'object')} ({_human_bytes(s.retired_leftover_bytes)}) "
        f"for {_counted(retired, 'retired rollout')}"
        + ("; 's3capture gc' removes them" if s.retired_leftover_objects else "")
    )
    if s.bare_fences:
        lines.append(f"bare fences (an interrupted delete or gc): {s.bare_fences}")
    if s.unfinished_retires:
        lines.append(
            f"retired without a fence (a retire that did not finish; writers still take them for open): "
            f"{s.unfinished_retires}; retire or delete them again"
        )
    if s.dropping:
        lines.append(
            f"frozen with a drop deciding or crashed (a drop/ tombstone, no retire): {s.dropping}; "
            "markers on them are not acknowledged until a builder freezes and drops them again"
        )
    return "\n".join(lines)


def _counted(count: int, noun: str) -> str:
    """``1 object``, ``2 objects``, ``1,000 objects``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def format_action(action: GcAction, *, dry_run: bool) -> str:
    """One ``s3capture gc`` line per rollout."""
    verb = {
        "delete": "would delete" if dry_run else "deleted",
        "retire_again": "would retire again" if dry_run else "retired again",
        "skipped": "skipped",
        "abandoned": "abandoned (kept)",
    }[action.action]
    keys = ", ".join(action.keys[:6]) + (f", ... ({len(action.keys)} keys)" if len(action.keys) > 6 else "")
    detail = f"{_counted(action.objects, 'object')}, {_human_bytes(action.bytes)}"
    where = f"; last write {_stamp(action.last_write)}" if action.last_write is not None else ""
    suffix = f": {keys}" if keys else ""
    return f"{verb} {printable_id(action.rollout_id)} ({detail}{where}; {escape_controls(action.reason)}){suffix}"


def format_gc(r: GcReport) -> str:
    """The summary line(s) of ``s3capture gc``."""
    mode = "dry run (nothing deleted; --yes deletes)" if r.dry_run else "done"
    would = "would remove" if r.dry_run else "removed"
    return "\n".join(
        [
            f"gc {r.url}: {mode}",
            f"  retired rollouts: {r.retired_seen} listed, {r.too_young} younger than {_duration(r.older_than)}",
            f"  {would} {_counted(r.deleted_objects, 'object')} ({_human_bytes(r.deleted_bytes)}): fences of "
            f"{_counted(r.deleted_rollouts, 'rollout')}, stragglers of {r.retired_again} (retired again, fence kept)",
            f"  skipped (changed since the listing): {r.skipped}",
            *(
                [
                    f"  skipped (a retire that did not finish: tombstone, no fence; retire or delete them): "
                    f"{r.unfinished}"
                ]
                if r.unfinished
                else []
            ),
            f"  abandoned open rollouts (quiet > {_duration(r.abandoned_after)}, not deleted): {r.abandoned} "
            f"({_human_bytes(r.abandoned_bytes)})",
        ]
    )


# --------------------------------------------------------------------------- command line
def _state_list(text: str) -> tuple[str, ...]:
    """``--state`` of ``ls``: comma-separated state names (the option also repeats)."""
    import argparse

    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [name for name in names if name not in ROLLOUT_STATES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(ROLLOUT_STATES)}, got {text!r}"
        )
    return names


def _given_states(groups: list[tuple[str, ...]] | None) -> list[str] | None:
    """The states of every ``--state`` given (``action="append"`` of ``_state_list``), in order,
    each once; ``None`` when none was given."""
    return list(dict.fromkeys(name for group in groups for name in group)) if groups else None


def register(sub: Any) -> dict[str, Any]:
    """Add ``ls``, ``status`` and ``gc`` to an argparse subparsers object; returns name -> parser."""
    from s3capture.cli import _argument, check_endpoint, check_s3_url

    def duration(text: str) -> float:
        from s3capture.export import parse_duration

        return parse_duration(text)

    parsers: dict[str, Any] = {}
    ls = sub.add_parser(
        "ls",
        help="list a root's rollouts with state, objects, bytes and last write",
        description="One streaming listing of URL's rollouts (LIST only). A table on a terminal, "
        "tab-separated lines otherwise, JSON lines with --json.",
    )
    st = sub.add_parser(
        "status",
        help="counts by state, oldest open rollout, masked counts, retired leftovers",
        description="One streaming listing plus one GET per frozen rollout's newest manifest "
        "(--no-manifests: LIST only). See docs/operations.md.",
    )
    g = sub.add_parser(
        "gc",
        help="remove what retired rollouts leave behind (dry run unless --yes)",
        description="Delete the fence and tombstone of retired rollouts whose every key is older than "
        "--retired-older-than (retiring again those that hold straggler objects), after re-listing "
        "each one; report open rollouts quiet for that long without deleting them. A dry run unless "
        "--yes. See docs/operations.md for the rules and for what removing a fence means for id reuse.",
    )
    for parser in (ls, st, g):
        parser.add_argument(
            "url", type=_argument(check_s3_url), help="s3://bucket/prefix the rollouts were captured under"
        )
        parser.add_argument(
            "--endpoint",
            type=_argument(check_endpoint),
            help="S3 endpoint URL (default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS S3)",
        )
        parser.add_argument("--prefix", default="", help="only rollout ids starting with this text")
        parser.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument(
        "--state",
        type=_state_list,
        action="append",
        metavar="STATES",
        help=f"only these states: comma-separated and repeatable, among {', '.join(ROLLOUT_STATES)}",
    )
    for parser in (st, g):
        parser.add_argument("--no-progress", action="store_true", help="no progress counter on stderr")
    st.add_argument("--no-manifests", action="store_true", help="LIST only: skip the masked counts")
    g.add_argument(
        "--retired-older-than",
        type=_argument(duration),
        required=True,
        metavar="AGE",
        help="handle a retired rollout only when every key under it is this old, e.g. 7d, 12h (a bare number is seconds)",
    )
    g.add_argument(
        "--abandoned-after",
        type=_argument(duration),
        metavar="AGE",
        help="report open rollouts quiet for this long (default: --retired-older-than)",
    )
    g.add_argument("--yes", action="store_true", help="delete (default: a dry run that deletes nothing)")
    ls.set_defaults(func=_ls_command)
    st.set_defaults(func=_status_command)
    g.set_defaults(func=_gc_command)
    parsers.update({"ls": ls, "status": st, "gc": g})
    return parsers


def _open_store(args: Any) -> Any:
    import os

    from s3capture.store import S3TokenStore

    if args.endpoint:
        os.environ["AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL_S3"] = args.endpoint
    return S3TokenStore(args.url, endpoint_url=args.endpoint)


async def _close_after(store: Any, work: Any) -> Any:
    try:
        return await work
    finally:
        await store.close()


def _ls_command(args: Any) -> int:
    store = _open_store(args)
    table = sys.stdout.isatty() and not args.json

    async def run() -> int:
        count = 0
        # The header comes with the first row (or alone, for an empty listing): a listing that
        # fails at once (no credentials, no bucket) prints its error without a table above it.
        header = not args.json
        async with contextlib.aclosing(store.rollouts(_given_states(args.state), prefix=args.prefix)) as rollouts:
            async for info in rollouts:
                if header:
                    print(format_rollout_row(None, table=table))
                    header = False
                line = msgspec.json.encode(info).decode() if args.json else format_rollout_row(info, table=table)
                print(line)
                count += 1
        if header:
            print(format_rollout_row(None, table=table))
        if table:
            print(_counted(count, "rollout"), file=sys.stderr)
        if not count and not args.json:
            _print_hint(await _empty_listing_hint(store, filtered=bool(args.state or args.prefix)))
        return 0

    return asyncio.run(_close_after(store, run()))


def _status_command(args: Any) -> int:
    store = _open_store(args)
    progress = not args.no_progress and sys.stderr.isatty()

    async def run() -> tuple[StoreStatus, str]:
        result = await status(store, prefix=args.prefix, manifests=not args.no_manifests, progress=progress)
        empty = not any(counts.rollouts for counts in result.states.values())
        return result, await _empty_listing_hint(store, filtered=bool(args.prefix)) if empty and not args.json else ""

    result, hint = asyncio.run(_close_after(store, run()))
    print(msgspec.json.encode(result).decode() if args.json else format_status(result))
    _print_hint(hint)
    return 0


async def _empty_listing_hint(store: RolloutObjects, *, filtered: bool) -> str:
    """What ``ls`` and ``status`` say on stderr when they show no rollout: for a selection
    (``--state``, ``--prefix``) of a root that holds rollouts, that none matched; else the roots
    inside or beside the URL (``roots_near``), a mistyped or too short root. ``""``: nothing to say."""
    if filtered:
        from s3capture.errors import StoreError

        holds = False
        try:  # the first rollout of the root, if any (folder markers alone are none)
            async with contextlib.aclosing(store.rollouts_listed()) as every:
                async for _ in every:
                    holds = True
                    break
        except StoreError:
            pass
        if holds:
            return "no rollouts match --state/--prefix; this root holds others (`s3capture ls URL` lists them all)"
    hint = await roots_near(store)
    return f"no rollouts here; {hint}" if hint else ""


def _print_hint(hint: str) -> None:
    if hint:
        print(hint, file=sys.stderr)


def _gc_command(args: Any) -> int:
    if args.retired_older_than < MIN_SAFE_AGE:
        print(
            f"s3capture gc: warning: --retired-older-than {args.retired_older_than:g}s is under {MIN_SAFE_AGE:.0f}s; "
            "a threshold must exceed the longest a put can take (retries included) "
            "(docs/operations.md)",
            file=sys.stderr,
        )
    store = _open_store(args)
    progress = not args.no_progress and sys.stderr.isatty()
    dry_run = not args.yes

    reader_gone = False

    def show(action: GcAction) -> None:
        nonlocal reader_gone
        line = (
            msgspec.json.encode({"type": "action", **msgspec.to_builtins(action)}).decode()
            if args.json
            else format_action(action, dry_run=dry_run)
        )
        try:
            print(line, flush=True)
        except BrokenPipeError:
            if dry_run:
                raise  # `gc URL | head`: a quiet end, nothing was changed
            # `gc --yes | head`: stopping here would leave the run half done and exit 0; it
            # finishes its deletions, and says so where it still can.
            from s3capture.cli import stdout_to_devnull

            stdout_to_devnull()
            if not reader_gone:
                reader_gone = True
                print("s3capture gc: the output's reader went away; finishing the run", file=sys.stderr)

    report = asyncio.run(
        _close_after(
            store,
            gc(
                store,
                args.retired_older_than,
                dry_run=dry_run,
                abandoned_after=args.abandoned_after,
                prefix=args.prefix,
                on_action=show,
                progress=progress,
            ),
        )
    )
    if args.json:
        print(msgspec.json.encode({"type": "summary", **msgspec.to_builtins(report)}).decode())
    else:
        print(format_gc(report))
    if reader_gone:
        print(f"s3capture gc: {format_gc(report)}", file=sys.stderr)
    return 0
