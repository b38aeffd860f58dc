"""``s3capture serve``: starts a local S3 server, prints working export lines, stops on a signal.

Each test runs the real command in a subprocess (it starts its own server, not the session's
``s3_server``), uses the printed lines to put and read an entry, signals it and checks that
every server process is gone and its temporary directory removed. One test per server kind:
Ceph's start takes seconds.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from conftest import SERVER_KINDS, server_unavailable, skip_unless_selected
from s3capture.records import TokenEntry
from s3capture.store import S3TokenStore

SRC = str(Path(__file__).resolve().parents[1] / "src")
_STATUS = re.compile(r"\(pids ([\d, ]+?)(?:, data in (\S+))?\) with bucket")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Served:
    """A running ``s3capture serve`` subprocess and what it printed."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.err_path = tmp_path / "serve.err"
        self._err = self.err_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "s3capture.cli", "serve", *args],
            stdout=subprocess.PIPE, stderr=self._err, stdin=subprocess.DEVNULL, env=_clean_env(),
        )  # fmt: skip
        self.lines: list[str] = []
        self._done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode().rstrip("\n"))
            if self.lines[-1].startswith("# URL:"):
                break
        self._done.set()

    def wait_ready(self, timeout: float) -> bool:
        """True once the URL line is printed; False if the process exited first."""
        deadline = time.monotonic() + timeout
        while not self._done.wait(0.1):
            if self.proc.poll() is not None and not self._done.wait(1.0):
                return False
            if time.monotonic() > deadline:
                raise AssertionError(f"serve printed no URL within {timeout} s; stderr:\n{self.stderr()}")
        if not (self.lines and self.lines[-1].startswith("# URL:")):
            return False
        while not _STATUS.search(self.stderr()):  # printed to stderr right after the URL line
            if time.monotonic() > deadline:
                raise AssertionError(f"serve printed no status line; stderr:\n{self.stderr()}")
            time.sleep(0.05)
        return True

    def stderr(self) -> str:
        self._err.flush()
        return self.err_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._err.close()


def _parse(lines: list[str]) -> tuple[dict[str, str], list[str], str]:
    """(exported variables, unset names, URL) from serve's stdout lines, by shell rules."""
    exported: dict[str, str] = {}
    unset: list[str] = []
    url = ""
    for line in lines:
        words = shlex.split(line, comments=False)
        if words[0] == "export":
            name, _, value = words[1].partition("=")
            exported[name] = value
        elif words[0] == "unset":
            unset += words[1:]
        elif line.startswith("# URL: "):
            url = line[len("# URL: ") :]
        else:
            raise AssertionError(f"serve printed a line that is not shell: {line!r}")
    return exported, unset, url


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start(tmp_path: Path, kind: str, *args: str, timeout: float = 240.0) -> Served:
    served = Served(tmp_path, "--server", kind, *args)
    if not served.wait_ready(timeout):
        served.stop()
        text = served.stderr()
        if "not installed" in text or "does not exist or is not executable" in text:
            server_unavailable(kind, text.strip().splitlines()[-1])
        raise AssertionError(f"serve --server {kind} exited with {served.proc.returncode}:\n{text}")
    return served


@pytest.mark.parametrize("kind", SERVER_KINDS)
async def test_serve_prints_working_env_and_stops_on_sigint(kind, tmp_path, monkeypatch):
    skip_unless_selected(kind)
    bucket = f"serve-{uuid.uuid4().hex[:12]}"
    served = _start(tmp_path, kind, "--bucket", bucket, "--prefix", "run1")
    try:
        exported, unset, url = _parse(served.lines)
        assert set(exported) == {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}
        assert exported["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        assert "AWS_ENDPOINT_URL_S3" in unset and "AWS_PROFILE" in unset
        assert url == f"s3://{bucket}/run1"
        status = _STATUS.search(served.stderr())
        assert status, served.stderr()
        pids = [int(p) for p in status.group(1).split(",")]
        data_dir = status.group(2)
        assert (data_dir is None) == (kind == "moto")
        assert all(_alive(pid) for pid in pids)

        # The printed lines are all a client needs: put an entry and read it back (the bucket exists).
        for name in unset:
            monkeypatch.delenv(name, raising=False)
        for name, value in exported.items():
            monkeypatch.setenv(name, value)
        store = S3TokenStore(url)
        try:
            entry = TokenEntry(rollout_id="r", model_call_id="c", prompt_token_ids=[1, 2],
                               generation_token_ids=[3], generation_log_probs=[-0.5])  # fmt: skip
            await store.put(entry)
            snapshot = await S3TokenStore(url).freeze("r")
            assert [e.prompt_token_ids + e.generation_token_ids for e in snapshot.entries] == [[1, 2, 3]]
        finally:
            await store.close()

        served.proc.send_signal(signal.SIGINT)
        assert served.proc.wait(60) == 0, served.stderr()
        assert "SIGINT: stopping" in served.stderr()
        assert not [pid for pid in pids if _alive(pid)]
        if data_dir is not None:
            assert not os.path.exists(data_dir)
    finally:
        served.stop()


def test_serve_stops_on_sigterm(tmp_path):
    skip_unless_selected("moto")
    served = _start(tmp_path, "moto")
    try:
        assert _parse(served.lines)[2] == "s3://s3capture/capture"  # the defaults
        pids = [int(p) for p in _STATUS.search(served.stderr()).group(1).split(",")]
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0, served.stderr()
        assert "SIGTERM: stopping" in served.stderr()
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        served.stop()


def test_serve_rejects_a_bad_bucket_name_before_starting(capsys):
    from s3capture.cli import main

    assert main(["serve", "--bucket", "no"]) == 2
    err = capsys.readouterr().err
    assert "s3capture serve: error: 'no'" in err and "not a bucket name" in err
    assert "starting a local" not in err
    # A URL where a name belongs said "the endpoint goes in --endpoint", an option serve lacks.
    assert main(["serve", "--bucket", "s3://x"]) == 2
    err = capsys.readouterr().err
    assert "--bucket takes a bucket name" in err and "--endpoint" not in err


@pytest.mark.parametrize(("prefix", "why"), [("a/rollouts", "'rollouts' segment"), ("a/../b", "'..' path segment")])
def test_serve_rejects_a_prefix_no_store_would_take_before_starting(capsys, prefix, why):
    """It printed s3://s3capture/a/rollouts, which every other command then refused."""
    from s3capture.cli import main

    assert main(["serve", "--prefix", prefix]) == 2
    err = capsys.readouterr().err
    assert "s3capture serve: error:" in err and why in err
    assert "starting a local" not in err
