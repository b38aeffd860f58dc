"""The main job, ``s3capture demo``, end to end through the installed command line.

Each run starts its own embedded moto server (no endpoint configured), replays the given rollout
file through worker processes, freezes, verifies and drops every rollout, and must report every
faithful continuation RESOLVED to the right parent, every rollout trainable and every chain
contiguous. A run against SeaweedFS (endpoint configured) shows that pointing the demo at another
store works the same way. A worker killed mid-run ends the run at once. The example files are read
from ``../shared/data/gym-example-rollouts`` beside the checkout: missing, the tests skip, or fail
under ``CI``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gymcompat import running_under_ci

from s3capture.demo import format_report, run_workload
from s3capture.demo_common import PlainProgress, open_progress
from s3capture.replay import synthetic_rollouts

# The example data lives beside the checkout, in ../shared (never copied into the repository).
from helpers import EXAMPLE_DATA, process_alive

ROLLOUTS = EXAMPLE_DATA


def example_file(name: str, folder: Path = ROLLOUTS) -> Path:
    """``folder/name``; when it is missing the test is skipped, or fails under CI (``CI=true``)."""
    path = folder / name
    if not path.is_file():
        message = f"{path} is missing (tests read ../shared/data/gym-example-rollouts beside the checkout, or S3CAPTURE_EXAMPLE_DATA)"
        if running_under_ci():
            pytest.fail(f"{message}; under CI the example data must be there", pytrace=False)
        pytest.skip(message)
    return path


def _run_demo(args: list[str], env_extra: dict[str, str] | None = None, stderr: list[str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-m", "s3capture.cli", "demo", "--no-progress", "--workers", "3", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    if stderr is not None:
        stderr.append(proc.stderr)
    return proc.stdout


def _times(out: str) -> dict[str, float]:
    """The summary's start-up, capture, builder and total wall times (seconds), checked for consistency."""
    times = {}
    for name, pattern in (
        ("startup", r"^  start-up: ([\d.]+) s \(\d+ worker processes"),
        ("capture", r"^  capture: (?:captured|committed) \d+ of \d+ model calls in ([\d.]+) s \([\d,.]+ calls/s"),
        ("build", r"^  (?:freeze\+verify[+a-z ()]*|manifest\+verify\+retire): ([\d.]+) s$"),
        ("total", r"^  total wall time: ([\d.]+) s"),
    ):
        match = re.search(pattern, out, re.MULTILINE)
        assert match, f"no {name} time in:\n{out}"
        times[name] = float(match.group(1))
    assert times["capture"] <= times["total"] and times["startup"] <= times["total"], out
    # Each is rounded to 0.1 s in the text.
    assert times["startup"] + times["capture"] + times["build"] <= times["total"] + 0.21, out
    return times


def _numbers(out: str, label: str) -> tuple[int, int]:
    match = re.search(label + r": (\d+)/(\d+)", out)
    assert match, f"no {label!r} line in:\n{out}"
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize(
    ("name", "faithful"),
    [("anyterminal_hermes.jsonl", 142), ("competitive_coding.jsonl", 0), ("hermes_math.jsonl", 3)],
)
def test_demo_replays_gym_rollouts_on_embedded_server(name: str, faithful: int):
    said: list[str] = []
    out = _run_demo([str(example_file(name))], stderr=said)
    assert "embedded moto" in out
    # A new user's walkthrough (2026-12-03): nothing said that the data went with the embedded server.
    assert "the embedded server stops now and its data goes with it" in said[0], said[0]
    assert _numbers(out, "faithful continuations RESOLVED to the right parent") == (faithful, faithful)
    assert re.search(r"snapshots: trainable (\d+), masked 0; dropped after consumption (\d+)/\1", out), out
    assert re.search(r"chains checked \d+, broken 0", out), out
    assert "UNRESOLVED 0" in out and "result: OK" in out
    _times(out)
    assert re.search(
        r"^  stored: [\d.]+ [kMG]B for [\d,]+ tokens: [\d.]+ bytes per token, [\d.]+x Gym's JSONL of the same calls"
        r" \([\d.]+ bytes per token\)$",
        out,
        re.MULTILINE,
    ), out


@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
def test_demo_generated_workload_against_configured_endpoint(s3_server, tmp_path):
    """Also ``--export``: the frozen rollouts become Parquet trajectories before they are dropped."""
    import pyarrow.parquet as pq

    dest = tmp_path / "trajectories"
    out = _run_demo(
        ["--rollouts", "12", "--calls", "5", "--prompt-storage", "full", "--export", str(dest)], s3_server.env()
    )
    assert "embedded moto" not in out and s3_server.endpoint_url in out
    assert _numbers(out, "faithful continuations RESOLVED to the right parent") == (48, 48)
    assert "trainable 12, masked 0" in out and "result: OK" in out
    assert re.search(r"exported to .*: 12 rollouts, 12 trajectories, .* dropped once durable 12", out), out
    # The export's requests are in the demo's tally: its reads and its 12 drops (a walkthrough
    # found them missing: the summary said "dropped 12" beside no DeleteObjects at all).
    assert re.search(r"export:source:DeleteObjects 12\b", out) and "export:source:GetObject" in out, out
    table = pq.read_table(dest)
    assert table.num_rows == 12 and not any(table.column("masked").to_pylist())
    assert all(n == 5 for n in table.column("num_calls").to_pylist())
    assert all(
        len(t) == len(m) and sum(m) > 0
        for t, m in zip(table.column("token_ids").to_pylist(), table.column("loss_mask").to_pylist())
    )


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_demo_against_a_missing_bucket_fails_with_one_clear_line(s3_server):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "s3capture.cli",
            "demo",
            "--no-progress",
            "--workers",
            "1",
            "--rollouts",
            "2",
            "--calls",
            "2",
            "--url",
            "s3://no-such-bucket-s3capture/x",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "no-such-bucket-s3capture" in proc.stderr and "does not exist" in proc.stderr


@pytest.mark.parametrize("ci", ["true", ""])
def test_missing_example_data_skips_locally_and_fails_under_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ci: str
):
    monkeypatch.setenv("CI", ci)
    (tmp_path / "present.jsonl").write_text("{}\n")
    assert example_file("present.jsonl", tmp_path) == tmp_path / "present.jsonl"
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match="absent.jsonl is missing"):
        example_file("absent.jsonl", tmp_path)


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_a_worker_killed_mid_run_stops_the_run_at_once(s3_env, bucket_url, s3_client):
    """A worker that dies while serving (here: SIGKILL) ends the run within seconds, naming it.

    Its calls in flight will never be answered; the coordinator used to wait 120 s for 'no progress'.
    """
    rollouts = synthetic_rollouts(400, 6, seed=3)
    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            run_workload(
                rollouts, bucket_url, s3_env.env(), workers=2, concurrency=4, parallel_rollouts=8, progress=False
            )
            outcome["error"] = None
        except BaseException as error:  # noqa: BLE001 - examined below
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    bucket = bucket_url[len("s3://") :].split("/", 1)[0]
    deadline = time.monotonic() + 120
    while not s3_client.list_objects_v2(Bucket=bucket, MaxKeys=1).get("KeyCount"):  # calls are being served
        assert thread.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.2)
    victim = next(p for p in multiprocessing.active_children() if p.name == "s3capture-demo-worker-1")
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the run kept waiting on a dead worker"
    assert time.monotonic() - killed < 20
    error = outcome["error"]
    assert isinstance(error, RuntimeError), error
    assert str(error) == f"worker 1 (pid {victim.pid}) exited during the run with status -9"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("s3capture-demo-worker-")]


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_demo_keep_leaves_frozen_rollouts_that_export_reads(s3_server, bucket_url, tmp_path):
    """``--keep``: every rollout frozen and verified but not dropped; ``s3capture export`` then
    exports each of them as one trainable trajectory (the README's offline walkthrough)."""
    import pyarrow.parquet as pq

    out = _run_demo(["--rollouts", "4", "--calls", "3", "--keep", "--url", bucket_url], s3_server.env())
    assert "trainable 4, masked 0; kept frozen 4/4 (--keep: none dropped)" in out and "result: OK" in out
    assert "kept frozen (not dropped): 4 rollouts" in out and "dropped after consumption" not in out
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env())
    dest = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "s3capture.cli",
            "export",
            bucket_url,
            "--out",
            str(dest),
            "--no-progress",
            "--workers",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pq.read_table(dest)
    assert table.num_rows == 4 and not any(table.column("masked").to_pylist())
    assert sorted(table.column("num_calls").to_pylist()) == [3, 3, 3, 3]


def test_demo_export_into_a_folder_that_is_not_empty_is_refused_before_the_capture(tmp_path):
    """Every demo captures into a new root, and an export refuses a folder holding another root's
    export: so a second ``--export DEST`` is refused at once, not after the whole capture."""
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "part-00000.parquet").write_bytes(b"")
    started = time.monotonic()
    with pytest.raises(ValueError, match="not empty: the demo exports into a new or empty folder"):
        run_workload(synthetic_rollouts(2, 2, seed=1), "s3://no-such-bucket/d", {}, export_dest=str(dest))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_demo_export_to_an_s3_prefix_that_is_not_empty_is_refused_before_the_capture(
    s3_server, s3_client, bucket_url, monkeypatch
):
    """The same for an ``s3://`` destination: one LIST of one key, with the demo's endpoint and
    credentials (``env``), before any worker starts; nothing is captured into the source root."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    bucket = bucket_url[len("s3://") :].split("/", 1)[0]
    s3_client.put_object(Bucket=bucket, Key="exports/part-00000.parquet", Body=b"x")
    source = f"s3://{bucket}/captured"
    with pytest.raises(ValueError, match=rf"not empty \(it holds s3://{bucket}/exports/part-00000.parquet\)"):
        run_workload(synthetic_rollouts(2, 2, seed=1), source, s3_server.env(), export_dest=f"s3://{bucket}/exports")
    assert not s3_client.list_objects_v2(Bucket=bucket, Prefix="captured/").get("KeyCount")
    assert not [k for k in os.environ if k.startswith("AWS_")], "the demo's env leaked into the environment"
    # An empty prefix (a sibling of the used one: "exports" is not "exports-2") passes the check.
    from s3capture.demo import _refuse_used_export_dest

    _refuse_used_export_dest(source, f"s3://{bucket}/exports-2", s3_server.env())
    _refuse_used_export_dest(source, f"s3://{bucket}/export", s3_server.env())
    # A console's folder marker is the destination itself, not an object in it.
    s3_client.put_object(Bucket=bucket, Key="marked/", Body=b"")
    _refuse_used_export_dest(source, f"s3://{bucket}/marked", s3_server.env())
    # The top of the source's bucket holds the capture's rollouts: refused before any request.
    with pytest.raises(ValueError, match="contains the rollouts of"):
        _refuse_used_export_dest(source, f"s3://{bucket}", {})


def test_plain_progress_writes_whole_lines_every_tenth_and_every_few_seconds():
    clock = [100.0]
    out = io.StringIO()
    progress = PlainProgress(50, "model calls", "call", out, every=5.0, clock=lambda: clock[0])
    for _ in range(50):
        clock[0] += 0.01
        progress.update(1)
    progress.close()
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == [f"{n}/50" for n in range(5, 51, 5)]
    assert lines[-1] == "model calls: 50/50 calls (100%), 0.5 s"
    # A slow run also gets a line every `every` seconds between the 10 % marks, and close() adds the last count.
    out = io.StringIO()
    progress = PlainProgress(1000, "rollouts", "rollout", out, every=5.0, clock=lambda: clock[0])
    for _ in range(3):
        clock[0] += 6.0
        progress.update(1)
    progress.close()
    progress.update(1)  # after close: nothing more
    assert out.getvalue().splitlines() == [
        "rollouts: 1/1,000 rollouts (0%), 6.0 s",
        "rollouts: 2/1,000 rollouts (0%), 12.0 s",
        "rollouts: 3/1,000 rollouts (0%), 18.0 s",
    ]


def test_open_progress_redraws_only_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    plain = io.StringIO()
    assert isinstance(open_progress(10, "model calls", "call", stream=plain), PlainProgress)
    bar = open_progress(10, "model calls", "call", stream=Terminal())
    assert type(bar).__name__ == "tqdm"
    bar.close()
    silent = io.StringIO()
    off = open_progress(10, "model calls", "call", enabled=False, stream=silent)
    off.update(10)
    off.close()
    assert silent.getvalue() == ""


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_demo_off_a_terminal_prints_progress_lines_and_separate_times(s3_env, bucket_url, capsys):
    """stderr captured (not a terminal): whole progress lines, no carriage-return redraws; the summary
    reports worker start-up apart from capture time, and the total wall time."""
    started = time.perf_counter()
    report = run_workload(
        synthetic_rollouts(4, 3, seed=7),
        bucket_url,
        s3_env.env(),
        workers=1,
        concurrency=4,
        parallel_rollouts=4,
        progress=True,
        wall_started=started,
    )
    err = capsys.readouterr().err
    assert "\r" not in err and err.endswith("\n"), err
    assert "model calls: 12/12 calls (100%)" in err and "freeze+verify+drop: 4/4 rollouts (100%)" in err, err
    assert report.ok and report.captured == 12
    assert 0 < report.startup_seconds and 0 < report.seconds and 0 < report.build_seconds
    assert report.startup_seconds + report.seconds + report.build_seconds <= report.wall_seconds
    assert report.wall_seconds <= time.perf_counter() - started
    out = format_report(report, where=bucket_url)
    times = _times(out)
    assert times["capture"] == round(report.seconds, 1) and times["total"] == round(report.wall_seconds, 1), out
    assert "start-up" in out.split("capture:")[0]  # start-up comes first, on its own line


SRC = Path(__file__).resolve().parents[1] / "src" / "s3capture"


def _imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at the top or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_demo_and_demo_ledger_do_not_import_each_other():
    """The dependency runs one way: demo -> demo_ledger -> demo_common (which imports neither)."""
    assert not {"s3capture.demo", "s3capture.demo_ledger"} & _imported_modules(SRC / "demo_common.py")
    assert "s3capture.demo" not in _imported_modules(SRC / "demo_ledger.py")
    assert "s3capture.demo_ledger" in _imported_modules(SRC / "demo.py")
    # And at run time: demo_ledger imports (and its worker opens) with s3capture.demo blocked.
    code = (
        "import sys; sys.modules['s3capture.demo'] = None\n"
        "import s3capture.demo_ledger as m\n"
        "m.LedgerWorker('s3://b/run', 's3://b/run-staging', 2)\n"
        "assert 's3capture.demo' not in [k for k, v in sys.modules.items() if v is not None]\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# --------------------------------------------------------------------------- a demo breaker's four
def _demo_process(args: list[str], env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "s3capture.cli", "demo", "--no-progress", "--workers", "2", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def _few_shot_file(tmp_path: Path) -> Path:
    """Two rollouts whose input already holds an assistant turn (a few-shot example): their first
    call has model-authored history but no parent in the rollout, so it resolves UNRESOLVED."""
    import json

    line = {
        "responses_create_params": {
            "input": [
                {"role": "user", "content": "What is 1+1?", "type": "message"},
                {"role": "assistant", "content": "2", "type": "message"},
                {"role": "user", "content": "And 2+2?", "type": "message"},
            ]
        },
        "response": {
            "output": [
                {"type": "message", "role": "assistant", "id": "m1", "content": [{"type": "output_text", "text": "4"}]},
                {"type": "message", "role": "user", "content": "And 3+3?"},
                {"type": "message", "role": "assistant", "id": "m2", "content": [{"type": "output_text", "text": "6"}]},
            ]
        },
    }
    path = tmp_path / "fewshot.jsonl"
    path.write_text("".join(json.dumps({**line, "_ng_rollout_index": i}) + "\n" for i in range(2)))
    return path


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_demo_calls_trainable_only_what_the_builder_would_train_on(s3_server, bucket_url, tmp_path):
    """A rollout whose first call resolves UNRESOLVED (few-shot history in its input) is masked by
    the trajectory builder; the demo's summary used to call it trainable ("result: OK") while the
    same run with --export exported nothing (a demo breaker, 2026-12-03)."""
    proc = _demo_process([str(_few_shot_file(tmp_path))], s3_server.env())
    out = proc.stdout
    assert "UNRESOLVED 2" in out, out
    assert "snapshots: trainable 0, masked 2" in out and "result: FAILED" in out, out
    assert re.search(r"MASKED fewshot-L1-r0@\S+: .*unresolved_parent:fewshot-L1-r0-c0000", out), out
    assert proc.returncode == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_demo_counts_only_its_own_objects_under_a_reused_url(s3_server, bucket_url):
    """Two --keep runs on one --url: the second's "stored" line counts its own 6 entries, not the
    first run's too (it listed the whole root: 12 entry objects and twice the bytes)."""
    runs = [
        _demo_process(["--rollouts", "2", "--calls", "3", "--keep", "--url", bucket_url], s3_server.env())
        for _ in range(2)
    ]
    stored = []
    for proc in runs:
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        match = re.search(r"\(([\d,]+) bytes in (\d+) entry objects", proc.stdout)
        assert match, proc.stdout
        stored.append((int(match.group(1).replace(",", "")), int(match.group(2))))
    assert [objects for _, objects in stored] == [6, 6], stored
    assert stored[1][0] < 1.5 * stored[0][0], stored


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_a_demo_killed_by_pid_leaves_no_worker_running(s3_server, bucket_url, s3_client, how):
    """SIGTERM or SIGKILL to the demo's own pid (a supervisor, `kill`, a timeout): its worker
    processes used to stay alive forever, writing to the bucket (a demo breaker, 2026-12-03)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env())
    proc = subprocess.Popen(
        [sys.executable, "-m", "s3capture.cli", "demo", "--no-progress", "--workers", "2"]
        + ["--rollouts", "400", "--calls", "6", "--url", bucket_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    workers: set[int] = set()
    try:
        bucket = bucket_url[len("s3://") :].split("/", 1)[0]
        deadline = time.monotonic() + 120
        while not s3_client.list_objects_v2(Bucket=bucket, MaxKeys=1).get("KeyCount"):  # calls are being served
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        workers = _descendants(proc.pid)
        assert len(workers) >= 2, workers  # the two workers (and the resource tracker)
        proc.send_signal(how)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == (143 if how == signal.SIGTERM else -9), err[-3000:]
        if how == signal.SIGTERM:
            assert f"interrupted by SIGTERM: the rollouts written so far stay under {bucket_url}" in err, err[-3000:]
        deadline = time.monotonic() + 20
        while any(process_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if process_alive(pid)], "workers outlived the demo"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in [pid for pid in workers if process_alive(pid)]:  # a regression's orphans must not outlive the test
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
def test_demo_with_refused_credentials_says_so_instead_of_failing_to_create_its_bucket(s3_server):
    """No --url on a configured endpoint: the demo checks its bucket and creates it only when it is
    missing. A 403 used to be taken for "missing", so the error named CreateBucket."""
    env = {**s3_server.env(), "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    proc = _demo_process(["--rollouts", "1", "--calls", "1"], env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "HeadBucket" in proc.stderr and "CreateBucket" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
