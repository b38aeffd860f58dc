"""The conformance suite's results and their text form.

``CheckResult`` (one check's outcome), ``ConformanceReport`` (every result, in suite order) and the
formatters the ``s3capture conformance`` command prints: ``format_result`` (one line per check),
``format_summary`` (the counts line) and ``format_report`` (the whole report).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``status`` is ``"passed"``, ``"failed"`` or ``"skipped"``."""

    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class ConformanceReport:
    """Every check's result, in suite order."""

    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> list[str]:
        return [r.name for r in self.results if r.status == "passed"]

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if r.status == "failed"]

    @property
    def skipped(self) -> list[str]:
        return [r.name for r in self.results if r.status == "skipped"]

    @property
    def ok(self) -> bool:
        """True when no check failed and at least one ran."""
        return not self.failed and bool(self.passed)


def format_result(result: CheckResult) -> str:
    """One report line: ``PASS|FAIL|SKIP  <name>  <seconds>  <detail>``."""
    mark = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[result.status]
    line = f"  {mark}  {result.name:<36} {result.seconds:6.2f} s"
    return f"{line}  {result.detail}" if result.detail else line


def format_summary(report: ConformanceReport) -> str:
    """The report's last line: counts, and ``NOT CONFORMANT`` when a check failed or none ran."""
    summary = f"{len(report.passed)} passed, {len(report.failed)} failed, {len(report.skipped)} skipped"
    return summary + ("" if report.ok else "  -- NOT CONFORMANT")


def format_report(report: ConformanceReport, *, where: str = "") -> str:
    """A human-readable report: a title, one line per check by name, then a summary line."""
    lines = [f"s3capture conformance{' against ' + where if where else ''}"]
    lines.extend(format_result(result) for result in report.results)
    lines.append(format_summary(report))
    return "\n".join(lines)
