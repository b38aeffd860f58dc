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
   (``s3capture.trajectory.build_rollout_async``), appends rows to a bounded row-group buffer, publishes
   the data file atomically (temp file + rename locally; one PUT on S3) and then the shard manifest
   ``_part-NNNNN.manifest.json``. **A shard is durable once its manifest exists.**
4. With ``drop``, the parent drops a rollout (``S3TokenStore.drop``: conditional, it keeps the
   evidence when a write raced the freeze) only after the manifest of the shard holding it exists.

A masked or incomplete rollout is never written as trainable: ``masked="skip"`` leaves it out (the
manifest still records the decision), ``masked="include"`` writes it with ``masked=true`` and its
reasons.

Modules: ``records`` (options, ``ExportJob``, manifests, results, summary), ``destinations`` (local
folder and ``s3://`` destinations, their lock / claim, ``read_manifests``; their parts in
``destination_base``, ``destination_local`` and ``destination_s3``), ``writers`` (Parquet
schema and writer, Gym JSONL), ``shard`` (``export_shard``: read, build, write one shard),
``engines`` (``local_engine``, ``ray_engine``, ``ENGINES``), ``driver`` (``export``: listing,
resume, drop), ``options`` (its checks, ``parse_duration``, ``read_ids``) and ``report`` (progress,
``format_summary``). Everything is importable from ``s3capture.export`` itself.
"""

from s3capture.export.destination_s3 import (
    CLAIM_HOLD as CLAIM_HOLD,
    CLAIM_LEASE as CLAIM_LEASE,
    CLAIM_RENEW as CLAIM_RENEW,
)
from s3capture.export.destinations import (
    _LocalDestination as _LocalDestination,
    _S3Destination as _S3Destination,
    current_snapshots as current_snapshots,
    read_manifests as read_manifests,
)
from s3capture.export.driver import (
    HOLD_ENV as HOLD_ENV,
    _Progress as _Progress,
    export as export,
    format_summary as format_summary,
    parse_duration as parse_duration,
    read_ids as read_ids,
)
from s3capture.export.engines import (
    ENGINES as ENGINES,
    RAY_INSTALL as RAY_INSTALL,
    ShardTask as ShardTask,
    local_engine as local_engine,
    ray_engine as ray_engine,
)
from s3capture.export.records import (
    BUILD_WITH as BUILD_WITH,
    BUILDERS as BUILDERS,
    FORMATS as FORMATS,
    MANIFEST_FORMAT as MANIFEST_FORMAT,
    MASKED_CHOICES as MASKED_CHOICES,
    STATES as STATES,
    TOKEN_TYPES as TOKEN_TYPES,
    ExportJob as ExportJob,
    ExportSummary as ExportSummary,
    RolloutRecord as RolloutRecord,
    ShardManifest as ShardManifest,
    ShardResult as ShardResult,
)
from s3capture.export.shard import (
    ListedRollout as ListedRollout,
    _close_clients as _close_clients,
    export_shard as export_shard,
)
from s3capture.export.writers import (
    METRIC_COLUMNS as METRIC_COLUMNS,
    _Built as _Built,
    _ParquetWriter as _ParquetWriter,
    gym_dict as gym_dict,
    parquet_schema as parquet_schema,
)

__all__ = [
    "ENGINES",
    "ExportJob",
    "ExportSummary",
    "ListedRollout",
    "RolloutRecord",
    "ShardManifest",
    "ShardResult",
    "export",
    "current_snapshots",
    "export_shard",
    "format_summary",
    "local_engine",
    "parquet_schema",
    "ray_engine",
    "read_manifests",
]
