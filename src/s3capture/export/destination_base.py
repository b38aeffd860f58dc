"""What every export destination shares: the names of its files (``_PART`` data files and
manifests, ``_TEMP`` temp files, the ``_LOCK`` lock), the ``_Destination`` interface, and how the
files a scan finds are sorted (``_classify``) and which shards are durable (``_settle``,
``_decode_manifest``). The local folder is in ``destination_local``, the ``s3://`` prefix in
``destination_s3``."""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable

import msgspec

from s3capture.export.records import MANIFEST_FORMAT, ShardManifest

_PART = re.compile(
    r"^(?:part-([0-9]{5,})(?:-[0-9a-f]{8,32})?\.(?:parquet|jsonl)|_?part-([0-9]{5,})(?:-[0-9a-f]{8,32})?\.manifest\.json)$"
)
"""Data files ``part-NNNNN[-<run tag>].parquet|jsonl`` and manifests ``_part-NNNNN[-<run tag>].manifest.json``
(``ExportJob.run_tag`` on ``s3://`` destinations; the leading
``_`` makes pyarrow, pandas, Spark and Ray Data skip them when they read the folder as a dataset).
Manifests named ``part-NNNNN.manifest.json`` (exports before the ``_``) are read too: otherwise their
data files would look unfinished and be removed. Digits are ``[0-9]``, never ``\\d``, which matches
every Unicode digit: a user's ``part-00007.parquet`` written in fullwidth digits (U+FF10-U+FF19) was
read as shard 7 and deleted as an unfinished shard (an audit, 2026-12-04). Applied with ``fullmatch``."""
_TEMP = re.compile(r"^\._?part-[0-9]{5,}.*\.tmp$")
_LOCK = ".s3capture-export.lock"
"""A local destination's lock file (``_LocalDestination.lock``); hidden, so dataset readers skip it.
On an ``s3://`` destination, the folder of the exports' claims (``_S3Destination.lock``)."""


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
    foreign: list[str] = []
    """Files (and folders, with a trailing ``/``) no export writes, which a dataset reader of the
    destination would read too (names starting with ``.`` or ``_`` are skipped by those readers)."""


def _foreign(name: str, folder: bool = False) -> bool:
    """A top-level name in a destination that no export writes and that dataset readers (pyarrow,
    pandas, Spark, Ray Data: they skip names starting with ``.`` or ``_``) would read. An export
    writes no folder readers see, so a ``folder`` is foreign whatever its name: one named like a
    data file (``part-00009.parquet/``) was read with the export (a breaker, 2026-12-04)."""
    return not name.startswith((".", "_")) and (folder or not _PART.fullmatch(name))


class _Destination:
    """Where shards go: a local folder or an ``s3://`` prefix. ``publish`` is atomic."""

    requests: collections.Counter

    def written_by_an_export(self, name: str) -> bool:
        """Whether the data file ``name``, which no manifest names, can only be an export's (its
        unfinished shard, removed by the re-run) in a destination that holds no manifest and no
        temp file; otherwise it is refused as foreign and kept. Called after ``lock``."""
        return False

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

    async def close(self, *, failed: bool = False) -> None:
        """Release the destination; ``failed``: the export ends with an error."""


def _classify(files: Iterable[tuple[str, int]], existing: _Existing) -> list[str]:
    """Sort destination files ``(name, size)`` into data files, temp files and manifest names."""
    manifests: list[str] = []
    for name, size in files:
        match = _PART.fullmatch(name)
        if match:
            existing.highest = max(existing.highest, int(match.group(1) or match.group(2)))
            if match.group(2):
                manifests.append(name)
            else:
                existing.data_files.append(name)
                existing.sizes[name] = size
        elif _TEMP.fullmatch(name):
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


def _manifest_names_of(data: str) -> tuple[str, ...]:
    """The names a data file's manifest can have: ``_part-N[-tag].manifest.json``, and
    ``part-N.manifest.json`` of exports before the ``_``."""
    stem = data.rsplit(".", 1)[0]
    return (f"_{stem}.manifest.json", f"{stem}.manifest.json")


def _decode_manifest(name: str, raw: bytes) -> ShardManifest:
    try:
        manifest = msgspec.json.decode(raw, type=ShardManifest)
    except (msgspec.DecodeError, RecursionError) as error:  # RecursionError: nested past the stack
        raise ValueError(f"shard manifest {name} is not a valid export manifest: {error}") from None
    if manifest.format != MANIFEST_FORMAT:
        raise ValueError(f"shard manifest {name} has format {manifest.format!r}, expected {MANIFEST_FORMAT!r}")
    return manifest
