"""``s3capture demo`` and ``s3capture conformance``: the commands that run against a bucket
(an embedded moto server when none is given).

``_demo`` checks its options (``_check_demo``: ``DEMO_RANGES``, ``MAX_GENERATED_TOKENS``) and
inputs (``_load_inputs``) before anything starts, then runs ``s3capture.demo.run_workload``;
``_conformance`` runs ``s3capture.conformance``. Both create their bucket with ``_ensure_bucket``
(a test that replaces it patches ``s3capture.cli.demo._ensure_bucket``, the name these read).
Their arguments are declared in ``s3capture.cli.build_parser``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from s3capture.transport_config import check_endpoint_url
from s3capture.errors import install_hint

# The demo's numeric options: (lowest, highest). Upper bounds keep a typo from forking a thousand
# processes or generating a workload that cannot fit in memory.
DEMO_RANGES = {
    "workers": (1, 256),
    "concurrency": (1, 1024),
    "parallel_rollouts": (1, 100_000),
    "rollouts": (1, 1_000_000),
    "calls": (1, 10_000),
    "seed": (0, 2**63 - 1),
}
_DEMO_DEFAULTS = {"rollouts": 40, "calls": 6, "prompt_storage": "delta"}
# The generated workload is held in memory, and a call's prompt repeats every earlier turn, so its
# size grows with rollouts x calls^2: at most this many token ids (about 400 MB of lists).
MAX_GENERATED_TOKENS = 50_000_000


def generated_tokens(rollouts: int, calls: int) -> int:
    """Token ids (prompts and generations) of ``synthetic_rollouts(rollouts, calls)`` with its defaults.

    Call ``k``'s prompt has 64 + 48k ids and its generation 32.
    """
    return rollouts * (96 * calls + 24 * calls * (calls - 1))


def _input_files(names: list[str]) -> list[Path]:
    """The .jsonl files the inputs name (a folder stands for its ``*.jsonl``, as ``load_rollouts`` reads it).

    Raises ``ValueError`` for an input that does not exist, cannot be read, is neither a file nor a
    folder, or is a folder without a ``.jsonl`` file.
    """
    files: list[Path] = []
    for name in names:
        path = Path(name)
        if not path.exists():
            hint = (
                " (NeMo Gym's example rollouts: put them in a folder and point S3CAPTURE_EXAMPLE_DATA at it; README.md)"
                if "gym-example-rollouts" in name
                else ""
            )
            raise ValueError(f"input {name}: no such file or folder{hint}")
        if path.is_dir():
            try:
                found = sorted(p for p in path.iterdir() if p.suffix == ".jsonl" and p.is_file())
            except OSError as error:
                raise ValueError(f"input folder {name}: cannot list it: {error.strerror}") from None
            if not found:
                raise ValueError(f"input folder {name} contains no .jsonl file")
        elif path.is_file():
            found = [path]
        else:
            raise ValueError(f"input {name} is neither a regular file nor a folder")
        for file in found:
            try:
                with file.open("rb"):
                    pass
            except OSError as error:
                raise ValueError(f"input {file}: cannot read it: {error.strerror}") from None
        files.extend(found)
    return files


def _load_inputs(names: list[str]) -> list[Any]:
    """Every rollout of the input files; ``ValueError`` for a file without one usable rollout."""
    from s3capture.replay import load_rollouts

    rollouts: list[Any] = []
    seen: dict[str, str] = {}
    for file in _input_files(names):
        loaded = load_rollouts([file])
        if not any(rollout.calls for rollout in loaded):
            what = "no rollout" if not loaded else f"{len(loaded)} rollouts, none with a model call"
            raise ValueError(f"input {file}: no usable rollout ({what})")
        for rollout in loaded:  # ids are unique within a file (they hold the line number)
            previous = seen.get(rollout.rollout_id)
            if previous is not None:
                raise ValueError(
                    f"duplicate rollout id {rollout.rollout_id!r} ({previous} and {file}:{rollout.source.rsplit(':', 1)[-1]}); "
                    "rollout ids are built from the file stem, so give each file once and keep stems distinct"
                )
        seen.update((rollout.rollout_id, f"{file}:{rollout.source.rsplit(':', 1)[-1]}") for rollout in loaded)
        rollouts.extend(loaded)
    return rollouts


def _check_demo(args: argparse.Namespace) -> str | None:
    """Check the demo's options against each other and the environment; return the endpoint to use.

    Raises ``ValueError`` (exit 2, one line) before any input is read, any server or worker starts.
    """
    if args.files:
        for name in ("rollouts", "calls"):
            if getattr(args, name) is not None:
                raise ValueError(f"--{name} sizes the generated workload; it does not apply with rollout files")
    if args.staging_url is not None and args.capture != "ledger":
        raise ValueError("--staging-url applies only with --capture ledger")
    if args.export is not None and args.capture != "store":
        raise ValueError("--export applies only with --capture store (the ledger holds no token ids)")
    if args.keep and args.capture != "store":
        raise ValueError("--keep applies only with --capture store")
    if args.keep and args.export is not None:
        raise ValueError("--keep and --export: --export drops what it exported; export the kept rollouts later instead")
    if args.export is not None:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError(f"--export writes Parquet and needs pyarrow: {install_hint('parquet')}") from None
    if args.prompt_storage is not None and args.capture != "store":
        raise ValueError("--prompt-storage applies only with --capture store (the ledger stages token deltas)")
    for name, value in vars(args).items():
        if value is None and name in _DEMO_DEFAULTS:
            setattr(args, name, _DEMO_DEFAULTS[name])
    if not args.files and generated_tokens(args.rollouts, args.calls) > MAX_GENERATED_TOKENS:
        raise ValueError(
            f"--rollouts {args.rollouts} --calls {args.calls} would generate "
            f"{generated_tokens(args.rollouts, args.calls):,} token ids (a prompt repeats every earlier turn); "
            f"the limit is {MAX_GENERATED_TOKENS:,}: lower --calls or --rollouts"
        )
    if args.endpoint:
        return args.endpoint
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):  # the order in which the store reads them
        value = os.environ.get(name)
        if value:
            return check_endpoint_url(value, source=name)
    return None


def _demo(args: argparse.Namespace) -> int:
    started = time.perf_counter()  # the report's total wall time counts from here
    from s3capture.demo import format_report, run_workload
    from s3capture.replay import synthetic_rollouts

    endpoint = _check_demo(args)
    if args.keep and args.url is None and endpoint is None:
        raise ValueError(
            "--keep needs --url or --endpoint (or AWS_ENDPOINT_URL): without them the demo runs on an embedded "
            "server that stops with it, and the kept rollouts with it (--export DEST exports them during the run)"
        )
    if args.files:
        rollouts = _load_inputs(args.files)
    else:
        rollouts = synthetic_rollouts(args.rollouts, args.calls, seed=args.seed)
    run = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    # Attempt-scoped rollout ids: a second run never collides with the first one's fences.
    for rollout in rollouts:
        object.__setattr__(rollout, "rollout_id", f"{rollout.rollout_id}@{run}")
    server = None
    env: dict[str, str] = {}
    url = args.url
    try:
        if url is None and endpoint is None:
            import importlib.util

            from s3capture.localserver import start_moto

            if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
                print(
                    "s3capture demo: no S3 endpoint is configured and the embedded server is not installed; "
                    f"{install_hint('local')}, or pass --endpoint/--url (or set AWS_ENDPOINT_URL)",
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
                # Both names: the store reads AWS_ENDPOINT_URL_S3 first, so --endpoint must override it too.
                env["AWS_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL_S3"] = args.endpoint
            where = endpoint or "AWS S3"
        if url is None:
            url = f"s3://s3capture-demo/{run}"
            _ensure_bucket(url, endpoint, env)
        if server is not None and args.staging_url:
            _ensure_bucket(args.staging_url, endpoint, env)  # every bucket of the embedded server is the demo's
        transport = os.environ.get("S3CAPTURE_TRANSPORT") or "aioboto3"
        where = f"{url} on {where} (transport: {transport})"
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
            export_dest=args.export,
            keep=args.keep,
            wall_started=started,
        )
        print(format_report(report, where=where))
        if server is not None and args.export is None and args.capture == "store":
            # The embedded server and its bucket go with this process: say so, and how to keep data
            # (not after --export, whose trajectories are kept in its destination, nor for the
            # ledger, which --keep does not apply to: a new user, 2026-12-04).
            print(
                "the embedded server stops now and its data goes with it. To keep a capture: run `s3capture "
                "serve` in another terminal, paste the lines it prints here, then `s3capture demo --keep --url` "
                'with the URL it names (README.md, "Offline: list a bucket\'s rollouts and export them")',
                file=sys.stderr,
            )
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
    from s3capture.transport import configured_endpoint

    endpoint = configured_endpoint(args.endpoint)
    url = args.url
    if url is not None:
        from s3capture.store import parse_s3_url

        parse_s3_url(url)  # ValueError (exit 2, one line) before any server or request
    try:
        if url is None:
            if endpoint is not None:
                variable = "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"
                source = "--endpoint" if args.endpoint else f"{variable}={endpoint}"
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
            os.environ["AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL_S3"] = args.endpoint
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
    except client.exceptions.ClientError as error:
        if str(error.response.get("Error", {}).get("Code", "")) not in ("404", "NoSuchBucket", "NotFound"):
            raise  # refused credentials (403) are not a missing bucket: say so, not CreateBucket's error
        client.create_bucket(Bucket=bucket)
