"""Shared pytest fixtures: local S3 servers (moto and SeaweedFS) and fresh buckets.

Fixtures:
    s3_server:  session-scoped, parametrized over ``moto`` and ``seaweedfs`` (test ids
                ``[moto]`` / ``[seaweedfs]``); a started :class:`LocalS3Server`, stopped at
                the end of the session (or when pytest moves on to the other parameter).
                Started lazily, only if a selected test uses it.
    s3_client:  session-scoped synchronous boto3 S3 client for ``s3_server`` (path-style
                addressing, standard retries).
    bucket_url: function-scoped ``"s3://<fresh bucket>/t"``; the bucket and everything in
                it are deleted afterwards (best effort, never fails the test).
    s3_env:     function-scoped; points the AWS SDK environment variables
                (AWS_ENDPOINT_URL, credentials, AWS_DEFAULT_REGION) at ``s3_server`` via
                ``monkeypatch`` and yields the server.

Set ``S3CAPTURE_TEST_SERVERS`` to a comma-separated subset (e.g. ``moto``) to run only
those servers; tests for the others are skipped.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from s3capture.localserver import LocalS3Server, start_moto, start_seaweedfs

SERVER_KINDS = ("moto", "seaweedfs")
_STARTERS = {"moto": start_moto, "seaweedfs": start_seaweedfs}
_SELECT_VAR = "S3CAPTURE_TEST_SERVERS"
# Environment variables that would make an AWS SDK ignore or override s3_server.env().
_CONFLICTING_ENV = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_USE_DUALSTACK_ENDPOINT",
    "AWS_USE_FIPS_ENDPOINT",
    "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT",
)

log = logging.getLogger(__name__)


def selected_servers() -> tuple[str, ...]:
    """Server kinds selected by ``S3CAPTURE_TEST_SERVERS`` (all when unset or empty)."""
    raw = os.environ.get(_SELECT_VAR, "").strip()
    if not raw:
        return SERVER_KINDS
    chosen = tuple(dict.fromkeys(p.strip().lower() for p in raw.split(",") if p.strip()))
    unknown = [k for k in chosen if k not in SERVER_KINDS]
    if unknown:
        raise pytest.UsageError(
            f"{_SELECT_VAR}={raw!r}: unknown server(s) {unknown}; choose from {list(SERVER_KINDS)}"
        )
    return chosen


def pytest_configure(config: pytest.Config) -> None:
    selected_servers()  # fail early on a typo in S3CAPTURE_TEST_SERVERS


def skip_unless_selected(kind: str) -> None:
    """``pytest.skip`` when ``kind`` is not in ``S3CAPTURE_TEST_SERVERS``."""
    if kind not in selected_servers():
        pytest.skip(f"{kind} server not selected ({_SELECT_VAR}={os.environ.get(_SELECT_VAR)!r})")


@pytest.fixture(scope="session", params=SERVER_KINDS, ids=SERVER_KINDS)
def s3_server(request: pytest.FixtureRequest) -> Iterator[LocalS3Server]:
    """A running local S3 server, one per kind for the whole session."""
    kind = request.param
    skip_unless_selected(kind)
    server = _STARTERS[kind]()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_client(s3_server: LocalS3Server) -> Iterator[Any]:
    """Synchronous boto3 S3 client for ``s3_server`` (path-style addressing)."""
    client = make_boto3_client(s3_server)
    try:
        yield client
    finally:
        client.close()


def make_boto3_client(server: LocalS3Server) -> Any:
    """A synchronous boto3 S3 client for ``server`` with path-style addressing."""
    import boto3
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path"},
        retries={"mode": "standard", "max_attempts": 3},
        connect_timeout=5,
        read_timeout=60,
        max_pool_connections=32,
    )
    return boto3.session.Session().client("s3", config=config, **server.client_kwargs())


@pytest.fixture
def bucket_url(s3_server: LocalS3Server, s3_client: Any) -> Iterator[str]:
    """``"s3://<fresh uniquely named bucket>/t"`` on ``s3_server``; removed afterwards."""
    if not s3_server.running:
        pytest.fail(f"{s3_server.kind} server is not running anymore; log tail:\n{s3_server.log_tail()}")
    bucket = f"s3capture-test-{uuid.uuid4().hex[:20]}"
    s3_client.create_bucket(Bucket=bucket)
    try:
        yield f"s3://{bucket}/t"
    finally:
        delete_bucket_quietly(s3_client, bucket)


def delete_bucket_quietly(client: Any, bucket: str) -> None:
    """Delete ``bucket`` and its objects and multipart uploads; log, never raise."""
    try:
        try:
            client.delete_bucket(Bucket=bucket)  # SeaweedFS deletes non-empty buckets
            return
        except client.exceptions.NoSuchBucket:
            return
        except client.exceptions.ClientError:
            pass  # BucketNotEmpty (moto, S3): empty it first
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for upload in page.get("Uploads", []):
                try:
                    client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                except client.exceptions.ClientError:
                    pass
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            for i in range(0, len(keys), 1000):  # SeaweedFS rejects more than 1,000 keys
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})
        client.delete_bucket(Bucket=bucket)
    except Exception as exc:  # best effort: never fail the test in teardown
        log.warning("could not delete test bucket %s: %s", bucket, exc)


@pytest.fixture
def s3_env(
    s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalS3Server]:
    """Point the AWS SDK environment at ``s3_server`` for one test; yields the server.

    Sets ``s3_server.env()``, removes variables that would override it (session token,
    profile, AWS_ENDPOINT_URL_S3, ...) and hides the user's ~/.aws files.
    """
    for name in _CONFLICTING_ENV:
        monkeypatch.delenv(name, raising=False)
    no_files = tmp_path_factory.getbasetemp() / "no-aws-config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(no_files / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(no_files / "credentials"))
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    yield s3_server


async def _client_factory(cls: type, bucket_url: str):
    """Yield ``make(url=..., **kwargs)`` building fresh ``cls`` clients; close them all afterwards.

    The clients share one ``aioboto3.Session`` (credentials and the loaded service model, ~80 ms to
    build) but each has its own HTTP client, caches and state, so cross-client visibility is real.
    """
    import aioboto3

    session = aioboto3.Session()
    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("session", session)
        client = cls(kwargs.pop("url", bucket_url), **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()


@pytest.fixture
async def fresh(s3_env: Any, bucket_url: str):
    """Factory of fresh ``S3TokenStore`` clients on the test bucket; all are closed afterwards."""
    from s3capture.store import S3TokenStore

    async for make in _client_factory(S3TokenStore, bucket_url):
        yield make


@pytest.fixture
async def ledgers(s3_env: Any, bucket_url: str):
    """Factory of fresh ``S3CaptureLedger`` clients on the test bucket; all are closed afterwards."""
    from s3capture.ledger import S3CaptureLedger

    async for make in _client_factory(S3CaptureLedger, bucket_url):
        yield make
