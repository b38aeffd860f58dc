"""``s3capture demo``: a capture workload end to end on S3.

Model-server workers (separate processes, each with its own ``S3TokenStore``) serve the model calls
of many rollouts in parallel. Every call goes to a random worker, so a continuation usually lands
on a worker that never saw its parent. A worker resolves the call's parent, records its intent
(``begin_call``), builds the ``TokenEntry`` (with ``--prompt-storage delta`` a RESOLVED call stores
only the prompt suffix after its parent's cumulative tokens) and puts it. When a rollout's calls
are done, a trajectory builder freezes it, checks every chain is contiguous (each child's full
prompt starts with its parent's cumulative tokens, and every digest verifies) and drops the
consumed snapshot.

With ``capture="ledger"`` (``s3capture demo --capture ledger``) the token arrays are staged outside
the store, as a training framework does, and S3 holds only ``S3CaptureLedger``'s token-free rows; see
``s3capture.demo_ledger``.

Without ``--url`` and without ``AWS_ENDPOINT_URL`` the demo starts an embedded S3 server (moto in
server mode on 127.0.0.1) and stops it at the end.

This module holds ``run_workload`` (the coordinator), the trajectory builder and the report; the
worker processes and the coordinator's pool of them are in ``s3capture.demo_workers``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from s3capture.demo_common import (
    CallResult,
    DemoReport,
    closing_lines,
    human_bytes,
    open_progress,
    percentiles,
    resolution_lines,
    timing_lines,
)
from s3capture.demo_ledger import (
    LedgerDemoReport,
    build_ledger,
    default_staging_url,
    format_ledger_report,
)
from s3capture.demo_workers import (
    RESOLVED,
    _serve_call as _serve_call,
    _WorkerPool,
)
from s3capture.records import encode_entry
from s3capture.replay import ReplayRollout
from s3capture.trajectory import ChainError, build_rollout_async, check_chain, cumulative_prompt


async def _build(
    url: str,
    rollout_ids: list[str],
    report: DemoReport,
    progress: Any,
    export_dest: str | None = None,
    keep: bool = False,
) -> None:
    """Freeze, verify and drop every rollout (the trajectory builder).

    With ``export_dest`` the frozen rollouts are exported there (``s3capture.export``, read-only
    reads of the sealed snapshots) before they are dropped, and the export drops each one once the
    shard holding it is durable."""
    from s3capture.store import S3TokenStore

    async with S3TokenStore(url) as builder:
        limit = asyncio.Semaphore(8)
        # This run's rollouts only: a --url used before (or by another demo at the same time)
        # holds other rollouts under the same root.
        ours = {builder.layout.rollout(rollout_id) for rollout_id in rollout_ids}
        rollouts_root = f"{builder.layout.root}rollouts/"
        for item in await builder._list(rollouts_root):
            head, _, _ = item.key[len(rollouts_root) :].partition("/")
            if f"{rollouts_root}{head}/" in ours:
                report.stored_bytes += item.size
                if "/log/e/" in item.key:
                    report.entry_objects += 1

        async def one(rollout_id: str) -> None:
            async with limit:
                snapshot = await builder.freeze(rollout_id)
                # The verdict an export gives (s3capture.trajectory: Gym's builder when it is
                # importable), so "trainable" here means what a trainer would get.
                build = await build_rollout_async(snapshot)
                problems = check_chain(snapshot.entries)
                by_id = {entry.model_call_id: entry for entry in snapshot.entries}
                cumulative: dict[str, list[int]] = {}
                report.chains_checked += sum(1 for e in snapshot.entries if e.parent_call_id)
                report.chains_broken.extend(f"{rollout_id}: {p}" for p in problems)
                for entry in snapshot.entries:
                    report.gym_jsonl_bytes += len(encode_entry(entry)) + 1
                    report.tokens += len(entry.prompt_token_ids) + len(entry.generation_token_ids)
                    full_prompt = None
                    if entry.prompt_is_delta:
                        try:
                            full_prompt = cumulative_prompt(entry, by_id, memo=cumulative)
                        except ChainError:
                            pass  # reported by check_chain above
                    if full_prompt is not None:
                        # The JSONL line Gym would write for this call with its full prompt.
                        entry.prompt_token_ids = full_prompt
                        entry.prompt_is_delta = False
                        report.gym_full_jsonl_bytes += len(encode_entry(entry)) + 1
                        report.full_tokens += len(full_prompt) + len(entry.generation_token_ids)
                    else:
                        report.gym_full_jsonl_bytes += len(encode_entry(entry)) + 1
                        report.full_tokens += len(entry.prompt_token_ids) + len(entry.generation_token_ids)
                if build.masked or problems:
                    report.masked += 1
                    shown = build.mask_reasons[:3] + (["..."] if len(build.mask_reasons) > 3 else [])
                    report.masked_reasons.append(f"{rollout_id}: {', '.join(shown) or 'masked'}")
                else:
                    report.trainable += 1
                if keep:
                    report.kept += 1
                elif export_dest is None and await builder.drop(rollout_id, snapshot.snapshot_id, snapshot.version):
                    report.dropped += 1
                progress.update(1)

        await asyncio.gather(*(one(r) for r in rollout_ids))
        if export_dest is not None:
            from s3capture.export import export

            summary = await export(url, export_dest, states=("frozen",), ids=rollout_ids, drop=True, workers=0)
            report.export_summary = summary
            report.dropped = summary.dropped
            # The export's own store sent the reads and drops: its requests are the builder's too.
            report.requests.update({f"export:{k}": v for k, v in summary.requests.items()})
        if not keep:
            await builder.delete(rollout_ids)
        report.requests.update({f"builder:{k}": v for k, v in builder.request_counts.items()})


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` over ``os.environ`` (the workers' endpoint and credentials) for the parent's own
    requests, restored afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _refuse_used_export_dest(url: str, dest: str, env: dict[str, str]) -> None:
    """Refuse a non-empty export destination before the capture, not after it: an export refuses a
    destination holding another source root's export, and every demo captures into a new root.

    A local folder: any file in it. An ``s3://bucket/prefix``: any object under ``prefix/`` but the
    prefix's own folder marker (one LIST of two keys, with the demo's endpoint and credentials,
    ``env`` over the environment), and a prefix that holds or lies inside ``url``'s rollouts
    (``s3capture.export``'s own check, before any request).

    Raises:
        ValueError: the destination is not empty, or holds the capture's rollouts.
        StoreError: the destination's bucket cannot be listed (missing, or no permission).
    """
    if "://" not in dest:
        if os.path.isdir(dest) and os.listdir(dest):
            raise ValueError(
                f"the export destination {dest!r} (--export) is not empty: the demo exports into a new or empty folder"
            )
        return
    from s3capture.export.driver import check_destination
    from s3capture.rollouts import parse_s3_url
    from s3capture.transport import configured_endpoint, make_transport

    check_destination(url, dest)
    bucket, prefix = parse_s3_url(dest)
    folder = f"{prefix}/" if prefix else ""

    async def first_key() -> str | None:
        transport = make_transport(None, bucket, endpoint_url=configured_endpoint(None), max_concurrency=1)
        try:
            page = await transport.list_page(folder, 2)
        finally:
            await transport.close()
        keys = [item.key for item in page.objects if item.key != folder]  # not the folder marker
        return keys[0] if keys else None

    with _environment(env):
        key = asyncio.run(first_key())
    if key is not None:
        raise ValueError(
            f"the export destination {dest!r} (--export) is not empty (it holds s3://{bucket}/{key}): the demo "
            "exports into a new or empty prefix"
        )


def run_workload(
    rollouts: list[ReplayRollout],
    url: str,
    env: dict[str, str],
    *,
    workers: int = 4,
    concurrency: int = 16,
    parallel_rollouts: int = 32,
    delta: bool = True,
    seed: int = 0,
    progress: bool = True,
    capture: str = "store",
    staging_url: str | None = None,
    manifest_hook: Callable[[dict], None] | None = None,
    export_dest: str | None = None,
    keep: bool = False,
    wall_started: float | None = None,
) -> DemoReport:
    """Replay ``rollouts`` through ``workers`` processes against ``url``; return the report.

    ``env`` is merged into each worker's environment (endpoint and credentials). Calls of one
    rollout run in order; up to ``parallel_rollouts`` rollouts are in flight at once.

    ``capture="store"`` puts whole token entries in an ``S3TokenStore`` (``delta``: RESOLVED calls
    store only their prompt suffix), then freezes, verifies and drops every rollout.
    ``capture="ledger"`` stages token deltas under ``staging_url`` (default: the sibling prefix
    ``<url>-staging``) and keeps only token-free rows in an ``S3CaptureLedger`` at ``url``, then
    checks each rollout's manifest (passed to ``manifest_hook`` when given), rebuilds every call
    from the staged deltas, retires the ledger and deletes the staged objects; the report is then
    a ``demo_ledger.LedgerDemoReport``. ``export_dest`` (``capture="store"`` only): export the
    frozen rollouts there as training trajectories (``s3capture.export``) before they are dropped;
    ``keep`` (``capture="store"`` only): freeze and verify, but leave every rollout frozen.

    ``progress``: progress on stderr, a redrawn bar on a terminal and plain lines (every 10 % or
    5 s) otherwise. The report's times (seconds): ``startup_seconds`` until every worker has opened
    and probed its store, ``seconds`` the capture alone, ``build_seconds`` the builder and
    ``wall_seconds`` from ``wall_started`` (a ``time.perf_counter()`` reading, e.g. the command's
    start; default: this call's start) to the end.
    """
    wall_started = time.perf_counter() if wall_started is None else wall_started
    from s3capture.store import parse_s3_url

    # Every argument is checked before any worker starts (a bad one would otherwise kill every worker).
    for name, value in (("workers", workers), ("concurrency", concurrency), ("parallel_rollouts", parallel_rollouts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if capture not in ("store", "ledger"):
        raise ValueError(f"capture must be 'store' or 'ledger', got {capture!r}")
    parse_s3_url(url)
    if staging_url is not None:
        if capture != "ledger":
            raise ValueError("staging_url applies only with capture='ledger'")
        parse_s3_url(staging_url)
    if export_dest is not None and capture != "store":
        raise ValueError("export_dest applies only with capture='store' (the ledger holds no token ids)")
    if export_dest is not None:
        _refuse_used_export_dest(url, export_dest, env)
    if keep and capture != "store":
        raise ValueError("keep applies only with capture='store'")
    if not any(r.calls for r in rollouts):
        raise ValueError(f"nothing to replay: {len(rollouts)} rollouts and no model call among them")

    if capture == "ledger":
        staging_url = staging_url or default_staging_url(url)
        report: DemoReport = LedgerDemoReport(capture=capture, staging_url=staging_url)

        def build(bar: Any) -> Coroutine[Any, Any, None]:
            assert isinstance(report, LedgerDemoReport)
            return build_ledger(url, staging_url, rollouts, report, bar, manifest_hook)

        build_desc = "manifest+verify+retire"
    else:
        report = DemoReport(capture=capture, url=url)

        def build(bar: Any) -> Coroutine[Any, Any, None]:
            return _build(url, [r.rollout_id for r in rollouts], report, bar, export_dest, keep)

        build_desc = "freeze+verify" if export_dest or keep else "freeze+verify+drop"
    report.rollouts, report.calls = len(rollouts), sum(len(r.calls) for r in rollouts)
    report.faithful = sum(max(0, len(r.calls) - 1) for r in rollouts)
    options = {"capture": capture, "delta": delta, "staging_url": staging_url}
    rng = random.Random(seed)
    report.workers = workers
    pool = _WorkerPool(workers, url, env, options, concurrency)
    by_id = {r.rollout_id: r for r in rollouts}
    waiting = collections.deque(r.rollout_id for r in rollouts if r.calls)
    done_rollouts: list[str] = [r.rollout_id for r in rollouts if not r.calls]

    def dispatch(rollout_id: str, index: int) -> None:
        worker = rng.randrange(workers)
        calls = by_id[rollout_id].calls
        expected_parent = calls[index - 1].model_call_id if index else None
        pool.send(worker, (rollout_id, calls[index], expected_parent))

    in_flight = 0
    bar: Any = None
    aborted = True
    try:
        startup_started = time.perf_counter()
        pool.start()  # raises at once when a worker cannot open or reach its store
        capture_started = time.perf_counter()
        report.startup_seconds = capture_started - startup_started
        bar = open_progress(report.calls, "model calls", "call", enabled=progress)
        while waiting and in_flight < parallel_rollouts:
            dispatch(waiting.popleft(), 0)
            in_flight += 1
        remaining = report.calls
        while remaining:
            kind, *payload = pool.get()  # raises at once when a worker fails or dies
            if kind != "call":
                continue
            result: CallResult = payload[0]
            remaining -= 1
            bar.update(1)
            rollout = by_id[result.rollout_id]
            if result.status == "error":
                report.errors.append(f"{result.rollout_id}#{result.index}: {result.error}")
            else:
                report.statuses[result.status] += 1
                report.resolve_ms.append(result.resolve_ms)
                if result.committed:
                    report.captured += 1
                    report.put_ms.append(result.put_ms)
                    if result.stage_ms:
                        report.stage_ms.append(result.stage_ms)
                if result.failure:
                    report.failures[result.failure] += 1
                if result.index > 0 and result.status == RESOLVED.value and result.parent_ok:
                    report.faithful_resolved += 1
                if result.status == "unresolved":
                    report.unresolved_reasons[result.reason] += 1
            if result.status != "error" and result.index + 1 < len(rollout.calls):
                dispatch(result.rollout_id, result.index + 1)
            else:
                remaining -= len(rollout.calls) - result.index - 1 if result.status == "error" else 0
                bar.update(len(rollout.calls) - result.index - 1 if result.status == "error" else 0)
                done_rollouts.append(result.rollout_id)
                in_flight -= 1
                if waiting:
                    dispatch(waiting.popleft(), 0)
                    in_flight += 1
        report.seconds = time.perf_counter() - capture_started
        aborted = False
    finally:
        if bar is not None:
            bar.close()
        pool.stop(abort=aborted)
        report.requests.update(pool.requests)
    if report.errors and not report.captured:
        first = report.errors[0].split(": ", 1)[-1].splitlines()[0]
        raise RuntimeError(f"every model call failed ({len(report.errors)} errors); the first: {first}")
    with _environment(env):
        build_bar = open_progress(len(rollouts), build_desc, "rollout", enabled=progress)
        build_started = time.perf_counter()
        asyncio.run(build(build_bar))
        report.build_seconds = time.perf_counter() - build_started
        build_bar.close()
    report.wall_seconds = time.perf_counter() - wall_started
    return report


def _per_token(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def storage_lines(report: DemoReport) -> list[str]:
    """What the run stored on S3, per token of the full sequences, against Gym's JSONL of the same calls.

    The first line is one sentence: bytes stored, tokens (every call's full prompt plus its
    generation, the sequences a trainer reads), bytes per token, and the ratio to Gym's JSONL of
    the same calls with full prompts. The second says what the bytes include and, when prompts were
    stored as deltas, the size of Gym's JSONL with delta prompts (``delta_records: true``).
    """
    if not report.full_tokens:
        return [f"  stored: {human_bytes(report.stored_bytes)} in {report.entry_objects} entry objects, no tokens"]
    per_token = report.stored_bytes / report.full_tokens
    gym_per_token = report.gym_full_jsonl_bytes / report.full_tokens
    ratio = f"{report.stored_bytes / report.gym_full_jsonl_bytes:.2f}x" if report.gym_full_jsonl_bytes else "n/a"
    lines = [
        f"  stored: {human_bytes(report.stored_bytes)} for {report.full_tokens:,} tokens: {_per_token(per_token)} bytes per token,"
        f" {ratio} Gym's JSONL of the same calls ({_per_token(gym_per_token)} bytes per token)",
    ]
    detail = (
        f"    ({report.stored_bytes:,} bytes in {report.entry_objects} entry objects, with intents, markers, fences"
        f" and delta checkpoints; tokens: every call's full prompt + generation"
    )
    if report.gym_jsonl_bytes != report.gym_full_jsonl_bytes:
        detail += f"; Gym's JSONL with delta prompts: {human_bytes(report.gym_jsonl_bytes)}"
    lines.append(detail + ")")
    return lines


def format_report(report: DemoReport, *, where: str) -> str:
    """Human-readable summary of a demo run (either capture mode)."""
    if report.capture == "ledger":
        assert isinstance(report, LedgerDemoReport)  # what capture="ledger" builds
        return format_ledger_report(report, where=where)
    if report.export_summary is not None:
        build_desc = "freeze+verify+export+drop"
    elif report.kept:
        build_desc = "freeze+verify (kept frozen)"
    else:
        build_desc = "freeze+verify+drop"
    lines = [
        f"s3capture demo against {where}",
        f"  rollouts {report.rollouts}, model calls {report.calls}",
        *timing_lines(report, build_desc),
        *resolution_lines(report),
        f"  snapshots: trainable {report.trainable}, masked {report.masked}; "
        + (
            f"kept frozen {report.kept}/{report.rollouts} (--keep: none dropped)"
            if report.kept
            else f"dropped after consumption {report.dropped}/{report.rollouts}"
        ),
        f"  chains checked {report.chains_checked}, broken {len(report.chains_broken)}",
        f"  put     latency: {percentiles(report.put_ms)}",
        f"  resolve latency: {percentiles(report.resolve_ms)}",
        *storage_lines(report),
    ]
    if report.kept:
        lines.append(
            f"  kept frozen (not dropped): {report.kept} rollouts; export them with: s3capture export {report.url} --out DEST"
        )
    summary = report.export_summary
    if summary is not None:
        lines.append(
            f"  exported to {summary.dest}: {summary.exported} rollouts, {summary.trajectories} trajectories,"
            f" {summary.tokens:,} tokens in {summary.shards_written} shard{'' if summary.shards_written == 1 else 's'}; masked {summary.masked_excluded},"
            f" failed {summary.failed}; dropped once durable {summary.dropped}"
        )
    problems = [f"  BROKEN CHAIN {item}" for item in report.chains_broken[:5]]
    problems += [f"  MASKED {item}" for item in report.masked_reasons[:5]]
    lines += closing_lines(report, problems)
    return "\n".join(lines)
