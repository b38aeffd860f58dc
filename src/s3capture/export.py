"""``s3capture export``: captured rollouts to training trajectories, sharded, resumable, bounded.

Pipeline (``docs/export.md``):

1. The parent streams **one listing** of the source (``S3TokenStore.rollouts``: one LIST page per
   1,000 keys, no per-rollout request), selects rollouts (state, ``--ids``, ``--prefix``,
   quiescence of open ones) and skips every rollout the destination's shard manifests already hold
   at the same ``(snapshot_id, version)``: a re-run resumes an interrupted export without a GET.
2. It cuts the rest into **shards** (at most ``shard_rollouts`` rollouts and about ``shard_bytes``
   stored bytes each) and hands them to an **engine** (``ENGINES``). The local engine runs
   ``export_shard`` in a process pool on this machine; another engine (Ray) runs the same function
   elsewhere. At most ``2 x workers`` shards are assigned ahead, so the listing pauses while they
   work (bounded memory).
3. ``export_shard(job, shard, rollouts)`` reads each rollout (``read_snapshot`` of the state the
   parent's listing showed, handed over with the shard: GETs only, no per-rollout LIST; ``freeze``
   with ``--freeze``), at most ``concurrency`` in flight, builds its trajectories
   (``s3capture.trajectory.build_rollout``), appends rows to a bounded row-group buffer, publishes
   the data file atomically (temp file + rename locally; one PUT on S3) and then the shard manifest
   ``_part-NNNNN.manifest.json``. **A shard is durable once its manifest exists.**
4. With ``drop``, the parent drops a rollout (``S3TokenStore.drop``: conditional, it keeps the
   evidence when a write raced the freeze) only after the manifest of the shard holding it exists.

A masked or incomplete rollout is never written as trainable: ``masked="skip"`` leaves it out (the
manifest still records the decision), ``masked="include"`` writes it with ``masked=true`` and its
reasons.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import datetime as _dt
import io
import logging
import multiprocessing
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import msgspec

from s3capture.errors import StoreError

__all__ = [
    "ENGINES",
    "ExportJob",
    "ExportSummary",
    "ListedRollout",
    "RolloutRecord",
    "ShardManifest",
    "ShardResult",
    "export",
    "export_shard",
    "format_summary",
    "local_engine",
    "parquet_schema",
    "ray_engine",
    "read_manifests",
]

_log = logging.getLogger("s3capture")

FORMATS = ("parquet", "gym-jsonl")
MASKED_CHOICES = ("skip", "include")
BUILDERS = ("prefix_merging", "per_request")
"""Gym's builder names; which of them a run can use depends on the engine (NeMo Gym 0.7.0 and the
built-in engine know ``prefix_merging`` only): ``export`` checks before reading anything."""
BUILD_WITH = ("auto", "gym", "builtin")
STATES = ("open", "frozen", "retired")
TOKEN_TYPES = ("auto", "int64")
MANIFEST_FORMAT = "s3capture.export-shard/1"
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_PART = re.compile(
    r"^(?:part-(\d{5,})(?:-[0-9a-f]{8,32})?\.(?:parquet|jsonl)|_?part-(\d{5,})(?:-[0-9a-f]{8,32})?\.manifest\.json)$"
)
"""Data files ``part-NNNNN[-<run tag>].parquet|jsonl`` and manifests ``_part-NNNNN[-<run tag>].manifest.json``
(``ExportJob.run_tag`` on ``s3://`` destinations; the leading
``_`` makes pyarrow, pandas, Spark and Ray Data skip them when they read the folder as a dataset).
Manifests named ``part-NNNNN.manifest.json`` (exports before the ``_``) are read too: otherwise their
data files would look unfinished and be removed."""
_TEMP = re.compile(r"^\.part-\d{5,}\..*\.tmp$")
_LOCK = ".s3capture-export.lock"
"""A local destination's lock file (``_LocalDestination.lock``); hidden, so dataset readers skip it.
On an ``s3://`` destination, the folder of the exports' claims (``_S3Destination.lock``)."""
CLAIM_LEASE = 600.0
"""Seconds (by the store's clock) after its last renewal at which an ``s3://`` destination's claim
is stale: the export that wrote it is taken to be dead, and the next export takes the destination."""
CLAIM_RENEW = 30.0
"""Seconds between renewals of a live export's claim."""


def _awake_clock() -> float:
    """Seconds of a clock that keeps counting while the machine sleeps (Linux ``CLOCK_BOOTTIME``;
    ``time.monotonic`` elsewhere): a laptop or VM suspended past the lease must find its claim's
    hold expired when it wakes, which ``CLOCK_MONOTONIC`` (stopped during suspend) would hide."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


CLAIM_HOLD = 300.0
"""Seconds after its last successful renewal at which an export stops dropping: it may have been
taken over. Well below ``CLAIM_LEASE``, so a paused export fences itself before another can start."""
_EXAMPLES = 20
"""Examples kept per reason in a summary (counts are exact; examples are bounded)."""
_DROPS_AHEAD = 1024
"""Drops started and not finished at most (32 of them run at once); the listing and the shard results
wait behind them, so pending drops hold bounded memory (~2 KB each) whatever the number of rollouts."""

HOLD_ENV = "S3CAPTURE_EXPORT_HOLD_AFTER_SHARDS"
"""Test hook: after the parent has handled this many shard results (and finished their drops) it prints
``s3capture export: holding after N shards`` to stderr and sleeps (workers go on with the shards
already assigned), so a test can SIGKILL the export between shards."""

# The metrics NeMo Gym's consumer reports that are scalars, as typed columns (``metric_<name>``);
# every metric (nested ones too) is also in the ``metrics`` JSON column.
METRIC_COLUMNS: dict[str, str] = {
    "chains": "int",
    "roots": "int",
    "quarantined_calls": "int",
    "quarantined_fraction": "float",
    "delivered_fraction": "float",
    "generated_tokens_captured": "int",
    "generated_tokens_delivered": "int",
    "unresolved_parent_calls": "int",
    "empty_generation_calls": "int",
    "capture_incomplete": "bool",
}


# --------------------------------------------------------------------------- records
class ExportJob(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a shard needs to read, build and write (picklable; the same on every engine).

    ``url`` is the source ``s3://bucket/prefix``; ``dest`` a local folder or an ``s3://`` prefix.
    ``row_group_rows`` and ``row_group_bytes`` bound a Parquet row group (and so the row buffer):
    rows, and estimated uncompressed bytes of the list columns (9 bytes per token).
    ``token_type``: ``"auto"`` (``list<int32>`` token ids in every shard; a rollout holding a larger
    id fails with ``token_overflow``) or ``"int64"`` (``list<int64>`` in every shard).
    """

    url: str
    dest: str
    format: str = "parquet"
    builder: str = "prefix_merging"
    build_with: str = "auto"
    masked: str = "skip"
    freeze: bool = False
    concurrency: int = 8
    row_group_rows: int = 1024
    row_group_bytes: int = 64 * 1024 * 1024
    token_type: str = "auto"
    endpoint_url: str | None = None
    transport: str | None = None
    cache_bytes: int = 32 * 1024 * 1024
    run_tag: str = ""
    """On an ``s3://`` destination, this export's claim id, in the name of every shard it writes
    (``part-NNNNN-<run_tag>.parquet``): an export taken over after a pause can never replace a
    shard of the export that took over (both number shards from the highest one they found)."""

    def shard_name(self, shard: int) -> str:
        """The data file of ``shard``: ``part-NNNNN[-<run_tag>].parquet`` (or ``.jsonl``)."""
        tag = f"-{self.run_tag}" if self.run_tag else ""
        return f"part-{shard:05d}{tag}.{'parquet' if self.format == 'parquet' else 'jsonl'}"

    def manifest_name(self, shard: int) -> str:
        """The manifest of ``shard``: ``_part-NNNNN[-<run_tag>].manifest.json``."""
        tag = f"-{self.run_tag}" if self.run_tag else ""
        return f"_part-{shard:05d}{tag}.manifest.json"


class RolloutRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One rollout's line in a shard manifest: which snapshot was exported and what became of it.

    ``written``: its rows are in the shard's data file (False: a masked rollout left out by
    ``masked="skip"``). ``rows``: trajectories written. ``sealed``: read from its sealed manifest
    (or frozen by this export), so a conditional ``drop`` can consume it; False for an open
    rollout read unsealed. ``tokens``: token ids written (sum of ``len(token_ids)``).
    """

    rollout_id: str
    snapshot_id: str
    version: int
    masked: bool
    mask_reasons: list[str] = []
    written: bool = True
    rows: int = 0
    tokens: int = 0
    sealed: bool = True


class ShardManifest(msgspec.Struct, kw_only=True):
    """``_part-NNNNN.manifest.json``: written after the data file; its existence makes the shard durable."""

    format: str = MANIFEST_FORMAT
    shard: int
    data: str | None
    """The data file's name beside the manifest, ``None`` when the shard has no row."""
    data_format: str
    data_bytes: int = 0
    rows: int = 0
    builder: str = ""
    build_with: str = ""
    source: str = ""
    created_at: str = ""
    rollouts: list[RolloutRecord] = []


class ShardResult(msgspec.Struct, kw_only=True):
    """What one ``export_shard`` call did. ``skipped`` and ``failed`` are ``(rollout_id, reason)``;
    ``requests`` counts HTTP requests by ``"source:<S3 operation>"`` / ``"dest:<S3 operation>"``."""

    shard: int
    data: str | None = None
    manifest: str | None = None
    rows: int = 0
    records: list[RolloutRecord] = []
    skipped: list[tuple[str, str]] = []
    failed: list[tuple[str, str]] = []
    tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    requests: dict[str, int] = {}
    seconds: float = 0.0
    error: str = ""
    """Set when the shard as a whole failed (nothing of it is durable; its rollouts are in ``failed``)."""


class ExportSummary(msgspec.Struct, kw_only=True):
    """The outcome of one ``export`` run (``format_summary`` prints it; ``--json`` encodes it).

    Rollout counts: ``exported`` (written as trainable), ``masked_written`` (written with
    ``masked=true``), ``masked_excluded`` (left out by ``masked="skip"``), ``already_exported``
    (the destination held them at the same snapshot), ``changed_since_export`` (the destination
    holds rows of an earlier snapshot of them; exported again, so both snapshots have rows),
    ``skipped`` (not read: not quiescent, not
    sealed, retired, not listed) and ``failed`` (a store or build error; retried by a re-run).
    ``*_reasons`` count by reason class, ``*_examples`` hold up to 20 ``"rollout_id: reason"``
    lines per class. ``tokens`` and ``trajectories`` count what this run wrote; ``bytes_read`` is
    the stored size of the rollouts it read, ``bytes_written`` the data and manifests it wrote.
    ``requests`` counts HTTP requests by ``source:<operation>`` and ``dest:<operation>``.
    """

    source: str
    dest: str
    format: str
    listed: int = 0
    selected: int = 0
    exported: int = 0
    masked_written: int = 0
    masked_excluded: int = 0
    already_exported: int = 0
    changed_since_export: int = 0
    changed_examples: list[str] = []
    skipped: int = 0
    skipped_reasons: dict[str, int] = {}
    skipped_examples: dict[str, list[str]] = {}
    failed: int = 0
    failed_reasons: dict[str, int] = {}
    failed_examples: dict[str, list[str]] = {}
    masked_reasons: dict[str, int] = {}
    trajectories: int = 0
    tokens: int = 0
    shards_written: int = 0
    shards_failed: int = 0
    shards_existing: int = 0
    orphans_removed: int = 0
    dropped: int = 0
    drop_failed: int = 0
    drop_failed_examples: list[str] = []
    not_dropped: int = 0
    not_dropped_examples: list[str] = []
    bytes_read: int = 0
    bytes_written: int = 0
    requests: dict[str, int] = {}
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No rollout failed, no shard failed and no drop failed."""
        return not self.failed and not self.shards_failed and not self.drop_failed


def _reason_class(reason: str) -> str:
    """The class of a reason: its text up to the first ':' (``"not_sealed: ..."`` -> ``not_sealed``)."""
    return reason.split(":", 1)[0].strip() or "unknown"


def _note(counts: dict[str, int], examples: dict[str, list[str]], rollout_id: str, reason: str) -> None:
    kind = _reason_class(reason)
    counts[kind] = counts.get(kind, 0) + 1
    kept = examples.setdefault(kind, [])
    if len(kept) < _EXAMPLES:
        kept.append(f"{rollout_id}: {reason}")


# --------------------------------------------------------------------------- schema and rows
def parquet_schema(token_type: str = "int32") -> Any:
    """The Parquet schema of an export: one row per trajectory (``docs/export.md``).

    ``token_type`` is ``"int32"`` or ``"int64"`` (the ``token_ids`` element type). Needs pyarrow
    (``pip install 's3capture[parquet]'``).
    """
    import pyarrow as pa

    ids = pa.int64() if token_type == "int64" else pa.int32()
    metric_types = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
    fields = [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("chain_id", pa.string(), nullable=False),
        pa.field("snapshot_id", pa.string(), nullable=False),
        pa.field("version", pa.int64(), nullable=False),
        pa.field("token_ids", pa.list_(ids), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("call_ids", pa.list_(pa.string()), nullable=False),
        pa.field("num_calls", pa.int32(), nullable=False),
        pa.field("masked", pa.bool_(), nullable=False),
        pa.field("mask_reasons", pa.list_(pa.string()), nullable=False),
    ]
    fields += [pa.field(f"metric_{name}", metric_types[kind]) for name, kind in METRIC_COLUMNS.items()]
    fields.append(pa.field("metrics", pa.string(), nullable=False))
    return pa.schema(fields, metadata={b"s3capture.export": b"1"})


def _metric_value(metrics: dict, name: str, kind: str) -> Any:
    value = metrics.get(name)
    if value is None or isinstance(value, (dict, list, str)):
        return None
    if kind == "bool":
        return bool(value)
    if kind == "int":
        return int(value) if not isinstance(value, float) or value.is_integer() else None
    return float(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "value"):  # enums
        return value.value
    return str(value)


_json_encoder = msgspec.json.Encoder(enc_hook=_json_default, order="sorted")


def _metrics_json(metrics: dict) -> str:
    return _json_encoder.encode(metrics).decode()


class _Built(msgspec.Struct, kw_only=True):
    """One rollout read and built, as a shard consumes it."""

    info: Any
    snapshot_id: str = ""
    version: int = 0
    sealed: bool = True
    build: Any = None
    masked: bool = False
    reasons: list[str] = []
    skipped: str = ""
    failed: str = ""


def _verdict(build: Any, snapshot: Any) -> tuple[bool, list[str]]:
    """``(masked, reasons)`` of a build: masked when the builder or the snapshot says so, or when
    nothing trainable came out (no trajectory, misaligned arrays, no generated token)."""
    reasons = list(getattr(build, "mask_reasons", None) or [])
    masked = bool(build.masked)
    if snapshot.incomplete:
        masked = True
        for reason in getattr(snapshot, "reasons", ()) or ("capture_incomplete",):
            if reason not in reasons:
                reasons.append(reason)
    trajectories = list(build.trajectories or ())
    if not trajectories:
        masked = True
        if not reasons:
            reasons.append("no_trajectory")
    for t in trajectories:
        if not (len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)):
            masked = True
            reasons.append(f"misaligned_trajectory:{t.chain_id}")
        elif not masked and not any(t.loss_mask):
            masked = True
            reasons.append(f"no_generated_tokens:{t.chain_id}")
    if masked and not reasons:
        reasons.append("masked")
    return masked, reasons


# --------------------------------------------------------------------------- destinations
def _is_s3(dest: str) -> bool:
    return dest.startswith("s3://")


class _Existing(msgspec.Struct, kw_only=True):
    manifests: list[ShardManifest] = []
    """The durable shards, in shard order (``_settle``)."""
    data_files: list[str] = []
    temp_files: list[str] = []
    broken: list[str] = []
    """Manifests whose data file is missing or not the size they record: not durable (``_settle``)."""
    sizes: dict[str, int] = {}
    """Size in bytes of every data file found."""
    highest: int = -1


class _Destination:
    """Where shards go: a local folder or an ``s3://`` prefix. ``publish`` is atomic."""

    requests: collections.Counter

    async def scan(self) -> _Existing:
        raise NotImplementedError

    async def remove(self, names: list[str]) -> None:
        raise NotImplementedError

    async def lock(self) -> None:
        """Take the destination for one export, until ``close``; ``ValueError`` when another holds it."""
        raise NotImplementedError

    def check_held(self) -> None:
        """Raise ``StoreError`` when this export may no longer hold the destination (before a drop)."""

    def temp_path(self, name: str) -> str:
        raise NotImplementedError

    async def publish(self, name: str, temp: str) -> int:
        """Make the finished temp file ``temp`` appear as ``name``; its size in bytes."""
        raise NotImplementedError

    async def publish_bytes(self, name: str, body: bytes) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


def _classify(files: Iterable[tuple[str, int]], existing: _Existing) -> list[str]:
    """Sort destination files ``(name, size)`` into data files, temp files and manifest names."""
    manifests: list[str] = []
    for name, size in files:
        match = _PART.match(name)
        if match:
            existing.highest = max(existing.highest, int(match.group(1) or match.group(2)))
            if match.group(2):
                manifests.append(name)
            else:
                existing.data_files.append(name)
                existing.sizes[name] = size
        elif _TEMP.match(name):
            existing.temp_files.append(name)
    return manifests


def _settle(existing: _Existing, found: list[tuple[str, ShardManifest]]) -> None:
    """Keep the manifests whose shard is durable, in shard order (a later shard's record of a
    rollout supersedes an earlier one's; ``part-100000`` sorts before ``part-99999`` by name). A
    manifest whose data file is missing or not the size it records (removed, truncated, replaced)
    is not durable: it goes to ``broken``, and its data file becomes an orphan, so its rollouts are
    exported again and never dropped on its word."""
    for name, manifest in sorted(found, key=lambda pair: (pair[1].shard, pair[0])):
        if manifest.data is not None and existing.sizes.get(manifest.data) != manifest.data_bytes:
            existing.broken.append(name)
        else:
            existing.manifests.append(manifest)


def _decode_manifest(name: str, raw: bytes) -> ShardManifest:
    try:
        manifest = msgspec.json.decode(raw, type=ShardManifest)
    except msgspec.DecodeError as error:
        raise ValueError(f"shard manifest {name} is not a valid export manifest: {error}") from None
    if manifest.format != MANIFEST_FORMAT:
        raise ValueError(f"shard manifest {name} has format {manifest.format!r}, expected {MANIFEST_FORMAT!r}")
    return manifest


class _LocalDestination(_Destination):
    def __init__(self, folder: str) -> None:
        self.folder = os.path.abspath(folder)
        self.requests = collections.Counter()

    def _make(self) -> None:
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise ValueError(f"--out {self.folder} exists and is not a folder")
        os.makedirs(self.folder, exist_ok=True)

    async def lock(self) -> None:
        """Take the folder for this export: an exclusive ``flock`` on ``.s3capture-export.lock``
        in it, held until ``close`` (the kernel releases it when the process dies, SIGKILL too).
        Two exports into one folder would number their shards alike and replace each other's
        files, and a ``--drop`` would then consume rollouts whose rows were replaced. Raises
        ``ValueError`` when another export holds the folder or it is not writable."""
        self._make()
        path = os.path.join(self.folder, _LOCK)
        try:
            handle = open(path, "a+b")
        except OSError as error:
            raise ValueError(f"--out {self.folder} is not writable: {error}") from None
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: one export at a time is the operator's duty
            self._lock: io.BufferedRandom | None = handle
            return
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise ValueError(
                f"--out {self.folder} is being written by another export (it holds {_LOCK}); "
                "one export at a time per destination"
            ) from None
        except OSError as error:  # a file system without locks (some FUSE mounts): the operator's duty
            _log.warning("cannot lock %s (%s): make sure no other export writes there", path, error)
        self._lock = handle

    async def close(self) -> None:
        handle, self._lock = getattr(self, "_lock", None), None
        if handle is not None:
            handle.close()  # releases the flock

    async def scan(self) -> _Existing:
        existing = _Existing()
        self._make()
        files = []
        for name in sorted(os.listdir(self.folder)):
            try:
                files.append((name, os.path.getsize(os.path.join(self.folder, name))))
            except FileNotFoundError:
                continue
        found = []
        for name in _classify(files, existing):
            with open(os.path.join(self.folder, name), "rb") as handle:
                found.append((name, _decode_manifest(name, handle.read())))
        _settle(existing, found)
        return existing

    async def remove(self, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(os.path.join(self.folder, name))
            except FileNotFoundError:
                pass

    def temp_path(self, name: str) -> str:
        # Hidden (a leading '.'): Parquet dataset readers skip it while it is being written.
        return os.path.join(self.folder, f".{name}.{uuid.uuid4().hex[:12]}.tmp")

    def _fsync_folder(self) -> None:
        try:
            fd = os.open(self.folder, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    async def publish(self, name: str, temp: str) -> int:
        with open(temp, "rb+") as handle:
            os.fsync(handle.fileno())
        size = os.path.getsize(temp)
        os.replace(temp, os.path.join(self.folder, name))
        self._fsync_folder()
        return size

    async def publish_bytes(self, name: str, body: bytes) -> None:
        temp = self.temp_path(name)
        try:
            with open(temp, "wb") as handle:
                handle.write(body)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, os.path.join(self.folder, name))
        except BaseException:
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass
            raise
        self._fsync_folder()


class _S3Destination(_Destination):
    def __init__(self, url: str, *, endpoint_url: str | None, transport: str | None, session: Any = None) -> None:
        from s3capture.rollouts import parse_s3_url
        from s3capture.transport import make_transport

        self.bucket, prefix = parse_s3_url(url)
        self.prefix = f"{prefix}/" if prefix else ""
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self.transport = make_transport(
            transport, self.bucket, endpoint_url=endpoint, session=session, max_concurrency=8
        )
        self._claim: str | None = None  # this export's claim of the prefix (``lock``), until ``close``
        self._claim_body = b""
        self._renewed = 0.0
        self._renewal: asyncio.Task | None = None
        self._lost: str | None = None
        self.tag = ""  # the claim's id (``lock``), also in this export's shard names

    @property
    def requests(self) -> collections.Counter:  # type: ignore[override]
        return self.transport.request_counts

    async def scan(self) -> _Existing:
        existing = _Existing()
        listed = await self.transport.list(self.prefix)
        files = [
            (item.key[len(self.prefix) :], item.size) for item in listed if "/" not in item.key[len(self.prefix) :]
        ]
        manifest_names = _classify(sorted(files), existing)
        found = []
        for name in manifest_names:
            raw = await self.transport.get(self.prefix + name)
            if raw is None:  # removed since the listing: not durable any more
                continue
            found.append((name, _decode_manifest(name, raw)))
        _settle(existing, found)
        return existing

    async def lock(self) -> None:
        """Take the prefix for this export with a claim, without compare-and-swap.

        The export PUTs its own claim ``<prefix>/.s3capture-export.lock/<run id>``, then LISTs the
        claims (verified, and required to show its own). Any other claim renewed less than
        ``CLAIM_LEASE`` seconds before its own, both by the store's clock, means another export is
        alive: this one deletes its claim and raises ``ValueError``. Of two exports that start at
        once, the later PUT's LIST always sees the earlier claim (read-after-write and
        list-after-write consistency, which s3capture requires anyway; ``s3capture doctor`` checks
        them), so at most one proceeds; both may refuse, never both proceed. A claim older than the
        lease belongs to a dead export and is deleted. The claim is renewed every ``CLAIM_RENEW``
        seconds until ``close``; ``check_held`` fails once the last renewal is ``CLAIM_HOLD`` seconds old
        or the claim was taken over, so a paused export stops dropping before another can start.

        Requests: 1 PUT, 1 LIST, a DELETE per stale claim; then a GET and a PUT per renewal.
        Raises ``ValueError`` (another export holds the prefix), ``StoreError``.
        """
        import socket

        self.tag = uuid.uuid4().hex[:16]
        claim = self._claim = f"{self.prefix}{_LOCK}/{self.tag}"
        self._claim_body = msgspec.json.encode(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            }
        )
        await self.transport.put(claim, self._claim_body)
        self._renewed = _awake_clock()
        try:
            claims = await self.transport.list(f"{self.prefix}{_LOCK}/", require=[claim])
            (mine,) = [c for c in claims if c.key == claim]
            others = [c for c in claims if c.key != claim]
            live = [c for c in others if mine.modified - c.modified < CLAIM_LEASE]
            if live:
                age = max(0.0, mine.modified - max(c.modified for c in live))
                raise ValueError(
                    f"--out s3://{self.bucket}/{self.prefix} is being written by another export (its claim "
                    f"{live[0].key.rsplit('/', 1)[-1]} was renewed {age:.0f} s ago); one export at a time per "
                    f"destination (a claim not renewed for {CLAIM_LEASE:.0f} s is taken over)"
                )
            stale = [c.key for c in others]
            if stale:
                _log.warning("taking over %s: %d claim(s) of dead exports", self.prefix or "/", len(stale))
                await self.transport.delete(stale)
        except BaseException:
            self._claim = None
            try:
                await self.transport.delete([claim])
            except Exception:  # noqa: BLE001 - the refusal matters more; a stale claim expires
                pass
            raise
        self._renewal = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(CLAIM_RENEW)
            claim = self._claim
            if claim is None:
                return
            try:
                if await self.transport.get(claim) is None:
                    self._lost = "its claim was deleted (taken over after a pause longer than the lease?)"
                    return
                await self.transport.put(claim, self._claim_body)
                previous, self._renewed = self._renewed, _awake_clock()
                if self._renewed - previous > CLAIM_HOLD:
                    # Paused past the hold (perhaps between the GET and the PUT): another export
                    # may have taken over, and this PUT may have re-created a deleted claim.
                    self._lost = f"its renewal came {self._renewed - previous:.0f} s after the previous one"
                    self._claim = None
                    await self.transport.delete([claim])
                    return
            except Exception as error:  # noqa: BLE001 - check_held decides when it is too late
                _log.warning("could not renew the export's claim %s: %s", claim, error)

    def check_held(self) -> None:
        lost = self._lost
        if lost is None and self._claim is not None:
            overdue = _awake_clock() - self._renewed
            if overdue > CLAIM_HOLD:
                lost = f"its claim was last renewed {overdue:.0f} s ago"
        if lost:
            raise StoreError(f"this export may no longer hold s3://{self.bucket}/{self.prefix}: {lost}; no more drops")

    async def remove(self, names: list[str]) -> None:
        if names:
            await self.transport.delete([self.prefix + name for name in names])

    def temp_path(self, name: str) -> str:
        fd, path = tempfile.mkstemp(prefix=f"s3capture-{name}.", suffix=".tmp")
        os.close(fd)
        return path

    async def publish(self, name: str, temp: str) -> int:
        # One PUT: the object appears whole or not at all.
        with open(temp, "rb") as handle:
            body = handle.read()
        await self.transport.put(self.prefix + name, body)
        os.unlink(temp)
        return len(body)

    async def publish_bytes(self, name: str, body: bytes) -> None:
        await self.transport.put(self.prefix + name, body)

    async def close(self) -> None:
        renewal, claim = self._renewal, self._claim
        self._claim = self._renewal = None
        try:
            if renewal is not None:
                renewal.cancel()
                await asyncio.gather(renewal, return_exceptions=True)
            if claim is not None:
                await self.transport.delete([claim])
        finally:
            await self.transport.close()


def _open_destination(job: ExportJob, session: Any = None) -> _Destination:
    if _is_s3(job.dest):
        return _S3Destination(job.dest, endpoint_url=job.endpoint_url, transport=job.transport, session=session)
    return _LocalDestination(job.dest)


async def read_manifests(
    dest: str, *, endpoint_url: str | None = None, transport: str | None = None
) -> list[ShardManifest]:
    """The durable shards of an export destination (a local folder or an ``s3://`` prefix), in
    shard order. Data files without a manifest are not durable and are not returned.

    Raises ``ValueError`` for a manifest that is not an export manifest, ``StoreError`` when S3 fails.
    """
    target = _open_destination(ExportJob(url="", dest=dest, endpoint_url=endpoint_url, transport=transport))
    try:
        if isinstance(target, _LocalDestination) and not os.path.isdir(target.folder):
            return []
        existing = await target.scan()
    finally:
        await target.close()
    return sorted(existing.manifests, key=lambda m: m.shard)


# --------------------------------------------------------------------------- shard writers
class _Writer:
    """Rows of one shard into a temp file, then published atomically."""

    def __init__(self, job: ExportJob, dest: _Destination, shard: int) -> None:
        self.job = job
        self.dest = dest
        self.name = job.shard_name(shard)
        self.temp = dest.temp_path(self.name)
        self.rows = 0

    def add(self, built: _Built) -> tuple[int, int]:
        """Write one built rollout; ``(rows, tokens)`` written. ``OverflowError`` for a token id
        that the export's column type does not hold (int32 under ``token_type="auto"``, int64 under
        ``"int64"``): nothing of that rollout is written then."""
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    async def publish(self) -> tuple[str | None, int]:
        """Close and publish the data file; ``(name, bytes)``, or ``(None, 0)`` without a row."""
        self.finish()
        if not self.rows:
            self.discard()
            return None, 0
        return self.name, await self.dest.publish(self.name, self.temp)

    def discard(self) -> None:
        try:
            self.finish()
        except Exception:  # noqa: BLE001 - discarding after a failure
            pass
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass


def _trajectory_rows(built: _Built) -> list[dict]:
    build = built.build
    metrics = dict(getattr(build, "metrics", None) or {})
    common = {
        "rollout_id": built.info.rollout_id,
        "snapshot_id": built.snapshot_id,
        "version": built.version,
        "masked": built.masked,
        "mask_reasons": list(built.reasons) if built.masked else [],
        "metrics": _metrics_json(metrics),
    }
    for name, kind in METRIC_COLUMNS.items():
        common[f"metric_{name}"] = _metric_value(metrics, name, kind)
    rows = []
    for t in build.trajectories or ():
        aligned = len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        rows.append(
            dict(
                common,
                chain_id=t.chain_id,
                token_ids=t.token_ids if aligned else [],  # sequences, converted once by the writer
                loss_mask=t.loss_mask if aligned else [],
                logprobs=t.logprobs if aligned else [],
                call_ids=list(t.call_ids),
                num_calls=len(t.call_ids),
            )
        )
    if not rows:  # a masked rollout without a trajectory still leaves its evidence
        rows.append(dict(common, chain_id="", token_ids=[], loss_mask=[], logprobs=[], call_ids=[], num_calls=0))
    return rows


_LIST_COLUMNS = (("token_ids", "int64"), ("loss_mask", "int8"), ("logprobs", "float32"))
"""The token-aligned list columns and the numpy type each row's values are held in until written."""
_DICTIONARY_COLUMNS = ["rollout_id", "chain_id", "snapshot_id", "call_ids.list.element", "mask_reasons.list.element"]
"""Parquet columns worth dictionary encoding (repeated strings); token ids, masks and log-probabilities
are written plain (zstd compresses them; a dictionary of a 150k vocabulary only costs CPU)."""


class _ParquetWriter(_Writer):
    """Row groups of at most ``row_group_rows`` rows / ``row_group_bytes`` estimated bytes.

    ``token_ids`` is ``list<int32>`` in every shard of an export with ``token_type="auto"`` and
    ``list<int64>`` with ``"int64"``: one schema per export, never chosen per shard.

    Each row's token ids, loss mask and log-probabilities are converted once, when the rollout is
    added, into numpy arrays (which also finds the largest id without a Python loop); a row group's
    list columns are then one concatenation each, handed to Arrow without a per-element step."""

    def __init__(self, job: ExportJob, dest: _Destination, shard: int) -> None:
        import numpy  # noqa: F401 - the writer's arrays; with pyarrow, the parquet extra
        import pyarrow  # noqa: F401 - fail here, before any read, when the extra is missing

        super().__init__(job, dest, shard)
        self.token_type = "int64" if job.token_type == "int64" else "int32"
        self.buffer: list[dict] = []
        self.buffered_bytes = 0
        self.writer: Any = None

    def _open(self) -> Any:
        import pyarrow.parquet as pq

        if self.writer is None:
            self.writer = pq.ParquetWriter(
                self.temp, parquet_schema(self.token_type), compression="zstd", use_dictionary=_DICTIONARY_COLUMNS
            )
        return self.writer

    def add(self, built: _Built) -> tuple[int, int]:
        import numpy as np

        rows = _trajectory_rows(built)
        highest = 0
        for row in rows:
            n = len(row["token_ids"])
            for name, kind in _LIST_COLUMNS:
                try:
                    row[name] = np.fromiter(row[name], dtype=kind, count=n)
                except OverflowError:
                    raise OverflowError(
                        f"a token id of {built.info.rollout_id} does not fit a 64-bit integer"
                    ) from None
            if n:
                highest = max(highest, int(row["token_ids"].max()))
        if highest > _INT32_MAX and self.token_type == "int32":
            # One schema per export: readers open the folder as one dataset (pyarrow.dataset, Ray
            # Data, pandas), which a shard of list<int64> among list<int32> ones would break.
            raise OverflowError(
                f"a token id of {built.info.rollout_id} ({highest}) does not fit int32, the token_ids type of "
                "every shard under --token-ids auto; re-run with --token-ids int64 (into a new --out, so that "
                "every shard has the same schema)"
            )
        tokens = 0
        for row in rows:
            n = len(row["token_ids"])
            tokens += n
            self.buffer.append(row)
            self.buffered_bytes += 9 * n + 256
        self.rows += len(rows)
        if len(self.buffer) >= self.job.row_group_rows or self.buffered_bytes >= self.job.row_group_bytes:
            self._flush()
        return len(rows), tokens

    def _flush(self) -> None:
        if not self.buffer:
            return
        self._write(self.buffer)
        self.buffer = []
        self.buffered_bytes = 0

    def _write(self, rows: list[dict]) -> None:
        """One row group of ``rows``; two when its token count exceeds an Arrow list's 32-bit offsets."""
        import numpy as np
        import pyarrow as pa

        total = sum(len(row["token_ids"]) for row in rows)
        if total > _INT32_MAX and len(rows) > 1:
            self._write(rows[: len(rows) // 2])
            self._write(rows[len(rows) // 2 :])
            return
        schema = parquet_schema(self.token_type)
        arrays = []
        for field in schema:
            values = [row[field.name] for row in rows]
            if field.name not in dict(_LIST_COLUMNS):
                arrays.append(pa.array(values, type=field.type))
                continue
            offsets = np.zeros(len(values) + 1, dtype=np.int64)
            np.cumsum([len(v) for v in values], out=offsets[1:])
            flat = np.concatenate(values).astype(field.type.value_type.to_pandas_dtype(), copy=False)
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(flat)))
        self._open().write_table(pa.Table.from_arrays(arrays, schema=schema))

    def finish(self) -> None:
        if self.writer is None and self.rows:
            self._open()
        self._flush()
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def gym_dict(build: Any, *, snapshot_id: str, version: int, masked: bool, reasons: Sequence[str], builder: str) -> dict:
    """The dict NeMo Gym's ``trajectories_from_source`` returns for a rollout: ``build.gym_result``
    when Gym's builder ran, else an equivalent built from the built-in builder's trajectories
    (``rebuilt_response.output`` holds token-only items, one per generated run, as Gym's projection
    makes for calls without content items). ``mask_sample`` is True whenever ``masked`` is;
    ``_capture_snapshot`` names the snapshot and ``_s3capture`` the mask reasons."""
    result = getattr(build, "gym_result", None)
    if result is not None:
        out = dict(result)
    else:
        trajectories = list(build.trajectories or ())
        main = next((t for t in trajectories if t.chain_id == "main"), trajectories[0] if trajectories else None)
        response = None
        if main is not None:
            items: list[dict] = []
            n = len(main.token_ids)
            position = 0
            while position < n:
                if main.loss_mask[position]:
                    end = position
                    while end < n and main.loss_mask[end]:
                        end += 1
                    items.append(
                        {
                            "type": "message",
                            "prompt_token_ids": list(main.token_ids[:position]),
                            "generation_token_ids": list(main.token_ids[position:end]),
                            "generation_log_probs": [float(x) for x in main.logprobs[position:end]],
                        }
                    )
                    position = end
                else:
                    position += 1
            response = {
                "id": f"proj-{build.rollout_id}",
                "model": "",
                "object": "response",
                "output": items,
                "usage": {
                    "input_tokens": len(items[0]["prompt_token_ids"]) if items else 0,
                    "output_tokens": sum(len(i["generation_token_ids"]) for i in items),
                },
            }
        out = {
            "rollout_id": build.rollout_id,
            "builder": builder,
            "rebuilt_response": response,
            "metrics": dict(getattr(build, "metrics", None) or {}),
            "mask_sample": masked,
        }
    out["mask_sample"] = bool(out.get("mask_sample")) or masked
    out.setdefault("_capture_snapshot", {"snapshot_id": snapshot_id, "version": version})
    out["_s3capture"] = {"masked": masked, "mask_reasons": list(reasons) if masked else []}
    return out


class _JsonlWriter(_Writer):
    """One line per rollout: ``gym_dict`` (the dict Gym's consumer returns)."""

    def __init__(self, job: ExportJob, dest: _Destination, shard: int) -> None:
        super().__init__(job, dest, shard)
        self.handle: io.BufferedWriter | None = open(self.temp, "wb")

    def add(self, built: _Built) -> tuple[int, int]:
        assert self.handle is not None
        line = gym_dict(
            built.build,
            snapshot_id=built.snapshot_id,
            version=built.version,
            masked=built.masked,
            reasons=built.reasons,
            builder=self.job.builder,
        )
        self.handle.write(_json_encoder.encode(line) + b"\n")
        self.rows += 1
        tokens = sum(len(t.token_ids) for t in built.build.trajectories or ())
        return 1, tokens

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def _open_writer(job: ExportJob, dest: _Destination, shard: int) -> _Writer:
    return _ParquetWriter(job, dest, shard) if job.format == "parquet" else _JsonlWriter(job, dest, shard)


# --------------------------------------------------------------------------- one shard
_REPORT: Callable[[tuple[int, int, int, int]], Any] | None = None
"""Where ``export_shard`` reports progress, once per rollout: ``(rollouts, trajectories, tokens,
bytes_read)``. Set in each pool worker by the local engine (a queue's ``put``), in the parent for
in-process shards; ``None``: no progress."""


class _Clients:
    """The source store and destination client of one thread of a worker, kept across shards.

    Opening an S3 client costs about half a second of CPU (botocore's endpoint rules), so a
    worker opens one per (job source, destination) on a long-lived event loop of its own and
    reuses it for every shard it runs; they are closed at exit (``close``)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.session: Any = None
        self.opened: dict[tuple, tuple[Any, _Destination]] = {}

    def get(self, job: ExportJob) -> tuple[Any, _Destination]:
        from s3capture.store import S3TokenStore

        key = (job.url, job.dest, job.endpoint_url, job.transport, job.cache_bytes, job.concurrency)
        found = self.opened.get(key)
        if found is None:
            if (
                self.session is None
                and (job.transport or os.environ.get("S3CAPTURE_TRANSPORT", "aioboto3")) != "obstore"
            ):
                import aioboto3

                self.session = aioboto3.Session()  # credentials and the service model load once
            store = S3TokenStore(
                job.url,
                endpoint_url=job.endpoint_url,
                session=self.session,
                transport=job.transport,
                cache_bytes=job.cache_bytes,
                max_concurrency=max(8, min(64, 4 * job.concurrency)),
            )
            found = self.opened[key] = (store, _open_destination(job, self.session))
        return found

    def close(self) -> None:
        async def close_all() -> None:
            for store, dest in self.opened.values():
                for client in (store, dest):
                    try:
                        await client.close()
                    except Exception:  # noqa: BLE001 - closing at exit is best effort
                        pass

        if self.loop.is_closed():
            return
        try:
            self.loop.run_until_complete(close_all())
        finally:
            self.opened.clear()
            self.loop.close()


_THREAD = threading.local()


def _clients() -> _Clients:
    """This thread's ``_Clients`` (created on first use; closed at interpreter exit)."""
    clients = getattr(_THREAD, "clients", None)
    if clients is None:
        import atexit

        clients = _THREAD.clients = _Clients()
        atexit.register(clients.close)
    return clients


def _close_clients() -> None:
    """Close this thread's clients now (the in-process engine's thread, when it is done)."""
    clients = getattr(_THREAD, "clients", None)
    if clients is not None:
        _THREAD.clients = None
        clients.close()


class ListedRollout(msgspec.Struct, frozen=True):
    """A rollout of a shard task with the objects the parent's listing showed under its prefix
    (``S3TokenStore.rollouts``' own listing): ``export_shard`` reads its snapshot from them
    (``read_snapshot(listing=...)``) instead of listing the rollout again. ``info`` is its
    ``RolloutInfo``; ``listing`` its ``ListedObject``s. ``supersedes``: the destination holds
    trainable rows of an earlier snapshot of it, so a masked build is written (``masked=true``)
    even under ``masked="skip"``, and the newest rows of the rollout are never trainable."""

    info: Any
    listing: tuple = ()
    supersedes: bool = False

    @property
    def rollout_id(self) -> str:
        return self.info.rollout_id


async def _read(store: Any, job: ExportJob, info: Any, listing: Any = None) -> tuple[Any, bool]:
    """The snapshot to export and whether it is sealed (a ``drop`` can consume it). With
    ``listing`` (the parent's listing of the rollout) the snapshot is that listed state's, read
    without a LIST; when that read fails (the manifest vanished: a drop or retire since the
    listing) or finds objects vanished, the rollout is read again from a fresh LIST, so the
    outcome is the one of its current state."""
    from s3capture.errors import SnapshotNotSealedError, StoreError

    if info.state == "open":
        if job.freeze:
            return await store.freeze(info.rollout_id), True
        return await store.read_snapshot(info.rollout_id, sealed=False, listing=listing), False
    if listing is not None:
        try:
            snapshot = await store.read_snapshot(info.rollout_id, sealed=True, listing=listing)
        except (StoreError, SnapshotNotSealedError):
            pass  # judged again below, on a fresh listing
        else:
            if not any(reason.startswith("vanished:") for reason in snapshot.reasons):
                return snapshot, True
    try:
        return await store.read_snapshot(info.rollout_id, sealed=True), True
    except SnapshotNotSealedError:
        if not job.freeze:
            raise
        return await store.freeze(info.rollout_id), True


async def _read_and_build(store: Any, job: ExportJob, info: Any, listing: Any = None) -> _Built:
    from s3capture.errors import SnapshotNotSealedError, StoreError
    from s3capture.protocols import TokenCaptureRetiredError
    from s3capture.trajectory import build_rollout

    built = _Built(info=info)
    try:
        snapshot, built.sealed = await _read(store, job, info, listing)
    except SnapshotNotSealedError as error:
        built.skipped = f"not_sealed: {error}"
        return built
    except TokenCaptureRetiredError as error:
        built.skipped = f"retired: {error}"
        return built
    except StoreError as error:
        built.failed = f"store_error: {type(error).__name__}: {error}"
        return built
    except ValueError as error:  # an id the store cannot hold
        built.failed = f"bad_rollout: {error}"
        return built
    built.snapshot_id, built.version = snapshot.snapshot_id, snapshot.version
    try:
        build = await asyncio.to_thread(build_rollout, snapshot, builder=job.builder, engine=job.build_with)
    except Exception as error:  # noqa: BLE001 - one rollout's build failure never aborts its shard
        built.failed = f"build_error: {type(error).__name__}: {error}"
        return built
    built.build = build
    built.masked, built.reasons = _verdict(build, snapshot)
    return built


def _consume(built: _Built, writer: _Writer, result: ShardResult, job: ExportJob, supersedes: bool = False) -> None:
    info = built.info
    rid = info.rollout_id
    if built.skipped:
        result.skipped.append((rid, built.skipped))
        return
    if built.failed:
        result.failed.append((rid, built.failed))
        return
    rows = tokens = 0
    # masked="skip" leaves a masked rollout out, except over trainable rows of an earlier export:
    # "the highest version per rollout_id" must then be the masked one.
    written = not built.masked or job.masked == "include" or supersedes
    if written:
        try:
            rows, tokens = writer.add(built)
        except OverflowError as error:
            result.failed.append((rid, f"token_overflow: {error}"))
            return
    result.records.append(
        RolloutRecord(
            rollout_id=rid,
            snapshot_id=built.snapshot_id,
            version=built.version,
            masked=built.masked,
            mask_reasons=list(built.reasons) if built.masked else [],
            written=written,
            rows=rows,
            tokens=tokens,
            sealed=built.sealed,
        )
    )
    result.rows += rows
    result.tokens += tokens
    result.bytes_read += int(getattr(info, "bytes", 0) or 0)
    if _REPORT is not None:
        _REPORT((1, rows, tokens, int(getattr(info, "bytes", 0) or 0)))


async def _export_shard(job: ExportJob, shard: int, rollouts: list[Any], store: Any, dest: _Destination) -> ShardResult:
    started = time.monotonic()
    result = ShardResult(shard=shard)
    source_before = collections.Counter(store.request_counts)
    dest_before = collections.Counter(dest.requests)
    writer = _open_writer(job, dest, shard)
    window: collections.deque[tuple[asyncio.Task, bool]] = collections.deque()
    try:
        for item in rollouts:
            info, listing = (item.info, item.listing) if isinstance(item, ListedRollout) else (item, None)
            supersedes = bool(getattr(item, "supersedes", False))
            window.append((asyncio.create_task(_read_and_build(store, job, info, listing)), supersedes))
            if len(window) >= job.concurrency:
                task, supersedes = window.popleft()
                _consume(await task, writer, result, job, supersedes)
        while window:
            task, supersedes = window.popleft()
            _consume(await task, writer, result, job, supersedes)
        result.data, result.bytes_written = await writer.publish()
        if result.data is None and not result.records:
            return result  # every rollout failed or was skipped: nothing decided, nothing to record
        manifest = ShardManifest(
            shard=shard,
            data=result.data,
            data_format=job.format,
            data_bytes=result.bytes_written,
            rows=result.rows,
            builder=job.builder,
            build_with=job.build_with,
            source=job.url,
            created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            rollouts=result.records,
        )
        body = msgspec.json.format(msgspec.json.encode(manifest), indent=1)
        result.manifest = job.manifest_name(shard)
        await dest.publish_bytes(result.manifest, body)
        result.bytes_written += len(body)
    except BaseException:
        for task, _ in window:
            task.cancel()
        writer.discard()
        raise
    finally:
        source = collections.Counter(store.request_counts) - source_before
        target = collections.Counter(dest.requests) - dest_before
        result.requests = {f"source:{k}": v for k, v in source.items()}
        result.requests.update({f"dest:{k}": v for k, v in target.items()})
        result.seconds = time.monotonic() - started
    return result


def export_shard(job: ExportJob, shard: int, rollouts: list[Any]) -> ShardResult:
    """Read, build and write one whole shard; the function every engine runs (picklable arguments).

    ``rollouts`` are ``ListedRollout``s (a ``RolloutInfo`` with its listed objects: read without
    a LIST, and from a fresh LIST only when that read finds the rollout changed since) or plain
    ``s3capture.rollouts.RolloutInfo``s (listed again). Each is read with
    ``read_snapshot`` (sealed for a frozen rollout, unsealed for an open one; ``freeze`` instead
    with ``job.freeze``), at most ``job.concurrency`` in flight, built with
    ``s3capture.trajectory.build_rollout`` and written in listing order. Then the data file
    ``part-<shard>.parquet`` (or ``.jsonl``) is published atomically, then the manifest
    ``_part-<shard>.manifest.json`` (none when every rollout of the shard failed or was skipped:
    nothing was decided). A rollout that is not sealed, retired, unreadable or fails to
    build is reported in ``skipped`` / ``failed`` and never aborts the shard.

    Raises (nothing durable then) when the shard cannot be written: ``StoreError`` or ``OSError``
    from the destination. Runs on an event loop of its own thread, with clients that stay open for
    the next shard of the same job on that thread: call it from a thread without a running loop.
    """
    clients = _clients()
    store, dest = clients.get(job)
    return clients.loop.run_until_complete(_export_shard(job, shard, list(rollouts), store, dest))


# --------------------------------------------------------------------------- engines
ShardTask = tuple[int, list[Any]]
"""``(shard number, ListedRollout list)``: one unit of work for an engine."""


def _failed_shard(shard: int, rollouts: list[Any], error: BaseException) -> ShardResult:
    reason = f"shard_failed: part-{shard:05d}: {type(error).__name__}: {error}"
    return ShardResult(shard=shard, failed=[(info.rollout_id, reason) for info in rollouts], error=reason)


def _init_worker(queue: Any) -> None:
    global _REPORT
    _REPORT = queue.put
    threading.Thread(
        target=_exit_with_parent, args=(os.getppid(),), name="s3capture-export-watchdog", daemon=True
    ).start()


def _exit_with_parent(parent: int) -> None:
    """A pool worker ends within 0.2 s of its export process's death (SIGKILL included). Left
    running, it would publish the shards already handed to it, numbered by a dead parent, while a
    re-run numbers its own shards alike (one replacing the other's rows after the re-run dropped
    them), and then stay alive for good. Whatever it had not published is an orphan for the re-run."""
    while True:
        time.sleep(0.2)
        if os.getppid() != parent:
            os._exit(70)


async def local_engine(
    job: ExportJob, shards: AsyncIterator[ShardTask], *, workers: int = 2, report: Callable | None = None
) -> AsyncGenerator[ShardResult, None]:
    """Run ``export_shard`` for every shard task on this machine; yield each ``ShardResult`` as it ends.

    ``workers >= 1``: a process pool of that many processes (``spawn``); ``workers == 0``: one shard
    at a time in a thread of this process (debugging, tests). At most ``max(2, 2 x workers)``
    shards are taken from ``shards`` ahead of their results, so a streamed listing pauses while
    they work. A shard that raises is yielded as a failed ``ShardResult`` (its rollouts in
    ``failed``); a worker process that dies raises ``RuntimeError``. ``report`` receives progress
    tuples (see ``_REPORT``).

    This is the engine seam: an engine is ``async def engine(job, shards, *, workers, report)``
    yielding ``ShardResult``s (``ENGINES``).
    """
    global _REPORT
    if workers == 0:
        previous, _REPORT = _REPORT, report
        thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="s3capture-export")
        loop = asyncio.get_running_loop()
        try:
            async for shard, rollouts in shards:
                try:
                    yield await loop.run_in_executor(thread, export_shard, job, shard, rollouts)
                except Exception as error:  # noqa: BLE001 - the shard's rollouts are reported failed
                    yield _failed_shard(shard, rollouts, error)
        finally:
            _REPORT = previous
            await loop.run_in_executor(thread, _close_clients)
            thread.shutdown(wait=True)
        return
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    stop = threading.Event()

    def drain() -> None:
        import queue as queue_module

        while not stop.is_set():
            try:
                item = queue.get(timeout=0.2)
            except queue_module.Empty:
                continue
            except (EOFError, OSError):
                return
            if report is not None:
                report(item)

    drainer = threading.Thread(target=drain, name="s3capture-export-progress", daemon=True)
    drainer.start()
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(queue,))
    pending: dict[asyncio.Future, ShardTask] = {}
    ahead = max(2, 2 * workers)

    def settle(future: asyncio.Future) -> ShardResult:
        shard, rollouts = pending.pop(future)
        error = future.exception()
        if error is None:
            return future.result()
        if isinstance(error, concurrent.futures.process.BrokenProcessPool):
            raise RuntimeError(f"an export worker process died (shard part-{shard:05d}): {error}") from error
        return _failed_shard(shard, rollouts, error)

    try:
        async for task in shards:
            future = asyncio.wrap_future(pool.submit(export_shard, job, task[0], task[1]))
            pending[future] = task
            while len(pending) >= ahead:
                done, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    yield settle(future)
        while pending:
            done, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                yield settle(future)
    finally:
        for future in pending:
            future.cancel()
        await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
        # Progress the workers sent before they ended is in the queue: drain it, then stop.
        await asyncio.sleep(0.3)
        stop.set()
        drainer.join(timeout=2)
        queue.close()


RAY_INSTALL = "pip install 's3capture[ray]'"


def _import_ray() -> Any:
    """``ray``, or ``ValueError`` naming the extra to install (one line, before anything is read)."""
    try:
        import ray
    except ImportError as error:
        raise ValueError(f"--engine ray needs Ray ({error}): {RAY_INSTALL}") from None
    return ray


class _RayProgress:
    """The Ray engine's progress sink (run as an actor): workers add summed progress tuples, the
    parent takes what accumulated since its last take."""

    def __init__(self) -> None:
        self.pending = [0, 0, 0, 0]

    def add(self, item: tuple[int, int, int, int]) -> None:
        for index, value in enumerate(item):
            self.pending[index] += value

    def take(self) -> tuple[int, int, int, int]:
        out, self.pending = tuple(self.pending), [0, 0, 0, 0]
        return out  # type: ignore[return-value]


class _BatchedReport:
    """``_REPORT`` in a Ray worker: sums the per-rollout tuples and sends them to the progress actor
    at most every ``interval`` seconds (one actor call, not one per rollout); ``flush(wait=True)``
    at the end of a shard waits until the actor holds everything, so the parent's last take after
    the shard's result is complete."""

    def __init__(self, sink: Any, interval: float = 0.5) -> None:
        self.sink = sink
        self.interval = interval
        self.sums = [0, 0, 0, 0]
        self.last = time.monotonic()

    def __call__(self, item: tuple[int, int, int, int]) -> None:
        for index, value in enumerate(item):
            self.sums[index] += value
        if time.monotonic() - self.last >= self.interval:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        self.last = time.monotonic()
        if not any(self.sums):
            return
        sums, self.sums = tuple(self.sums), [0, 0, 0, 0]
        ref = self.sink.add.remote(sums)
        if wait:
            import ray

            ray.get(ref)


def _ray_export_shard(job: ExportJob, shard: int, rollouts: list[Any], sink: Any) -> ShardResult:
    """``export_shard`` as a Ray task: the same function, with its progress sent to ``sink``."""
    global _REPORT
    report = _BatchedReport(sink) if sink is not None else None
    previous, _REPORT = _REPORT, report
    try:
        return export_shard(job, shard, rollouts)
    finally:
        _REPORT = previous
        if report is not None:
            report.flush(wait=True)


async def ray_engine(
    job: ExportJob,
    shards: AsyncIterator[ShardTask],
    *,
    workers: int = 2,
    report: Callable | None = None,
    address: str | None = None,
    runtime_env: dict[str, Any] | None = None,
    num_cpus: float = 1.0,
    max_retries: int = 2,
    poll_interval: float = 0.05,
) -> AsyncGenerator[ShardResult, None]:
    """Run ``export_shard`` for every shard task as a Ray task; yield each ``ShardResult`` as it ends.

    The same function, arguments and output files as ``local_engine``: each task is one whole
    shard (``export_shard(job, shard, rollouts)``), so its data file, manifest, row groups and
    resume records are byte-for-byte the local engine's (manifest timestamps aside). At most
    ``workers`` tasks run at once (Ray's parallelism; each asks for ``num_cpus`` CPUs) and at most
    ``workers`` more shards are listed ahead in this process, so a streamed listing pauses while
    they work (bounded memory: ``2 x workers`` shards of ``RolloutInfo`` and their results).

    Ray: ``ray.init(address=address)`` unless this process is connected already (then that
    connection is used and left open): ``None`` starts a local Ray runtime (or joins
    ``RAY_ADDRESS``), ``"auto"`` joins the cluster of this machine, ``"ray://host:10001"`` a
    remote one through Ray Client. A runtime the engine started is shut down when it ends.
    ``runtime_env`` (e.g. ``{"env_vars": {...}}``) is applied to every task: workers read the S3
    credentials from their own environment, as ``export_shard`` does anywhere; the job carries the
    source and destination URLs, the endpoint (``job.endpoint_url``, else this process's
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``) and the transport, never credentials.

    A task that raises is yielded as a failed ``ShardResult`` (its rollouts in ``failed``); a worker
    that dies is retried ``max_retries`` times by Ray (a shard re-run publishes the same files),
    then its shard fails the same way. ``report`` receives progress tuples (``_REPORT``), summed by
    each worker over at most 0.5 s and collected by a small actor. Raises ``ValueError`` when Ray
    is not installed or ``workers < 1``.
    """
    ray = _import_ray()
    if workers < 1:
        raise ValueError(f"--engine ray needs --workers >= 1 (Ray tasks at once), got {workers}")
    job = msgspec.structs.replace(
        job,
        endpoint_url=job.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"),
        transport=job.transport or os.environ.get("S3CAPTURE_TRANSPORT") or None,
    )
    started_here = False
    if not ray.is_initialized():
        import logging

        options: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
        if address is None and not os.environ.get("RAY_ADDRESS"):
            options["include_dashboard"] = False  # a local runtime for this export only
        ray.init(address=address, **options)
        started_here = True
    sink: Any = None
    pending: dict[Any, ShardTask] = {}
    try:
        task_options: dict[str, Any] = {"num_cpus": num_cpus, "max_retries": max_retries}
        if runtime_env:
            task_options["runtime_env"] = runtime_env
        remote = ray.remote(_ray_export_shard).options(**task_options)
        if report is not None:
            sink = ray.remote(_RayProgress).options(num_cpus=0).remote()
        held: collections.deque[ShardTask] = collections.deque()
        exhausted = False
        take: Any = None
        next_take = time.monotonic()

        def settle(ref: Any) -> ShardResult:
            shard, rollouts = pending.pop(ref)
            try:
                return ray.get(ref)
            except ray.exceptions.RayTaskError as error:  # export_shard raised: the cause, as locally
                cause = getattr(error, "cause", None)
                return _failed_shard(shard, rollouts, cause if isinstance(cause, BaseException) else error)
            except ray.exceptions.RayError as error:  # a worker or node died, retries spent
                return _failed_shard(shard, rollouts, error)

        def drain(final: bool = False) -> None:
            nonlocal take, next_take
            if sink is None or report is None:  # both or neither
                return
            if take is not None and (final or ray.wait([take], timeout=0)[0]):
                report(ray.get(take))
                take = None
            if final:
                report(ray.get(sink.take.remote()))
            elif take is None and time.monotonic() >= next_take:
                take, next_take = sink.take.remote(), time.monotonic() + 0.5

        while True:
            while held and len(pending) < workers:
                task = held.popleft()
                pending[remote.remote(job, task[0], task[1], sink)] = task
            while not exhausted and len(pending) + len(held) < 2 * workers:
                try:
                    task = await anext(shards)
                except StopAsyncIteration:
                    exhausted = True
                    break
                if len(pending) < workers:
                    pending[remote.remote(job, task[0], task[1], sink)] = task
                else:
                    held.append(task)
            if not pending:
                break
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            drain()
            if not ready:
                await asyncio.sleep(poll_interval)
                continue
            for ref in ready:
                yield settle(ref)
        drain(final=True)
    finally:
        for ref in pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        if sink is not None:
            with contextlib.suppress(Exception):
                ray.kill(sink)
        if started_here:
            ray.shutdown()


ENGINES: dict[str, Callable[..., AsyncGenerator[ShardResult, None]]] = {"local": local_engine, "ray": ray_engine}
"""Engines by ``--engine`` name. Each is ``engine(job, shards, *, workers, report, **options)``
(``options``: ``export(engine_options=...)``): it runs
``export_shard`` for every ``(shard, rollouts)`` task of the async iterator ``shards`` and yields
``ShardResult``s in any order."""


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
        self.bar: Any = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=0, desc="export", unit="rollout", file=self.stream, dynamic_ncols=True)

    def add(self, item: tuple[int, int, int, int]) -> None:
        rollouts, trajectories, tokens, size = item
        with self.lock:
            self.rollouts += rollouts
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
        if self.listing_done and self.rollouts:
            eta = f"{(self.total - self.rollouts) * elapsed / self.rollouts:.0f}s"
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
        with open(path, encoding="utf-8") as handle:
            ids = [line.strip() for line in handle]
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--ids {path}: cannot read it: {error}") from None
    ids = [i for i in ids if i and not i.startswith("#")]
    if not ids:
        raise ValueError(f"--ids {path}: no rollout id in it")
    return ids


def _check_options(url: str, dest: str, opts: dict[str, Any]) -> None:
    from s3capture.rollouts import parse_s3_url

    bucket, root = parse_s3_url(url)
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
    if opts["min_age"] < 0:
        raise ValueError("min_age must be >= 0 seconds")
    if not opts["fence_grace"] >= 0:
        raise ValueError(f"fence_grace must be >= 0 seconds, got {opts['fence_grace']!r}")
    if opts["engine"] == "ray":
        _import_ray()  # one line naming the extra, before anything is read
        if opts["workers"] < 1:
            raise ValueError(f"--engine ray needs --workers >= 1 (Ray tasks at once), got {opts['workers']}")
    if not dest:
        raise ValueError("no destination (--out)")
    if _is_s3(dest):
        dest_bucket, dest_prefix = parse_s3_url(dest)
        inside = f"{root}/rollouts" if root else "rollouts"
        if dest_bucket == bucket and (
            dest_prefix == inside or dest_prefix.startswith(inside + "/") or "rollouts" in dest_prefix.split("/")
        ):
            raise ValueError(f"--out {dest} lies inside the rollouts of {url}; choose a prefix outside it")
        if dest_bucket == bucket and (not dest_prefix or inside.startswith(dest_prefix + "/")):
            # The destination scan lists every key under DEST: here every captured object, each run.
            raise ValueError(
                f"--out {dest} contains the rollouts of {url}: reading the destination would list every captured "
                "object; choose a prefix beside them"
            )
    if opts["format"] == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError("--format parquet needs pyarrow: pip install 's3capture[parquet]'") from None
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
    ``min_age`` seconds old by this machine's clock; read unsealed unless ``freeze``), ``ids`` (only
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
    builder), ``StoreError`` when the source listing or the destination fails, ``RuntimeError``
    when a worker process dies.
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
    )
    _check_options(url, dest, opts)
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
    target = _open_destination(job)
    try:
        await target.lock()  # held until the end: another export into it is refused
        if isinstance(target, _S3Destination) and target.tag:
            job = msgspec.structs.replace(job, run_tag=target.tag)
        existing = await target.scan()
        done: dict[str, RolloutRecord] = {}
        for manifest in existing.manifests:
            if manifest.data_format != format:
                raise ValueError(
                    f"--out {dest} holds a {manifest.data_format} export (part-{manifest.shard:05d}); "
                    f"this run writes {format}: use another destination"
                )
            if manifest.builder and manifest.builder != builder:
                raise ValueError(
                    f"--out {dest} was exported with --builder {manifest.builder}; re-run with it or use another destination"
                )
            for record in manifest.rollouts:
                done[record.rollout_id] = record
        durable_data = {m.data for m in existing.manifests if m.data}
        orphans = [name for name in existing.data_files if name not in durable_data] + existing.temp_files
        await target.remove(existing.broken + orphans)
        summary.orphans_removed = len(existing.broken) + len(orphans)
        summary.shards_existing = len(existing.manifests)
        next_shard = existing.highest + 1
    except BaseException:
        await target.close()
        raise
    finally:
        requests.update({f"dest:{k}": v for k, v in target.requests.items()})

    drop_limit = asyncio.Semaphore(32)
    drop_tasks: set[asyncio.Task] = set()
    store = S3TokenStore(
        url, endpoint_url=endpoint_url, transport=transport, cache_bytes=1024 * 1024, fence_grace=fence_grace
    )

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

    async def schedule_drop(record: RolloutRecord) -> None:
        """Start the drop of ``record``'s rollout; first wait while ``_DROPS_AHEAD`` are pending,
        so the listing and the shard results pause behind slow drops (bounded memory)."""
        if not (drop and record.written and not record.masked):
            return
        if not record.sealed:
            summary.not_dropped += 1
            if len(summary.not_dropped_examples) < _EXAMPLES:
                summary.not_dropped_examples.append(
                    f"{record.rollout_id}: exported from an open rollout read unsealed; --freeze freezes it first"
                )
            return
        while len(drop_tasks) >= _DROPS_AHEAD:
            await asyncio.wait(list(drop_tasks), return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.create_task(drop_one(record))
        drop_tasks.add(task)
        task.add_done_callback(drop_tasks.discard)

    def skip(rollout_id: str, reason: str) -> None:
        summary.skipped += 1
        _note(summary.skipped_reasons, summary.skipped_examples, rollout_id, reason)

    async def shard_tasks() -> AsyncIterator[ShardTask]:
        nonlocal next_shard
        batch: list[Any] = []
        batch_bytes = 0
        now = _dt.datetime.now(_dt.timezone.utc)
        listed_prefix = prefix
        if wanted:  # narrow the listing to the ids' common prefix
            common = os.path.commonprefix(sorted(wanted))
            if common.startswith(prefix):
                listed_prefix = common
        async for info, listing in store.rollouts_listed(states, prefix=listed_prefix):
            rid = info.rollout_id
            if wanted is not None:
                if rid not in wanted:
                    continue
                seen_ids.add(rid)
            summary.listed += 1
            if info.state not in states:
                continue
            previous = done.get(rid)
            if (
                previous is not None
                and info.snapshot_id
                and (previous.snapshot_id, previous.version) == (info.snapshot_id, info.version)
                and (previous.written or masked == "skip")
            ):
                summary.already_exported += 1
                if info.state == "frozen":  # its shard is durable; a drop a killed run never made
                    await schedule_drop(msgspec.structs.replace(previous, sealed=True))
                continue
            if previous is not None and previous.written:
                summary.changed_since_export += 1
                if len(summary.changed_examples) < _EXAMPLES:
                    summary.changed_examples.append(
                        f"{rid}: exported at version {previous.version} ({previous.snapshot_id}), now version {info.version}"
                    )
            if info.state == "frozen" and not info.sealed and not freeze:
                # read_snapshot(sealed=True) would refuse it: say so without reading it.
                skip(
                    rid,
                    "not_sealed: frozen, but changed since its freeze (or its freeze did not finish); "
                    "--freeze seals it again",
                )
                continue
            if info.state == "open" and min_age > 0:
                if info.last_write is None:  # the listing gave no LastModified: its age is unknown
                    skip(
                        rid,
                        "not_quiescent: open, and the listing gives no time of its last write "
                        "(--min-age 0 exports it anyway)",
                    )
                    continue
                age = (now - info.last_write).total_seconds()
                if age < min_age:
                    skip(rid, f"not_quiescent: open, last write {age:.0f}s ago (< --min-age {min_age:.0f}s)")
                    continue
            summary.selected += 1
            # the worker reads it without listing it again
            batch.append(ListedRollout(info, tuple(listing), supersedes=previous is not None and previous.written))
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
    finally:
        for task in list(drop_tasks):
            task.cancel()
        bar.close()
        try:
            await store.close()
        finally:
            requests.update({f"source:{k}": v for k, v in store.request_counts.items()})
            await target.close()  # releases the destination (a local folder's lock)
    summary.requests = dict(sorted(requests.items()))
    summary.wall_seconds = round(time.monotonic() - started, 3)
    return summary


def _account(summary: ExportSummary, result: ShardResult, requests: collections.Counter) -> None:
    requests.update(result.requests)
    if result.error:
        summary.shards_failed += 1
    elif result.manifest:
        summary.shards_written += 1
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
    summary.bytes_read += result.bytes_read
    summary.bytes_written += result.bytes_written


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
        f"written: {s.trajectories:,} trajectories, {s.tokens:,} tokens, {s.shards_written:,} shards "
        f"({s.bytes_written / 1e6:.1f} MB); read {mb:.1f} MB ({rate:.1f} MB/s)",
    ]
    if s.shards_existing or s.orphans_removed:
        lines.append(
            f"destination: {s.shards_existing:,} durable shards found; {s.orphans_removed:,} unfinished files removed"
        )
    for title, counts in (("masked", s.masked_reasons), ("skipped", s.skipped_reasons), ("failed", s.failed_reasons)):
        if counts:
            lines.append(f"{title} by reason: " + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())))
    for title, examples in (("skipped", s.skipped_examples), ("failed", s.failed_examples)):
        for _, kept in sorted(examples.items()):
            lines.extend(f"  {title} {line}" for line in kept[:3])
    if s.changed_since_export:
        lines.extend(f"  changed {line}" for line in s.changed_examples[:3])
    if s.dropped or s.drop_failed or s.not_dropped:
        lines.append(
            f"dropped: {s.dropped:,}; drop failed (evidence kept): {s.drop_failed:,}; not dropped: {s.not_dropped:,}"
        )
        lines.extend(f"  {line}" for line in (s.drop_failed_examples[:3] + s.not_dropped_examples[:3]))
    if s.shards_failed:
        lines.append(f"shards failed: {s.shards_failed:,} (their rollouts are counted failed; a re-run retries them)")
    lines.append("requests: " + (", ".join(f"{k} {v:,}" for k, v in s.requests.items()) or "none"))
    lines.append(f"wall time: {s.wall_seconds:.1f}s; result: {'OK' if s.ok else 'FAILED'}")
    return "\n".join(lines)
