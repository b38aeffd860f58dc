"""Answers a store or a gateway may give that the two transports must read alike (a transport
breaker, 2026-12-03): throttling by 429 and 400 RequestTimeout, chunked answers without a
Content-Length, and a part answered to a GET of the whole object. Every test runs on both
transports, through FaultProxy in front of each test server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from faultproxy import Chunked, FaultProxy, Partial, Respond, s3_error
from helpers import list_keys, put_bytes, simple_entry, split_bucket_url
from s3capture.records import RecordError
from s3capture.store import StoreError

pytestmark = pytest.mark.all_transports  # every test runs on aioboto3 and obstore (tests/conftest.py)


def _kind(request: Any) -> str:
    if request.is_list:
        return "LIST"
    return "DeleteObjects" if request.method == "POST" else request.method


@pytest.mark.parametrize(
    "status, code",
    [
        (429, "TooManyRequests"),
        (429, "RateLimitExceeded"),  # a code of no RETRY_CODES: retried for its status alone (a test audit)
        (400, "RequestTimeout"),
        (400, "SlowDown"),
        (400, "InternalError"),
    ],
)
async def test_throttling_and_request_timeouts_are_retried_by_every_operation(
    s3_server: Any, fresh: Any, status: int, code: str
) -> None:
    # aioboto3 did not retry a 429 with a code botocore does not know (GCS's XML API answers one
    # for a rate limit), the obstore transport's LIST and DeleteObjects did not retry a 429, and
    # its PUT and GET did not retry S3's 400 RequestTimeout: one such answer failed a put, a
    # freeze or a retire on one transport that the other rode out. A review of the fix: obstore's
    # PUT and GET retried only RequestTimeout of the 4xx answers that carry a RETRY_CODES code.
    await fresh().put(simple_entry("r-throttled", "c0"))
    proxy = await FaultProxy(s3_server.port).start()
    answered: list[str] = []

    async def rule(request: Any) -> Any:
        kind = _kind(request)
        if kind not in answered:  # the first request of each kind
            answered.append(kind)
            return s3_error(status, code, "injected", "Too Many Requests" if status == 429 else "Bad Request")
        return None

    proxy.rule = rule
    try:
        store = fresh(endpoint_url=proxy.endpoint)
        await store.put(simple_entry("r-throttled", "c1"))
        snapshot = await store.freeze("r-throttled")
        assert sorted(e.model_call_id for e in snapshot.entries) == ["c0", "c1"] and not snapshot.incomplete
        assert await store.retire(["r-throttled"]) == {"removed": ["r-throttled"], "absent": []}
        assert {"PUT", "GET", "LIST", "DeleteObjects"} <= set(answered), answered
    finally:
        await proxy.stop()


async def test_a_chunked_answer_is_read_but_never_past_the_read_limit(
    s3_server: Any, s3_client: Any, bucket_url: str, fresh: Any, transport_kind: str
) -> None:
    # A GET answered without a Content-Length (Transfer-Encoding: chunked, from a gateway or a
    # compressing proxy) passed aioboto3's read limit as "0 bytes": a put on a rollout whose fence
    # was a 32 MiB foreign object read all of it into memory on every write.
    bucket, root = split_bucket_url(bucket_url)
    small, big = f"{root}chunked/small", f"{root}chunked/big"
    put_bytes(s3_client, bucket, small, b"s" * 5000)
    put_bytes(s3_client, bucket, big, b"b" * (4 << 20))
    proxy = await FaultProxy(s3_server.port).start()
    proxy.rule = lambda request: asyncio.sleep(0, None if request.is_list else Chunked())
    try:
        transport = fresh(endpoint_url=proxy.endpoint).transport
        if transport_kind == "aioboto3":
            assert await transport.get(small, limit=64 << 10) == b"s" * 5000
            assert await transport.get(big) == b"b" * (4 << 20)
            with pytest.raises(RecordError, match="over the read limit 65536"):
                await transport.get(big, limit=64 << 10)
        else:  # object_store refuses an answer without a Content-Length: say so, and what to use
            with pytest.raises(StoreError, match="without a Content-Length.*transport='aioboto3'"):
                await transport.get(small, limit=64 << 10)
    finally:
        await proxy.stop()


async def test_a_part_answered_to_a_whole_get_never_becomes_an_entry(
    s3_server: Any, fresh: Any, transport_kind: str
) -> None:
    # A 206 with a Content-Range of 5 bytes of 11 was taken as the whole object. aioboto3 now reads
    # again and fails; object_store reports no Content-Range, and the entry's SHA-256 refuses
    # the part: either way no freeze hands out a snapshot with it as trainable.
    entry = simple_entry("r-partial", "c1")
    await fresh().put(entry)
    proxy = await FaultProxy(s3_server.port).start()

    def entry_gets() -> int:
        return sum(1 for r in proxy.requests if r.method == "GET" and "/log/e/" in r.path)

    async def rule(request: Any) -> Any:
        return Partial(20) if request.method == "GET" and "/log/e/" in request.path else None

    proxy.rule = rule
    try:
        if transport_kind == "aioboto3":  # the transport's own check, not the entry's digest (a test audit)
            with pytest.raises(StoreError, match="answered only a part"):
                await fresh(endpoint_url=proxy.endpoint).freeze("r-partial")
            assert entry_gets() > 1  # read again before it is refused
        else:
            snapshot = await fresh(endpoint_url=proxy.endpoint).freeze("r-partial")
            assert snapshot.incomplete and snapshot.entries == (), snapshot
    finally:
        await proxy.stop()


async def test_a_retryable_per_key_error_of_deleteobjects_is_retried_by_a_single_delete(
    s3_server: Any, s3_client: Any, bucket_url: str, fresh: Any
) -> None:
    # A 200 DeleteObjects answer reporting InternalError for a key (AWS: retry such keys) raised
    # StoreError at once on both transports; such a key now goes out as a single DELETE.
    bucket, root = split_bucket_url(bucket_url)
    keys = [f"{root}per-key/{name}" for name in ("a", "b")]
    for key in keys:
        put_bytes(s3_client, bucket, key, b"x")
    result = "".join(
        f"<Error><Key>{key}</Key><Code>InternalError</Code><Message>Please try again.</Message></Error>" for key in keys
    )
    body = f'<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{result}</DeleteResult>'.encode()
    proxy = await FaultProxy(s3_server.port).start()
    proxy.rule = lambda request: asyncio.sleep(0, Respond(200, body) if request.method == "POST" else None)
    try:
        await fresh(endpoint_url=proxy.endpoint).transport.delete(keys)
        assert [r.method for r in proxy.requests].count("DELETE") == 2
        assert list_keys(s3_client, bucket, f"{root}per-key/") == []
    finally:
        await proxy.stop()


async def test_a_whole_object_with_a_content_range_is_read(s3_server: Any, fresh: Any) -> None:
    # A review of the 206 check: some gateways send a Content-Range covering the whole object with
    # a 200; refusing it failed every read through them.
    entry = simple_entry("r-ranged", "c1")
    await fresh().put(entry)
    proxy = await FaultProxy(s3_server.port).start()
    proxy.rule = lambda request: asyncio.sleep(
        0, Partial(None) if request.method == "GET" and not request.is_list else None
    )
    try:
        snapshot = await fresh(endpoint_url=proxy.endpoint).freeze("r-ranged")
        assert [e.model_call_id for e in snapshot.entries] == ["c1"] and not snapshot.incomplete
    finally:
        await proxy.stop()


async def test_a_list_answered_with_a_part_is_listed_again(s3_server: Any, fresh: Any) -> None:
    # A 206 with the first 10 bytes of a LIST's answer (a range nobody asked for) failed a freeze
    # with StoreError on obstore, while aioboto3 read the listing again (a resolve breaker,
    # 2026-12-03). Both now read it again.
    store = fresh()
    await store.put(simple_entry("r-list-part", "c0"))
    await store.put(simple_entry("r-list-part", "c1"))
    proxy = await FaultProxy(s3_server.port).start()
    parted: list[str] = []

    async def rule(request: Any) -> Any:
        if request.is_list and not parted:
            parted.append(request.path)
            return Partial(10)
        return None

    proxy.rule = rule
    try:
        snapshot = await fresh(endpoint_url=proxy.endpoint).freeze("r-list-part")
        assert parted, "no LIST went through the proxy"
        assert sorted(e.model_call_id for e in snapshot.entries) == ["c0", "c1"] and not snapshot.incomplete
    finally:
        await proxy.stop()


async def test_a_bulk_delete_answered_with_a_part_is_sent_again(
    s3_server: Any, s3_client: Any, bucket_url: str, fresh: Any
) -> None:
    # The DeleteObjects side of the 206 resend above (a review): the answer's first 10 bytes, as
    # a 206, to a request that asked for no range. The keys must all be gone afterwards.
    bucket, root = split_bucket_url(bucket_url)
    keys = [f"{root}part-delete/{name}" for name in ("a", "b", "c")]
    for key in keys:
        put_bytes(s3_client, bucket, key, b"x")
    proxy = await FaultProxy(s3_server.port).start()
    parted: list[str] = []

    async def rule(request: Any) -> Any:
        if request.method == "POST" and not parted:
            parted.append(request.path)
            return Partial(10)
        return None

    proxy.rule = rule
    try:
        await fresh(endpoint_url=proxy.endpoint).transport.delete(keys)
        assert parted, "no DeleteObjects went through the proxy"
        assert list_keys(s3_client, bucket, f"{root}part-delete/") == []
    finally:
        await proxy.stop()


async def test_a_put_answered_200_without_an_etag_is_not_acknowledged(
    s3_server: Any, fresh: Any, ledgers: Any, s3_client: Any, bucket_url: str
) -> None:
    # A ledger breaker (2026-12-04): something in between answered a PUT 200 with an empty body
    # and never forwarded it. On aioboto3 `record` returned and the row was never stored, and
    # `retire` deleted the rows under a tombstone that did not exist (the ledger then read as
    # live and empty); object_store refused the answer. Both transports now fail the PUT.
    from helpers import assistant_output, make_commit, user

    proxy = await FaultProxy(s3_server.port).start()

    async def rule(request: Any) -> Any:
        faked = ("/ledger/row/", "/log/e/", "/rollouts/r2/retired")
        return Respond(200, b"") if request.method == "PUT" and any(f in request.path for f in faked) else None

    proxy.rule = rule
    bucket, root = split_bucket_url(bucket_url)
    try:
        commit = make_commit("r", "c1", [user("hi")], assistant_output("a"))
        with pytest.raises(StoreError):
            await ledgers(endpoint_url=proxy.endpoint).record(commit)
        with pytest.raises(StoreError):
            await fresh(endpoint_url=proxy.endpoint).put(simple_entry("r1", "c1"))
        # retire: its tombstone PUT is faked; it must not go on to delete the rows.
        writer = ledgers()
        await writer.record(make_commit("r2", "c1", [user("hi")], assistant_output("a")))
        with pytest.raises(StoreError):
            await ledgers(endpoint_url=proxy.endpoint).retire(["r2"])
        assert (await ledgers().manifest("r2"))["records"][0]["model_call_id"] == "c1"
    finally:
        await proxy.stop()
    keys = list_keys(s3_client, bucket, root)
    assert not [k for k in keys if "/rollouts/r/ledger/row/" in k or "/rollouts/r1/log/e/" in k]  # never stored
