#!/usr/bin/env python3
"""``s3capture export`` against a bare parallel reader of the same objects, and its memory, in one run.

For each size (default 1,000 and 10,000 rollouts of ``--calls`` model calls) the tool captures the
rollouts under a root of their own on a local server, the way model servers do (``begin_call`` and
``put`` per call through ``S3TokenStore``, ``--storage delta`` or ``full`` prompts), and freezes
them (a sealed manifest each). The token ids are real: every call's generation (ids and
log-probabilities, 785 to 1,277 tokens) is one of the NeMo Gym example file
``competitive_coding.jsonl``'s, its first prompt (109 tokens) one of that file's prompts, and the
environment turn between two calls the first 64 ids of another prompt; the items (messages, tool
calls) are ``s3capture.replay.synthetic_rollouts``'s. Then, ``--repeats`` times, in alternating order:

* **bare reader** -- the floor: one LIST of the root (every page, streamed) and a GET of every
  object the export reads (each rollout's entry objects and its sealed manifest), the GETs handed
  page by page to ``--workers`` spawned processes that each keep ``max(8, min(64, 4 x
  concurrency))`` GETs in flight (the bound of the export's per-worker source client), bodies read
  and dropped; on the ``--transport``'s own client (``_benchcommon.BareOps``: aiobotocore calls,
  or obstore's ``get_async``), no s3capture code. Timed from the first LIST to the last body,
  process start-up included (as in the export's wall time);
* **export** -- ``s3capture export ROOT --out <temp folder>`` (local engine, ``--workers``,
  ``--concurrency``, everything else default: Parquet, Gym's builder when ``nemo_gym`` is
  importable) in a child process; its wall time is the summary's (from the call to ``export``,
  worker start-up included, interpreter start-up not), its requests the summary's (the transports'
  request hooks). Its peak RSS is sampled from ``/proc/<pid>/status`` (``VmHWM``, each process's
  own high-water mark) of the export process and of each worker process, every 0.25 s.

Printed: per size, throughput (rollouts/s and MB/s of stored objects) of both, export ÷ bare
reader (target >= 0.9), requests per rollout by kind for both, and the peak RSS of the export's
parent and of its largest worker (target: the same at 1,000 and 10,000 rollouts). ``--profile``
also runs one shard's ``export_shard`` under cProfile in this process (``asyncio.to_thread`` made
inline so the build's CPU shows) and prints the top functions.

Usage::

    python tools/bench_export.py                                # moto, 1,000 and 10,000 rollouts of 4 calls, delta
    python tools/bench_export.py --servers moto,seaweedfs --transport obstore --storage full
    python tools/bench_export.py --quick                        # a few seconds (smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from _benchcommon import (
    DATA_DIR,
    ROOT,
    BareOps,
    DelayProxy,
    build_entry,
    load_average,
    machine_summary,
    result_line,
    server_cpu_seconds,
    server_list,
    start_server,
    table,
    total_line,
    transport_list,
)

ENV_TOKENS = 64


# --------------------------------------------------------------------------- the rollouts
def example_calls() -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, generation, log-probabilities) of each call of ``competitive_coding.jsonl``."""
    from s3capture.replay import load_rollouts

    path = DATA_DIR / "competitive_coding.jsonl"
    if not path.exists():
        raise SystemExit(f"data file {path} not found (set S3CAPTURE_BENCH_DATA to the directory of the Gym examples)")
    out = []
    for rollout in load_rollouts([path]):
        for call in rollout.calls:
            if call.synthetic_tokens:
                raise SystemExit(f"{path}: {call.model_call_id} has no real token ids")
            out.append((list(call.prompt_token_ids), list(call.generation_token_ids), list(call.generation_log_probs)))
    return out


def rollout_entries(
    index: int, calls: int, storage: str, examples: list[tuple[list[int], list[int], list[float]]]
) -> list[Any]:
    """The entries of rollout ``index``: a contiguous chain of ``calls`` calls with real token ids."""
    from s3capture.replay import synthetic_rollouts

    shape = synthetic_rollouts(1, calls, seed=index, prompt_len=1, gen_len=1)[0]
    entries = []
    cumulative: list[int] = []
    previous: str | None = None
    for k, call in enumerate(shape.calls):
        prompt_source, generation, log_probs = examples[(index + k) % len(examples)]
        if k == 0:
            prompt = list(prompt_source)
        else:
            prompt = cumulative + list(examples[(index + k + 1) % len(examples)][0][:ENV_TOKENS])
        entries.append(
            build_entry(
                shape.rollout_id,
                call.model_call_id,
                call.request_items,
                call.output_items,
                prompt,
                generation,
                log_probs,
                parent_call_id=previous,
                parent_len=len(cumulative) if (storage == "delta" and previous) else None,
            )
        )
        cumulative = prompt + list(generation)
        previous = call.model_call_id
    return entries


async def capture(
    url: str, endpoint: str, transport: str, n: int, calls: int, storage: str, examples: list
) -> dict[str, Any]:
    """Capture and freeze ``n`` rollouts under ``url``; what it took."""
    from s3capture.store import S3TokenStore

    started = time.perf_counter()
    limit = asyncio.Semaphore(64)
    async with S3TokenStore(
        url, endpoint_url=endpoint, transport=transport, max_concurrency=64, cache_bytes=8 * 2**20
    ) as store:

        async def one(index: int) -> None:
            async with limit:
                entries = rollout_entries(index, calls, storage, examples)
                for entry in entries:
                    await store.begin_call(entry.rollout_id, entry.model_call_id)
                    await store.put(entry)
                snapshot = await store.freeze(entries[0].rollout_id)
                if snapshot.incomplete or len(snapshot.entries) != calls:
                    raise SystemExit(f"{entries[0].rollout_id}: frozen incomplete {snapshot.reasons[:3]}")

        await asyncio.gather(*(one(i) for i in range(n)))
        infos = [info async for info in store.rollouts()]
        requests = dict(store.request_counts)
    sealed = sum(1 for info in infos if info.state == "frozen" and info.sealed)
    if sealed != n:
        raise SystemExit(f"{url}: {sealed} of {n} rollouts frozen and sealed after the capture")
    return {
        "seconds": time.perf_counter() - started,
        "objects": sum(info.objects for info in infos),
        "bytes": sum(info.bytes for info in infos),
        "requests": requests,
    }


# --------------------------------------------------------------------------- the bare reader
_BARE: dict[str, Any] = {}


def _bare_init(bucket: str, endpoint: str, transport: str, bound: int) -> None:
    from s3capture.transport import make_transport

    loop = asyncio.new_event_loop()
    made = make_transport(transport, bucket, endpoint_url=endpoint, max_concurrency=bound)
    _BARE.update(loop=loop, ops=loop.run_until_complete(BareOps.of(made)), bound=bound)


def _bare_get_all(keys: list[str]) -> tuple[int, int, dict[str, int]]:
    """GET every key in this worker process, ``bound`` at once; (objects, bytes, requests)."""
    ops: BareOps = _BARE["ops"]
    before = collections.Counter(ops.counts)

    async def run() -> tuple[int, int]:
        limit = asyncio.Semaphore(_BARE["bound"])

        async def one(key: str) -> int:
            async with limit:
                body = await ops.get(key)
                if body is None:
                    raise RuntimeError(f"{key} vanished")
                return len(body)

        sizes = await asyncio.gather(*(one(k) for k in keys))
        return len(sizes), sum(sizes)

    count, size = _BARE["loop"].run_until_complete(run())
    return count, size, dict(collections.Counter(ops.counts) - before)


async def list_pages(ops: BareOps, prefix: str):
    """The keys under ``prefix``, one list per LIST page (1,000 keys), counted in ``ops.counts``."""
    if ops.name == "obstore":
        import obstore

        first = True
        async for batch in obstore.list(ops.client[0], prefix, chunk_size=1000):
            if not first:
                ops.counts["ListObjectsV2"] += 1
            first = False
            yield [item["path"] for item in batch]
        ops.counts["ListObjectsV2"] += 1
        return
    token = None
    while True:
        params: dict[str, Any] = {"Bucket": ops.bucket, "Prefix": prefix, "MaxKeys": 1000}
        if token:
            params["ContinuationToken"] = token
        ops.counts["ListObjectsV2"] += 1
        page = await ops.client.list_objects_v2(**params)
        yield [item["Key"] for item in page.get("Contents", ())]
        if not page.get("IsTruncated"):
            return
        token = page["NextContinuationToken"]


def read_by_export(key: str) -> bool:
    """Whether a sealed export GETs this key: an entry object or a sealed manifest."""
    return "/log/e/" in key or "/snap/" in key


async def bare_read(bucket: str, root: str, endpoint: str, transport: str, workers: int, bound: int) -> dict[str, Any]:
    from s3capture.transport import make_transport

    started, cpu, children = time.perf_counter(), time.process_time(), _children_cpu()
    lister = make_transport(transport, bucket, endpoint_url=endpoint, max_concurrency=bound)
    ops = await BareOps.of(lister)
    ctx = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_bare_init, initargs=(bucket, endpoint, transport, bound)
    )
    futures = []
    try:
        async for keys in list_pages(ops, f"{root}/rollouts/"):
            wanted = [k for k in keys if read_by_export(k)]
            step = -(-len(wanted) // workers) if wanted else 1
            for i in range(0, len(wanted), step):  # each page spread over every worker
                futures.append(asyncio.wrap_future(pool.submit(_bare_get_all, wanted[i : i + step])))
        results = await asyncio.gather(*futures)
        seconds = time.perf_counter() - started
    finally:
        pool.shutdown(wait=True)
        await lister.close()
    client_cpu = time.process_time() - cpu + _children_cpu() - children
    requests = collections.Counter(ops.counts)
    for _, _, counts in results:
        requests.update(counts)
    return {
        "seconds": seconds,
        "objects": sum(r[0] for r in results),
        "bytes": sum(r[1] for r in results),
        "requests": dict(requests),
        "client_cpu": client_cpu,
    }


def server_cpu(server: Any) -> float:
    """CPU seconds of the server's processes (every helper of a SeaweedFS or Ceph server too)."""
    return sum(server_cpu_seconds(pid) for pid in getattr(server, "pids", (server.pid,)))


def _children_cpu() -> float:
    """User + system CPU seconds of this process's reaped children (and theirs)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------- the export, in a child process
def _read_proc(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as handle:
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read_proc(int(entry), "stat")
            if stat:
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found.extend(children)
        frontier = children
    return found


def _hwm_kib(pid: int) -> int:
    for line in _read_proc(pid, "status").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def run_export(
    url: str, endpoint: str, transport: str, workers: int, concurrency: int, out: str, extra: list[str]
) -> dict[str, Any]:
    env = dict(os.environ)
    env["S3CAPTURE_TRANSPORT"] = transport
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    command = [
        sys.executable,
        "-m",
        "s3capture.cli",
        "export",
        url,
        "--out",
        out,
        "--endpoint",
        endpoint,
        "--json",
        "--workers",
        str(workers),
        "--concurrency",
        str(concurrency),
        *extra,
    ]
    started, children = time.perf_counter(), _children_cpu()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peaks: dict[int, int] = {}
    kinds: dict[int, str] = {process.pid: "parent"}
    stop = threading.Event()

    def sample() -> None:  # VmHWM is each process's own high-water mark: a sample every 0.25 s keeps it
        scanned = 0.0
        while not stop.is_set():
            if time.monotonic() - scanned >= 1.0:  # the /proc scan costs CPU: once a second
                scanned = time.monotonic()
                for pid in _descendants(process.pid):
                    if pid not in kinds:
                        kinds[pid] = "worker" if "spawn_main" in _read_proc(pid, "cmdline") else "other"
            for pid in list(kinds):
                peaks[pid] = max(peaks.get(pid, 0), _hwm_kib(pid))
            stop.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = process.communicate()
    stop.set()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"export failed ({process.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    summary = json.loads(stdout)
    if not summary["ok"] or summary["failed"] or summary["skipped"]:
        raise SystemExit(f"export did not export everything: {stdout[:3000]}")
    workers_hwm = [kib for pid, kib in peaks.items() if kinds.get(pid) == "worker"]
    return {
        "seconds": summary["wall_seconds"],
        "process_seconds": time.perf_counter() - started,
        "client_cpu": _children_cpu() - children,  # the export process and its workers (interpreter start-up included)
        "summary": summary,
        "parent_mib": peaks.get(process.pid, 0) / 1024,
        "worker_mib": max(workers_hwm, default=0) / 1024,
        "workers_seen": len(workers_hwm),
    }


# --------------------------------------------------------------------------- profile
def profile_shard(url: str, endpoint: str, transport: str, concurrency: int, rollouts: int, top: int = 30) -> str:
    """One shard of ``rollouts`` through ``export_shard`` under cProfile, in this process."""
    import cProfile
    import io
    import pstats

    from s3capture.export import ExportJob, _close_clients, export_shard
    from s3capture.export.shard import ListedRollout
    from s3capture.store import S3TokenStore

    async def listing() -> list[Any]:
        # What the export's parent hands its workers: each rollout with its listed objects, so the
        # profiled shard reads without listing again (plain RolloutInfos would profile 2 LISTs
        # and 2 confirming LISTs per rollout that the measured export never sends).
        async with S3TokenStore(url, endpoint_url=endpoint, transport=transport) as store:
            out = []
            async for info, objects in store.rollouts_listed(None):
                out.append(ListedRollout(info, tuple(objects)))
                if len(out) >= rollouts:
                    break
            return out

    infos = asyncio.run(listing())
    folder = tempfile.mkdtemp(prefix="bench-export-profile-")
    job = ExportJob(url=url, dest=folder, concurrency=concurrency, endpoint_url=endpoint, transport=transport)

    async def inline(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    original = asyncio.to_thread
    asyncio.to_thread = inline  # the build's CPU in this thread, where cProfile sees it
    try:
        export_shard(job, 0, infos[:1])  # clients opened outside the profile
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        result = export_shard(job, 1, infos)
        profiler.disable()
        seconds = time.perf_counter() - started
    finally:
        asyncio.to_thread = original
        _close_clients()
        shutil.rmtree(folder, ignore_errors=True)
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
    head = (
        f"export_shard of {len(infos)} rollouts ({result.rows} rows, {result.tokens:,} tokens) in {seconds:.2f} s, "
        f"profiled; its requests: {dict(sorted(result.requests.items()))}\n"
    )
    return head + "\n".join(line for line in stream.getvalue().splitlines() if line.strip())


# --------------------------------------------------------------------------- one server
def per_rollout(requests: dict[str, int], n: int) -> str:
    return ", ".join(f"{kind} {count / n:.2f}" for kind, count in sorted(requests.items()))


async def measure(
    server: Any, bucket: str, root: str, n: int, transport: str, args: argparse.Namespace, scratch: str
) -> dict[str, Any]:
    """The bare reader and the export of one captured root on one transport, ``args.repeats`` times
    (both through one ``--rtt-ms`` delay proxy when asked: a store that is not on loopback)."""
    proxy = DelayProxy(server.port, args.rtt_ms) if args.rtt_ms > 0 else None
    try:
        return await _measure(
            proxy.endpoint_url if proxy else server.endpoint_url, server, bucket, root, n, transport, args, scratch
        )
    finally:
        if proxy is not None:
            proxy.stop()


async def _measure(
    endpoint: str, server: Any, bucket: str, root: str, n: int, transport: str, args: argparse.Namespace, scratch: str
) -> dict[str, Any]:
    bound = max(8, min(64, 4 * args.concurrency))
    url = f"s3://{bucket}/{root}"
    if not args.no_warmup:
        await bare_read(bucket, root, endpoint, transport, args.workers, bound)  # warm-up, not counted
    bares, exports = [], []
    for repeat in range(args.repeats):
        order = ("bare", "export") if repeat % 2 == 0 else ("export", "bare")
        for what in order:
            server_before = server_cpu(server)
            if what == "bare":
                bares.append(await bare_read(bucket, root, endpoint, transport, args.workers, bound))
                bares[-1]["server_cpu"] = server_cpu(server) - server_before
            else:
                out = os.path.join(scratch, f"out-{n}-{transport}-{repeat}")
                exports.append(
                    await asyncio.to_thread(
                        run_export, url, endpoint, transport, args.workers, args.concurrency, out, args.export_args
                    )
                )
                exports[-1]["server_cpu"] = server_cpu(server) - server_before
                shutil.rmtree(out, ignore_errors=True)
        bare, done = bares[-1], exports[-1]  # a line per repeat, so a run cut short still leaves its numbers
        print(
            f"  {n:,} rollouts, {transport}, repeat {repeat + 1}: bare reader {bare['seconds']:.1f} s "
            f"(client CPU {bare['client_cpu'] * 1000 / n:.1f} ms/rollout, server {bare['server_cpu'] * 1000 / n:.1f}), "
            f"export {done['seconds']:.1f} s (client CPU {done['client_cpu'] * 1000 / n:.1f} ms/rollout, server "
            f"{done['server_cpu'] * 1000 / n:.1f}; peak RSS parent {done['parent_mib']:.0f} MiB, worker {done['worker_mib']:.0f} MiB), "
            f"ratio {bare['seconds'] / done['seconds']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    return {"bares": bares, "exports": exports}


async def run_server(kind: str, transports: list[str], args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """Capture every size once on a fresh ``kind`` server, then measure it on each transport."""
    import boto3

    server = start_server(kind)
    examples = example_calls()
    results: dict[str, Any] = {}
    measured: dict[tuple[str, int], dict[str, Any]] = {}
    captured: dict[int, dict[str, Any]] = {}
    scratch = tempfile.mkdtemp(prefix="bench-export-")
    try:
        for n in args.sizes:
            # A bucket per size: moto's LIST scans the whole bucket, so a shared one would slow the smaller run.
            bucket = f"s3capture-bench-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", **server.client_kwargs()).create_bucket(Bucket=bucket)
            root = f"n{n}"
            capture_with = "obstore" if "obstore" in transports else transports[0]  # the quicker writer; not measured
            made = captured[n] = await capture(
                f"s3://{bucket}/{root}", server.endpoint_url, capture_with, n, args.calls, args.storage, examples
            )
            print(
                f"captured and froze {n:,} rollouts on {kind} ({made['objects']:,} objects, {made['bytes'] / 1e6:.1f} MB "
                f"stored) in {made['seconds']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            for transport in transports:
                measured[(transport, n)] = await measure(server, bucket, root, n, transport, args, scratch)
        if args.profile:
            profiled = await asyncio.to_thread(
                profile_shard,
                f"s3://{bucket}/{root}",
                server.endpoint_url,
                transports[0],
                args.concurrency,
                min(256, args.sizes[-1]),
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        server.stop()

    text = []
    for transport in transports:
        lines = [
            f"### export vs a bare reader on {kind} ({transport} transport, {args.calls} calls per rollout, "
            f"{args.storage} prompts, --workers {args.workers} --concurrency {args.concurrency}, {args.repeats} repeats"
            + (f", every request behind a {args.rtt_ms:g} ms round-trip delay proxy" if args.rtt_ms > 0 else "")
            + ")\n"
        ]
        rows, request_rows, memory_rows = [], [], []
        for n in args.sizes:
            bares, exports = measured[(transport, n)]["bares"], measured[(transport, n)]["exports"]
            bare_s = statistics.median(b["seconds"] for b in bares)
            export_s = statistics.median(e["seconds"] for e in exports)
            ratios = [bares[i]["seconds"] / exports[i]["seconds"] for i in range(len(exports))]
            ratio = statistics.median(ratios)
            summary = exports[-1]["summary"]
            assert summary["exported"] == n, summary
            got = bares[-1]["requests"].get("GetObject", 0)
            if got != summary["requests"].get("source:GetObject", 0):
                print(
                    f"note: the bare reader sent {got} GETs, the export {summary['requests'].get('source:GetObject')}",
                    file=sys.stderr,
                )
            mb = captured[n]["bytes"] / 1e6
            cpu = lambda runs, key: statistics.median(r[key] for r in runs) * 1000 / n  # noqa: E731 - ms per rollout
            rows.append(
                [
                    f"{n:,}",
                    "bare reader: LIST root + GET entries and sealed manifests",
                    bare_s,
                    n / bare_s,
                    mb / bare_s,
                    cpu(bares, "client_cpu"),
                    cpu(bares, "server_cpu"),
                    "1.00x",
                ]
            )
            rows.append(
                [
                    f"{n:,}",
                    "s3capture export (local engine, Parquet)",
                    export_s,
                    n / export_s,
                    mb / export_s,
                    cpu(exports, "client_cpu"),
                    cpu(exports, "server_cpu"),
                    f"{ratio:.2f}x" + ("" if ratio >= 0.9 else " (MISS: target 0.9)"),
                ]
            )
            source = {k.split(":", 1)[1]: v for k, v in summary["requests"].items() if k.startswith("source:")}
            dest = {k: v for k, v in summary["requests"].items() if k.startswith("dest:")}
            request_rows.append([f"{n:,}", "bare reader", per_rollout(bares[-1]["requests"], n)])
            request_rows.append(
                [f"{n:,}", "export (source)", per_rollout(source, n) + (f"; {per_rollout(dest, n)}" if dest else "")]
            )
            parent = max(e["parent_mib"] for e in exports)
            worker = max(e["worker_mib"] for e in exports)
            memory_rows.append(
                [
                    f"{n:,}",
                    parent,
                    worker,
                    exports[-1]["workers_seen"],
                    f"{summary['trajectories']:,}",
                    f"{summary['tokens']:,}",
                    f"{summary['bytes_written'] / 1e6:.1f}",
                ]
            )
            results[f"{kind}/{transport}/{n}"] = {
                "ratio": round(ratio, 3),
                "ratios": [round(r, 3) for r in ratios],
                "bare_s": round(bare_s, 2),
                "export_s": round(export_s, 2),
                "parent_mib": round(parent, 1),
                "worker_mib": round(worker, 1),
                "export_client_cpu_ms": round(cpu(exports, "client_cpu"), 2),
                "bare_client_cpu_ms": round(cpu(bares, "client_cpu"), 2),
                "requests_per_rollout": {k: round(v / n, 3) for k, v in summary["requests"].items()},
            }
        lines.append(
            table(
                [
                    "rollouts",
                    "reader",
                    "wall s (median)",
                    "rollouts/s",
                    "MB/s (stored)",
                    "client CPU ms/rollout",
                    "server CPU ms/rollout",
                    "÷ bare reader",
                ],
                rows,
            )
        )
        lines.append(
            "\nrequests per rollout, by kind (export: the summary's counts, from the transports' request hooks):\n"
        )
        lines.append(table(["rollouts", "reader", "requests per rollout"], request_rows))
        lines.append("\npeak RSS of the export (VmHWM, highest over the repeats):\n")
        lines.append(
            table(
                ["rollouts", "parent MiB", "largest worker MiB", "workers", "trajectories", "tokens", "Parquet MB"],
                memory_rows,
            )
        )
        if len(memory_rows) > 1:
            low, high = memory_rows[0], memory_rows[-1]
            growth = max(high[1] / low[1], high[2] / low[2]) if low[1] and low[2] else float("nan")
            verdict = "flat" if growth <= 1.15 else "GROWS"
            lines.append(
                f"\nRSS at {high[0]} ÷ at {low[0]} rollouts: parent {high[1] / low[1]:.2f}x, worker {high[2] / low[2]:.2f}x "
                f"({verdict}; target: flat, <= 1.15x)"
            )
            results[f"{kind}/{transport}/rss_growth"] = round(growth, 3)
        text.append("\n".join(lines))
    if args.profile:
        text.append("cProfile of one shard's export_shard (top functions by own time):\n\n```\n" + profiled + "\n```")
    return "\n\n".join(text), results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--servers", default="moto", help="comma-separated: moto, seaweedfs, ceph, or all (default moto)"
    )
    parser.add_argument(
        "--transport",
        default="aioboto3",
        help="comma-separated transports of both readers: aioboto3 (default), obstore",
    )
    parser.add_argument("--sizes", default="1000,10000", help="rollouts per run (default 1000,10000)")
    parser.add_argument("--calls", type=int, default=4, help="model calls per rollout (default 4)")
    parser.add_argument(
        "--storage", choices=("delta", "full"), default="delta", help="how prompts are stored (default delta)"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="export worker processes, and the bare reader's (default 2)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="export --concurrency (default 8)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="measured repeats per size, after one warm-up read (default 2)"
    )
    parser.add_argument(
        "--export-args", default="", help="more 's3capture export' options, e.g. '--build-with builtin'"
    )
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="add this round-trip time to every request of both readers (tools/_delayproxy.py; default 0: loopback)",
    )
    parser.add_argument("--profile", action="store_true", help="also cProfile one shard of export_shard")
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the uncounted warm-up read before the repeats (numbers are noisier)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="10 and 30 rollouts of 2 calls, one repeat, no warm-up (smoke test)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.calls, args.repeats, args.no_warmup = "10,30", 2, 1, True
    args.sizes = [int(x) for x in args.sizes.split(",")]
    args.export_args = args.export_args.split()
    args.servers = server_list(parser, args.servers)
    transports = transport_list(parser, args.transport)
    started, load_at_start = time.perf_counter(), load_average()
    print(f"# bench_export\n\nmachine: {machine_summary()}\nload average at start: {load_at_start}\n", flush=True)
    results: dict[str, Any] = {}
    for kind in args.servers:
        text, found = asyncio.run(run_server(kind, transports, args))
        results.update(found)
        print(text + "\n", flush=True)
    print(result_line("bench_export", results))
    print(total_line(started, load_at_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
