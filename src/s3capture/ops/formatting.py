"""What ``s3capture ls``, ``status`` and ``gc`` print for people: ``ls`` rows (``LS_HEADER``,
``format_rollout_row``), the ``status`` report, ``gc`` lines and summary, and the byte, time and
age texts they share."""

from __future__ import annotations

import datetime

from s3capture.layout import escape_controls, printable_id
from s3capture.ops.gc_run import GcAction, GcReport
from s3capture.ops.status_report import StoreStatus
from s3capture.rollouts import RolloutInfo

# --------------------------------------------------------------------------- formatting
LS_HEADER = ("rollout_id", "state", "objects", "bytes", "last_write")
_LS_WIDTHS = (40, 8, 8, 12, 20)


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _stamp(value: datetime.datetime | None) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ") if value is not None else "-"


def format_rollout_row(info: RolloutInfo | None, *, table: bool) -> str:
    """One ``s3capture ls`` line (``None``: the header). ``table``: fixed-width columns with
    human-readable sizes (a terminal), the rollout id last so that ids of any length keep the
    columns aligned; otherwise tab-separated exact values in ``LS_HEADER`` order. An id with a
    control character is quoted (``s3capture.layout.printable_id``) so that it cannot split a row."""
    if info is None:
        cells = list(LS_HEADER)
    else:
        size = _human_bytes(info.bytes) if table else str(info.bytes)
        cells = [printable_id(info.rollout_id), info.state, str(info.objects), size, _stamp(info.last_write)]
    if not table:
        return "\t".join(cells)
    rid, state, objects, size, last = cells
    return "  ".join(
        [
            state.ljust(_LS_WIDTHS[1]),
            objects.rjust(_LS_WIDTHS[2]),
            size.rjust(_LS_WIDTHS[3]),
            last.ljust(_LS_WIDTHS[4]),
            rid,
        ]
    )


def _ago(seconds: float) -> str:
    """An age for people: ``"5.0m ago"``; a negative one (a write stamped after the listing's
    time: the clocks of the store's nodes disagree) says so instead of "0s ago"."""
    if seconds < 0:
        return f"{_duration(-seconds)} in the future by the store's clock: its nodes' clocks disagree"
    return f"{_duration(seconds)} ago"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def format_status(s: StoreStatus) -> str:
    """``StoreStatus`` as the lines ``s3capture status`` prints."""
    lines = [f"rollouts under {s.url}:"]
    for state, counts in s.states.items():
        lines.append(
            f"  {state:<8} {counts.rollouts:>8} rollouts  {counts.objects:>10} objects  {_human_bytes(counts.bytes):>12}"
        )
    if s.oldest_open is not None:
        o = s.oldest_open
        lines.append(
            f"oldest open rollout: {printable_id(o.rollout_id)} (last write {_stamp(o.last_write)}, {_ago(o.age_seconds)})"
        )
    else:
        lines.append("oldest open rollout: none")
    frozen = s.states["frozen"].rollouts
    if frozen:
        lines.append(
            f"frozen: {s.frozen_sealed} sealed, {s.frozen_changed} changed since freeze, "
            f"{s.frozen_without_manifest} without a manifest"
        )
        if not s.manifests_read:
            lines.append("newest manifests: not read (--no-manifests)")
        else:
            lines.append(
                f"newest manifests: {s.complete} complete"
                + (f" ({s.empty} of them empty: frozen with nothing written, which a builder masks)" if s.empty else "")
                + (
                    f" ({s.complete_changed} of them changed since that freeze: a later write, a marker "
                    "say, may mask them; a freeze or an export reads them again)"
                    if s.complete_changed
                    else ""
                )
                + f", {s.masked} masked, {s.manifest_errors} unreadable "
                "(complete: the snapshot masks nothing; the builder may still mask)"
            )
        for code, count in s.masked_by_reason.items():
            lines.append(f"  masked by {code}: {count}")
    retired = s.states["retired"].rollouts
    lines.append(
        f"retired leftovers: {_counted(s.retired_leftover_objects, 'object')} ({_human_bytes(s.retired_leftover_bytes)}) "
        f"for {_counted(retired, 'retired rollout')}"
        + ("; 's3capture gc' removes them" if s.retired_leftover_objects else "")
    )
    if s.bare_fences:
        lines.append(f"bare fences (an interrupted delete or gc): {s.bare_fences}")
    if s.unfinished_retires:
        lines.append(
            f"retired without a fence (a retire that did not finish; writers still take them for open): "
            f"{s.unfinished_retires}; retire or delete them again"
        )
    if s.dropping:
        lines.append(
            f"frozen with a drop deciding or crashed (a drop/ tombstone, no retire): {s.dropping}; "
            "markers on them are not acknowledged until a builder freezes and drops them again"
        )
    return "\n".join(lines)


def _counted(count: int, noun: str) -> str:
    """``1 object``, ``2 objects``, ``1,000 objects``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def format_action(action: GcAction, *, dry_run: bool) -> str:
    """One ``s3capture gc`` line per rollout."""
    verb = {
        "delete": "would delete" if dry_run else "deleted",
        "retire_again": "would retire again" if dry_run else "retired again",
        "delete_probes": "would delete the probes of" if dry_run else "deleted the probes of",
        "skipped": "skipped",
        "abandoned": "abandoned (kept)",
    }[action.action]
    keys = ", ".join(action.keys[:6]) + (f", ... ({len(action.keys)} keys)" if len(action.keys) > 6 else "")
    detail = f"{_counted(action.objects, 'object')}, {_human_bytes(action.bytes)}"
    where = f"; last write {_stamp(action.last_write)}" if action.last_write is not None else ""
    suffix = f": {keys}" if keys else ""
    return f"{verb} {printable_id(action.rollout_id)} ({detail}{where}; {escape_controls(action.reason)}){suffix}"


def format_gc(r: GcReport) -> str:
    """The summary line(s) of ``s3capture gc``."""
    mode = "dry run (nothing deleted; --yes deletes)" if r.dry_run else "done"
    would = "would remove" if r.dry_run else "removed"
    return "\n".join(
        [
            f"gc {r.url}: {mode}",
            f"  retired rollouts: {r.retired_seen} listed, {r.too_young} younger than {_duration(r.older_than)}",
            f"  {would} {_counted(r.deleted_objects, 'object')} ({_human_bytes(r.deleted_bytes)}): fences of "
            f"{_counted(r.deleted_rollouts, 'rollout')}, stragglers of {r.retired_again} (retired again, fence kept)"
            + (
                f", leftover listing probes under {r.deleted_probe_prefixes:,} otherwise empty rollout "
                f"prefix{'' if r.deleted_probe_prefixes == 1 else 'es'}"
                if r.deleted_probe_prefixes
                else ""
            ),
            f"  skipped (changed since the listing): {r.skipped}",
            *(
                [
                    f"  skipped (a retire that did not finish: tombstone, no fence; retire or delete them): "
                    f"{r.unfinished}"
                ]
                if r.unfinished
                else []
            ),
            f"  abandoned open rollouts (quiet > {_duration(r.abandoned_after)}, not deleted): {r.abandoned} "
            f"({_human_bytes(r.abandoned_bytes)})",
        ]
    )
