#!/usr/bin/env python3
"""Client RSS over a long capture run: is it flat once the cache is full?

One ``S3TokenStore`` with a small ``cache_bytes`` captures ``--rollouts`` rollouts of ``--calls``
calls each (default 1,000 x 20 = 20,000 calls) through a real local S3 server (moto in server
mode, a separate process, so its memory is not ours). Each call does what a model-server worker
does around generation: a resolve-like read of the parent (the previous call's entry, through the
store's cache; a GET when it was evicted), then ``put`` of the new entry (PUT + fence GET). When a
rollout's calls are done it is frozen (the builder's side: fence PUT, LIST, hand-out, background
manifest). ``--parallel`` rollouts run at once.

Every 1,000 calls (``--sample-every``) the tool samples the process's RSS (``/proc/self/statm``), the cache's own byte
count and the sizes of the per-call key map and the fence-time map. The verdict: RSS after the
cache first filled stays within 10 % (max / min of those samples).

Usage::

    python tools/bench_memory.py                          # ~5-10 minutes on 2 loaded cores
    python tools/bench_memory.py --rollouts 8 --calls 30 --cache-mib 0.1 --sample-every 60  # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
import uuid
from typing import Any

import msgspec
from _benchcommon import bare_session, load_average, machine_summary, start_server, synthetic_entry, table, total_line

from s3capture.records import coerce_entry, encode_entry
from s3capture.store import S3TokenStore

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE / 2**20


async def run(args: argparse.Namespace) -> tuple[list[list[Any]], str]:
    server = start_server("moto")  # also puts its credentials in the environment, where obstore reads them
    try:
        session, config = bare_session(server)
        async with session.client("s3", endpoint_url=server.endpoint_url, config=config) as bare:
            bucket = f"s3capture-mem-{uuid.uuid4().hex[:8]}"
            await bare.create_bucket(Bucket=bucket)
        # obstore takes a session's profile, not its keys: it reads the server's credentials from the environment.
        auth: dict[str, Any] = {} if args.transport == "obstore" else {"session": session}
        store = S3TokenStore(
            f"s3://{bucket}/mem",
            endpoint_url=server.endpoint_url,
            cache_bytes=args.cache_mib * 2**20,
            transport=args.transport,
            **auth,
        )
        template = synthetic_entry(args.tokens, generation_tokens=args.tokens // 2, call_id="mem")
        samples: list[list[Any]] = []
        largest: list[float] = []  # MiB of the largest cached object, per sample
        done = 0
        started = time.perf_counter()
        last_parent: dict[str, str] = {}

        def sample() -> None:
            gc.collect()
            largest.append(max((v.nbytes for v in store._cache._data.values()), default=0) / 2**20)
            samples.append(
                [
                    done,
                    rss_mib(),
                    store._cache.nbytes / 2**20,
                    len(store._cache),
                    len(store._call_keys),
                    getattr(store._call_keys, "nbytes", float("nan")) / 2**10,
                    len(store._fence_seen),
                    time.perf_counter() - started,
                ]
            )

        async def rollout(r: int) -> None:
            nonlocal done
            rid = f"mem-{r:05d}"
            for c in range(args.calls):
                cid = f"call-{c:03d}"
                parent = last_parent.get(rid)
                if parent is not None:  # resolve-like: the parent's entry through the cache (GET if evicted)
                    stored = await store._load(parent, parent.rsplit("/", 1)[-1][:-4])
                    assert stored is not None and stored.entry.model_call_id == f"call-{c - 1:03d}"
                entry = msgspec.structs.replace(template, rollout_id=rid, model_call_id=cid, response_id=f"{rid}/{cid}")
                await store.put(entry)
                record = coerce_entry(entry)
                import hashlib

                prefix = store.layout.rollout(rid)
                sha = hashlib.sha256(encode_entry(record)).hexdigest()
                last_parent[rid] = prefix + store.layout.entry_rel(prefix, record.continuation_fingerprint, cid, sha)
                done += 1
                if done % args.sample_every == 0:
                    sample()
            last_parent.pop(rid, None)
            snapshot = await store.freeze(rid)
            assert len(snapshot.entries) == args.calls and not snapshot.incomplete, snapshot.reasons[:3]

        sample()
        limit = asyncio.Semaphore(args.parallel)

        async def limited(r: int) -> None:
            async with limit:
                await rollout(r)

        await asyncio.gather(*(limited(r) for r in range(args.rollouts)))
        await store.close()
        sample()
        # The verdict: from the first sample with the cache full (no room for another object as
        # large as its largest; entries are all of one size here).
        full = next(
            (i for i, s in enumerate(samples) if s[3] and s[2] + largest[i] > args.cache_mib),
            None,
        )
        if full is None:
            verdict = "the cache never filled (raise --rollouts or lower --cache-mib)"
        else:
            after = [s[1] for s in samples[full:-1]] or [samples[-1][1]]
            spread = max(after) / min(after) - 1
            verdict = (
                f"after the cache filled (from {samples[full][0]:,} calls): RSS {min(after):.1f}-{max(after):.1f} MiB, "
                f"max/min - 1 = {spread * 100:.1f} % ({'flat: within 10 %' if spread <= 0.10 else 'NOT within 10 %'})"
            )
        return samples, verdict
    finally:
        server.stop()


HEADERS = [
    "calls",
    "RSS MiB",
    "cache MiB (own count)",
    "cached objects",
    "call-key rows",
    "call-key KiB (own count)",
    "fence times",
    "s",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=8, help="rollouts in flight at once (default 8)")
    parser.add_argument("--cache-mib", type=float, default=8.0, help="cache_bytes in MiB (default 8)")
    parser.add_argument(
        "--tokens", type=int, default=1100, help="tokens per entry (default 1100, like competitive_coding)"
    )
    parser.add_argument("--transport", default="aioboto3", help="the store's transport: aioboto3 (default) or obstore")
    parser.add_argument(
        "--sample-every",
        type=int,
        default=1000,
        help="calls between two RSS samples (default 1000; smaller: smoke test)",
    )
    args = parser.parse_args(argv)
    if args.sample_every < 1:
        parser.error("--sample-every must be at least 1")
    started, load_at_start = time.perf_counter(), load_average()
    print(f"# bench_memory\n\nmachine: {machine_summary()}\nload average at start: {load_at_start}\n", flush=True)
    samples, verdict = asyncio.run(run(args))
    print(
        f"### RSS over {args.rollouts:,} rollouts x {args.calls} calls ({args.transport} transport, cache_bytes {args.cache_mib:g} MiB, "
        f"{args.tokens:,}-token entries, {args.parallel} rollouts in flight; moto in its own process)\n"
    )
    print(table(HEADERS, [[s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]] for s in samples], digits=1))
    print(f"\n{verdict}\n")
    print(total_line(started, load_at_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
