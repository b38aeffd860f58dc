"""``s3capture export``: the command around ``s3capture.export.export``.

Its option ranges (``EXPORT_RANGES``) and argparse types (``_duration``, ``_states``), the checks
made before any request (``_export``), the stdout kept clean for ``--json``
(``_stdout_kept_for_json``) and the call itself (``_run_export``). Its arguments are declared in
``s3capture.cli.build_parser``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

EXIT_NO_ROLLOUTS = 3
"""Exit status of an export that failed nothing but found no rollout at all under its source root
(a mistyped URL, or a run that has not written yet); the summary names the roots near it."""

EXPORT_RANGES = {
    "workers": (0, 256),
    "concurrency": (1, 1024),
    "shard_rollouts": (1, 1_000_000),
    "shard_mb": (1, 1_000_000),
    "row_group_rows": (1, 10_000_000),
    "row_group_mb": (1, 100_000),
}


def _duration(text: str) -> float:
    from s3capture.export import parse_duration

    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _states(text: str) -> tuple[str, ...]:
    """``--state`` of ``export``: the same names, parsed the same way, as ``ls --state``."""
    from s3capture.ops import _state_list

    return _state_list(text)


def _export(args: argparse.Namespace) -> int:
    import msgspec

    from s3capture.export import format_summary, read_ids
    from s3capture.store import parse_s3_url

    parse_s3_url(args.url)  # ValueError (exit 2, one line) before any request
    if args.out.startswith("s3://"):
        parse_s3_url(args.out)
    if args.endpoint:
        os.environ["AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL_S3"] = args.endpoint
    ids = read_ids(args.ids) if args.ids else None
    engine_options: dict[str, Any] = {}
    if args.engine == "ray":
        engine_options["address"] = args.address
        if args.ray_env:
            names = [name.strip() for name in args.ray_env.split(",") if name.strip()]
            missing = [name for name in names if name not in os.environ]
            if missing:
                raise ValueError(f"--ray-env: {', '.join(missing)} not set in this environment")
            engine_options["runtime_env"] = {"env_vars": {name: os.environ[name] for name in names}}
    elif args.address or args.ray_env:
        raise ValueError("--address and --ray-env apply to --engine ray only")
    with _stdout_kept_for_json() if args.json else contextlib.nullcontext():
        summary = _run_export(args, ids, engine_options)
    if args.json:
        data = msgspec.to_builtins(summary)
        data["ok"] = summary.ok
        print(msgspec.json.encode(data).decode())
    else:
        print(format_summary(summary))
    if not summary.ok:
        return 1
    # Nothing under the source root's rollouts/ prefix: a mistyped URL reads like this, and a
    # script that checks the exit status must not take it for a finished export.
    return EXIT_NO_ROLLOUTS if summary.root_empty else 0


@contextlib.contextmanager
def _stdout_kept_for_json() -> Iterator[None]:
    """``export --json``: while the export runs, ``sys.stdout`` and file descriptor 1 point at
    stderr, so stdout carries the summary's JSON and nothing else. Ray's driver prints its workers' and raylet's
    messages ("A worker died ...", task retries) on stdout, and worker processes inherit the
    descriptor; a parser of the output (``json.loads``, ``jq``) failed on them."""
    if sys.stdout is None:  # stdout closed (`>&-`): nothing to keep, and nothing can be printed
        yield
        return
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # descriptor 1 closed while sys.stdout was left open
        yield
        return
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # and Python's own stdout, whatever it writes to
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _run_export(args: argparse.Namespace, ids: Any, engine_options: dict) -> Any:
    import asyncio

    from s3capture.export import export
    from s3capture.ops import _given_states

    return asyncio.run(
        export(
            args.url,
            args.out,
            states=_given_states(args.state),
            ids=ids,
            prefix=args.prefix,
            min_age=args.min_age,
            freeze=args.freeze,
            builder=args.builder,
            build_with=args.build_with,
            format=args.format,
            masked=args.masked,
            drop=args.drop,
            engine=args.engine,
            engine_options=engine_options,
            workers=args.workers,
            concurrency=args.concurrency,
            shard_rollouts=args.shard_rollouts,
            shard_bytes=args.shard_mb * 1024 * 1024,
            row_group_rows=args.row_group_rows,
            row_group_bytes=args.row_group_mb * 1024 * 1024,
            token_type=args.token_ids,
            endpoint_url=args.endpoint,
            fence_grace=args.fence_grace,
            probe_listing=args.probe_listing,
            progress=not args.no_progress and not args.json,
        )
    )
