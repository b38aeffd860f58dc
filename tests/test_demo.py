"""The main job, ``s3capture demo``, end to end through the installed command line.

Each run starts its own embedded moto server (no endpoint configured), replays the given rollout
file through worker processes, freezes, verifies and drops every rollout, and must report every
faithful continuation RESOLVED to the right parent, every rollout trainable and every chain
contiguous. A run against SeaweedFS (endpoint configured) shows that pointing the demo at another
store works the same way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROLLOUTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "gym-example-rollouts"


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
    path = ROLLOUTS / name
    if not path.exists():
        pytest.skip(f"{path} is missing (tests read ../shared/data from the repository's parent)")
    out = _run_demo([str(path)])
    assert "embedded moto" in out
    assert _numbers(out, "faithful continuations RESOLVED to the right parent") == (faithful, faithful)
    assert re.search(r"snapshots: trainable (\d+), masked 0; dropped after consumption (\d+)/\1", out), out
    assert re.search(r"chains checked \d+, broken 0", out), out
    assert "UNRESOLVED 0" in out and "result: OK" in out


@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
def test_demo_generated_workload_against_configured_endpoint(s3_server):
    out = _run_demo(["--rollouts", "12", "--calls", "5", "--prompt-storage", "full"], s3_server.env())
    assert "embedded moto" not in out and s3_server.endpoint_url in out
    assert _numbers(out, "faithful continuations RESOLVED to the right parent") == (48, 48)
    assert "trainable 12, masked 0" in out and "result: OK" in out


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
