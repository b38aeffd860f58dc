"""A killed export to an ``s3://`` destination leaves its shard's temp file in the system's temp
folder (it is written there, then sent with one PUT). The next export on the machine removes the
temp files of exports whose process is gone, and never those of a live one (docs/export.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")

from helpers import simple_entry, split_bucket_url
from s3capture.export import export
from s3capture.export.destinations import remove_dead_exports_temp_files


def dead_pid() -> int:
    """The id of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def plant(folder: Path, pid: int, shard: int = 3) -> Path:
    path = folder / f"s3capture-export-{pid}-part-{shard:05d}.parquet.abc123.tmp"
    path.write_bytes(b"half a shard")
    return path


def test_only_the_temp_files_of_dead_exports_are_removed(tmp_path: Path) -> None:
    dead, live = plant(tmp_path, dead_pid()), plant(tmp_path, os.getpid(), 4)
    others = [tmp_path / "s3capture-export-notapid-part-00001.tmp", tmp_path / "part-00001.parquet"]
    for path in others:
        path.write_bytes(b"someone else's")
    assert remove_dead_exports_temp_files(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and all(path.exists() for path in others)


async def test_an_export_to_s3_removes_what_a_killed_export_left(
    fresh: Any, bucket_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    store = fresh()
    await store.put(simple_entry("r1", "c1"))
    await store.freeze("r1")
    left = plant(tmp_path, dead_pid())
    bucket, _ = split_bucket_url(bucket_url)
    summary = await export(bucket_url, f"s3://{bucket}/exports/temp", workers=0, min_age=0)
    assert summary.ok and summary.exported == 1
    assert not left.exists()
    assert not list(tmp_path.glob("s3capture-export-*"))  # its own shard's temp file is gone too
