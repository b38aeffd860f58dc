#!/usr/bin/env python
"""Run the model-based state machines longer than CI does, with faults, and report what they did.

    python tools/chaos.py --server moto --examples 200 --steps 40 --seed 1
    python tools/chaos.py --server seaweedfs --machine ledger --examples 100 --verbose
    python tools/chaos.py --server ceph --machine store --examples 40   # the Ceph RADOS Gateway (radosgw installed)
    python tools/chaos.py --server seaweedfs --transport obstore --examples 30

Starts its own local S3 server (``s3capture.localserver``: moto, SeaweedFS or the Ceph gateway), then runs the
token-store machine and/or the ledger machine of ``tests/model_machines.py`` (the same machines
``tests/test_model.py`` runs in CI with a small fixed budget) for ``--examples`` runs of up to
``--steps`` operations each, on the transport ``--transport`` names. Every run gets a fresh bucket, three clients (two behind a fault
proxy whose faults rules switch on and off) and checks the invariants of
``docs/reliability.md`` after every operation.

Prints the operations by outcome, the faults injected, the invariant checks made and the
violations found (expected: 0), with the wall time. ``--verbose`` also prints every operation,
fault switch and violation as it happens. On a violation hypothesis shrinks the run and prints a
minimal reproduction. Exit status: 0 when no invariant was violated, 1 otherwise, 2 for usage.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # model_machines, helpers, the fault proxy
sys.path.append(str(HERE.parent / "src"))  # only when s3capture is not installed (PYTHONPATH wins)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See docs/reliability.md.")
    parser.add_argument("--server", choices=("moto", "seaweedfs", "ceph"), default="moto")
    parser.add_argument("--machine", choices=("store", "ledger", "both"), default="both")
    parser.add_argument("--examples", type=int, default=200, help="runs per machine (default 200)")
    parser.add_argument("--steps", type=int, default=40, help="operations per run, at most (default 40)")
    parser.add_argument(
        "--transport",
        choices=("aioboto3", "obstore"),
        default="aioboto3",
        help="the transport every client of the machines uses (default aioboto3)",
    )
    parser.add_argument(
        "--faults",
        default="",
        help="comma-separated fault kinds to aim the machines at: client 1 starts with the first "
        "on, and the fault rule draws from these only (default: every kind, drawn; "
        "docs/reliability.md, Faults), e.g. --faults lag,cut for a run aimed at listings",
    )
    parser.add_argument("--seed", type=int, default=1, help="hypothesis seed (default 1)")
    parser.add_argument("--verbose", action="store_true", help="print every operation as it happens")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    if args.examples < 1 or args.steps < 1:
        parser.error("--examples and --steps must be at least 1")

    if args.faults:
        os.environ["S3CAPTURE_MODEL_FAULTS"] = args.faults  # read when model_machines is imported
    from hypothesis import seed as hypothesis_seed
    from hypothesis.stateful import run_state_machine_as_test

    try:
        from model_machines import Stats, ci_settings, ledger_machine, store_machine
    except ValueError as error:  # an unknown --faults kind
        parser.error(str(error))
    from s3capture.localserver import start_ceph_rgw, start_moto, start_seaweedfs

    server = {"moto": start_moto, "seaweedfs": start_seaweedfs, "ceph": start_ceph_rgw}[args.server]()
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        os.environ.pop(name, None)
    os.environ.update(server.env())
    os.environ["S3CAPTURE_TRANSPORT"] = args.transport  # read by every store the machines build
    machines = {"store": store_machine, "ledger": ledger_machine}
    chosen = list(machines) if args.machine == "both" else [args.machine]
    violations = 0
    started = time.monotonic()
    try:
        for name in chosen:
            stats = Stats(log=print if args.verbose else None)
            # --faults: client 1 starts with the first kind on, and the fault rule draws from them only.
            aimed = tuple(kind for kind in args.faults.split(",") if kind) or None
            machine = machines[name](server, stats, faults=aimed)
            config = ci_settings(max_examples=args.examples, stateful_step_count=args.steps, derandomize=False)
            gc.collect()  # see tests/test_model.py's run_state_machine_as_test (a CPython 3.11.7 bug)
            test = hypothesis_seed(args.seed)(lambda: run_state_machine_as_test(machine, settings=config))
            print(
                f"== {name} machine on {args.server} ({args.transport}): {args.examples} runs of up to {args.steps} steps, seed {args.seed}"
            )
            t0 = time.monotonic()
            failure = ""
            try:
                test()
            except AssertionError:
                failure = traceback.format_exc()
            elapsed = time.monotonic() - t0
            found = len(set(stats.violations)) or (1 if failure else 0)
            violations += found
            report(name, stats, elapsed, found)
            if failure:
                print(failure)
    finally:
        server.stop()
    print(f"== total: {violations} violation(s) in {time.monotonic() - started:.0f} s")
    return 1 if violations else 0


def report(name: str, stats, elapsed: float, violations: int) -> None:
    ops = sum(v for k, v in stats.ops.items() if not k.startswith("fault"))
    print(
        f"{name}: {stats.runs} runs, {stats.steps} steps, {ops} operations, "
        f"{sum(stats.faults.values())} faults injected, {sum(stats.checks.values())} invariant checks, "
        f"{violations} violation(s), {elapsed:.0f} s"
    )
    print("  operations by outcome:")
    for key, count in sorted(stats.ops.items()):
        print(f"    {key:45s} {count}")
    print("  faults injected (kind:request class):")
    for key, count in sorted(stats.faults.items()):
        print(f"    {key:45s} {count}")
    print("  invariant checks:")
    for key, count in sorted(stats.checks.items()):
        print(f"    {key:45s} {count}")
    for text in sorted(set(stats.violations)):
        print(f"  VIOLATION {text}")


if __name__ == "__main__":
    sys.exit(main())
