"""What an export shows: its progress while it runs (``_Progress``: a tqdm bar on a TTY, else a
line every few seconds), the shard results counted into its ``ExportSummary`` (``_account``) and
the human-readable summary printed at the end (``format_summary``)."""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Any

from s3capture.export.records import ExportSummary, ShardResult, _note, _reason_class
from s3capture.layout import escape_controls
from s3capture.ops import roots_hint


# --------------------------------------------------------------------------- progress
class _Progress:
    """A tqdm bar on a TTY, else a plain line every ``interval`` seconds (and none when disabled)."""

    def __init__(self, enabled: bool, *, stream: Any = None, interval: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = interval
        self.lock = threading.Lock()
        self.rollouts = self.trajectories = self.tokens = self.bytes = 0
        self.total = 0
        self.listing_done = False
        self.started = time.monotonic()
        self.last_line = self.started
        self.first: tuple[float, int] | None = None
        """When the first rollouts were done, and how many: the ETA's rate counts from there, not
        from the start (starting worker processes or a Ray runtime takes seconds)."""
        self.bar: Any = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=0, desc="export", unit="rollout", file=self.stream, dynamic_ncols=True)

    def add(self, item: tuple[int, int, int, int]) -> None:
        rollouts, trajectories, tokens, size = item
        with self.lock:
            self.rollouts += rollouts
            if self.first is None:
                self.first = (time.monotonic(), self.rollouts)
            self.trajectories += trajectories
            self.tokens += tokens
            self.bytes += size
            self._render(rollouts)

    def planned(self, count: int, *, done: bool = False) -> None:
        with self.lock:
            self.total += count
            self.listing_done = self.listing_done or done
            if self.bar is not None:
                self.bar.total = self.total
                self.bar.refresh()

    def _rate(self) -> float:
        return self.bytes / 1e6 / max(1e-9, time.monotonic() - self.started)

    def _render(self, advanced: int) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"{self.trajectories:,} traj, {self.tokens / 1e6:.1f}M tok, {self._rate():.1f} MB/s", refresh=False
            )
            self.bar.update(advanced)
            return
        now = time.monotonic()
        if now - self.last_line >= self.interval:
            self.last_line = now
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        eta = "?"
        if self.listing_done and self.first is not None and self.rollouts > self.first[1]:
            since, counted = self.first
            rate = (self.rollouts - counted) / max(1e-9, time.monotonic() - since)
            eta = f"{(self.total - self.rollouts) / rate:.0f}s"
        total = f"{self.total:,}" if self.listing_done else f"{self.total:,}+"
        return (
            f"export: {self.rollouts:,}/{total} rollouts, {self.trajectories:,} trajectories, "
            f"{self.tokens:,} tokens, {self._rate():.1f} MB/s, {elapsed:.0f}s elapsed, ETA {eta}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.rollouts:
            self.stream.write(self.line() + "\n")
            self.stream.flush()


# --------------------------------------------------------------------------- the summary
def _account(summary: ExportSummary, result: ShardResult, requests: collections.Counter) -> None:
    requests.update(result.requests)
    if result.error:
        summary.shards_failed += 1
    elif result.manifest:
        summary.shards_written += 1
        if result.data:
            summary.data_files += 1
    for rid, reason in result.skipped:
        summary.skipped += 1
        _note(summary.skipped_reasons, summary.skipped_examples, rid, reason)
    for rid, reason in result.failed:
        summary.failed += 1
        _note(summary.failed_reasons, summary.failed_examples, rid, reason)
    if result.error:
        return
    for record in result.records:
        if record.masked:
            for reason in record.mask_reasons or ["masked"]:
                kind = _reason_class(reason)
                summary.masked_reasons[kind] = summary.masked_reasons.get(kind, 0) + 1
            if record.written:
                summary.masked_written += 1
            else:
                summary.masked_excluded += 1
        else:
            summary.exported += 1
    summary.trajectories += result.rows
    summary.tokens += result.tokens
    for rid, count in result.clipped:
        summary.logprobs_clipped += count
        if len(summary.clipped_examples) < 20:
            summary.clipped_examples.append(f"{rid}: {count}")
    summary.bytes_read += result.bytes_read
    summary.bytes_written += result.bytes_written


def _size(nbytes: float) -> str:
    """``nbytes`` in MB with one decimal, or in kB under 1 MB (a small export is not "0.0 MB")."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} kB"


def _not_selected(s: ExportSummary) -> list[str]:
    lines = []
    for state, count in sorted(s.not_selected.items()):
        why = " (dropped or retired: their entries are gone)" if state == "retired" else ""
        lines.append(f"{count:,} {state} rollouts were not selected{why}")
    return lines


def _prefix_matched_nothing(s: ExportSummary) -> list[str]:
    """The line for a ``--prefix`` no rollout id starts with, in a root that holds rollouts: a
    mistyped prefix read like a finished, empty export (a breaker, 2026-12-04)."""
    if s.id_prefix and not s.listed and not s.not_selected and not s.root_empty:
        return [
            f"no rollout id under {s.source} starts with --prefix {escape_controls(repr(s.id_prefix))}, "
            "though the root holds rollouts (s3capture ls lists their ids)"
        ]
    return []


def format_summary(summary: ExportSummary) -> str:
    """The human-readable summary ``s3capture export`` prints at the end."""
    s = summary
    mb = s.bytes_read / 1e6
    rate = mb / s.wall_seconds if s.wall_seconds else 0.0
    lines = [
        f"export {s.source} -> {s.dest} ({s.format})",
        f"rollouts: exported {s.exported:,}, masked {s.masked_written + s.masked_excluded:,} "
        f"({s.masked_written:,} written with masked=true, {s.masked_excluded:,} left out), "
        f"already exported {s.already_exported:,}"
        + (f" ({s.already_left_out:,} of them masked and left out: no rows)" if s.already_left_out else "")
        + f", changed since their export {s.changed_since_export:,}, skipped {s.skipped:,}, failed {s.failed:,}",
        f"written: {s.trajectories:,} {'trajectory' if s.trajectories == 1 else 'trajectories'}"
        # --masked include: a masked rollout's rows (a placeholder row when it has no calls) are
        # counted too, and are not training data (a walkthrough read "6 trajectories, 0 tokens").
        + (f" (with the masked=true rows of {s.masked_written:,} rollouts)" if s.masked_written else "")
        + f", {s.tokens:,} tokens, {s.shards_written:,} shard{'' if s.shards_written == 1 else 's'} "
        f"({_size(s.bytes_written)}{'; manifests only, no data file' if s.shards_written and not s.trajectories else ''}); "
        f"read {_size(s.bytes_read)} ({rate:.2f} MB/s)",
    ]
    if s.shards_existing or s.orphans_removed:
        lines.append(
            f"destination: {s.shards_existing:,} durable shard{'' if s.shards_existing == 1 else 's'} found; "
            f"{s.orphans_removed:,} unfinished file{'' if s.orphans_removed == 1 else 's'} removed"
        )
    for title, counts in (("masked", s.masked_reasons), ("skipped", s.skipped_reasons), ("failed", s.failed_reasons)):
        if counts:
            # counted by reason class (``roots`` for ``roots:2``): "roots 1" read as "one root"
            lines.append(
                f"{title} rollouts by reason class (a rollout may have several): "
                + ", ".join(f"{k}: {v:,}" for k, v in sorted(counts.items()))
            )
    # Example lines name rollout ids, which may hold control characters: escaped, one line each.
    for title, examples in (("skipped", s.skipped_examples), ("failed", s.failed_examples)):
        for _, kept in sorted(examples.items()):
            lines.extend(f"  {title} {escape_controls(line)}" for line in kept[:3])
    if s.changed_since_export:
        lines.extend(f"  changed {escape_controls(line)}" for line in s.changed_examples[:3])
    if s.logprobs_clipped:
        lines.append(
            f"log probabilities beyond float32's range, written as its nearest finite value: {s.logprobs_clipped:,} "
            "(--format gym-jsonl keeps them)"
        )
        lines.extend(f"  clipped {escape_controls(line)}" for line in s.clipped_examples[:3])
    if s.dropped or s.drop_failed or s.not_dropped:
        lines.append(
            f"dropped: {s.dropped:,}; drop failed (evidence kept): {s.drop_failed:,}; not dropped: {s.not_dropped:,}"
        )
        lines.extend(f"  {escape_controls(line)}" for line in (s.drop_failed_examples[:3] + s.not_dropped_examples[:3]))
    if s.shards_failed:
        lines.append(f"shards failed: {s.shards_failed:,} (their rollouts are counted failed; a re-run retries them)")
    if not s.data_files and not s.shards_failed:
        # Reading such a folder fails in pyarrow ("No match for FieldRef.Name(masked)"): say why.
        hints = []
        waiting = s.skipped_reasons.get("not_quiescent", 0)
        if waiting:
            hints.append(
                f"{waiting:,} open {'rollout has' if waiting == 1 else 'rollouts have'} not been quiet for "
                f"--min-age: --min-age 0 takes {'it' if waiting == 1 else 'them'} now (with --freeze "
                f"{'it is' if waiting == 1 else 'they are'} frozen first, and a write still coming to "
                f"{'it' if waiting == 1 else 'one of them'} fails)"
            )
        if s.masked_excluded:
            were = "rollout was" if s.masked_excluded == 1 else "rollouts were"
            hints.append(f"{s.masked_excluded:,} masked {were} left out: --masked include writes them too")
        hints.extend(_not_selected(s))
        hints.extend(_prefix_matched_nothing(s))
        if s.root_empty:
            where = f"no rollouts under {s.source} (no rollout under its rollouts/ prefix)"
            hint = roots_hint(s.roots_below, s.roots_beside)
            if hint:
                where += "; " + hint
            hints.append(where)
        lines.append(
            "nothing to read: no row was written" + ("" if s.root_empty else ", and the destination holds no data file")
        )
        lines.extend(f"  {hint}" for hint in hints)
    else:
        # Said whatever the destination holds (an export into an earlier one's folder, after a
        # --drop, said nothing of the 40 retired rollouts a new folder's summary named).
        lines.extend(_not_selected(s))
        lines.extend(_prefix_matched_nothing(s))  # a re-run into an earlier export's folder too
    lines.append("requests: " + (", ".join(f"{k} {v:,}" for k, v in s.requests.items()) or "none"))
    result = "FAILED" if not s.ok else "NO ROLLOUTS under the source root" if s.root_empty else "OK"
    lines.append(f"wall time: {s.wall_seconds:.1f}s; result: {result}")
    return "\n".join(lines)
