#!/usr/bin/env python3
"""Latency, requests, client CPU and stored bytes of ``S3CaptureLedger``, each against a peer in the same run.

The commits are realistic: every model call of the Gym example ``anyterminal_hermes.jsonl``
(5 multi-turn rollouts, 147 calls, request items up to ~150 KB) loaded with
``s3capture.replay.load_rollouts``, staged with ``s3capture.staging.stage_call`` along each rollout's
parent chain (as ``s3capture demo --capture ledger`` does) and turned into ``CaptureLedgerCommit``
wire dicts (``call_record`` + request and response items). Five measurements:

* **record** -- ``S3CaptureLedger.record(commit)`` (A) against a bare aioboto3 ``put_object`` of the
  same row bytes to a sibling key (B, the peer), the bare ``PUT row`` and ``LIST row prefix`` sent
  together (C), and record's whole wire pattern without s3capture code (D: PUT row, PUT empty
  index object, LIST, together). Rounds alternate the kinds (A B C D, B C D A, ...) to cancel drift;
  each round runs ``concurrency`` operations of one kind at once (1 and 8). The bare client has the
  ledger's configuration (``default_botocore_config(32)``, path style, no ``Expect: 100-continue``).
  Client CPU (``process_time``) and server CPU (``/proc/<pid>/stat``) are attributed per kind;
  requests per record come from ``ledger.request_counts``, round trips and requests in flight from
  the client's botocore events. Every record uses a new call id (a new row). The comparison is
  repeated (half the rounds) behind ``tools/_delayproxy.py``, a proxy process that adds a round-trip
  time (``--rtt-ms``, default 10 ms) to every exchange, as a store off loopback does.
* **resolve** -- a ledger of 1, 100 and 1,000 rows (one rollout: a realistic target call plus other
  real rows under new call ids, each ledger in its own bucket), resolving the real next request of
  the target (a mid-rollout call of the 91-call rollout) so the request is the same at every size.
  Cold client: a new ledger whose connection was warmed by an unrelated resolve (cache empty);
  warm client: the same ledger again (row cached); new client: a new ledger including client
  creation and the TCP connection. Peers: the same requests sent bare, in the same two rounds
  (LIST index + GET tombstone, then GET row + LIST row prefix; warm: without the row GET).
* **manifest** (and ``has_rows``) -- ledgers of 10, 100 and 1,000 rows, cold and warm client. Peer:
  the same wire pattern bare (paged LIST of ``ledger/`` with the tombstone GET, then a GET per row,
  32 in flight; warm: the LISTs and the tombstone GET alone). "Candidate" rows (not s3capture code)
  list only ``ledger/row/`` and ``ledger/fail/``, in parallel, skipping the fingerprint index.
* **client CPU per record** (``time.process_time``, no S3): what ``record`` does before its requests
  (``validate_commit`` + ``assistant_fingerprint`` + ``conversation_digest`` + msgspec encode +
  SHA-256 + zstd above 1 KiB; checked byte for byte against what ``record`` hands its PUT) and the whole ``record``
  with its requests stubbed, against Gym 0.7.0's path for the same commit
  (``CaptureLedgerCommit.model_validate(wire)`` + the row dict ``FileLineageStore._record`` builds
  + ``json.dumps(sort_keys=True)``), with a breakdown of the steps.
* **stored bytes per row** -- the row object ``record`` writes (canonical JSON, zstd-compressed above
  1 KiB; plus the empty index object) against the line Gym's ``FileLineageStore`` appends to its
  JSONL for the same commit.

The tool starts its own servers (moto in server mode, SeaweedFS ``weed mini``) on 127.0.0.1 as
separate processes and stops them at the end. moto's LIST scans every key of the bucket, so each
measurement uses its own bucket; the peers run against the same bucket and cancel that out.

Usage::

    python tools/bench_ledger.py                   # both servers, ~4 minutes on 2 cores
    python tools/bench_ledger.py --servers moto    # one server
    python tools/bench_ledger.py --quick           # seconds (smoke test)
    python tools/bench_ledger.py --no-s3           # only the CPU and bytes tables
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from _benchcommon import (
    DATA_DIR,
    DelayProxy,
    KindStats,
    ServerCpu,
    Sink,
    Timeline,
    bare_get,
    bare_session,
    load_average,
    machine_summary,
    mean,
    measured_round,
    pct,
    server_list,
    set_bare_wire,
    start_server,
    table,
    rotated_medians,
    time_path,
    total_line,
)

from s3capture import fingerprint as _fp
from s3capture.layout import Layout, escape_id
from s3capture.ledger import _COMPRESS_ABOVE, _ROW_FORMAT, S3CaptureLedger, _Row
from s3capture.ledger_records import CaptureLedgerCommit, to_wire, validate_commit
from s3capture.protocols import LineageMatch
from s3capture.staging import call_record, stage_call

ADMITTED_AT = 1_700_000_000.0
DATA_FILE = "anyterminal_hermes"


# --------------------------------------------------------------------------- commits
@dataclass
class Commits:
    """The real commits of the example file, in rollout order."""

    wires: list[dict]
    rollouts: list[list[int]]
    """Indices into ``wires`` per rollout."""
    next_request: dict[int, list[dict]]
    """Index of a commit -> the request of the next call of its rollout (its continuation)."""


def load_commits() -> Commits:
    """Stage every call of the example file along its rollout's chain, as the ledger demo does."""
    from s3capture.replay import load_rollouts

    path = DATA_DIR / f"{DATA_FILE}.jsonl"
    if not path.exists():
        raise SystemExit(f"data file {path} not found (set S3CAPTURE_BENCH_DATA to the directory of the Gym examples)")
    wires: list[dict] = []
    rollouts: list[list[int]] = []
    next_request: dict[int, list[dict]] = {}
    for rollout in load_rollouts([path]):
        match: LineageMatch | None = None
        indices: list[int] = []
        for call in rollout.calls:
            try:
                staged = _stage(rollout.rollout_id, call, match)
            except ValueError:  # the prompt does not extend the parent's tokens: a new text-mode root
                match = None
                staged = _stage(rollout.rollout_id, call, None)
            output = list(call.output_items)
            record = call_record(
                staged,
                response_id=f"resp-{call.model_call_id}",
                admitted_at=ADMITTED_AT + len(wires),
                request_items=call.request_items,
                response_items=output,
            )
            chain = (*(match.staging_chain if match is not None else ()), staged.staging_key)
            commit = CaptureLedgerCommit(
                rollout_id=rollout.rollout_id,
                record=record,
                staging_chain=chain,
                request_items=list(call.request_items),
                response_items=output,
            )
            if indices:
                next_request[indices[-1]] = list(call.request_items)
            indices.append(len(wires))
            wires.append(to_wire(commit))
            match = LineageMatch(
                model_call_id=staged.model_call_id,
                cumulative_token_ids=(),
                digest=staged.cumulative_hash,
                staging_chain=chain,
                prev_len=staged.cum_len,
                chain_hash=staged.chain_hash,
            )
        rollouts.append(indices)
    return Commits(wires, rollouts, next_request)


def _stage(rollout_id: str, call: Any, parent: LineageMatch | None) -> Any:
    return stage_call(
        rollout_id=rollout_id,
        model_call_id=call.model_call_id,
        prompt_token_ids=call.prompt_token_ids,
        generation_token_ids=call.generation_token_ids,
        generation_log_probs=call.generation_log_probs,
        parent=parent,
    )


def renamed(wire: dict, call_id: str, rollout_id: str | None = None) -> dict:
    """The same commit under another call id (and rollout id): a new row with the same size and fingerprint."""
    out = dict(wire, record=dict(wire["record"], model_call_id=call_id))
    if rollout_id is not None:
        out["rollout_id"] = rollout_id
    return out


def request_bytes(wire: dict) -> int:
    return len(msgspec.json.encode(wire["request_items"]))


# --------------------------------------------------------------------------- record's work before I/O
@dataclass
class Prepared:
    row_key: str
    body: bytes
    """The bytes PUT: the row's canonical JSON, zstd-compressed above ``_COMPRESS_ABOVE`` bytes."""
    json_len: int
    index_key: str | None
    list_prefix: str


def prepare_row(ledger: S3CaptureLedger, commit: Any) -> Prepared:
    """What ``S3CaptureLedger.record`` computes before its requests, step for step (checked by ``check_prepare``)."""
    layout = ledger.layout
    c = validate_commit(commit)
    prefix = layout.rollout(c.rollout_id)
    segment = layout.check_call_id(prefix, c.record.model_call_id)
    request_items = list(c.request_items)
    fingerprint = _fp.assistant_fingerprint(request_items + list(c.response_items)) or None
    context_digest = _fp.conversation_digest(request_items)
    row = _Row(
        format=_ROW_FORMAT,
        rollout_id=c.rollout_id,
        record=c.record,
        staging_chain=list(c.staging_chain),
        fingerprint=fingerprint,
        fingerprint_version=_fp.FINGERPRINT_VERSION,
        context_len=len(request_items),
        context_digest=context_digest,
    )
    body = msgspec.json.encode(row, order="sorted")
    sha = hashlib.sha256(body).hexdigest()
    stored = ledger._compressor().compress(body) if len(body) > _COMPRESS_ABOVE else body
    index = f"{prefix}ledger-index/{escape_id(fingerprint)}/{segment}/{sha}" if fingerprint else None
    return Prepared(
        f"{prefix}ledger/row/{segment}/{sha}.json", stored, len(body), index, f"{prefix}ledger/row/{segment}/"
    )


def stubbed_ledger(url: str = "s3://s3capture-bench/ledger") -> tuple[S3CaptureLedger, dict[str, bytes]]:
    """A ledger whose PUTs land in a dict and whose LISTs are empty: ``record`` without I/O."""
    ledger = S3CaptureLedger(url)
    written: dict[str, bytes] = {}

    async def put(key: str, body: bytes) -> None:
        written[key] = body

    async def list_(prefix: str) -> list[Any]:
        return []

    ledger._put = put  # type: ignore[method-assign]
    ledger._list = list_  # type: ignore[method-assign]
    return ledger, written


def check_prepare(wires: list[dict]) -> None:
    """``prepare_row`` must give exactly the keys and bytes ``record`` writes, or every number here is off."""
    ledger, written = stubbed_ledger()
    loop = asyncio.new_event_loop()
    try:
        for wire in wires:
            written.clear()
            loop.run_until_complete(ledger.record(wire))
            mine = prepare_row(ledger, wire)
            expected = {mine.row_key: mine.body, **({mine.index_key: b""} if mine.index_key else {})}
            if written != expected:
                raise SystemExit(
                    f"tools/bench_ledger.py prepare_row no longer matches S3CaptureLedger.record for "
                    f"{wire['record']['model_call_id']}: record wrote {sorted(written)}; update prepare_row"
                )
    finally:
        loop.close()


# --------------------------------------------------------------------------- Gym's path
def gym_pieces() -> tuple[Any, Callable[[Any], dict], Callable[[dict], bytes]]:
    """(Gym's CaptureLedgerCommit, the row dict FileLineageStore._record builds, its JSONL line)."""
    from nemo_gym.token_id_capture.fingerprint import (
        assistant_fingerprint,
        conversation_digest,
    )
    from nemo_gym.token_id_capture.lineage import _custody_columns
    from nemo_gym.token_id_capture.staging.records import (
        CaptureLedgerCommit as GymCommit,
    )

    def gym_row(commit: Any) -> dict:  # nemo_gym 0.7.0 FileLineageStore._record, before its lock and append
        request_items = list(commit.request_items)
        return {
            "model_call_id": commit.record.model_call_id,
            "fingerprint": assistant_fingerprint(request_items + list(commit.response_items)),
            "context_len": len(request_items),
            "context_digest": conversation_digest(request_items),
            "digest": commit.record.cumulative_hash,
            **_custody_columns(commit.record, commit.staging_chain),
        }

    def gym_line(row: dict) -> bytes:  # FileLineageStore._append
        return json.dumps(row, sort_keys=True, separators=(",", ":")).encode() + b"\n"

    return GymCommit, gym_row, gym_line


# --------------------------------------------------------------------------- CPU per record
PEER_CPU = "Gym: model_validate(wire) + _record's row dict + json.dumps(sort_keys)"


def cpu_paths(
    wires: list[dict],
) -> tuple[dict[str, Callable[[], None]], list[tuple[str, Callable[[Any], Any], list[Any]]], Any]:
    GymCommit, gym_row, gym_line = gym_pieces()
    probe = S3CaptureLedger("s3://s3capture-bench/ledger")  # never connects: prepare_row's layout and compressor
    gyms = [GymCommit.model_validate(w) for w in wires]
    structs = [validate_commit(w) for w in wires]
    rows = [gym_row(g) for g in gyms]
    ledger, _ = stubbed_ledger()
    loop = asyncio.new_event_loop()

    def over(fn: Callable[[Any], Any], items: list[Any]) -> Callable[[], None]:
        def run() -> None:
            for item in items:
                fn(item)

        return run

    async def record_all(items: list[Any]) -> None:
        for item in items:
            await ledger.record(item)

    def gym_path(wire: dict) -> None:
        gym_line(gym_row(GymCommit.model_validate(wire)))

    def encode_row(c: Any) -> bytes:  # the row struct, its sorted JSON and SHA-256 (fingerprints precomputed)
        body = msgspec.json.encode(
            _Row(
                format=_ROW_FORMAT,
                rollout_id=c.rollout_id,
                record=c.record,
                staging_chain=list(c.staging_chain),
                fingerprint="0" * 64,
                fingerprint_version=2,
                context_len=len(c.request_items),
                context_digest="0" * 64,
            ),
            order="sorted",
        )
        hashlib.sha256(body).hexdigest()
        return body

    bodies = [encode_row(s) for s in structs]

    paths = {
        "s3capture: record before I/O, commit = wire dict": over(lambda w: prepare_row(probe, w), wires),
        "s3capture: record before I/O, commit = Gym pydantic model": over(lambda g: prepare_row(probe, g), gyms),
        "s3capture: record before I/O, commit = s3capture struct": over(lambda s: prepare_row(probe, s), structs),
        "s3capture: whole record(wire dict), requests stubbed": lambda: loop.run_until_complete(record_all(wires)),
        PEER_CPU: over(gym_path, wires),
        "Gym: _record's row dict + json.dumps on a built model (no validation)": over(
            lambda g: gym_line(gym_row(g)), gyms
        ),
    }
    steps: list[tuple[str, Callable[[Any], Any], list[Any]]] = [
        ("s3capture: validate_commit(wire dict)  [msgspec.convert]", validate_commit, wires),
        ("s3capture: validate_commit(Gym model)  [model_dump(json) + convert]", validate_commit, gyms),
        ("s3capture: validate_commit(s3capture struct)  [to_builtins + convert]", validate_commit, structs),
        ("Gym: CaptureLedgerCommit.model_validate(wire dict)", GymCommit.model_validate, wires),
        (
            "both: assistant_fingerprint(request + response)  [Gym's function]",
            lambda s: _fp.assistant_fingerprint(list(s.request_items) + list(s.response_items)),
            structs,
        ),
        (
            "both: conversation_digest(request)  [Gym's function]",
            lambda s: _fp.conversation_digest(list(s.request_items)),
            structs,
        ),
        ("s3capture: _Row + msgspec sorted encode + SHA-256", encode_row, structs),
        (
            f"s3capture: zstd level 3 of rows over {_COMPRESS_ABOVE} B",
            lambda b: probe._compressor().compress(b) if len(b) > _COMPRESS_ABOVE else b,
            bodies,
        ),
        ("Gym: json.dumps(row, sort_keys=True)", gym_line, rows),
    ]
    return paths, steps, loop


def bench_cpu(
    commits: Commits, repeats: int, target: float, limit: int | None = None
) -> tuple[list[list[Any]], list[list[Any]]]:
    wires = commits.wires[:limit]  # "all calls": every commit, or the first ``limit`` (--cpu-commits)
    roots = [commits.wires[r[0]] for r in commits.rollouts]
    workloads = {
        f"{DATA_FILE}, {'all' if len(wires) == len(commits.wires) else 'the first'} calls ({len(wires)}, request mean {mean(map(request_bytes, wires)) / 1024:.0f} KiB)": wires,
        f"{DATA_FILE}, first call of each rollout ({len(roots)}, request mean {mean(map(request_bytes, roots)) / 1024:.1f} KiB)": roots,
    }
    cpu_rows, step_rows = [], []
    for name, items in workloads.items():
        paths, steps, loop = cpu_paths(items)
        medians, _ = rotated_medians(paths, repeats, target, per=len(items))
        peer = medians[PEER_CPU]
        for path in paths:
            cpu_rows.append(
                [name, path, medians[path] * 1e6, f"{medians[path] / peer:.2f}x" if path != PEER_CPU else "(peer)"]
            )
        for label, fn, args in steps:

            def run(fn: Any = fn, args: list[Any] = args) -> None:
                for a in args:
                    fn(a)

            run()
            step_samples = [time_path(run, target)[0] / len(args) for _ in range(max(1, repeats // 2))]
            step_rows.append([name, label, statistics.median(step_samples) * 1e6])
        loop.close()
    return cpu_rows, step_rows


CPU_HEADERS = ["commits", "path", "µs/commit (median)", "this / Gym"]
STEP_HEADERS = ["commits", "step", "µs/commit"]


# --------------------------------------------------------------------------- stored bytes
def bench_bytes(commits: Commits) -> list[list[Any]]:
    GymCommit, gym_row, gym_line = gym_pieces()
    ledger = S3CaptureLedger(
        "s3://s3capture-bench/capture/run-42"
    )  # never connects; a plausible prefix, for key lengths
    groups = {"all calls": commits.wires, "first call of each rollout": [commits.wires[r[0]] for r in commits.rollouts]}
    longest = max(commits.rollouts, key=len)
    groups[f"longest rollout ({len(longest)} calls)"] = [commits.wires[i] for i in longest]
    rows = []
    for name, wires in groups.items():
        prepared = [prepare_row(ledger, w) for w in wires]
        ours = [len(p.body) for p in prepared]
        plain = [p.json_len for p in prepared]
        keys = [len(p.row_key.encode()) + len((p.index_key or "").encode()) for p in prepared]
        lines = [len(gym_line(gym_row(GymCommit.model_validate(w)))) for w in wires]
        rows.append(
            [
                f"{DATA_FILE}, {name}",
                len(wires),
                mean(ours),
                max(ours),
                mean(plain),
                max(plain),
                0,
                2,
                mean(keys),
                mean(lines),
                max(lines),
                f"{mean(ours) / mean(lines):.2f}x",
            ]
        )
    return rows


BYTES_HEADERS = [
    "commits",
    "n",
    "s3capture row object B (mean)",
    "row object B (max)",
    "row JSON B (mean)",
    "row JSON B (max)",
    "index object B",
    "objects/row",
    "key B/row (mean)",
    "Gym JSONL line B (mean)",
    "Gym line B (max)",
    "s3capture / Gym",
]


# --------------------------------------------------------------------------- S3 plumbing
@dataclass
class Env(ServerCpu):
    server: Any
    session: Any
    bare: Any
    """A bare aioboto3 client configured like the ledger's: default_botocore_config(32), path style, no Expect."""
    endpoint_url: str = ""
    proxy_pid: int | None = None

    def ledger(self, bucket: str) -> S3CaptureLedger:
        return S3CaptureLedger(
            f"s3://{bucket}/bench", endpoint_url=self.endpoint_url or self.server.endpoint_url, session=self.session
        )

    async def bucket(self, tag: str) -> str:
        name = f"s3capture-bl-{tag}-{uuid.uuid4().hex[:6]}"
        await self.bare.create_bucket(Bucket=name)
        return name


async def bare_list(env: Env, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    token = None
    while True:
        params: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1000}
        if token:
            params["ContinuationToken"] = token
        page = await env.bare.list_objects_v2(**params)
        keys.extend(item["Key"] for item in page.get("Contents", ()))
        if not page.get("IsTruncated"):
            return keys
        token = page["NextContinuationToken"]


async def fill_ledger(env: Env, bucket: str, wires: list[dict]) -> None:
    writer = env.ledger(bucket)
    limit = asyncio.Semaphore(16)

    async def one(wire: dict) -> None:
        async with limit:
            await writer.record(wire)

    await asyncio.gather(*(one(w) for w in wires))
    await writer.close()


# --------------------------------------------------------------------------- record latency
KINDS = ("A", "B", "C", "D")
LABELS = {
    "A": "S3CaptureLedger.record",
    "B": "bare PUT of the row bytes (peer)",
    "C": "bare PUT row ∥ LIST row prefix",
    "D": "bare PUT row ∥ PUT index ∥ LIST (record's wire pattern)",
}
WIRE = {"B": (1, 1), "C": (2, 2), "D": (3, 3)}  # bare kinds: requests per op, in flight


async def record_latency(
    env: Env, wires: list[dict], concurrency: int, rounds: int, warmup: int
) -> dict[str, KindStats]:
    bucket = await env.bucket(f"rec{concurrency}")
    ledger = env.ledger(bucket)
    rollout_id = f"rec-c{concurrency}"
    total = (rounds + warmup) * concurrency
    ops = []
    for j in range(total):
        base = wires[j % len(wires)]
        wire = renamed(base, f"{base['record']['model_call_id']}-op{j}", rollout_id)
        p = prepare_row(ledger, wire)
        sibling = {
            k: prepare_row(ledger, renamed(wire, f"{wire['record']['model_call_id']}-{k.lower()}")) for k in "BCD"
        }
        ops.append((wire, p.body, sibling))
    timeline = Timeline().hook(ledger.transport)
    stats = {kind: KindStats() for kind in KINDS}

    def op_c(j: int) -> Any:
        s = ops[j][2]["C"]
        return asyncio.gather(
            env.bare.put_object(Bucket=bucket, Key=s.row_key, Body=ops[j][1]), bare_list(env, bucket, s.list_prefix)
        )

    def op_d(j: int) -> Any:
        s = ops[j][2]["D"]
        return asyncio.gather(
            env.bare.put_object(Bucket=bucket, Key=s.row_key, Body=ops[j][1]),
            env.bare.put_object(Bucket=bucket, Key=s.index_key, Body=b""),
            bare_list(env, bucket, s.list_prefix),
        )

    run = {
        "A": lambda j: ledger.record(ops[j][0]),
        "B": lambda j: env.bare.put_object(Bucket=bucket, Key=ops[j][2]["B"].row_key, Body=ops[j][1]),
        "C": op_c,
        "D": op_d,
    }
    for r in range(rounds + warmup):
        indices = range(r * concurrency, (r + 1) * concurrency)
        for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
            timeline.reset()
            await measured_round(
                run[kind],
                indices,
                stats[kind] if r >= warmup else None,
                env.server_cpu,
                requests=(lambda: sum(ledger.request_counts.values())) if kind == "A" else None,
                timeline=timeline if kind == "A" and concurrency == 1 else None,
            )
    set_bare_wire(stats, WIRE)
    await ledger.close()
    return stats


def record_rows(concurrency: int, stats: dict[str, KindStats]) -> list[list[Any]]:
    peer = stats["B"]
    p50_peer, mean_peer = pct(peer.latencies, 0.5), mean(peer.latencies)
    rows = []
    for kind, s in stats.items():
        p50, p90, p99, avg = pct(s.latencies, 0.5), pct(s.latencies, 0.9), pct(s.latencies, 0.99), mean(s.latencies)
        rows.append(
            [
                concurrency,
                LABELS[kind],
                s.ops,
                p50 * 1000,
                p90 * 1000,
                p99 * 1000,
                avg * 1000,
                f"{p50 / p50_peer:.2f}x",
                f"{avg / mean_peer:.2f}x",
                s.ops / s.wall if s.wall else float("nan"),
                s.client_cpu / s.ops * 1000,
                s.server_cpu / s.ops * 1000,
                s.requests / s.ops,
                max(s.round_trips) if s.round_trips else "",
                s.max_in_flight if concurrency == 1 else "",
            ]
        )
    return rows


RECORD_HEADERS = [
    "conc",
    "operation",
    "n",
    "p50 ms",
    "p90 ms",
    "p99 ms",
    "mean ms",
    "p50 vs peer",
    "mean vs peer",
    "ops/s",
    "client CPU ms/op",
    "server CPU ms/op",
    "requests/op",
    "round trips (max)",
    "max in flight",
]


# --------------------------------------------------------------------------- ledgers of N rows
@dataclass
class Ledger:
    n: int
    bucket: str
    rollout_id: str
    target: dict
    request: list[dict]
    layout: Layout


def ledger_rows(commits: Commits, n: int, rollout_id: str) -> tuple[dict, list[dict], list[dict]]:
    """(target commit, its next request, all n commits): the target plus n-1 other real rows under new ids."""
    longest = max(commits.rollouts, key=len)
    target_index = longest[len(longest) // 2]
    target = renamed(commits.wires[target_index], commits.wires[target_index]["record"]["model_call_id"], rollout_id)
    others = [w for i, w in enumerate(commits.wires) if i != target_index]
    fillers = [
        renamed(others[j % len(others)], f"{others[j % len(others)]['record']['model_call_id']}-n{j}", rollout_id)
        for j in range(n - 1)
    ]
    return target, commits.next_request[target_index], [target, *fillers]


async def build_ledgers(env: Env, commits: Commits, sizes: list[int]) -> dict[int, Ledger]:
    out = {}
    for n in sizes:
        bucket = await env.bucket(f"n{n}")
        rollout_id = f"ledger-{n}"
        target, request, wires = ledger_rows(commits, n, rollout_id)
        await fill_ledger(env, bucket, wires)
        out[n] = Ledger(n, bucket, rollout_id, target, request, env.ledger(bucket).layout)
    return out


async def warm_connection(ledger: S3CaptureLedger, request: list[dict]) -> None:
    """Connection up and botocore's LIST/GET set-up done, cache empty (an unrelated rollout)."""
    await ledger.resolve(f"warmup-{uuid.uuid4().hex[:6]}", request)
    await ledger._get(ledger.layout.rollout("warmup") + "missing")


def check_resolved(resolution: Any, n: int, target_id: str) -> None:
    if resolution.match is None or resolution.match.model_call_id != target_id:
        raise SystemExit(f"resolve in a ledger of {n} rows did not find {target_id}: {resolution}")


async def bench_resolve(
    env: Env, ledgers: dict[int, Ledger], sizes: list[int], samples: int, warm_samples: int, new_samples: int
) -> list[list[Any]]:
    rows = []
    for n in sizes:
        spec = ledgers[n]
        target_id = spec.target["record"]["model_call_id"]
        prefix = spec.layout.rollout(spec.rollout_id)
        fingerprint = _fp.assistant_fingerprint(spec.request)
        fp_prefix = f"{prefix}ledger-index/{escape_id(fingerprint)}/"
        row_prefix = f"{prefix}ledger/row/{escape_id(target_id)}/"
        row_keys = await bare_list(env, spec.bucket, row_prefix)
        assert len(row_keys) == 1, row_keys
        cold, warm, new = Sink(), Sink(), Sink()
        peer_cold: list[float] = []
        peer_warm: list[float] = []

        for _ in range(samples):
            ledger = env.ledger(spec.bucket)
            await warm_connection(ledger, spec.request)
            timeline = Timeline().hook(ledger.transport)
            for sink, count in ((cold, 1), (warm, warm_samples)):
                for _ in range(count):
                    timeline.reset()
                    cpu, started = time.process_time(), time.perf_counter()
                    resolution = await ledger.resolve(spec.rollout_id, spec.request)
                    sink.add(time.perf_counter() - started, time.process_time() - cpu, timeline)
                    check_resolved(resolution, n, target_id)
            await ledger.close()
            # the same requests sent bare, in the same two rounds
            started = time.perf_counter()
            await asyncio.gather(
                bare_list(env, spec.bucket, fp_prefix), bare_get(env.bare, spec.bucket, prefix + "retired")
            )
            await asyncio.gather(bare_get(env.bare, spec.bucket, row_keys[0]), bare_list(env, spec.bucket, row_prefix))
            peer_cold.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            await asyncio.gather(
                bare_list(env, spec.bucket, fp_prefix), bare_get(env.bare, spec.bucket, prefix + "retired")
            )
            await bare_list(env, spec.bucket, row_prefix)
            peer_warm.append((time.perf_counter() - started) * 1000)
        for _ in range(new_samples):
            ledger = env.ledger(spec.bucket)
            cpu, started = time.process_time(), time.perf_counter()
            check_resolved(await ledger.resolve(spec.rollout_id, spec.request), n, target_id)
            new.add(time.perf_counter() - started, time.process_time() - cpu, None)
            await ledger.close()
        label = f"{n:,} rows"
        for client, sink, peer in (
            ("cold client (cache empty)", cold, peer_cold),
            ("warm client (row cached)", warm, peer_warm),
        ):
            rows.append(
                [
                    label,
                    client,
                    len(sink.ms),
                    pct(sink.ms, 0.5),
                    pct(sink.ms, 0.9),
                    pct(sink.ms, 0.99),
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
            [
                label,
                "peer: bare cold pattern (LIST ∥ GET, then GET ∥ LIST)",
                len(peer_cold),
                pct(peer_cold, 0.5),
                pct(peer_cold, 0.9),
                pct(peer_cold, 0.99),
                "1.00x",
                "",
                2,
                2,
                0,
                2,
                2,
            ]
        )
        rows.append(
            [
                label,
                "peer: bare warm pattern (LIST ∥ GET, then LIST)",
                len(peer_warm),
                pct(peer_warm, 0.5),
                pct(peer_warm, 0.9),
                pct(peer_warm, 0.99),
                "1.00x",
                "",
                2,
                1,
                0,
                2,
                2,
            ]
        )
        if new.ms:
            rows.append(
                [
                    label,
                    "new client (client creation + connect)",
                    len(new.ms),
                    pct(new.ms, 0.5),
                    pct(new.ms, 0.9),
                    "",
                    "",
                    pct(new.cpu, 0.5),
                    "",
                    "",
                    "",
                    "",
                    "",
                ]
            )
    return rows


RESOLVE_HEADERS = [
    "ledger",
    "client",
    "n",
    "p50 ms",
    "p90 ms",
    "p99 ms",
    "p50 vs peer",
    "client CPU ms (p50)",
    "LIST",
    "GET",
    "other",
    "round trips",
    "max in flight",
]


# --------------------------------------------------------------------------- manifest and has_rows
async def bare_manifest(env: Env, spec: Ledger, prefixes: list[str], get_rows: bool = True) -> int:
    """The manifest's wire pattern without s3capture: LISTs ∥ tombstone GET, then every row GET, 32 in flight."""
    prefix = spec.layout.rollout(spec.rollout_id)
    *listings, _ = await asyncio.gather(
        *(bare_list(env, spec.bucket, prefix + p) for p in prefixes),
        bare_get(env.bare, spec.bucket, prefix + "retired"),
    )
    keys = [k for listing in listings for k in listing if "/ledger/row/" in k or "/ledger/fail/" in k]
    if not get_rows:
        return len(keys)
    limit = asyncio.Semaphore(32)

    async def get(key: str) -> None:
        async with limit:
            await bare_get(env.bare, spec.bucket, key)

    await asyncio.gather(*(get(k) for k in keys))
    return len(keys)


async def bench_manifest(env: Env, ledgers: dict[int, Ledger], sizes: list[int], samples: int) -> list[list[Any]]:
    rows = []
    for n in sizes:
        spec = ledgers[n]
        cold, warm, has = Sink(), Sink(), Sink()
        peer: list[float] = []
        candidate: list[float] = []
        peer_warm: list[float] = []
        candidate_warm: list[float] = []
        budget = samples if n < 1000 else max(1, samples // 2)
        for _ in range(budget):
            ledger = env.ledger(spec.bucket)
            await warm_connection(ledger, spec.request)
            timeline = Timeline().hook(ledger.transport)
            for sink in (cold, warm):
                timeline.reset()
                cpu, started = time.process_time(), time.perf_counter()
                manifest = await ledger.manifest(spec.rollout_id)
                sink.add(time.perf_counter() - started, time.process_time() - cpu, timeline)
                # The rows are real commits renamed into one synthetic ledger, so their parents are
                # not in it: missing_parent_row is expected for continuations, nothing else is.
                unexpected = [f for f in manifest["failures"] if f["reason"] != "missing_parent_row"]
                if len(manifest["records"]) != n or unexpected:
                    raise SystemExit(
                        f"manifest of a ledger of {n} rows: {len(manifest['records'])} records, failures {unexpected[:3]}"
                    )
            timeline.reset()
            cpu, started = time.process_time(), time.perf_counter()
            if not await ledger.has_rows(spec.rollout_id):
                raise SystemExit("has_rows returned False for a ledger with rows")
            has.add(time.perf_counter() - started, time.process_time() - cpu, timeline)
            await ledger.close()
            started = time.perf_counter()
            got = await bare_manifest(env, spec, ["ledger/"])
            peer.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            await bare_manifest(env, spec, ["ledger/row/", "ledger/fail/"])
            candidate.append((time.perf_counter() - started) * 1000)
            assert got == n, (got, n)
            started = time.perf_counter()
            await bare_manifest(env, spec, ["ledger/"], get_rows=False)
            peer_warm.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            await bare_manifest(env, spec, ["ledger/row/", "ledger/fail/"], get_rows=False)
            candidate_warm.append((time.perf_counter() - started) * 1000)
        label = f"{n:,} rows ({2 * n:,} keys)"
        pages, row_pages = -(-2 * n // 1000), -(-n // 1000)
        for what, sink, peer_of in (
            ("manifest, cold client", cold, peer),
            ("manifest, warm client (rows cached)", warm, peer_warm),
        ):
            rows.append(
                [
                    label,
                    what,
                    len(sink.ms),
                    pct(sink.ms, 0.5),
                    pct(sink.ms, 0.9),
                    f"{pct(sink.ms, 0.5) / pct(peer_of, 0.5):.2f}x",
                    pct(sink.cpu, 0.5),
                    sink.count("ListObjectsV2"),
                    sink.count("GetObject"),
                    sink.other(),
                    max(sink.rt),
                    max(sink.inflight),
                ]
            )
        rows.append(
            [
                label,
                "peer (cold): bare LIST ledger/ ∥ GET tombstone, then GET rows",
                len(peer),
                pct(peer, 0.5),
                pct(peer, 0.9),
                "1.00x",
                "",
                pages,
                n + 1,
                0,
                "",
                min(32, n),
            ]
        )
        rows.append(
            [
                label,
                "candidate (cold): bare LIST row/ ∥ LIST fail/ ∥ GET tombstone, then GET rows",
                len(candidate),
                pct(candidate, 0.5),
                pct(candidate, 0.9),
                f"{pct(candidate, 0.5) / pct(peer, 0.5):.2f}x",
                "",
                row_pages + 1,
                n + 1,
                0,
                "",
                "",
            ]
        )
        rows.append(
            [
                label,
                "peer (warm): bare LIST ledger/ ∥ GET tombstone",
                len(peer_warm),
                pct(peer_warm, 0.5),
                pct(peer_warm, 0.9),
                "1.00x",
                "",
                pages,
                1,
                0,
                pages,
                2,
            ]
        )
        rows.append(
            [
                label,
                "candidate (warm): bare LIST row/ ∥ LIST fail/ ∥ GET tombstone",
                len(candidate_warm),
                pct(candidate_warm, 0.5),
                pct(candidate_warm, 0.9),
                f"{pct(candidate_warm, 0.5) / pct(peer_warm, 0.5):.2f}x",
                "",
                row_pages + 1,
                1,
                0,
                row_pages,
                3,
            ]
        )
        rows.append(
            [
                label,
                "has_rows",
                len(has.ms),
                pct(has.ms, 0.5),
                pct(has.ms, 0.9),
                "",
                pct(has.cpu, 0.5),
                has.count("ListObjectsV2"),
                has.count("GetObject"),
                has.other(),
                max(has.rt),
                max(has.inflight),
            ]
        )
    return rows


MANIFEST_HEADERS = [
    "ledger",
    "operation",
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


# --------------------------------------------------------------------------- main
async def run_server(kind: str, args: argparse.Namespace, commits: Commits) -> str:
    from botocore.handlers import add_expect_header

    server = start_server(kind)
    out: list[str] = []
    try:
        session, config = bare_session(server)  # the configuration S3CaptureLedger builds
        async with session.client("s3", endpoint_url=server.endpoint_url, config=config) as bare:
            bare.meta.events.unregister("before-call.s3", add_expect_header)  # as the ledger's own client
            env = Env(server, session, bare)
            timings = []
            started = time.perf_counter()
            rows = []
            for concurrency, rounds in ((1, args.rounds), (8, args.rounds8)):
                rows.extend(
                    record_rows(concurrency, await record_latency(env, commits.wires, concurrency, rounds, warmup=3))
                )
            out.append(
                f"### record latency on {kind} ({len(commits.wires)} real commits of {DATA_FILE} cycled, new call id each; "
                "kinds interleaved per round)\n\n" + table(RECORD_HEADERS, rows)
            )
            timings.append(f"record {time.perf_counter() - started:.0f} s")
            if args.rtt_ms > 0:
                started = time.perf_counter()
                proxy = DelayProxy(server.port, args.rtt_ms)
                try:
                    async with session.client("s3", endpoint_url=proxy.endpoint_url, config=config) as slow:
                        slow.meta.events.unregister("before-call.s3", add_expect_header)
                        slow_env = Env(server, session, slow, proxy.endpoint_url, proxy.process.pid)
                        rows = []
                        for concurrency, rounds in ((1, max(2, args.rounds // 2)), (8, max(1, args.rounds8 // 2))):
                            rows.extend(
                                record_rows(
                                    concurrency,
                                    await record_latency(slow_env, commits.wires, concurrency, rounds, warmup=3),
                                )
                            )
                finally:
                    proxy.stop()
                out.append(
                    f"### record latency on {kind} behind a {args.rtt_ms:g} ms round-trip delay proxy "
                    "(server CPU includes the proxy's)\n\n" + table(RECORD_HEADERS, rows)
                )
                timings.append(f"record with RTT {time.perf_counter() - started:.0f} s")
            started = time.perf_counter()
            sizes = sorted(set(args.resolve_sizes) | set(args.manifest_sizes))
            ledgers = await build_ledgers(env, commits, sizes)
            timings.append(f"setup of ledgers {sizes} {time.perf_counter() - started:.0f} s")
            started = time.perf_counter()
            rows = await bench_resolve(
                env, ledgers, args.resolve_sizes, args.samples, args.warm_samples, args.new_samples
            )
            target = ledgers[args.resolve_sizes[0]]
            out.append(
                f"### resolve on {kind} (request: the next call after {target.target['record']['model_call_id']}, "
                f"{len(target.request)} items, {request_bytes({'request_items': target.request}) / 1024:.0f} KiB)\n\n"
                + table(RESOLVE_HEADERS, rows)
            )
            timings.append(f"resolve {time.perf_counter() - started:.0f} s")
            started = time.perf_counter()
            rows = await bench_manifest(env, ledgers, args.manifest_sizes, args.manifest_samples)
            out.append(f"### manifest and has_rows on {kind}\n\n" + table(MANIFEST_HEADERS, rows))
            timings.append(f"manifest {time.perf_counter() - started:.0f} s")
            out.append(
                f"({kind}: {', '.join(timings)}; server started in {server.startup_seconds:.1f} s; load average {load_average()})"
            )
    finally:
        server.stop()
    return "\n\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: seconds (smoke test)")
    parser.add_argument("--servers", default="moto,seaweedfs", help="comma-separated: moto, seaweedfs (default both)")
    parser.add_argument("--no-s3", action="store_true", help="only the CPU and bytes tables (no server)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="measured record rounds at concurrency 1 per kind (default 200)"
    )
    parser.add_argument(
        "--rounds8", type=int, default=None, help="measured record rounds at concurrency 8 per kind (default 40)"
    )
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=None,
        help="also measure record behind a delay proxy adding this round-trip time (default 10; 0 skips)",
    )
    parser.add_argument("--resolve-sizes", default=None, help="rows per ledger for resolve (default 1,100,1000)")
    parser.add_argument("--manifest-sizes", default=None, help="rows per ledger for manifest (default 10,100,1000)")
    parser.add_argument("--samples", type=int, default=None, help="cold-client resolves per ledger (default 20)")
    parser.add_argument("--warm-samples", type=int, default=None, help="warm resolves after each cold one (default 5)")
    parser.add_argument(
        "--new-samples", type=int, default=None, help="resolves from a brand-new client per ledger (default 5)"
    )
    parser.add_argument(
        "--manifest-samples",
        type=int,
        default=None,
        help="cold+warm manifests per ledger (default 6; half for 1,000+ rows)",
    )
    parser.add_argument("--cpu-repeats", type=int, default=None, help="interleaved repeats per CPU path (default 5)")
    parser.add_argument("--cpu-target", type=float, default=None, help="process seconds per CPU sample (default 0.2)")
    parser.add_argument(
        "--cpu-commits",
        type=int,
        default=None,
        help="time the CPU paths over the first N commits only (default all; --quick 30)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.cpu_commits = args.cpu_commits or (30 if quick else None)
    args.rounds = args.rounds or (6 if quick else 200)
    args.rounds8 = args.rounds8 or (2 if quick else 40)
    args.resolve_sizes = [int(x) for x in (args.resolve_sizes or ("1,20" if quick else "1,100,1000")).split(",")]
    args.manifest_sizes = [int(x) for x in (args.manifest_sizes or ("10,20" if quick else "10,100,1000")).split(",")]
    args.samples = args.samples or (2 if quick else 20)
    args.warm_samples = args.warm_samples or (2 if quick else 5)
    args.new_samples = args.new_samples if args.new_samples is not None else (1 if quick else 5)
    args.manifest_samples = args.manifest_samples or (1 if quick else 6)
    args.cpu_repeats = args.cpu_repeats or (1 if quick else 5)
    args.cpu_target = args.cpu_target or (0.01 if quick else 0.2)
    if args.rtt_ms is None:
        args.rtt_ms = 10.0
    args.servers = [] if args.no_s3 else server_list(parser, args.servers)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_at_start = load_average()
    commits = load_commits()
    check_prepare(commits.wires)
    print(f"# bench_ledger\n\nmachine: {machine_summary()}\n", flush=True)
    print(
        f"commits: {len(commits.wires)} calls of {DATA_FILE} in {len(commits.rollouts)} rollouts "
        f"(fingerprinting: {'Gym' if _fp.USING_GYM else 'native'}); load average at the start {load_at_start}\n",
        flush=True,
    )
    cpu_rows, step_rows = bench_cpu(commits, args.cpu_repeats, args.cpu_target, args.cpu_commits)
    print(
        "### client CPU per record (no S3; median of interleaved repeats)\n\n"
        + table(CPU_HEADERS, cpu_rows, digits=1)
        + "\n",
        flush=True,
    )
    print("#### where the CPU goes\n\n" + table(STEP_HEADERS, step_rows, digits=1) + "\n", flush=True)
    print(
        "### stored bytes per row (row object + empty index object vs Gym's FileLineageStore JSONL line)\n\n"
        + table(BYTES_HEADERS, bench_bytes(commits), digits=0)
        + "\n",
        flush=True,
    )
    for kind in args.servers:
        print(asyncio.run(run_server(kind, args, commits)), flush=True)
        print()
    print(total_line(started, load_at_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
