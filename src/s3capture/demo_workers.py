"""The worker side of ``s3capture demo``: the model-server worker processes and the coordinator's
pool of them.

- ``_serve_call``: one model call as a worker of the token-store demo serves it (resolve the
  parent, ``begin_call``, build and stamp the ``TokenEntry``, with ``--prompt-storage delta`` only
  the prompt suffix after a RESOLVED parent, and put it); ``_StoreWorker`` holds the worker's
  ``S3TokenStore``, ``_open_worker`` picks it or ``demo_ledger.LedgerWorker`` by capture mode;
- ``_worker_main``: a worker process (start up, say ``ready``, serve calls until told to stop,
  report its request counts; a failure is one line to the coordinator);
- ``_WorkerPool``: the coordinator's side (spawn, wait for every worker to be ready, send calls,
  read results, stop), which raises at once when a worker fails, dies or stalls.

Part of ``s3capture demo``: ``s3capture.demo.run_workload`` drives these; ``s3capture.demo``
re-exports ``_serve_call`` (tests build entries through it).
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import os
import queue
import sys
import threading
import time
import traceback
from typing import Any

from s3capture.demo_common import CallResult, probe_store
from s3capture.demo_ledger import LedgerWorker
from s3capture.fingerprint import stamp_continuation
from s3capture.protocols import TokenCaptureFrozenError
from s3capture.records import (
    ParentResolutionStatus,
    TokenEntry,
    stamp_lineage,
    store_prompt_as_delta,
)
from s3capture.replay import ReplayCall

RESOLVED = ParentResolutionStatus.RESOLVED


def _token_item_index(items: list[dict]) -> int | None:
    for position in range(len(items) - 1, -1, -1):
        if items[position].get("type") == "message" and items[position].get("role") == "assistant":
            return position
    return len(items) - 1 if items else None


async def _serve_call(
    store: Any, worker: int, rollout_id: str, call: ReplayCall, delta: bool, expected_parent: str | None
) -> CallResult:
    started = time.perf_counter()
    resolution = await store.resolve(rollout_id, call.request_items)
    resolve_ms = (time.perf_counter() - started) * 1000
    await store.begin_call(rollout_id, call.model_call_id)
    full_prompt = list(call.prompt_token_ids)
    entry = TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call.model_call_id,
        model="s3capture-demo",
        prompt_token_ids=full_prompt,
        generation_token_ids=list(call.generation_token_ids),
        generation_log_probs=list(call.generation_log_probs),
        output_items=list(call.output_items),
        token_item_index=_token_item_index(call.output_items),
        response_id=f"resp-{call.model_call_id}",
        created_at=time.time(),
    )
    stamp_continuation(entry, call.request_items)
    parent_ok = True
    if resolution.status == RESOLVED:
        assert resolution.match is not None
        parent_tokens = list(resolution.match.cumulative_token_ids)
        parent_ok = full_prompt[: len(parent_tokens)] == parent_tokens and (
            expected_parent is None or resolution.match.model_call_id == expected_parent
        )
        stamp_lineage(entry, resolution.match.model_call_id, parent_resolution=RESOLVED)
        # Every RESOLVED call stores only its prompt suffix, as Gym's delta_records does; the store's
        # own checkpoints keep a fresh resolve at three round trips whatever the depth.
        if delta and parent_ok:
            store_prompt_as_delta(entry, parent_tokens)
    else:
        stamp_lineage(
            entry, None, parent_resolution=ParentResolutionStatus(resolution.status), reason=resolution.reason
        )
    started = time.perf_counter()
    try:
        await store.put(entry)
    except TokenCaptureFrozenError:
        raise
    except Exception:
        await store.mark_incomplete(rollout_id, call.model_call_id)
        raise
    put_ms = (time.perf_counter() - started) * 1000
    return CallResult(
        rollout_id,
        call.index,
        worker,
        ParentResolutionStatus(resolution.status).value,
        resolution.reason,
        parent_ok,
        resolve_ms,
        put_ms,
    )


class _StoreWorker:
    """A model-server worker of the token-store demo: one ``S3TokenStore``."""

    def __init__(self, url: str, concurrency: int, delta: bool) -> None:
        from s3capture.store import S3TokenStore

        self.store = S3TokenStore(url, max_concurrency=concurrency)
        self.delta = delta

    async def serve(self, worker: int, rollout_id: str, call: ReplayCall, expected_parent: str | None) -> CallResult:
        return await _serve_call(self.store, worker, rollout_id, call, self.delta, expected_parent)

    async def probe(self) -> None:
        await probe_store(self.store.url)

    def request_counts(self) -> dict[str, int]:
        return {f"worker:{k}": v for k, v in self.store.request_counts.items()}

    async def close(self) -> None:
        await self.store.close()


def _open_worker(url: str, concurrency: int, options: dict[str, Any]) -> Any:
    if options["capture"] == "ledger":
        return LedgerWorker(url, options["staging_url"], concurrency)
    return _StoreWorker(url, concurrency, options["delta"])


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or repr(error)
    return f"{type(error).__name__}: {text}"


def _exit_with_parent() -> None:
    """End this worker process as soon as the coordinator is gone (SIGKILL, a crash): its queues
    then never say stop, so it would otherwise wait on them, and keep writing, forever (a demo
    breaker found four orphaned workers and the resource tracker still running minutes later)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns when the parent process has ended (its sentinel pipe closes)
        os._exit(1)

    threading.Thread(target=watch, name="s3capture-demo-parent-watch", daemon=True).start()


def _worker_main(
    worker: int, url: str, env: dict[str, str], inbox: Any, outbox: Any, options: dict[str, Any], concurrency: int
) -> None:
    """A worker process: start up (open the store, probe it), say ``ready``, then serve calls until ``None``.

    Any exception that ends the worker (at start-up or later) is sent to the coordinator as one
    ``("failed", worker, phase, line)`` message and the process exits with status 1, without a
    traceback on stderr: the coordinator stops the run and prints that line.
    """
    os.environ.update(env)
    _exit_with_parent()
    phase = ["start-up"]

    async def run() -> None:
        server = _open_worker(url, concurrency, options)
        try:
            await server.probe()
            outbox.put(("ready", worker))
            phase[0] = "run"
            await serve(server)
        finally:
            await server.close()

    async def serve(server: Any) -> None:
        loop = asyncio.get_running_loop()
        limit = asyncio.Semaphore(concurrency)
        tasks: set[asyncio.Task] = set()

        async def handle(rollout_id: str, call: ReplayCall, expected_parent: str | None) -> None:
            async with limit:
                try:
                    result = await server.serve(worker, rollout_id, call, expected_parent)
                except Exception as error:  # noqa: BLE001 - reported to the coordinator
                    result = CallResult(
                        rollout_id,
                        call.index,
                        worker,
                        "error",
                        "",
                        False,
                        0.0,
                        0.0,
                        f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}",
                    )
                outbox.put(("call", result))

        while True:
            message = await loop.run_in_executor(None, inbox.get)
            if message is None:
                break
            task = asyncio.create_task(handle(*message))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        outbox.put(("requests", worker, server.request_counts()))

    try:
        asyncio.run(run())
    except BaseException as error:  # noqa: BLE001 - one line to the coordinator, no traceback dump
        outbox.put(("failed", worker, phase[0], _one_line(error)))
        outbox.close()
        outbox.join_thread()
        sys.exit(1)


class _WorkerPool:
    """The coordinator's side of the worker processes.

    ``start`` spawns them and waits until every one has opened its store and probed it; ``get``
    returns the next result. Both raise ``RuntimeError`` at once when a worker reports a failure
    or exits, and when nothing arrives for ``stall`` seconds, so a run never waits on a dead worker.
    """

    def __init__(
        self,
        workers: int,
        url: str,
        env: dict[str, str],
        options: dict[str, Any],
        concurrency: int,
        stall: float = 120.0,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(workers)]
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(w, url, env, self.inboxes[w], self.outbox, options, concurrency),
                name=f"s3capture-demo-worker-{w}",
                daemon=True,
            )
            for w in range(workers)
        ]
        self.stall = stall
        self.requests: collections.Counter = collections.Counter()
        self._stopping = False

    def start(self) -> None:
        for proc in self.procs:
            proc.start()
        ready: set[int] = set()
        while len(ready) < len(self.procs):
            kind, *payload = self._next("start-up")
            if kind == "ready":
                ready.add(payload[0])

    def send(self, worker: int, message: Any) -> None:
        self.inboxes[worker].put(message)

    def get(self) -> tuple:
        return self._next("run")

    def _next(self, phase: str) -> tuple:
        deadline = time.monotonic() + self.stall
        while True:
            try:
                message = self.outbox.get(timeout=0.25)
            except queue.Empty:
                self._raise_if_dead(phase)
                if time.monotonic() > deadline:
                    what = "no worker finished starting" if phase == "start-up" else "no progress"
                    raise RuntimeError(f"{what} for {self.stall:.0f} s") from None
                continue
            if message[0] == "failed":
                self._fail(*message[1:])
            return tuple(message)

    def _fail(self, worker: int, phase: str, line: str) -> None:
        where = "at start-up" if phase == "start-up" else "during the run"
        raise RuntimeError(f"worker {worker} failed {where}: {line}")

    def _raise_if_dead(self, phase: str) -> None:
        dead = [(w, p) for w, p in enumerate(self.procs) if p.exitcode is not None]
        if not dead:
            return
        # A worker that failed sent its reason before exiting: read it rather than just the exit code.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                message = self.outbox.get(timeout=0.25)
            except queue.Empty:
                break
            if message[0] == "failed":
                self._fail(*message[1:])
        worker, proc = dead[0]
        where = "at start-up" if phase == "start-up" else "during the run"
        raise RuntimeError(f"worker {worker} (pid {proc.pid}) exited {where} with status {proc.exitcode}")

    def stop(self, *, abort: bool) -> None:
        """Tell every worker to finish. Normally wait (up to 60 s) for their request counts; when the run is
        being aborted, give them 1 s and kill the rest (a worker still starting up reads no message)."""
        for inbox in self.inboxes:
            inbox.put(None)
        if not abort:
            reported: set[int] = set()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if all(w in reported or p.exitcode is not None for w, p in enumerate(self.procs)):
                    break
                try:
                    message = self.outbox.get(timeout=0.25)
                except queue.Empty:
                    continue
                if message[0] == "requests":
                    reported.add(message[1])
                    self.requests.update(message[2])
        deadline = time.monotonic() + (1 if abort else 10)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
