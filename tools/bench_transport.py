#!/usr/bin/env python3
"""Transports side by side: put ÷ bare PUT, and capture calls ÷ the same request mix sent bare.

Per server (moto, SeaweedFS, and Ceph RGW when its binaries are installed) and per transport
(``aioboto3``, ``obstore``), in one run where the transports and their peers are interleaved
round by round (the order rotates every round, so drift and other processes' load cancel):

* **put ÷ bare PUT** -- ``S3TokenStore.put(entry)`` (real ``competitive_coding`` entries, a new call
  id each time) against a bare PUT of the same stored bytes to a sibling key *on the transport's
  own client* (aiobotocore ``put_object`` / ``obstore.put_async``), at concurrency 1 and 8, on
  loopback and behind ``tools/_delayproxy.py`` (``--rtt-ms``, default 10 ms). A third kind sends a
  put's requests bare (the PUT together with a GET of the fence): put ÷ that is s3capture's own
  cost; that ÷ bare PUT is what the fence read costs on the server and the wire.
* **capture calls** -- what Gym's middleware does per model call: ``resolve`` (LIST of the
  request's fingerprint prefix; the candidate is cached by this client's own put of the previous
  call, so no GET), ``begin_call`` (PUT intent, then GET fence) and ``put`` (PUT entry and GET fence
  together). ``--workers`` rollouts run at once, ``--calls`` calls each, every round on fresh
  rollouts. The peer is the *same request mix sent bare* on the same transport's client (the
  LIST, the intent PUT then the fence GET, the entry PUT with the fence GET), with bytes encoded
  outside the timing. Reported: calls/s and its ratio to the bare mix, client CPU per call
  (``time.process_time`` of this process over the round, so it includes the event loop), server
  CPU per call (``/proc``), and requests per call (request hooks vs the bare counter; they must
  match, or the comparison is not like for like).

The headline: client CPU per capture call, aioboto3 ÷ obstore (issue 8 target: >= 5x), and
obstore capture throughput ÷ its bare mix (target: >= 0.8x). A last ``RESULT-JSON`` line carries
every ratio for ``tools/bench_all.py``.

Usage::

    python tools/bench_transport.py                       # all servers, both transports, ~6 min
    python tools/bench_transport.py --servers moto --transports obstore
    python tools/bench_transport.py --quick --servers moto   # seconds (smoke test)
    python tools/bench_transport.py --only capture --servers seaweedfs,moto   # capture-call rows only
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from _benchcommon import (
    BareOps,
    DelayProxy,
    KindStats,
    build_entry,
    load_average,
    machine_summary,
    mean,
    measured_round,
    n_tokens,
    pct,
    replay_entries,
    result_line,
    server_cpu_seconds,
    server_list,
    start_server,
    table,
    total_line,
    transport_list,
)
from bench_put import object_body

from s3capture.fingerprint import assistant_fingerprint
from s3capture.layout import escape_id
from s3capture.records import ParentResolutionStatus
from s3capture.replay import synthetic_rollouts
from s3capture.store import S3TokenStore


@dataclass
class Server:
    server: Any
    bucket: str
    proxy_pid: int | None = None

    def cpu(self) -> float:
        return server_cpu_seconds(self.server.pid) + (server_cpu_seconds(self.proxy_pid) if self.proxy_pid else 0.0)


def new_store(srv: Server, endpoint_url: str, transport: str) -> S3TokenStore:
    # No session: both transports read the server's credentials from the standard chain
    # (``start_server`` put them in the environment), as a deployment would.
    return S3TokenStore(f"s3://{srv.bucket}/bench", endpoint_url=endpoint_url, transport=transport)


def rotated(items: list[Any], r: int) -> list[Any]:
    k = r % len(items)
    return items[k:] + items[:k]


# --------------------------------------------------------------------------- 1. put ÷ bare PUT
async def put_ratio(
    srv: Server,
    endpoint_url: str,
    transports: list[str],
    bases: list[Any],
    concurrency: int,
    rounds: int,
    warmup: int = 2,
) -> dict[tuple[str, str], KindStats]:
    kinds = [(t, k) for t in transports for k in ("put", "bare", "wire")]
    stores = {t: new_store(srv, endpoint_url, t) for t in transports}
    bares = {t: await BareOps.of(stores[t].transport) for t in transports}
    total = (rounds + warmup) * concurrency
    ops: dict[str, list[tuple[Any, bytes, str]]] = {}
    fences: dict[str, str] = {}
    for t, store in stores.items():
        rollout_id = f"put-{t}-c{concurrency}-{uuid.uuid4().hex[:6]}"
        prefix = store.layout.rollout(rollout_id)
        fences[t] = prefix + "fence"
        ops[t] = []
        for j in range(total):
            base = bases[j % len(bases)]
            entry = msgspec.structs.replace(base, rollout_id=rollout_id, model_call_id=f"{base.model_call_id}-op{j}")
            rel, body = object_body(store, entry)
            ops[t].append((entry, body, prefix + "bare/" + rel))
    stats = {kind: KindStats() for kind in kinds}

    def runner(t: str, k: str) -> Any:
        if k == "put":
            return lambda j: stores[t].put(ops[t][j][0])
        if k == "wire":  # the requests of a put without s3capture code: the PUT with a GET of the fence
            return lambda j: asyncio.gather(bares[t].put(ops[t][j][2] + ".wire", ops[t][j][1]), bares[t].get(fences[t]))
        return lambda j: bares[t].put(ops[t][j][2], ops[t][j][1])

    for r in range(rounds + warmup):
        indices = range(r * concurrency, (r + 1) * concurrency)
        for kind in rotated(kinds, r):
            await measured_round(runner(*kind), indices, stats[kind] if r >= warmup else None, srv.cpu)
    for store in stores.values():
        await store.close()
    return stats


PUT_HEADERS = [
    "path",
    "conc",
    "transport",
    "operation",
    "n",
    "p50 ms",
    "p90 ms",
    "mean ms",
    "p50 ÷ bare",
    "mean ÷ bare",
    "client CPU ms/op",
    "server CPU ms/op",
]


def put_rows(
    path: str, concurrency: int, stats: dict[tuple[str, str], KindStats], results: dict[str, Any], kind: str
) -> list[list[Any]]:
    rows = []
    for (t, k), s in stats.items():
        peer = stats[(t, "bare")]
        p50, avg = pct(s.latencies, 0.5), mean(s.latencies)
        r50, ravg = p50 / pct(peer.latencies, 0.5), avg / mean(peer.latencies)
        label = {
            "put": "S3TokenStore.put",
            "bare": "bare put_object (peer)" if t == "aioboto3" else "bare obstore.put_async (peer)",
            "wire": "bare PUT + GET fence (a put's requests)",
        }[k]
        rows.append(
            [
                path,
                concurrency,
                t,
                label,
                s.ops,
                p50 * 1000,
                pct(s.latencies, 0.9) * 1000,
                avg * 1000,
                f"{r50:.2f}x",
                f"{ravg:.2f}x",
                s.client_cpu / s.ops * 1000,
                s.server_cpu / s.ops * 1000,
            ]
        )
        if k == "put":
            results.setdefault("put", []).append(
                {
                    "server": kind,
                    "path": path,
                    "concurrency": concurrency,
                    "transport": t,
                    "p50_ratio": r50,
                    "mean_ratio": ravg,
                    "wire_p50_ratio": p50 / pct(stats[(t, "wire")].latencies, 0.5),
                    "p50_ms": p50 * 1000,
                    "bare_p50_ms": pct(peer.latencies, 0.5) * 1000,
                    "client_cpu_ms": s.client_cpu / s.ops * 1000,
                    "bare_client_cpu_ms": peer.client_cpu / peer.ops * 1000,
                }
            )
    return rows


# --------------------------------------------------------------------------- 2. capture calls ÷ bare mix
@dataclass
class CallSpec:
    """One call position of the template rollout: its entry, request, and the bare mix's bytes."""

    entry: Any
    request: list[dict]
    fingerprint: str
    rel: str
    body: bytes


@dataclass
class CaptureStats:
    calls: int = 0
    wall: float = 0.0
    client_cpu: float = 0.0
    server_cpu: float = 0.0
    requests: collections.Counter = field(default_factory=collections.Counter)
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)


def template_calls(store: S3TokenStore, calls: int, prompt_len: int, gen_len: int) -> list[CallSpec]:
    rollout = synthetic_rollouts(1, calls, seed=7, prompt_len=prompt_len, gen_len=gen_len)[0]
    out = []
    previous = None
    for call in rollout.calls:
        entry = build_entry(
            "template",
            call.model_call_id,
            call.request_items,
            call.output_items,
            call.prompt_token_ids,
            call.generation_token_ids,
            call.generation_log_probs,
            parent_call_id=previous,
        )
        rel, body = object_body(store, entry)
        out.append(CallSpec(entry, call.request_items, assistant_fingerprint(call.request_items), rel, body))
        previous = call.model_call_id
    return out


async def capture_rollout(store: S3TokenStore, rollout_id: str, entries: list[Any], specs: list[CallSpec]) -> None:
    """Gym's middleware, per model call: resolve, begin_call, (generation), put."""
    for entry, spec in zip(entries, specs):
        resolution = await store.resolve(rollout_id, spec.request)
        expected = ParentResolutionStatus.ROOT if entry.parent_call_id is None else ParentResolutionStatus.RESOLVED
        if resolution.status != expected:
            raise SystemExit(f"resolve of {rollout_id}/{entry.model_call_id} gave {resolution}")
        await store.begin_call(rollout_id, entry.model_call_id)
        await store.put(entry)


async def bare_rollout(bare: BareOps, store: S3TokenStore, rollout_id: str, specs: list[CallSpec]) -> None:
    """The same requests without s3capture code: LIST the fingerprint prefix (none for a root
    call), PUT the intent, then GET the fence, then PUT the entry bytes with a GET of the fence."""
    prefix = store.layout.rollout(rollout_id)
    fence = prefix + "fence"
    for spec in specs:
        if spec.fingerprint:
            await bare.list(f"{prefix}log/e/{escape_id(spec.fingerprint)}/")
        await bare.put(prefix + "log/i/" + escape_id(spec.entry.model_call_id), b"")
        await bare.get(fence)
        await asyncio.gather(bare.put(prefix + spec.rel, spec.body), bare.get(fence))


async def capture_ratio(
    srv: Server,
    endpoint_url: str,
    transports: list[str],
    workers: int,
    calls: int,
    rounds: int,
    prompt_len: int,
    gen_len: int,
    warmup: int = 1,
) -> dict[tuple[str, str], CaptureStats]:
    kinds = [(t, k) for t in transports for k in ("capture", "bare")]
    stores = {t: new_store(srv, endpoint_url, t) for t in transports}
    counters: dict[str, collections.Counter] = {}
    for t, store in stores.items():
        counter: collections.Counter = collections.Counter()
        store.transport.add_hook(before=lambda op, key, token, c=counter: c.update((op,)))
        counters[t] = counter
    bares = {t: await BareOps.of(stores[t].transport) for t in transports}
    specs = template_calls(next(iter(stores.values())), calls, prompt_len, gen_len)
    tag = uuid.uuid4().hex[:6]
    # Every (round, worker) gets its own rollout; entries re-stamped with its id outside the timing.
    plan: dict[tuple[str, str, int], list[tuple[str, list[Any]]]] = {}
    for t, k in kinds:
        for r in range(rounds + warmup):
            items = []
            for w in range(workers):
                rollout_id = f"cap-{t}-{k}-{tag}-r{r}-w{w}"
                entries = (
                    [msgspec.structs.replace(s.entry, rollout_id=rollout_id) for s in specs] if k == "capture" else []
                )
                items.append((rollout_id, entries))
            plan[(t, k, r)] = items
    stats = {kind: CaptureStats() for kind in kinds}
    for r in range(rounds + warmup):
        for t, k in rotated(kinds, r):
            store, bare = stores[t], bares[t]
            counter = counters[t] if k == "capture" else bare.counts
            before = collections.Counter(counter)
            if k == "capture":
                jobs = [capture_rollout(store, rid, entries, specs) for rid, entries in plan[(t, k, r)]]
            else:
                jobs = [bare_rollout(bare, store, rid, specs) for rid, _ in plan[(t, k, r)]]
            cpu0, srv0, wall0 = time.process_time(), srv.cpu(), time.perf_counter()
            await asyncio.gather(*jobs)
            wall, cpu, server = time.perf_counter() - wall0, time.process_time() - cpu0, srv.cpu() - srv0
            if r < warmup:
                continue
            s = stats[(t, k)]
            n = workers * calls
            s.calls += n
            s.wall += wall
            s.client_cpu += cpu
            s.server_cpu += server
            s.walls.append(wall / n)
            s.cpus.append(cpu / n)
            s.requests.update(counter - before)
    for store in stores.values():
        await store.close()
    return stats


CAPTURE_HEADERS = [
    "transport",
    "workload",
    "calls",
    "calls/s",
    "÷ bare mix",
    "client CPU ms/call (p50 of rounds)",
    "client CPU ms/call (all)",
    "server CPU ms/call",
    "requests/call (LIST/PUT/GET)",
    "capture calls/s per client core",
]


def capture_rows(stats: dict[tuple[str, str], CaptureStats], results: dict[str, Any], kind: str) -> list[list[Any]]:
    rows = []
    for (t, k), s in stats.items():
        peer = stats[(t, "bare")]
        rate, peer_rate = s.calls / s.wall, peer.calls / peer.wall
        cpu = s.client_cpu / s.calls
        req = "/".join(f"{s.requests[op] / s.calls:.2f}" for op in ("ListObjectsV2", "PutObject", "GetObject"))
        label = "capture call (resolve + begin_call + put)" if k == "capture" else "same request mix, bare (peer)"
        rows.append(
            [
                t,
                label,
                s.calls,
                rate,
                f"{rate / peer_rate:.2f}x",
                pct(s.cpus, 0.5) * 1000,
                cpu * 1000,
                s.server_cpu / s.calls * 1000,
                req,
                1.0 / cpu if cpu else float("nan"),
            ]
        )
        if k == "capture":
            results.setdefault("capture", []).append(
                {
                    "server": kind,
                    "transport": t,
                    "throughput_ratio": rate / peer_rate,
                    "calls_per_s": rate,
                    "client_cpu_ms": cpu * 1000,
                    "client_cpu_ms_p50": pct(s.cpus, 0.5) * 1000,
                    "bare_client_cpu_ms": peer.client_cpu / peer.calls * 1000,
                    "server_cpu_ms": s.server_cpu / s.calls * 1000,
                    "requests_per_call": {op: v / s.calls for op, v in s.requests.items()},
                    "bare_requests_per_call": {op: v / peer.calls for op, v in peer.requests.items()},
                }
            )
    return rows


# --------------------------------------------------------------------------- main
async def run_server(kind: str, args: argparse.Namespace, bases: list[Any], results: dict[str, Any]) -> str:
    server = start_server(kind)
    out: list[str] = []
    proxy: DelayProxy | None = None
    try:
        bucket = f"s3capture-bench-{uuid.uuid4().hex[:8]}"
        import aioboto3

        async with aioboto3.Session().client("s3", endpoint_url=server.endpoint_url) as admin:
            await admin.create_bucket(Bucket=bucket)
        srv = Server(server, bucket)
        timings = []
        started = time.perf_counter()
        rows: list[list[Any]] = []
        paths = [("loopback", server.endpoint_url, None)]
        if args.rtt_ms > 0 and args.only != "capture":
            proxy = DelayProxy(server.port, args.rtt_ms)
            paths.append((f"{args.rtt_ms:g} ms RTT", proxy.endpoint_url, proxy.process.pid))
        for path, endpoint, pid in paths if args.only != "capture" else []:
            srv.proxy_pid = pid
            for concurrency, rounds in ((1, args.rounds), (8, args.rounds8)):
                if pid is not None and concurrency == 1:
                    rounds = max(3, rounds * 2 // 3)
                stats = await put_ratio(srv, endpoint, args.transports, bases, concurrency, rounds)
                rows.extend(put_rows(path, concurrency, stats, results, kind))
        srv.proxy_pid = None
        if args.only != "capture":
            out.append(
                f"### put ÷ bare PUT of the same transport on {kind} (kinds interleaved per round; server CPU includes the proxy's behind it)\n\n"
                + table(PUT_HEADERS, rows)
            )
            timings.append(f"put {time.perf_counter() - started:.0f} s")
        if args.only == "put":
            out.append(f"({kind}: {', '.join(timings)}; server started in {server.startup_seconds:.1f} s)")
            return "\n\n".join(out)
        started = time.perf_counter()
        stats = await capture_ratio(
            srv,
            server.endpoint_url,
            args.transports,
            args.workers,
            args.calls,
            args.capture_rounds,
            args.prompt_len,
            args.gen_len,
        )
        rows = capture_rows(stats, results, kind)
        out.append(
            f"### capture calls on {kind}, loopback: {args.workers} rollouts at once x {args.calls} calls per round, "
            f"{args.capture_rounds} rounds per kind (prompts {args.prompt_len}+, generations {args.gen_len} tokens)\n\n"
            + table(CAPTURE_HEADERS, rows)
        )
        by_t = {c["transport"]: c for c in results.get("capture", []) if c["server"] == kind}
        if "aioboto3" in by_t and "obstore" in by_t:
            ratio = by_t["aioboto3"]["client_cpu_ms"] / by_t["obstore"]["client_cpu_ms"]
            results.setdefault("cpu_ratio", []).append({"server": kind, "aioboto3_over_obstore": ratio})
            out.append(f"client CPU per capture call on {kind}: aioboto3 ÷ obstore = {ratio:.2f}x (target >= 5x)")
        timings.append(f"capture {time.perf_counter() - started:.0f} s")
        out.append(f"({kind}: {', '.join(timings)}; server started in {server.startup_seconds:.1f} s)")
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
    return "\n\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: seconds per server (smoke test)")
    parser.add_argument(
        "--servers",
        default="all",
        help="comma-separated: moto, seaweedfs, ceph; 'all' (default) = moto, seaweedfs and ceph when installed",
    )
    parser.add_argument("--transports", default="aioboto3,obstore", help="comma-separated (default aioboto3,obstore)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="put rounds per kind at concurrency 1 (default 40; 2/3 of it behind the proxy)",
    )
    parser.add_argument("--rounds8", type=int, default=None, help="put rounds per kind at concurrency 8 (default 12)")
    parser.add_argument(
        "--rtt-ms", type=float, default=None, help="round-trip time of the delay proxy (default 10; 0 skips)"
    )
    parser.add_argument("--workers", type=int, default=None, help="rollouts captured at once (default 8)")
    parser.add_argument("--calls", type=int, default=None, help="calls per rollout per round (default 6)")
    parser.add_argument("--capture-rounds", type=int, default=None, help="measured capture rounds per kind (default 6)")
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=768,
        help="first call's prompt tokens (default 768; each call adds 1.5x --gen-len)",
    )
    parser.add_argument("--gen-len", type=int, default=128, help="generation tokens per call (default 128)")
    parser.add_argument(
        "--only",
        choices=("put", "capture"),
        default=None,
        help="run only the put rows or only the capture-call rows (default: both)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.rounds = args.rounds or (4 if quick else 40)
    args.rounds8 = args.rounds8 or (2 if quick else 12)
    args.workers = args.workers or (2 if quick else 8)
    args.calls = args.calls or (3 if quick else 6)
    args.capture_rounds = args.capture_rounds or (2 if quick else 6)
    if args.rtt_ms is None:
        args.rtt_ms = 10.0
    args.servers = server_list(parser, args.servers)
    args.transports = transport_list(parser, args.transports)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_at_start = load_average()
    bases = replay_entries("competitive_coding", limit=40)
    print(
        f"# bench_transport\n\nmachine: {machine_summary()}\nload average at start: {load_at_start}\n"
        f"put entries: competitive_coding (real, ~{sum(map(n_tokens, bases)) // len(bases):,} tokens)\n",
        flush=True,
    )
    results: dict[str, Any] = {"servers": args.servers, "transports": args.transports, "quick": args.quick}
    for kind in args.servers:
        print(asyncio.run(run_server(kind, args, bases, results)), flush=True)
        print()
    print(result_line("bench_transport", results))
    print(total_line(started, load_at_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
