"""Adversarial: retire/delete on stores that lack or reject DeleteObjects, lost responses, retries.

Faults are injected on the wire by ``FaultProxy`` in front of the real test server.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import list_keys, simple_entry, split_bucket_url
from test_adversarial_faultproxy import (
    DropResponse,
    FaultProxy,
    Respond,
    not_implemented_xml,
)

from s3capture.store import StoreError, default_botocore_config


def _is_delete_objects(request: Any) -> bool:
    return request.method == "POST" and "delete" in request.query.split("&")


async def _setup(s3_server: Any, fresh: Any, rule: Any, **kwargs: Any) -> tuple[FaultProxy, Any]:
    proxy = await FaultProxy(s3_server.port).start()
    proxy.rule = rule
    return proxy, fresh(endpoint_url=proxy.endpoint, **kwargs)


async def _fill(store: Any, rollout_id: str, n: int = 5) -> None:
    for i in range(n):
        await store.put(simple_entry(rollout_id, f"c{i}", text=f"t{i}"))


def _left(s3_client: Any, bucket_url: str, rollout_id: str) -> list[str]:
    bucket, root = split_bucket_url(bucket_url)
    from s3capture.layout import Layout

    return list_keys(s3_client, bucket, Layout(root.rstrip("/")).rollout(rollout_id))


@pytest.mark.all_transports
async def test_delete_objects_not_implemented_falls_back_to_single_deletes(s3_server, fresh, s3_client, bucket_url):
    """Holds: a store answering 501 NotImplemented to POST ?delete (GCS XML API) still retires and
    deletes, on both transports: one DeleteObjects is tried, never retried (a 501 is no transient
    error), and after it the transport sends single DELETEs only. (The obstore transport retried
    the 501 for object_store's whole backoff, then failed: its delete of one key is a DeleteObjects
    too. Found by a breaker session, 2026-12-02.)"""

    async def rule(request: Any) -> Any:
        if _is_delete_objects(request):
            return Respond(501, not_implemented_xml(), "Not Implemented")
        return None

    proxy, store = await _setup(s3_server, fresh, rule)
    try:
        await _fill(store, "r-501")
        assert (await store.retire(["r-501"]))["removed"] == ["r-501"]
        assert sorted(k.rsplit("/", 1)[-1] for k in _left(s3_client, bucket_url, "r-501")) == ["fence", "retired"]
        await _fill(store, "r-501b")
        assert (await store.retire(["r-501b"]))["removed"] == ["r-501b"]
        assert (await store.delete(["r-501", "r-501b"]))["removed"] == ["r-501", "r-501b"]
        assert _left(s3_client, bucket_url, "r-501") == []
        assert _left(s3_client, bucket_url, "r-501b") == []
        assert sum(1 for r in proxy.requests if _is_delete_objects(r)) == 1
        assert sum(1 for r in proxy.requests if r.method == "DELETE") == 5 + 5 + 4  # records, then fences
    finally:
        await proxy.stop()


# Regression test (found by the adversarial review, fixed in 0d86cd4): DeleteObjects is sent with a CRC32
# checksum and no Content-MD5; stores that require Content-MD5 (MinIO/Ceph/OneFS-era servers, see botocore
# 1.36 regressions) answer 400 MissingContentMD5, which is not treated as 'unsupported', so retire/drop/delete
# fail outright
async def test_retire_works_on_a_store_that_requires_content_md5_for_delete_objects(
    s3_server, fresh, s3_client, bucket_url
):
    async def rule(request: Any) -> Any:
        if _is_delete_objects(request) and "content-md5" not in request.headers:
            return Respond(
                400,
                not_implemented_xml("MissingContentMD5", "Missing required header for this request: Content-Md5."),
                "Bad Request",
            )
        return None

    proxy, store = await _setup(s3_server, fresh, rule)
    try:
        await _fill(store, "r-md5")
        try:
            result = await store.retire(["r-md5"])
        except StoreError as error:
            pytest.fail(f"retire failed on a Content-MD5 store: {error}")
        assert result["removed"] == ["r-md5"]
        assert sorted(k.rsplit("/", 1)[-1] for k in _left(s3_client, bucket_url, "r-md5")) == ["fence", "retired"]
    finally:
        await proxy.stop()


async def test_lost_delete_objects_response_is_retried_and_retire_is_idempotent(
    s3_server, fresh, s3_client, bucket_url
):
    """Holds: the first DeleteObjects executes but its response is lost; botocore retries it."""
    lost = {"n": 0}

    async def rule(request: Any) -> Any:
        if _is_delete_objects(request) and lost["n"] == 0:
            lost["n"] += 1
            return DropResponse()
        return None

    proxy, store = await _setup(s3_server, fresh, rule)
    try:
        await _fill(store, "r-lost")
        assert (await store.retire(["r-lost"]))["removed"] == ["r-lost"]
        assert lost["n"] == 1
        assert sorted(k.rsplit("/", 1)[-1] for k in _left(s3_client, bucket_url, "r-lost")) == ["fence", "retired"]
        assert await store.retire(["r-lost"]) == {"removed": [], "absent": ["r-lost"]}
    finally:
        await proxy.stop()


async def test_retire_that_failed_mid_way_is_finished_by_a_retry(s3_server, fresh, s3_client, bucket_url):
    """Holds: DeleteObjects fails (500, no retries) after the fence and tombstone were written;
    writes are already refused, and a second retire removes the records."""
    broken = {"on": True}

    async def rule(request: Any) -> Any:
        if _is_delete_objects(request) and broken["on"]:
            return Respond(500, not_implemented_xml("InternalError", "boom"), "Internal Server Error")
        return None

    config = default_botocore_config(
        16, retries={"mode": "standard", "max_attempts": 1}, s3={"addressing_style": "path"}
    )
    proxy, store = await _setup(s3_server, fresh, rule, botocore_config=config)
    try:
        await _fill(store, "r-half")
        with pytest.raises(StoreError):
            await store.retire(["r-half"])
        from s3capture.protocols import TokenCaptureRetiredError

        with pytest.raises(TokenCaptureRetiredError):
            await fresh().put(simple_entry("r-half", "late"))
        broken["on"] = False
        assert (await store.retire(["r-half"]))["removed"] == ["r-half"]
        assert sorted(k.rsplit("/", 1)[-1] for k in _left(s3_client, bucket_url, "r-half")) == ["fence", "retired"]
    finally:
        await proxy.stop()
