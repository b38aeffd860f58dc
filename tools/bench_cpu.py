#!/usr/bin/env python3
"""Client CPU per entry, stored bytes per token and memory of a freeze: s3capture against NeMo Gym.

Three measurements, each against NeMo Gym 0.7.0 as the peer in the same run:

* **CPU per entry** (``time.process_time``, no S3): encoding an entry for storage and decoding it
  back, on the real ``competitive_coding`` entries and on synthetic 8k- and 32k-token entries.
  s3capture: ``coerce_entry`` + ``encode_entry`` + zstd compression, and zstd decompression +
  ``decode_entry``. Gym: ``TokenEntry.model_validate(dict)`` + ``model_dump(mode="json")`` +
  ``orjson.dumps(..., OPT_SORT_KEYS)``, and ``orjson.loads`` + ``model_validate``. Further rows show
  the whole client CPU of ``S3TokenStore.put`` (SHA-256 and envelope included) for an s3capture
  entry and for a Gym pydantic entry (what Gym's capture path hands a sink), against the CPU of
  Gym's file store ``append`` (``model_dump`` + ``orjson`` + SHA-256), and the full s3capture reader
  (envelope, SHA-256 check, and ``entry_type="gym"`` conversion). Paths are interleaved, each cell is
  the median of several repeats of many iterations.
* **Bytes per token**: the size of the object ``put`` stores against the size of Gym's JSONL line
  (``orjson.dumps(model_dump(mode="json"), OPT_SORT_KEYS)`` + newline) for the same entries: real
  ``competitive_coding``; ``anyterminal_hermes`` replayed with full prompts (and with delta
  prompts, as the demo stores them); synthetic 8k/32k entries.
* **Memory of a freeze** (needs moto, started by the tool): peak RSS and tracemalloc peak of
  freezing one 2,000-entry rollout with ``cache_bytes`` = 8 MiB and 256 MiB, and what stays
  allocated once the snapshot is released; the peer is Gym's file store freezing the same entries
  from local disk. Each configuration runs in its own process.

Usage::

    python tools/bench_cpu.py            # ~1.5 minutes on 2 cores
    python tools/bench_cpu.py --quick    # a few seconds (smoke test)
    python tools/bench_cpu.py --no-memory
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import orjson
import zstandard
from _benchcommon import (
    bare_session,
    load_average,
    machine_summary,
    n_tokens,
    replay_entries,
    start_server,
    synthetic_entry,
    table,
    time_path,
    total_line,
)
from nemo_gym.token_id_capture.records import TokenEntry as GymTokenEntry

from s3capture.records import (
    TokenEntry,
    coerce_entry,
    decode_entry,
    encode_entry,
    to_gym,
)
from s3capture.store import CHAIN_KEYS, S3TokenStore

STORE = S3TokenStore("s3://s3capture-bench/cpu")  # never connects: used for its encoder/decoder only
LEVEL = 3  # S3TokenStore's default compression_level


# --------------------------------------------------------------------------- CPU per entry
def gym_line(gym_entry: Any) -> bytes:
    return orjson.dumps(gym_entry.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


def make_paths(entries: list[Any]) -> dict[str, tuple[str, Callable[[], None]]]:
    """name -> (peer group, function running the path once over every entry)."""
    dicts = [orjson.loads(encode_entry(e)) for e in entries]
    gyms = [GymTokenEntry.model_validate(d) for d in dicts]
    compressor = zstandard.ZstdCompressor(level=LEVEL)
    decompressor = zstandard.ZstdDecompressor()
    compressed = [compressor.compress(encode_entry(e)) for e in entries]
    lines = [gym_line(g) for g in gyms]
    objects = [STORE._encode_object(encode_entry(e), ()) for e in entries]
    shas = [hashlib.sha256(encode_entry(e)).hexdigest() for e in entries]

    def s3c_encode() -> None:
        for d in dicts:
            compressor.compress(encode_entry(coerce_entry(d)))

    def gym_encode() -> None:
        for d in dicts:
            orjson.dumps(GymTokenEntry.model_validate(d).model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)

    def s3c_decode() -> None:
        for blob in compressed:
            decode_entry(decompressor.decompress(blob))

    def gym_decode() -> None:
        for line in lines:
            GymTokenEntry.model_validate(orjson.loads(line))

    def put_cpu(source: list[Any]) -> Callable[[], None]:
        def run() -> None:  # S3TokenStore.put before its requests: validate+copy, encode, SHA-256, envelope+zstd
            for entry in source:
                payload = encode_entry(coerce_entry(entry))
                hashlib.sha256(payload).hexdigest()
                STORE._encode_object(payload, ())

        return run

    def gym_append() -> None:  # Gym's TokenCaptureStore.append before its file write
        for g in gyms:
            hashlib.sha256(orjson.dumps(g.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)).hexdigest()

    def reader(gym: bool) -> Callable[[], None]:
        def run() -> None:  # what freeze/resolve do per fetched object
            for blob, sha in zip(objects, shas):
                stored = STORE._decode_object(blob, sha)
                if gym:
                    to_gym(stored.entry)

        return run

    return {
        "encode: s3capture coerce_entry(dict) + encode_entry + zstd": ("encode", s3c_encode),
        "encode: Gym model_validate(dict) + model_dump + orjson": ("encode", gym_encode),
        "decode: s3capture zstd + decode_entry": ("decode", s3c_decode),
        "decode: Gym orjson.loads + model_validate": ("decode", gym_decode),
        "put CPU: S3TokenStore.put of an s3capture TokenEntry": ("put", put_cpu(entries)),
        "put CPU: S3TokenStore.put of a Gym pydantic TokenEntry": ("put", put_cpu(gyms)),
        "put CPU: Gym file store append (dump + orjson + SHA-256)": ("put", gym_append),
        "read CPU: s3capture reader (envelope, SHA-256, decode)": ("read", reader(False)),
        "read CPU: s3capture reader, entry_type=gym": ("read", reader(True)),
        "read CPU: Gym file store read (orjson + model_validate)": ("read", gym_decode),
    }


PEERS = {
    "encode": "encode: Gym model_validate(dict) + model_dump + orjson",
    "decode": "decode: Gym orjson.loads + model_validate",
    "put": "put CPU: Gym file store append (dump + orjson + SHA-256)",
    "read": "read CPU: Gym file store read (orjson + model_validate)",
}


def bench_cpu(workloads: dict[str, list[Any]], repeats: int, target: float) -> list[list[Any]]:
    rows = []
    for name, entries in workloads.items():
        paths = make_paths(entries)
        for _, fn in paths.values():  # warm up caches and lazy imports
            fn()
        samples: dict[str, list[float]] = {p: [] for p in paths}
        iterations: dict[str, int] = {p: 0 for p in paths}
        order = list(paths)
        for r in range(repeats):
            rotated = order[r % len(order) :] + order[: r % len(order)]
            for path in rotated:
                per_call, calls = time_path(paths[path][1], target)
                samples[path].append(per_call / len(entries))
                iterations[path] += calls * len(entries)
        medians = {p: statistics.median(v) for p, v in samples.items()}
        tokens = sum(map(n_tokens, entries)) / len(entries)
        for path, (group, _) in paths.items():
            peer = medians[PEERS[group]]
            rows.append(
                [
                    name,
                    path,
                    iterations[path],
                    medians[path] * 1e6,
                    medians[path] * 1e9 / tokens,
                    f"{peer / medians[path]:.1f}x" if path != PEERS[group] else "(peer)",
                ]
            )
    return rows


CPU_HEADERS = ["entries", "path", "entries timed", "µs/entry", "ns/token", "Gym / this"]


def bench_breakdown(workloads: dict[str, list[Any]], target: float) -> list[list[Any]]:
    """Where the time of each path goes, plus candidate replacements (marked "candidate", not s3capture code)."""
    import math

    from s3capture.records import _check_finite, _has_big_float, _json_encoder
    from s3capture.store import _Envelope

    rows = []
    for name, entries in workloads.items():
        canon = [encode_entry(e) for e in entries]
        dicts = [orjson.loads(b) for b in canon]
        records = [coerce_entry(d) for d in dicts]
        gyms = [GymTokenEntry.model_validate(d) for d in dicts]
        objects = [(STORE._encode_object(b, ()), hashlib.sha256(b).hexdigest()) for b in canon]
        raws = [STORE._decompress(o) for o, _ in objects]
        c3, c1 = zstandard.ZstdCompressor(level=3), zstandard.ZstdCompressor(level=1)
        decompressor = zstandard.ZstdDecompressor()
        probs = [e.generation_log_probs for e in records]
        size1 = sum(len(c1.compress(b)) for b in canon)
        size3 = sum(len(c3.compress(b)) for b in canon)
        parts: list[tuple[str, Any, list[Any]]] = [
            ("s3capture: coerce_entry(dict)  [msgspec.convert + validate]", coerce_entry, dicts),
            ("s3capture: coerce_entry(s3capture TokenEntry)  [to_builtins + convert]", coerce_entry, records),
            ("s3capture: coerce_entry(Gym TokenEntry)  [model_dump(json) + convert]", coerce_entry, gyms),
            ("s3capture: encode_entry (all)", encode_entry, records),
            ("s3capture:   _check_finite (Python loop)", _check_finite, records),
            ("s3capture:   _has_big_float (min/max + item scan)", lambda e: _has_big_float(e, None), records),
            ("s3capture:   msgspec sorted JSON encode", _json_encoder.encode, records),
            ("s3capture: SHA-256 of canonical bytes", lambda b: hashlib.sha256(b).hexdigest(), canon),
            (
                f"s3capture: _encode_object (new ZstdCompressor, level 3; {size3:,} B)",
                lambda b: STORE._encode_object(b, ()),
                canon,
            ),
            (
                "s3capture: zstd decompress (reused ZstdDecompressor, one shot)",
                decompressor.decompress,
                [o for o, _ in objects],
            ),
            ("s3capture:   _decompress (new decompressor, stream reader)", STORE._decompress, [o for o, _ in objects]),
            (
                "s3capture:   envelope decode (msgspec scans the entry as Raw)",
                lambda r: bytes(msgspec.json.decode(r, type=_Envelope).entry),
                raws,
            ),
            ("s3capture: decode_entry  [msgspec JSON decode + convert]", decode_entry, canon),
            (
                "s3capture: _decode_object  [zstd + envelope + SHA-256 + decode_entry]",
                lambda o: STORE._decode_object(*o),
                objects,
            ),
            ("s3capture: to_gym  [encode + decode + model_validate]", to_gym, records),
            ("Gym: model_validate(dict)", GymTokenEntry.model_validate, dicts),
            ("Gym: model_dump(mode=json)", lambda g: g.model_dump(mode="json"), gyms),
            ("Gym: orjson.dumps(OPT_SORT_KEYS)", lambda d: orjson.dumps(d, option=orjson.OPT_SORT_KEYS), dicts),
            ("Gym: orjson.loads", orjson.loads, canon),
            ("candidate: reused ZstdCompressor, level 3", c3.compress, canon),
            (f"candidate: reused ZstdCompressor, level 1 ({size1:,} B)", c1.compress, canon),
            ("candidate: math.isfinite(sum(probs))  [finite iff the sum is]", lambda p: math.isfinite(sum(p)), probs),
            ("candidate: min(probs), max(probs)  [the 1e16 bound alone]", lambda p: (min(p), max(p)), probs),
            (
                "candidate: msgspec.json.decode(type=TokenEntry)",
                lambda b: msgspec.json.decode(b, type=TokenEntry),
                canon,
            ),
            (
                "candidate: Gym model_validate(msgspec.to_builtins(entry))",
                lambda e: GymTokenEntry.model_validate(msgspec.to_builtins(e)),
                records,
            ),
            ("candidate: Gym model_validate_json(canonical bytes)", GymTokenEntry.model_validate_json, canon),
        ]
        for label, fn, items in parts:

            def run(fn: Any = fn, items: list[Any] = items) -> None:
                for item in items:
                    fn(item)

            run()
            per_call, _ = time_path(run, target)
            rows.append([name, label, per_call / len(items) * 1e6])
    return rows


BREAKDOWN_HEADERS = ["entries", "step", "µs/entry"]


# --------------------------------------------------------------------------- bytes per token
def delta_entries(entries: list[Any], anchor_every: int = 0) -> list[tuple[Any, tuple[str, ...]]]:
    """The entries as the demo stores them: a RESOLVED call whose prompt extends its parent's
    cumulative tokens keeps only the suffix (``prompt_is_delta``) and carries its ancestors' keys
    (``S3TokenStore._delta_chain``: the parent's key, plus the parent's chain when the parent is a delta).

    ``anchor_every`` > 0 evaluates a candidate (not what s3capture does today): a call that would be
    the ``anchor_every``-th delta in a row stores its full prompt instead, so a chain never needs
    more than one round of ancestor GETs."""
    out: list[tuple[Any, tuple[str, ...]]] = []
    seen: dict[str, tuple[Any, tuple[str, ...], str, list[int]]] = {}
    depth: dict[str, int] = {}
    for entry in entries:
        cumulative = list(entry.prompt_token_ids) + list(entry.generation_token_ids)
        stored, chain = entry, ()
        parent = seen.get(entry.parent_call_id or "")
        depth[entry.model_call_id] = 0
        if parent is not None and anchor_every and depth[entry.parent_call_id] + 1 >= anchor_every:
            parent = None  # candidate: store a full-prompt anchor here
        if parent is not None:
            parent_stored, parent_chain, parent_rel, parent_cumulative = parent
            if list(entry.prompt_token_ids[: len(parent_cumulative)]) == parent_cumulative:
                depth[entry.model_call_id] = depth[entry.parent_call_id] + 1
                stored = msgspec.structs.replace(
                    entry, prompt_token_ids=list(entry.prompt_token_ids[len(parent_cumulative) :]), prompt_is_delta=True
                )
                chain = (*parent_chain, parent_rel)[-CHAIN_KEYS:] if parent_stored.prompt_is_delta else (parent_rel,)
        prefix = STORE.layout.rollout(entry.rollout_id)
        sha = hashlib.sha256(encode_entry(stored)).hexdigest()
        rel = STORE.layout.entry_rel(prefix, stored.continuation_fingerprint, stored.model_call_id, sha)
        seen[entry.model_call_id] = (stored, chain, rel, cumulative)
        out.append((stored, chain))
    return out


def bench_bytes(workloads: dict[str, list[tuple[Any, tuple[str, ...]]]]) -> list[list[Any]]:
    rows = []
    for name, items in workloads.items():
        stored = sum(len(STORE._encode_object(encode_entry(e), chain)) for e, chain in items)
        jsonl = sum(len(gym_line(GymTokenEntry.model_validate(orjson.loads(encode_entry(e))))) + 1 for e, _ in items)
        tokens = sum(n_tokens(e) for e, _ in items)
        rows.append(
            [
                name,
                len(items),
                tokens,
                stored,
                jsonl,
                stored / len(items),
                stored / tokens,
                jsonl / tokens,
                f"{jsonl / stored:.1f}x",
            ]
        )
    return rows


BYTES_HEADERS = [
    "entries",
    "n",
    "tokens stored",
    "s3capture bytes",
    "Gym JSONL bytes",
    "s3capture B/entry",
    "s3capture B/token",
    "Gym B/token",
    "Gym / s3capture",
]


# --------------------------------------------------------------------------- memory of a freeze
def memory_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run in a fresh process: freeze one rollout, report peak and retained memory."""
    import tracemalloc

    def status(field: str) -> int:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    trace = spec["tracemalloc"]
    cache_bytes = None
    if spec["kind"] == "s3capture":
        store = S3TokenStore(spec["url"], endpoint_url=spec["endpoint_url"], cache_bytes=spec["cache_bytes"])
        loop = asyncio.new_event_loop()
        # Bring the HTTP client up first (botocore's service model is ~10 MiB): measure the freeze only.
        loop.run_until_complete(
            store.resolve("warm-up", [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
        )
    else:
        from nemo_gym.token_id_capture.store import TokenCaptureStore

        store = TokenCaptureStore(spec["root"])
    gc.collect()
    rss_before = status("VmRSS")
    if trace:
        tracemalloc.start()
    started = time.perf_counter()
    if spec["kind"] == "s3capture":
        snapshot = loop.run_until_complete(store.freeze(spec["rollout_id"]))
    else:
        snapshot = store.freeze_now(spec["rollout_id"])
    entries = len(snapshot.entries)
    seconds = time.perf_counter() - started
    peak = current_with_snapshot = 0
    rss_with_snapshot = status("VmRSS")
    if trace:
        peak = tracemalloc.get_traced_memory()[1]
        gc.collect()  # what the snapshot (and the cache) hold, not garbage awaiting collection
        current_with_snapshot = tracemalloc.get_traced_memory()[0]
    del snapshot
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] if trace else 0
    if spec["kind"] == "s3capture":
        cache_bytes = store._cache.nbytes  # the cache's own accounting (bytes of canonical JSON)
        loop.run_until_complete(store.close())
        loop.close()
    return {
        "entries": entries,
        "seconds": seconds,
        "peak_rss": status("VmHWM"),
        "rss_before": rss_before,
        "rss_with_snapshot": rss_with_snapshot,
        "rss_after": status("VmRSS"),
        "trace_peak": peak,
        "trace_with_snapshot": current_with_snapshot,
        "trace_retained": retained,
        "cache_accounted": cache_bytes,
    }


def run_child(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--memory-child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"memory child failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_memory(n_entries: int, caches: list[int]) -> tuple[list[list[Any]], str]:
    template = synthetic_entry(1100, generation_tokens=1000, call_id="mem")
    server = start_server("moto")
    tmp = tempfile.mkdtemp(prefix="s3capture-bench-gym-")
    try:
        env = server.env()
        bucket = f"s3capture-bench-{uuid.uuid4().hex[:8]}"
        url = f"s3://{bucket}/mem"
        rollout_id = f"mem-{n_entries}"
        entries = [
            msgspec.structs.replace(template, rollout_id=rollout_id, model_call_id=f"call-{i:05d}")
            for i in range(n_entries)
        ]
        canonical = 0
        writer = S3TokenStore(url, endpoint_url=server.endpoint_url)
        prefix = writer.layout.rollout(rollout_id)

        async def setup(entries: list[Any]) -> None:
            nonlocal canonical
            session, config = bare_session(server)
            async with session.client("s3", endpoint_url=server.endpoint_url, config=config) as client:
                await client.create_bucket(Bucket=bucket)
                limit = asyncio.Semaphore(32)

                async def one(entry: Any) -> None:
                    nonlocal canonical
                    payload = encode_entry(entry)
                    canonical += len(payload)
                    sha = hashlib.sha256(payload).hexdigest()
                    key = prefix + writer.layout.entry_rel(
                        prefix, entry.continuation_fingerprint, entry.model_call_id, sha
                    )
                    async with limit:
                        await client.put_object(Bucket=bucket, Key=key, Body=writer._encode_object(payload, ()))

                await asyncio.gather(*(one(e) for e in entries))

        asyncio.run(setup(entries))
        # The same entries in Gym's file store, written in Gym's own format (lines and index state).
        from nemo_gym.token_id_capture.store import TokenCaptureStore

        gym_store = TokenCaptureStore(tmp)
        digests = {}
        with open(gym_store.path_for(rollout_id), "wb") as handle:
            for entry in entries:
                line = gym_line(GymTokenEntry.model_validate(orjson.loads(encode_entry(entry))))
                digests[entry.model_call_id] = hashlib.sha256(line).hexdigest()
                handle.write(line + b"\n")
            size = handle.tell()
        gym_store._write_state(
            rollout_id,
            {
                "frozen": False,
                "retired": False,
                "incomplete": False,
                "snapshot_id": "",
                "version": n_entries,
                "entry_digests": digests,
                "indexed_size": size,
            },
        )
        del entries
        rows = []
        configs = [("s3capture", c) for c in caches] + [("gym", None)]
        for kind, cache in configs:
            spec = {
                "kind": kind,
                "url": url,
                "endpoint_url": server.endpoint_url,
                "cache_bytes": cache,
                "rollout_id": rollout_id,
                "root": tmp,
            }
            plain = run_child({**spec, "tracemalloc": False}, env)
            traced = run_child({**spec, "tracemalloc": True}, env)
            label = (
                f"s3capture freeze, cache_bytes={cache // 2**20} MiB"
                if kind == "s3capture"
                else "Gym TokenCaptureStore.freeze_now (local file)"
            )
            mib = 2**20
            rows.append(
                [
                    label,
                    plain["entries"],
                    plain["seconds"],
                    plain["peak_rss"] / mib,
                    (plain["peak_rss"] - plain["rss_before"]) / mib,
                    traced["trace_peak"] / mib,
                    traced["trace_with_snapshot"] / mib,
                    traced["trace_retained"] / mib,
                    (traced["cache_accounted"] or 0) / mib if kind == "s3capture" else "",
                ]
            )
        note = (
            f"{n_entries:,} entries of {n_tokens(template):,} tokens ({n_entries * n_tokens(template):,} tokens, "
            f"{canonical / 2**20:.1f} MiB of canonical JSON) frozen from moto; peak RSS from runs without tracemalloc, "
            "heap figures from separate runs with tracemalloc"
        )
        return rows, note
    finally:
        server.stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


MEMORY_HEADERS = [
    "freeze of one rollout",
    "entries",
    "s",
    "peak RSS MiB",
    "RSS growth MiB",
    "heap peak MiB",
    "heap with snapshot MiB",
    "heap retained after release MiB",
    "cache accounting MiB",
]


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="short timings, a small rollout, one cache size (smoke test)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="repeats per CPU cell (default 5)")
    parser.add_argument("--target", type=float, default=None, help="seconds of CPU per repeat (default 0.15)")
    parser.add_argument("--no-memory", action="store_true", help="skip the freeze memory measurement (needs moto)")
    parser.add_argument("--memory-entries", type=int, default=None, help="entries in the frozen rollout (default 2000)")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.target = args.target or (0.01 if args.quick else 0.15)
    args.memory_entries = args.memory_entries or (50 if args.quick else 2000)
    # The freeze memory table's cache sizes: --quick measures only the first (each is two child
    # processes, a freeze each, with and without tracemalloc).
    args.memory_caches = [8 * 2**20] if args.quick else [8 * 2**20, 256 * 2**20]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(json.loads(args.memory_child))))
        return 0
    started = time.perf_counter()
    load_at_start = load_average()
    print(f"# bench_cpu\n\nmachine: {machine_summary()}\n", flush=True)
    real = replay_entries("competitive_coding")
    workloads = {
        f"competitive_coding (real, {len(real)} entries, ~{sum(map(n_tokens, real)) // len(real):,} tok)": real,
        "synthetic 8k tok (4 entries)": [synthetic_entry(8192, seed=s, call_id=f"s8k-{s}") for s in range(4)],
        "synthetic 32k tok (2 entries)": [
            synthetic_entry(32768, generation_tokens=2048, seed=s, call_id=f"s32k-{s}") for s in range(2)
        ],
    }
    rows = bench_cpu(workloads, args.repeats, args.target)
    print("### client CPU per entry (process_time, no S3)\n\n" + table(CPU_HEADERS, rows, digits=1) + "\n", flush=True)

    breakdown = {k: v for k, v in workloads.items() if not k.startswith("synthetic 32k")}
    rows = bench_breakdown(breakdown, args.target / 3)
    print(
        "### where the CPU goes (steps of the paths above; candidates are not s3capture code)\n\n"
        + table(BREAKDOWN_HEADERS, rows, digits=1)
        + "\n",
        flush=True,
    )

    hermes = replay_entries("anyterminal_hermes")
    size_workloads = {
        "competitive_coding (real ids), full prompts": [(e, ()) for e in real],
        "anyterminal_hermes (replayed ids), full prompts": [(e, ()) for e in hermes],
        "anyterminal_hermes (replayed ids), delta prompts": delta_entries(hermes),
        "anyterminal_hermes, delta + full anchor every 16 calls (candidate)": delta_entries(hermes, anchor_every=16),
        "synthetic 8k tok": [(e, ()) for e in workloads["synthetic 8k tok (4 entries)"]],
        "synthetic 32k tok": [(e, ()) for e in workloads["synthetic 32k tok (2 entries)"]],
    }
    rows = bench_bytes(size_workloads)
    print(
        "### stored bytes per token (S3 object vs Gym JSONL line)\n\n" + table(BYTES_HEADERS, rows) + "\n", flush=True
    )

    if not args.no_memory:
        rows, note = bench_memory(args.memory_entries, args.memory_caches)
        print(f"### memory of a freeze ({note})\n\n" + table(MEMORY_HEADERS, rows, digits=1) + "\n", flush=True)
    print(total_line(started, load_at_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
