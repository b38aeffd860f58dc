"""Process, log and port plumbing shared by the local S3 servers of :mod:`s3capture.localserver`.

Starting a child in its own session with a parent-death signal (:func:`_spawn`), stopping its
process group (:func:`_terminate`), keeping and reading the tail of its output
(:class:`_TailBuffer`, :func:`_read_tail`, :func:`_read_from`, :func:`_file_size`), probing it over
HTTP (:func:`_http_request`) and finding free ports on 127.0.0.1 (:func:`_port_free`,
:func:`_port_open`, :func:`_pick_free_ports`). Standard library only.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Any

_LOG_TAIL_BYTES = 64 * 1024

# Tiny launcher used on Linux: ask the kernel to signal the child when the parent (the
# thread that forked it) dies, then exec the real server. PR_SET_PDEATHSIG survives execve.
_PDEATHSIG_LAUNCHER = (
    "import ctypes,os,sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]), 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    sys.exit(70)\n"
    "os.execv(sys.argv[3], sys.argv[4:])\n"
)


# ------------------------------------------------------------------- ports
def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_free_ports(count: int, *, exclude: range = range(0)) -> tuple[int, ...]:
    """``count`` distinct ports currently bindable on 127.0.0.1, below the ephemeral range."""
    low, high = 10000, 32767
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            eph_low = int(f.read().split()[0])
        if eph_low - low >= 2000:
            high = eph_low - 1
    except (OSError, ValueError, IndexError):
        pass
    rng = random.SystemRandom()
    chosen: list[int] = []
    for _ in range(2000):
        if len(chosen) == count:
            return tuple(chosen)
        p = rng.randint(low, high)
        if p in chosen or p in exclude:
            continue
        if _port_free(p):
            chosen.append(p)
    raise RuntimeError(f"could not find {count} free ports on 127.0.0.1")


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int, limit: int = 1 << 20) -> str:
    """Up to ``limit`` bytes of ``path`` from ``offset`` (``""`` if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _port_open(port: int) -> bool:
    """True if something accepts TCP connections on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------ helpers
class _TailBuffer:
    """Thread-safe ring of the last bytes a process wrote."""

    def __init__(self, limit: int = _LOG_TAIL_BYTES) -> None:
        self._buf = bytearray()
        self._limit = limit
        self._lock = threading.Lock()

    def add(self, data: bytes) -> None:
        with self._lock:
            self._buf += data
            if len(self._buf) > self._limit:
                del self._buf[: len(self._buf) - self._limit]

    def text(self, max_chars: int) -> str:
        with self._lock:
            return bytes(self._buf).decode("utf-8", "replace")[-max_chars:]


def _read_tail(path: str, max_chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_chars * 4))
            return f.read().decode("utf-8", "replace")[-max_chars:]
    except OSError:
        return ""


def _spawn(cmd: list[str], *, death_signal: int, **kwargs: Any) -> subprocess.Popen:
    """Popen in a new session; on Linux from the main thread also with PR_SET_PDEATHSIG.

    The parent-death signal fires when the *thread* that forked the child ends, so it is
    only requested from the main thread.
    """
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        executable = cmd[0] if os.sep in cmd[0] else (shutil.which(cmd[0]) or cmd[0])
        cmd = [
            sys.executable,
            "-S",
            "-c",
            _PDEATHSIG_LAUNCHER,
            str(int(death_signal)),
            str(os.getpid()),
            executable,
            *cmd,
        ]
    return subprocess.Popen(cmd, start_new_session=True, **kwargs)


def _terminate(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the child's process group, wait ``grace`` s, then SIGKILL it; reap it."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        _signal_group(proc, signal.SIGKILL)
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session: pgid == pid
    except (ProcessLookupError, PermissionError, OSError):
        try:
            proc.send_signal(sig)
        except (ProcessLookupError, OSError):
            pass


def _http_request(url: str, *, method: str = "GET", timeout: float = 2.0) -> int | None:
    """HTTP status of ``url`` (any status counts as an answer), ``None`` if unreachable.

    Ignores proxy environment variables: the servers are on loopback.
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with opener.open(request, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code
    except (urllib.error.URLError, OSError, ValueError):
        return None
