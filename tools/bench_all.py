#!/usr/bin/env python3
"""Every benchmark of issue 8, per transport, then one table of every target: PASS or MISS, and the ratio.

Runs, one after the other, each in its own process (so one tool's memory or event loop never
skews another's), printing each tool's output as it comes:

1. ``bench_transport.py`` -- put ÷ bare PUT (concurrency 1 and 8, loopback and 10 ms RTT) and
   capture calls ÷ the bare request mix, client CPU per capture call; both transports interleaved
   in one run, on moto, SeaweedFS and Ceph RGW (when installed);
2. ``bench_resolve.py --transport T`` -- cold and warm resolve at 1, 100 and 1,000 calls, full and
   delta prompts, loopback and 10 ms RTT, per transport;
3. ``bench_encode.py`` -- encode CPU ÷ Gym's canonical path, bytes per token (no S3: transport-free);
4. ``bench_freeze.py --transport T`` -- freeze ÷ floor at 100 and 1,000 entries (when the tool exists);
5. ``bench_memory.py --transport T`` -- RSS over 1,000 rollouts x 20 calls (when the tool exists).

Each ratio is taken inside one tool's interleaved run (subject and peer alternate round by
round); nothing is compared across tools or across runs. The summary is parsed from each tool's
``RESULT-JSON`` line (or its table, for tools without one). ``--log DIR`` keeps every tool's raw
output.

Usage::

    python tools/bench_all.py                 # everything, ~15 minutes on 2 loaded cores
    python tools/bench_all.py --quick         # every tool in its smoke mode, ~2 minutes
    python tools/bench_all.py --only transport,encode --servers moto
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _benchcommon import ceph_available, load_average, machine_summary, table

TOOLS = Path(__file__).resolve().parent
STEPS = ("transport", "resolve", "encode", "freeze", "memory")


def supports(tool: str, option: str) -> bool:
    """Whether ``tool --help`` mentions ``option`` (tools merged from other branches may lack it)."""
    out = subprocess.run([sys.executable, str(TOOLS / tool), "--help"], capture_output=True, text=True, check=False)
    return option in out.stdout


def run(
    tool: str, args: list[str], log_dir: Path | None, label: str, env: dict[str, str] | None = None
) -> tuple[str, float, int]:
    print(f"\n\n## {label}: python tools/{tool} {' '.join(args)}\n", flush=True)
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, str(TOOLS / tool), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if not line.startswith("RESULT-JSON "):
            sys.stdout.write(line)
            sys.stdout.flush()
    code = process.wait()
    text = "".join(lines)
    if log_dir is not None:
        (log_dir / f"{label.replace(' ', '_').replace('/', '-')}.txt").write_text(text)
    seconds = time.perf_counter() - started
    print(f"\n({label}: exit {code}, {seconds:.0f} s)", flush=True)
    return text, seconds, code


def result_of(text: str) -> dict[str, Any] | None:
    for line in text.splitlines():
        if line.startswith("RESULT-JSON "):
            return json.loads(line[len("RESULT-JSON ") :])
    return None


def verdict(value: float, limit: float, at_least: bool = False) -> str:
    if value != value:  # NaN
        return "n/a"
    return "PASS" if (value >= limit if at_least else value <= limit) else "MISS"


def table_rows(text: str, first_cell: str | None = None) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|--"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if first_cell is None or cells[0].startswith(first_cell):
                rows.append(cells)
    return rows


def ratio_of(cell: str) -> float:
    match = re.match(r"\s*([0-9.]+)x", cell)
    return float(match.group(1)) if match else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="every tool in its smoke mode")
    parser.add_argument(
        "--servers",
        default="all",
        help="servers for bench_transport: 'all' (moto, seaweedfs, ceph when installed) or a list",
    )
    parser.add_argument(
        "--resolve-servers", default="moto,seaweedfs", help="servers for bench_resolve (default moto,seaweedfs)"
    )
    parser.add_argument(
        "--freeze-servers", default="moto,seaweedfs", help="servers for bench_freeze (default moto,seaweedfs)"
    )
    parser.add_argument("--transports", default="aioboto3,obstore")
    parser.add_argument(
        "--only", default=",".join(STEPS), help=f"comma-separated steps (default all: {','.join(STEPS)})"
    )
    parser.add_argument("--resolve-samples", type=int, default=3, help="cold resolves per rollout (default 3)")
    parser.add_argument("--freeze-repeats", type=int, default=5, help="repeats per freeze size (default 5)")
    parser.add_argument(
        "--memory-rollouts", type=int, default=1000, help="rollouts of the RSS run (default 1,000 x 20 calls)"
    )
    parser.add_argument("--log", default=None, help="directory for each tool's raw output")
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    log_dir = Path(args.log) if args.log else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    quick = ["--quick"] if args.quick else []
    started, load_at_start = time.perf_counter(), load_average()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(
        f"# bench_all\n\nmachine: {machine_summary()}\nuptime at start: {uptime}\nCeph RGW installed: {ceph_available()}",
        flush=True,
    )
    summary: list[list[Any]] = []
    timings: list[str] = []
    notes: list[str] = []

    if "transport" in steps:
        text, seconds, code = run(
            "bench_transport.py",
            [*quick, "--servers", args.servers, "--transports", ",".join(transports)],
            log_dir,
            "bench_transport",
        )
        timings.append(f"transport {seconds:.0f} s")
        result = result_of(text) or {}
        for row in result.get("cpu_ratio", []):
            summary.append(
                [
                    "obstore: client CPU per capture call >= 5x lower than aioboto3",
                    row["server"],
                    "",
                    f"{row['aioboto3_over_obstore']:.2f}x lower",
                    verdict(row["aioboto3_over_obstore"], 5.0, at_least=True),
                ]
            )
        for row in result.get("capture", []):
            scope = f"{row['server']}, {row['transport']}"
            if row["transport"] == "obstore":
                summary.append(
                    [
                        "obstore: capture throughput >= 0.8x the bare request mix",
                        row["server"],
                        "loopback, 8 rollouts at once",
                        f"{row['throughput_ratio']:.2f}x",
                        verdict(row["throughput_ratio"], 0.8, at_least=True),
                    ]
                )
            else:
                summary.append(
                    [
                        "(info) aioboto3: capture throughput ÷ bare request mix",
                        scope,
                        "loopback",
                        f"{row['throughput_ratio']:.2f}x",
                        "info",
                    ]
                )
            summary.append(
                [
                    f"(info) client CPU per capture call, {row['transport']}",
                    row["server"],
                    "",
                    f"{row['client_cpu_ms']:.2f} ms ({1000 / row['client_cpu_ms']:.0f} calls/s per core)",
                    "info",
                ]
            )
        for row in result.get("put", []):
            path, conc = row["path"], row["concurrency"]
            if row["transport"] == "obstore" and "RTT" in path and conc == 1:
                summary.append(
                    [
                        "obstore: put <= 1.15x bare PUT behind 10 ms, concurrency 1",
                        row["server"],
                        "p50",
                        f"{row['p50_ratio']:.2f}x",
                        verdict(row["p50_ratio"], 1.15),
                    ]
                )
                summary.append(
                    [
                        "(info) obstore: put ÷ its bare requests (PUT + GET fence), 10 ms, conc 1",
                        row["server"],
                        "p50",
                        f"{row['wire_p50_ratio']:.2f}x",
                        "info",
                    ]
                )
            else:
                summary.append(
                    [
                        f"(info) put ÷ bare PUT, {row['transport']}",
                        row["server"],
                        f"{path}, conc {conc}, p50",
                        f"{row['p50_ratio']:.2f}x",
                        "info",
                    ]
                )
        if code:
            notes.append(f"bench_transport exited {code}")

    if "resolve" in steps:
        for transport in transports:
            extra = [*quick, "--transport", transport, "--servers", args.resolve_servers]
            if not args.quick:
                extra += ["--samples", str(args.resolve_samples)]
            text, seconds, code = run("bench_resolve.py", extra, log_dir, f"bench_resolve {transport}")
            timings.append(f"resolve/{transport} {seconds:.0f} s")
            result = result_of(text) or {}
            biggest = max((r["calls"] for r in result.get("rows", [])), default=0)
            for row in result.get("rows", []):
                if row["mode"] == "delta" and row["client"] == "cold" and row["calls"] == biggest:
                    scope = f"{row['server']}, {transport}"
                    summary.append(
                        [
                            f"delta resolve, fresh client, {biggest:,} calls: <= 3 round trips",
                            scope,
                            row["path"],
                            f"{row['round_trips']} ({row['gets']} GETs)",
                            verdict(row["round_trips"], 3),
                        ]
                    )
                    summary.append(
                        [
                            f"delta resolve, fresh client, {biggest:,} calls: <= 2x full-prompt resolve",
                            scope,
                            row["path"],
                            f"{row['vs_full']:.2f}x",
                            verdict(row["vs_full"], 2.0),
                        ]
                    )
            if code:
                notes.append(f"bench_resolve --transport {transport} exited {code}")

    if "encode" in steps:
        text, seconds, code = run("bench_encode.py", quick, log_dir, "bench_encode")
        timings.append(f"encode {seconds:.0f} s")
        result = result_of(text) or {}
        for workload, value in result.get("encode_ratio", {}).items():
            summary.append(
                [
                    "encode CPU <= 1.0x Gym's canonical path",
                    workload.split(" (")[0],
                    "no S3",
                    f"{value:.2f}x",
                    verdict(value, 1.0),
                ]
            )
        for workload, value in result.get("bytes", {}).items():
            summary.append(
                [
                    "bytes per token <= 1.1x today's (zstd 3)",
                    workload.split(" (")[0],
                    f"{value['default_bytes_per_token']:.2f} B/token",
                    f"{value['ratio']:.3f}x",
                    verdict(value["ratio"], 1.1),
                ]
            )

    if "freeze" in steps:
        if not (TOOLS / "bench_freeze.py").exists():
            notes.append("bench_freeze.py is not on this branch: freeze targets not measured")
        else:
            has_transport = supports("bench_freeze.py", "--transport")
            for transport in transports if has_transport else ["aioboto3"]:
                extra = [*quick, "--servers", args.freeze_servers] + (
                    ["--transport", transport] if has_transport else []
                )
                if not args.quick:
                    extra += ["--repeats", str(args.freeze_repeats)]
                text, seconds, code = run("bench_freeze.py", extra, log_dir, f"bench_freeze {transport}")
                timings.append(f"freeze/{transport} {seconds:.0f} s")
                server = "?"
                for line in text.splitlines():
                    match = re.match(r"### freeze vs its floor on (\w+)", line)
                    if match:
                        server = match.group(1)
                    if line.startswith("| "):
                        cells = [c.strip() for c in line.strip().strip("|").split("|")]
                        if len(cells) >= 5 and cells[1].startswith("freeze, cold"):
                            summary.append(
                                [
                                    "freeze cold <= 1.15x its floor (bare LIST + parallel GETs)",
                                    f"{server}, {transport}",
                                    f"{cells[0]} entries",
                                    cells[4],
                                    verdict(ratio_of(cells[4]), 1.15),
                                ]
                            )
                        elif len(cells) >= 5 and cells[1].startswith("freeze, warm"):
                            summary.append(
                                [
                                    "freeze warm <= 1.15x a bare LIST",
                                    f"{server}, {transport}",
                                    f"{cells[0]} entries",
                                    cells[4],
                                    verdict(ratio_of(cells[4]), 1.15),
                                ]
                            )
                if not has_transport:
                    notes.append("bench_freeze.py has no --transport here: measured on aioboto3 only")
                if code:
                    notes.append(f"bench_freeze exited {code}")

    if "memory" in steps:
        if not (TOOLS / "bench_memory.py").exists():
            notes.append("bench_memory.py is not on this branch: the RSS target is not measured")
        else:
            has_transport = supports("bench_memory.py", "--transport")
            for transport in transports if has_transport else ["aioboto3"]:
                extra = ["--rollouts", "60" if args.quick else str(args.memory_rollouts)] + (
                    ["--calls", "10"] if args.quick else []
                )
                extra += ["--transport", transport] if has_transport else []
                text, seconds, code = run("bench_memory.py", extra, log_dir, f"bench_memory {transport}")
                timings.append(f"memory/{transport} {seconds:.0f} s")
                match = re.search(r"max/min - 1 = ([0-9.]+) %", text)
                if match:
                    spread = float(match.group(1))
                    summary.append(
                        [
                            "RSS flat (within 10%) after the cache fills",
                            transport,
                            "1,000 rollouts x 20 calls" if not args.quick else "smoke",
                            f"{spread:.1f} %",
                            verdict(spread, 10.0),
                        ]
                    )
                else:
                    summary.append(
                        ["RSS flat (within 10%) after the cache fills", transport, "", "no verdict (see output)", "n/a"]
                    )
                if code:
                    notes.append(f"bench_memory exited {code}")

    uptime_end = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print("\n\n## Summary: every target of issue 8 (ratios inside one interleaved run of each tool)\n")
    print(table(["target", "where", "detail", "measured", "verdict"], summary))
    if notes:
        print("\n" + "\n".join(f"- {n}" for n in notes))
    print(f"\nsteps: {', '.join(timings)}")
    print(f"uptime at start: {uptime}\nuptime at end:   {uptime_end}")
    print(
        f"total {time.perf_counter() - started:.0f} s; load average at the end {load_average()} (started at {load_at_start})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
