"""The export's vocabulary and records: option values, ``ExportJob`` (what a shard needs),
``RolloutRecord`` and ``ShardManifest`` (what a durable shard holds), ``ShardResult`` (what one
shard run did) and ``ExportSummary`` (what one export did)."""

from __future__ import annotations

import msgspec

FORMATS = ("parquet", "gym-jsonl")
MASKED_CHOICES = ("skip", "include")
BUILDERS = ("prefix_merging", "per_request")
"""Gym's builder names; which of them a run can use depends on the engine (NeMo Gym 0.7.0 and the
built-in engine know ``prefix_merging`` only): ``export`` checks before reading anything."""
BUILD_WITH = ("auto", "gym", "builtin")
STATES = ("open", "frozen", "retired")
TOKEN_TYPES = ("auto", "int64")
MANIFEST_FORMAT = "s3capture.export-shard/1"

_EXAMPLES = 20
"""Examples kept per reason in a summary (counts are exact; examples are bounded)."""


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
    source_endpoint: str | None = None
    """The endpoint the source store resolved (``source_endpoint_of`` of the client's endpoint),
    recorded in every shard manifest; ``None``: recorded from ``endpoint_url`` and the environment."""
    cache_bytes: int = 32 * 1024 * 1024
    probe_listing: bool = False
    """Freezes (``freeze``) list behind a probe: ``S3TokenStore(probe_listing=True)``."""
    run_tag: str = ""
    """On an ``s3://`` destination, this export's claim id, in the name of every shard it writes
    (``part-NNNNN-<run_tag>.parquet``): an export taken over after a pause can never replace a
    shard of the export that took over (both number shards from the highest one they found)."""

    lock_token: str = ""
    """On a local destination, the token this export wrote into the folder's lock file: a shard
    is published only while the folder's lock is held under it (``_LocalDestination``), so a
    worker that outlives its export (killed, or a Ray task still running) never replaces a
    re-run's files."""

    def shard_name(self, shard: int) -> str:
        """The data file of ``shard``: ``part-NNNNN[-<run_tag>].parquet`` (or ``.jsonl``)."""
        tag = f"-{self.run_tag}" if self.run_tag else ""
        return f"part-{shard:05d}{tag}.{'parquet' if self.format == 'parquet' else 'jsonl'}"

    def parquet_token_ids(self) -> str:
        """The ``token_ids`` element type every Parquet shard of this job has (``"int64"`` only with
        ``token_type="int64"``), ``""`` for gym-jsonl."""
        if self.format != "parquet":
            return ""
        return "int64" if self.token_type == "int64" else "int32"

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
    source_endpoint: str | None = None
    """The S3 endpoint the source was read from (``source_endpoint_of``: ``""`` for AWS itself);
    ``None`` in manifests written before the field."""
    created_at: str = ""
    rollouts: list[RolloutRecord] = []
    token_ids: str = ""
    """Parquet: the element type of the shard's ``token_ids`` (``"int32"`` or ``"int64"``), one per
    destination so its shards read as one dataset; ``""`` for gym-jsonl and for manifests written
    before the field."""


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
    clipped: list[tuple[str, int]] = []
    """``(rollout_id, count)`` of log probabilities written clipped to the column's finite range."""
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
    not_selected: dict[str, int] = {}
    """Listed rollouts in a state the run did not select, by state (``retired``, ...)."""
    root_empty: bool = False
    """No rollout in any state under the source root (with ``--prefix`` or ids, one more LIST of
    one key tells), and no shard of it in the destination (a root this destination consumed, by
    ``--drop`` and ``gc``, is not mistyped): ``s3capture export`` exits 3."""
    id_prefix: str = ""
    """The ``--prefix`` selection the run listed (``""``: every rollout id)."""
    roots_below: list[str] = []
    """When the source root holds no rollout: ``s3://`` URLs of roots found inside it (a URL one
    level too high), from one LIST page."""
    roots_beside: list[str] = []
    """When the source root holds no rollout and none is inside it: ``s3://`` URLs of roots beside
    it under its parent (a typo in its last segment), from one LIST page."""
    exported: int = 0
    masked_written: int = 0
    masked_excluded: int = 0
    already_exported: int = 0
    already_left_out: int = 0
    """Of ``already_exported``, those an earlier run left out as masked (``masked="skip"``): in
    a shard manifest, with no row."""
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
    logprobs_clipped: int = 0
    """Log probabilities written as float32's lowest (or highest) finite value because they lie
    beyond float32's range (Parquet only; ``gym-jsonl`` keeps them). ``clipped_examples`` holds up
    to 20 ``"rollout_id: count"`` lines."""
    clipped_examples: list[str] = []
    shards_written: int = 0
    shards_failed: int = 0
    shards_existing: int = 0
    data_files: int = 0
    """Data files in the destination after this run: durable ones found plus the ones it wrote (a
    shard whose rollouts were all masked and left out has a manifest and no data file)."""
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


def source_endpoint_of(endpoint_url: str | None) -> str:
    """The endpoint an export's source store talks to, as its manifests record it: ``endpoint_url``,
    else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (the store's own order), without a
    trailing slash and with its scheme and host in lower case; ``""`` for AWS itself."""
    from urllib.parse import urlsplit, urlunsplit

    from s3capture.transport import configured_endpoint

    raw = configured_endpoint(endpoint_url) or ""
    if not raw:
        return ""
    parts = urlsplit(raw.strip())
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), parts.path.rstrip("/"), parts.query, ""))
