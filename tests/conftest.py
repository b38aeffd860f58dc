"""Shared pytest fixtures: S3 servers (moto, SeaweedFS, Ceph RGW, or your own) and fresh buckets.

Fixtures:
    s3_server:  session-scoped, parametrized over ``moto``, ``seaweedfs`` and ``ceph`` (test ids
                ``[moto]`` / ``[seaweedfs]`` / ``[ceph]``, plus ``[external]`` when selected); a
                started :class:`LocalS3Server`, stopped at the end of the session (or when pytest
                moves on to the next parameter). Started lazily, only if a selected test uses it.
    s3_client:  session-scoped synchronous boto3 S3 client for ``s3_server`` (path-style
                addressing, standard retries).
    bucket_url: function-scoped ``"s3://<fresh bucket>/t"``; the bucket and everything in
                it are deleted afterwards (best effort, never fails the test).
    s3_env:     function-scoped; points the AWS SDK environment variables
                (AWS_ENDPOINT_URL, credentials, AWS_DEFAULT_REGION) at ``s3_server`` via
                ``monkeypatch`` and yields the server.

Choosing servers: ``S3CAPTURE_TEST_SERVERS`` is a comma-separated list of ``moto``,
``seaweedfs``, ``ceph`` and ``external`` (unset or empty: the three local servers); tests for the
others are skipped. ``external`` is an S3 endpoint you run yourself, described by
``S3CAPTURE_TEST_ENDPOINT`` (e.g. ``http://127.0.0.1:9000``) and the usual ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` (optional ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``); the tests
create and delete buckets named ``s3capture-test-*`` there. See docs/testing.md.

Choosing transports: tests marked ``pytest.mark.all_transports`` (docs/testing.md lists them:
conformance, Gym's conformance, request budgets, fault injection, the model test, ...) run once
per transport selected by
``S3CAPTURE_TEST_TRANSPORTS`` (``aioboto3,obstore`` when unset; test ids ``[...-obstore]``); the
autouse ``transport_kind`` fixture sets ``S3CAPTURE_TRANSPORT`` for them, so every store a test
builds uses that transport. Other tests use ``S3CAPTURE_TRANSPORT`` (``aioboto3`` when unset).

A selected server whose software is missing (e.g. no Ceph packages on a laptop) is skipped with a
one-line reason; under ``CI`` (``CI=true``) it fails instead, as does a server that cannot start.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from gymcompat import running_under_ci
from s3capture.localserver import LocalS3Server, ServerUnavailable, start_ceph_rgw, start_moto, start_seaweedfs

#: The local servers the suite starts itself (all of them when S3CAPTURE_TEST_SERVERS is unset).
SERVER_KINDS = ("moto", "seaweedfs", "ceph")
#: The user's own endpoint: only when named in S3CAPTURE_TEST_SERVERS.
EXTERNAL = "external"
_STARTERS = {"moto": start_moto, "seaweedfs": start_seaweedfs, "ceph": start_ceph_rgw}
_SELECT_VAR = "S3CAPTURE_TEST_SERVERS"
_ENDPOINT_VAR = "S3CAPTURE_TEST_ENDPOINT"
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
    """Server kinds selected by ``S3CAPTURE_TEST_SERVERS`` (the local three when unset or empty)."""
    raw = os.environ.get(_SELECT_VAR, "").strip()
    if not raw:
        return SERVER_KINDS
    chosen = tuple(dict.fromkeys(p.strip().lower() for p in raw.split(",") if p.strip()))
    unknown = [k for k in chosen if k not in (*SERVER_KINDS, EXTERNAL)]
    if unknown:
        raise pytest.UsageError(
            f"{_SELECT_VAR}={raw!r}: unknown server(s) {unknown}; choose from {[*SERVER_KINDS, EXTERNAL]}"
        )
    return chosen


class ExternalS3Server:
    """Your own S3 endpoint in the place of a :class:`LocalS3Server` (``S3CAPTURE_TEST_SERVERS=external``).

    Same interface as far as the tests use it; :meth:`stop` does nothing and :meth:`reset`
    refuses (the suite never wipes a store it did not start). Read from ``S3CAPTURE_TEST_ENDPOINT``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, optional ``AWS_SESSION_TOKEN`` and
    ``AWS_DEFAULT_REGION`` (or ``AWS_REGION``; default ``us-east-1``).
    """

    kind = EXTERNAL
    data_dir = None
    pid = None
    startup_seconds = 0.0
    running = True

    def __init__(
        self, endpoint_url: str, access_key: str, secret_key: str, region: str, session_token: str | None
    ) -> None:
        self.endpoint_url = endpoint_url.rstrip("/")
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.session_token = session_token

    @classmethod
    def from_env(cls) -> "ExternalS3Server":
        """Build it from the environment; ``pytest.UsageError`` naming what is missing."""
        endpoint = os.environ.get(_ENDPOINT_VAR, "").strip()
        missing = [
            name
            for name, value in ((_ENDPOINT_VAR, endpoint), *((n, os.environ.get(n)) for n in _EXTERNAL_KEYS))
            if not value
        ]
        if missing:
            raise pytest.UsageError(f"{_SELECT_VAR} names {EXTERNAL!r} but {', '.join(missing)} is not set")
        if not endpoint.startswith(("http://", "https://")):
            raise pytest.UsageError(f"{_ENDPOINT_VAR}={endpoint!r} is not an http(s):// URL")
        region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
        return cls(
            endpoint,
            os.environ["AWS_ACCESS_KEY_ID"],
            os.environ["AWS_SECRET_ACCESS_KEY"],
            region,
            os.environ.get("AWS_SESSION_TOKEN") or None,
        )

    @property
    def port(self) -> int:
        """The port of an ``http://127.0.0.1:PORT`` endpoint (the fault-injecting proxy's upstream).

        The proxy only forwards plain HTTP to 127.0.0.1, so tests that need it skip elsewhere.
        """
        parsed = urllib.parse.urlsplit(self.endpoint_url)
        if parsed.scheme != "http" or parsed.hostname not in ("127.0.0.1", "localhost") or not parsed.port:
            pytest.skip(f"needs an http://127.0.0.1:PORT endpoint for the fault proxy, not {self.endpoint_url}")
        return parsed.port

    def env(self) -> dict[str, str]:
        env = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }
        if self.session_token:
            env["AWS_SESSION_TOKEN"] = self.session_token
        return env

    def client_kwargs(self) -> dict[str, str]:
        kwargs = {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }
        if self.session_token:
            kwargs["aws_session_token"] = self.session_token
        return kwargs

    def log_tail(self, max_chars: int = 4000) -> str:
        return ""

    def reset(self) -> None:
        raise RuntimeError("the suite never wipes an external S3 endpoint")

    def stop(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<ExternalS3Server {self.endpoint_url}>"


_EXTERNAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


TRANSPORT_KINDS = ("aioboto3", "obstore")
_TRANSPORTS_VAR = "S3CAPTURE_TEST_TRANSPORTS"


def selected_transports() -> tuple[str, ...]:
    """Transports selected by ``S3CAPTURE_TEST_TRANSPORTS`` (both when unset or empty)."""
    raw = os.environ.get(_TRANSPORTS_VAR, "").strip()
    if not raw:
        return TRANSPORT_KINDS
    chosen = tuple(dict.fromkeys(p.strip().lower() for p in raw.split(",") if p.strip()))
    unknown = [k for k in chosen if k not in TRANSPORT_KINDS]
    if unknown:
        raise pytest.UsageError(
            f"{_TRANSPORTS_VAR}={raw!r}: unknown transport(s) {unknown}; choose from {list(TRANSPORT_KINDS)}"
        )
    return chosen


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "all_transports: run each test once per transport in S3CAPTURE_TEST_TRANSPORTS (aioboto3, obstore)"
    )
    selected_transports()  # fail early on a typo
    # fail early on a typo in S3CAPTURE_TEST_SERVERS or a missing external endpoint setting
    if EXTERNAL in selected_servers():
        ExternalS3Server.from_env()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Say what the run is about to do: with ``-q`` pytest prints no header, and the first dots
    wait for a server to start (a walkthrough took the silent minute for a hang)."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller says it once
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    servers = selected_servers()
    slow = " (the Ceph gateway takes 30-90 s)" if "ceph" in servers else ""
    reporter.write_line(
        f"s3capture: testing against {', '.join(servers)} x transports {', '.join(selected_transports())}; "
        f"each server starts on its first test{slow}, so the first results can take a minute"
    )


@pytest.hookimpl(trylast=True)  # after pytest's own reordering of the items by fixture parameter
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``, the README's command), every test of the Ceph
    gateway runs in one worker, so that server (tens of seconds to start) is started once; the
    other tests, moto's and SeaweedFS's included (a few seconds to start, once per worker that
    needs them), are spread over the workers one by one, which keeps the two workers' loads even.
    Grouping every server's tests, as before, left one worker with two servers' tests. The Ceph
    tests come first, so that their worker starts on them while the other takes single tests."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        kind = callspec.params.get("s3_server") if callspec is not None else None
        if kind in _GROUPED_SERVERS:
            item.add_marker(pytest.mark.xdist_group(f"server-{kind}"))
    # The group, the longest unit of work, first (a stable sort: the order within each part stays):
    # one worker takes it at the start while the other works through the single tests, instead
    # of one worker running it alone at the end.
    items.sort(key=lambda item: not _grouped(item))


def _grouped(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("s3_server") in _GROUPED_SERVERS


_GROUPED_SERVERS = frozenset({"ceph"})
"""Servers whose tests share one xdist worker: those slow to start."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "transport_kind" in metafunc.fixturenames and metafunc.definition.get_closest_marker("all_transports"):
        if _parametrizes(metafunc, "transport_kind"):
            return  # a test in an all_transports module that names its transport(s) itself
        metafunc.parametrize("transport_kind", TRANSPORT_KINDS, ids=TRANSPORT_KINDS, indirect=True)


def _parametrizes(metafunc: pytest.Metafunc, name: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if name in names:
            return True
    return False


@pytest.fixture(autouse=True)
def transport_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The transport this test's stores use: a parameter in ``all_transports`` modules (exported
    as ``S3CAPTURE_TRANSPORT``), else ``S3CAPTURE_TRANSPORT`` or ``aioboto3``."""
    kind = getattr(request, "param", None)
    if kind is None:
        return os.environ.get("S3CAPTURE_TRANSPORT", "aioboto3")
    if kind not in selected_transports():
        pytest.skip(f"{kind} transport not selected ({_TRANSPORTS_VAR}={os.environ.get(_TRANSPORTS_VAR)!r})")
    if kind == "obstore":
        try:
            import obstore  # noqa: F401
        except ImportError:
            if running_under_ci():
                pytest.fail(
                    "the obstore transport is required under CI: pip install 's3capture[obstore]'", pytrace=False
                )
            pytest.skip("obstore is not installed (pip install 's3capture[obstore]')")
    monkeypatch.setenv("S3CAPTURE_TRANSPORT", kind)
    return kind


def skip_unless_selected(kind: str) -> None:
    """``pytest.skip`` when ``kind`` is not in ``S3CAPTURE_TEST_SERVERS``."""
    if kind not in selected_servers():
        pytest.skip(f"{kind} server not selected ({_SELECT_VAR}={os.environ.get(_SELECT_VAR)!r})")


def server_unavailable(kind: str, reason: str) -> None:
    """Skip (one line: ``reason``) where ``kind`` cannot run here; fail instead under ``CI``."""
    if running_under_ci():
        pytest.fail(f"{kind} test server is required under CI: {reason}", pytrace=False)
    pytest.skip(f"{kind} test server unavailable: {reason}")


def start_server(kind: str, **kwargs: Any) -> Any:
    """Start the server ``kind`` (``kwargs`` go to its launcher): skip if its software is missing, fail under CI."""
    if kind == EXTERNAL:
        return ExternalS3Server.from_env()
    # pytest.skip/fail outside the except blocks: no chained traceback around a one-line reason
    try:
        return _STARTERS[kind](**kwargs)
    except ServerUnavailable as exc:
        missing, failed = str(exc), None
    except RuntimeError as exc:
        if not running_under_ci():
            raise
        missing, failed = None, str(exc)
    if failed is not None:
        pytest.fail(f"{kind} test server could not start: {failed}", pytrace=False)
    server_unavailable(kind, missing)


# The local kinds are always parameters (skipped when not selected, so test ids stay put);
# "external" only when selected.
# (A typo in the setting is reported by pytest_configure, not here at import.)
_PARAMS = SERVER_KINDS + (
    (EXTERNAL,) if EXTERNAL in os.environ.get(_SELECT_VAR, "").lower().replace(" ", "").split(",") else ()
)


@pytest.fixture(scope="session", params=_PARAMS, ids=_PARAMS)
def s3_server(request: pytest.FixtureRequest) -> Iterator[LocalS3Server]:
    """A running S3 server, one per kind for the whole session."""
    kind = request.param
    skip_unless_selected(kind)
    server = start_server(kind)
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
    if s3_server.region == "us-east-1":
        s3_client.create_bucket(Bucket=bucket)
    else:  # an external endpoint in another region
        s3_client.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": s3_server.region})
    try:
        yield f"s3://{bucket}/t"
    finally:
        # Two requests fewer per test on moto and Ceph, which refuse to delete a non-empty bucket.
        delete_bucket_quietly(s3_client, bucket, deletes_non_empty=s3_server.kind not in ("moto", "ceph"))


def delete_bucket_quietly(client: Any, bucket: str, *, deletes_non_empty: bool = True) -> None:
    """Delete ``bucket`` and its objects and multipart uploads; log, never raise.

    ``deletes_non_empty``: first try DELETE of the bucket as it is (SeaweedFS deletes a non-empty
    bucket); pass False for a server that refuses (moto, Ceph, S3) to skip that request. Multipart
    uploads are looked for only when the bucket is still there once its objects are gone.
    """
    try:
        if deletes_non_empty:
            try:
                client.delete_bucket(Bucket=bucket)  # SeaweedFS deletes non-empty buckets
                return
            except client.exceptions.NoSuchBucket:
                return
            except client.exceptions.ClientError:
                pass  # BucketNotEmpty (moto, S3): empty it first
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
                for i in range(0, len(keys), 1000):  # SeaweedFS rejects more than 1,000 keys
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})
            client.delete_bucket(Bucket=bucket)
            return
        except client.exceptions.NoSuchBucket:
            return
        except client.exceptions.ClientError:
            pass  # multipart uploads left (or objects written meanwhile): abort them, then again
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for upload in page.get("Uploads", []):
                try:
                    client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                except client.exceptions.ClientError:
                    pass
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            for i in range(0, len(keys), 1000):
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})
        client.delete_bucket(Bucket=bucket)
    except Exception as exc:  # noqa: BLE001 - best effort: never fail the test in teardown
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
async def proxy(s3_server: LocalS3Server):
    """A ``FaultProxy`` (``tests/faultproxy.py``) in front of ``s3_server``, knowing its
    credentials; point a client at ``proxy.endpoint`` and set ``proxy.rule``. Stopped afterwards."""
    from faultproxy import FaultProxy

    started = await FaultProxy.for_server(s3_server).start()
    try:
        yield started
    finally:
        await started.stop()


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


@pytest.fixture
def not_on_the_ceph_gateway(s3_server: Any) -> None:
    """Skip on the Ceph gateway (``pytestmark = pytest.mark.usefixtures("not_on_the_ceph_gateway")``):
    for the breakers' sleep-bound matrices, whose behaviour other tests cover on every server.
    Every Ceph test runs in one xdist worker, the suite's longest unit (``pytest_collection_modifyitems``)."""
    if s3_server.kind == "ceph":
        pytest.skip("this matrix runs on moto and SeaweedFS only (every Ceph test shares one worker)")
