"""mark_incomplete stays available when the store is down: a local, fsynced spill replayed later."""

from __future__ import annotations

import pytest
from botocore.config import Config

from helpers import simple_entry
from s3capture.protocols import TokenCaptureRetiredError
from faultproxy import FaultProxy, Outage

from s3capture.store import S3TokenStore, StoreError, parse_s3_url


def _dead_store(url: str, tmp_path) -> S3TokenStore:
    config = Config(
        retries={"mode": "standard", "max_attempts": 1},
        connect_timeout=0.5,
        read_timeout=0.5,
        s3={"addressing_style": "path"},
    )
    return S3TokenStore(url, endpoint_url="http://127.0.0.1:9", botocore_config=config, spill_dir=tmp_path)


async def test_marker_spills_when_store_is_down_and_replays_later(s3_env, s3_server, bucket_url, tmp_path):
    # The store goes down and comes back at the same endpoint (a fault proxy answering 503): the
    # spill belongs to (endpoint, bucket, prefix), so only a client of that endpoint replays it.
    proxy = await FaultProxy(s3_server.port).start()
    outage = proxy.rule = Outage()
    config = Config(retries={"mode": "standard", "max_attempts": 1}, s3={"addressing_style": "path"})
    try:
        dead = S3TokenStore(bucket_url, endpoint_url=proxy.endpoint, botocore_config=config, spill_dir=tmp_path)
        try:
            await dead.mark_incomplete("spilled-rollout", "call-7")  # must not raise: the spill holds it
        finally:
            await dead.close()
        (spill,) = tmp_path.glob("spill-*.jsonl")
        assert b"call-7" in spill.read_bytes()
        outage.down = False
        live = S3TokenStore(bucket_url, endpoint_url=proxy.endpoint, botocore_config=config, spill_dir=tmp_path)
        try:
            # A successful put replays the pending spill: the store answers again.
            await live.put(simple_entry("spilled-rollout", "call-1"))
            assert not spill.exists()
            assert await live.replay_spill() == 0
            snapshot = await live.freeze("spilled-rollout")
            assert snapshot.incomplete
            assert "marked_incomplete:call-7" in snapshot.reasons
        finally:
            await live.close()
    finally:
        await proxy.stop()


async def test_marker_without_spill_raises_store_error_when_store_is_down(s3_env, bucket_url, tmp_path):
    # (s3_env: with credentials, so the failure is the dead endpoint, not the missing credentials)
    config = Config(retries={"mode": "standard", "max_attempts": 1}, connect_timeout=0.5, read_timeout=0.5)
    dead = S3TokenStore(bucket_url, endpoint_url="http://127.0.0.1:9", botocore_config=config)
    try:
        with pytest.raises(StoreError, match="cannot connect to http://127.0.0.1:9"):
            await dead.mark_incomplete("r", "c")
    finally:
        await dead.close()


async def test_marker_after_retire_raises_retired_and_only_retire_removes_it(s3_env, bucket_url, s3_client):
    store = S3TokenStore(bucket_url)
    try:
        await store.put(simple_entry("gone", "call-1"))
        await store.retire(["gone"])
        with pytest.raises(TokenCaptureRetiredError):
            await store.mark_incomplete("gone", "call-2")
        bucket, prefix = parse_s3_url(bucket_url)

        def log_keys() -> list[str]:
            keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
            return [k for k in keys if k.split("/rollouts/gone/")[1].startswith("log/")]

        # No write path deletes a key; the refused marker stays, unused, until retire removes it.
        assert [k.split("/")[-2] for k in log_keys()] == ["call-2"]
        await store.retire(["gone"])
        assert log_keys() == []
    finally:
        await store.close()
