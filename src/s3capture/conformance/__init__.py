"""s3capture's conformance suite: every contract of the token-capture protocol reference.

Source of the contracts: ``shared/spec/protocols-reference.txt`` (``TokenSink``, ``TokenSource``,
``LineageResolver``, ``CaptureLedger``, the frozen and retired errors, the install functions).
NeMo Gym 0.7.0's ``nemo_gym.token_id_capture.conformance`` has ten checks and predates ``retire``,
``delete``, ``TokenCaptureRetiredError``, ``RolloutRetiredError`` and the ledger; this suite keeps
its ten checks (same names) and adds the rest. ``docs/conformance.md`` lists every check, and which
of them Gym's own reference stores pass.

Usage (a library call; importable without aioboto3 or NeMo Gym)::

    report = await run_conformance(
        sink_factory=lambda: MySink(...),         # each factory returns a FRESH client
        source_factory=lambda: MySource(...),     # over the same shared backend
        resolver_factory=lambda: MyResolver(...),
        ledger_factory=lambda: MyLedger(...),
    )
    print(format_report(report))
    assert report.ok, report.failed

or from a shell against a real bucket: ``s3capture conformance s3://bucket/prefix``.

Every factory is optional: checks whose parts are missing are reported as skipped. A factory may
return the client or an awaitable of it. Each check gets its own rollout ids (``<prefix>-<check>-
<random>``) and fresh clients, closes every client it opened, and deletes its rollouts afterwards
when a source or ledger offers ``delete``. A failure names the check and what was observed; an
unexpected exception is a failure of that check, never a crash of the suite.

The suite is a package: ``framework`` (per-check context and shared helpers), ``checks_sink_source``,
``checks_lineage``, ``checks_ledger`` and ``checks_shapes`` (the checks, by protocol), ``runner``
(``CHECKS``, ``run_conformance``, ``run_s3_conformance``) and ``report`` (results and their text form).
Every public name is importable from ``s3capture.conformance`` itself.
"""

from __future__ import annotations

from s3capture.conformance.checks_ledger import (
    ledger_begin_call_custody as ledger_begin_call_custody,
    ledger_conflicting_record as ledger_conflicting_record,
    ledger_delete_reuse as ledger_delete_reuse,
    ledger_failure_rows as ledger_failure_rows,
    ledger_idempotent_record as ledger_idempotent_record,
    ledger_record_visibility as ledger_record_visibility,
    ledger_retire as ledger_retire,
    ledger_unused_rollout as ledger_unused_rollout,
)
from s3capture.conformance.checks_lineage import (
    fresh_client_lineage_visibility as fresh_client_lineage_visibility,
    lineage_visibility as lineage_visibility,
    resolver_conflict_zero_candidates as resolver_conflict_zero_candidates,
)
from s3capture.conformance.checks_shapes import protocol_shapes_and_install as protocol_shapes_and_install
from s3capture.conformance.checks_sink_source import (
    begin_call_custody as begin_call_custody,
    conditional_retirement as conditional_retirement,
    conflicting_reput as conflicting_reput,
    freeze_idempotency as freeze_idempotency,
    frozen_error_on_late_put as frozen_error_on_late_put,
    idempotent_reput as idempotent_reput,
    mark_incomplete_after_retire as mark_incomplete_after_retire,
    mark_incomplete_durability as mark_incomplete_durability,
    post_freeze_write_safety as post_freeze_write_safety,
    put_then_freeze_visibility as put_then_freeze_visibility,
    source_delete_reuse as source_delete_reuse,
    source_retire_fences_late_put as source_retire_fences_late_put,
    source_retire_idempotent as source_retire_idempotent,
)
from s3capture.conformance.framework import (
    RESOLVED as RESOLVED,
    ROOT as ROOT,
    UNRESOLVED as UNRESOLVED,
    ConformanceError,
    Factory as Factory,
)
from s3capture.conformance.report import (
    CheckResult,
    ConformanceReport,
    format_report,
    format_result,
    format_summary,
)
from s3capture.conformance.runner import CHECKS, run_conformance, run_s3_conformance

__all__ = [
    "CheckResult",
    "ConformanceReport",
    "ConformanceError",
    "CHECKS",
    "run_conformance",
    "format_report",
    "format_result",
    "format_summary",
    "run_s3_conformance",
]
