#!/usr/bin/env python3
"""Cold and warm ``S3TokenStore.resolve`` at 1, 100 and 1,000 calls, full and delta prompts.

The rollouts are ``bench_put``'s synthetic ones (``s3capture.replay.synthetic_rollouts``): the
request continues the last stored call, whose prompt is stored in full or, for every call after the
first, as a delta after its parent (Gym's ``delta_records: true``). Each rollout is written once by
one writer through ``S3TokenStore.put`` (so the delta rollouts carry the store's checkpoints), then
resolved by clients whose connection is warm and whose cache is empty (cold: a new client per
sample) and again by the same client (warm). Requests and sequential round trips come from the
transport's request hooks (``_benchcommon.Timeline.hook``), so both transports are measured alike. Every measurement is repeated behind
``tools/_delayproxy.py`` (``--rtt-ms``, default 10 ms), where round trips, not CPU, set the time.
"vs full" divides a row's p50 by the full-prompt row of the same size, path and client.

Usage::

    python tools/bench_resolve.py                       # moto and SeaweedFS
    python tools/bench_resolve.py --servers moto --quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from typing import Any

from _benchcommon import (
    DelayProxy,
    Sink,
    bare_session,
    load_average,
    machine_summary,
    pct,
    result_line,
    server_list,
    start_server,
    table,
    total_line,
)
from bench_put import Env, ResolveRollout, build_resolve_rollouts, put_rollout, timeline_of

HEADERS = [
    "rollout",
    "path",
    "client",
    "n",
    "p50 ms",
    "p90 ms",
    "vs full",
    "client CPU ms (p50)",
    "LIST",
    "GET",
    "other",
    "round trips",
    "checkpoints (objects / KiB)",
]


async def measure(
    env: Env, spec: ResolveRollout, rollout_id: str, samples: int, warm_samples: int
) -> tuple[Sink, Sink]:
    prefix = env.store().layout.rollout(rollout_id)
    cold, warm = Sink(), Sink()
    for _ in range(samples):
        store = env.store()
        # Connection up and botocore's per-operation set-up done (a LIST and a GET), cache empty.
        await store.resolve(f"warmup-{uuid.uuid4().hex[:6]}", spec.request)
        await store._get(f"{prefix}warmup-missing-key")
        timeline = timeline_of(store)
        for sink, count in ((cold, 1), (warm, warm_samples)):
            for _ in range(count):
                timeline.reset()
                cpu, started = time.process_time(), time.perf_counter()
                resolution = await store.resolve(rollout_id, spec.request)
                sink.add(time.perf_counter() - started, time.process_time() - cpu, timeline)
                if resolution.match is None or resolution.match.model_call_id != spec.parent_call_id:
                    raise SystemExit(f"resolve of {rollout_id} did not find its parent: {resolution}")
        await store.close()
    return cold, warm


async def run_server(
    kind: str, args: argparse.Namespace, rollouts: list[ResolveRollout], summary: list[dict[str, Any]]
) -> str:
    server = start_server(kind)
    proxy: DelayProxy | None = None
    try:
        session, config = bare_session(server)
        async with session.client("s3", endpoint_url=server.endpoint_url, config=config) as bare:
            bucket = f"s3capture-bench-{uuid.uuid4().hex[:8]}"
            await bare.create_bucket(Bucket=bucket)
            env = Env(
                server, session, bare, bucket, f"s3://{bucket}/bench", server.endpoint_url, transport=args.transport
            )
            started = time.perf_counter()
            stored: list[tuple[ResolveRollout, str, str]] = []
            for spec in rollouts:
                rollout_id = f"res-{spec.mode}-{spec.n}-{uuid.uuid4().hex[:6]}"
                writer = env.store()
                await put_rollout(writer, rollout_id, spec.entries, spec.mode == "delta")
                await writer.close()
                prefix = writer.layout.rollout(rollout_id)
                listed = (await bare.list_objects_v2(Bucket=bucket, Prefix=prefix + "cum/")).get("Contents", [])
                stored.append((spec, rollout_id, f"{len(listed)} / {sum(o['Size'] for o in listed) / 1024:,.1f}"))
            write_seconds = time.perf_counter() - started
            paths = [("loopback", env)]
            if args.rtt_ms > 0:
                proxy = DelayProxy(server.port, args.rtt_ms)
                paths.append(
                    (
                        f"{args.rtt_ms:g} ms RTT",
                        Env(
                            server,
                            session,
                            bare,
                            bucket,
                            env.url,
                            proxy.endpoint_url,
                            proxy.process.pid,
                            transport=args.transport,
                        ),
                    )
                )
            rows = []
            for path, path_env in paths:
                results: dict[tuple[str, int, str], Sink] = {}
                for spec, rollout_id, _ in stored:
                    cold, warm = await measure(path_env, spec, rollout_id, args.samples, args.warm_samples)
                    results[(spec.mode, spec.n, "cold")] = cold
                    results[(spec.mode, spec.n, "warm")] = warm
                for spec, _, checkpoints in stored:
                    for client in ("cold", "warm"):
                        sink = results[(spec.mode, spec.n, client)]
                        full = results[("full", spec.n, client)]
                        rows.append(
                            [
                                f"{spec.mode}, {spec.n:,} calls",
                                path,
                                client,
                                len(sink.ms),
                                pct(sink.ms, 0.5),
                                pct(sink.ms, 0.9),
                                f"{pct(sink.ms, 0.5) / pct(full.ms, 0.5):.2f}x",
                                pct(sink.cpu, 0.5),
                                sink.count("ListObjectsV2"),
                                sink.count("GetObject"),
                                sink.other(),
                                max(sink.rt),
                                checkpoints if client == "cold" else "",
                            ]
                        )
                        summary.append(
                            {
                                "server": kind,
                                "transport": args.transport or os.environ.get("S3CAPTURE_TRANSPORT", "aioboto3"),
                                "path": path,
                                "mode": spec.mode,
                                "calls": spec.n,
                                "client": client,
                                "p50_ms": pct(sink.ms, 0.5),
                                "vs_full": pct(sink.ms, 0.5) / pct(full.ms, 0.5),
                                "round_trips": max(sink.rt),
                                "gets": sink.count("GetObject"),
                                "lists": sink.count("ListObjectsV2"),
                                "client_cpu_ms": pct(sink.cpu, 0.5),
                            }
                        )
            return (
                f"### resolve on {kind}\n\n"
                + table(HEADERS, rows)
                + f"\n\n({kind}: rollouts written in {write_seconds:.0f} s; server started in {server.startup_seconds:.1f} s)"
            )
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few samples (smoke test)")
    parser.add_argument("--servers", default="moto,seaweedfs", help="comma-separated: moto, seaweedfs (default both)")
    parser.add_argument("--sizes", default=None, help="calls per rollout (default 1,100,1000)")
    parser.add_argument(
        "--samples", type=int, default=None, help="cold resolves per rollout, each from a new client (default 5)"
    )
    parser.add_argument("--warm-samples", type=int, default=None, help="warm resolves after each cold one (default 3)")
    parser.add_argument(
        "--transport", default=None, help="aioboto3 or obstore (default: S3CAPTURE_TRANSPORT, else aioboto3)"
    )
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=None,
        help="also measure behind a delay proxy adding this round-trip time (default 10; 0 skips)",
    )
    args = parser.parse_args(argv)
    args.sizes = [int(x) for x in (args.sizes or ("1,40" if args.quick else "1,100,1000")).split(",")]
    args.samples = args.samples or (1 if args.quick else 5)
    args.warm_samples = args.warm_samples or (1 if args.quick else 3)
    if args.rtt_ms is None:
        args.rtt_ms = 10.0
    args.servers = server_list(parser, args.servers)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_at_start = load_average()
    rollouts = build_resolve_rollouts(args.sizes)
    print(f"# bench_resolve (transport {args.transport or 'default'})\n\nmachine: {machine_summary()}\n", flush=True)
    results: list[dict[str, Any]] = []
    for kind in args.servers:
        print(asyncio.run(run_server(kind, args, rollouts, results)), flush=True)
        print()
    print(result_line("bench_resolve", {"rows": results}))
    print(total_line(started, load_at_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
