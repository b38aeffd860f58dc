"""The transport seam: selection, key fidelity and listing parsing, on every transport.

Every key the layout builds, under every root a user may configure, must reach the server byte
for byte on both transports (obstore's ``Path`` refuses empty and dot segments and could encode
characters); a key written one way and listed another would be a lost entry.
"""

from __future__ import annotations

import sys

import pytest

from helpers import make_entry, split_bucket_url
from s3capture.ledger import S3CaptureLedger
from s3capture.store import S3TokenStore
from s3capture.transport import S3Transport, Transport, _verify_page, make_transport

pytestmark = pytest.mark.all_transports

ROOTS = ["", "plain", "a b/c+d", "x%y/\u00fc/z*!()@$", "t~/a=b&c/semi;colon", "quote\"s'/<a>/{b}|^`[c]"]
IDS = ["r/with/slashes", "caf\u00e9 \u2603 ..", "~a%2Fb"]  # escaped into segments; the roots vary the rest


def _server_keys(s3_client, bucket: str) -> set[str]:
    keys: set[str] = set()
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys.update(item["Key"] for item in page.get("Contents", ()))
    return keys


@pytest.mark.parametrize("root", ROOTS, ids=[f"root{i}" for i in range(len(ROOTS))])
async def test_every_key_the_layout_builds_reaches_the_server_byte_for_byte(
    s3_env, s3_client, bucket_url, root, transport_kind
):
    bucket, _ = split_bucket_url(bucket_url)
    url = f"s3://{bucket}/{root}" if root else f"s3://{bucket}"
    store = S3TokenStore(url, fence_grace=0.05)
    ledger = S3CaptureLedger(url)
    assert store.transport.name == transport_kind
    written: list[str] = []
    for client in (store, ledger):
        client.transport.add_hook(before=lambda op, key, _c: written.append(key) if op == "PutObject" else None)
    try:
        for rid in IDS:
            await store.begin_call(rid, "c/1")
            await store.put(
                make_entry(
                    rid,
                    "c/1",
                    [{"role": "user", "content": "hi"}],
                    [{"role": "assistant", "content": "yo"}],
                    [1, 2],
                    [3],
                )
            )
            await store.mark_incomplete(rid, "c:2 \u00e9")
            snapshot = await store.freeze(rid)
            # What the store lists back is what it wrote, and so is what another client sees.
            assert snapshot.version == 3, (rid, snapshot)
            assert [e.model_call_id for e in snapshot.entries] == ["c/1"]
        await ledger.begin_call("ledger-r", "c/1")
    finally:
        await store.close()
        await ledger.close()
    on_server = _server_keys(s3_client, bucket)
    assert written and set(written) <= on_server, sorted(set(written) - on_server)[:5]
    prefix = f"{root.strip('/')}/" if root else ""
    assert all(key.startswith(prefix + "rollouts/") for key in on_server), sorted(on_server)[:5]


@pytest.mark.parametrize("control", ["\t", "\n", "\r", "\x00", "\x7f"])
def test_a_root_with_a_control_character_is_refused_not_silently_changed(control):
    # urllib drops tabs and newlines from URLs: "s3://b/a\tb" would have stored under "ab".
    with pytest.raises(ValueError, match="control characters"):
        S3TokenStore(f"s3://bkt/a{control}b")


@pytest.mark.parametrize("character", ["\ufffe", "\uffff", "\ud800", "\udcff"])
def test_a_root_xml_cannot_carry_is_refused_before_any_request(character):
    """The Ceph gateway writes a listing's ``<Prefix>`` unencoded: under a root holding U+FFFE or
    U+FFFF every LIST answered a body no client can parse, after the puts were acknowledged (a
    Ceph breaker, 2026-12-03). Every s3:// URL refuses them, the export's destination included."""
    from s3capture.ledger import S3CaptureLedger
    from s3capture.rollouts import parse_s3_url

    from s3capture.cli import check_s3_url  # what `serve --prefix` and the CLI's arguments go through

    for build in (S3TokenStore, S3CaptureLedger, parse_s3_url, check_s3_url):
        with pytest.raises(ValueError, match="XML 1.0" if character in "\ufffe\uffff" else "lone surrogate"):
            build(f"s3://bkt/run{character}7")
    assert parse_s3_url("s3://bkt/run\ufffd7") == ("bkt", "run\ufffd7")  # U+FFFD is XML text


def test_a_root_with_a_backslash_is_refused():
    # SeaweedFS lists "a\\b/..." under another key than the one written: the fence would vanish.
    with pytest.raises(ValueError, match="backslash"):
        S3TokenStore("s3://bkt/a\\b")


def test_entry_type_gym_without_nemo_gym_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_gym.token_id_capture.records", None)  # import raises ImportError
    with pytest.raises(ImportError, match=r"s3capture\[gym\].*nemo-gym==0.7.0"):
        S3TokenStore("s3://bkt/p", entry_type="gym")


def test_transport_is_chosen_by_argument_then_environment(monkeypatch, transport_kind):
    monkeypatch.setenv("S3CAPTURE_TRANSPORT", transport_kind)
    assert make_transport(None, "bkt", endpoint_url="http://127.0.0.1:9").name == transport_kind
    assert isinstance(make_transport("aioboto3", "bkt"), S3Transport)
    given = S3Transport("bkt")
    assert make_transport(given, "bkt") is given
    with pytest.raises(ValueError, match="transport must be one of"):
        make_transport("boto2", "bkt")
    monkeypatch.setenv("S3CAPTURE_TRANSPORT", "curl")
    with pytest.raises(ValueError, match="S3CAPTURE_TRANSPORT must be one of"):
        make_transport(None, "bkt")
    with pytest.raises(ValueError, match="S3CAPTURE_TRANSPORT must be one of"):
        S3TokenStore("s3://bkt/p")


def test_obstore_listing_parser_keeps_what_verification_needs():
    pytest.importorskip("obstore")
    from s3capture.transport_obstore import _parse_list
    from s3capture.transport import _Unverified

    ns = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
    page = _parse_list(
        f"<ListBucketResult {ns}><IsTruncated>true</IsTruncated><EncodingType>url</EncodingType>"
        "<NextContinuationToken>tok</NextContinuationToken>"
        "<Contents><Key>p/a+b%2Fc%25</Key><ETag>&quot;abc&quot;</ETag><Size>7</Size>"
        "<LastModified>2026-11-30T10:00:00.000Z</LastModified></Contents></ListBucketResult>".encode(),
        "p/",
    )
    verified = _verify_page(page, "p/", set())
    assert [(o.key, o.etag, o.size) for o in verified.objects] == [("p/a b/c%", "abc", 7)]
    assert verified.next_token == "tok"
    # A page that does not say whether it is truncated is not "no objects".
    with pytest.raises(_Unverified):
        _verify_page(_parse_list(f"<ListBucketResult {ns}></ListBucketResult>".encode(), "p/"), "p/", set())
    # Truncated without a token: refused (object_store would end the listing here).
    truncated = _parse_list(f"<ListBucketResult {ns}><IsTruncated>true</IsTruncated></ListBucketResult>".encode(), "p/")
    with pytest.raises(_Unverified):
        _verify_page(truncated, "p/", set())
    for body in (b"", b"<html>gateway</html>", b"<ListBucketResult"):
        with pytest.raises(_Unverified):
            _parse_list(body, "p/")


def _findtext_parse(body: bytes) -> dict:
    """The listing as ElementTree's ``findtext``/``iterfind`` read it (the reference for ``_parse_list``)."""
    import contextlib
    import datetime
    import xml.etree.ElementTree as ET

    from s3capture.transport_obstore import _url_decoded

    root = ET.fromstring(body)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    page: dict = {}
    if (truncated := root.findtext(ns + "IsTruncated")) is not None:
        page["IsTruncated"] = truncated.strip().lower() == "true"
    if token := root.findtext(ns + "NextContinuationToken"):
        page["NextContinuationToken"] = token
    encoded = (root.findtext(ns + "EncodingType") or "").strip().lower() == "url"
    contents = []
    for item in root.iterfind(ns + "Contents"):
        key = item.findtext(ns + "Key")
        entry = {
            "Key": _url_decoded(key) if key is not None and encoded else key,
            "ETag": item.findtext(ns + "ETag") or "",
            "Size": int(item.findtext(ns + "Size") or 0),
        }
        if modified := item.findtext(ns + "LastModified"):
            with contextlib.suppress(ValueError):  # an unreadable date is left out
                entry["LastModified"] = datetime.datetime.fromisoformat(modified.replace("Z", "+00:00"))
        contents.append(entry)
    if contents:
        page["Contents"] = contents
    return page


@pytest.mark.parametrize("transport_kind", ["obstore"], indirect=True)  # a parser: one transport
@pytest.mark.parametrize("ns", ['xmlns="http://s3.amazonaws.com/doc/2006-03-01/"', 'xmlns="urn:other ns"', ""])
def test_obstore_listing_parser_reads_odd_pages_as_findtext_does(ns):
    """The one-pass parse reads each field as ``findtext`` does: the first child of a name, "" for an
    empty one, None for a missing one; children of another namespace are not the listing's;
    ``EncodingType`` applies wherever it stands; repeated top-level fields keep the first."""
    pytest.importorskip("obstore")
    from s3capture.transport_obstore import _parse_list

    bodies = [
        "<IsTruncated/><Contents/><Contents><Key/><Size/><ETag/><LastModified/></Contents>",
        "<Contents><Key>a%2Fb+c</Key><Key>second</Key><Size>3</Size><Size>9</Size></Contents>"
        "<EncodingType> URL </EncodingType><IsTruncated> TRUE </IsTruncated><IsTruncated>false</IsTruncated>",
        "<NextContinuationToken></NextContinuationToken><NextContinuationToken>t2</NextContinuationToken>"
        "<IsTruncated>true</IsTruncated><Contents><ETag>e</ETag><LastModified>not a date</LastModified></Contents>",
        '<x:IsTruncated xmlns:x="urn:x">true</x:IsTruncated><Contents><x:Key xmlns:x="urn:x">k</x:Key>'
        "<Owner><Key>inner</Key></Owner><Key>outer</Key></Contents>",
        "<EncodingType/><Contents><Key>a%20b</Key><LastModified>2026-11-30T10:00:00Z</LastModified></Contents>",
        '<Contents xmlns="urn:elsewhere"><Key>foreign</Key></Contents><Name>b</Name><KeyCount>0</KeyCount>',
    ]
    for inner in bodies:
        body = f"<ListBucketResult {ns}>{inner}</ListBucketResult>".encode()
        assert _parse_list(body, "p/") == _findtext_parse(body), body


@pytest.mark.parametrize(
    "endpoint",
    ["http://127.0.0.1:8333", "http://LocalHost:80", "http://[::1]:9000", "https://S3.example.com:443", None],
)
@pytest.mark.parametrize("token", [None, "session/token+="])
def test_obstore_list_signer_signs_exactly_as_botocore_does(monkeypatch, endpoint, token):
    # The LIST's signer keeps botocore's S3SigV4Auth and its signing key across requests, and
    # gives the Host header instead of parsing it from every URL: the Authorization it produces
    # must be the one a fresh botocore signer produces for the same request at the same second.
    pytest.importorskip("obstore")
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest

    from s3capture.transport_obstore import ObstoreTransport

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    if token:
        monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    else:
        monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    transport = ObstoreTransport("my.bucket", endpoint_url=endpoint)
    url = f"{transport._base}?continuation-token=a%2Bb%3D&encoding-type=url&list-type=2&max-keys=1000&prefix=r%2F%C3%BC%20x%2F"
    for _ in range(3):  # the same signer twice: its kept signing key is the derived one
        for _attempt in range(20):
            ours = transport._sign(url)
            request = AWSRequest(method="GET", url=url)
            S3SigV4Auth(transport._frozen(), "s3", "eu-west-3").add_auth(request)
            if request.headers["X-Amz-Date"] == ours["X-Amz-Date"]:
                break
        assert ours["Authorization"] == request.headers["Authorization"]
        assert ours["X-Amz-Content-SHA256"] == request.headers["X-Amz-Content-SHA256"]
        assert ours.get("X-Amz-Security-Token") == token
        assert "SignedHeaders=host;x-amz-content-sha256;x-amz-date" in ours["Authorization"]


def test_obstore_listing_key_decoding_is_botocore_s():
    pytest.importorskip("obstore")
    from urllib.parse import unquote_plus

    from s3capture.transport_obstore import _url_decoded

    cases = ["", "a", "p%2Fq", "p%2fq", "%252F", "%25%2F", "a+b", "%2B%2F+", "%E2%82%AC%2F", "%zz%2F", "%", "%2", "%C3"]
    for key in cases:
        assert _url_decoded(key) == unquote_plus(key), key


def test_a_transport_is_a_transport(transport_kind):
    store = S3TokenStore("s3://bkt/p", transport=transport_kind, endpoint_url="http://127.0.0.1:9")
    assert isinstance(store.transport, Transport)
    assert store.transport.name == transport_kind


async def test_an_explicit_session_s_keys_are_used_on_every_transport(s3_env, bucket_url, monkeypatch, transport_kind):
    """README: credentials come from the standard chain "or pass session=aioboto3.Session(...)".
    With no keys in the environment, the session's explicit keys must work on both transports
    (the obstore transport once ignored them: "the standard credential chain is empty")."""
    import aioboto3

    keys = s3_env.env()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    session = aioboto3.Session(
        aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    store = S3TokenStore(bucket_url, session=session, endpoint_url=keys["AWS_ENDPOINT_URL"])
    assert store.transport.name == transport_kind
    try:
        await store.begin_call("r", "c1")
        snapshot = await store.freeze("r")
    finally:
        await store.close()
    assert snapshot.reasons == ("dangling_intent:c1",)


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
async def test_https_to_a_plain_http_server_says_to_use_http(s3_server, transport_kind, monkeypatch):
    """A new user's https:// endpoint for a local server ended in the SSL library's
    WRONG_VERSION_NUMBER with "check the endpoint and the network"; it now says what to change."""
    from s3capture.errors import StoreError
    from s3capture.transport import default_botocore_config

    monkeypatch.setattr("s3capture.transport_errors._CONNECT_WARNED", {})
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    endpoint = s3_server.endpoint_url.replace("http://", "https://")
    config = default_botocore_config(
        4, retries={"mode": "standard", "max_attempts": 1}, s3={"addressing_style": "path"}
    )
    transport = make_transport(transport_kind, "bkt", endpoint_url=endpoint, botocore_config=config)
    try:
        with pytest.raises(StoreError) as failed:
            await transport.list_page("p/")
    finally:
        await transport.close()
    assert "the server answers plain HTTP: use http:// in the endpoint" in str(failed.value), failed.value


async def test_an_endpoint_that_accepts_but_never_answers_warns_at_the_first_retry(monkeypatch, caplog):
    """A socket that accepts connections and never answers took about three minutes of silence
    (read timeouts, retried) before the one-line error (a breaker, 2026-12-02): the first retry
    now says so, naming the endpoint. aioboto3: botocore's retries are observed."""
    import logging
    import socket
    import threading

    from s3capture.errors import StoreError
    from s3capture.transport import default_botocore_config

    monkeypatch.setattr("s3capture.transport_errors._CONNECT_WARNED", {})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])  # never answered
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    config = default_botocore_config(
        4, retries={"mode": "standard", "max_attempts": 1}, s3={"addressing_style": "path"}, read_timeout=0.5
    )
    transport = make_transport("aioboto3", "bkt", endpoint_url=endpoint, botocore_config=config)
    try:
        with caplog.at_level(logging.WARNING, logger="s3capture"):
            with pytest.raises(StoreError):
                await transport.list_page("p/")
    finally:
        await transport.close()
        stop.set()
        thread.join()
        for connection in held:
            connection.close()
        server.close()
    warnings = [r.getMessage() for r in caplog.records if "no answer from" in r.getMessage()]
    assert len(warnings) == 1 and endpoint in warnings[0] and "attempt 2 of" in warnings[0], warnings


async def test_a_request_that_cannot_connect_warns_at_once_then_fails_after_its_retries(
    transport_kind, monkeypatch, caplog
):
    """A wrong endpoint is retried like any connection error, but says so at the first retry
    instead of after a quarter of a minute of silence; the warning names the endpoint."""
    import logging
    import socket

    from s3capture.errors import StoreError
    from s3capture.transport import default_botocore_config

    monkeypatch.setattr("s3capture.transport_errors._CONNECT_WARNED", {})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    config = default_botocore_config(
        4, retries={"mode": "standard", "max_attempts": 1}, s3={"addressing_style": "path"}
    )
    transport = make_transport(transport_kind, "bkt", endpoint_url=endpoint, botocore_config=config)
    try:
        with caplog.at_level(logging.WARNING, logger="s3capture"):
            with pytest.raises(StoreError) as failed:
                await transport.list_page("p/")
    finally:
        await transport.close()
    records = [r for r in caplog.records if "cannot connect" in r.getMessage()]
    warnings = [r.getMessage() for r in records]
    assert warnings and all(endpoint in message for message in warnings)
    assert "attempt 2 of" in warnings[0]  # the first retry says so at once
    gaps = [later.created - earlier.created for earlier, later in zip(records, records[1:])]
    assert all(gap >= 4.9 for gap in gaps), gaps  # at most one line per 5 s, whatever the number of retries
    assert str(failed.value).startswith(f"cannot connect to {endpoint} (LIST s3://bkt/p/)")
    assert "check the endpoint" in str(failed.value)


def test_connect_warnings_repeat_every_5_seconds_while_the_retries_go_on(monkeypatch, caplog) -> None:
    """A wrong endpoint's retries take 8-14 s; one warning and then silence (the warning came at
    most once a minute) looked like a hang. Now: at once, then at most one line per 5 s per
    endpoint, however many requests fail together; another endpoint has its own."""
    import logging

    from s3capture import transport_errors as transport_module

    monkeypatch.setattr(transport_module, "_CONNECT_WARNED", {})
    now = [1000.0]
    monkeypatch.setattr(transport_module.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="s3capture.connect"):
        for at, endpoint in [
            (0.0, "http://a"), (0.1, "http://a"), (0.2, "http://b"), (4.9, "http://a"),
            (5.1, "http://a"), (9.0, "http://a"), (10.2, "http://a"),
        ]:  # fmt: skip
            now[0] = 1000.0 + at
            transport_module.warn_connect_retry(endpoint, OSError("refused"), 1, 6)
    said = [(r.created, r.getMessage().split(" (")[0]) for r in caplog.records]
    assert [message for _, message in said] == [
        "cannot connect to http://a",
        "cannot connect to http://b",
        "cannot connect to http://a",
        "cannot connect to http://a",
    ], said
    # the first retry of six attempts: up to 1 + 2 + 4 + 8 + 16 s of backoff follow
    assert "retrying, attempt 2 of 6, backing off up to 31 s" in caplog.records[0].getMessage()
    transport_module._CONNECT_WARNED.clear()
    transport_module.warn_connect_retry("http://c", OSError("refused"), 5, 6)
    assert "attempt 6 of 6, backing off up to 16 s" in caplog.records[-1].getMessage()


def test_requests_retried_by_s3capture_wait_as_botocore_standard_mode_does() -> None:
    """Retries s3capture sends itself (a 429 botocore does not know, obstore's answers of
    ``RETRY_CODES``) wait with botocore's standard-mode backoff: full jitter over 2**(attempt-1)
    seconds, never more than 20 s, so both transports and botocore's own retries back off alike."""
    from s3capture.transport import store_retry_delay

    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (6, 20.0), (12, 20.0)]:
        delays = [store_retry_delay(attempt) for _ in range(400)]
        assert all(0.0 <= delay <= ceiling for delay in delays), (attempt, max(delays))
        assert max(delays) > ceiling / 2, (attempt, max(delays))  # jittered over the whole range
