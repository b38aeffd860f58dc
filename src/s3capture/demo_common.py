"""What both capture modes of ``s3capture demo`` share: results, the report, progress and report lines.

``s3capture.demo`` (the workload, the token-store mode) and ``s3capture.demo_ledger`` (the ledger
mode) both import this module; it imports neither of them, and ``demo_ledger`` does not import
``demo``, so the three form no import cycle (``demo`` -> ``demo_ledger`` -> ``demo_common``).
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = [
    "CallResult",
    "DemoReport",
    "PlainProgress",
    "closing_lines",
    "human_bytes",
    "open_progress",
    "percentiles",
    "probe_store",
    "resolution_lines",
    "timing_lines",
]


@dataclass
class CallResult:
    """One served model call, as a worker reports it to the coordinator (times in milliseconds)."""

    rollout_id: str
    index: int
    worker: int
    status: str
    reason: str
    parent_ok: bool
    resolve_ms: float
    put_ms: float
    error: str = ""
    committed: bool = True
    """False when the call left no committed record (ledger mode: a failure row instead)."""
    failure: str = ""
    """The failure row's reason when the call was not committed (ledger mode)."""
    stage_ms: float = 0.0
    """Time to stage the token delta outside the store (ledger mode)."""


@dataclass
class DemoReport:
    """What a demo run did; ``ok`` is True when every acceptance condition held.

    Times, in seconds of wall time: ``startup_seconds`` spawning the worker processes until every
    one has opened its store and probed it; ``seconds`` the capture itself (first call sent to last
    call answered); ``build_seconds`` the trajectory builder; ``wall_seconds`` the whole run, from
    ``run_workload``'s ``wall_started`` (the command's start) to the end of the builder, so it also
    counts loading the input, the embedded server's start and stopping the workers.
    """

    capture: str = "store"
    url: str = ""
    rollouts: int = 0
    calls: int = 0
    captured: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    faithful: int = 0
    faithful_resolved: int = 0
    unresolved_reasons: collections.Counter = field(default_factory=collections.Counter)
    trainable: int = 0
    masked: int = 0
    masked_reasons: list[str] = field(default_factory=list)
    chains_checked: int = 0
    chains_broken: list[str] = field(default_factory=list)
    dropped: int = 0
    requests: collections.Counter = field(default_factory=collections.Counter)
    resolve_ms: list[float] = field(default_factory=list)
    put_ms: list[float] = field(default_factory=list)
    stage_ms: list[float] = field(default_factory=list)
    failures: collections.Counter = field(default_factory=collections.Counter)
    stored_bytes: int = 0
    entry_objects: int = 0
    gym_jsonl_bytes: int = 0
    gym_full_jsonl_bytes: int = 0
    tokens: int = 0
    full_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    workers: int = 0
    startup_seconds: float = 0.0
    seconds: float = 0.0
    """Capture time only (worker start-up excluded)."""
    build_seconds: float = 0.0
    wall_seconds: float = 0.0
    export_summary: Any = None
    """The ``ExportSummary`` of ``--export`` (None without it)."""
    kept: int = 0
    """Rollouts left frozen for a later export (``--keep``)."""

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and self.faithful_resolved == self.faithful
            and self.masked == 0
            and not self.chains_broken
            and self.dropped + self.kept == self.rollouts
            and (
                self.export_summary is None
                or (self.export_summary.exported == self.rollouts and not self.export_summary.failed)
            )
        )


def percentiles(values: list[float]) -> str:
    """``"p50 … ms  p90 … ms  p99 … ms  max … ms"`` of latencies in milliseconds; ``"n/a"`` when empty."""
    if not values:
        return "n/a"
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return f"p50 {pick(0.5):.1f} ms  p90 {pick(0.9):.1f} ms  p99 {pick(0.99):.1f} ms  max {ordered[-1]:.1f} ms"


def human_bytes(n: int) -> str:
    """``n`` bytes in decimal units with one decimal: ``812 bytes``, ``4.1 kB``, ``1.2 MB``, ``3.0 GB``."""
    if n < 1000:
        return f"{n} bytes"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 999.95 or unit == "TB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def timing_lines(report: DemoReport, build_desc: str, *, what: str = "captured") -> list[str]:
    """The report's time lines: worker start-up, capture (with its throughput), the builder and total wall time.

    Throughput is over capture time only: the worker start-up is reported on its own line.
    """
    rate = f"{report.captured / report.seconds:,.1f} calls/s" if report.seconds > 0 else "n/a calls/s"
    if report.full_tokens and report.seconds > 0:
        rate += f", {report.full_tokens / report.seconds:,.0f} tokens/s of the full sequences"
    return [
        f"  start-up: {report.startup_seconds:.1f} s ({report.workers} worker processes spawned, each opened and probed its store)",
        f"  capture: {what} {report.captured} of {report.calls} model calls in {report.seconds:.1f} s ({rate})",
        f"  {build_desc}: {report.build_seconds:.1f} s",
        f"  total wall time: {report.wall_seconds:.1f} s (from the start of the run to this report)",
    ]


def resolution_lines(report: DemoReport) -> list[str]:
    """The report lines on parent resolution, shared by both capture modes."""
    s = report.statuses
    return [
        f"  parent resolution: ROOT {s['root']}, RESOLVED {s['resolved']}, UNRESOLVED {s['unresolved']}"
        + (f" (reasons: {dict(report.unresolved_reasons)})" if report.unresolved_reasons else ""),
        f"  faithful continuations RESOLVED to the right parent: {report.faithful_resolved}/{report.faithful}",
    ]


def closing_lines(report: DemoReport, problems: list[str]) -> list[str]:
    """The S3 request counts, up to five of each kind of problem, errors and the verdict."""
    lines = ["  S3 requests: " + ", ".join(f"{k} {v}" for k, v in sorted(report.requests.items()))]
    lines.extend(problems)
    for item in report.errors[:5]:
        lines.append(f"  ERROR {item.strip()}")
    lines.append("  result: " + ("OK" if report.ok else "FAILED"))
    return lines


async def probe_store(url: str) -> None:
    """One LIST under ``url`` (a key prefix nothing uses), with at most two attempts.

    A worker's start-up check: an unreachable endpoint, missing credentials, refused credentials or
    a missing bucket fail here, once and within seconds, instead of in every model call after
    botocore's five attempts each. Raises ``StoreError`` (or ``ValueError`` for a bad URL).
    """
    from s3capture.store import S3TokenStore, default_botocore_config
    from s3capture.transport import configured_endpoint

    endpoint = configured_endpoint()
    extra = {"s3": {"addressing_style": "path"}} if endpoint else {}
    config = default_botocore_config(10, retries={"mode": "standard", "max_attempts": 2}, **extra)
    from s3capture.transport import connect_log

    probe = S3TokenStore(url, botocore_config=config)
    level = connect_log.level
    connect_log.setLevel(logging.ERROR)  # this probe's own error says it, once per run
    try:
        await probe._list(probe.layout.root + ".s3capture-demo-probe")
    finally:
        connect_log.setLevel(level)
        await probe.close()


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class PlainProgress:
    """Progress as plain lines, for a stderr that is not a terminal (a log file, a CI console).

    Writes ``"<desc>: <done>/<total> <unit>s (<pct>%), <elapsed> s"`` when the count crosses each
    further ``step`` of the total (default 10 %) or ``every`` seconds (default 5) after the last
    line, whichever comes first, and once more at ``close`` if the last count was not written. No
    carriage returns, no redraws: one complete line each time. ``clock`` returns seconds
    (``time.monotonic`` by default; tests pass their own).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str,
        stream: TextIO,
        *,
        every: float = 5.0,
        step: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total!r}")
        if every <= 0 or not 0 < step <= 1:
            raise ValueError(f"every must be > 0 and step in (0, 1], got every={every!r}, step={step!r}")
        self.total, self.desc, self.unit, self.stream = total, desc, unit, stream
        self.every, self.step, self.clock = every, step, clock
        self.count = 0
        self._started = self._last_time = clock()
        self._last_count = 0
        self._closed = False

    def _step_of(self, count: int) -> int:
        """How many whole ``step`` fractions of the total ``count`` has reached."""
        return int(count / (self.step * self.total) + 1e-9) if self.total else count

    def _write(self) -> None:
        now = self.clock()
        percent = f" ({100 * self.count / self.total:.0f}%)" if self.total else ""
        self.stream.write(
            f"{self.desc}: {self.count:,}/{self.total:,} {self.unit}s{percent}, {now - self._started:.1f} s\n"
        )
        self.stream.flush()
        self._last_time, self._last_count = now, self.count

    def update(self, n: int = 1) -> None:
        if n <= 0 or self._closed:
            return
        self.count += n
        if self._step_of(self.count) > self._step_of(self._last_count) or self.clock() - self._last_time >= self.every:
            self._write()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.count != self._last_count or self.count == 0:
            self._write()


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def open_progress(total: int, desc: str, unit: str, *, enabled: bool = True, stream: TextIO | None = None) -> Any:
    """A progress reporter with ``update(n)`` and ``close()`` on ``stream`` (default: ``sys.stderr``).

    Disabled: does nothing. On a terminal: a redrawn ``tqdm`` bar. Otherwise (stderr redirected to a
    file or a pipe): a ``PlainProgress``, complete lines every 10 % or 5 s, so logs get no redraws.
    """
    if not enabled:
        return _NoProgress()
    stream = sys.stderr if stream is None else stream
    if _is_tty(stream):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream)
    return PlainProgress(total, desc, unit, stream)
