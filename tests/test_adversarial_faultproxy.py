"""Self-tests of the fault-injecting proxy (``tests/faultproxy.py``), one per action.

Each test drives the proxy with a plain boto3 client (no retries) in a worker thread, so what it
checks is the proxy's behaviour on the wire, not s3capture's. The names below are re-exported for
the tests that imported them from here before the proxy had its own module.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from typing import Any

import pytest

from faultproxy import (  # noqa: F401 - re-exported
    ApplyLate,
    CutBody,
    DropResponse,
    FaultProxy,
    ListEmpty,
    ListHideYoung,
    ListNoToken,
    ListPaged,
    ListSiblings,
    ListSkip,
    Request,
    Respond,
    ShortBody,
    Truncate,
    Twice,
    internal_error,
    not_implemented_xml,
    once,
    s3_error,
    slow_down,
)


def _client(proxy: FaultProxy, server: Any, key: str | None = None) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=proxy.endpoint,
        aws_access_key_id=key or server.access_key,
        aws_secret_access_key=server.secret_key if key is None else "some-secret",
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            retries={"mode": "standard", "total_max_attempts": 1},
            read_timeout=5,
            response_checksum_validation="when_required",
            request_checksum_calculation="when_required",
        ),
    )


@pytest.fixture
async def wire(s3_server, bucket_url):
    """(proxy, boto3 client through it, bucket)."""
    proxy = await FaultProxy.for_server(s3_server).start()
    client = _client(proxy, s3_server)
    try:
        yield proxy, client, bucket_url[len("s3://") :].split("/")[0]
    finally:
        client.close()
        await proxy.stop()


def _client_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


# What boto3 raises for a broken exchange: an error answer (ClientError) or a connection, timeout or
# body error (BotoCoreError); anything else (a TypeError, say) is a bug, not the fault injected.
_CLIENT_ERRORS = _client_errors()


def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return asyncio.to_thread(fn, *args, **kwargs)


async def _keys(client: Any, bucket: str, prefix: str = "", **kwargs: Any) -> list[str]:
    page = await _run(client.list_objects_v2, Bucket=bucket, Prefix=prefix, **kwargs)
    return [item["Key"] for item in page.get("Contents", [])]


async def test_fault_proxy_forwards_faithfully(s3_server, fresh, bucket_url):
    """The proxy itself is transparent when no rule fires (so findings are not proxy artefacts)."""
    from helpers import simple_entry

    proxy = await FaultProxy(s3_server.port).start()
    try:
        store = fresh(endpoint_url=proxy.endpoint)
        await store.put(simple_entry("r-proxy", "c1"))
        snapshot = await store.freeze("r-proxy")
        assert not snapshot.incomplete and len(snapshot.entries) == 1
        assert await fresh(endpoint_url=proxy.endpoint, fence_grace=0.0).drop(
            "r-proxy", snapshot.snapshot_id, snapshot.version
        ) in (True, False)
        assert any(m == "PUT" for m, _, _ in proxy.seen)
    finally:
        await proxy.stop()


@pytest.mark.parametrize("answer", [slow_down, internal_error])
async def test_fail_before_applying(wire, answer):
    from botocore.exceptions import ClientError

    proxy, client, bucket = wire
    proxy.rule = once(lambda r: r.method == "PUT", answer())
    with pytest.raises(ClientError) as caught:
        await _run(client.put_object, Bucket=bucket, Key="k", Body=b"x")
    assert caught.value.response["Error"]["Code"] in ("SlowDown", "InternalError")
    assert await _keys(client, bucket) == []


async def test_lost_ack_is_applied(wire):
    proxy, client, bucket = wire
    proxy.rule = once(lambda r: r.method == "PUT", DropResponse())
    with pytest.raises(_CLIENT_ERRORS):
        await _run(client.put_object, Bucket=bucket, Key="k", Body=b"x")
    assert await _keys(client, bucket) == ["k"]


async def test_apply_late_lands_after_the_client_gave_up(wire):
    proxy, client, bucket = wire
    proxy.rule = once(lambda r: r.method == "PUT", ApplyLate(0.5))
    with pytest.raises(_CLIENT_ERRORS):
        await _run(client.put_object, Bucket=bucket, Key="k", Body=b"x")
    assert await _keys(client, bucket) == []
    await asyncio.sleep(0.8)
    assert await _keys(client, bucket) == ["k"]


async def test_twice_delivers_two_requests(wire):
    proxy, client, bucket = wire
    proxy.rule = once(lambda r: r.method == "PUT", Twice())
    before = proxy.forward_count
    await _run(client.put_object, Bucket=bucket, Key="k", Body=b"x")
    assert proxy.forward_count - before == 2


async def test_truncate_never_applies(wire):
    proxy, client, bucket = wire
    proxy.rule = once(lambda r: r.method == "PUT", Truncate(0.5))
    with pytest.raises(_CLIENT_ERRORS):
        await _run(client.put_object, Bucket=bucket, Key="k", Body=b"x" * 1000)
    await asyncio.sleep(0.1)
    assert await _keys(client, bucket) == []


async def test_cut_and_short_bodies(wire):
    proxy, client, bucket = wire
    await _run(client.put_object, Bucket=bucket, Key="k", Body=b"y" * 1000)

    def read() -> bytes:
        return client.get_object(Bucket=bucket, Key="k")["Body"].read()

    proxy.rule = once(lambda r: r.method == "GET", CutBody(0.5))
    with pytest.raises(_CLIENT_ERRORS):
        await _run(read)
    proxy.rule = once(lambda r: r.method == "GET", ShortBody(0.5))
    assert await _run(read) == b"y" * 500  # well-formed and short: no error at all
    assert await _run(read) == b"y" * 1000


async def test_list_actions(wire):
    proxy, client, bucket = wire
    for key in ("r1/a", "r1/b", "r1/c", "r1000/z"):
        await _run(client.put_object, Bucket=bucket, Key=key, Body=b"")
    lists = lambda r: r.is_list  # noqa: E731
    proxy.rule = once(lists, ListEmpty())
    page = await _run(client.list_objects_v2, Bucket=bucket, Prefix="r1/")
    assert "IsTruncated" not in page and "Contents" not in page
    proxy.rule = once(lists, ListSiblings())
    assert await _keys(client, bucket, "r1/") == ["r1/a", "r1/b", "r1/c", "r1000/z"]
    proxy.rule = once(lists, ListSkip())
    assert await _keys(client, bucket, "r1/") == ["r1/a", "r1/b"]
    proxy.rule = once(lists, ListNoToken())
    page = await _run(client.list_objects_v2, Bucket=bucket, Prefix="r1/", MaxKeys=1)
    assert page["IsTruncated"] and "NextContinuationToken" not in page
    proxy.rule = once(lists, ListPaged(2, repeat=True), times=2)
    pages = await _run(lambda: list(client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="r1/")))
    assert [i["Key"] for p in pages for i in p["Contents"]] == ["r1/a", "r1/b", "r1/b", "r1/c"]
    proxy.rule = None
    await asyncio.sleep(0.5)
    await _run(client.put_object, Bucket=bucket, Key="r1/d", Body=b"")
    proxy.rule = once(lists, ListHideYoung(400))
    assert await _keys(client, bucket, "r1/") == ["r1/a", "r1/b", "r1/c"]
    await asyncio.sleep(0.5)
    proxy.rule = once(lists, ListHideYoung(400))
    assert await _keys(client, bucket, "r1/") == ["r1/a", "r1/b", "r1/c", "r1/d"]


async def test_date_skew(wire):
    proxy, client, bucket = wire
    proxy.date_skew = 20
    page = await _run(client.list_objects_v2, Bucket=bucket)
    date = email.utils.parsedate_to_datetime(page["ResponseMetadata"]["HTTPHeaders"]["date"]).timestamp()
    assert 17 < date - time.time() < 23


async def test_expired_token_for_an_old_key_and_any_new_key_works(wire, s3_server):
    from botocore.exceptions import ClientError

    proxy, _, bucket = wire
    proxy.expired_keys = {"OLDKEY"}
    old, new = _client(proxy, s3_server, "OLDKEY"), _client(proxy, s3_server, "NEWKEY")
    with pytest.raises(ClientError) as caught:
        await _run(old.list_objects_v2, Bucket=bucket)
    assert caught.value.response["Error"]["Code"] == "ExpiredToken"
    await _run(new.put_object, Bucket=bucket, Key="k", Body=b"x")  # signed again with the server's key
    assert await _keys(new, bucket) == ["k"]
