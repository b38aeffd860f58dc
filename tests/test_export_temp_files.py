"""A killed export to an ``s3://`` destination leaves its shard's temp file in the system's temp
folder (it is written there, then sent with one PUT). The next export on the machine removes the
temp files of exports whose process is gone, and nothing else (docs/export.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")

from helpers import simple_entry, split_bucket_url
from s3capture.export import export
from s3capture.export.destinations import remove_dead_exports_temp_files
from s3capture.leftovers import host_tag as _temp_host

HOUR = 3600.0


def dead_pid() -> int:
    """The id of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def plant(folder: Path, pid: int | str, *, host: str | None = None, age: float = 2 * HOUR, shard: int = 3) -> Path:
    path = folder / f"s3capture-export-{host or _temp_host()}-{pid}-part-{shard:05d}.parquet.abc123.tmp"
    path.write_bytes(b"half a shard")
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_only_the_old_temp_files_of_dead_exports_on_this_host_are_removed(tmp_path: Path) -> None:
    dead = plant(tmp_path, dead_pid())
    kept = [
        plant(tmp_path, os.getpid(), shard=4),  # alive
        plant(tmp_path, dead_pid(), age=60.0, shard=5),  # written a minute ago: maybe another PID namespace's
        plant(tmp_path, dead_pid(), host="another-node.ns1", shard=6),  # a temp folder shared between machines
        plant(tmp_path, dead_pid(), host=_temp_host().replace(".ns", ".ns9"), shard=7),  # another PID namespace
        plant(tmp_path, dead_pid(), host=_temp_host().replace(".", "_", 1), shard=8),  # a host name that differs
    ]
    others = [tmp_path / "s3capture-export-x-notapid-part-00001.tmp", tmp_path / "part-00001.parquet"]
    for path in others:
        path.write_bytes(b"someone else's")
    folder = tmp_path / f"s3capture-export-{_temp_host()}-{dead_pid()}-part-00008.parquet.d.tmp"
    folder.mkdir()  # not a regular file
    assert remove_dead_exports_temp_files(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and all(path.exists() for path in kept + others) and folder.is_dir()


def test_a_file_it_cannot_judge_never_fails_the_export(tmp_path: Path) -> None:
    """A huge process id (OverflowError from os.kill) or a folder that cannot be listed made the
    export that starts raise (a breaker on the first version, 2026-12-02)."""
    path = tmp_path / f"s3capture-export-{_temp_host()}-9999999999-part-00001.parquet.x.tmp"
    path.write_bytes(b"x")
    then = time.time() - 2 * HOUR
    os.utime(path, (then, then))
    assert remove_dead_exports_temp_files(str(tmp_path)) == [] and path.exists()  # not judged: kept
    assert remove_dead_exports_temp_files(str(tmp_path / "no-such-folder")) == []


async def test_an_export_to_s3_removes_what_a_killed_export_left(
    fresh: Any, bucket_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    store = fresh()
    await store.put(simple_entry("r1", "c1"))
    await store.freeze("r1")
    left, recent = plant(tmp_path, dead_pid()), plant(tmp_path, dead_pid(), age=10.0, shard=9)
    bucket, _ = split_bucket_url(bucket_url)
    summary = await export(bucket_url, f"s3://{bucket}/exports/temp", workers=0, min_age=0)
    assert summary.ok and summary.exported == 1
    assert not left.exists() and recent.exists()
    assert list(tmp_path.glob("s3capture-export-*")) == [recent]  # its own shard's temp file is gone too
