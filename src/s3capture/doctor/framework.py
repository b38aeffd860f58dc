"""The probe framework of ``s3capture doctor``: the report (``Probe``, ``DoctorReport``, ``PROBES``,
``VERDICTS``), the state and plumbing every probe uses (``_DoctorBase``: raw requests with their
``Date`` recorded, raw listings, timed requests) and the report as text (``format_report``)."""

from __future__ import annotations

import email.utils
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from s3capture.errors import StoreError
from s3capture.transport import Transport

VERDICTS = ("ok", "note", "fail")

PROBES = (
    "read-after-write",
    "list-after-write",
    "listing-order",
    "prefix",
    "pagination",
    "double-slash",
    "dot-segments",
    "transport-keys",
    "content-md5",
    "checksum-headers",
    "default-checksums",
    "etag-md5",
    "delete-objects",
    "conditional-write",
    "clock-skew",
    "latency",
    "cleanup",
)
"""The probes of a report, in report order."""


class Probe(msgspec.Struct, frozen=True):
    """One property probed: ``name`` (one of ``PROBES``), ``verdict`` (``"ok"``, ``"note"`` or
    ``"fail"``), ``detail`` (what was measured, one line), ``advice`` (what to change, or why
    nothing needs to; ``""`` when the verdict is ``ok``) and ``data`` (the measured values, JSON)."""

    name: str
    verdict: str
    detail: str
    advice: str = ""
    data: dict[str, Any] = {}


class DoctorReport(msgspec.Struct):
    """The result of ``diagnose``: the store probed and one ``Probe`` per property.

    ``transport`` is the transport the timed requests and ``transport-keys`` went through
    (``"aioboto3"`` or ``"obstore"``); ``probe_prefix`` the key prefix the throwaway objects were
    written under; ``left_behind`` the keys still listed under it after the clean-up (empty unless
    the ``cleanup`` probe failed).
    """

    url: str
    endpoint: str | None
    transport: str
    probe_prefix: str
    probes: list[Probe]
    left_behind: list[str] = []

    @property
    def ok(self) -> bool:
        """No probe failed."""
        return all(p.verdict != "fail" for p in self.probes)

    def probe(self, name: str) -> Probe:
        """The probe called ``name``; ``KeyError`` when the report has none."""
        for p in self.probes:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready builtins, with ``ok`` and verdict counts added."""
        data = msgspec.to_builtins(self)
        data["ok"] = self.ok
        data["counts"] = {v: sum(p.verdict == v for p in self.probes) for v in VERDICTS}
        return data


def _code(error: BaseException) -> str:
    response = getattr(error, "response", None) or {}
    return str(
        response.get("Error", {}).get("Code", "") or response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    )


def _status(error: BaseException) -> int:
    response = getattr(error, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 1))))
    return ordered[rank - 1]


class _DoctorBase:
    """One run's state and the plumbing its probes use; ``_Doctor`` (``s3capture.doctor.run``) adds
    the probes, one mixin per theme."""

    def __init__(
        self, transport: Transport, raw: Transport, root: str, samples: int, extra_client: Callable[[], Any]
    ) -> None:
        self.t = transport
        self.raw_t = raw
        """An aioboto3 transport (``transport`` itself when it is one): its client for raw requests."""
        self.bucket = transport.bucket
        self.root = root
        self.samples = samples
        self.extra_client = extra_client
        self.client: Any = None
        self.dates: list[tuple[float, float, float]] = []
        """(local time before, local time after, server Date) of raw answers."""
        self.latency: dict[str, list[float]] = {"PUT": [], "GET": [], "LIST": []}

    # ------------------------------------------------------------------ plumbing
    def _record_date(self, t0: float, t1: float, meta: dict) -> None:
        date = (meta.get("HTTPHeaders") or {}).get("date")
        if not date:
            return
        try:
            when = email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            return
        self.dates.append((t0, t1, when))

    async def raw(self, operation: str, **params: Any) -> dict:
        """One aiobotocore request (``operation`` is the client method name), Date recorded."""
        from botocore.exceptions import ClientError

        t0 = time.time()
        try:
            response = await getattr(self.client, operation)(Bucket=self.bucket, **params)
        except ClientError as error:
            self._record_date(t0, time.time(), (error.response or {}).get("ResponseMetadata", {}))
            raise
        self._record_date(t0, time.time(), response.get("ResponseMetadata", {}))
        return response

    async def raw_list(self, prefix: str, max_keys: int = 1000) -> list[str]:
        """Every key the store lists for ``prefix`` (all pages, unverified, in listing order)."""
        keys: list[str] = []
        token: str | None = None
        for _ in range(1000):
            params: dict[str, Any] = {"Prefix": prefix, "MaxKeys": max_keys}
            if token:
                params["ContinuationToken"] = token
            page = await self.raw("list_objects_v2", **params)
            keys.extend(item["Key"] for item in page.get("Contents", ()) or ())
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return keys
        raise StoreError(f"LIST {prefix!r} did not end after 1,000 pages", operation="LIST", key=prefix)

    async def timed(self, what: str, job: Awaitable[Any]) -> Any:
        start = time.perf_counter()
        result = await job
        self.latency[what].append(time.perf_counter() - start)
        return result

    def k(self, rel: str) -> str:
        return self.root + rel


def format_report(report: DoctorReport) -> str:
    """The report as a table (probe, verdict, detail), then the advice of every note and failure
    and a last line: ``verdict: OK`` or ``verdict: FAIL (<n> failed)``."""
    lines = [
        f"s3capture doctor: {report.url} on {report.endpoint or 'AWS S3'} "
        f"(transport: {report.transport}; probe prefix {report.probe_prefix})",
        "",
    ]
    width = max((len(p.name) for p in report.probes), default=10)
    lines.append(f"{'probe':<{width}}  verdict  detail")
    for p in report.probes:
        lines.append(f"{p.name:<{width}}  {p.verdict.upper():<7}  {p.detail}")
    advised = [p for p in report.probes if p.verdict != "ok" and p.advice]
    if advised:
        lines.append("")
        lines.append("advice:")
        for p in advised:
            lines.append(f"  {p.name} ({p.verdict}): {p.advice}")
    counts = {v: sum(p.verdict == v for p in report.probes) for v in VERDICTS}
    lines.append("")
    if report.ok:
        lines.append(f"verdict: OK ({counts['ok']} ok, {counts['note']} notes): s3capture can use this store")
    else:
        failed = ", ".join(p.name for p in report.probes if p.verdict == "fail")
        lines.append(f"verdict: FAIL ({counts['fail']} failed: {failed})")
    return "\n".join(lines)
