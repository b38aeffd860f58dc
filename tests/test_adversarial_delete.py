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


@pytest.mark.all_transports
@pytest.mark.parametrize("body", [b"", b"<html><body>OK</body></html>"], ids=["empty", "html"])
async def test_a_200_delete_objects_answer_that_is_no_result_deletes_nothing_silently(
    s3_server, fresh, s3_client, bucket_url, body
):
    """A 200 answer to DeleteObjects that is not a DeleteResult (an empty body, a proxy's HTML
    page) confirms no key: every key of the batch is then deleted with a single DELETE, whose
    answer is unambiguous. The aioboto3 transport used to take such an answer for success and
    report the rollout removed while its objects stayed (a breaker, 2026-12-02): a reusing attempt's
    freeze then held the deleted attempt's entries."""

    async def rule(request: Any) -> Any:
        if _is_delete_objects(request):
            return Respond(200, body, "OK", content_type="text/html" if body else "application/xml")
        return None

    proxy, store = await _setup(s3_server, fresh, rule)
    try:
        await _fill(store, "r-200", 3)
        assert (await store.delete(["r-200"]))["removed"] == ["r-200"]
        assert _left(s3_client, bucket_url, "r-200") == []
        assert sum(1 for r in proxy.requests if r.method == "DELETE") >= 3
        await store.put(simple_entry("r-200", "new"))
        snapshot = await fresh().freeze("r-200")
        assert [e.model_call_id for e in snapshot.entries] == ["new"]
    finally:
        await proxy.stop()


@pytest.mark.all_transports
async def test_a_transient_400_to_delete_objects_is_not_remembered(s3_server, fresh, s3_client, bucket_url):
    """One 400 MalformedXML sends that batch as single DELETEs; the next delete tries DeleteObjects
    again (only NotImplemented / MethodNotAllowed mean the store has none)."""
    seen = {"n": 0}

    async def rule(request: Any) -> Any:
        if _is_delete_objects(request):
            seen["n"] += 1
            if seen["n"] == 1:
                return Respond(400, not_implemented_xml("MalformedXML", "once"), "Bad Request")
        return None

    proxy, store = await _setup(s3_server, fresh, rule)
    try:
        await _fill(store, "r-400a", 3)
        await _fill(store, "r-400b", 3)
        assert (await store.retire(["r-400a"]))["removed"] == ["r-400a"]
        assert (await store.retire(["r-400b"]))["removed"] == ["r-400b"]
        for rid in ("r-400a", "r-400b"):
            assert sorted(k.rsplit("/", 1)[-1] for k in _left(s3_client, bucket_url, rid)) == ["fence", "retired"]
        assert seen["n"] == 2  # the second retire used DeleteObjects again
    finally:
        await proxy.stop()


@pytest.mark.all_transports
async def test_delete_objects_deletes_a_key_with_a_carriage_return_and_not_its_neighbour(
    s3_server, fresh, s3_client, bucket_url
):
    """Keys travel in the XML body of DeleteObjects, where a raw ``\\r`` is read as ``\\n``: the
    obstore transport's own body deleted ``note\\n`` when asked for ``note\\r`` (SeaweedFS, Ceph; a
    breaker, 2026-12-02). Such keys are never s3capture's; a foreign object can have one."""
    if s3_server.kind == "moto":
        pytest.skip("moto cannot store a key with a carriage return (its PUT answers 404)")
    store = fresh()
    bucket, root = split_bucket_url(bucket_url)
    from s3capture.layout import Layout

    prefix = Layout(root.rstrip("/")).rollout("r-cr")
    s3_client.put_object(Bucket=bucket, Key=prefix + "note\r", Body=b"cr")
    s3_client.put_object(Bucket=bucket, Key=prefix + "note\n", Body=b"lf")
    await store.transport.delete([prefix + "note\r", prefix + "absent"])
    left = list_keys(s3_client, bucket, prefix)
    assert prefix + "note\n" in left, left  # never another key
    assert prefix + "note\r" not in left, left


def _access_denied() -> Respond:
    return Respond(403, not_implemented_xml("AccessDenied", "Access Denied"), "Forbidden")


@pytest.mark.all_transports
async def test_a_delete_objects_refused_for_access_but_not_its_deletes_falls_back_and_remembers(
    s3_server, fresh, s3_client, bucket_url, caplog, monkeypatch
):
    """The Ceph gateway checks ``s3:DeleteObject`` of a DeleteObjects request against the bucket's
    ARN, so the builder role of docs/permissions.md (DeleteObject on the root's keys) was refused
    every batch, while a single DELETE of the same key was allowed: drop, retire, delete and gc
    failed after writing their tombstone (a Ceph breaker, 2026-12-03). The batch now goes out as
    single DELETEs, and the transport remembers it after they succeed."""

    async def rule(request: Any) -> Any:
        return _access_denied() if _is_delete_objects(request) else None

    proxy, store = await _setup(s3_server, fresh, rule)
    try:
        for rid in ("r-403a", "r-403b"):
            await _fill(store, rid, 3)
            snapshot = await store.freeze(rid)
            with caplog.at_level("WARNING", logger="s3capture"):
                assert await store.drop(rid, snapshot.snapshot_id, snapshot.version)
            assert sorted(k.rsplit("/", 1)[-1] for k in _left(s3_client, bucket_url, rid)) == ["fence", "retired"]
        assert sum(1 for r in proxy.requests if _is_delete_objects(r)) == 1  # remembered after the first
        assert sum("AccessDenied" in m and "one DELETE per key" in m for m in caplog.messages) == 1
        # ... for BULK_DENIED_SECONDS: credentials or the policy may change, so it is tried again
        monkeypatch.setattr(store.transport, "_bulk_denied_until", 0.0)
        await _fill(store, "r-403c", 3)
        assert (await store.delete(["r-403c"]))["removed"] == ["r-403c"]
        assert sum(1 for r in proxy.requests if _is_delete_objects(r)) == 2
        assert sum("AccessDenied" in m and "one DELETE per key" in m for m in caplog.messages) == 1  # said once
    finally:
        await proxy.stop()


@pytest.mark.all_transports
async def test_deletes_refused_for_access_raise_and_leave_the_entries(s3_server, fresh, s3_client, bucket_url):
    """A role without DeleteObject at all: the drop raises a StoreError naming AccessDenied after
    one DeleteObjects and one DELETE, the
    entries stay (the rollout reads as retired by its tombstone), and nothing is remembered: the
    retire that finishes the drop's deletes tries DeleteObjects again (permissions may have been
    granted meanwhile)."""

    async def rule(request: Any) -> Any:
        return _access_denied() if _is_delete_objects(request) or request.method == "DELETE" else None

    proxy, store = await _setup(
        s3_server, fresh, rule, botocore_config=default_botocore_config(8, retries={"max_attempts": 1})
    )
    try:
        await _fill(store, "r-deny", 3)
        snapshot = await store.freeze("r-deny")
        with pytest.raises(StoreError, match="AccessDenied"):
            await store.drop("r-deny", snapshot.snapshot_id, snapshot.version)
        assert sum(1 for r in proxy.requests if _is_delete_objects(r)) == 1
        # one key's DELETE tells: not a DELETE per key, each refused (a review, 2026-12-03)
        assert sum(1 for r in proxy.requests if r.method == "DELETE") == 1
        with pytest.raises(StoreError, match="AccessDenied"):
            await store.retire(["r-deny"])  # finishes a failed drop's deletes: refused again
        assert sum(1 for r in proxy.requests if _is_delete_objects(r)) == 2  # not remembered
        assert sum(1 for r in proxy.requests if r.method == "DELETE") == 2
        left = sorted(k.rsplit("/", 1)[-1] for k in _left(s3_client, bucket_url, "r-deny"))
        assert len([k for k in left if k.endswith(".zst")]) >= 3, left
    finally:
        await proxy.stop()
