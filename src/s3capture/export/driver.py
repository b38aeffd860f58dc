"""The export run (``export``): options, the destination's durable shards and orphans, the streamed
listing cut into shard tasks (selection, resume), the engine, drops after durable shards, progress
and the summary (``format_summary``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import msgspec

from s3capture.errors import install_hint
from s3capture.export.destinations import _is_s3, _LocalDestination, _open_destination, _S3Destination
from s3capture.layout import escape_controls
from s3capture.export.engines import ENGINES, ShardTask, _import_ray
from s3capture.export.records import (
    _EXAMPLES,
    BUILD_WITH,
    FORMATS,
    MASKED_CHOICES,
    STATES,
    TOKEN_TYPES,
    ExportJob,
    ExportSummary,
    RolloutRecord,
    ShardResult,
    _note,
    _reason_class,
    source_endpoint_of,
)
from s3capture.export.shard import NOT_SEALED, ListedRollout
from s3capture.ops import roots_below, roots_beside, roots_hint, store_time

_DROPS_AHEAD = 1024
"""Drops started and not finished at most (32 of them run at once); the listing and the shard results
wait behind them, so pending drops hold bounded memory (~2 KB each) whatever the number of rollouts."""

HOLD_ENV = "S3CAPTURE_EXPORT_HOLD_AFTER_SHARDS"
"""Test hook: after the parent has handled this many shard results (and finished their drops) it prints
``s3capture export: holding after N shards`` to stderr and sleeps (workers go on with the shards
already assigned), so a test can SIGKILL the export between shards."""


# --------------------------------------------------------------------------- progress
class _Progress:
    """A tqdm bar on a TTY, else a plain line every ``interval`` seconds (and none when disabled)."""

    def __init__(self, enabled: bool, *, stream: Any = None, interval: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = interval
        self.lock = threading.Lock()
        self.rollouts = self.trajectories = self.tokens = self.bytes = 0
        self.total = 0
        self.listing_done = False
        self.started = time.monotonic()
        self.last_line = self.started
        self.first: tuple[float, int] | None = None
        """When the first rollouts were done, and how many: the ETA's rate counts from there, not
        from the start (starting worker processes or a Ray runtime takes seconds)."""
        self.bar: Any = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=0, desc="export", unit="rollout", file=self.stream, dynamic_ncols=True)

    def add(self, item: tuple[int, int, int, int]) -> None:
        rollouts, trajectories, tokens, size = item
        with self.lock:
            self.rollouts += rollouts
            if self.first is None:
                self.first = (time.monotonic(), self.rollouts)
            self.trajectories += trajectories
            self.tokens += tokens
            self.bytes += size
            self._render(rollouts)

    def planned(self, count: int, *, done: bool = False) -> None:
        with self.lock:
            self.total += count
            self.listing_done = self.listing_done or done
            if self.bar is not None:
                self.bar.total = self.total
                self.bar.refresh()

    def _rate(self) -> float:
        return self.bytes / 1e6 / max(1e-9, time.monotonic() - self.started)

    def _render(self, advanced: int) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"{self.trajectories:,} traj, {self.tokens / 1e6:.1f}M tok, {self._rate():.1f} MB/s", refresh=False
            )
            self.bar.update(advanced)
            return
        now = time.monotonic()
        if now - self.last_line >= self.interval:
            self.last_line = now
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        eta = "?"
        if self.listing_done and self.first is not None and self.rollouts > self.first[1]:
            since, counted = self.first
            rate = (self.rollouts - counted) / max(1e-9, time.monotonic() - since)
            eta = f"{(self.total - self.rollouts) / rate:.0f}s"
        total = f"{self.total:,}" if self.listing_done else f"{self.total:,}+"
        return (
            f"export: {self.rollouts:,}/{total} rollouts, {self.trajectories:,} trajectories, "
            f"{self.tokens:,} tokens, {self._rate():.1f} MB/s, {elapsed:.0f}s elapsed, ETA {eta}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.rollouts:
            self.stream.write(self.line() + "\n")
            self.stream.flush()


# --------------------------------------------------------------------------- the export
def parse_duration(text: str) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"10m"``, ``"2h"`` or ``"1d"``; ``ValueError`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not match:
        raise ValueError(f"expected a duration such as 90s, 10m, 2h or 1d, got {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def read_ids(path: str | os.PathLike) -> list[str]:
    """Rollout ids of an ``--ids`` file: one per line; blank lines and lines starting with ``#``
    are ignored, surrounding whitespace is stripped. ``ValueError`` for an unreadable or empty file."""
    try:
        with open(path, encoding="utf-8-sig") as handle:  # a BOM (Notepad, PowerShell) is not part of an id
            ids = [line.strip() for line in handle]
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--ids {path}: cannot read it: {error}") from None
    ids = [i for i in ids if i and not i.startswith("#")]
    if not ids:
        raise ValueError(f"--ids {path}: no rollout id in it")
    return ids


def check_destination(url: str, dest: str) -> None:
    """Refuse an ``s3://`` destination inside the source root's rollouts, or one that contains
    them (its scan would list every captured object). ``ValueError``; a local folder passes."""
    from s3capture.rollouts import parse_s3_url

    bucket, root = parse_s3_url(url)
    if _is_s3(dest):
        dest_bucket, dest_prefix = parse_s3_url(dest)
        inside = f"{root}/rollouts" if root else "rollouts"
        if dest_bucket == bucket and (
            dest_prefix == inside or dest_prefix.startswith(inside + "/") or "rollouts" in dest_prefix.split("/")
        ):
            raise ValueError(f"destination {dest} lies inside the rollouts of {url}; choose a prefix outside it")
        if dest_bucket == bucket and (not dest_prefix or inside.startswith(dest_prefix + "/")):
            # The destination scan lists every key under DEST: here every captured object, each run.
            raise ValueError(
                f"destination {dest} contains the rollouts of {url}: reading the destination would list every captured "
                "object; choose a prefix beside them"
            )


def _check_options(url: str, dest: str, opts: dict[str, Any]) -> None:
    from s3capture.rollouts import parse_s3_url

    parse_s3_url(url)
    for name, allowed in (
        ("format", FORMATS),
        ("masked", MASKED_CHOICES),
        ("build_with", BUILD_WITH),
        ("token_type", TOKEN_TYPES),
    ):
        if opts[name] not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {opts[name]!r}")
    if opts["format"] == "gym-jsonl" and opts["builder"] == "per_request":
        # A Gym JSONL line is the one response (main chain) Gym's consumer returns for a rollout;
        # per_request gives one trajectory per call, all but one of which it would leave out.
        raise ValueError(
            "--format gym-jsonl holds one Gym response (the main chain) per rollout and Gym has no "
            "per_request builder: use --format parquet with --builder per_request"
        )
    if opts["engine"] not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {opts['engine']!r}")
    for name in opts["states"]:
        if name not in STATES:
            raise ValueError(f"state must be among {', '.join(STATES)}, got {name!r}")
    for name, low in (("workers", 0), ("concurrency", 1), ("shard_rollouts", 1), ("row_group_rows", 1)):
        if not isinstance(opts[name], int) or opts[name] < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {opts[name]!r}")
    if not opts["min_age"] >= 0:  # NaN too: no age compares below it, every open rollout would pass
        raise ValueError(f"min_age must be >= 0 seconds, got {opts['min_age']!r}")
    if isinstance(opts["ids"], (str, bytes)):
        raise TypeError("ids must be a collection of rollout ids, not a single str")
    if not opts["fence_grace"] >= 0:
        raise ValueError(f"fence_grace must be >= 0 seconds, got {opts['fence_grace']!r}")
    if opts["engine"] == "ray":
        _import_ray()  # one line naming the extra, before anything is read
        if opts["workers"] < 1:
            raise ValueError(f"--engine ray needs --workers >= 1 (Ray tasks at once), got {opts['workers']}")
    if not dest:
        raise ValueError("no destination (dest, or --out on the command line)")
    check_destination(url, dest)
    if opts["format"] == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError(f"--format parquet needs pyarrow: {install_hint('parquet')}") from None
    # The builder and engine, checked once here (on an empty snapshot, which only masks) rather than
    # failing every rollout (NeMo Gym 0.7.0 knows prefix_merging only; per_request is built-in).
    from s3capture.store import FrozenSnapshot
    from s3capture.trajectory import build_rollout

    try:
        build_rollout(
            FrozenSnapshot("s3capture-export-probe", (), False, "", 0),
            builder=opts["builder"],
            engine=opts["build_with"],
        )
    except ValueError as error:
        raise ValueError(f"--builder {opts['builder']} --build-with {opts['build_with']}: {error}") from None
    except ImportError as error:
        raise ValueError(f"--build-with {opts['build_with']}: {error}") from None


def _resolved_engine(builder: str, build_with: str) -> str:
    """``"gym"`` or ``"builtin"``: the engine ``build_with`` (``auto`` | ``gym`` | ``builtin``) picks here."""
    from s3capture.store import FrozenSnapshot
    from s3capture.trajectory import _choose_engine

    return _choose_engine(FrozenSnapshot("s3capture-export-probe", (), False, "", 0), builder, build_with)


def _root_of(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of a source URL, so that ``s3://b/run`` and ``s3://b/run/`` compare equal."""
    from s3capture.rollouts import parse_s3_url

    try:
        return parse_s3_url(url)
    except ValueError:
        return url, ""


def _called_by_a_reimported_script() -> bool:
    """Whether this call comes from the top-level code of a script that a ``spawn`` child is
    re-importing as ``__mp_main__`` (a script that calls ``export`` without a ``__main__`` guard):
    left to run, it would start an export of its own inside the worker."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        # (spawn runs the script through runpy under the name __mp_main__, in a namespace of its own)
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


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
    so it must be the capture fleet's value, never less.

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
    )
    summary = ExportSummary(source=url, dest=dest, format=format)
    requests: collections.Counter[str] = collections.Counter()
    wanted = set(ids) if ids is not None else None
    seen_ids: set[str] = set()
    bar = progress if isinstance(progress, _Progress) else _Progress(bool(progress))

    # -- the destination: durable shards, orphans of an interrupted run
    store = S3TokenStore(
        url, endpoint_url=endpoint_url, transport=transport, cache_bytes=1024 * 1024, fence_grace=fence_grace
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
        orphans = [name for name in existing.data_files if name not in durable_data] + existing.temp_files
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
        elif not prefix and not summary.listed and not summary.not_selected:
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
            await target.close(failed=failed)  # releases the destination (a local folder's lock)
            # the parent's own destination requests: claim, scan, renewals, the claim's delete
            requests.update({f"dest:{k}": v for k, v in target.requests.items()})
    summary.requests = dict(sorted(requests.items()))
    summary.wall_seconds = round(time.monotonic() - started, 3)
    return summary


def _account(summary: ExportSummary, result: ShardResult, requests: collections.Counter) -> None:
    requests.update(result.requests)
    if result.error:
        summary.shards_failed += 1
    elif result.manifest:
        summary.shards_written += 1
        if result.data:
            summary.data_files += 1
    for rid, reason in result.skipped:
        summary.skipped += 1
        _note(summary.skipped_reasons, summary.skipped_examples, rid, reason)
    for rid, reason in result.failed:
        summary.failed += 1
        _note(summary.failed_reasons, summary.failed_examples, rid, reason)
    if result.error:
        return
    for record in result.records:
        if record.masked:
            for reason in record.mask_reasons or ["masked"]:
                kind = _reason_class(reason)
                summary.masked_reasons[kind] = summary.masked_reasons.get(kind, 0) + 1
            if record.written:
                summary.masked_written += 1
            else:
                summary.masked_excluded += 1
        else:
            summary.exported += 1
    summary.trajectories += result.rows
    summary.tokens += result.tokens
    for rid, count in result.clipped:
        summary.logprobs_clipped += count
        if len(summary.clipped_examples) < 20:
            summary.clipped_examples.append(f"{rid}: {count}")
    summary.bytes_read += result.bytes_read
    summary.bytes_written += result.bytes_written


def _size(nbytes: float) -> str:
    """``nbytes`` in MB with one decimal, or in kB under 1 MB (a small export is not "0.0 MB")."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} kB"


def format_summary(summary: ExportSummary) -> str:
    """The human-readable summary ``s3capture export`` prints at the end."""
    s = summary
    mb = s.bytes_read / 1e6
    rate = mb / s.wall_seconds if s.wall_seconds else 0.0
    lines = [
        f"export {s.source} -> {s.dest} ({s.format})",
        f"rollouts: exported {s.exported:,}, masked {s.masked_written + s.masked_excluded:,} "
        f"({s.masked_written:,} written with masked=true, {s.masked_excluded:,} left out), "
        f"already exported {s.already_exported:,}, changed since their export {s.changed_since_export:,}, skipped {s.skipped:,}, failed {s.failed:,}",
        f"written: {s.trajectories:,} trajectories, {s.tokens:,} tokens, {s.shards_written:,} shard{'' if s.shards_written == 1 else 's'} "
        f"({_size(s.bytes_written)}{'; manifests only, no data file' if s.shards_written and not s.trajectories else ''}); "
        f"read {_size(s.bytes_read)} ({rate:.2f} MB/s)",
    ]
    if s.shards_existing or s.orphans_removed:
        lines.append(
            f"destination: {s.shards_existing:,} durable shard{'' if s.shards_existing == 1 else 's'} found; "
            f"{s.orphans_removed:,} unfinished file{'' if s.orphans_removed == 1 else 's'} removed"
        )
    for title, counts in (("masked", s.masked_reasons), ("skipped", s.skipped_reasons), ("failed", s.failed_reasons)):
        if counts:
            # counted by reason class (``roots`` for ``roots:2``): "roots 1" read as "one root"
            lines.append(
                f"{title} rollouts by reason class (a rollout may have several): "
                + ", ".join(f"{k}: {v:,}" for k, v in sorted(counts.items()))
            )
    # Example lines name rollout ids, which may hold control characters: escaped, one line each.
    for title, examples in (("skipped", s.skipped_examples), ("failed", s.failed_examples)):
        for _, kept in sorted(examples.items()):
            lines.extend(f"  {title} {escape_controls(line)}" for line in kept[:3])
    if s.changed_since_export:
        lines.extend(f"  changed {escape_controls(line)}" for line in s.changed_examples[:3])
    if s.logprobs_clipped:
        lines.append(
            f"log probabilities beyond float32's range, written as its nearest finite value: {s.logprobs_clipped:,} "
            "(--format gym-jsonl keeps them)"
        )
        lines.extend(f"  clipped {escape_controls(line)}" for line in s.clipped_examples[:3])
    if s.dropped or s.drop_failed or s.not_dropped:
        lines.append(
            f"dropped: {s.dropped:,}; drop failed (evidence kept): {s.drop_failed:,}; not dropped: {s.not_dropped:,}"
        )
        lines.extend(f"  {escape_controls(line)}" for line in (s.drop_failed_examples[:3] + s.not_dropped_examples[:3]))
    if s.shards_failed:
        lines.append(f"shards failed: {s.shards_failed:,} (their rollouts are counted failed; a re-run retries them)")
    if not s.data_files and not s.shards_failed:
        # Reading such a folder fails in pyarrow ("No match for FieldRef.Name(masked)"): say why.
        hints = []
        waiting = s.skipped_reasons.get("not_quiescent", 0)
        if waiting:
            hints.append(
                f"{waiting:,} open rollouts have not been quiet for --min-age: --min-age 0 takes them now "
                "(with --freeze they are frozen first, and a write still coming to one of them fails)"
            )
        if s.masked_excluded:
            were = "rollout was" if s.masked_excluded == 1 else "rollouts were"
            hints.append(f"{s.masked_excluded:,} masked {were} left out: --masked include writes them too")
        for state, count in sorted(s.not_selected.items()):
            why = " (dropped or retired: their entries are gone)" if state == "retired" else ""
            hints.append(f"{count:,} {state} rollouts were not selected{why}")
        if s.root_empty:
            where = f"no rollouts under {s.source} (nothing under its rollouts/ prefix)"
            hint = roots_hint(s.roots_below, s.roots_beside)
            if hint:
                where += "; " + hint
            hints.append(where)
        lines.append("nothing to read: the destination holds no data file (no row was written)")
        lines.extend(f"  {hint}" for hint in hints)
    lines.append("requests: " + (", ".join(f"{k} {v:,}" for k, v in s.requests.items()) or "none"))
    lines.append(f"wall time: {s.wall_seconds:.1f}s; result: {'OK' if s.ok else 'FAILED'}")
    return "\n".join(lines)
