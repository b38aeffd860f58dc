"""``s3capture demo --capture ledger``: tokens staged outside the store, token-free rows in S3.

This is the framework-owned staging path of NeMo Gym (``nemo_gym/token_id_capture/external_capture.py``
and ``staging/``), played end to end with ``S3CaptureLedger``:

* each model-server worker resolves the call's parent through ``S3CaptureLedger.resolve``: ROOT
  makes a text-mode root, RESOLVED a ``token_in`` child whose delta starts after the parent's
  ``prev_len`` tokens (the worker checks that its prompt begins with the parent's tokens against
  the parent's cumulative hash), UNRESOLVED records the failure row ``unresolved_parent`` and
  still serves the call;
* the worker stages the call's delta (prompt suffix, generation, masks, log probs and the staging
  digests of ``s3capture.staging``) as one JSON object in a separate staging area,
  ``s3://bucket/<run>-staging/<rollout_id>/<model_call_id>.json`` by default, written with a plain
  aioboto3 ``put_object``: it stands for the framework's transfer queue. A staging failure records
  ``worker_capture_failed``;
* then the worker ``record``\\ s the token-free ``CaptureLedgerCommit`` (row, staging chain, request
  and response items) in the ledger;
* the trajectory builder reads each rollout's manifest, validates it as ``RolloutManifest`` (with
  s3capture's rules, and with NeMo Gym's pydantic model when Gym is installed), rebuilds every
  committed call's cumulative tokens from the staged deltas along its parent chain and checks them
  against the replay file and against ``chain_hash``/``cumulative_hash``, retires the rollout's
  ledger and deletes its staged objects (the framework owns them).
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from s3capture.demo_common import (
    CallResult,
    DemoReport,
    closing_lines,
    percentiles,
    probe_store,
    resolution_lines,
    timing_lines,
)
from s3capture.ledger_records import (
    UNCOMMITTED_CALL_REASON,
    CaptureLedgerCommit,
    validate_manifest,
)
from s3capture.records import ParentResolutionStatus, RecordError
from s3capture.replay import ReplayCall, ReplayRollout
from s3capture.staging import (
    StagedCall,
    call_record,
    compute_chain_hash,
    hash_token_ids,
    stage_call,
)
from s3capture.store import default_botocore_config, parse_s3_url
from s3capture.transport import configured_endpoint

__all__ = [
    "LedgerDemoReport",
    "LedgerWorker",
    "StagingArea",
    "build_ledger",
    "default_staging_url",
    "format_ledger_report",
]

# Gym's reason codes (nemo_gym.token_id_capture.records / staging.records): wire contract.
UNRESOLVED_PARENT_REASON = "unresolved_parent"
WORKER_CAPTURE_FAILED_REASON = "worker_capture_failed"

_SHARED_FIELDS = (
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)


def default_staging_url(url: str) -> str:
    """The staging area beside a ledger URL: ``s3://b/run`` -> ``s3://b/run-staging``."""
    bucket, prefix = parse_s3_url(url)
    return f"s3://{bucket}/{prefix}-staging" if prefix else f"s3://{bucket}/staging"


class StagingArea:
    """The framework's staging store, played by plain S3 objects: one JSON ``StagedCall`` per call.

    Key of a staged call: ``<prefix>/<staging_key>.json`` with Gym's staging key
    ``<rollout_id>/<model_call_id>``. One lazily opened aioboto3 client; ``request_counts`` counts
    its HTTP requests by operation. The endpoint comes from ``AWS_ENDPOINT_URL`` as for the ledger.
    """

    def __init__(self, url: str, *, max_concurrency: int = 32) -> None:
        self.url = url
        self.bucket, prefix = parse_s3_url(url)
        self.prefix = f"{prefix}/" if prefix else ""
        self.endpoint_url = configured_endpoint()
        extra = {"s3": {"addressing_style": "path"}} if self.endpoint_url else {}
        self._config = default_botocore_config(max(max_concurrency, 10), **extra)
        self._sem = asyncio.Semaphore(max_concurrency)
        self._stack: Any = None
        self._client: Any = None
        self.request_counts: collections.Counter[str] = collections.Counter()

    async def _s3(self) -> Any:
        if self._client is None:
            from contextlib import AsyncExitStack

            import aioboto3

            stack = AsyncExitStack()
            client = await stack.enter_async_context(
                aioboto3.Session().client("s3", endpoint_url=self.endpoint_url, config=self._config)
            )
            client.meta.events.register("before-send.s3", self._count)
            if self._client is None:
                self._stack, self._client = stack, client
            else:  # another task opened one meanwhile
                await stack.aclose()
        return self._client

    def _count(self, event_name: str = "", **_: Any) -> None:
        self.request_counts[event_name.rsplit(".", 1)[-1]] += 1

    def key(self, staging_key: str) -> str:
        return f"{self.prefix}{staging_key}.json"

    async def put(self, staged: StagedCall) -> int:
        """Stage one call (one PUT); returns the bytes written."""
        body = staged.encode()
        client = await self._s3()
        async with self._sem:
            await client.put_object(Bucket=self.bucket, Key=self.key(staged.staging_key), Body=body)
        return len(body)

    async def get(self, staging_key: str) -> bytes | None:
        client = await self._s3()
        async with self._sem:
            try:
                response = await client.get_object(Bucket=self.bucket, Key=self.key(staging_key))
            except client.exceptions.NoSuchKey:
                return None
            async with response["Body"] as stream:
                return await stream.read()

    async def list(self, under: str = "") -> list[tuple[str, int]]:
        """``(key, size)`` of every staged object under ``<prefix><under>``."""
        client = await self._s3()
        out: list[tuple[str, int]] = []
        async with self._sem:
            paginator = client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + under):
                out.extend((item["Key"], item["Size"]) for item in page.get("Contents", ()))
        return out

    async def delete(self, keys: builtins.list[str]) -> None:  # `list` here is the method above
        client = await self._s3()
        for start in range(0, len(keys), 1000):
            batch = [{"Key": key} for key in keys[start : start + 1000]]
            async with self._sem:
                await client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()


class LedgerWorker:
    """A model-server worker of the ledger demo: an ``S3CaptureLedger`` and the staging area."""

    def __init__(self, url: str, staging_url: str, concurrency: int) -> None:
        from s3capture.ledger import S3CaptureLedger

        self.ledger = S3CaptureLedger(url, max_concurrency=concurrency)
        self.staging = StagingArea(staging_url, max_concurrency=concurrency)

    async def serve(self, worker: int, rollout_id: str, call: ReplayCall, expected_parent: str | None) -> CallResult:
        cid = call.model_call_id
        admitted_at = time.time()
        started = time.perf_counter()
        resolution = await self.ledger.resolve(rollout_id, call.request_items)
        status = ParentResolutionStatus(resolution.status)
        result = CallResult(
            rollout_id,
            call.index,
            worker,
            status.value,
            resolution.reason,
            True,
            (time.perf_counter() - started) * 1000,
            0.0,
        )
        if status == ParentResolutionStatus.UNRESOLVED:
            # Gym admits no capture for this call; the completion is still served.
            await self.ledger.record_failure(rollout_id, cid, UNRESOLVED_PARENT_REASON)
            result.committed, result.failure, result.parent_ok = False, UNRESOLVED_PARENT_REASON, False
            return result
        match = resolution.match if status == ParentResolutionStatus.RESOLVED else None
        if match is not None:
            result.parent_ok = expected_parent is None or match.model_call_id == expected_parent
        started = time.perf_counter()
        try:
            staged = stage_call(
                rollout_id=rollout_id,
                model_call_id=cid,
                prompt_token_ids=call.prompt_token_ids,
                generation_token_ids=call.generation_token_ids,
                generation_log_probs=call.generation_log_probs,
                parent=match,
            )
            await self.staging.put(staged)
        except Exception as error:  # noqa: BLE001 - the worker's capture_failed acknowledgement
            await self.ledger.record_failure(rollout_id, cid, WORKER_CAPTURE_FAILED_REASON)
            result.committed, result.failure, result.parent_ok = False, WORKER_CAPTURE_FAILED_REASON, False
            result.reason = f"{type(error).__name__}: {error}"[:200]
            return result
        result.stage_ms = (time.perf_counter() - started) * 1000
        output_items = list(call.output_items)
        record = call_record(
            staged,
            response_id=f"resp-{cid}",
            admitted_at=admitted_at,
            request_items=call.request_items,
            response_items=output_items,
        )
        commit = CaptureLedgerCommit(
            rollout_id=rollout_id,
            record=record,
            staging_chain=(*(match.staging_chain if match is not None else ()), staged.staging_key),
            request_items=list(call.request_items),
            response_items=output_items,
        )
        started = time.perf_counter()
        await self.ledger.record(commit)
        result.put_ms = (time.perf_counter() - started) * 1000
        return result

    async def probe(self) -> None:
        """The worker's start-up check: one LIST in the ledger's bucket and one in the staging bucket."""
        await probe_store(self.ledger.url)
        await probe_store(self.staging.url)

    def request_counts(self) -> dict[str, int]:
        counts = {f"worker:{k}": v for k, v in self.ledger.request_counts.items()}
        counts.update({f"staging:{k}": v for k, v in self.staging.request_counts.items()})
        return counts

    async def close(self) -> None:
        await self.ledger.close()
        await self.staging.close()


@dataclass
class LedgerDemoReport(DemoReport):
    """A ledger-mode run: ``DemoReport`` (``captured`` = committed calls) plus the builder's checks."""

    staging_url: str = ""
    manifests_valid: int = 0
    gym_manifests_valid: int | None = None
    """Manifests NeMo Gym's pydantic ``RolloutManifest`` accepted; ``None`` when Gym is not installed."""
    calls_rebuilt: int = 0
    rebuild_problems: list[str] = field(default_factory=list)
    rollouts_with_rows: int = 0
    retired: int = 0
    ledger_bytes: int = 0
    ledger_objects: int = 0
    staged_bytes: int = 0
    staged_objects: int = 0
    staged_deleted: int = 0

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and self.faithful_resolved == self.faithful
            and self.manifests_valid == self.rollouts
            and self.gym_manifests_valid in (None, self.rollouts)
            and self.masked == 0
            and not self.rebuild_problems
            and self.calls_rebuilt == self.captured
            and self.retired == self.rollouts_with_rows
        )


def _gym_manifest_model() -> Any:
    try:
        from nemo_gym.token_id_capture.staging.records import RolloutManifest
    except Exception:  # noqa: BLE001 - Gym is optional
        return None
    return RolloutManifest


async def _verify_rollout(staging: StagingArea, rollout: ReplayRollout, manifest: dict) -> tuple[int, list[str]]:
    """Rebuild every committed call from its staged deltas; return (calls rebuilt, problems)."""
    calls = {call.model_call_id: call for call in rollout.calls}
    records = {row["model_call_id"]: row for row in manifest["records"]}
    failed = {failure["model_call_id"] for failure in manifest["failures"]}
    problems = [f"{cid}: {UNCOMMITTED_CALL_REASON}" for cid in calls if cid not in records and cid not in failed]
    bodies = await asyncio.gather(*(staging.get(row["staging_key"]) for row in records.values()))
    staged: dict[str, StagedCall] = {}
    for (cid, row), body in zip(records.items(), bodies):
        try:
            if body is None:
                raise ValueError(f"staged object {row['staging_key']} is missing")
            snapshot = StagedCall.decode(body)  # recomputes the digest and the extras digest
            if snapshot.rollout_id != rollout.rollout_id:
                raise ValueError(f"staged record belongs to {snapshot.rollout_id}")
            for name in _SHARED_FIELDS:
                if getattr(snapshot, name) != row[name]:
                    raise ValueError(f"staged {name} {getattr(snapshot, name)!r} != manifest {row[name]!r}")
            staged[cid] = snapshot
        except ValueError as error:
            problems.append(f"{cid}: {error}")
    rebuilt: dict[str, tuple[list[int], str]] = {}
    expected_parent = {
        call.model_call_id: (rollout.calls[call.index - 1].model_call_id if call.index else None)
        for call in rollout.calls
    }
    ok = 0
    for call in rollout.calls:  # parents come first
        cid = call.model_call_id
        if cid not in staged:
            continue
        row, snapshot = records[cid], staged[cid]
        parent = row["parent_call_id"]
        if parent is not None and parent not in rebuilt:
            problems.append(f"{cid}: parent {parent} has no verified row")
            continue
        prefix, parent_chain = rebuilt[parent] if parent is not None else ([], None)
        tokens = prefix + snapshot.token_ids_delta
        chain_hash = compute_chain_hash(parent_chain, snapshot.token_ids_delta)
        real = list(call.prompt_token_ids) + list(call.generation_token_ids)
        generated = len(call.generation_token_ids)
        if parent != expected_parent[cid] and call.index > 0:
            problems.append(f"{cid}: resolved to parent {parent}, expected {expected_parent[cid]}")
        elif len(prefix) != row["prev_len"]:
            problems.append(f"{cid}: parent ends at {len(prefix)}, row starts at {row['prev_len']}")
        elif chain_hash != row["chain_hash"]:
            problems.append(f"{cid}: chain_hash does not extend the parent's chain")
        elif hash_token_ids(tokens) != row["cumulative_hash"]:
            problems.append(f"{cid}: cumulative_hash does not cover the rebuilt tokens")
        elif tokens != real:
            problems.append(f"{cid}: rebuilt tokens differ from the call's prompt + generation")
        elif generated and (
            snapshot.generation_log_probs_delta[-generated:] != list(call.generation_log_probs)
            or snapshot.token_mask_delta[-generated:] != [1.0] * generated
        ):
            problems.append(f"{cid}: staged log probs or masks differ from the call's generation")
        else:
            ok += 1
        rebuilt[cid] = (tokens, chain_hash)
    return ok, problems


async def build_ledger(
    url: str,
    staging_url: str,
    rollouts: list[ReplayRollout],
    report: LedgerDemoReport,
    progress: Any,
    manifest_hook: Callable[[dict], None] | None = None,
) -> None:
    """The trajectory builder of the ledger demo: manifest, verify, retire, delete staged objects."""
    from s3capture.ledger import S3CaptureLedger

    gym_manifest = _gym_manifest_model()
    if gym_manifest is not None:
        report.gym_manifests_valid = 0
    staging = StagingArea(staging_url)
    try:
        async with S3CaptureLedger(url) as ledger:
            for item in await ledger._list(ledger.layout.root):
                report.ledger_bytes += item.size
                report.ledger_objects += 1
            for _, size in await staging.list():
                report.staged_bytes += size
                report.staged_objects += 1
            limit = asyncio.Semaphore(8)

            async def one(rollout: ReplayRollout) -> None:
                async with limit:
                    rid = rollout.rollout_id
                    manifest = await ledger.manifest(rid)
                    if manifest_hook is not None:
                        manifest_hook(manifest)
                    problems: list[str] = []
                    try:
                        validate_manifest(manifest)
                        report.manifests_valid += 1
                    except RecordError as error:
                        problems.append(f"manifest: {error}")
                    if gym_manifest is not None:
                        try:
                            gym_manifest.model_validate(manifest)
                            report.gym_manifests_valid = (report.gym_manifests_valid or 0) + 1
                        except Exception as error:  # noqa: BLE001 - pydantic's ValidationError
                            problems.append(f"Gym RolloutManifest: {str(error).splitlines()[0]}")
                    rebuilt, rebuild_problems = await _verify_rollout(staging, rollout, manifest)
                    report.calls_rebuilt += rebuilt
                    report.chains_checked += sum(1 for row in manifest["records"] if row["parent_call_id"])
                    report.rebuild_problems.extend(f"{rid}: {p}" for p in problems + rebuild_problems)
                    failures = sorted({f["reason"] for f in manifest["failures"]})
                    if problems or rebuild_problems or failures:
                        report.masked += 1
                        report.masked_reasons.append(
                            f"{rid}: failures {failures}" if failures else f"{rid}: unverified"
                        )
                    else:
                        report.trainable += 1
                    if manifest["records"] or manifest["failures"]:
                        report.rollouts_with_rows += 1
                    removal = await ledger.retire([rid])
                    report.retired += rid in removal["removed"]
                    keys = [key for key, _ in await staging.list(f"{rid}/")]
                    await staging.delete(keys)
                    report.staged_deleted += len(keys)
                    progress.update(1)

            await asyncio.gather(*(one(r) for r in rollouts))
            await ledger.delete([r.rollout_id for r in rollouts])  # the fences retire left behind
            report.requests.update({f"builder:{k}": v for k, v in ledger.request_counts.items()})
            report.requests.update({f"builder-staging:{k}": v for k, v in staging.request_counts.items()})
    finally:
        await staging.close()


def format_ledger_report(report: LedgerDemoReport, *, where: str) -> str:
    """Human-readable summary of a ledger-mode demo run."""
    gym = (
        "NeMo Gym's pydantic RolloutManifest not installed, not checked"
        if report.gym_manifests_valid is None
        else f"NeMo Gym's pydantic RolloutManifest accepts {report.gym_manifests_valid}/{report.rollouts}"
    )
    failures = ", ".join(f"{reason} {n}" for reason, n in sorted(report.failures.items())) or "none"
    ratio = f" ({report.ledger_bytes / report.staged_bytes:.1%} of the staged bytes)" if report.staged_bytes else ""
    lines = [
        f"s3capture demo --capture ledger against {where}",
        f"  token deltas staged outside the ledger, in {report.staging_url} (the framework's transfer queue)",
        f"  rollouts {report.rollouts}, model calls {report.calls}",
        *timing_lines(report, "manifest+verify+retire", what="committed"),
        *resolution_lines(report),
        f"  failure rows: {failures}",
        f"  manifests valid: {report.manifests_valid}/{report.rollouts} ({gym})",
        f"  rollouts trainable (no failures): {report.trainable}/{report.rollouts}, masked {report.masked}",
        f"  calls rebuilt from staged deltas (tokens equal the replay's, chain_hash and cumulative_hash verified):"
        f" {report.calls_rebuilt}/{report.captured}; broken {len(report.rebuild_problems)}",
        f"  retired: {report.retired}/{report.rollouts_with_rows}; staged objects deleted by the builder:"
        f" {report.staged_deleted}/{report.staged_objects}",
        f"  resolve latency: {percentiles(report.resolve_ms)}",
        f"  stage   latency: {percentiles(report.stage_ms)}",
        f"  record  latency: {percentiles(report.put_ms)}",
        f"  ledger bytes: {report.ledger_bytes:,} in {report.ledger_objects} objects (rows, fingerprint index,"
        f" failure rows){ratio}; staged bytes: {report.staged_bytes:,} in {report.staged_objects} objects",
    ]
    problems = [f"  BROKEN {item}" for item in report.rebuild_problems[:5]]
    problems += [f"  MASKED {item}" for item in report.masked_reasons[:5]]
    return "\n".join(lines + closing_lines(report, problems))
