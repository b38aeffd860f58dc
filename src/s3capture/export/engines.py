"""Engines: run ``export_shard`` for every shard task and yield the results, in a local process pool
(``local_engine``) or as Ray tasks (``ray_engine``); ``ENGINES`` maps ``--engine`` names to them."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import msgspec

from s3capture.errors import ExportWorkerDied, install_hint
from s3capture.export import shard as _shard
from s3capture.export.records import ExportJob, ShardResult
from s3capture.export.shard import _close_clients, export_shard
from s3capture.transport import configured_endpoint

ShardTask = tuple[int, list[Any]]
"""``(shard number, ListedRollout list)``: one unit of work for an engine."""


def _failed_shard(shard: int, rollouts: list[Any], error: BaseException) -> ShardResult:
    reason = f"shard_failed: part-{shard:05d}: {type(error).__name__}: {error}"
    return ShardResult(shard=shard, failed=[(info.rollout_id, reason) for info in rollouts], error=reason)


class _NoPandas:
    """A worker's import hook that makes ``import pandas`` fail. pyarrow imports pandas, when it is
    installed, at its first ``pa.array()`` only to ask whether the input is a pandas object: half a
    second of CPU in every worker, which never converts one. On ImportError pyarrow goes on
    without pandas."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.partition(".")[0] == "pandas":
            raise ModuleNotFoundError("s3capture's export workers do not load pandas", name=name)
        return None


@contextlib.contextmanager
def _sigint_blocked() -> Any:
    """Block SIGINT in this thread while a pool worker is spawned. The worker inherits the mask,
    so a Ctrl-C during its start-up (seconds of imports) stays pending instead of printing a
    ``KeyboardInterrupt`` traceback from inside ``multiprocessing``; ``_init_worker`` discards it
    and unblocks. Here a Ctrl-C meanwhile is not lost: it stays pending until the mask is restored
    (or another thread takes it and Python raises it in the main thread as usual)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_BUSY = False
"""In a pool worker: whether it is running a shard (``_pool_export_shard``)."""


def _worker_sigint(signum: int, frame: Any) -> None:
    """A pool worker's SIGINT handler: a Ctrl-C interrupts the shard it runs (``export_shard``
    cancels its work and re-raises; the export process, which got the Ctrl-C too, stops the pool)
    and is ignored while the worker waits for work, where a ``KeyboardInterrupt`` would only end
    the worker with a traceback."""
    if _BUSY:
        raise KeyboardInterrupt


def _pool_export_shard(job: ExportJob, shard: int, rollouts: list[Any]) -> ShardResult:
    """``export_shard`` in a pool worker, marked busy for ``_worker_sigint``."""
    global _BUSY
    _BUSY = True
    try:
        return export_shard(job, shard, rollouts)
    finally:
        _BUSY = False


def _take_sigint(ignored: bool) -> None:
    """In a worker spawned under ``_sigint_blocked``: drop a Ctrl-C that arrived during start-up
    (the export process got it too and is stopping the pool) and take SIGINT with
    ``_worker_sigint`` from now on, or keep ignoring it when the export process ignores it
    (started in the background by a shell, or by a caller that handles Ctrl-C itself): the
    workers then never stop on a Ctrl-C their export carries on through."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a pending signal that is ignored is discarded
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if not ignored:
        signal.signal(signal.SIGINT, _worker_sigint)


def _init_worker(queue: Any, parent: int, sigint_ignored: bool = False, started: Any = None) -> None:
    """``parent``: the export process's pid, taken by the parent itself. (Read here, after the
    spawned interpreter's start-up, ``os.getppid()`` is already 1 when the export died meanwhile,
    and a watchdog watching pid 1 never fires: such a worker ran its shards for good.)
    ``started``: an event set once a worker got this far (its start-up, the re-import of the
    caller's script included, succeeded)."""
    if os.getppid() != parent:
        os._exit(70)
    if started is not None:
        started.set()
    _take_sigint(sigint_ignored)
    _shard._REPORT = queue.put
    if "pandas" not in sys.modules:  # the caller's __main__, re-imported by spawn, may have loaded it
        sys.meta_path.insert(0, _NoPandas())
    threading.Thread(target=_exit_with_parent, args=(parent,), name="s3capture-export-watchdog", daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A pool worker ends within 0.2 s of its export process's death (SIGKILL included). Left
    running, it would publish the shards already handed to it, numbered by a dead parent, while a
    re-run numbers its own shards alike (one replacing the other's rows after the re-run dropped
    them), and then stay alive for good. Whatever it had not published is an orphan for the re-run."""
    while True:
        time.sleep(0.2)
        if os.getppid() != parent:
            os._exit(70)


def _worker_died(when: str) -> ExportWorkerDied:
    """The error of an export whose worker process died (``when``: which shard it ran, or ``""``)."""
    return ExportWorkerDied(
        f"an export worker process died{' ' + when if when else ''} (killed: out of memory? lower "
        "--concurrency or --shard-rollouts). The shards published before are durable: a re-run resumes "
        "from them. (Calling export() from a script: workers are spawned and re-import it, so call it "
        "under `if __name__ == '__main__':`, or pass workers=0.)"
    )


async def _close_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Shut the pool down and leave none of its processes alive."""
    # The pool's processes, before shutdown forgets them. A pool broken by a worker's death
    # terminates the workers it knows and then joins them all, but a worker that a submit
    # spawned while the pool was breaking (CPython sets the broken flag without the lock
    # submit holds) is not terminated: it waits on the call queue for good, the pool's
    # manager thread joins it for good, and so do shutdown and this process's exit. Seen in
    # about 1 of 20 SIGKILLs of a worker (a breaker, 2026-12-02). Every submit happened
    # before this point, so a broken pool's workers still alive here are such strays.
    processes = list((getattr(pool, "_processes", None) or {}).values())
    if getattr(pool, "_broken", False):
        await asyncio.to_thread(_reap_workers, processes)
    await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
    await asyncio.to_thread(_reap_workers, processes)


def _reap_workers(processes: list[Any]) -> None:
    """Kill and join the pool processes still alive after the pool shut down (a broken pool's
    stragglers; a healthy pool's workers have exited by then)."""
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(5)


async def local_engine(
    job: ExportJob, shards: AsyncIterator[ShardTask], *, workers: int = 2, report: Callable | None = None
) -> AsyncGenerator[ShardResult, None]:
    """Run ``export_shard`` for every shard task on this machine; yield each ``ShardResult`` as it ends.

    ``workers >= 1``: a process pool of that many processes (``spawn``); ``workers == 0``: one shard
    at a time in a thread of this process (debugging, tests). At most ``max(2, 2 x workers)``
    shards are taken from ``shards`` ahead of their results, so a streamed listing pauses while
    they work. A shard that raises is yielded as a failed ``ShardResult`` (its rollouts in
    ``failed``); a worker process that dies raises ``RuntimeError``. ``report`` receives progress
    tuples (see ``shard._REPORT``).

    This is the engine seam: an engine is ``async def engine(job, shards, *, workers, report)``
    yielding ``ShardResult``s (``ENGINES``).
    """
    if workers == 0:
        previous, _shard._REPORT = _shard._REPORT, report
        thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="s3capture-export")
        loop = asyncio.get_running_loop()
        try:
            async for shard, rollouts in shards:
                try:
                    yield await loop.run_in_executor(thread, export_shard, job, shard, rollouts)
                except Exception as error:  # noqa: BLE001 - the shard's rollouts are reported failed
                    yield _failed_shard(shard, rollouts, error)
        finally:
            _shard._REPORT = previous
            await loop.run_in_executor(thread, _close_clients)
            thread.shutdown(wait=True)
        return
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    stop = threading.Event()

    def drain() -> None:
        import queue as queue_module

        while not stop.is_set():
            try:
                item = queue.get(timeout=0.2)
            except queue_module.Empty:
                continue
            except (EOFError, OSError):
                return
            if item is None:  # the parent's end marker: every worker's progress came before it
                return
            if report is not None:
                report(item)

    drainer = threading.Thread(target=drain, name="s3capture-export-progress", daemon=True)
    drainer.start()
    started = ctx.Event()
    pool = concurrent.futures.ProcessPoolExecutor(
        workers,
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(queue, os.getpid(), signal.getsignal(signal.SIGINT) == signal.SIG_IGN, started),
    )
    pending: dict[asyncio.Future, ShardTask] = {}
    ahead = max(2, 2 * workers)

    def settle(future: asyncio.Future) -> ShardResult:
        shard, rollouts = pending.pop(future)
        error = future.exception()
        if error is None:
            return future.result()
        if isinstance(error, concurrent.futures.process.BrokenProcessPool) and not started.is_set():
            raise ExportWorkerDied(
                "no export worker process could start (its error is printed above; with none printed, a "
                "worker was killed while it started). Calling export() from a script: workers are "
                "spawned and re-import it, so call it under `if __name__ == "
                "'__main__':` (a script read from stdin cannot be re-imported: save it to a file), or pass "
                "workers=0. Nothing was exported by this run."
            ) from error
        if isinstance(error, concurrent.futures.process.BrokenProcessPool):
            raise _worker_died(f"while it ran shard part-{shard:05d}") from error
        return _failed_shard(shard, rollouts, error)

    try:
        async for task in shards:
            with _sigint_blocked():  # a submit may spawn a worker
                try:
                    submitted = pool.submit(_pool_export_shard, job, task[0], task[1])
                except concurrent.futures.process.BrokenProcessPool as error:  # a worker died since the last result
                    raise _worker_died("") from error
                future = asyncio.wrap_future(submitted)
            pending[future] = task
            while len(pending) >= ahead:
                done, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    yield settle(future)
        while pending:
            done, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                yield settle(future)
    finally:
        for future in pending:
            future.cancel()
        await _close_pool(pool)
        # The workers have exited, and a process flushes its queue's buffer into the pipe before
        # it exits: their progress is all in the pipe, ahead of the end marker put now. (A fixed
        # sleep here cost every export 0.3-0.5 s.) A worker killed while writing can leave the
        # queue's lock held: then the drainer is stopped after 2 s and the marker abandoned.
        queue.put(None)
        await asyncio.to_thread(drainer.join, 2)
        stop.set()
        queue.cancel_join_thread()
        queue.close()


RAY_INSTALL = install_hint("ray")


def _import_ray() -> Any:
    """``ray``, or ``ValueError`` naming the extra to install (one line, before anything is read)."""
    try:
        import ray
    except ImportError as error:
        raise ValueError(f"--engine ray needs Ray ({error}): {RAY_INSTALL}") from None
    return ray


class _RayProgress:
    """The Ray engine's progress sink (run as an actor): workers add summed progress tuples, the
    parent takes what accumulated since its last take."""

    def __init__(self) -> None:
        self.pending = [0, 0, 0, 0]

    def add(self, item: tuple[int, int, int, int]) -> None:
        for index, value in enumerate(item):
            self.pending[index] += value

    def take(self) -> tuple[int, int, int, int]:
        (a, b, c, d), self.pending = self.pending, [0, 0, 0, 0]
        return a, b, c, d


class _BatchedReport:
    """``shard._REPORT`` in a Ray worker: sums the per-rollout tuples and sends them to the progress actor
    at most every ``interval`` seconds (one actor call, not one per rollout); ``flush(wait=True)``
    at the end of a shard waits until the actor holds everything, so the parent's last take after
    the shard's result is complete."""

    def __init__(self, sink: Any, interval: float = 0.5) -> None:
        self.sink = sink
        self.interval = interval
        self.sums = [0, 0, 0, 0]
        self.last = time.monotonic()

    def __call__(self, item: tuple[int, int, int, int]) -> None:
        for index, value in enumerate(item):
            self.sums[index] += value
        if time.monotonic() - self.last >= self.interval:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        self.last = time.monotonic()
        if not any(self.sums):
            return
        sums, self.sums = tuple(self.sums), [0, 0, 0, 0]
        ref = self.sink.add.remote(sums)
        if wait:
            import ray

            ray.get(ref)


def _ray_export_shard(job: ExportJob, shard: int, rollouts: list[Any], sink: Any) -> ShardResult:
    """``export_shard`` as a Ray task: the same function, with its progress sent to ``sink``."""
    report = _BatchedReport(sink) if sink is not None else None
    previous, _shard._REPORT = _shard._REPORT, report
    try:
        return export_shard(job, shard, rollouts)
    finally:
        _shard._REPORT = previous
        if report is not None:
            report.flush(wait=True)


async def ray_engine(
    job: ExportJob,
    shards: AsyncIterator[ShardTask],
    *,
    workers: int = 2,
    report: Callable | None = None,
    address: str | None = None,
    runtime_env: dict[str, Any] | None = None,
    num_cpus: float = 1.0,
    max_retries: int = 2,
    poll_interval: float = 0.05,
) -> AsyncGenerator[ShardResult, None]:
    """Run ``export_shard`` for every shard task as a Ray task; yield each ``ShardResult`` as it ends.

    The same function, arguments and output files as ``local_engine``: each task is one whole
    shard (``export_shard(job, shard, rollouts)``), so its data file, manifest, row groups and
    resume records are byte-for-byte the local engine's (manifest timestamps aside). At most
    ``workers`` tasks run at once (Ray's parallelism; each asks for ``num_cpus`` CPUs) and at most
    ``workers`` more shards are listed ahead in this process, so a streamed listing pauses while
    they work (bounded memory: ``2 x workers`` shards of ``RolloutInfo`` and their results).

    Ray: ``ray.init(address=address)`` unless this process is connected already (then that
    connection is used and left open): ``None`` starts a local Ray runtime (or joins
    ``RAY_ADDRESS``, or the machine's latest ``ray start`` cluster), ``"auto"`` joins the cluster of
    this machine, ``"ray://host:10001"`` a remote one through Ray Client. A runtime the engine
    started is shut down when it ends, and on Linux watched by ``s3capture.export.raywatch``, which
    ends it if this process is killed.
    ``runtime_env`` (e.g. ``{"env_vars": {...}}``) is applied to every task: workers read the S3
    credentials from their own environment, as ``export_shard`` does anywhere; the job carries the
    source and destination URLs, the endpoint (``job.endpoint_url``, else this process's
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``) and the transport, never credentials.

    A task that raises is yielded as a failed ``ShardResult`` (its rollouts in ``failed``); a worker
    that dies is retried ``max_retries`` times by Ray (a shard re-run publishes the same files),
    then its shard fails the same way. ``report`` receives progress tuples (``shard._REPORT``), summed by
    each worker over at most 0.5 s and collected by a small actor. Raises ``ValueError`` when Ray
    is not installed or ``workers < 1``.
    """
    ray = _import_ray()
    if workers < 1:
        raise ValueError(f"--engine ray needs --workers >= 1 (Ray tasks at once), got {workers}")
    job = msgspec.structs.replace(
        job,
        endpoint_url=configured_endpoint(job.endpoint_url),
        transport=job.transport or os.environ.get("S3CAPTURE_TRANSPORT") or None,
    )
    started_here, watchdog = False, None
    if not ray.is_initialized():
        import logging

        options: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
        if address is None and not os.environ.get("RAY_ADDRESS"):
            options["include_dashboard"] = False  # a local runtime for this export only
            # Started before ray.init, so that a kill while ray.init starts the runtime is covered.
            watchdog = _start_ray_watchdog()
        # ray.init replaces the driver's SIGTERM handler with one that exits at once (status 15,
        # a stack dump); the caller's (the CLI's: SIGTERM ends an export as Ctrl-C does, and the
        # Ctrl-C path shuts down what this export started) is put back.
        sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        try:
            ray.init(address=address, **options)
        except BaseException:
            if watchdog is not None:
                _stop_ray_watchdog(watchdog)  # ends what the failed ray.init left running
            raise
        started_here = True
        if callable(sigterm):  # a handler of the caller's own (not the default: Ray's stays)
            signal.signal(signal.SIGTERM, sigterm)
        if watchdog is not None:
            watchdog = _name_ray_session(watchdog)
    sink: Any = None
    pending: dict[Any, ShardTask] = {}
    try:
        task_options: dict[str, Any] = {"num_cpus": num_cpus, "max_retries": max_retries}
        if runtime_env:
            task_options["runtime_env"] = runtime_env
        remote = ray.remote(_ray_export_shard).options(**task_options)
        if report is not None:
            sink = ray.remote(_RayProgress).options(num_cpus=0).remote()
        held: collections.deque[ShardTask] = collections.deque()
        exhausted = False
        take: Any = None
        next_take = time.monotonic()

        def settle(ref: Any) -> ShardResult:
            shard, rollouts = pending.pop(ref)
            try:
                return ray.get(ref)
            except ray.exceptions.RayTaskError as error:  # export_shard raised: the cause, as locally
                cause = getattr(error, "cause", None)
                return _failed_shard(shard, rollouts, cause if isinstance(cause, BaseException) else error)
            except ray.exceptions.RayError as error:  # a worker or node died, retries spent
                return _failed_shard(shard, rollouts, error)

        def drain(final: bool = False) -> None:
            nonlocal take, next_take
            if sink is None or report is None:  # both or neither
                return
            if take is not None and (final or ray.wait([take], timeout=0)[0]):
                report(ray.get(take))
                take = None
            if final:
                report(ray.get(sink.take.remote()))
            elif take is None and time.monotonic() >= next_take:
                take, next_take = sink.take.remote(), time.monotonic() + 0.5

        while True:
            while held and len(pending) < workers:
                task = held.popleft()
                pending[remote.remote(job, task[0], task[1], sink)] = task
            while not exhausted and len(pending) + len(held) < 2 * workers:
                try:
                    task = await anext(shards)
                except StopAsyncIteration:
                    exhausted = True
                    break
                if len(pending) < workers:
                    pending[remote.remote(job, task[0], task[1], sink)] = task
                else:
                    held.append(task)
            if not pending:
                break
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            drain()
            if not ready:
                await asyncio.sleep(poll_interval)
                continue
            for ref in ready:
                yield settle(ref)
        drain(final=True)
    finally:
        for ref in pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        if sink is not None:
            with contextlib.suppress(Exception):
                ray.kill(sink)
        if started_here:
            ray.shutdown()
        if watchdog is not None:
            _stop_ray_watchdog(watchdog)  # it ends whatever of the runtime outlived the shutdown


def _start_ray_watchdog() -> Any:
    """Start ``s3capture.export.raywatch`` for the local Ray runtime ``ray.init`` is about to start,
    so that a SIGKILL of the export (or the OOM killer) does not leave Ray's agents running; ``None``
    where it cannot run (not Linux). ``_name_ray_session`` tells it the session once ``ray.init``
    returned, ``_stop_ray_watchdog`` that the export ended."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        return None
    import subprocess

    from s3capture.export import raywatch

    try:
        since, started = raywatch.now_ticks(), raywatch.start_time(os.getpid())
        if started is None:
            return None
        return subprocess.Popen(
            [sys.executable, "-m", "s3capture.export.raywatch", str(os.getpid()), str(started), str(since)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C or SIGTERM to the export's group is not for it
        )
    except (OSError, ValueError):
        return None


def _name_ray_session(watchdog: Any) -> Any:
    """After ``ray.init``: tell the watchdog the runtime's session directory, or, when ``ray.init``
    joined a cluster (``address=None`` joins the machine's latest ``ray start`` cluster when there
    is one), to forget it all. Returns the watchdog, or ``None`` when it was told to forget."""
    from s3capture.export import raywatch

    try:
        import ray._private.worker as ray_worker  # the session directory has no public accessor

        node: Any = ray_worker._global_node
        session_dir = str(node.get_session_dir_path())
    except Exception:  # noqa: BLE001 - unknown: the watchdog keeps every Ray root this ray.init started
        session_dir = ""
    joined = bool(session_dir) and not raywatch.runtime_roots(os.getpid(), session_dir)
    with contextlib.suppress(OSError, ValueError):
        if joined:
            watchdog.stdin.write(raywatch.FORGET + b"\n")
        elif session_dir and "\n" not in session_dir:
            watchdog.stdin.write(raywatch.SESSION + session_dir.encode(errors="surrogateescape") + b"\n")
        watchdog.stdin.flush()
    if joined:
        _stop_ray_watchdog(watchdog, done=False)
        return None
    return watchdog


def _stop_ray_watchdog(watchdog: Any, *, done: bool = True) -> None:
    """After ``ray.shutdown()`` (or a ``ray.init`` that raised): tell the watchdog the export ended
    (a child this process forked may hold the pipe open, so closing it is not enough), and reap it
    without waiting here."""
    from s3capture.export import raywatch

    with contextlib.suppress(OSError, ValueError):
        if done:
            watchdog.stdin.write(raywatch.DONE + b"\n")
        watchdog.stdin.flush()
    with contextlib.suppress(OSError, ValueError):
        watchdog.stdin.close()
    threading.Thread(target=watchdog.wait, daemon=True).start()


ENGINES: dict[str, Callable[..., AsyncGenerator[ShardResult, None]]] = {"local": local_engine, "ray": ray_engine}
"""Engines by ``--engine`` name. Each is ``engine(job, shards, *, workers, report, **options)``
(``options``: ``export(engine_options=...)``): it runs
``export_shard`` for every ``(shard, rollouts)`` task of the async iterator ``shards`` and yields
``ShardResult``s in any order."""
