#!/usr/bin/env python3
"""``S3TokenStore.freeze`` against its floor, in one interleaved run on one server.

For rollouts of 100 and 1,000 entries (written once with bare PUTs of the bytes ``put`` writes),
every repeat builds one fresh ``S3TokenStore``, warms its connection pool (a LIST and a parallel
GET wave of another rollout), and then runs, in an order that rotates from repeat to repeat:

* **floor, cold** -- a bare LIST of the rollout's prefix (every page) followed by GETs of every
  entry object, in parallel under the same bound as the store (``max_concurrency`` = 32), bodies
  read, all on *the store's own client* (``--transport``: aiobotocore calls on the aioboto3
  transport's client, ``obstore.list`` / ``get_async`` / ``put_async`` on the obstore transport's
  ``S3Store``; ``_benchcommon.BareOps``);
* **floor, warm** -- the bare LIST alone, same client;
* **fence PUT** -- one bare PUT of the fence bytes to a sibling key, same client (the round trip a
  freeze must add before its LIST: the fence orders it after every racing put);
* **cold freeze** -- ``freeze`` with an empty cache (the sealed manifest is deleted outside the
  timing, so every freeze is a first freeze that PUTs one: fence PUT, LIST, GETs, manifest PUT);
* **warm freeze** -- ``freeze`` with every entry in the cache and not yet handed out (the entries
  decoded into the cache outside the timing, as a writer's own puts or a resolve leave them);
* **repeat freeze** -- the same client freezing the unchanged rollout again (its entries were handed
  out already, so the nested parts of each are checked against their digest before a copy is
  handed out; the sealed manifest its freeze wrote is in place, so it writes the fence and LISTs).

Reported: medians over the repeats of wall time, of client CPU, and of the per-repeat ratios
freeze / floor (cold / (LIST + GETs), warm / LIST) and freeze / (floor + fence PUT). What the floor
includes, and what it leaves out, is written in docs/benchmarks.md ("Freeze floor").

Usage::

    python tools/bench_freeze.py                        # moto, 100 and 1,000 entries, ~2 minutes
    python tools/bench_freeze.py --servers moto,seaweedfs --repeats 9
    python tools/bench_freeze.py --quick                # a few seconds (smoke test)
    python tools/bench_freeze.py --servers seaweedfs --rtt-ms 10   # behind a 10 ms round trip
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import time
import uuid
from typing import Any

import msgspec
from _benchcommon import (
    BareOps,
    DelayProxy,
    bare_session,
    load_average,
    machine_summary,
    server_list,
    start_server,
    synthetic_entry,
    table,
    total_line,
)

from s3capture.records import coerce_entry, encode_entry
from s3capture.rollouts import FENCE_FROZEN
from s3capture.store import S3TokenStore

CONCURRENCY = 32


async def bare_list(client: Any, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    token = None
    while True:
        kwargs = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1000}
        if token:
            kwargs["ContinuationToken"] = token
        page = await client.list_objects_v2(**kwargs)
        keys.extend(item["Key"] for item in page.get("Contents", ()))
        if not page.get("IsTruncated"):
            return keys
        token = page["NextContinuationToken"]


async def bare_gets(client: Any, bucket: str, keys: list[str]) -> int:
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(key: str) -> int:
        async with limit:
            response = await client.get_object(Bucket=bucket, Key=key)
            async with response["Body"] as stream:
                return len(await stream.read())

    return sum(await asyncio.gather(*(one(k) for k in keys)))


async def write_rollout(
    client: Any, bucket: str, store: S3TokenStore, rollout_id: str, n: int, tokens: int
) -> dict[str, tuple[bytes, str]]:
    """Entries written with bare PUTs (the objects ``put`` would write); returns key -> (object, sha)."""
    template = synthetic_entry(tokens, generation_tokens=tokens // 2, call_id="frz")
    prefix = store.layout.rollout(rollout_id)
    objects: dict[str, tuple[bytes, str]] = {}
    for i in range(n):
        entry = coerce_entry(msgspec.structs.replace(template, rollout_id=rollout_id, model_call_id=f"call-{i:05d}"))
        payload = encode_entry(entry)
        sha = hashlib.sha256(payload).hexdigest()
        key = prefix + store.layout.entry_rel(prefix, entry.continuation_fingerprint, entry.model_call_id, sha)
        objects[key] = (store._encode_object(payload, ()), sha)
    limit = asyncio.Semaphore(CONCURRENCY)

    async def put(key: str, body: bytes) -> None:
        async with limit:
            await client.put_object(Bucket=bucket, Key=key, Body=body)

    await asyncio.gather(*(put(k, body) for k, (body, _) in objects.items()))
    return objects


async def measure(fn: Any) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    await fn()
    return time.perf_counter() - wall, time.process_time() - cpu


async def peer_gets(bare: BareOps, keys: list[str]) -> int:
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(key: str) -> int:
        async with limit:
            return len(await bare.get(key) or b"")

    return sum(await asyncio.gather(*(one(k) for k in keys)))


async def drop_manifests(store: S3TokenStore, client: Any, bucket: str, prefix: str) -> None:
    settle = getattr(store, "settle", None)
    if settle is not None:
        await settle()
    for key in await bare_list(client, bucket, prefix + "snap/"):
        await client.delete_object(Bucket=bucket, Key=key)


async def run_size(
    server: Any,
    session: Any,
    config: Any,
    bare: Any,
    bucket: str,
    n: int,
    repeats: int,
    tokens: int,
    transport: str = "aioboto3",
    endpoint: str | None = None,
) -> list[list[Any]]:
    """One size's rows. ``endpoint``: where the store and its bare peer send requests (the server,
    or a delay proxy in front of it); the rollout is written and cleaned up directly."""
    endpoint = endpoint or server.endpoint_url
    url = f"s3://{bucket}/bench"
    # obstore takes a session's profile, not its keys: the server's credentials are in this
    # process's environment (``_benchcommon.start_server``).
    store_kwargs: dict[str, Any] = (
        {"transport": transport} if transport == "obstore" else {"session": session, "transport": transport}
    )
    writer = S3TokenStore(url, endpoint_url=endpoint, **store_kwargs)
    rollout_id = f"frz-{n}-{uuid.uuid4().hex[:6]}"
    objects = await write_rollout(bare, bucket, writer, rollout_id, n, tokens)
    warm_rollout = f"warm-{uuid.uuid4().hex[:6]}"
    warm_objects = await write_rollout(bare, bucket, writer, warm_rollout, CONCURRENCY, tokens)
    prefix = writer.layout.rollout(rollout_id)
    # The fence exists from the first freeze on; write it now so every LIST sees the same keys.
    await bare.put_object(Bucket=bucket, Key=prefix + "fence", Body=FENCE_FROZEN)
    await writer.close()
    kinds = ["floor cold", "floor warm", "fence PUT", "freeze cold", "freeze warm", "freeze repeat"]
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(repeats + 1):  # the first repeat is a warm-up, not counted
        store = S3TokenStore(url, endpoint_url=endpoint, max_concurrency=CONCURRENCY, **store_kwargs)
        peer = await BareOps.of(store.transport)  # bare requests on the store's own client
        client = bare  # the tool's own aioboto3 client, for clean-up outside the timings
        await peer.list(store.layout.rollout(warm_rollout))
        await peer_gets(peer, list(warm_objects))  # open the pool's connections
        keys = list(objects)

        async def floor_cold() -> None:
            listed = await peer.list(prefix)
            assert len(listed) >= n
            await peer_gets(peer, [k for k in listed if k in objects])

        async def floor_warm() -> None:
            assert len(await peer.list(prefix)) >= n

        async def fence_put() -> None:
            await peer.put(f"bench/fence-bench/{rollout_id}", FENCE_FROZEN)

        async def freeze_checked() -> None:
            snapshot = await store.freeze(rollout_id)
            if len(snapshot.entries) != n or snapshot.incomplete:
                raise SystemExit(f"freeze returned {len(snapshot.entries)} entries, reasons {snapshot.reasons[:3]}")

        def prime() -> None:
            for key in keys:
                body, sha = objects[key]
                store._cache.put(key, store._decode_object(body, sha))

        # Rotate the order of the three groups (floor, cold freeze, warm freeze) each repeat.
        groups = [("floor", None), ("cold", None), ("warm", None)]
        order = groups[r % 3 :] + groups[: r % 3]
        for group, _ in order:
            if group == "floor":
                for kind, fn in (("floor cold", floor_cold), ("floor warm", floor_warm), ("fence PUT", fence_put)):
                    w, c = await measure(fn)
                    if r:
                        wall[kind].append(w)
                        cpu[kind].append(c)
            elif group == "cold":
                store._cache.discard_prefix(prefix)
                await drop_manifests(store, client, bucket, prefix)
                w, c = await measure(freeze_checked)
                await drop_manifests(store, client, bucket, prefix)  # the background manifest, outside the timing
                if r:
                    wall["freeze cold"].append(w)
                    cpu["freeze cold"].append(c)
            else:
                store._cache.discard_prefix(prefix)
                prime()
                await drop_manifests(store, client, bucket, prefix)
                w, c = await measure(freeze_checked)
                if r:
                    wall["freeze warm"].append(w)
                    cpu["freeze warm"].append(c)
                # The same client again, nothing changed: its entries were handed out, and the
                # manifest its freeze wrote is in place.
                w, c = await measure(freeze_checked)
                await drop_manifests(store, client, bucket, prefix)
                if r:
                    wall["freeze repeat"].append(w)
                    cpu["freeze repeat"].append(c)
        await store.close()
    med = {k: statistics.median(v) for k, v in wall.items()}
    medcpu = {k: statistics.median(v) for k, v in cpu.items()}

    def ratio(a: str, *floor: str) -> float:
        return statistics.median(wall[a][i] / sum(wall[f][i] for f in floor) for i in range(repeats))

    rows = [
        [
            f"{n:,}",
            "bare LIST + parallel GETs (floor, cold)",
            med["floor cold"] * 1000,
            medcpu["floor cold"] * 1000,
            "1.00x",
            "",
        ],
        [f"{n:,}", "bare LIST (floor, warm)", med["floor warm"] * 1000, medcpu["floor warm"] * 1000, "1.00x", ""],
        [f"{n:,}", "bare PUT of the fence", med["fence PUT"] * 1000, medcpu["fence PUT"] * 1000, "", ""],
        [
            f"{n:,}",
            "freeze, cold (empty cache)",
            med["freeze cold"] * 1000,
            medcpu["freeze cold"] * 1000,
            f"{ratio('freeze cold', 'floor cold'):.2f}x",
            f"{ratio('freeze cold', 'floor cold', 'fence PUT'):.2f}x",
        ],
        [
            f"{n:,}",
            "freeze, warm (entries cached)",
            med["freeze warm"] * 1000,
            medcpu["freeze warm"] * 1000,
            f"{ratio('freeze warm', 'floor warm'):.2f}x",
            f"{ratio('freeze warm', 'floor warm', 'fence PUT'):.2f}x",
        ],
        [
            f"{n:,}",
            "freeze, same client again (unchanged: fence PUT, LIST, confirming LIST; manifest in place)",
            med["freeze repeat"] * 1000,
            medcpu["freeze repeat"] * 1000,
            f"{ratio('freeze repeat', 'floor warm'):.2f}x",
            f"{ratio('freeze repeat', 'floor warm', 'fence PUT'):.2f}x",
        ],
    ]
    return rows


HEADERS = ["entries", "operation", "wall ms (median)", "client CPU ms (median)", "÷ floor", "÷ (floor + fence PUT)"]


async def run_server(kind: str, args: argparse.Namespace) -> str:
    server = start_server(kind)
    proxy = None
    try:
        endpoint = server.endpoint_url
        if args.rtt_ms > 0:
            proxy = DelayProxy(server.port, args.rtt_ms)
            endpoint = proxy.endpoint_url
        session, config = bare_session(server)
        async with session.client("s3", endpoint_url=server.endpoint_url, config=config) as bare:
            bucket = f"s3capture-bench-{uuid.uuid4().hex[:8]}"
            await bare.create_bucket(Bucket=bucket)
            rows: list[list[Any]] = []
            for n in args.sizes:
                rows.extend(
                    await run_size(
                        server, session, config, bare, bucket, n, args.repeats, args.tokens, args.transport, endpoint
                    )
                )
        where = f"{kind} behind a {args.rtt_ms:g} ms round-trip delay proxy" if proxy else kind
        return (
            f"### freeze vs its floor on {where} ({args.transport} transport, {args.repeats} repeats, entries of {args.tokens} tokens)\n\n"
            + table(HEADERS, rows)
        )
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="moto", help="comma-separated: moto, seaweedfs (default moto)")
    parser.add_argument("--sizes", default="100,1000", help="entries per rollout (default 100,1000)")
    parser.add_argument("--repeats", type=int, default=7, help="measured repeats per size (default 7)")
    parser.add_argument(
        "--tokens", type=int, default=64, help="tokens per entry (default 64: small objects, so the requests dominate)"
    )
    parser.add_argument("--quick", action="store_true", help="one repeat of 50 entries")
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="send the store's and the floor's requests through tools/_delayproxy.py, which adds this "
        "round-trip time to every exchange, as a store off loopback does (default 0: loopback)",
    )
    parser.add_argument(
        "--transport",
        default="aioboto3",
        help="the store's transport, and the client of the floor: aioboto3 (default) or obstore",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = "50", 1
    args.sizes = [int(x) for x in args.sizes.split(",")]
    args.servers = server_list(parser, args.servers)
    started, load_at_start = time.perf_counter(), load_average()
    print(f"# bench_freeze\n\nmachine: {machine_summary()}\nload average at start: {load_at_start}\n", flush=True)
    for kind in args.servers:
        print(asyncio.run(run_server(kind, args)), flush=True)
        print()
    print(total_line(started, load_at_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
