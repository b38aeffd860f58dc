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
from gymcompat import require_gym, running_under_ci

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
# The shared example data sits beside the checkout (<checkout>/../shared/...) unless
# S3CAPTURE_BENCH_DATA names another directory; the tools are always told which one to use.
from helpers import EXAMPLE_DATA as DATA  # noqa: E402


def _skip_or_fail(message: str) -> None:
    """Skip locally; fail under ``CI`` (see ``gymcompat.running_under_ci``), where a skip would hide a gap."""
    if running_under_ci():
        pytest.fail(f"{message} (required under CI)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(autouse=True)
def example_data() -> Path:
    missing = [name for name in ("competitive_coding.jsonl", "anyterminal_hermes.jsonl") if not (DATA / name).exists()]
    if missing:
        _skip_or_fail(
            f"Gym example rollouts {missing} not found in {DATA} (../shared beside the checkout, or set S3CAPTURE_BENCH_DATA)"
        )
    return DATA


def require_moto() -> None:
    try:
        import moto  # noqa: F401
    except ImportError as error:
        _skip_or_fail(f"moto is not installed ({error}); install the test extra")


def run_tool(*args: str, timeout: float = 240.0) -> str:
    # The bound only stops a hung tool: on a loaded machine bench_cpu --quick took 80 s (load
    # average 10), so the former 45 s failed healthy runs.
    env = dict(os.environ)
    env["S3CAPTURE_BENCH_DATA"] = str(DATA)
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
    assert result.returncode == 0, (
        f"{args[0]} exited {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
    return result.stdout


def test_bench_put_quick_prints_its_tables() -> None:
    require_moto()
    out = run_tool("bench_put.py", "--quick", "--servers", "moto")
    for heading in (
        "### put latency on moto",
        "### the request a put adds, on moto",
        "### resolve on moto",
        "### freeze on moto",
    ):
        assert heading in out, out
    assert "| S3TokenStore.put " in out and "| bare put_object (peer) " in out
    assert "peer: bare LIST then GET" in out


def test_bench_cpu_quick_prints_its_tables() -> None:
    require_moto()
    require_gym()  # Gym's records, and orjson, which Gym needs
    out = run_tool("bench_cpu.py", "--quick")
    for heading in (
        "### client CPU per entry",
        "### where the CPU goes",
        "### stored bytes per token",
        "### memory of a freeze",
    ):
        assert heading in out, out
    assert "s3capture freeze, cache_bytes=8 MiB" in out and "Gym TokenCaptureStore.freeze_now" in out


def test_bench_encode_quick_prints_its_tables() -> None:
    require_gym()  # Gym's records and orjson are the peer
    out = run_tool("bench_encode.py", "--quick")
    for heading in (
        "### put-side encode CPU per entry",
        "### stored bytes per token and compression CPU per zstd level",
    ):
        assert heading in out, out
    assert "(peer)" in out and "zstd 1 + trained dictionary" in out and "÷ Gym's canonical path:" in out


def test_bench_ledger_quick_prints_its_tables() -> None:
    require_moto()
    require_gym()  # its package imports staging.records
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


def test_bench_freeze_quick_prints_its_table() -> None:
    require_moto()
    out = run_tool("bench_freeze.py", "--quick")
    assert "### freeze vs its floor on moto" in out, out
    for row in (
        "bare LIST + parallel GETs (floor, cold)",
        "bare LIST (floor, warm)",
        "freeze, cold (empty cache)",
        "freeze, warm (entries cached)",
    ):
        assert f"| {row} " in out, out


def test_bench_memory_small_run_prints_its_series_and_verdict() -> None:
    require_moto()
    # 120 calls sampled every 40 (not 1,200 every 1,000): the series and the verdict need only a few
    # samples after a cache of a few entries (0.25 MiB; an entry is ~60 KiB) filled.
    out = run_tool(
        "bench_memory.py",
        *("--rollouts", "6", "--calls", "20", "--cache-mib", "0.25", "--parallel", "3", "--sample-every", "40"),
    )
    assert "### RSS over 6 rollouts x 20 calls" in out, out
    assert "|    40 " in out and "|   120 " in out and "after the cache filled" in out, out
    assert "the cache never filled" not in out, out


def test_bench_cache_estimate_quick_prints_its_table_within_the_target() -> None:
    out = run_tool("bench_cache_estimate.py", "--quick")
    assert "| MoE routing 1,200 tok x 4 layers x top-2 " in out and "| 5,000 token ids under 256 " in out, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "estimate B" not in line]
    assert len(rows) >= 15, out
    assert all("| yes " in row for row in rows), out  # every shape within 1.5x of tracemalloc
    assert "worst ratio (either way): " in out, out


def test_bench_resolve_quick_prints_its_table() -> None:
    require_moto()
    out = run_tool("bench_resolve.py", "--quick", "--servers", "moto")
    assert "### resolve on moto" in out, out
    delta_cold = [line for line in out.splitlines() if line.startswith("| delta, 40 calls") and "| cold " in line]
    assert len(delta_cold) == 2, out  # loopback and behind the delay proxy
    for line in delta_cold:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[11] == "3", line  # round trips: LIST, candidate, checkpoint + deltas
        assert cells[12].startswith("2 /"), line  # checkpoints beside calls 16 and 32


def test_bench_transport_quick_prints_both_transports() -> None:
    require_moto()
    pytest.importorskip("obstore", reason="the obstore extra is not installed")
    out = run_tool("bench_transport.py", "--quick", "--servers", "moto")
    for heading in ("### put ÷ bare PUT of the same transport on moto", "### capture calls on moto"):
        assert heading in out, out
    assert "| bare put_object (peer) " in out and "| bare obstore.put_async (peer) " in out
    assert "client CPU per capture call on moto: aioboto3 ÷ obstore =" in out
    result = next(line for line in out.splitlines() if line.startswith("RESULT-JSON "))
    import json

    data = json.loads(result[len("RESULT-JSON ") :])
    assert {row["transport"] for row in data["capture"]} == {"aioboto3", "obstore"}
    for row in data["capture"]:
        # Like for like: the bare mix sends exactly the requests the capture calls sent.
        assert row["requests_per_call"] == row["bare_requests_per_call"], row
    # 4 put rows per transport: loopback and 10 ms RTT, concurrency 1 and 8.
    assert len(data["put"]) == 8


def test_bench_export_quick_prints_its_tables() -> None:
    require_moto()
    pytest.importorskip("pyarrow", reason="the parquet extra is not installed")
    out = run_tool("bench_export.py", "--quick")
    assert "### export vs a bare reader on moto (aioboto3 transport" in out, out
    assert "| bare reader: LIST root + GET entries and sealed manifests " in out
    assert "| s3capture export (local engine, Parquet) " in out
    # The export reads each rollout from the listing: the same requests as the bare reader (3 GETs
    # a rollout of 2 calls: its entries and its sealed manifest), and no LIST of its own beyond the
    # LIST after the root listing's last key that confirms its end.
    # (--quick: 10 and 30 rollouts; at 30, one LIST page is 1/30 = 0.03 LISTs a rollout.)
    requests = [line for line in out.splitlines() if line.startswith("|       30 | ") and "GetObject" in line]
    assert len(requests) == 2, requests
    assert "bare reader" in requests[0] and "GetObject 3.00, ListObjectsV2 0.03" in requests[0], requests
    assert "export" in requests[1] and "GetObject 3.00, ListObjectsV2 0.07" in requests[1], requests
    assert "RSS at 30 ÷ at 10 rollouts" in out
    result = next(line for line in out.splitlines() if line.startswith("RESULT-JSON "))
    import json

    data = json.loads(result[len("RESULT-JSON ") :])
    assert data["moto/aioboto3/30"]["requests_per_rollout"]["source:GetObject"] == 3.0
