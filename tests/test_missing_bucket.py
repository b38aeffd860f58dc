"""A bucket that does not exist is one clear ``StoreError`` ("bucket 'X' does not exist") at the
first request of the capture ledger and of the export, on every server (the token store's
operations: ``tests/test_store_source.py``, "missing bucket"). SeaweedFS would create the bucket on
the first PUT; ``start_seaweedfs`` turns that off, so writes fail there too instead of creating it.
"""

from __future__ import annotations

import uuid

import pytest

from helpers import assistant_output, make_commit, system, user
from s3capture.errors import StoreError
from s3capture.export import export
from s3capture.ledger import S3CaptureLedger


def _missing() -> str:
    return f"s3capture-missing-{uuid.uuid4().hex[:12]}"


async def test_ledger_on_a_missing_bucket_says_so_and_creates_nothing(s3_env, s3_client):
    bucket = _missing()
    ledger = S3CaptureLedger(f"s3://{bucket}/p")
    commit = make_commit("r", "c", [system("s"), user("u")], assistant_output("a"))
    operations = [
        ("begin_call", lambda: ledger.begin_call("r", "c")),
        ("record", lambda: ledger.record(commit)),
        ("record_failure", lambda: ledger.record_failure("r", "c", "boom")),
        ("rollouts", lambda: ledger.rollouts().__anext__()),
    ]
    try:
        for name, operation in operations:
            with pytest.raises(StoreError) as caught:
                await operation()
            assert f"bucket {bucket!r} does not exist" in str(caught.value), (name, str(caught.value))
    finally:
        await ledger.close()
    assert bucket not in [b["Name"] for b in s3_client.list_buckets().get("Buckets", [])]


async def test_export_from_a_missing_bucket_says_so(s3_env, tmp_path):
    bucket = _missing()
    with pytest.raises(StoreError, match=f"bucket '{bucket}' does not exist"):
        await export(f"s3://{bucket}/p", str(tmp_path / "out"), workers=0)
