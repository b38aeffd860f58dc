"""``gc``: plan (dry run) and carry out the removal of what retired rollouts leave behind (and of
leftover listing probes alone at a rollout prefix), and report abandoned open rollouts
(``GcAction``, ``GcReport``, ``MIN_SAFE_AGE``). The rules it follows, and why it cannot lose an
acknowledged entry, are in the ``s3capture.ops`` package docstring."""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Callable

import msgspec

from s3capture.layout import is_ledger_probe_rel
from s3capture.ops.common import _age, _clock, _newest, _progress, _rollout_prefix, _when
from s3capture.rollouts import RolloutInfo, RolloutObjects
from s3capture.rollouts.listing import _check_prefix
from s3capture.transport import ListedObject

MIN_SAFE_AGE = 3600.0
"""Seconds: the smallest ``--retired-older-than`` the command line takes without a warning."""


class GcAction(msgspec.Struct, kw_only=True):
    """One rollout ``gc`` acted on (or, in a dry run, would act on)."""

    rollout_id: str
    action: str
    """``"delete"`` (fence and tombstone, or a bare fence, removed: the id reads as unused),
    ``"retire_again"`` (straggler objects removed, fence and tombstone rewritten and kept),
    ``"delete_probes"`` (leftover listing probes removed from a prefix that held nothing else: the
    id was never used otherwise and reads as unused either way),
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
    deleted_probe_prefixes: int = 0
    """Rollout prefixes holding nothing but leftover listing probes (``ledger/.probe/<32 hex>``,
    ``probe_listing``) whose probes were (would be) removed; their keys count in
    ``deleted_objects``."""
    deleted_objects: int = 0
    deleted_bytes: int = 0
    skipped: int = 0
    """Rollouts left alone because the re-check listing differed from the streaming one."""
    unfinished: int = 0
    """Retired rollouts left alone because they hold objects and a retire tombstone but no fence (a
    retire that failed or crashed before its fence PUT): writers take them for open, so their
    objects may be acknowledged writes; retire or delete them to finish (``docs/operations.md``)."""
    too_young: int = 0
    """Retired rollouts (or bare fences, or prefixes of leftover listing probes alone) with a key
    newer than ``older_than``."""
    abandoned: int = 0
    """Open rollouts quiet for longer than ``abandoned_after`` (reported, not deleted)."""
    abandoned_bytes: int = 0


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
    """Remove what retired rollouts leave behind, and leftover listing probes alone at a rollout
    prefix; report abandoned open rollouts.

    ``older_than``: seconds; a retired rollout (or a bare fence, or a prefix of probes alone) is
    handled only when every key under its prefix is at least this old (``now`` minus the store's
    LastModified). ``dry_run``
    (default ``True``): send nothing but LIST requests and report what would be done.
    ``abandoned_after``: seconds an open rollout must be quiet to be reported as abandoned (default
    ``older_than``). ``prefix``: only rollout ids starting with it. ``now``: seconds since the epoch
    (default ``store_time``: the earlier of the store's clock, from the ``Date`` of its LIST answers,
    and this machine's, so a clock running ahead never makes a rollout look older). ``on_action``: called with each ``GcAction`` as it is decided
    (dry run) or done, so a caller can print them without ``gc`` keeping a list.

    The rules (module docstring and ``docs/operations.md``): a rollout is changed only after a
    second listing of its own prefix, right before the first write or delete, shows exactly what
    the streaming listing showed; only listed keys are deleted; a retired rollout with straggler
    objects is retired again (fence rewritten and kept) instead of losing its fence; a prefix whose
    every key is a listing probe (``ledger/.probe/<32 hex>``, left by a ``probe_listing`` call
    whose PUT the store applied after the call deleted it) loses those keys; open and frozen
    rollouts are never written to or deleted from.

    Requests: one streaming LIST of the root; without ``dry_run``, per rollout acted on one LIST
    plus two DELETEs (fence and tombstone), two PUTs and DeleteObjects (retire again), or one
    DeleteObjects (probes alone).
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
        # Every rollout prefix, also those ``rollouts`` does not show (nothing of the client's, no
        # fence): a prefix of leftover listing probes alone is removed here, and nowhere else.
        async with contextlib.aclosing(store._listed_prefixes(_check_prefix(prefix))) as listed:
            async for rollout_id, found, items, listed_at in listed:
                bar.update(1)
                if found is None:
                    await _collect_probes(
                        store, rollout_id, items, clock(_Listed(listed_at)), older_than, dry_run, report, emit
                    )
                    continue
                info = found
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


async def _changed_since_listing(
    store: RolloutObjects,
    rollout_id: str,
    rollout_prefix: str,
    items: list[ListedObject],
    report: GcReport,
    emit: Callable[[GcAction], None],
) -> bool:
    """List ``rollout_prefix`` again; when it does not show exactly ``items`` (new, gone or
    rewritten keys), count and report the rollout as skipped and return True."""
    again = await store._list(rollout_prefix)
    if _same_listing(items, again):
        return False
    report.skipped += 1
    emit(
        GcAction(
            rollout_id=rollout_id,
            action="skipped",
            keys=[],
            last_write=_when(_newest(again)),
            reason="changed since the listing",
        )
    )
    return True


class _Listed(msgspec.Struct, frozen=True):
    """When a rollout prefix that ``rollouts`` does not show was listed (what ``_clock`` reads)."""

    listed_at: float


async def _collect_probes(
    store: RolloutObjects,
    rollout_id: str,
    items: list[ListedObject],
    now: float,
    older_than: float,
    dry_run: bool,
    report: GcReport,
    emit: Callable[[GcAction], None],
) -> None:
    """Remove a rollout prefix's keys when every one of them is a leftover listing probe older
    than ``older_than`` (at ``now``): a ``probe_listing`` call's probe PUT that the store applied
    after the call had deleted it, under an id nothing else was written to. Anything else there
    (a folder marker, any other key) leaves the prefix alone; a probe beside a rollout's keys goes
    with them (retire, delete). Without ``dry_run``, a listing of the prefix right before the
    delete must show exactly the same keys, and only those are deleted."""
    rollout_prefix = _rollout_prefix(store, rollout_id)
    if not items or not all(is_ledger_probe_rel(item.key[len(rollout_prefix) :]) for item in items):
        return  # folder markers, or probes beside one: not ours to remove
    newest = _newest(items)
    if newest <= 0 or _age(now, newest) < older_than:
        report.too_young += 1
        return
    if not dry_run:
        # The re-check (a call probing the id, or a write that uses it, makes it someone's now).
        if await _changed_since_listing(store, rollout_id, rollout_prefix, items, report, emit):
            return
        await store._delete_keys([item.key for item in items])
        store._cache.discard_prefix(rollout_prefix)
    report.deleted_probe_prefixes += 1
    report.deleted_objects += len(items)
    report.deleted_bytes += sum(item.size for item in items)
    emit(
        GcAction(
            rollout_id=rollout_id,
            action="delete_probes",
            keys=sorted(item.key[len(rollout_prefix) :] for item in items),
            objects=len(items),
            bytes=sum(item.size for item in items),
            last_write=_when(newest),
            reason="leftover listing probes alone (a probe_listing call's PUT applied after its delete)",
        )
    )


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
        if await _changed_since_listing(store, info.rollout_id, rollout_prefix, items, report, emit):
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
