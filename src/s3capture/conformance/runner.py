"""The conformance suite's runner: the ordered check list and the entry points that run it.

``CHECKS`` (every check in suite order, with the parts it needs), ``run_conformance`` (any
factories; one ``CheckResult`` per check, cleanup after each) and ``run_s3_conformance``
(``S3TokenStore`` and ``S3CaptureLedger`` on a bucket, behind ``s3capture conformance``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from s3capture.conformance.checks_ledger import (
    ledger_begin_call_custody,
    ledger_conflicting_record,
    ledger_delete_reuse,
    ledger_failure_rows,
    ledger_idempotent_record,
    ledger_record_visibility,
    ledger_retire,
    ledger_unused_rollout,
)
from s3capture.conformance.checks_lineage import (
    fresh_client_lineage_visibility,
    lineage_visibility,
    resolver_conflict_zero_candidates,
)
from s3capture.conformance.checks_shapes import protocol_shapes_and_install
from s3capture.conformance.checks_sink_source import (
    begin_call_custody,
    conditional_retirement,
    conflicting_reput,
    freeze_idempotency,
    frozen_error_on_late_put,
    idempotent_reput,
    mark_incomplete_after_retire,
    mark_incomplete_durability,
    post_freeze_write_safety,
    put_then_freeze_visibility,
    source_delete_reuse,
    source_retire_fences_late_put,
    source_retire_idempotent,
)
from s3capture.conformance.framework import ConformanceError, Factory, _Ctx, _Skip, _Suite
from s3capture.conformance.report import CheckResult, ConformanceReport


# name, needs, function. needs: letters s(ink) o(source) r(esolver) l(edger)
CHECKS: list[tuple[str, str, Callable[[_Ctx], Awaitable[None]]]] = [
    ("put_then_freeze_visibility", "so", put_then_freeze_visibility),
    ("idempotent_reput", "so", idempotent_reput),
    ("conflicting_reput", "so", conflicting_reput),
    ("mark_incomplete_durability", "so", mark_incomplete_durability),
    ("freeze_idempotency", "so", freeze_idempotency),
    ("post_freeze_write_safety", "so", post_freeze_write_safety),
    ("conditional_retirement", "so", conditional_retirement),
    ("lineage_visibility", "sr", lineage_visibility),
    ("fresh_client_lineage_visibility", "sr", fresh_client_lineage_visibility),
    ("begin_call_custody", "so", begin_call_custody),
    ("frozen_error_on_late_put", "so", frozen_error_on_late_put),
    ("source_retire_fences_late_put", "so", source_retire_fences_late_put),
    ("source_retire_idempotent", "so", source_retire_idempotent),
    ("mark_incomplete_after_retire", "so", mark_incomplete_after_retire),
    ("source_delete_reuse", "so", source_delete_reuse),
    ("resolver_conflict_zero_candidates", "sr", resolver_conflict_zero_candidates),
    ("ledger_record_visibility", "l", ledger_record_visibility),
    ("ledger_idempotent_record", "l", ledger_idempotent_record),
    ("ledger_conflicting_record", "l", ledger_conflicting_record),
    ("ledger_failure_rows", "l", ledger_failure_rows),
    ("ledger_begin_call_custody", "l", ledger_begin_call_custody),
    ("ledger_unused_rollout", "l", ledger_unused_rollout),
    ("ledger_retire", "l", ledger_retire),
    ("ledger_delete_reuse", "l", ledger_delete_reuse),
    ("protocol_shapes_and_install", "", protocol_shapes_and_install),
]
"""Every check in suite order: ``(name, parts needed, check)``; the first ten are Gym 0.7.0's."""


async def run_conformance(
    *,
    sink_factory: Factory | None = None,
    source_factory: Factory | None = None,
    resolver_factory: Factory | None = None,
    ledger_factory: Factory | None = None,
    only: Sequence[str] | None = None,
    rollout_prefix: str = "conformance",
    entry_type: str = "s3capture",
    progress: Callable[[CheckResult], None] | None = None,
) -> ConformanceReport:
    """Run every check whose parts are given; return a report (never raises for a failed check).

    Parameters:
        sink_factory, source_factory, resolver_factory, ledger_factory: zero-argument callables
            returning a FRESH client (or an awaitable of one) over one shared backend.
        only: names of checks to run (``CHECKS``); ``ValueError`` for an unknown name.
        rollout_prefix: rollout ids are ``<rollout_prefix>-<check>-<random>``.
        entry_type: ``"s3capture"`` hands the clients s3capture's ``TokenEntry`` and
            ``CaptureLedgerCommit``; ``"gym"`` hands NeMo Gym's pydantic models (requires nemo_gym).
        progress: called with each ``CheckResult`` as it completes.
    """
    if entry_type not in ("s3capture", "gym"):
        raise ValueError(f"entry_type must be 's3capture' or 'gym', got {entry_type!r}")
    names = [name for name, _, _ in CHECKS]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise ValueError(f"unknown conformance checks {unknown}; known: {', '.join(names)}")
    suite = _Suite(sink_factory, source_factory, resolver_factory, ledger_factory, rollout_prefix, entry_type)
    parts = {"s": sink_factory, "o": source_factory, "r": resolver_factory, "l": ledger_factory}
    labels = {"s": "sink", "o": "source", "r": "resolver", "l": "ledger"}
    report = ConformanceReport()
    for name, needs, check in CHECKS:
        if only and name not in only:
            continue
        missing = [labels[p] for p in needs if parts[p] is None]
        if missing:
            result = CheckResult(name, "skipped", f"no {' or '.join(missing)} factory given")
        else:
            result = await _run_one(suite, name, check)
        report.results.append(result)
        if progress is not None:
            progress(result)
    return report


async def _run_one(suite: _Suite, name: str, check: Callable[[_Ctx], Awaitable[None]]) -> CheckResult:
    ctx = _Ctx(suite, name)
    started = time.monotonic()
    try:
        await check(ctx)
        status, detail = "passed", ""
    except _Skip as skip:
        status, detail = "skipped", str(skip)
    except ConformanceError as error:
        status, detail = "failed", error.detail
    except Exception as error:  # noqa: BLE001 - a raising backend is a failed check, not a crash
        status, detail = "failed", f"unexpected {type(error).__name__}: {error}"
    finally:
        # Shielded: a Ctrl-C that lands while a check cleans up (or as it starts to) left the
        # check's rollouts in the bucket (2026-12-03); it now waits for the cleanup, then ends
        # the run. A second Ctrl-C still stops at once.
        finishing = asyncio.ensure_future(_finish(ctx))
        try:
            await asyncio.shield(finishing)
        except asyncio.CancelledError:
            await asyncio.wait([finishing], timeout=_CLEANUP_SECONDS)
            raise
    return CheckResult(name, status, detail, time.monotonic() - started)


_CLEANUP_SECONDS = 60.0
"""How long an interrupted check waits for its cleanup."""


async def _finish(ctx: _Ctx) -> None:
    """Close the check's clients, then delete its rollouts with a fresh one: the check's clients
    first, so that none of their requests is still in flight when the cleanup lists and deletes."""
    await ctx.close()
    ctx.opened.clear()
    await _cleanup(ctx)
    await ctx.close()


async def _cleanup(ctx: _Ctx) -> None:
    """Delete the check's rollouts where a client offers ``delete`` (best effort)."""
    for factory, rollouts in (
        (ctx.suite.source_factory, ctx.rollouts),
        (ctx.suite.ledger_factory, ctx.ledger_rollouts),
    ):
        if factory is None or not rollouts:
            continue
        try:
            client = await ctx._open(factory)
            if getattr(client, "delete", None) is not None:
                await client.delete(list(rollouts))
        except Exception:  # noqa: BLE001 - cleanup never changes a verdict
            pass


async def run_s3_conformance(
    url: str,
    *,
    endpoint_url: str | None = None,
    only: Sequence[str] | None = None,
    fence_grace: float = 1.0,
    progress: Callable[[CheckResult], None] | None = None,
) -> ConformanceReport:
    """Run the whole suite against ``S3TokenStore`` and ``S3CaptureLedger`` on ``url`` (needs aioboto3).

    Raises ``StoreError`` before any check when the bucket is missing or access is refused.

    Every factory call builds a new client with its own HTTP connection pool, caches and state;
    they share one ``aioboto3.Session`` (the credential chain and service model, ~0.1 s to load).
    Credentials come from the standard AWS chain; ``endpoint_url`` defaults to ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``.
    """
    import aioboto3

    from s3capture.ledger import S3CaptureLedger
    from s3capture.store import S3TokenStore

    session = aioboto3.Session()

    def store() -> Any:
        return S3TokenStore(url, endpoint_url=endpoint_url, fence_grace=fence_grace, session=session)

    def ledger() -> Any:
        return S3CaptureLedger(url, endpoint_url=endpoint_url, session=session)

    # A missing bucket or refused credentials is one clear StoreError, not every check failing.
    probe = store()
    try:
        await probe._list(probe.layout.root + "rollouts/conformance-")
    finally:
        await probe.close()
    return await run_conformance(
        sink_factory=store,
        source_factory=store,
        resolver_factory=store,
        ledger_factory=ledger,
        only=only,
        rollout_prefix=f"conformance-{uuid.uuid4().hex[:6]}",
        progress=progress,
    )
