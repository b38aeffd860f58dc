"""Writers and a builder killed with SIGKILL mid-put, mid-freeze and mid-drop lose nothing.

Separate processes (``tests/killworkers.py``, forked by a forkserver that preloaded the store),
each with its own ``S3TokenStore`` (``fence_grace=0.2``) and a spill directory per host: three
writers put the entries of nine rollouts (a ``begin_call`` intent before each put, delta prompts in
some rollouts, a ``mark_incomplete`` for the last call of others) and keep re-sending acknowledged
entries (lost-ack retries); a builder freezes rollouts (some while still being written) and drops
the trainable ones. Every process reports each operation it starts, and the builder each request
inside freeze and drop, on a pipe; the test SIGKILLs it a seeded random moment later (before the
request, in flight, or after the reply and before the journal noted it) and restarts it. Writers
resend their journaled entries byte for byte (acknowledged ones too) and go on; the builder re-runs
a drop it was killed in. After the run the test checks, with a fresh store and a plain listing:

1. a rollout that is gone was removed by a drop of a trainable snapshot holding every acknowledged
   put of the rollout, and had no acknowledged marker;
2. no trainable snapshot misses the entry of a call whose ``begin_call`` returned (a writer killed
   between intent and put, and never resending, leaves the rollout masked);
3. after the writers finished and the builder consumed everything, every acknowledged entry is in
   the consumed snapshot or still in its rollout (byte-identical), and a rollout with a returned
   ``begin_call`` and no entry, or a marker, is incomplete.

A drop killed after its tombstone and before it decided has deleted nothing (a drop writes the
retire tombstone before deleting); a later freeze ignores its tombstone, so the rollout is frozen
and consumed again rather than wedged.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from helpers import forkserver_context, list_keys, split_bucket_url
from killworkers import EXIT_STORE_ERROR, child_main, read_journal, rollout_plan

from s3capture.layout import Layout
from s3capture.protocols import TokenCaptureFrozenError

GRACE = 0.2
WRITERS = 3
CONFIG = {
    "writers": WRITERS,
    "rollouts": 9,
    "calls": 5,
    "fence_grace": GRACE,
    "race_probability": 0.25,
    "retry_pause": 0.02,
}
KILLS = {"writer": 3, "freeze": 3, "drop": 3}
"""SIGKILLs per writer, and of the builder during freezes and during drops."""
KILL_ODDS = {
    "put": 0.25,
    "begin_call": 0.15,
    "mark": 0.5,
    "retry": 0.01,
    "freeze": 0.15,
    "freeze/": 0.06,
    "freeze/PutObject:fence": 0.2,
    "drop": 0.15,
    "drop/": 0.06,
    "drop/PutObject:drop": 0.25,
    "drop/PutObject:fence": 0.35,
    "drop/DeleteObjects": 0.3,
}
"""Chance that an operation's start (or a request inside freeze and drop) triggers a kill."""
KILL_DELAY = {"drop": 0.45, "freeze": 0.05, "drop/PutObject:fence": 0.06}
"""Longest delay between the start message and the kill (drop waits ``fence_grace`` + 0.1 s first);
0.03 s when not named. A kill after the retired fence of a drop that has not decided yet leaves that
fence up until the builder is back."""
REQUIRED_PHASES = ("put", "freeze", "drop")
"""Operations every run must kill at least once in (the test's closing assertion)."""
FORCE_AFTER = 4
"""Operations of a required phase started without a kill in that phase, after which the next one
is killed for certain."""
BUILDER_RESTART = 0.5
"""Longest pause before a killed builder is restarted (seconds)."""
RUN_TIMEOUT = 90.0


class Fleet:
    """The worker processes, their progress messages, and the kills (all from one thread)."""

    def __init__(self, config: dict, seed: int) -> None:
        self.config = config
        self.ctx = forkserver_context()
        self.rng = random.Random(seed)
        self.procs: dict[str, Any] = {}
        self.conns: dict[str, Any] = {}
        self.kills_left = {f"writer-{i}": KILLS["writer"] for i in range(WRITERS)} | {
            "builder/freeze": KILLS["freeze"],
            "builder/drop": KILLS["drop"],
        }
        self.kills: list[tuple[float, str, Any, str]] = []  # (when, name, process, operation)
        self.killed: list[tuple[str, str]] = []
        self.unkilled: collections.Counter = collections.Counter()
        """Operations of each phase the test requires a kill in (put, freeze, drop) started since
        that phase's last scheduled kill; past ``FORCE_AFTER`` the next one is killed for certain."""
        self.finished: set[str] = set()
        self.notes: collections.Counter = collections.Counter()
        self.log: list[str] = []
        self.t0 = time.monotonic()

    def note(self, name: str, text: str) -> None:
        self.log.append(f"{time.monotonic() - self.t0:6.2f} {name}: {text}")

    def start(self, name: str) -> None:
        role, _, index = name.partition("-")
        reader, writer = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=child_main, args=(role, self.config, int(index or 0), writer), daemon=True)
        proc.start()
        writer.close()
        self.procs[name], self.conns[name] = proc, reader
        self.note(name, f"started pid {proc.pid}")

    def on_message(self, name: str, text: str) -> None:
        self.note(name, text)
        parts = text.split()
        if parts[0] == "finished":
            self.finished.add(name)
        if parts[0] == "note":
            self.notes[parts[1]] += 1
        if parts[0] != "op":
            return
        op = parts[1]
        budget = f"builder/{op.split('/')[0]}" if name == "builder" else name
        if self.kills_left[budget] <= 0:
            return
        odds = KILL_ODDS.get(op, KILL_ODDS.get(op.split("/")[0] + "/", 0.0))
        phase = op if op in REQUIRED_PHASES else ""
        if phase and not any(o.split("/")[0] == phase for _, o in self.killed + [(k[1], k[3]) for k in self.kills]):
            # The test requires a kill in each of these phases: a run whose timing kept dodging
            # one (say, every drop finished before its kill) gets it on a later operation.
            self.unkilled[phase] += 1
            if self.unkilled[phase] > FORCE_AFTER:
                odds = 1.0
        if self.rng.random() < odds:
            self.kills_left[budget] -= 1
            when = time.monotonic() + self.rng.uniform(0, KILL_DELAY.get(op, 0.03))
            self.kills.append((when, name, self.procs[name], op))

    def kill_due(self) -> None:
        now = time.monotonic()
        for item in [k for k in self.kills if k[0] <= now]:
            self.kills.remove(item)
            _, name, proc, op = item
            if proc is self.procs[name] and proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)  # not reaped yet: the pid is still this process
                self.killed.append((name, op))
                self.note(name, f"KILLED in {op}")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.exitcode is None:
                proc.kill()
            proc.join(10)


def run_fleet(config: dict, seed: int) -> Fleet:
    from multiprocessing.connection import wait

    workdir = Path(config["workdir"])
    fleet = Fleet(config, seed)
    names = [f"writer-{i}" for i in range(WRITERS)] + ["builder"]
    for name in names:
        fleet.start(name)
    deadline = time.monotonic() + RUN_TIMEOUT
    done: set[str] = set()
    restarts: dict[str, float] = {}
    try:
        while done != set(names):
            if time.monotonic() > deadline:
                for proc in fleet.procs.values():
                    if proc.exitcode is None:
                        os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(1.0)
                stacks = "".join(p.read_text()[-3000:] for p in workdir.glob("stacks-*.txt"))
                raise AssertionError(
                    f"no end after {RUN_TIMEOUT} s; done={sorted(done)}; last events:\n"
                    + "\n".join(fleet.log[-60:])
                    + "\nstacks:\n"
                    + stacks
                )
            for name, when in list(restarts.items()):
                if when <= time.monotonic():
                    del restarts[name]
                    fleet.start(name)  # it resumes from its journal
            pending = [k[0] for k in fleet.kills] + list(restarts.values())
            timeout = min([0.5] + [max(0.0, when - time.monotonic()) for when in pending])
            live = {name: fleet.procs[name] for name in names if name not in done and name not in restarts}
            ready = wait([fleet.conns[n] for n in live] + [p.sentinel for p in live.values()], timeout)
            for name in live:
                conn = fleet.conns[name]
                try:
                    while conn.poll():
                        fleet.on_message(name, conn.recv_bytes().decode())
                except (EOFError, OSError):
                    pass
            fleet.kill_due()
            if fleet.finished >= {f"writer-{i}" for i in range(WRITERS)}:
                (workdir / "writers-done").touch()  # the builder's final pass starts
            for name, proc in live.items():
                if proc.sentinel not in ready:
                    continue
                proc.join()
                code = proc.exitcode
                fleet.conns[name].close()
                if code in (-signal.SIGKILL, EXIT_STORE_ERROR):
                    # Writers come back at once; the builder's host takes a while (its killed
                    # drop may have left the retired fence up meanwhile).
                    restarts[name] = time.monotonic() + (
                        fleet.rng.uniform(0, BUILDER_RESTART) if name == "builder" else 0
                    )
                elif code == 0:
                    done.add(name)
                    fleet.note(name, "done")
                    if name == "builder":
                        (workdir / "stop").touch()  # the writers' lost-ack retries end
                else:
                    crashes = [line for line in fleet.log if ": crash " in line]
                    raise AssertionError(f"{name} exited with {code}; log:\n" + "\n".join(fleet.log[-40:] + crashes))
    finally:
        fleet.stop_all()
        (workdir / "fleet.log").write_text("\n".join(fleet.log) + "\n")
    return fleet


# --------------------------------------------------------------------------- the test


# One kill schedule per server, a different one on each (seeds 1-3 over the suite): two per server
# cost CI a minute and a half, and which server a schedule meets does not change what it explores.
_SEED_OF_SERVER = {"moto": 1, "seaweedfs": 2, "ceph": 3}


async def test_sigkilled_writers_and_builder_lose_no_acknowledged_entry(
    s3_server, fresh, bucket_url, s3_client, tmp_path
):
    seed = _SEED_OF_SERVER.get(s3_server.kind, 1)
    workdir = tmp_path / "run"
    workdir.mkdir()
    config = dict(CONFIG, url=bucket_url, workdir=str(workdir), seed=seed, env=dict(os.environ))
    (workdir / "config.json").write_text(json.dumps(config))

    started = time.monotonic()
    fleet = await asyncio.to_thread(run_fleet, config, seed)
    elapsed = time.monotonic() - started

    writers = [read_journal(workdir / f"writer-{i}.jsonl") for i in range(WRITERS)]
    builder = read_journal(workdir / "builder.jsonl")
    report = check_invariants(config, writers, builder, fresh, s3_client, bucket_url)
    summary = await report
    kills = collections.Counter(op for _, op in fleet.killed)
    print(f"\n[{s3_server.kind} seed={seed}] {elapsed:.1f} s, kills {dict(kills)}, {summary}, {dict(fleet.notes)}")
    killed_in = {op.split("/")[0] for op in kills}
    assert {"put", "freeze", "drop"} <= killed_in, f"a run must kill mid-put, mid-freeze and mid-drop: {dict(kills)}"


async def check_invariants(
    config: dict, writers: list[list[dict]], builder: list[dict], fresh: Any, s3_client: Any, bucket_url: str
) -> dict:
    # What the writers know: acknowledged puts (with their bytes), intents and markers.
    payloads: dict[tuple[str, str], bytes] = {}
    acked: dict[str, dict[str, str]] = collections.defaultdict(dict)  # rid -> cid -> sha
    intents_ok: dict[str, set[str]] = collections.defaultdict(set)
    marks_ok: set[str] = set()
    for journal in writers:
        for r in journal:
            if r["t"] == "send":
                body = base64.b64decode(r["p"])
                assert payloads.setdefault((r["r"], r["c"]), body) == body, "a resend was not byte-identical"
            elif r["t"] == "ack":
                acked[r["r"]][r["c"]] = hashlib.sha256(payloads[(r["r"], r["c"])]).hexdigest()
            elif r["t"] == "intent_ok":
                intents_ok[r["r"]].add(r["c"])
            elif r["t"] == "mark_ok":
                marks_ok.add(r["r"])

    # What the builder saw: snapshots and drops.
    snaps: dict[tuple[str, str, int], dict] = {}
    drops: dict[str, list[tuple[str, int, bool | None]]] = collections.defaultdict(list)
    for r in builder:
        if r["t"] == "snap":
            snaps[(r["r"], r["id"], r["v"])] = r
        elif r["t"] == "drop":
            drops[r["r"]].append((r["id"], r["v"], None))
        elif r["t"] == "dropped":
            drops[r["r"]].append((r["id"], r["v"], r["ok"]))
    assert any(r["t"] == "final" for r in builder), "the builder never finished its final pass"

    # 2. No trainable snapshot misses an entry whose begin_call returned (every acknowledged intent
    #    landed before the first freeze's fence), and every entry it holds is one a writer sent.
    for (rid, _, _), snap in snaps.items():
        if snap["inc"]:
            continue
        missing = intents_ok[rid] - set(snap["entries"])
        assert not missing, f"trainable snapshot of {rid} misses calls {sorted(missing)} whose begin_call returned"
        for cid, sha in snap["entries"].items():
            assert hashlib.sha256(payloads[(rid, cid)]).hexdigest() == sha, f"{rid}/{cid}: snapshot bytes differ"

    bucket, root = split_bucket_url(bucket_url)
    layout = Layout(root)
    store = fresh(fence_grace=GRACE)
    outcome = collections.Counter()
    for index in range(config["rollouts"]):
        rid = rollout_plan(config, index)["rid"]
        prefix = layout.rollout(rid)
        keys = list_keys(s3_client, bucket, prefix)
        retired = prefix + "retired" in keys
        ok_drops = [(i, v) for i, v, ok in drops[rid] if ok]
        assert len(ok_drops) <= 1, f"{rid} dropped twice: {ok_drops}"
        if retired:
            # 1. The rollout was dropped (the only remover here): by a drop that returned True, or
            #    by one the builder was killed in. That snapshot was trainable and holds every
            #    acknowledged put; no acknowledged marker can have been left out.
            started = {(i, v) for i, v, ok in drops[rid] if ok is None}
            failed = {(i, v) for i, v, ok in drops[rid] if ok is False}
            candidates = ok_drops or sorted(started - failed) or sorted(started)
            assert candidates, f"{rid} is retired but the builder never dropped it"
            assert any(
                not snaps[(rid, i, v)]["inc"] and set(acked[rid].items()) <= set(snaps[(rid, i, v)]["entries"].items())
                for i, v in candidates
            ), (
                f"{rid}: acknowledged entries {sorted(acked[rid])} are not all in a dropped snapshot {[snaps[(rid, i, v)]['entries'] for i, v in candidates]}"
            )
            assert rid not in marks_ok, f"{rid} had an acknowledged marker but was dropped as trainable"
            outcome["dropped_ok" if ok_drops else "dropped_by_killed_drop"] += 1
            continue
        assert not ok_drops, f"drop of {rid} returned True but the rollout is not retired"
        # 3. Not dropped: everything acknowledged is still there.
        try:
            snap = await store.freeze(rid)
        except TokenCaptureFrozenError:
            # A drop killed after its tombstone and before it decided wedges the rollout (freeze
            # refuses it): the entries are still stored.
            for cid, sha in acked[rid].items():
                assert any(k.endswith(f"/{sha}.zst") for k in keys), f"{rid}/{cid} lost from a wedged rollout"
            outcome["wedged"] += 1
            continue
        present = {e.model_call_id: hashlib.sha256(_canonical(e)).hexdigest() for e in snap.entries}
        lost = {cid for cid, sha in acked[rid].items() if present.get(cid) != sha}
        assert not lost, f"{rid}: acknowledged entries {sorted(lost)} lost (snapshot {snap.reasons})"
        if intents_ok[rid] - set(present) or rid in marks_ok:
            assert snap.incomplete, f"{rid} is trainable with a dangling intent or a marker"
        outcome["kept_incomplete" if snap.incomplete else "kept_trainable"] += 1
    acked_total = sum(len(v) for v in acked.values())
    return {"acked": acked_total, "rollouts": dict(outcome)}


def _canonical(entry: Any) -> bytes:
    from s3capture.records import coerce_entry, encode_entry

    return encode_entry(coerce_entry(entry))
