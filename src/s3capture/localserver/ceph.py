""":func:`start_ceph_rgw`: a throwaway one-node Ceph cluster and its RADOS Gateway (S3).

Part of :mod:`s3capture.localserver` (import it from there): the fixed credentials of the
gateway's user, the Debian packages that bring the binaries, the ``ceph.conf`` template, and the
start recipe (monitor, memstore OSD, ``radosgw``, user) with its retries on other ports.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

from s3capture.localserver.process import (
    _file_size,
    _http_request,
    _pick_free_ports,
    _port_free,
    _port_open,
    _read_from,
    _read_tail,
    _spawn,
    _terminate,
)
from s3capture.localserver.server import (
    LocalS3Server,
    ServerUnavailable,
    _server_dir_prefix,
    remove_dead_server_dirs,
)

#: Fixed credentials of the user ``s3capture`` created on the Ceph RADOS Gateway.
CEPH_ACCESS_KEY = "s3capture-access"
CEPH_SECRET_KEY = "s3capture-secret"
#: Debian packages that bring the Ceph binaries :func:`start_ceph_rgw` runs.
CEPH_APT_PACKAGES = ("radosgw", "ceph-mon", "ceph-osd", "ceph-common")


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
