"""``s3capture export --engine ray``: the local engine's files, from Ray tasks (docs/export.md, "Engines").

One test on a local Ray runtime (2 CPUs, no dashboard; starting it costs ~10-20 s, so there is one,
on moto): the example rollouts, full and delta, plus masked ones, exported by the local engine and
by the Ray engine into two folders give the same file names, byte-identical Parquet files, the
same manifests up to their timestamps, the same summary (request counts by kind included) and
progress that adds up to it. The Ray workers get the S3 credentials the documented way
(``runtime_env`` env vars); afterwards no process the Ray runtime started is left running.
Under ``CI`` a missing Ray fails the module instead of skipping it.

Without Ray or a server: ``--engine ray`` without Ray installed, and the Ray-only options with the
local engine, are one-line usage errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gymcompat import running_under_ci
from s3capture.cli import main
from s3capture.export import _Progress, export, format_summary
from helpers import put_chain
from test_export import MASKED, capture_all

RAY_PROCESS_WORDS = ("ray", "raylet", "gcs_server", "plasma")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        if running_under_ci():
            pytest.fail(
                f"Ray is required under CI ({error}): pip install 's3capture[ray]' (in the test extra)", pytrace=False
            )
        pytest.skip(f"Ray is not installed ({error}): pip install 's3capture[ray]'")
    return ray


def _children() -> dict[int, int]:
    """pid -> parent pid of every process (from ``/proc``)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as handle:
                    out[int(name)] = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return out


def _family(root: int) -> dict[int, tuple[int, str]]:
    """``pid -> (start time, command)`` of the live descendants of ``root`` whose command line names Ray."""
    parents = _children()
    family = {root}
    grew = True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    family.discard(root)
    out = {}
    for pid in family:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as handle:
                started = int(handle.read().rsplit(")", 1)[1].split()[19])
        except (OSError, ValueError, IndexError):
            continue
        if any(word in command for word in RAY_PROCESS_WORDS):
            out[pid] = (started, command[:120])
    return out


def _still_running(processes: dict[int, tuple[int, str]]) -> dict[int, str]:
    """``pid -> command`` of those of ``processes`` still running (the same pid and start time)."""
    left = {}
    for pid, (started, command) in processes.items():
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[19]) == started:
            left[pid] = command
    return left


@pytest.fixture(scope="module")
def ray_runtime() -> Any:
    """A local Ray runtime with 2 CPUs for this module; shut down afterwards, and every process it
    started (GCS, raylet, workers, ...) checked gone."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the process check reads /proc")
    ray = _import_ray()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        yield ray
    finally:
        started = _family(os.getpid())  # the runtime ray.init started
        ray.shutdown()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _still_running(started):
            time.sleep(0.2)
        left = _still_running(started)
        assert not left, f"Ray processes still running after ray.shutdown(): {left}"


def _folder(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _manifest_without_time(raw: bytes) -> dict:
    data = msgspec.json.decode(raw)
    assert data.pop("created_at")
    return data


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # one Ray runtime start: one server (CI budget)
async def test_the_ray_engine_writes_the_local_engines_files(
    ray_runtime: Any, fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    ids, _ = await capture_all(fresh)
    options = dict(min_age=0, masked="include", shard_rollouts=3)
    local = await export(bucket_url, str(tmp_path / "local"), workers=0, **options)
    assert local.ok and local.exported == len(ids) and local.masked_written == len(MASKED), format_summary(local)
    assert local.shards_written == -(-(len(ids) + len(MASKED)) // 3) >= 3

    # Ray's workers were started before this test pointed the environment at the server: they get
    # the credentials through runtime_env (the documented way); the endpoint travels in the job.
    credentials = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    progress = _Progress(False)
    on_ray = await export(
        bucket_url,
        str(tmp_path / "ray"),
        engine="ray",
        workers=2,
        progress=progress,
        engine_options={"runtime_env": {"env_vars": credentials}},
        **options,
    )
    assert on_ray.ok, format_summary(on_ray)

    # The same summary (request counts by kind included), bar the destination and the wall time.
    def comparable(summary: Any) -> dict:
        data = msgspec.to_builtins(summary)
        for name in ("dest", "wall_seconds"):
            data.pop(name)
        return data

    assert comparable(on_ray) == comparable(local)
    # Progress came back from the Ray workers and adds up to what was written.
    assert (progress.rollouts, progress.trajectories, progress.tokens, progress.bytes) == (
        len(ids) + len(MASKED),
        on_ray.trajectories,
        on_ray.tokens,
        on_ray.bytes_read,
    )

    # The same files: names, byte-identical data files, manifests equal up to their timestamps.
    a, b = _folder(tmp_path / "local"), _folder(tmp_path / "ray")
    assert list(a) == list(b) and not [name for name in a if name.startswith(".") and name != ".s3capture-export.lock"]
    assert sum(name.endswith(".parquet") for name in a) == local.shards_written
    for name in a:
        if name.endswith(".manifest.json"):
            assert _manifest_without_time(a[name]) == _manifest_without_time(b[name]), name
        else:
            assert a[name] == b[name], f"{name} differs between the local and the Ray engine"


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
async def test_a_sigkilled_ray_export_leaves_no_process_of_its_runtime(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    """``s3capture export --engine ray`` starts a local Ray runtime of its own. SIGKILLed (or killed
    by the OOM killer), it cannot shut it down: Ray ends its GCS and raylet with the driver, but
    left the raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) running for good.
    The export's watchdog (``s3capture.export.raywatch``) ends them."""
    import signal
    import subprocess

    from s3capture.export import HOLD_ENV

    if not sys.platform.startswith("linux"):
        pytest.skip("the process check reads /proc")
    _import_ray()
    writer, builder = fresh(), fresh()
    for rid in ("k1", "k2", "k3"):
        await put_chain(writer, rid, 2)
        await builder.freeze(rid)
    env = {**os.environ, HOLD_ENV: "1"}
    env.pop("RAY_ADDRESS", None)  # a runtime of its own, not this process's
    command = [sys.executable, "-m", "s3capture.cli", "export", bucket_url, "--out", str(tmp_path / "out")]
    command += ["--engine", "ray", "--workers", "1", "--shard-rollouts", "1", "--min-age", "0", "--no-progress"]
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    runtime: dict[int, tuple[int, str]] = {}
    try:
        line, deadline = "", time.monotonic() + 180
        while "holding after" not in line:
            line = await asyncio.to_thread(proc.stderr.readline)  # type: ignore[union-attr]
            assert (line or proc.poll() is None) and time.monotonic() < deadline, f"no hold: {line!r}"
        runtime = _family(proc.pid)
        commands = " | ".join(command for _, command in runtime.values())
        assert "raylet" in commands and "ray::" in commands, f"no local Ray runtime under the export: {commands}"
        os.kill(proc.pid, signal.SIGKILL)  # the export process alone, as the OOM killer does
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _still_running(runtime) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert not _still_running(runtime), f"Ray processes outlived the killed export: {_still_running(runtime)}"
    finally:
        for pid in _still_running(runtime):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stderr.close()  # type: ignore[union-attr]


def test_the_watchdog_ends_only_its_runtime_and_exits_when_told_though_a_fork_holds_its_pipe(tmp_path: Path) -> None:
    """Found by a breaker: the watchdog first noted every ``ray::`` descendant of the export's
    process, so a normal export ended another Ray runtime the same program ran (an actor died); it
    watched a cluster the export had only joined; and a child the export forked kept its pipe open,
    so it lingered and later ended the program's next runtime. Now it notes only the runtime's roots
    (the export's direct children naming the session directory) and their descendants, and ends on
    an explicit ``done``. No Ray needed: ``exec -a`` gives ``sleep`` a runtime's command lines."""
    import multiprocessing
    import signal
    import subprocess

    from s3capture.export import raywatch

    if not sys.platform.startswith("linux"):
        pytest.skip("the watchdog reads /proc")
    session = str(tmp_path / "session_2026-12-01_00-00-00_000000_1")
    root = subprocess.Popen(["bash", "-c", f"(exec -a ray::Agent sleep 300) & exec -a '{session}/raylet' sleep 300"])
    other = subprocess.Popen(["bash", "-c", "exec -a ray::OtherRuntimeActor sleep 300"])
    forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    dog = None
    runtime: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 10
        while len(raywatch.runtime_processes(os.getpid(), session)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        runtime = raywatch.runtime_processes(os.getpid(), session)
        assert root.pid in runtime and len(runtime) == 2, runtime  # the root and its agent, not "other"
        assert raywatch.runtime_roots(os.getpid(), str(tmp_path / "another_session")) == set()
        # Processes started before ray.init was called are no roots of its runtime (a PID 1 that
        # adopted a `ray start` cluster's processes, then joined that cluster).
        assert raywatch.runtime_roots(os.getpid(), session, since=raywatch.now_ticks() + 100) == set()
        started = raywatch.start_time(os.getpid())
        since = str(raywatch.start_time(root.pid))
        command = [sys.executable, "-m", "s3capture.export.raywatch", str(os.getpid()), str(started), since, session]
        dog = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
        time.sleep(1.0)  # its first note
        forked.start()  # holds the pipe's write end from now on
        dog.stdin.write(raywatch.DONE + b"\n")  # type: ignore[union-attr]
        dog.stdin.flush()  # type: ignore[union-attr]
        dog.stdin.close()  # type: ignore[union-attr]
        assert dog.wait(timeout=20) == 0, "the watchdog did not exit on done while a fork held its pipe"
        assert root.wait(timeout=5) is not None
        assert not any(raywatch.start_time(pid) == st for pid, st in runtime.items()), "the runtime survived"
        assert other.poll() is None, "the watchdog ended a process of another runtime"
    finally:
        for proc in (root, other, dog):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        if forked.pid is not None:
            forked.kill()
            forked.join()
        for pid, st in runtime.items():
            if raywatch.start_time(pid) == st:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def test_an_export_killed_while_ray_init_starts_the_runtime_leaves_none_of_it(tmp_path: Path) -> None:
    """Found by a breaker: the watchdog used to start when ``ray.init`` returned, so an export
    killed during ``ray.init`` (its first seconds, longer on a busy node) left the agents the raylet
    had started. It now starts before ``ray.init`` and, until told the session, takes any Ray
    session's roots the export started since. Here a process starts it as ``ray_engine`` does, then
    a fake runtime (``exec -a`` names) as ``ray.init`` would, and is SIGKILLed before naming it."""
    import signal
    import subprocess

    from s3capture.export import raywatch

    if not sys.platform.startswith("linux"):
        pytest.skip("the watchdog reads /proc")
    session = tmp_path / "ray" / "session_2026-12-01_00-00-00_000000_1"
    script = tmp_path / "export_in_init.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from s3capture.export.engines import _start_ray_watchdog\n"
        "dog = _start_ray_watchdog()\n"
        "time.sleep(0.2)\n"
        f"raylet = subprocess.Popen(['bash', '-c', \"(exec -a ray::DashboardAgent sleep 300) & exec -a '{session}/raylet' sleep 300\"])\n"
        "print(dog.pid, raylet.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    runtime: dict[int, int] = {}
    try:
        dog_pid, raylet_pid = map(int, proc.stdout.readline().split())  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while len(runtime) < 2 and time.monotonic() < deadline:
            runtime = raywatch.runtime_processes(proc.pid, str(session))
            time.sleep(0.1)
        assert raylet_pid in runtime and len(runtime) == 2, runtime
        time.sleep(2.5)  # the watchdog's second note (every 2 s at first)
        os.kill(proc.pid, signal.SIGKILL)  # during "ray.init": the session was never named
        proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(raywatch.start_time(pid) == st for pid, st in runtime.items()) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid, st in runtime.items() if raywatch.start_time(pid) == st]
        assert not left, f"the fake runtime outlived the export killed in ray.init: {left}"
        deadline = time.monotonic() + 10
        while raywatch.start_time(dog_pid) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert raywatch.start_time(dog_pid) is None, "the watchdog did not exit"
    finally:
        for pid, st in runtime.items():
            if raywatch.start_time(pid) == st:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stdout.close()  # type: ignore[union-attr]


# --------------------------------------------------------------------------- without Ray or a server
def test_engine_ray_without_ray_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main(["export", "s3://bkt/p", "--out", str(tmp_path / "x"), "--engine", "ray"]) == 2
    err = capsys.readouterr().err
    assert "pip install 's3capture[ray]'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--address", "auto"], "--engine ray only"),
        (["--ray-env", "AWS_ACCESS_KEY_ID"], "--engine ray only"),
        (["--engine", "ray", "--workers", "0"], "--workers >= 1"),
        (["--engine", "ray", "--ray-env", "S3CAPTURE_SURELY_UNSET_VARIABLE"], "not set"),
    ],
)
def test_ray_options_usage_errors_are_one_line(
    capsys: pytest.CaptureFixture, tmp_path: Path, args: list[str], message: str
) -> None:
    if "--engine" in args:
        _import_ray()
    assert main(["export", "s3://bkt/p", "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_ray_init_does_not_take_the_callers_sigterm_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.init`` replaces the driver's SIGTERM handler with Ray's, which exits at once (status
    15, a stack dump): a SIGTERM to ``s3capture export --engine ray`` skipped the CLI's Ctrl-C path
    (status 143, one line, the runtime shut down). The engine now puts a caller's own handler back
    (2026-12-03; checked by hand on a real runtime: status 143, no Ray process left). A stand-in for
    Ray here: it does what ``ray.init`` does to the handler, then fails the engine's next call."""
    import signal

    from s3capture.export import engines
    from s3capture.export.records import ExportJob

    class Stop(Exception):
        pass

    def ray_handler(signum: int, frame: Any) -> None:  # pragma: no cover - never delivered
        raise SystemExit(15)

    class FakeRay:
        initialized = False
        shutdowns = 0

        def is_initialized(self) -> bool:
            return self.initialized

        def init(self, **options: Any) -> None:
            self.initialized = True
            signal.signal(signal.SIGTERM, ray_handler)

        def remote(self, *args: Any, **kwargs: Any) -> Any:
            raise Stop

        def shutdown(self) -> None:
            self.shutdowns += 1

    def callers_handler(signum: int, frame: Any) -> None:  # pragma: no cover - never delivered
        pass

    fake = FakeRay()
    monkeypatch.setattr(engines, "_import_ray", lambda: fake)
    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:

        async def shards() -> Any:
            yield  # pragma: no cover - the engine fails before it takes a shard

        async def run() -> None:
            job = ExportJob(url="s3://bkt/p", dest="/tmp/unused")
            async for _ in engines.ray_engine(job, shards(), workers=1, address="ray://stand-in:10001"):
                pass  # pragma: no cover

        with pytest.raises(Stop):
            asyncio.run(run())
        assert signal.getsignal(signal.SIGTERM) is callers_handler
        assert fake.shutdowns == 1  # the runtime it started is shut down
        # The default handler is no handler of the caller's: Ray's stays (it shuts Ray down).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fake.initialized = False
        with pytest.raises(Stop):
            asyncio.run(run())
        assert signal.getsignal(signal.SIGTERM) is ray_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
