"""``s3capture doctor`` on every test server: the verdicts measured there, the exit status, the
``--json`` shape, one-line setup errors, and nothing left behind under the prefix.

The per-server verdicts are what the probes measured on moto 5.2.5, SeaweedFS 4.48 and Ceph RGW
16.2.15 (docs/doctor.md): SeaweedFS lists in directory order, collapses ``//``, refuses dot
segments and verifies checksums; moto verifies neither Content-MD5 nor checksums; Ceph verifies
Content-MD5 but ignores ``x-amz-checksum-*``. A fault proxy shows the failures (a listing that
hides young keys) and notes (keys outside the prefix, a skewed ``Date``) on the wire. The full run
and the ``transport-keys`` probe run on both transports (``all_transports``): a transport that
changes a key in transit fails it, and the changed key is still cleaned up.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from faultproxy import FaultProxy, ListHideYoung, ListIgnoreStartAfter, ListSiblings, Request, Respond
from test_transport import IDS, ROOTS

from s3capture.cli import main
from s3capture.doctor import (
    KEY_IDS,
    KEY_ROOTS,
    ORDER_KEYS,
    PROBES,
    DoctorReport,
    diagnose,
    format_report,
    grade_order,
    layout_keys,
)
from s3capture.rollouts import _segment_after
from s3capture.transport import Transport

SAMPLES = "3"

# Verdicts measured on each local server; every other probe is "ok" there.
KNOWN: dict[str, dict[str, str]] = {
    "moto": {"content-md5": "note", "checksum-headers": "note"},
    "seaweedfs": {"listing-order": "note", "double-slash": "note", "dot-segments": "note"},
    "ceph": {"checksum-headers": "note"},
}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["doctor", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _keys(s3_client: Any, url: str) -> list[str]:
    bucket, _, prefix = url[len("s3://") :].partition("/")
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


@pytest.mark.all_transports
def test_doctor_json_verdicts_of_each_server(
    s3_env: Any, bucket_url: str, s3_client: Any, transport_kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # endpoint from AWS_ENDPOINT_URL, transport from S3CAPTURE_TRANSPORT (set by transport_kind)
    code, out, err = _run(capsys, bucket_url, "--samples", SAMPLES, "--json")
    report = json.loads(out)
    assert code == 0, (out, err)
    assert set(report) == {"url", "endpoint", "transport", "probe_prefix", "probes", "left_behind", "ok", "counts"}
    assert report["ok"] is True and report["left_behind"] == []
    assert report["url"] == bucket_url and report["endpoint"] == s3_env.endpoint_url
    assert report["transport"] == transport_kind
    assert report["probe_prefix"].startswith("t/_s3capture-doctor-") and report["probe_prefix"].endswith("/")
    assert [p["name"] for p in report["probes"]] == list(PROBES)
    for probe in report["probes"]:
        assert set(probe) == {"name", "verdict", "detail", "advice", "data"}
        assert probe["verdict"] in ("ok", "note") and probe["detail"]
        assert bool(probe["advice"]) == (probe["verdict"] != "ok"), probe
    assert sum(report["counts"].values()) == len(PROBES) and report["counts"]["fail"] == 0
    verdicts = {p["name"]: p["verdict"] for p in report["probes"]}
    data = {p["name"]: p["data"] for p in report["probes"]}
    if s3_env.kind in KNOWN:
        assert verdicts == {name: KNOWN[s3_env.kind].get(name, "ok") for name in PROBES}
    if s3_env.kind == "seaweedfs":
        assert data["listing-order"]["order"] == "directory"
        assert data["double-slash"]["listed"] == ["a/x"]  # '//' collapsed
    elif s3_env.kind in ("moto", "ceph"):
        assert data["listing-order"]["order"] == "byte"
        assert data["double-slash"]["listed"] == ["a//x"]
    assert data["latency"]["PUT"]["samples"] == int(SAMPLES) and data["latency"]["transport"] == transport_kind
    keys = data["transport-keys"]
    assert keys["transport"] == transport_kind and keys["keys"] == len(layout_keys()) == len(ROOTS) * len(IDS)
    assert keys["refused"] == {} and keys["changed"] == keys["unread"] == keys["listed_instead"] == []
    # the table the command prints without --json, from the same report
    parsed = msgspec.convert({k: v for k, v in report.items() if k not in ("ok", "counts")}, DoctorReport)
    assert parsed.ok and parsed.probe("read-after-write").data["stale_reads"] == 0
    lines = format_report(parsed).splitlines()
    assert lines[0].startswith(f"s3capture doctor: {bucket_url} on {s3_env.endpoint_url} (transport: {transport_kind};")
    for name in PROBES:
        assert any(line.split()[:2] == [name, verdicts[name].upper()] for line in lines), name
    assert lines[-1].startswith("verdict: OK")
    assert _keys(s3_client, bucket_url) == []  # nothing left behind, not even the probe prefix


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # CLI plumbing: one server is enough
def test_doctor_with_stdout_closed_ends_without_a_traceback(s3_env: Any, bucket_url: str, s3_client: Any) -> None:
    """``doctor URL >&-`` printed ``AttributeError: 'NoneType' object has no attribute 'flush'``
    (a review, 2026-12-03; ``ls`` had the same and was fixed first)."""
    import subprocess
    import sys

    command = [sys.executable, "-c", "import sys; from s3capture.cli import main; sys.exit(main())"]
    line = subprocess.list2cmdline([*command, "doctor", bucket_url, "--samples", SAMPLES])
    done = subprocess.run(f"{line} >&-", shell=True, capture_output=True, timeout=300)
    assert (done.returncode, done.stderr.decode()) == (0, "")
    assert _keys(s3_client, bucket_url) == []


@pytest.mark.all_transports
def test_doctor_missing_bucket(
    s3_env: Any, bucket_url: str, transport_kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = bucket_url.replace("s3://", "s3://no-such-").split("/")[2]
    code, out, err = _run(capsys, f"s3://{missing}/p", "--endpoint", s3_env.endpoint_url, "--transport", transport_kind)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "s3capture doctor: error:" in err and "does not exist" in err, err


def test_doctor_refused_credentials(
    s3_env: Any, bucket_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if s3_env.kind == "moto":
        pytest.skip("moto does not check signatures")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    code, out, err = _run(capsys, bucket_url, "--samples", "1")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "refused" in err, err


def test_doctor_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["http://b/p"],
        ["s3://b/p", "--samples", "0"],
        ["s3://b/p", "--endpoint", "ftp://x"],
        ["s3://bkt/p", "--transport", "curl"],
        ["s3://bkt/run7/rollouts/r1"],  # its probes would be foreign objects of a live rollout
    ):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1, (argv, err)


def test_doctor_without_obstore_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)  # `import obstore` raises ImportError
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens: no request may be sent
    code, out, err = _run(capsys, "s3://bkt/p", "--transport", "obstore")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--transport=obstore needs obstore: pip install 's3capture[obstore]'" in err, err
    monkeypatch.setenv("S3CAPTURE_TRANSPORT", "obstore")  # the default comes from the environment
    code, out, err = _run(capsys, "s3://bkt/p")
    assert code == 2 and "S3CAPTURE_TRANSPORT=obstore needs obstore" in err and "s3capture[obstore]" in err, err
    monkeypatch.setenv("S3CAPTURE_TRANSPORT", "curl")
    code, out, err = _run(capsys, "s3://bkt/p")
    assert code == 2 and "S3CAPTURE_TRANSPORT must be one of aioboto3, obstore" in err, err


def test_transport_keys_are_the_transport_tests_keys() -> None:
    """The probe writes the key shapes tests/test_transport.py checks on every server."""
    assert KEY_ROOTS == tuple(ROOTS) and KEY_IDS == tuple(IDS)
    assert len(set(layout_keys())) == len(ROOTS) * len(IDS)


@pytest.mark.all_transports
def test_transport_keys_fails_when_the_transport_changes_a_key(
    s3_env: Any,
    bucket_url: str,
    s3_client: Any,
    transport_kind: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A transport that percent-encodes non-ASCII characters of a key on PUT (as a client that
    builds the URL path itself might): the keys under the root with 'ü' land elsewhere, the probe
    fails naming them, every other probe is unaffected and the changed keys are still deleted."""
    put = Transport.put

    async def encoding_put(self: Transport, key: str, body: bytes) -> None:
        await put(self, key.replace("\u00fc", "%C3%BC"), body)

    monkeypatch.setattr(Transport, "put", encoding_put)
    other = "obstore" if transport_kind == "aioboto3" else "aioboto3"
    monkeypatch.setenv("S3CAPTURE_TRANSPORT", other)  # --transport wins over the environment
    code, out, err = _run(capsys, bucket_url, "--samples", "1", "--transport", transport_kind, "--json")
    report = json.loads(out)
    probes = {p["name"]: p for p in report["probes"]}
    assert code == 1 and report["transport"] == transport_kind, err
    assert [name for name, p in probes.items() if p["verdict"] == "fail"] == ["transport-keys"]
    odd = [k for k in layout_keys() if "\u00fc" in k]
    assert len(odd) == len(IDS)
    data = probes["transport-keys"]["data"]
    assert data["changed"] == odd and data["unread"] == odd and data["refused"] == {}
    assert sorted(data["listed_instead"]) == sorted(k.replace("\u00fc", "%C3%BC") for k in odd)
    assert f"{len(odd)} stored under another key" in probes["transport-keys"]["detail"]
    advice = probes["transport-keys"]["advice"]
    assert ("aioboto3 transport" in advice) == (transport_kind == "obstore"), advice
    assert probes["cleanup"]["verdict"] == "ok" and report["left_behind"] == []
    assert _keys(s3_client, bucket_url) == []  # the changed keys were deleted as the server stored them


@pytest.fixture
def proxy(s3_server: Any) -> Iterator[FaultProxy]:
    """A fault proxy in front of ``s3_server``, served by an event loop in a thread (so the
    synchronous CLI can run against it)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started = asyncio.run_coroutine_threadsafe(FaultProxy.for_server(s3_server).start(), loop).result(10)
    try:
        yield started
    finally:
        asyncio.run_coroutine_threadsafe(started.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # the proxy's answer decides: one server
def test_doctor_never_deletes_what_a_widened_listing_shows(
    s3_env: Any, bucket_url: str, s3_client: Any, proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    """A store that ignores a LIST's Prefix, or lists the prefix's whole folder, answered doctor's
    clean-up LIST with the bucket's other objects, and the clean-up deleted them all (a doctor
    breaker, 2026-12-03). It deletes only keys under its own probe prefix."""
    from urllib.parse import quote, urlencode, urlsplit

    bucket, _, root = bucket_url[len("s3://") :].partition("/")
    mine = [f"{root}/other-data.txt", f"{root}/rollouts/x/y", f"{root}/_s3capture-doctor-foreign/keep"]
    for key in mine:
        s3_client.put_object(Bucket=bucket, Key=key, Body=b"keep me")

    async def rule(request: Request) -> Any:
        prefix = request.params.get("prefix", "")
        if request.is_list and re.search(r"_s3capture-doctor-[^/]+/$", prefix):
            # the folder of the probe prefix instead of the probe prefix
            params = {**request.params, "prefix": prefix.rstrip("/").rpartition("/")[0] + "/"}
            query = urlencode(sorted(params.items()), quote_via=quote, safe="-_.~")
            request.target = urlsplit(request.target).path + "?" + query
            proxy._sign(request)
        return None

    proxy.rule = rule
    _run(capsys, bucket_url, "--endpoint", proxy.endpoint, "--samples", "1", "--json")
    assert sorted(_keys(s3_client, bucket_url)) == sorted(mine)


_EMPTY_DELETE_RESULT = b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"></DeleteResult>'


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # the proxy's answers decide: one server
@pytest.mark.parametrize(
    ("misbehaviour", "probe", "verdict"),
    [
        # A GET of a missing key caches its 404 for 3 s (AWS S3 before 2020): a put's fence GET then
        # hides a freeze's fence, and a late put is acknowledged. doctor said OK (a doctor breaker).
        ("cached_404", "read-after-write", "fail"),
        # StartAfter ignored: the end of a listing cannot be confirmed. doctor said OK.
        ("start_after_ignored", "pagination", "fail"),
        # DeleteObjects answers 200 and deletes nothing: s3capture sends the keys again one by one,
        # and works; doctor said FAIL.
        ("delete_objects_noop", "delete-objects", "note"),
    ],
)
def test_doctor_grades_stores_as_s3capture_uses_them(
    s3_env: Any,
    bucket_url: str,
    s3_client: Any,
    proxy: FaultProxy,
    capsys: pytest.CaptureFixture[str],
    misbehaviour: str,
    probe: str,
    verdict: str,
) -> None:
    import time

    missed: dict[str, float] = {}  # key -> when its 404 was served

    async def rule(request: Request) -> Any:
        if misbehaviour == "start_after_ignored" and request.is_list and "start-after" in request.params:
            return ListIgnoreStartAfter()
        if misbehaviour == "delete_objects_noop" and request.method == "POST" and "delete" in request.params:
            return Respond(200, _EMPTY_DELETE_RESULT, "OK")
        if misbehaviour == "cached_404" and request.method == "GET" and not request.is_list:
            served = missed.get(request.key)
            if served is not None and time.monotonic() - served < 3.0:
                return Respond(404, b"<Error><Code>NoSuchKey</Code><Message>cached</Message></Error>", "Not Found")
            if request.key.endswith("/rw/0000") and served is None:
                missed[request.key] = time.monotonic()  # the probe's first key is missing: cache it
        return None

    proxy.rule = rule
    code, out, err = _run(capsys, bucket_url, "--endpoint", proxy.endpoint, "--samples", "1", "--json")
    report = json.loads(out)
    verdicts = {p["name"]: p["verdict"] for p in report["probes"]}
    assert verdicts[probe] == verdict, (verdicts, err)
    assert [name for name, v in verdicts.items() if v == "fail"] == ([probe] if verdict == "fail" else [])
    assert code == (1 if verdict == "fail" else 0)
    assert report["left_behind"] == [] and _keys(s3_client, bucket_url) == []


def test_doctor_fails_on_lagging_listing_and_notes_skew_and_siblings(
    s3_env: Any, bucket_url: str, s3_client: Any, proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    async def rule(request: Request) -> Any:
        if not request.is_list:
            return None
        prefix = request.params.get("prefix", "")
        if "/law/" in prefix:
            return ListHideYoung(300)  # list-after-write lag of 300 ms
        if prefix.endswith("/pfx/r1/"):
            return ListSiblings()  # 'r1/' answered with r10/ and r1-x/ too
        return None

    proxy.rule = rule
    proxy.date_skew = 30.0
    code, out, _err = _run(capsys, bucket_url, "--endpoint", proxy.endpoint, "--samples", "1", "--json")
    report = json.loads(out)
    verdicts = {p["name"]: p for p in report["probes"]}
    assert code == 1 and report["ok"] is False
    assert verdicts["list-after-write"]["verdict"] == "fail"
    assert verdicts["list-after-write"]["data"]["late"] >= 1
    assert "consistency" in verdicts["list-after-write"]["advice"]
    assert verdicts["prefix"]["verdict"] == "note"
    assert verdicts["prefix"]["data"]["outside_prefix"] == {"/r1/": ["/r1-x/a", "/r10/a"]}
    assert verdicts["clock-skew"]["verdict"] == "note"
    assert 28 <= verdicts["clock-skew"]["data"]["skew_seconds"] <= 32
    assert report["counts"]["fail"] == 1
    assert verdicts["cleanup"]["verdict"] == "ok" and report["left_behind"] == []
    assert _keys(s3_client, bucket_url) == []


def test_doctor_with_delete_objects_refused_for_access_notes_it_and_says_how_to_keep_batches(
    s3_env: Any, bucket_url: str, s3_client: Any, proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Ceph gateway refuses DeleteObjects to a role granted s3:DeleteObject on its keys only
    (docs/permissions.md): doctor ran its table to the end only after the fallback to single
    DELETEs, and then its advice said there was nothing to change (a review, 2026-12-03)."""
    from faultproxy import Respond, not_implemented_xml

    async def rule(request: Request) -> Any:
        if request.method == "POST" and "delete" in request.query.split("&"):
            return Respond(403, not_implemented_xml("AccessDenied", "Access Denied"), "Forbidden")
        return None

    proxy.rule = rule
    code, out, _err = _run(capsys, bucket_url, "--endpoint", proxy.endpoint, "--samples", "1", "--json")
    verdicts = {p["name"]: p for p in json.loads(out)["probes"]}
    assert verdicts["delete-objects"]["verdict"] == "note"
    assert "arn:aws:s3:::BUCKET" in verdicts["delete-objects"]["advice"]
    assert verdicts["cleanup"]["verdict"] == "ok" and _keys(s3_client, bucket_url) == []


async def test_diagnose_refuses_bad_arguments_before_any_request() -> None:
    # A prefix with '..' or '//' segments, which every other command refuses, got "OK" (a breaker).
    bad_prefixes = (("s3://b/x/..", 1), ("s3://b/a//b", 1))
    for url, samples in (
        ("s3://b/p", 0),
        ("s3://b/p", 1001),
        ("http://b/p", 1),
        ("s3://b/root/rollouts/r1", 1),
        *bad_prefixes,
    ):
        with pytest.raises(ValueError):
            await diagnose(url, endpoint_url="http://127.0.0.1:1", samples=samples)


def test_grade_order_follows_what_rollouts_accepts() -> None:
    """No server lists out of order, so the grading of orders is shown on listings given here."""
    byte = sorted(ORDER_KEYS, key=lambda k: k.encode())
    tree = sorted(ORDER_KEYS, key=lambda k: [s.encode() for s in k.split("/")])
    assert byte != tree and byte.index("a/x") > byte.index("a-b/x") and tree.index("a/x") < tree.index("a-b/x")
    assert (grade_order(byte).verdict, grade_order(byte).data["order"]) == ("ok", "byte")
    assert (grade_order(tree).verdict, grade_order(tree).data["order"]) == ("note", "directory")
    utf16 = sorted(ORDER_KEYS, key=lambda k: k.encode("utf-16-be"))  # only the non-ASCII keys move
    assert utf16 != byte and grade_order(utf16).verdict == "note" and grade_order(utf16).data["order"] == "other"
    folded = sorted(ORDER_KEYS, key=str.lower)  # 'B/x' among the lower-case letters
    assert grade_order(folded).verdict == "fail"
    split = [k for k in byte if k != "a/y"] + ["a/y"]  # one rollout's keys not consecutive
    assert grade_order(split).verdict == "fail"
    assert grade_order(byte[:-1]).verdict == "fail" and grade_order(byte[:-1]).data["order"] == "incomplete"
    # the grading agrees with the check S3TokenStore.rollouts applies to its listing
    for listed in (byte, tree, folded, split):
        segments = [k.split("/")[0] for k in listed if k.isascii()]
        firsts = [s for i, s in enumerate(segments) if i == 0 or s != segments[i - 1]]
        accepted = len(set(firsts)) == len(firsts) and all(_segment_after(a, b) for a, b in itertools.pairwise(firsts))
        assert accepted == (grade_order(listed).verdict != "fail"), listed
