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

from s3capture.demo import run_workload
from s3capture.replay import synthetic_rollouts

# The example data lives beside the checkout, in ../shared (never copied into the repository).
ROLLOUTS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gym-example-rollouts"


def example_file(name: str, folder: Path = ROLLOUTS) -> Path:
    """``folder/name``; when it is missing the test is skipped, or fails under CI (``CI=true``)."""
    path = folder / name
    if not path.is_file():
        message = f"{path} is missing (tests read ../shared/data/gym-example-rollouts beside the checkout)"
        if running_under_ci():
            pytest.fail(f"{message}; under CI the example data must be there", pytrace=False)
        pytest.skip(message)
    return path


def _run_demo(args: list[str], env_extra: dict[str, str] | None = None) -> str:
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
    return proc.stdout


def _numbers(out: str, label: str) -> tuple[int, int]:
    match = re.search(label + r": (\d+)/(\d+)", out)
    assert match, f"no {label!r} line in:\n{out}"
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize(
    ("name", "faithful"),
    [("anyterminal_hermes.jsonl", 142), ("competitive_coding.jsonl", 0), ("hermes_math.jsonl", 3)],
)
def test_demo_replays_gym_rollouts_on_embedded_server(name: str, faithful: int):
    out = _run_demo([str(example_file(name))])
    assert "embedded moto" in out
    assert _numbers(out, "faithful continuations RESOLVED to the right parent") == (faithful, faithful)
    assert re.search(r"snapshots: trainable (\d+), masked 0; dropped after consumption (\d+)/\1", out), out
    assert re.search(r"chains checked \d+, broken 0", out), out
    assert "UNRESOLVED 0" in out and "result: OK" in out


@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
def test_demo_generated_workload_against_configured_endpoint(s3_server, tmp_path):
    """Also ``--export``: the frozen rollouts become Parquet trajectories before they are dropped."""
    import pyarrow.parquet as pq

    dest = tmp_path / "trajectories"
    out = _run_demo(["--rollouts", "12", "--calls", "5", "--prompt-storage", "full", "--export", str(dest)], s3_server.env())
    assert "embedded moto" not in out and s3_server.endpoint_url in out
    assert _numbers(out, "faithful continuations RESOLVED to the right parent") == (48, 48)
    assert "trainable 12, masked 0" in out and "result: OK" in out
    assert re.search(r"exported to .*: 12 rollouts, 12 trajectories, .* dropped once durable 12", out), out
    table = pq.read_table(dest)
    assert table.num_rows == 12 and not any(table.column("masked").to_pylist())
    assert all(n == 5 for n in table.column("num_calls").to_pylist())
    assert all(len(t) == len(m) and sum(m) > 0 for t, m in zip(table.column("token_ids").to_pylist(), table.column("loss_mask").to_pylist()))


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_demo_against_a_missing_bucket_fails_with_one_clear_line(s3_server):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env())
    proc = subprocess.run(
        [sys.executable, "-m", "s3capture.cli", "demo", "--no-progress", "--workers", "1", "--rollouts", "2",
         "--calls", "2", "--url", "s3://no-such-bucket-s3capture/x"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "no-such-bucket-s3capture" in proc.stderr and "does not exist" in proc.stderr


@pytest.mark.parametrize("ci", ["true", ""])
def test_missing_example_data_skips_locally_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ci: str):
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
            run_workload(rollouts, bucket_url, s3_env.env(), workers=2, concurrency=4, parallel_rollouts=8,
                         progress=False)
            outcome["error"] = None
        except BaseException as error:  # noqa: BLE001 - examined below
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    bucket = bucket_url[len("s3://"):].split("/", 1)[0]
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
    assert "trainable 4, masked 0" in out and "kept frozen (not dropped): 4 rollouts" in out and "result: OK" in out
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env())
    dest = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "s3capture.cli", "export", bucket_url, "--out", str(dest), "--no-progress", "--workers", "0"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pq.read_table(dest)
    assert table.num_rows == 4 and not any(table.column("masked").to_pylist())
    assert sorted(table.column("num_calls").to_pylist()) == [3, 3, 3, 3]
