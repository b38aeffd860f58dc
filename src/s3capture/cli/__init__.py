"""The ``s3capture`` command line (``s3capture demo``, ``s3capture conformance``, ``s3capture export``).

``main`` (the ``s3capture`` entry point) and ``build_parser``, which declares every subcommand's
arguments (``ls``, ``status``, ``gc``, ``doctor`` and ``serve`` register theirs from their own
modules). The commands themselves live in ``s3capture.cli.demo`` (``demo``, ``conformance``) and
``s3capture.cli.export`` (``export``); the parser class and the argument checks they share in
``s3capture.cli.arguments``. Their public names (and the private ones other modules use) stay
importable from here; a test that replaces a helper (``_ensure_bucket``) patches the submodule
that reads it, where a copy here would not take effect.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from s3capture.cli.arguments import (
    _argument as _argument,
    _int_in as _int_in,
    _Parser as _Parser,
    check_endpoint as check_endpoint,
    check_s3_url as check_s3_url,
    escape_unencodable_output as escape_unencodable_output,
    stdout_to_devnull as stdout_to_devnull,
)
from s3capture.cli.demo import (
    DEMO_RANGES as DEMO_RANGES,
    MAX_GENERATED_TOKENS as MAX_GENERATED_TOKENS,
    _conformance as _conformance,
    _demo as _demo,
    generated_tokens as generated_tokens,
)
from s3capture.cli.export import (
    EXPORT_RANGES as EXPORT_RANGES,
    _duration as _duration,
    _export as _export,
    _states as _states,
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="s3capture",
        description="s3capture: NeMo Gym's token-capture protocols on S3-compatible storage. "
        "'s3capture demo' runs a capture workload end to end; 's3capture conformance' checks a store; "
        "'s3capture export' turns captured rollouts into training trajectories.",
    )
    from s3capture import __version__

    parser.add_argument("--version", action="version", version=f"s3capture {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run a capture workload end to end (embedded S3 server unless an endpoint or --url is given)",
        description="Replay NeMo Gym rollout files (or a generated workload) through several worker "
        "processes writing to S3, then freeze, verify and drop every rollout. With --capture ledger the "
        "workers stage token deltas outside the store (as a training framework does) and S3CaptureLedger keeps "
        "only token-free rows; the builder then checks each manifest, rebuilds every call from the staged "
        "deltas, retires the ledger and deletes the staged objects.",
    )
    r = DEMO_RANGES
    demo.add_argument(
        "files", nargs="*", help="NeMo Gym rollout .jsonl files or folders of them (default: a generated workload)"
    )
    demo.add_argument(
        "--url",
        type=_argument(check_s3_url),
        help="s3://bucket/prefix to use (default: a fresh prefix in bucket s3capture-demo)",
    )
    demo.add_argument(
        "--endpoint",
        type=_argument(check_endpoint),
        help="S3 endpoint URL, http(s)://host[:port] (default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else embedded moto)",
    )
    demo.add_argument(
        "--workers",
        type=_int_in(*r["workers"]),
        default=4,
        help="model-server worker processes, %d to %d (default 4)" % r["workers"],
    )
    demo.add_argument(
        "--concurrency",
        type=_int_in(*r["concurrency"]),
        default=16,
        help="calls in flight per worker, %d to %d (default 16)" % r["concurrency"],
    )
    demo.add_argument(
        "--parallel-rollouts",
        type=_int_in(*r["parallel_rollouts"]),
        default=32,
        help="rollouts in flight, %d to %d (default 32)" % r["parallel_rollouts"],
    )
    demo.add_argument(
        "--rollouts",
        type=_int_in(*r["rollouts"]),
        help="generated rollouts, %d to %d (default 40; not with files)" % r["rollouts"],
    )
    demo.add_argument(
        "--calls",
        type=_int_in(*r["calls"]),
        help="calls per generated rollout, %d to %d (default 6; not with files)" % r["calls"],
    )
    demo.add_argument(
        "--export",
        metavar="DEST",
        default=None,
        help="with --capture store: export the frozen rollouts as training trajectories to DEST "
        "(a new or empty local folder or s3:// prefix, checked before the capture; Parquet, as "
        "'s3capture export' writes) before they are dropped",
    )
    demo.add_argument(
        "--keep",
        action="store_true",
        help="with --capture store: freeze and verify every rollout but do not drop it, so "
        "'s3capture export' can read it later (needs --url/--endpoint: the embedded "
        "server stops with the demo)",
    )
    demo.add_argument(
        "--prompt-storage",
        choices=("delta", "full"),
        help="with --capture store: store a RESOLVED call's prompt as a delta after its parent (default) or in full",
    )
    demo.add_argument(
        "--capture",
        choices=("store", "ledger"),
        default="store",
        help="store: whole token entries in S3TokenStore (default); ledger: token deltas staged "
        "outside, token-free rows in S3CaptureLedger",
    )
    demo.add_argument(
        "--staging-url",
        type=_argument(check_s3_url),
        help="with --capture ledger: s3://bucket/prefix of the staged deltas (default: <url>-staging)",
    )
    demo.add_argument(
        "--seed",
        type=_int_in(*r["seed"]),
        default=0,
        help="seed of the generated workload and of worker choice, >= 0 (default 0)",
    )
    demo.add_argument("--no-progress", action="store_true", help="hide progress bars")
    demo.set_defaults(func=_demo)
    check = sub.add_parser(
        "conformance",
        help="check every contract of the token-capture protocols against a bucket (embedded S3 without a URL)",
        description="Run s3capture's conformance suite (s3capture.conformance) against S3TokenStore and "
        "S3CaptureLedger on a real bucket, so an operator can check a store (AWS S3, GCS, MinIO, R2, Ceph) "
        "before a training run. Every check uses its own rollout ids under the prefix and deletes them "
        "afterwards. Exit status 0 when every check passes, 1 when any fails, 2 for a usage error or a "
        "store that cannot be used at all (missing bucket, refused credentials, unreachable endpoint).",
    )
    check.add_argument("url", nargs="?", help="s3://bucket/prefix to check (default: an embedded moto server)")
    check.add_argument(
        "--endpoint",
        type=_argument(check_endpoint),
        help="S3 endpoint URL (default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS S3)",
    )
    check.add_argument("--check", action="append", metavar="NAME", help="run only this check (repeatable)")
    check.add_argument("--list", action="store_true", help="print the names of the checks and exit")
    check.add_argument(
        "--fence-grace",
        type=float,
        default=1.0,
        help="S3TokenStore fence_grace in seconds, as the training job uses (default 1.0)",
    )
    check.set_defaults(func=_conformance)
    export = sub.add_parser(
        "export",
        help="export captured rollouts as training trajectories (Parquet or Gym JSONL), resumable",
        description="Turn the rollouts captured under URL into training trajectories in DEST (a local folder or an "
        "s3:// prefix): one streaming listing, a read-only snapshot per rollout (GET and LIST; --freeze and --drop "
        "also write), trajectories built with NeMo Gym's builder when it is importable, shards part-NNNNN written "
        "atomically, each followed by its manifest. A re-run skips what DEST already holds at the same snapshot, so "
        "an interrupted export resumes. Masked or incomplete rollouts are never written as trainable. Exit status 0 "
        "when nothing failed, 1 when a rollout, shard or drop failed, 2 for a usage or setup error, 3 when the source root "
        "holds no rollout (a mistyped URL, usually). See docs/export.md.",
    )
    e = EXPORT_RANGES
    export.add_argument("url", type=_argument(check_s3_url), help="s3://bucket/prefix the rollouts were captured under")
    export.add_argument(
        "--out", required=True, metavar="DEST", help="a local folder or an s3://bucket/prefix for the shards"
    )
    export.add_argument(
        "--state",
        type=_states,
        action="append",
        metavar="STATES",
        help="comma-separated (and repeatable) states to export among open, frozen, retired (default: frozen, and open "
        "ones quiescent for --min-age)",
    )
    export.add_argument(
        "--min-age",
        type=_duration,
        default=600.0,
        metavar="AGE",
        help="an open rollout is exported only when its newest object is this old, e.g. 90s, 10m, 2h (a bare number is seconds) "
        "(default 10m; measured on the earlier of the store's clock and this machine's)",
    )
    export.add_argument(
        "--freeze",
        action="store_true",
        help="freeze open rollouts (and re-seal changed frozen ones) before reading them; needs PutObject",
    )
    export.add_argument("--ids", metavar="FILE", help="export only the rollout ids in FILE (one per line)")
    export.add_argument("--prefix", default="", help="export only rollout ids starting with this text")
    export.add_argument(
        "--builder",
        choices=("prefix_merging", "per_request"),
        default="prefix_merging",
        help="trajectory builder, as NeMo Gym names them (default prefix_merging)",
    )
    export.add_argument(
        "--build-with",
        choices=("auto", "gym", "builtin"),
        default="auto",
        help="whose builder runs: gym (nemo_gym's own consumer), builtin (s3capture's, follows the "
        "recorded parent links) or auto (gym when nemo_gym is importable; default)",
    )
    export.add_argument(
        "--format",
        choices=("parquet", "gym-jsonl"),
        default="parquet",
        help="parquet: one row per trajectory (default); gym-jsonl: the dicts NeMo Gym's consumer returns",
    )
    export.add_argument(
        "--masked",
        choices=("skip", "include"),
        default="skip",
        help="a masked or incomplete rollout is left out (skip, default) or written with masked=true",
    )
    export.add_argument(
        "--drop",
        action="store_true",
        help="drop each rollout exported as trainable once its shard is durable (conditional: a rollout "
        "changed since its snapshot is kept); needs PutObject and DeleteObject",
    )
    export.add_argument(
        "--fence-grace",
        type=_duration,
        default=1.0,
        metavar="SECONDS",
        help="the fence_grace every S3TokenStore of the bucket uses (default 1s); --drop waits it, so "
        "it must be the capture fleet's value",
    )
    export.add_argument(
        "--probe-listing",
        action="store_true",
        help="with --freeze, on a store whose listings lag writes (doctor's list-after-write check): each "
        "freeze PUTs a probe and lists until it shows (S3TokenStore(probe_listing=True)); needs DeleteObject",
    )
    from s3capture.export import ENGINES

    export.add_argument(
        "--engine",
        choices=tuple(ENGINES),
        default="local",
        help="where shards run: local (a process pool on this machine; default) or ray (Ray tasks on "
        "a Ray cluster; pip install 's3capture[ray]')",
    )
    export.add_argument(
        "--address",
        metavar="ADDRESS",
        help="--engine ray: the cluster, ray://HOST:10001 (Ray Client) or auto (the cluster 'ray start' "
        "runs on this machine); default: RAY_ADDRESS, else a 'ray start' cluster of this machine if one "
        "runs, else a local Ray runtime for this export",
    )
    export.add_argument(
        "--ray-env",
        metavar="NAMES",
        help="--engine ray: comma-separated environment variables of this process to set on the Ray "
        "workers (runtime_env env_vars), e.g. AWS_ACCESS_KEY_ID,AWS_SECRET_ACCESS_KEY; workers "
        "otherwise read credentials from their own environment",
    )
    export.add_argument(
        "--workers",
        type=_int_in(*e["workers"]),
        default=2,
        help="worker processes of the local engine, or Ray tasks at once with --engine ray, %d to %d; "
        "0 runs shards in this process (local engine only; default 2)" % e["workers"],
    )
    export.add_argument(
        "--concurrency",
        type=_int_in(*e["concurrency"]),
        default=8,
        help="rollouts read at once per worker, %d to %d (default 8)" % e["concurrency"],
    )
    export.add_argument(
        "--shard-rollouts",
        type=_int_in(*e["shard_rollouts"]),
        default=256,
        help="rollouts per shard at most (default 256)",
    )
    export.add_argument(
        "--shard-mb",
        type=_int_in(*e["shard_mb"]),
        default=256,
        help="stored MiB of rollouts per shard, about (default 256)",
    )
    export.add_argument(
        "--row-group-rows",
        type=_int_in(*e["row_group_rows"]),
        default=1024,
        help="Parquet rows per row group at most (default 1024)",
    )
    export.add_argument(
        "--row-group-mb",
        type=_int_in(*e["row_group_mb"]),
        default=64,
        help="Parquet row group size at most, in MiB of uncompressed token columns (default 64)",
    )
    export.add_argument(
        "--token-ids",
        choices=("auto", "int64"),
        default="auto",
        help="token_ids element type of every shard: auto (int32; a rollout holding a larger id fails) or int64",
    )
    export.add_argument(
        "--endpoint",
        type=_argument(check_endpoint),
        help="S3 endpoint URL of the source and an s3:// DEST (default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS S3)",
    )
    export.add_argument("--json", action="store_true", help="print the summary as one JSON object (no progress bar)")
    export.add_argument("--no-progress", action="store_true", help="hide the progress bar / progress lines")
    export.set_defaults(func=_export)
    from s3capture.doctor import register as register_doctor
    from s3capture.ops import register as register_ops
    from s3capture.serve import register as register_serve

    parser.commands = {
        "demo": demo,
        "conformance": check,
        "export": export,
        **register_ops(sub),  # ls, status, gc
        "doctor": register_doctor(sub),
        "serve": register_serve(sub),
    }
    return parser


def main(argv: list[str] | None = None) -> int:
    escape_unencodable_output()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, or a usage error already printed on one line
        return done.code if isinstance(done.code, int) else 2
    from botocore.exceptions import BotoCoreError, ClientError

    from s3capture.store import StoreError

    # Long commands that clean up on Ctrl-C: a SIGTERM (timeout, kill, a pod stop) takes that path too.
    previous_sigterm = _sigterm_as_ctrl_c() if args.command in ("export", "conformance", "demo") else None
    try:
        code = args.func(args)
        if sys.stdout is not None:  # None: started with stdout closed (`>&-`)
            sys.stdout.flush()  # inside the try: a reader gone before the last flush is a quiet end too
        return code
    except BrokenPipeError:
        # The reader of our output went away (`s3capture ls URL | head`): a quiet end, as for any
        # Unix filter. (`gc --yes` does not end there: it finishes its deletions.)
        stdout_to_devnull()
        return 0
    except Exception as error:
        from s3capture.errors import ExportWorkerDied

        if isinstance(error, ExportWorkerDied):  # a run that failed, not a usage or setup error
            print(f"s3capture {args.command}: error: {error}", file=sys.stderr)
            return 1
        if isinstance(error, (StoreError, BotoCoreError, ClientError, ValueError, OSError, RuntimeError)):
            print(f"s3capture {args.command}: error: {error}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        hint = ""
        if args.command == "export":
            hint = ": shards published so far are durable; the same command resumes from them"
        elif args.command == "demo" and getattr(args, "url", None):
            hint = f": the rollouts written so far stay under {args.url} (`s3capture ls {args.url}` lists them)"
        how = " by SIGTERM" if _TERMINATED else ""
        print(f"s3capture {args.command}: interrupted{how}{hint}", file=sys.stderr)
        return 143 if _TERMINATED else 130
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)


_TERMINATED = False
"""Whether a SIGTERM interrupted the command (``_sigterm_as_ctrl_c``)."""


def _sigterm_as_ctrl_c() -> Any:
    """For a long command (``export``, ``conformance``): a SIGTERM (``timeout``, ``kill``, a Kubernetes pod's
    stop) ends it as a Ctrl-C does (its workers stopped, one line saying what is durable, status
    143) instead of killing it mid-shard with nothing said. Returns the previous handler, or
    ``None`` where none can be set (not the main thread, or SIGTERM ignored by the caller)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        return None

    def interrupt(signum: int, frame: Any) -> None:
        global _TERMINATED
        _TERMINATED = True
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            raise KeyboardInterrupt  # Ctrl-C ignored by the caller: SIGTERM still ends the command
        signal.raise_signal(signal.SIGINT)  # the Ctrl-C path: asyncio cancels, the pool stops

    return signal.signal(signal.SIGTERM, interrupt)
