"""The running-server handle of :mod:`s3capture.localserver` and what every launcher shares.

:class:`LocalS3Server` (endpoint, credentials, ``env()``, ``reset()``, ``stop()``),
:class:`ServerUnavailable`, the registry of live servers that an ``atexit`` hook stops, the
clean-up ``stop()`` does after SeaweedFS (the Unix sockets it leaves in /tmp), and the naming and
sweeping of the temp folders of servers whose starting process died
(:func:`remove_dead_server_dirs`). Standard library only (``boto3`` lazily, in ``reset()``).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from typing import Any

from s3capture import leftovers
from s3capture.localserver.process import _http_request, _read_tail, _TailBuffer, _terminate

_REGION = "us-east-1"

# Strong references: a server nobody stopped is still stopped at interpreter exit.
_live_servers: "set[LocalS3Server]" = set()


def _stop_all_at_exit() -> None:
    for server in list(_live_servers):  # stop() removes it from the set
        try:
            server.stop()
        except Exception:  # noqa: BLE001  # pragma: no cover - best effort at interpreter exit
            pass


atexit.register(_stop_all_at_exit)


class ServerUnavailable(RuntimeError):
    """The software a local server needs is not installed on this machine.

    Raised by the launchers before anything is started; the message names what is missing
    and how to install it, in one line (tests turn it into a skip reason).
    """


class LocalS3Server:
    """A running local S3 server (child processes) and how to reach it.

    Instances are created by :func:`start_moto`, :func:`start_seaweedfs` and
    :func:`start_ceph_rgw`; do not construct them directly.

    Attributes:
        kind: ``"moto"``, ``"seaweedfs"`` or ``"ceph"``.
        endpoint_url: e.g. ``"http://127.0.0.1:40123"`` (no trailing slash). Clients
            should use path-style addressing.
        access_key: access key id the server accepts.
        secret_key: secret access key the server accepts.
        region: always ``"us-east-1"``.
        pid: process id of the server process (for Ceph: of ``radosgw``).
        data_dir: the temporary directory of SeaweedFS or of the Ceph cluster (removed
            by :meth:`stop`); ``None`` for moto.
        startup_seconds: wall time the ``start_*`` function took.

    The object is a context manager: ``__enter__`` returns it, ``__exit__`` calls
    :meth:`stop`.
    """

    def __init__(
        self,
        *,
        kind: str,
        endpoint_url: str,
        access_key: str,
        secret_key: str,
        process: subprocess.Popen,
        data_dir: str | None = None,
        log_path: str | None = None,
        log_tail: "_TailBuffer | None" = None,
        ports: tuple[int, ...] = (),
        helpers: tuple[subprocess.Popen, ...] = (),
    ) -> None:
        self.kind = kind
        self.endpoint_url = endpoint_url
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = _REGION
        self.data_dir = data_dir
        self.startup_seconds: float = 0.0
        self._process = process
        self._log_path = log_path
        self._log_tail = log_tail
        self._ports = ports
        self._helpers = helpers  # Ceph: the OSD and the monitor radosgw depends on
        self._lock = threading.Lock()
        self._stopped = False
        _live_servers.add(self)

    # ------------------------------------------------------------------ info
    @property
    def pid(self) -> int:
        """Process id of the server process."""
        return self._process.pid

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of all its processes (Ceph: radosgw, the OSD, the monitor)."""
        return (self._process.pid, *(helper.pid for helper in self._helpers))

    @property
    def port(self) -> int:
        """TCP port of the S3 endpoint."""
        return int(self.endpoint_url.rsplit(":", 1)[1])

    @property
    def running(self) -> bool:
        """True while the server's processes are alive and :meth:`stop` was not called."""
        return (
            not self._stopped
            and self._process.poll() is None
            and all(helper.poll() is None for helper in self._helpers)
        )

    def env(self) -> dict[str, str]:
        """Environment variables that point an AWS SDK at this server.

        Returns:
            ``{"AWS_ENDPOINT_URL": ..., "AWS_ACCESS_KEY_ID": ...,
            "AWS_SECRET_ACCESS_KEY": ..., "AWS_DEFAULT_REGION": "us-east-1"}``, suitable
            for ``subprocess`` ``env=`` (merge with ``os.environ``) or ``monkeypatch``.
        """
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client_kwargs(self) -> dict[str, str]:
        """Keyword arguments for ``boto3.client("s3", **kw)`` / aioboto3 ``session.client``.

        Returns:
            ``endpoint_url``, ``aws_access_key_id``, ``aws_secret_access_key`` and
            ``region_name``. Add a ``config`` with ``s3={"addressing_style": "path"}``.
        """
        return {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }

    def log_tail(self, max_chars: int = 4000) -> str:
        """The last ``max_chars`` characters the server wrote to stdout/stderr.

        Available until :meth:`stop` for SeaweedFS and Ceph (their logs live in the data
        dir; for Ceph this is ``radosgw``'s log) and for the whole lifetime of the object
        for moto. Returns ``""`` if nothing is available.
        """
        if self._log_tail is not None:
            return self._log_tail.text(max_chars)
        if self._log_path is not None:
            return _read_tail(self._log_path, max_chars)
        return ""

    # ------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Wipe all server state (buckets and objects).

        * moto: ``POST /moto-api/reset`` (a few ms).
        * SeaweedFS, Ceph: deletes every bucket via the S3 API (needs ``boto3``, which
          comes with aioboto3); objects are emptied first if a bucket refuses deletion.

        Raises:
            RuntimeError: the server is stopped or the reset request failed.
        """
        if not self.running:
            raise RuntimeError(f"{self.kind} server at {self.endpoint_url} is not running")
        if self.kind == "moto":
            status = _http_request(self.endpoint_url + "/moto-api/reset", method="POST", timeout=10.0)
            if status is None or status >= 300:
                raise RuntimeError(f"moto reset failed (HTTP status {status})")
            return
        self._reset_via_s3()

    def _reset_via_s3(self) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - boto3 ships with aioboto3
            raise RuntimeError(f"reset() of a {self.kind} server needs boto3") from exc
        client = boto3.client(
            "s3",
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard"}),
            **self.client_kwargs(),
        )
        try:
            for bucket in client.list_buckets().get("Buckets", []):
                name = bucket["Name"]
                try:
                    client.delete_bucket(Bucket=name)
                except client.exceptions.ClientError:
                    _empty_bucket(client, name)
                    client.delete_bucket(Bucket=name)
        except Exception as exc:
            raise RuntimeError(f"{self.kind} reset failed: {exc}") from exc
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server and clean up; safe to call more than once (and concurrently).

        * moto: SIGTERM, wait up to 5 s, then SIGKILL.
        * SeaweedFS: SIGTERM, wait up to 2 s (started with ``-volume.preStopSeconds=0`` it
          usually exits in ~1.2 s; by default graceful shutdown can take 2-25 s), then
          SIGKILL; afterwards removes its temporary data directory and any Unix sockets
          it left in /tmp.
        * Ceph: SIGTERM to ``radosgw``, then the OSD, then the monitor (~1 s in all), each
          with up to 5 s before SIGKILL; afterwards removes the cluster's temporary
          directory.

        Never raises for an already dead process.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        _live_servers.discard(self)
        proc = self._process
        sockets: list[str] = []
        if self.kind == "seaweedfs":
            sockets = _unix_socket_paths(proc.pid)
            grace = 2.0
        else:
            grace = 5.0
        if self.kind == "ceph":
            # One at a time, clients before servers: radosgw, the OSD, the monitor (~1 s in
            # all). Signalled together, the OSD waits for the gone monitor and needs SIGKILL.
            for each in (proc, *self._helpers):
                _terminate(each, 5.0)
            if self.data_dir:
                shutil.rmtree(self.data_dir, ignore_errors=True)
            return
        _terminate(proc, grace)
        if self.kind == "seaweedfs":
            _remove_weed_sockets(sockets, self._ports)
            if self.data_dir:
                shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "LocalS3Server":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<LocalS3Server {self.kind} {self.endpoint_url} pid={self.pid} {state}>"


def _empty_bucket(client: Any, bucket: str) -> None:
    """Delete every object and multipart upload in ``bucket`` (1,000 keys per request)."""
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


# ------------------------------------------------------- stopped SeaweedFS
def _unix_socket_paths(pid: int) -> list[str]:
    """Paths of the bound Unix sockets held by ``pid`` (Linux only; else ``[]``)."""
    try:
        inodes = set()
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        paths = []
        with open(f"/proc/{pid}/net/unix") as f:
            next(f)
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/"):
                    paths.append(parts[7])
        return paths
    except (OSError, StopIteration):
        return []


def _remove_weed_sockets(paths: list[str], ports: tuple[int, ...]) -> None:
    """Remove the Unix sockets weed creates in /tmp (it does not after SIGKILL)."""
    candidates = set(paths)
    tmp = "/tmp"
    for port in ports:
        for role in ("master", "volume", "filer", "s3", "admin"):
            candidates.add(f"{tmp}/seaweedfs-{role}-{port}.sock")
            candidates.add(f"{tmp}/seaweedfs-{role}-grpc-{port}.sock")
    for path in candidates:
        if not os.path.basename(path).startswith("seaweedfs-") and "s3capture-weed-" not in path:
            continue  # never touch sockets that are not SeaweedFS's
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        except OSError:
            pass


# ---------------------------------------------------- dead servers' folders
_SERVER_DIR = re.compile(r"^s3capture-(?:weed|ceph)-(?P<host>[0-9a-f]{10})-(?P<pid>[0-9]{1,10})-[^/]+$")
"""The temp folder of a SeaweedFS or Ceph server this module started:
``s3capture-<weed|ceph>-<short host tag>-<pid of the starting process>-<random>``."""
SERVER_DIR_STALE = 600.0
"""Seconds since the last write to a dead process's server folder before it is removed."""


def _server_dir_prefix(kind: str) -> str:
    return f"s3capture-{kind}-{leftovers.host_tag(short=True)}-{os.getpid()}-"


def remove_dead_server_dirs(folder: str | None = None, *, stale_after: float = SERVER_DIR_STALE) -> list[str]:
    """Remove the temp folders (data, logs, sockets) of SeaweedFS and Ceph servers that this
    module started in processes since killed (SIGKILL skips :meth:`LocalS3Server.stop`; the
    servers die with them, by ``PR_SET_PDEATHSIG``). A folder goes only when it is this user's,
    named for this host and PID namespace, its starting process is gone, and nothing in it was
    written for ``stale_after`` seconds (``s3capture.leftovers.remove_dead``). ``folder``
    defaults to the system's temp folder. Never raises; returns the removed paths. Called when a
    server starts."""
    return leftovers.remove_dead(
        folder or tempfile.gettempdir(),
        _SERVER_DIR,
        host=leftovers.host_tag(short=True),
        stale_after=stale_after,
        directories=True,
    )
