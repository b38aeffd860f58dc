#!/usr/bin/env python3
"""Latency and request budgets of ``S3TokenStore.put``, ``resolve`` and ``freeze`` on local S3 servers.

Every number is measured against a peer in the same run, on the same server, with the same client
configuration (``s3capture.store.default_botocore_config`` with path-style addressing):

* **put** -- ``S3TokenStore.put(entry)`` (A) against a bare aioboto3 ``put_object`` of the same
  compressed bytes to a sibling key (B), and against the bare wire pattern of a put without any
  s3capture code (C: ``put_object`` of the same bytes together with a ``get_object`` of the
  rollout's fence). Rounds alternate the three (A B C, B C A, C A B, ...) to cancel drift; each
  round runs ``concurrency`` operations of one kind at once. Client CPU (``process_time``) and
  server CPU (``/proc/<pid>/stat``) are attributed per kind, which is what explains a ratio.
  The request a put adds is measured alone too (GET/HEAD of a missing and of an existing fence),
  and the A/B/C comparison is repeated behind ``tools/_delayproxy.py``, a proxy process that adds
  a round-trip time (``--rtt-ms``, default 10 ms) to every exchange, as a store off loopback does.
* **resolve** -- the continuation of the last call of rollouts of 10, 100 and 1,000 calls, with
  full prompts and with delta prompts, from a fresh client (empty cache, warm connection) and again
  from the same client (warm cache). Requests and sequential round trips come from the client's
  botocore events. The peer is a bare LIST of the same fingerprint prefix followed by a bare GET of
  the parent's object (two round trips), timed right after each fresh resolve.
* **freeze** -- requests of freezing rollouts of 1,000 and 2,500 entries from a fresh client, and
  again from the same client (entries cached, manifest already written).

The tool starts its own servers (moto in server mode, SeaweedFS ``weed mini``) on 127.0.0.1 as
separate processes and stops them at the end.

Usage::

    python tools/bench_put.py                     # both servers, under 3 minutes on 2 cores
    python tools/bench_put.py --servers moto      # one server
    python tools/bench_put.py --quick             # a few seconds per server (smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from _benchcommon import (
    DelayProxy,
    KindStats,
    ServerCpu,
    Sink,
    Timeline,
    bare_get,
    bare_session,
    build_entry,
    load_average,
    machine_summary,
    mean,
    measured_round,
    n_tokens,
    pct,
    replay_entries,
    server_list,
    set_bare_wire,
    start_server,
    synthetic_entry,
    table,
    total_line,
)
from botocore.exceptions import ClientError

from s3capture.fingerprint import assistant_fingerprint
from s3capture.layout import escape_id
from s3capture.records import coerce_entry, encode_entry
from s3capture.replay import synthetic_rollouts
from s3capture.store import S3TokenStore

KINDS = ("A", "B", "C")
LABELS = {
    "A": "S3TokenStore.put",
    "B": "bare put_object (peer)",
    "C": "bare put_object + GET fence",
    "D": "bare put_object, no Expect: 100-continue",
}


# --------------------------------------------------------------------------- plumbing
@dataclass
class Env(ServerCpu):
    server: Any
    session: Any
    bare: Any
    bucket: str
    url: str
    endpoint_url: str
    proxy_pid: int | None = None
    bare_no_expect: Any = None
    """A bare client without botocore's ``Expect: 100-continue`` on PutObject (kind D), or None."""
    transport: str | None = None
    """The stores' transport (``None``: ``S3CAPTURE_TRANSPORT`` or aioboto3)."""

    def store(self, **kwargs: Any) -> S3TokenStore:
        kwargs.setdefault("transport", self.transport)
        if kwargs["transport"] == "obstore":
            # obstore takes a session's profile, not its keys: the server's credentials are in
            # this process's environment (``_benchcommon.start_server``).
            return S3TokenStore(self.url, endpoint_url=self.endpoint_url, **kwargs)
        return S3TokenStore(self.url, endpoint_url=self.endpoint_url, session=self.session, **kwargs)


def timeline_of(store: S3TokenStore) -> Timeline:
    """A request timeline on the store's transport hooks (works on every transport)."""
    return Timeline().hook(store.transport)


def object_body(store: S3TokenStore, entry: Any, chain: tuple[str, ...] = ()) -> tuple[str, bytes]:
    """(key relative to the rollout prefix, stored bytes) exactly as ``put`` writes them."""
    record = coerce_entry(entry)
    prefix = store.layout.rollout(record.rollout_id)
    payload = encode_entry(record)
    sha = hashlib.sha256(payload).hexdigest()
    rel = store.layout.entry_rel(prefix, record.continuation_fingerprint, record.model_call_id, sha)
    return rel, store._encode_object(payload, chain)  # the store's own envelope and zstd level


# --------------------------------------------------------------------------- put latency
async def put_latency(
    env: Env, workload: str, bases: list[Any], concurrency: int, rounds: int, warmup: int
) -> dict[str, KindStats]:
    store = env.store()
    rollout_id = f"put-{workload}-c{concurrency}-{uuid.uuid4().hex[:6]}"
    prefix = store.layout.rollout(rollout_id)
    fence_key = prefix + "fence"
    total = (rounds + warmup) * concurrency
    ops = []
    for j in range(total):
        base = bases[j % len(bases)]
        entry = msgspec.structs.replace(base, rollout_id=rollout_id, model_call_id=f"{base.model_call_id}-op{j}")
        rel, body = object_body(store, entry)
        cid = escape_id(entry.model_call_id)
        ops.append(
            (
                entry,
                body,
                prefix + rel.replace(f"/{cid}/", f"/{cid}-bare/"),
                prefix + rel.replace(f"/{cid}/", f"/{cid}-wire/"),
            )
        )
    timeline = timeline_of(store)
    kinds = KINDS + (("D",) if env.bare_no_expect is not None else ())
    stats = {kind: KindStats() for kind in kinds}

    run = {
        "A": lambda j: store.put(ops[j][0]),
        "B": lambda j: env.bare.put_object(Bucket=env.bucket, Key=ops[j][2], Body=ops[j][1]),
        "C": lambda j: asyncio.gather(
            env.bare.put_object(Bucket=env.bucket, Key=ops[j][3], Body=ops[j][1]),
            bare_get(env.bare, env.bucket, fence_key),
        ),
        "D": lambda j: env.bare_no_expect.put_object(Bucket=env.bucket, Key=ops[j][3] + ".d", Body=ops[j][1]),
    }
    for r in range(rounds + warmup):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        indices = range(r * concurrency, (r + 1) * concurrency)
        for kind in order:
            traced = kind == "A" and concurrency == 1
            if traced:
                timeline.reset()
            await measured_round(
                run[kind],
                indices,
                stats[kind] if r >= warmup else None,
                env.server_cpu,
                requests=(lambda: sum(store.request_counts.values())) if kind == "A" else None,
                timeline=timeline if traced else None,
            )
    set_bare_wire(stats, {"B": (1, 1), "C": (2, 2), "D": (1, 1)})
    await store.close()
    return stats


def put_rows(workload: str, concurrency: int, stats: dict[str, KindStats]) -> list[list[Any]]:
    peer = stats["B"]
    p50_peer, mean_peer = pct(peer.latencies, 0.5), mean(peer.latencies)
    rows = []
    for kind, s in stats.items():
        p50, p90, avg = pct(s.latencies, 0.5), pct(s.latencies, 0.9), mean(s.latencies)
        rows.append(
            [
                workload,
                concurrency,
                LABELS[kind],
                s.ops,
                p50 * 1000,
                p90 * 1000,
                avg * 1000,
                f"{p50 / p50_peer:.2f}x",
                f"{avg / mean_peer:.2f}x",
                s.ops / s.wall if s.wall else float("nan"),
                s.client_cpu / s.ops * 1000,
                s.server_cpu / s.ops * 1000,
                (s.client_cpu + s.server_cpu) / s.wall if s.wall else float("nan"),
                s.requests / s.ops,
                max(s.round_trips) if s.round_trips else "",
                s.max_in_flight if concurrency == 1 else "",
            ]
        )
    return rows


PUT_HEADERS = [
    "workload",
    "conc",
    "operation",
    "n",
    "p50 ms",
    "p90 ms",
    "mean ms",
    "p50 vs peer",
    "mean vs peer",
    "ops/s",
    "client CPU ms/op",
    "server CPU ms/op",
    "CPU cores busy",
    "requests/op",
    "round trips (max)",
    "max in flight",
]


# --------------------------------------------------------------------------- fence reads (why a put costs more)
FENCE_BODY = b'{"format":"s3capture.fence/1","state":"frozen"}'


async def fence_reads(env: Env, rounds: int, body: bytes) -> list[list[Any]]:
    """Cost of the request a put adds: GET/HEAD of a missing and of an existing fence, vs a bare PUT."""
    base = f"fence-probe-{uuid.uuid4().hex[:6]}/"
    await env.bare.put_object(Bucket=env.bucket, Key=base + "fence", Body=FENCE_BODY)

    async def head(key: str) -> None:
        try:
            await env.bare.head_object(Bucket=env.bucket, Key=key)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise

    kinds = {
        "bare put_object (entry bytes)": lambda j: env.bare.put_object(
            Bucket=env.bucket, Key=f"{base}put/{j}", Body=body
        ),
        "GET missing fence (404)": lambda j: bare_get(env.bare, env.bucket, base + "missing"),
        "HEAD missing fence (404)": lambda j: head(base + "missing"),
        "GET existing fence (200, 47 B)": lambda j: bare_get(env.bare, env.bucket, base + "fence"),
        "HEAD existing fence (200)": lambda j: head(base + "fence"),
    }
    names = list(kinds)
    stats = {name: KindStats() for name in names}
    for r in range(rounds + 2):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            cpu0, srv0 = time.process_time(), env.server_cpu()
            started = time.perf_counter()
            await kinds[name](r)
            elapsed = time.perf_counter() - started
            cpu1, srv1 = time.process_time(), env.server_cpu()
            if r < 2:
                continue
            s = stats[name]
            s.latencies.append(elapsed)
            s.client_cpu += cpu1 - cpu0
            s.server_cpu += srv1 - srv0
            s.ops += 1
    rows = []
    for name in names:
        s = stats[name]
        rows.append(
            [
                name,
                s.ops,
                pct(s.latencies, 0.5) * 1000,
                pct(s.latencies, 0.9) * 1000,
                mean(s.latencies) * 1000,
                s.client_cpu / s.ops * 1000,
                s.server_cpu / s.ops * 1000,
            ]
        )
    return rows


FENCE_HEADERS = [
    "request (sequential, interleaved)",
    "n",
    "p50 ms",
    "p90 ms",
    "mean ms",
    "client CPU ms/op",
    "server CPU ms/op",
]


# --------------------------------------------------------------------------- resolve
@dataclass
class ResolveRollout:
    n: int
    mode: str
    entries: list[Any]
    request: list[dict]
    parent_call_id: str
    fingerprint: str


def build_resolve_rollouts(sizes: list[int]) -> list[ResolveRollout]:
    """Synthetic multi-turn rollouts (``s3capture.replay.synthetic_rollouts``), full and delta prompts."""
    out = []
    for n in sizes:
        rollout = synthetic_rollouts(1, n + 1, seed=n, prompt_len=32, gen_len=4)[0]
        full: list[Any] = []
        delta: list[Any] = []
        previous = None
        for call in rollout.calls[:n]:
            entry = build_entry(
                rollout.rollout_id,
                call.model_call_id,
                call.request_items,
                call.output_items,
                call.prompt_token_ids,
                call.generation_token_ids,
                call.generation_log_probs,
                parent_call_id=previous.model_call_id if previous else None,
            )
            full.append(entry)
            if previous is None:
                delta.append(entry)
            else:
                parent_len = len(previous.prompt_token_ids) + len(previous.generation_token_ids)
                delta.append(
                    msgspec.structs.replace(
                        entry, prompt_token_ids=list(call.prompt_token_ids[parent_len:]), prompt_is_delta=True
                    )
                )
            previous = call
        request = rollout.calls[n].request_items
        parent = rollout.calls[n - 1].model_call_id
        fingerprint = assistant_fingerprint(request)
        out.append(ResolveRollout(n, "full", full, request, parent, fingerprint))
        out.append(ResolveRollout(n, "delta", delta, request, parent, fingerprint))
    return out


async def put_rollout(store: S3TokenStore, rollout_id: str, entries: list[Any], delta: bool) -> None:
    entries = [msgspec.structs.replace(e, rollout_id=rollout_id) for e in entries]
    if delta:  # each delta put needs its parent's keys, which the writer learns from its own puts
        for entry in entries:
            await store.put(entry)
        return
    limit = asyncio.Semaphore(16)

    async def one(entry: Any) -> None:
        async with limit:
            await store.put(entry)

    await asyncio.gather(*(one(e) for e in entries))


async def bench_resolve(env: Env, rollouts: list[ResolveRollout], samples: int, warm_samples: int) -> list[list[Any]]:
    rows = []
    for spec in rollouts:
        rollout_id = f"res-{spec.mode}-{spec.n}-{uuid.uuid4().hex[:6]}"
        writer = env.store()
        await put_rollout(writer, rollout_id, spec.entries, spec.mode == "delta")
        await writer.close()
        prefix = writer.layout.rollout(rollout_id)
        fp_prefix = f"{prefix}log/e/{escape_id(spec.fingerprint)}/"
        parent_keys = [
            item["Key"]
            for item in (await env.bare.list_objects_v2(Bucket=env.bucket, Prefix=fp_prefix)).get("Contents", [])
        ]
        assert len(parent_keys) == 1, parent_keys
        parent_size = 0
        fresh, warm = Sink(), Sink()
        peer: list[float] = []
        budget = samples if spec.n < 1000 or spec.mode == "full" else min(samples, 2)
        for _ in range(budget):
            store = env.store()
            # Connection up and botocore's per-operation set-up done (a LIST and a GET), cache empty.
            await store.resolve(f"warmup-{uuid.uuid4().hex[:6]}", spec.request)
            await store._get(f"{prefix}warmup-missing-key")
            timeline = timeline_of(store)
            for sink, count in ((fresh, 1), (warm, warm_samples)):
                for _ in range(count):
                    timeline.reset()
                    cpu, started = time.process_time(), time.perf_counter()
                    resolution = await store.resolve(rollout_id, spec.request)
                    sink.add(time.perf_counter() - started, time.process_time() - cpu, timeline)
                    if resolution.match is None or resolution.match.model_call_id != spec.parent_call_id:
                        raise SystemExit(f"resolve of {rollout_id} did not find its parent: {resolution}")
            await store.close()
            started = time.perf_counter()
            await env.bare.list_objects_v2(Bucket=env.bucket, Prefix=fp_prefix)
            data = await bare_get(env.bare, env.bucket, parent_keys[0])
            peer.append((time.perf_counter() - started) * 1000)
            parent_size = len(data or b"")
        label = f"{spec.mode}, {spec.n:,} calls"
        for client, sink in (("fresh client", fresh), ("warm client", warm)):
            rows.append(
                [
                    label,
                    client,
                    len(sink.ms),
                    pct(sink.ms, 0.5),
                    pct(sink.ms, 0.9),
                    f"{pct(sink.ms, 0.5) / pct(peer, 0.5):.2f}x",
                    pct(sink.cpu, 0.5),
                    sink.count("ListObjectsV2"),
                    sink.count("GetObject"),
                    sink.other(),
                    max(sink.rt),
                    max(sink.inflight),
                ]
            )
        rows.append(
            [label, "peer: bare LIST then GET", len(peer), pct(peer, 0.5), pct(peer, 0.9), "1.00x", "", 1, 1, 0, 2, 1]
        )
        rows.append(
            [label, f"(parent object {parent_size:,} B, {n_tokens(spec.entries[-1]):,} tokens stored)", *[""] * 10]
        )
    return rows


RESOLVE_HEADERS = [
    "rollout",
    "client",
    "n",
    "p50 ms",
    "p90 ms",
    "p50 vs peer",
    "client CPU ms (p50)",
    "LIST",
    "GET",
    "other",
    "round trips",
    "max in flight",
]


# --------------------------------------------------------------------------- freeze
async def put_bare(env: Env, writer: S3TokenStore, entries: list[Any], concurrency: int = 32) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def one(entry: Any) -> None:
        rel, body = object_body(writer, entry)
        async with limit:
            await env.bare.put_object(Bucket=env.bucket, Key=writer.layout.rollout(entry.rollout_id) + rel, Body=body)

    await asyncio.gather(*(one(e) for e in entries))


async def bench_freeze(env: Env, sizes: list[int]) -> list[list[Any]]:
    rows = []
    template = synthetic_entry(64, generation_tokens=32, call_id="frz")
    for n in sizes:
        rollout_id = f"frz-{n}-{uuid.uuid4().hex[:6]}"
        writer = env.store()
        entries = [
            msgspec.structs.replace(template, rollout_id=rollout_id, model_call_id=f"call-{i:05d}") for i in range(n)
        ]
        await put_bare(env, writer, entries)  # setup with bare PUTs: the objects put() would write, half the requests
        store = env.store()
        await store.resolve(
            f"warmup-{uuid.uuid4().hex[:6]}", [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        )
        timeline = timeline_of(store)
        for client in ("fresh client", "same client again (cached)"):
            timeline.reset()
            started = time.perf_counter()
            snapshot = await store.freeze(rollout_id)
            elapsed = time.perf_counter() - started
            if len(snapshot.entries) != n or snapshot.incomplete:
                raise SystemExit(
                    f"freeze of {rollout_id} returned {len(snapshot.entries)} entries, incomplete={snapshot.incomplete}"
                )
            counts = timeline.counts()
            pages = -(-(n + 1) // 1000)  # entries + fence
            expected = (
                f"LIST {pages}, GET {n}, PUT 2"
                if client == "fresh client"
                else f"LIST {pages}, GET 0, PUT 1 (manifest exists)"
            )
            rows.append(
                [
                    f"{n:,} entries",
                    client,
                    elapsed * 1000,
                    counts.get("ListObjectsV2", 0),
                    counts.get("GetObject", 0),
                    counts.get("PutObject", 0),
                    sum(v for k, v in counts.items() if k not in ("ListObjectsV2", "GetObject", "PutObject")),
                    timeline.round_trips(),
                    timeline.max_in_flight(),
                    expected,
                ]
            )
        await store.close()
        await writer.close()
    return rows


FREEZE_HEADERS = ["rollout", "client", "ms", "LIST", "GET", "PUT", "other", "round trips", "max in flight", "target"]


# --------------------------------------------------------------------------- main
async def run_server(
    kind: str, args: argparse.Namespace, resolve_rollouts: list[ResolveRollout], workloads: dict[str, list[Any]]
) -> str:
    server = start_server(kind)
    out: list[str] = []
    proxy: DelayProxy | None = None
    try:
        session, config = bare_session(server)  # the configuration S3TokenStore builds by default
        async with session.client("s3", endpoint_url=server.endpoint_url, config=config) as bare:
            bucket = f"s3capture-bench-{uuid.uuid4().hex[:8]}"
            await bare.create_bucket(Bucket=bucket)
            env = Env(server, session, bare, bucket, f"s3://{bucket}/bench", server.endpoint_url)
            timings = []
            started = time.perf_counter()
            rows = []
            for workload, bases in workloads.items():
                for concurrency, rounds in ((1, args.rounds), (8, args.rounds8)):
                    stats = await put_latency(env, workload, bases, concurrency, rounds, warmup=2)
                    rows.extend(put_rows(workload, concurrency, stats))
            out.append(f"### put latency on {kind} (A/B/C interleaved per round)\n\n" + table(PUT_HEADERS, rows))
            first = next(iter(workloads.values()))
            rows = await fence_reads(env, args.rounds, object_body(env.store(), first[0])[1])
            out.append(f"### the request a put adds, on {kind}\n\n" + table(FENCE_HEADERS, rows))
            timings.append(f"put {time.perf_counter() - started:.0f} s")
            if args.rtt_ms > 0:
                started = time.perf_counter()
                proxy = DelayProxy(server.port, args.rtt_ms)
                async with (
                    session.client("s3", endpoint_url=proxy.endpoint_url, config=config) as slow,
                    session.client("s3", endpoint_url=proxy.endpoint_url, config=config) as no_expect,
                ):
                    from botocore.handlers import add_expect_header

                    no_expect.meta.events.unregister("before-call.s3", add_expect_header)
                    slow_env = Env(
                        server, session, slow, bucket, env.url, proxy.endpoint_url, proxy.process.pid, no_expect
                    )
                    rows = []
                    for workload, bases in list(workloads.items())[:1]:
                        for concurrency, rounds in ((1, max(2, args.rounds * 3 // 5)), (8, args.rounds8)):
                            stats = await put_latency(slow_env, workload, bases, concurrency, rounds, warmup=2)
                            rows.extend(put_rows(workload, concurrency, stats))
                out.append(
                    f"### put latency on {kind} behind a {args.rtt_ms:g} ms round-trip delay proxy (server CPU includes the proxy's)\n\n"
                    + table(PUT_HEADERS, rows)
                )
                proxy.stop()
                proxy = None
                timings.append(f"put with RTT {time.perf_counter() - started:.0f} s")
            started = time.perf_counter()
            rows = await bench_resolve(env, resolve_rollouts, args.samples, args.warm_samples)
            out.append(f"### resolve on {kind}\n\n" + table(RESOLVE_HEADERS, rows))
            timings.append(f"resolve {time.perf_counter() - started:.0f} s")
            started = time.perf_counter()
            rows = await bench_freeze(env, args.freeze_sizes)
            out.append(f"### freeze on {kind}\n\n" + table(FREEZE_HEADERS, rows))
            timings.append(f"freeze {time.perf_counter() - started:.0f} s")
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
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a few seconds per server (smoke test)")
    parser.add_argument("--servers", default="moto,seaweedfs", help="comma-separated: moto, seaweedfs (default both)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="measured rounds at concurrency 1 per kind (default 100)"
    )
    parser.add_argument(
        "--rounds8", type=int, default=None, help="measured rounds at concurrency 8 per kind (default 25)"
    )
    parser.add_argument("--resolve-sizes", default=None, help="calls per rollout for resolve (default 10,100,1000)")
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="fresh-client resolves per rollout (default 5; 2 for delta rollouts of 1,000+ calls)",
    )
    parser.add_argument("--warm-samples", type=int, default=None, help="warm resolves after each fresh one (default 5)")
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=None,
        help="also measure put behind a delay proxy adding this round-trip time (default 10; 0 skips)",
    )
    parser.add_argument("--freeze-sizes", default=None, help="entries per frozen rollout (default 1000,2500)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.rounds = args.rounds or (6 if quick else 100)
    args.rounds8 = args.rounds8 or (2 if quick else 25)
    args.resolve_sizes = [int(x) for x in (args.resolve_sizes or ("10,30" if quick else "10,100,1000")).split(",")]
    args.samples = args.samples or (1 if quick else 5)
    args.warm_samples = args.warm_samples or (2 if quick else 5)
    args.freeze_sizes = [int(x) for x in (args.freeze_sizes or ("100" if quick else "1000,2500")).split(",")]
    if args.rtt_ms is None:
        args.rtt_ms = 10.0
    args.servers = server_list(parser, args.servers)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_at_start = load_average()
    real = replay_entries("competitive_coding")
    workloads = {
        f"competitive_coding (real, ~{sum(map(n_tokens, real)) // len(real):,} tok)": real,
        "synthetic 8k tok": [synthetic_entry(8192, seed=s, call_id=f"s8k-{s}") for s in range(4)],
    }
    if args.quick:
        workloads = dict(list(workloads.items())[:1])
    resolve_rollouts = build_resolve_rollouts(args.resolve_sizes)
    print(f"# bench_put\n\nmachine: {machine_summary()}\n", flush=True)
    for kind in args.servers:
        print(asyncio.run(run_server(kind, args, resolve_rollouts, workloads)), flush=True)
        print()
    print(total_line(started, load_at_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
