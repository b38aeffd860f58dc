"""The ``s3capture`` command line (``s3capture demo``, ``s3capture conformance``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid


def _demo(args: argparse.Namespace) -> int:
    from s3capture.demo import format_report, run_workload
    from s3capture.replay import load_rollouts, synthetic_rollouts

    if args.staging_url and args.capture != "ledger":
        raise ValueError("--staging-url applies only with --capture ledger")
    if args.files:
        rollouts = load_rollouts(args.files)
    else:
        rollouts = synthetic_rollouts(args.rollouts, args.calls, seed=args.seed)
    run = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    # Attempt-scoped rollout ids: a second run never collides with the first one's fences.
    for rollout in rollouts:
        object.__setattr__(rollout, "rollout_id", f"{rollout.rollout_id}@{run}")
    server = None
    env: dict[str, str] = {}
    endpoint = args.endpoint or os.environ.get("AWS_ENDPOINT_URL")
    url = args.url
    try:
        if url is None and endpoint is None:
            import importlib.util

            from s3capture.localserver import start_moto

            if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
                print(
                    "s3capture demo: no S3 endpoint is configured and the embedded server is not installed; "
                    "pip install 's3capture[local]', or pass --endpoint/--url (or set AWS_ENDPOINT_URL)",
                    file=sys.stderr,
                )
                return 2

            print("no S3 endpoint configured: starting an embedded moto S3 server on 127.0.0.1", file=sys.stderr)
            server = start_moto()
            env = server.env()
            endpoint = server.endpoint_url
            where = f"embedded moto at {endpoint}"
        else:
            if args.endpoint:
                env["AWS_ENDPOINT_URL"] = args.endpoint
            where = endpoint or "AWS S3"
        if url is None:
            url = f"s3://s3capture-demo/{run}"
            _ensure_bucket(url, endpoint, env)
        where = f"{url} on {where}"
        report = run_workload(
            rollouts,
            url,
            env,
            workers=args.workers,
            concurrency=args.concurrency,
            parallel_rollouts=args.parallel_rollouts,
            delta=args.prompt_storage == "delta",
            seed=args.seed,
            progress=not args.no_progress,
            capture=args.capture,
            staging_url=args.staging_url,
        )
        print(format_report(report, where=where))
        return 0 if report.ok else 1
    finally:
        if server is not None:
            server.stop()


def _conformance(args: argparse.Namespace) -> int:
    import asyncio

    from s3capture.conformance import CHECKS, format_result, format_summary, run_s3_conformance

    if args.list:
        print("\n".join(name for name, _, _ in CHECKS))
        return 0
    unknown = sorted(set(args.check or ()) - {name for name, _, _ in CHECKS})
    if unknown:  # before any server starts or any request is sent; main() maps ValueError to exit 2
        raise ValueError(f"unknown check {', '.join(unknown)}; known: {', '.join(name for name, _, _ in CHECKS)}")
    server = None
    endpoint = args.endpoint or os.environ.get("AWS_ENDPOINT_URL")
    url = args.url
    if url is not None:
        from s3capture.store import parse_s3_url

        parse_s3_url(url)  # ValueError (exit 2, one line) before any server or request
    try:
        if url is None:
            if endpoint is not None:
                source = "--endpoint" if args.endpoint else f"AWS_ENDPOINT_URL={endpoint}"
                print(
                    f"s3capture conformance: {source} is set, so give the s3://bucket/prefix to check there "
                    "(unset it to check an embedded moto server)",
                    file=sys.stderr,
                )
                return 2
            from s3capture.localserver import start_moto

            print("no URL given: checking an embedded moto S3 server on 127.0.0.1", file=sys.stderr)
            server = start_moto()
            os.environ.update(server.env())
            endpoint = server.endpoint_url
            url = f"s3://s3capture-conformance/{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
            _ensure_bucket(url, endpoint, server.env())
        elif args.endpoint:
            os.environ["AWS_ENDPOINT_URL"] = args.endpoint
        print(f"s3capture conformance against {url} on {endpoint or 'AWS S3'}", flush=True)
        report = asyncio.run(
            run_s3_conformance(
                url,
                endpoint_url=endpoint,
                only=args.check or None,
                fence_grace=args.fence_grace,
                progress=lambda result: print(format_result(result), flush=True),
            )
        )
        print(format_summary(report))
        return 0 if report.ok else 1
    finally:
        if server is not None:
            server.stop()


def _ensure_bucket(url: str, endpoint: str | None, env: dict[str, str]) -> None:
    import boto3
    from botocore.config import Config

    from s3capture.store import parse_s3_url

    bucket, _ = parse_s3_url(url)
    kwargs = {}
    if env:
        kwargs = dict(
            aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
            region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"),
        )
    client = boto3.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}), **kwargs)
    try:
        client.head_bucket(Bucket=bucket)
    except client.exceptions.ClientError:
        client.create_bucket(Bucket=bucket)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="s3capture",
        description="s3capture: NeMo Gym's token-capture protocols on S3-compatible storage. "
        "'s3capture demo' runs a capture workload end to end; 's3capture conformance' checks a store.",
    )
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
    demo.add_argument("files", nargs="*", help="NeMo Gym rollout .jsonl files (default: a generated workload)")
    demo.add_argument("--url", help="s3://bucket/prefix to use (default: a fresh prefix in bucket s3capture-demo)")
    demo.add_argument("--endpoint", help="S3 endpoint URL (default: AWS_ENDPOINT_URL, else embedded moto)")
    demo.add_argument("--workers", type=int, default=4, help="model-server worker processes (default 4)")
    demo.add_argument("--concurrency", type=int, default=16, help="calls in flight per worker (default 16)")
    demo.add_argument("--parallel-rollouts", type=int, default=32, help="rollouts in flight (default 32)")
    demo.add_argument("--rollouts", type=int, default=40, help="generated rollouts (default 40)")
    demo.add_argument("--calls", type=int, default=6, help="calls per generated rollout (default 6)")
    demo.add_argument("--prompt-storage", choices=("delta", "full"), default="delta",
                      help="store a RESOLVED call's prompt as a delta after its parent (default) or in full")
    demo.add_argument("--capture", choices=("store", "ledger"), default="store",
                      help="store: whole token entries in S3TokenStore (default); ledger: token deltas staged "
                      "outside, token-free rows in S3CaptureLedger")
    demo.add_argument("--staging-url", help="with --capture ledger: s3://bucket/prefix of the staged deltas "
                      "(default: <url>-staging)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the generated workload and of worker choice (default 0)")
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
    check.add_argument("--endpoint", help="S3 endpoint URL (default: AWS_ENDPOINT_URL, else AWS S3)")
    check.add_argument("--check", action="append", metavar="NAME", help="run only this check (repeatable)")
    check.add_argument("--list", action="store_true", help="print the names of the checks and exit")
    check.add_argument("--fence-grace", type=float, default=1.0,
                       help="S3TokenStore fence_grace in seconds, as the training job uses (default 1.0)")
    check.set_defaults(func=_conformance)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from botocore.exceptions import BotoCoreError, ClientError

    from s3capture.store import StoreError

    try:
        return args.func(args)
    except (StoreError, BotoCoreError, ClientError, ValueError, OSError, RuntimeError) as error:
        print(f"s3capture {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
