"""Subprocess side of ``tests/test_kill.py``: writers and a builder that survive SIGKILL.

The test starts ``child_main`` in processes forked by a ``multiprocessing`` forkserver that has
imported this module (so a restart costs milliseconds, not an interpreter start-up). ``config``
comes from the test (bucket URL, AWS environment, work directory, plan, seed). Each process sends
one message on its pipe per store operation it is about to start (``op <name> <rollout> <call>``;
the builder also ``op <freeze|drop>/<request>`` per request inside freeze and drop), so the test can
SIGKILL it mid-operation, and keeps a journal (JSON lines, each fsynced) in the work directory from
which a restarted process resumes:

writer journal (``writer-<i>.jsonl``):
    intent / intent_ok / intent_err   around ``begin_call``
    send (with the canonical payload, base64) / ack / refused   around ``put``: ``send`` is
        fsynced before the PUT, ``ack`` only after ``put`` returned
    mark / mark_ok / mark_err   around ``mark_incomplete``
    stop (the rollout was fenced), abandon (a restart gave up a half-done call), done_r, finished

builder journal (``builder.jsonl``):
    freeze / snap (id, version, incomplete, reasons, entry SHA-256s) / freeze_err
    drop (id, version) / dropped (ok)
    final (the final pass finished)

A restarted writer resends, byte for byte from its journal, every entry it journaled (acknowledged
or not; the acknowledged ones are identical retries) and every marker it had not seen stored, then
continues its plan (its rollouts concurrently). A restarted builder first re-runs a drop it was
killed in (same id and version). Meanwhile a writer keeps re-sending the acknowledged entries of
rollouts it finished (lost-ack retries racing the builder's drops) until the test creates ``stop``.
The builder freezes finished rollouts (and sometimes one still being written) until the test
creates ``writers-done``, then freezes every rollout not consumed once more and exits.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hashlib
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import build_conversation, turn_entry


# --------------------------------------------------------------------------- journal
class Journal:
    """Append-only JSON lines, one fsync per record; a torn last line (killed mid-write) is ignored."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict] = read_journal(path)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            os.write(self.fd, b"\n")  # terminate the torn line so the next record stays whole

    def add(self, **record: Any) -> None:
        os.write(self.fd, json.dumps(record, sort_keys=True).encode() + b"\n")
        os.fsync(self.fd)
        self.records.append(record)


def read_journal(path: Path) -> list[dict]:
    out: list[dict] = []
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return out
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # torn by a SIGKILL
    return out


_EVENTS: Any = None
"""The write end of this process's event pipe (a ``multiprocessing`` connection)."""


def event(*parts: Any) -> None:
    """Tell the test what this process is about to do (one small message: atomic on a pipe)."""
    _EVENTS.send_bytes(" ".join(str(p) for p in parts).encode())


# --------------------------------------------------------------------------- plan
def rollout_plan(config: dict, index: int) -> dict:
    """Deterministic plan of rollout ``index``: its id, calls, delta storage and marked call."""
    rid = f"kr-{index:02d}"
    calls = config["calls"]
    return {
        "rid": rid,
        "writer": index % config["writers"],
        "turns": build_conversation(rid, calls, token_base=1000 + 100 * index),
        "delta": index % 3 == 1,
        # Every fourth rollout's last call fails to capture: begin_call, then mark_incomplete.
        "marked": calls - 1 if index % 4 == 3 else None,
    }


def payload_of(plan: dict, i: int) -> bytes:
    from s3capture.records import encode_entry

    turns = plan["turns"]
    parent_cumulative = turns[i - 1].cumulative if i else None
    entry = turn_entry(plan["rid"], turns[i], delta=plan["delta"], parent_cumulative=parent_cumulative)
    return encode_entry(entry)


def make_store(config: dict, name: str) -> Any:
    from s3capture.store import S3TokenStore

    spill = Path(config["workdir"]) / "hosts" / name / "spill"
    spill.mkdir(parents=True, exist_ok=True)
    return S3TokenStore(
        config["url"], fence_grace=config["fence_grace"], spill_dir=spill, max_concurrency=8, session=SESSION
    )


# --------------------------------------------------------------------------- writer
async def run_writer(config: dict, index: int) -> None:
    from s3capture.records import RecordError
    from s3capture.protocols import TokenCaptureFrozenError, TokenCaptureRetiredError
    from s3capture.records import decode_entry

    workdir = Path(config["workdir"])
    journal = Journal(workdir / f"writer-{index}.jsonl")
    restarts = sum(1 for r in journal.records if r["t"] == "start")
    journal.add(t="start")
    rng = random.Random(f"{config['seed']}-writer-{index}-{restarts}")
    plans = [rollout_plan(config, i) for i in range(config["rollouts"]) if i % config["writers"] == index]
    store = make_store(config, f"writer-{index}")
    refusals = (TokenCaptureFrozenError, RecordError)  # RecordError: a delta whose parent is gone

    async def put(rid: str, cid: str, payload: bytes, journaled: bool) -> bool:
        if not journaled:
            journal.add(t="send", r=rid, c=cid, p=base64.b64encode(payload).decode())
        event("op", "put", rid, cid)
        try:
            await store.put(decode_entry(payload))
        except refusals as error:
            journal.add(t="refused", r=rid, c=cid, e=type(error).__name__)
            return False
        journal.add(t="ack", r=rid, c=cid)
        return True

    async def mark(rid: str, cid: str, journaled: bool) -> None:
        if not journaled:
            journal.add(t="mark", r=rid, c=cid)
        event("op", "mark", rid, cid)
        try:
            await store.mark_incomplete(rid, cid)
        except TokenCaptureFrozenError as error:  # retired: nothing left to mask
            journal.add(t="mark_err", r=rid, c=cid, e=type(error).__name__)
            return
        journal.add(t="mark_ok", r=rid, c=cid)

    try:
        # 1. Resend what the journal says we were sending: entries byte for byte (acknowledged
        #    ones too, as identical retries), markers not seen stored. A call killed between
        #    begin_call and put is either redone below or (sometimes) abandoned with its intent.
        done: dict[tuple[str, str], str] = {}
        stopped: set[str] = set()
        for record in list(journal.records):
            key = (record.get("r"), record.get("c"))
            if record["t"] in ("send", "mark", "intent"):
                done.setdefault(key, record["t"])
                if record["t"] != "intent":
                    done[key] = record["t"]
            if record["t"] in ("stop", "abandon"):
                stopped.add(record["r"])
        marks_stored = {(r["r"], r["c"]) for r in journal.records if r["t"] in ("mark_ok", "mark_err")}
        for record in list(journal.records):
            if record["t"] == "send":
                await put(record["r"], record["c"], base64.b64decode(record["p"]), journaled=True)
            elif record["t"] == "mark" and (record["r"], record["c"]) not in marks_stored:
                await mark(record["r"], record["c"], journaled=True)
        for (rid, cid), kind in done.items():
            if kind == "intent" and rid not in stopped and rng.random() < 0.5:
                journal.add(t="abandon", r=rid, c=cid)  # the host lost this call: never resent
                stopped.add(rid)

        # Lost-ack retries, from now until the test says stop: re-send acknowledged entries of
        # rollouts this writer has finished (the ones the builder is freezing and dropping), as a
        # client whose acknowledgements got lost would.
        async def retry_loop() -> None:
            stop = workdir / "stop"
            while not stop.exists():
                finished = {r["r"] for r in journal.records if r["t"] in ("done_r", "stop", "abandon")}
                sends = {(r["r"], r["c"]): r["p"] for r in journal.records if r["t"] == "send"}
                acked = [
                    k
                    for k in dict.fromkeys((r["r"], r["c"]) for r in journal.records if r["t"] == "ack")
                    if k[0] in finished
                ]
                if acked:
                    rid, cid = rng.choice(acked)
                    event("op", "retry", rid, cid)
                    try:
                        await store.put(decode_entry(base64.b64decode(sends[(rid, cid)])))
                    except TokenCaptureRetiredError:
                        event("note", "retry-read-retired", rid, cid)
                    except refusals:
                        pass
                await asyncio.sleep(rng.uniform(0, config["retry_pause"]))

        retrying = asyncio.create_task(retry_loop())

        # 2. Continue the plan: this host's rollouts run concurrently, each call after the last.
        async def run_rollout(plan: dict) -> None:
            rid = plan["rid"]
            if rid in stopped or any(r["t"] == "done_r" and r["r"] == rid for r in journal.records):
                return
            for i, turn in enumerate(plan["turns"]):
                cid = turn.call_id
                if done.get((rid, cid)) in ("send", "mark"):
                    continue
                journal.add(t="intent", r=rid, c=cid)
                event("op", "begin_call", rid, cid)
                try:
                    await store.begin_call(rid, cid)
                except TokenCaptureFrozenError as error:
                    journal.add(t="intent_err", r=rid, c=cid, e=type(error).__name__)
                    journal.add(t="stop", r=rid)
                    return
                journal.add(t="intent_ok", r=rid, c=cid)
                await asyncio.sleep(rng.uniform(0, 0.05))  # "generation"
                if plan["marked"] == i:
                    await mark(rid, cid, journaled=False)
                    break
                if not await put(rid, cid, payload_of(plan, i), journaled=False):
                    journal.add(t="stop", r=rid)
                    return
            journal.add(t="done_r", r=rid)

        await asyncio.gather(*(run_rollout(plan) for plan in plans))
        if not any(r["t"] == "finished" for r in journal.records):
            journal.add(t="finished")
        event("finished")

        # 3. Wait for the end; the lost-ack retries go on meanwhile.
        await retrying
    finally:
        await store.close()
    event("done")


# --------------------------------------------------------------------------- builder
async def run_builder(config: dict) -> None:
    from s3capture.protocols import TokenCaptureFrozenError

    workdir = Path(config["workdir"])
    journal = Journal(workdir / "builder.jsonl")
    restarts = sum(1 for r in journal.records if r["t"] == "start")
    journal.add(t="start")
    rng = random.Random(f"{config['seed']}-builder-{restarts}")
    store = make_store(config, "builder")
    rids = [rollout_plan(config, i)["rid"] for i in range(config["rollouts"])]

    # Report the steps inside freeze and drop (fence, tombstone and manifest PUTs, deletes), so the
    # test can kill between them: the retired fence of a drop that has not decided yet, ...
    phase: contextvars.ContextVar[str] = contextvars.ContextVar("phase", default="freeze")  # per task

    def on_send(operation: str, key: str, continuation: str | None) -> None:
        what = key.split("/rollouts/", 1)[1].split("/")[1] if "/rollouts/" in key else ""
        step = f"{operation}:{what}" if operation == "PutObject" else operation
        event("op", f"{phase.get()}/{step}", "-", "-")  # e.g. drop/PutObject:fence

    store.transport.add_hook(before=on_send)

    def consumed() -> set[str]:
        return {r["r"] for r in journal.records if r["t"] == "dropped" and r["ok"]}

    async def drop(rid: str, snapshot_id: str, version: int, journaled: bool) -> bool:
        if not journaled:
            journal.add(t="drop", r=rid, id=snapshot_id, v=version)
        event("op", "drop", rid, "-")
        phase.set("drop")
        ok = await store.drop(rid, snapshot_id, version)
        journal.add(t="dropped", r=rid, id=snapshot_id, v=version, ok=ok)
        return ok

    async def consume(rid: str) -> str:
        """Freeze; a trainable snapshot is consumed (journaled) and dropped."""
        journal.add(t="freeze", r=rid)
        event("op", "freeze", rid, "-")
        phase.set("freeze")
        try:
            snap = await store.freeze(rid)
        except TokenCaptureFrozenError as error:  # retired, or a crashed drop's tombstone
            journal.add(t="freeze_err", r=rid, e=str(error)[:200])
            return "error"
        shas = {e.model_call_id: hashlib.sha256(_canonical(e)).hexdigest() for e in snap.entries}
        journal.add(
            t="snap",
            r=rid,
            id=snap.snapshot_id,
            v=snap.version,
            inc=snap.incomplete,
            reasons=list(snap.reasons),
            entries=shas,
        )
        if snap.incomplete:
            return "incomplete"
        return "dropped" if await drop(rid, snap.snapshot_id, snap.version, journaled=False) else "changed"

    try:
        # A drop we were killed in: re-run it with the same pair.
        results = {(r["r"], r["id"], r["v"]) for r in journal.records if r["t"] == "dropped"}
        for record in list(journal.records):
            if record["t"] == "drop" and (record["r"], record["id"], record["v"]) not in results:
                if record["r"] not in consumed():
                    await drop(record["r"], record["id"], record["v"], journaled=True)

        writers_done = workdir / "writers-done"
        while not writers_done.exists():
            # Rollouts whose writer is done with them, and (sometimes) one still being written.
            finished: set[str] = set()
            started: set[str] = set()
            for w in range(config["writers"]):
                for r in read_journal(workdir / f"writer-{w}.jsonl"):
                    if r["t"] == "ack":
                        started.add(r["r"])
                    if r["t"] in ("done_r", "stop", "abandon"):
                        finished.add(r["r"])
            candidates = [r for r in rids if r not in consumed()]
            ready = [r for r in candidates if r in finished]
            racing = [r for r in candidates if r in started and r not in finished]
            if racing and rng.random() < config["race_probability"]:
                await consume(rng.choice(racing))
            elif ready:
                await consume(rng.choice(ready))
            await asyncio.sleep(rng.uniform(0.02, 0.1))

        # Final pass: everything the writers left behind, a few rollouts at a time.
        limit = asyncio.Semaphore(3)

        async def final(rid: str) -> None:
            async with limit:
                for _ in range(3):
                    if rid in consumed() or await consume(rid) != "changed":
                        break

        await asyncio.gather(*(final(rid) for rid in rids))
        journal.add(t="final")
    finally:
        await store.close()
    event("done")


def _canonical(entry: Any) -> bytes:
    from s3capture.records import coerce_entry, encode_entry

    return encode_entry(coerce_entry(entry))


EXIT_STORE_ERROR = 75
"""Exit code of a worker whose store failed after retries (EX_TEMPFAIL): the test restarts it."""


def child_main(role: str, config: dict, index: int, events: Any) -> None:
    """Entry point of a worker process (forked by the test's forkserver, modules preloaded)."""
    import faulthandler
    import signal

    from s3capture.errors import StoreError

    global _EVENTS
    _EVENTS = events
    os.environ.update(config["env"])
    stacks = open(Path(config["workdir"]) / f"stacks-{role}-{index}.txt", "a")  # open until exit
    faulthandler.register(signal.SIGUSR1, file=stacks)  # the test dumps stacks when stuck
    event("start", role, index)
    try:
        if role == "writer":
            asyncio.run(run_writer(config, index))
        elif role == "builder":
            asyncio.run(run_builder(config))
        else:
            raise SystemExit(f"unknown role {role!r}")
    except StoreError as error:
        # The store failed after the transport's retries (an overloaded server): what a host does
        # then is restart the job, which resumes from its journal. The test restarts it like a
        # killed process; the invariants are checked all the same.
        event("note", "store-error-restart", str(error).replace("\n", " ")[:300])
        raise SystemExit(EXIT_STORE_ERROR) from None
    except Exception:
        import traceback

        # The test's failure message shows the fleet log, not the child's stderr: send the cause.
        event("crash", traceback.format_exc()[-1800:].replace("\n", " | "))
        raise


def _warm_session() -> Any:
    """An ``aioboto3.Session`` whose botocore loader has read S3's models (one throw-away client).

    Built when the forkserver imports this module, so every forked worker shares the parsed models:
    its first client costs ~50 ms instead of ~0.5 s (several seconds on a loaded machine).
    Credentials and endpoint are the worker's own, read from its environment later.
    """
    import aioboto3

    session = aioboto3.Session()

    async def build() -> None:
        async with session.client(
            "s3",
            endpoint_url="http://127.0.0.1:9",
            region_name="us-east-1",
            aws_access_key_id="warm",
            aws_secret_access_key="warm",
        ):
            pass

    asyncio.run(build())
    return session


SESSION = _warm_session()
