""":func:`start_moto`: moto in server mode (``python -m moto.server``) as a child process.

Part of :mod:`s3capture.localserver` (import it from there): the credentials handed out (moto
accepts any), the launcher, and the thread that drains the server's stderr (keeping its tail and
spotting the ``Running on`` line that gives the port).
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

from s3capture.errors import install_hint
from s3capture.localserver.process import _http_request, _spawn, _TailBuffer, _terminate
from s3capture.localserver.server import LocalS3Server, ServerUnavailable

#: Credentials handed out for moto (it accepts any).
MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing"

_RUNNING_ON = re.compile(r"Running on (https?://[^\s\x1b]+?):(\d+)")


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
