"""Smoke tests of the benchmark tools: each runs with ``--quick`` against moto and prints its tables.

The tools start their own moto server (``S3CAPTURE_TEST_SERVERS`` does not apply) and exit 0.
No timing is asserted here: speed and memory targets live in the tools and in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
DATA = Path(os.environ.get("S3CAPTURE_BENCH_DATA", "/work/shared/data/gym-example-rollouts"))

pytestmark = pytest.mark.skipif(
    not (DATA / "competitive_coding.jsonl").exists() or not (DATA / "anyterminal_hermes.jsonl").exists(),
    reason=f"Gym example rollouts not found in {DATA} (set S3CAPTURE_BENCH_DATA)",
)


def run_tool(*args: str, timeout: float = 45.0) -> str:
    env = dict(os.environ)
    # The tools import s3capture from the checkout when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        env.pop(name, None)  # the tools talk to the servers they start, never to a configured endpoint
    result = subprocess.run(
        [sys.executable, str(TOOLS / args[0]), *args[1:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"{args[0]} exited {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    return result.stdout


def test_bench_put_quick_prints_its_tables() -> None:
    pytest.importorskip("moto")
    out = run_tool("bench_put.py", "--quick", "--servers", "moto")
    for heading in ("### put latency on moto", "### the request a put adds, on moto", "### resolve on moto", "### freeze on moto"):
        assert heading in out, out
    assert "| S3TokenStore.put " in out and "| bare put_object (peer) " in out
    assert "peer: bare LIST then GET" in out


def test_bench_cpu_quick_prints_its_tables() -> None:
    pytest.importorskip("moto")
    pytest.importorskip("nemo_gym.token_id_capture.records")
    pytest.importorskip("orjson")
    out = run_tool("bench_cpu.py", "--quick")
    for heading in ("### client CPU per entry", "### where the CPU goes", "### stored bytes per token", "### memory of a freeze"):
        assert heading in out, out
    assert "s3capture freeze, cache_bytes=8 MiB" in out and "Gym TokenCaptureStore.freeze_now" in out


def test_bench_ledger_quick_prints_its_tables() -> None:
    pytest.importorskip("moto")
    pytest.importorskip("nemo_gym.token_id_capture.staging.records")
    out = run_tool("bench_ledger.py", "--quick", "--servers", "moto")
    for heading in (
        "### client CPU per record",
        "#### where the CPU goes",
        "### stored bytes per row",
        "### record latency on moto",
        "### resolve on moto",
        "### manifest and has_rows on moto",
    ):
        assert heading in out, out
    assert "| S3CaptureLedger.record " in out and "| bare PUT of the row bytes (peer) " in out
    assert "cold client (cache empty)" in out and "warm client (row cached)" in out
    assert "Gym: model_validate(wire)" in out
