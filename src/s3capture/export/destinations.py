"""Where shards go: a local folder (``flock``) or an ``s3://`` prefix (a renewed claim), and how a
destination's durable shards are found (``read_manifests``).

The parts live in ``destination_base`` (file names, the ``_Destination`` interface, which shards
are durable), ``destination_local`` (``_LocalDestination``) and ``destination_s3``
(``_S3Destination``, its claim constants ``CLAIM_*``, ``remove_dead_exports_temp_files``); the
names other modules and tests import from here are re-exported. The claim constants are not: a
test that shortens them patches ``destination_s3``, where they are read."""

from __future__ import annotations

import os
from typing import Any

from s3capture.export.destination_base import (
    _LOCK as _LOCK,
    _TEMP as _TEMP,
    _Destination as _Destination,
    _is_s3 as _is_s3,
)
from s3capture.export.destination_local import _LocalDestination as _LocalDestination
from s3capture.export.destination_s3 import (
    _S3Destination as _S3Destination,
    remove_dead_exports_temp_files as remove_dead_exports_temp_files,
)
from s3capture.export.records import ExportJob, ShardManifest


def _open_destination(job: ExportJob, session: Any = None) -> _Destination:
    if _is_s3(job.dest):
        return _S3Destination(
            job.dest, endpoint_url=job.endpoint_url, transport=job.transport, session=session, owner=job.run_tag
        )
    return _LocalDestination(job.dest, owner=job.lock_token)


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


async def current_snapshots(
    dest: str, *, endpoint_url: str | None = None, transport: str | None = None
) -> dict[str, str]:
    """``{rollout_id: snapshot_id}`` of the latest export of each rollout in a destination: the
    record of the highest-numbered durable shard that holds the rollout (a re-run numbers its
    shards after every earlier one, so a later record supersedes an earlier one).

    A destination can hold rows of two snapshots of one rollout (``changed_since_export``: an open
    rollout written to after an unsealed export, or an id deleted and captured again). Train on
    the rows whose ``(rollout_id, snapshot_id)`` is in this map and that are not ``masked``: the
    latest state, which is left out altogether when it was masked and skipped. The highest
    ``version`` is not that rule: an id captured again starts counting from zero, so its
    earlier, longer generation would win.

    Raises what ``read_manifests`` raises.
    """
    latest: dict[str, str] = {}
    for manifest in await read_manifests(dest, endpoint_url=endpoint_url, transport=transport):
        for record in manifest.rollouts:
            latest[record.rollout_id] = record.snapshot_id
    return latest
