"""The export run (``export``): the destination's durable shards and orphans, the streamed
listing cut into shard tasks (selection, resume), the engine, drops after durable shards. Its
options are checked in ``options``; its progress and summary are in ``report`` (both re-exported
here: ``parse_duration``, ``read_ids``, ``check_destination``, ``format_summary``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import msgspec

from s3capture.export.destinations import _is_s3, _LocalDestination, _open_destination, _S3Destination
from s3capture.export.engines import ENGINES, ShardTask
from s3capture.export.options import (
    _called_by_a_reimported_script,
    _check_options,
    _resolved_engine,
    _root_of,
    check_destination as check_destination,
    parse_duration as parse_duration,
    read_ids as read_ids,
)
from s3capture.export.records import (
    _EXAMPLES,
    ExportJob,
    ExportSummary,
    RolloutRecord,
    _note,
    source_endpoint_of,
)
from s3capture.export.report import _account, _Progress, format_summary as format_summary
from s3capture.export.shard import NOT_SEALED, ListedRollout
from s3capture.errors import StoreError
from s3capture.layout import is_folder_marker
from s3capture.ops import roots_below, roots_beside, store_time

_DROPS_AHEAD = 1024
"""Drops started and not finished at most (32 of them run at once); the listing and the shard results
wait behind them, so pending drops hold bounded memory (~2 KB each) whatever the number of rollouts."""

HOLD_ENV = "S3CAPTURE_EXPORT_HOLD_AFTER_SHARDS"
"""Test hook: after the parent has handled this many shard results (and finished their drops) it prints
``s3capture export: holding after N shards`` to stderr and sleeps (workers go on with the shards
already assigned), so a test can SIGKILL the export between shards."""


# --------------------------------------------------------------------------- the export
async def export(
    url: str,
    dest: str,
    *,
    states: Sequence[str] | None = None,
    ids: Iterable[str] | None = None,
    prefix: str = "",
    min_age: float = 600.0,
    freeze: bool = False,
    builder: str = "prefix_merging",
    build_with: str = "auto",
    format: str = "parquet",
    masked: str = "skip",
    drop: bool = False,
    engine: str = "local",
    engine_options: dict[str, Any] | None = None,
    workers: int = 2,
    concurrency: int = 8,
    shard_rollouts: int = 256,
    shard_bytes: int = 256 * 1024 * 1024,
    row_group_rows: int = 1024,
    row_group_bytes: int = 64 * 1024 * 1024,
    token_type: str = "auto",
    endpoint_url: str | None = None,
    transport: str | None = None,
    fence_grace: float = 1.0,
    probe_listing: bool = False,
    progress: bool | _Progress = False,
) -> ExportSummary:
    """Export the rollouts of ``url`` (``s3://bucket/prefix``) to ``dest`` (a local folder or an
    ``s3://`` prefix) as training trajectories; resumable (``docs/export.md``).

    Selection: ``states`` (default: frozen, and open ones whose newest object is at least
    ``min_age`` seconds old at ``s3capture.ops.store_time``, the earlier of the store's clock and this machine's; read unsealed unless ``freeze``), ``ids`` (only
    these rollout ids) and ``prefix`` (only ids starting with it). Building: ``builder``
    (``prefix_merging`` | ``per_request``), ``build_with`` (``auto`` | ``gym`` | ``builtin``).
    Output: ``format`` (``parquet`` | ``gym-jsonl``), ``masked`` (``skip`` | ``include``), shards of
    at most ``shard_rollouts`` rollouts and about ``shard_bytes`` stored bytes, Parquet row groups of
    at most ``row_group_rows`` rows / ``row_group_bytes`` estimated bytes, ``token_type``
    (``auto``: ``list<int32>`` token ids in every shard, and a rollout holding an id >= 2**31 fails
    with ``token_overflow``, naming ``int64``; ``int64``: ``list<int64>`` in every shard). ``drop``: drop each rollout
    exported as trainable from a sealed snapshot once its shard is durable. ``engine`` (``ENGINES``)
    with ``workers`` processes, ``concurrency`` rollouts in flight per shard, and
    ``engine_options`` (keyword arguments for the engine, e.g. a cluster address). ``fence_grace``:
    the seconds every client of the bucket uses (``S3TokenStore(fence_grace=)``); the drops wait it,
    so it must be the capture fleet's value, never less. ``probe_listing``: the freezes of
    ``freeze`` list behind a probe (``S3TokenStore(probe_listing=True)``), for a store whose
    listings lag writes (``docs/reliability.md``, "Listings that lag"); the reads and drops need none.

    Returns an ``ExportSummary``; a rollout that fails is counted there, never raised. Raises
    ``ValueError`` for bad options or a destination holding another export (other format or
    builder), ``TypeError`` for ``ids`` given as a single str, ``StoreError`` when the source
    listing or the destination fails, ``ExportWorkerDied`` (a ``RuntimeError``) when a worker
    process dies.
    """
    from s3capture.store import S3TokenStore

    states = tuple(states) if states else ("open", "frozen")
    opts = dict(
        format=format,
        masked=masked,
        builder=builder,
        build_with=build_with,
        token_type=token_type,
        engine=engine,
        states=states,
        workers=workers,
        concurrency=concurrency,
        shard_rollouts=shard_rollouts,
        row_group_rows=row_group_rows,
        min_age=min_age,
        fence_grace=fence_grace,
        ids=ids,
    )
    _check_options(url, dest, opts)
    if engine == "local" and workers and _called_by_a_reimported_script():
        raise RuntimeError(
            "export() was called while a spawned export worker re-imported the calling script: call it "
            "under `if __name__ == '__main__':` (workers are spawned and re-import the script), or pass "
            "workers=0"
        )
    # "auto" is decided once, here, and the job carries the decision: every worker (a Ray node
    # without NeMo Gym included) then builds with the same code or fails its rollouts loudly, and
    # the shard manifests record which builder ran, so a re-run can refuse to mix the two.
    build_with = _resolved_engine(builder, build_with)
    started = time.monotonic()
    job = ExportJob(
        url=url,
        dest=dest,
        format=format,
        builder=builder,
        build_with=build_with,
        masked=masked,
        freeze=freeze,
        concurrency=concurrency,
        row_group_rows=row_group_rows,
        row_group_bytes=row_group_bytes,
        token_type=token_type,
        endpoint_url=endpoint_url,
        transport=transport,
        probe_listing=probe_listing,
    )
    summary = ExportSummary(source=url, dest=dest, format=format, id_prefix=prefix)
    requests: collections.Counter[str] = collections.Counter()
    wanted = set(ids) if ids is not None else None
    seen_ids: set[str] = set()
    bar = progress if isinstance(progress, _Progress) else _Progress(bool(progress))

    # -- the destination: durable shards, orphans of an interrupted run
    store = S3TokenStore(
        url,
        endpoint_url=endpoint_url,
        transport=transport,
        cache_bytes=1024 * 1024,
        fence_grace=fence_grace,
        probe_listing=probe_listing,
    )
    target = _open_destination(job)
    try:
        # The endpoint the source client resolved (an AWS profile's endpoint_url included), which
        # every shard manifest records: the same bucket and prefix elsewhere is another root.
        endpoint = source_endpoint_of(await store.transport.effective_endpoint())
        job = msgspec.structs.replace(job, source_endpoint=endpoint)
        await target.lock()  # held until the end: another export into it is refused
        if isinstance(target, _S3Destination) and target.tag:
            job = msgspec.structs.replace(job, run_tag=target.tag)
        elif isinstance(target, _LocalDestination):
            job = msgspec.structs.replace(job, lock_token=target.token)
        existing = await target.scan()
        if existing.foreign:
            # A dataset reader of the destination would read them as part of the export (another
            # schema fails the read, or its columns silently replace the export's).
            shown = ", ".join(existing.foreign[:3]) + (
                f" and {len(existing.foreign) - 3} more" if len(existing.foreign) > 3 else ""
            )
            raise ValueError(
                f"destination {dest} holds files no export wrote ({shown}): a Parquet or JSONL reader of the "
                "destination would read them as part of the dataset; export into a new or empty "
                "destination, or move them away"
            )
        done: dict[str, RolloutRecord] = {}
        for manifest in existing.manifests:
            # (Not for an s3:// destination: the job reads it through the same endpoint as the
            # source, so another spelling of the endpoint there can only be an alias of it.)
            other_endpoint = (
                manifest.source_endpoint is not None and manifest.source_endpoint != endpoint and not _is_s3(dest)
            )
            if manifest.source and (_root_of(manifest.source) != _root_of(url) or other_endpoint):
                # Resume keys rows by rollout id: two roots' rollouts (ids reused, as every run's
                # "r-0") in one dataset would be mistaken for one another, or duplicated.
                where = f" at {manifest.source_endpoint or 'AWS'}" if other_endpoint else ""
                here = f" at {endpoint or 'AWS'}" if other_endpoint else ""
                raise ValueError(
                    f"destination {dest} holds an export of {manifest.source}{where} (part-{manifest.shard:05d}); this "
                    f"run exports {url}{here}: one destination takes one source root (a re-run resumes it), so "
                    "use another destination"
                )
            if manifest.data_format != format:
                raise ValueError(
                    f"destination {dest} holds a {manifest.data_format} export (part-{manifest.shard:05d}); "
                    f"this run writes {format}: use another destination"
                )
            if manifest.token_ids and manifest.token_ids != job.parquet_token_ids():
                raise ValueError(
                    f"destination {dest} holds list<{manifest.token_ids}> token ids (part-{manifest.shard:05d}); this run "
                    f"writes list<{job.parquet_token_ids()}>, and one folder must read as one dataset: re-run with "
                    f"--token-ids {'int64' if manifest.token_ids == 'int64' else 'auto'} or use another destination"
                )
            if manifest.builder and manifest.builder != builder:
                raise ValueError(
                    f"destination {dest} was exported with builder {manifest.builder!r}; re-run with it (--builder / builder=) or use another destination"
                )
            if manifest.build_with in ("gym", "builtin") and manifest.build_with != build_with:
                # ("auto" in a manifest of an older release: the builder that ran is unknown)
                raise ValueError(
                    f"destination {dest} was built with --build-with {manifest.build_with} (part-{manifest.shard:05d}); this "
                    f"run builds with {build_with}: re-run with --build-with {manifest.build_with} (build_with=) or use another "
                    "destination"
                )
            for record in manifest.rollouts:
                done[record.rollout_id] = record
        durable_data = {m.data for m in existing.manifests if m.data}
        unmanifested = [name for name in existing.data_files if name not in durable_data]
        unproven = (
            []
            if existing.manifests or existing.broken or existing.temp_files
            else [name for name in unmanifested if not target.written_by_an_export(name)]
        )
        if unproven:
            # Named like shards, but nothing says an export wrote them: another tool's files, or
            # data files copied without their manifests. Never removed on the strength of a name.
            shown = ", ".join(unproven[:3]) + (f" and {len(unproven) - 3} more" if len(unproven) > 3 else "")
            raise ValueError(
                f"destination {dest} holds data files without shard manifests ({shown}) and no sign that an "
                "export wrote them (no manifest or temp file, no export's lock file, no export's run tag in "
                "the name): they are not removed as an interrupted export's; export into a new or empty "
                "destination, or move them away"
            )
        orphans = unmanifested + existing.temp_files
        await target.remove(existing.broken + orphans)
        summary.orphans_removed = len(existing.broken) + len(orphans)
        summary.shards_existing = len(existing.manifests)
        summary.data_files = len(durable_data)
        next_shard = existing.highest + 1
    except BaseException:
        try:
            await store.close()
        finally:
            await target.close(failed=True)
        raise

    drop_limit = asyncio.Semaphore(32)
    drop_tasks: set[asyncio.Task] = set()

    async def drop_one(record: RolloutRecord) -> None:
        async with drop_limit:
            try:
                target.check_held()  # another export may own the destination now: never drop on its rows
                dropped = await store.drop(record.rollout_id, record.snapshot_id, record.version)
            except Exception as error:  # noqa: BLE001 - reported, never aborts the export
                summary.drop_failed += 1
                if len(summary.drop_failed_examples) < _EXAMPLES:
                    summary.drop_failed_examples.append(f"{record.rollout_id}: {type(error).__name__}: {error}")
                return
        if dropped:
            summary.dropped += 1
        else:
            summary.drop_failed += 1
            if len(summary.drop_failed_examples) < _EXAMPLES:
                summary.drop_failed_examples.append(
                    f"{record.rollout_id}: the rollout changed since its snapshot {record.snapshot_id} was exported "
                    "(a write raced the freeze); its objects are kept"
                )

    def droppable(record: RolloutRecord) -> bool:
        """Whether ``--drop`` asks for this exported rollout to be dropped: written as trainable."""
        return drop and record.written and not record.masked

    async def schedule_drop(record: RolloutRecord) -> None:
        """Start the drop of ``record``'s rollout; first wait while ``_DROPS_AHEAD`` are pending,
        so the listing and the shard results pause behind slow drops (bounded memory)."""
        if drop and record.masked:
            # Kept as the evidence of what went wrong; counted, so that the drop line does not
            # read as every exported rollout consumed (a breaker, 2026-12-04).
            summary.not_dropped += 1
            if len(summary.not_dropped_examples) < _EXAMPLES:
                reasons = ", ".join(record.mask_reasons[:3]) or "masked"
                summary.not_dropped_examples.append(f"{record.rollout_id}: masked ({reasons}), kept as evidence")
            return
        if not droppable(record):
            return
        if not record.sealed:
            summary.not_dropped += 1
            if len(summary.not_dropped_examples) < _EXAMPLES:
                summary.not_dropped_examples.append(
                    f"{record.rollout_id}: exported from an open rollout read unsealed; --freeze freezes it first"
                )
            return
        await in_background(drop_one(record))

    async def in_background(work: Any) -> None:
        """Run ``work`` (a drop, or a re-seal and its drop) beside the listing; first wait while
        ``_DROPS_AHEAD`` are pending, so the listing and the shard results pause behind slow ones
        (bounded memory)."""
        while len(drop_tasks) >= _DROPS_AHEAD:
            await asyncio.wait(list(drop_tasks), return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.create_task(work)
        drop_tasks.add(task)
        task.add_done_callback(drop_tasks.discard)

    async def reseal(previous: RolloutRecord) -> None:
        """Freeze a rollout an earlier run exported read unsealed (``--freeze``). Frozen unchanged,
        its sealed snapshot is the one that run's durable shard holds: it is not exported again,
        and ``--drop`` drops it. Changed since the listing, it is skipped, frozen: the next run
        exports its sealed snapshot."""
        rid = previous.rollout_id
        async with drop_limit:
            try:
                sealed = await store.freeze(rid)
            except Exception as error:  # noqa: BLE001 - one rollout's failure never aborts the export
                summary.failed += 1
                _note(
                    summary.failed_reasons,
                    summary.failed_examples,
                    rid,
                    f"freeze_failed: {type(error).__name__}: {error}",
                )
                return
        if (sealed.snapshot_id, sealed.version) != (previous.snapshot_id, previous.version):
            skip(rid, "changed_since_listing: written to after this run listed it; frozen now, a re-run exports it")
            return
        summary.already_exported += 1
        summary.already_left_out += not previous.written
        record = msgspec.structs.replace(previous, sealed=True)
        if droppable(record):
            await drop_one(record)  # not through in_background: this already is a background task

    def skip(rollout_id: str, reason: str) -> None:
        summary.skipped += 1
        _note(summary.skipped_reasons, summary.skipped_examples, rollout_id, reason)

    async def shard_tasks() -> AsyncIterator[ShardTask]:
        nonlocal next_shard
        batch: list[Any] = []
        batch_bytes = 0
        listed_prefix = prefix
        if wanted:  # narrow the listing to the ids' common prefix
            common = os.path.commonprefix(sorted(wanted))
            if common.startswith(prefix):
                listed_prefix = common
        async for info, listing in store.rollouts_listed(None, prefix=listed_prefix):
            rid = info.rollout_id
            if wanted is not None and rid not in wanted:
                continue
            if wanted is not None:
                seen_ids.add(rid)  # listed: counted under not_selected below, never "not listed" too
            if info.state not in states:  # listed for the summary's count only
                summary.not_selected[info.state] = summary.not_selected.get(info.state, 0) + 1
                continue
            if wanted is not None:
                seen_ids.add(rid)
            summary.listed += 1
            previous = done.get(rid)
            if (
                previous is not None
                and info.snapshot_id
                and (previous.snapshot_id, previous.version) == (info.snapshot_id, info.version)
                and (previous.written or masked == "skip")
            ):
                if info.state == "open" and freeze:  # exported read unsealed by an earlier run
                    await in_background(reseal(previous))
                    continue
                summary.already_exported += 1
                summary.already_left_out += not previous.written
                # Frozen: its shard is durable (a drop a killed run never made). Open, without
                # --freeze: reported "not dropped" under --drop, with what to do.
                await schedule_drop(
                    msgspec.structs.replace(previous, sealed=True) if info.state == "frozen" else previous
                )
                continue
            if previous is not None and previous.written:
                summary.changed_since_export += 1
                if len(summary.changed_examples) < _EXAMPLES:
                    summary.changed_examples.append(
                        f"{rid}: exported at version {previous.version} ({previous.snapshot_id}), now version {info.version}"
                    )
            mask_only = False
            if info.state == "frozen" and not info.sealed and not freeze:
                if previous is None or not previous.written or previous.masked:
                    # read_snapshot(sealed=True) would refuse it: say so without reading it.
                    skip(rid, NOT_SEALED)
                    continue
                # Its trainable rows are in the destination and it changed since (a late marker,
                # a dangling intent): read unsealed, it is written only if masked now, so that
                # the newest rows of a rollout are never trainable while its state is masked.
                mask_only = True
            if info.state == "open" and min_age > 0:
                if info.last_write is None:  # the listing gave no LastModified: its age is unknown
                    skip(
                        rid,
                        "not_quiescent: open, and the listing gives no time of its last write "
                        "(--min-age 0 exports it anyway)",
                    )
                    continue
                # Taken when the listing showed it (not now: the shards before it may have taken
                # minutes), at the earlier of the store's clock and this machine's: a clock ahead
                # never ages a write.
                age = (info.listed_at or store_time(store)) - info.last_write.timestamp()
                if age < min_age:
                    when = f"{age:.0f}s ago" if age >= 0 else f"{-age:.0f}s in the future by the store's clock"
                    skip(rid, f"not_quiescent: open, last write {when} (< --min-age {min_age:.0f}s)")
                    continue
            summary.selected += 1
            # the worker reads it without listing it again
            batch.append(
                ListedRollout(
                    info, tuple(listing), supersedes=previous is not None and previous.written, mask_only=mask_only
                )
            )
            batch_bytes += int(info.bytes or 0)
            if len(batch) >= shard_rollouts or batch_bytes >= shard_bytes:
                bar.planned(len(batch))
                yield next_shard, batch
                next_shard += 1
                batch, batch_bytes = [], 0
        bar.planned(len(batch), done=True)
        if batch:
            yield next_shard, batch
            next_shard += 1

    hold_after = int(os.environ.get(HOLD_ENV) or 0)
    handled = 0
    failed = True  # until the run completes: a failed run's empty new folder is removed at close
    try:
        async with contextlib.aclosing(
            ENGINES[engine](job, shard_tasks(), workers=workers, report=bar.add, **(engine_options or {}))
        ) as results:
            async for result in results:
                _account(summary, result, requests)
                if not result.error:
                    for record in result.records:
                        await schedule_drop(record)
                handled += 1
                if hold_after and handled >= hold_after:
                    if drop_tasks:  # the drops of the shards handled so far, as an export between shards
                        await asyncio.gather(*list(drop_tasks))
                    print(f"s3capture export: holding after {handled} shards", file=sys.stderr, flush=True)
                    while True:  # a test kills the process here
                        time.sleep(3600)  # noqa: ASYNC251 - blocks the loop on purpose: nothing more runs
        if drop_tasks:
            await asyncio.gather(*list(drop_tasks))
        if wanted is not None:
            for rid in sorted(wanted - seen_ids):
                skip(rid, "not_listed: no such rollout in the selected states and prefix")
        if (
            not summary.listed
            and not summary.not_selected
            and not summary.shards_existing  # a root this destination consumed (drop, gc): not a typo
            and (not (prefix or wanted is not None) or await _holds_no_rollout(store))
        ):
            # Nothing under the root's rollouts/ prefix (with a --prefix or --ids selection, one
            # more LIST of a single key tells): a mistyped URL, usually (exit 3).
            summary.root_empty = True
            summary.roots_below = await roots_below(store)
            summary.roots_beside = [] if summary.roots_below else await roots_beside(store)
        failed = False
    finally:
        for task in list(drop_tasks):
            task.cancel()
        bar.close()
        try:
            await store.close()
        finally:
            requests.update({f"source:{k}": v for k, v in store.request_counts.items()})
            # Releases the destination (a local folder's lock). An export of a root without
            # rollouts (exit 3: a mistyped URL, usually) leaves no folder or lock file behind, as a
            # failed one does.
            await target.close(failed=failed or summary.root_empty)
            # the parent's own destination requests: claim, scan, renewals, the claim's delete
            requests.update({f"dest:{k}": v for k, v in target.requests.items()})
    summary.requests = dict(sorted(requests.items()))
    summary.wall_seconds = round(time.monotonic() - started, 3)
    return summary


async def _holds_no_rollout(store: Any) -> bool:
    """Whether no rollout is under the root's ``rollouts/`` prefix, from one LIST page (for a
    ``--prefix`` or ``--ids`` selection that matched nothing); folder markers (``rollouts/``
    itself, a console's "Create folder") are no rollout. A LIST that fails (a role allowed to list
    only some prefixes) answers False: a hint, never an error."""
    prefix = f"{store.layout.root}rollouts/"
    try:
        page = await store.transport.list_page(prefix)
    except StoreError:
        return False
    return all(is_folder_marker(item.key[len(prefix) :], item.size) for item in page.objects)
