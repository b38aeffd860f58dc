"""Adversarial tests of S3CaptureLedger (docs/ledger.md, the CaptureLedger contract).

Every test asserts the CORRECT behaviour. Tests that hold are regression tests; a test marked
``xfail(strict=True, reason="BUG: ...")`` documents a real defect precisely (it fails today and
must start passing once the defect is fixed).

Attacks: races of record/manifest/has_rows with retire and delete (many clients, deterministic
interleavings forced by gating one client's requests), ids with odd characters, escaping
collisions, objects crafted with a raw boto3 client (misfiled rows, index entries pointing at other
rows, rows of other rollouts or fingerprints, zstd bombs, huge objects, keys that parse oddly),
conflicts across fingerprints, failures of the store in the middle of an operation, invalid input,
the conformance suite's power to catch a broken ledger, and the ``s3capture conformance`` CLI on a
missing bucket and bad credentials.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import uuid
from typing import Any

import msgspec
import pytest
import zstandard

from gymcompat import require_gym
from helpers import (
    assistant_output,
    continuation,
    get_bytes,
    list_keys,
    make_commit,
    put_bytes,
    split_bucket_url,
    system,
    user,
)
from s3capture.conformance import run_conformance
from s3capture.fingerprint import assistant_fingerprint
from s3capture.ledger import LedgerConflictError, S3CaptureLedger
from s3capture.ledger_records import (
    LEDGER_CONFLICTING_ROWS_REASON,
    LEDGER_UNREADABLE_ROW_REASON,
    validate_manifest,
)
from s3capture.protocols import RolloutRetiredError
from s3capture.records import ParentResolutionStatus
from s3capture.store import StoreError

RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED
REQ = [system("Be brief."), user("Name a colour.")]

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _keys(client: Any, bucket_url: str, rollout_prefix_rel: str = "") -> list[str]:
    bucket, root = split_bucket_url(bucket_url)
    return list_keys(client, bucket, f"{root}rollouts/{rollout_prefix_rel}")


def _cids(manifest: dict) -> list[str]:
    return sorted(r["model_call_id"] for r in manifest["records"])


def _chain(rid: str, n: int) -> list[dict]:
    """n commits forming one chain: call-0 (root), call-1 (child of call-0), ..."""
    out: list[dict] = []
    request = list(REQ)
    for i in range(n):
        commit = make_commit(
            rid, f"call-{i}", request, assistant_output(f"answer {i}"), parent=out[-1] if out else None
        )
        out.append(commit)
        request = continuation(commit, f"q{i}")
    return out


async def _request_count(ledger: S3CaptureLedger) -> int:
    return sum(ledger.request_counts.values())


# =========================================================================== races with retire
async def test_manifest_racing_retire_never_returns_a_partial_ledger(ledgers):
    rid = "race-manifest"
    commits = _chain(rid, 3)
    writer = ledgers()
    for c in commits:
        await writer.record(c)

    reader, retirer = ledgers(), ledgers()
    tomb_checked, may_list, listed = asyncio.Event(), asyncio.Event(), asyncio.Event()
    orig_retired, orig_list, orig_delete = reader._retired, reader._list, retirer._delete_keys

    async def retired(prefix: str) -> bool:
        try:
            return await orig_retired(prefix)
        finally:
            tomb_checked.set()

    async def gated_list(prefix: str, **options: Any) -> list:
        await may_list.wait()
        try:
            return await orig_list(prefix, **options)
        finally:
            listed.set()

    async def two_batches(keys: list[str]) -> None:
        # What retire does with more than 1,000 keys: several DeleteObjects, the parents' rows first.
        first = [k for k in keys if "/call-0/" in k or "/call-1/" in k]
        await orig_delete(first)
        may_list.set()
        await listed.wait()
        await asyncio.wait([manifest_task])  # the next batch is slower than the reader's row GETs
        await orig_delete([k for k in keys if k not in first])

    reader._retired, reader._list, retirer._delete_keys = retired, gated_list, two_batches
    manifest_task = asyncio.create_task(reader.manifest(rid))
    await tomb_checked.wait()
    await retirer.retire([rid])
    try:
        manifest = await manifest_task
    except RolloutRetiredError:
        return  # correct: the rollout was retired while the manifest was read
    # Also acceptable: the whole pre-retire ledger. Never a ledger with a hole and no failures.
    assert manifest["failures"] or _cids(manifest) == ["call-0", "call-1", "call-2"], manifest


async def test_has_rows_racing_retire_never_reports_an_unused_id(ledgers):
    rid = "race-has-rows"
    await ledgers().record(make_commit(rid, "call-0", REQ, assistant_output("x")))
    reader, retirer = ledgers(), ledgers()
    listing, retired_done = asyncio.Event(), asyncio.Event()
    orig_page = reader._list_page

    async def gated_page(prefix: str, max_keys: int, token: Any = None, start_after: Any = None) -> list:
        # has_rows has started; its LISTs run only after the retire deleted every row.
        listing.set()
        await retired_done.wait()
        return await orig_page(prefix, max_keys, token, start_after)

    reader._list_page = gated_page
    task = asyncio.create_task(reader.has_rows(rid))
    await listing.wait()
    await retirer.retire([rid])
    retired_done.set()
    try:
        answer = await task
    except RolloutRetiredError:
        return
    assert answer is True


async def test_records_racing_retire_from_many_clients_are_all_discarded(ledgers, s3_client, bucket_url):
    """Many writers race a retire: afterwards no reader uses any row, a second retire removes the
    late rows, and delete makes the id read as unused."""
    rid = "race-many"
    await ledgers().record(make_commit(rid, "seed", REQ, assistant_output("seed")))
    commits = [make_commit(rid, f"call-{i}", REQ, assistant_output(f"t{i}")) for i in range(24)]
    writers = [ledgers() for _ in range(8)]

    async def write(i: int, c: dict) -> None:
        await asyncio.sleep((i % 6) * 0.01)
        await writers[i % len(writers)].record(c)

    results = await asyncio.gather(
        *(write(i, c) for i, c in enumerate(commits)), ledgers().retire([rid]), return_exceptions=True
    )
    assert not [r for r in results if isinstance(r, BaseException)], results
    reader = ledgers()
    with pytest.raises(RolloutRetiredError):
        await reader.manifest(rid)
    with pytest.raises(RolloutRetiredError):
        await reader.has_rows(rid)
    for c in commits:
        assert (await reader.resolve(rid, continuation(c))).status == UNRESOLVED
    # The writers' own caches hold their rows: they must not resolve either.
    for w in writers:
        assert (await w.resolve(rid, continuation(commits[0]))).status == UNRESOLVED
    await ledgers().retire([rid])
    assert [k for k in _keys(s3_client, bucket_url, f"{rid}/") if "/ledger" in k] == []
    await ledgers().delete([rid])
    assert await reader.has_rows(rid) is False
    assert (await reader.manifest(rid))["records"] == []
    assert _keys(s3_client, bucket_url, f"{rid}/") == []


async def test_concurrent_identical_records_are_one_row_and_conflicting_ones_never_resolve(ledgers):
    rid = "race-conflict"
    same = make_commit(rid, "call-1", REQ, assistant_output("same"))
    await asyncio.gather(*(ledgers().record(copy.deepcopy(same)) for _ in range(16)))
    manifest = await ledgers().manifest(rid)
    assert _cids(manifest) == ["call-1"] and manifest["failures"] == []

    # 12 different payloads for one call id, under 12 different fingerprints, all at once.
    variants = [make_commit(rid, "call-2", REQ, assistant_output(f"v{i}")) for i in range(12)]
    results = await asyncio.gather(*(ledgers().record(v) for v in variants), return_exceptions=True)
    # Racing writers may all miss each other (no compare-and-swap): readers must see the conflict.
    assert all(r is None or isinstance(r, LedgerConflictError) for r in results), results
    reader = ledgers()
    manifest = await reader.manifest(rid)
    assert "call-2" not in _cids(manifest)
    assert {"schema_version": 2, "model_call_id": "call-2", "reason": LEDGER_CONFLICTING_ROWS_REASON} in manifest[
        "failures"
    ]
    for v in variants:
        assert (await reader.resolve(rid, continuation(v))).status == UNRESOLVED
    validate_manifest(manifest)


async def test_conflicting_writers_in_several_processes_never_resolve(ledgers, s3_env, bucket_url):
    """Four processes record four payloads of one call id (and a retry of their own) at once."""
    import os

    from helpers import forkserver_context
    from test_ledger import _record_worker

    rid = "procs"
    variants = [make_commit(rid, "call-1", REQ, assistant_output(f"p{p}")) for p in range(4)]
    context = forkserver_context()  # a preloaded forkserver: no interpreter start-up per process
    results = context.Queue()
    env = {**os.environ, **s3_env.env()}
    procs = [context.Process(target=_record_worker, args=(bucket_url, env, [v, v], results)) for v in variants]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert all(o == ("ok", 2) or (o[0] == "error" and "LedgerConflictError" in o[1]) for o in outcomes), outcomes
    reader = ledgers()
    manifest = await reader.manifest(rid)
    assert manifest["records"] == []
    assert manifest["failures"] == [
        {"schema_version": 2, "model_call_id": "call-1", "reason": LEDGER_CONFLICTING_ROWS_REASON}
    ]
    for v in variants:
        assert (await reader.resolve(rid, continuation(v))).status == UNRESOLVED


async def test_conflict_across_fingerprints_in_a_chain_never_resolves_the_child(ledgers):
    """The parent is conflicted under another fingerprint: neither it nor its continuation resolves."""
    rid = "chain-conflict"
    root, child = _chain(rid, 2)
    w = ledgers()
    await w.record(root)
    await w.record(child)
    other = make_commit(rid, "call-1", REQ, assistant_output("something else"), parent=root)
    with pytest.raises(LedgerConflictError):
        await ledgers().record(other)
    for ledger in (w, ledgers()):
        assert (await ledger.resolve(rid, continuation(child))).status == UNRESOLVED
        assert (await ledger.resolve(rid, continuation(other))).status == UNRESOLVED
        # The root is still a fine parent.
        r = await ledger.resolve(rid, continuation(root))
        assert r.status == RESOLVED and r.match.model_call_id == "call-0"


# =========================================================================== odd ids
ODD_IDS = [
    "a/b",
    "a.2Fb",
    "a.2E2Fb",
    ".",
    "..",
    "~",
    "~x",
    "-",
    "_",
    "a b",
    "a\nb",
    "\x00",
    "é",
    "e\u0301",
    "日本語",
    "🦜",
    "a%2Fb",
    "A",
    "a",
    "rollouts",
    "r1",
    "r10",
    "x" * 255,
]


async def test_odd_rollout_and_call_ids_are_isolated_and_round_trip(ledgers, s3_client, bucket_url):
    w = ledgers()
    for i, rid in enumerate(ODD_IDS):
        cid = ODD_IDS[(i + 3) % len(ODD_IDS)]
        await w.record(make_commit(rid, cid, REQ, assistant_output(f"text {i}")))
        await w.record_failure(rid, cid + "!", "worker_capture_failed")
    reader = ledgers()
    for i, rid in enumerate(ODD_IDS):
        cid = ODD_IDS[(i + 3) % len(ODD_IDS)]
        manifest = await reader.manifest(rid)
        validate_manifest(manifest)
        assert manifest["rollout_id"] == rid
        assert _cids(manifest) == [cid], (rid, manifest)
        assert manifest["failures"] == [
            {"schema_version": 2, "model_call_id": cid + "!", "reason": "worker_capture_failed"}
        ]
        r = await reader.resolve(rid, [*REQ, *assistant_output(f"text {i}"), user("more")])
        assert r.status == RESOLVED and r.match.model_call_id == cid
    # Case and Unicode normalization are distinct ids; retire of one leaves the others intact.
    await reader.retire(["a"])
    assert _cids(await reader.manifest("A")) == [ODD_IDS[(ODD_IDS.index("A") + 3) % len(ODD_IDS)]]
    await reader.retire(["é"])
    assert (await reader.manifest("e\u0301"))["records"]
    await reader.retire(["r1"])
    assert (await reader.manifest("r10"))["records"]


async def test_call_ids_that_extend_each_other_are_not_a_conflict(ledgers):
    """Every LIST prefix ends in '/': recording call ``c1`` after ``c10`` (and ``c1/`` after ``c1``)
    in one rollout sees no other call's row, and each call resolves and is listed on its own."""
    rid = "prefix-calls"
    cids = ["c10", "c1", "c1/", "c1/0", "c"]
    commits = {cid: make_commit(rid, cid, REQ, assistant_output(f"answer of {cid}")) for cid in cids}
    w = ledgers()
    for cid in cids:
        await w.record(commits[cid])  # a LedgerConflictError here is a LIST that saw another call
        await ledgers().record(commits[cid])  # an identical retry from another client: still no conflict
    m = await ledgers().manifest(rid)
    validate_manifest(m)
    assert m["failures"] == [] and _cids(m) == sorted(cids)
    reader = ledgers()
    for cid in cids:
        r = await reader.resolve(rid, continuation(commits[cid]))
        assert r.status == RESOLVED and r.match.model_call_id == cid, (cid, r)


async def test_unstorable_ids_and_bad_inputs_fail_before_any_request(ledgers):
    ledger = ledgers()
    good = make_commit("r", "c", REQ, assistant_output("x"))
    await ledger.record(good)
    before = await _request_count(ledger)
    bad_commits = []
    for path, value in [
        (("rollout_id",), "x" * 256),
        (("rollout_id",), "é" * 43),  # 258 escaped bytes
        (("rollout_id",), "a\ud800"),
        (("rollout_id",), ""),
        (("record", "model_call_id"), "c" * 256),
        (("record", "model_call_id"), "\udfff"),
        (("record", "staging_key"), ""),
        (("record", "digest"), "A" * 64),
        (("request_items",), [{"role": "user", "content": float("nan")}]),
    ]:
        c = copy.deepcopy(good)
        target = c
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value
        bad_commits.append(c)
    for c in bad_commits:
        with pytest.raises(ValueError):
            await ledger.record(c)
    for args in [
        ("r", "", "x"),
        ("r", "c", ""),
        ("r", "c", "bad\ud800"),
        ("", "c", "x"),
        ("r" * 300, "c", "x"),
        ("r", 5, "x"),
        ("r", "c", None),
    ]:
        with pytest.raises((ValueError, TypeError)):
            await ledger.record_failure(*args)
    for call in (
        lambda: ledger.retire("r"),
        lambda: ledger.delete("r"),
        lambda: ledger.retire(["ok", ""]),
        lambda: ledger.delete(["ok", "x" * 300]),
        lambda: ledger.manifest(""),
        lambda: ledger.has_rows("y" * 300),
        lambda: ledger.begin_call("r", ""),
    ):
        with pytest.raises((ValueError, TypeError)):
            await call()
    assert await _request_count(ledger) == before, ledger.request_counts
    # Nothing was lost: the good row is still the only one.
    m = await ledger.manifest("r")
    assert _cids(m) == ["c"] and m["failures"] == []


async def test_failure_row_of_a_call_id_starting_with_tilde_h_keeps_its_reason(ledgers):
    ledger = ledgers()
    for cid in ("~hello", "~h" + "0" * 64):
        await ledger.record_failure("r", cid, "worker_capture_failed")
    manifest = await ledger.manifest("r")
    assert manifest["failures"] == [
        {"schema_version": 2, "model_call_id": cid, "reason": "worker_capture_failed"}
        for cid in ("~h" + "0" * 64, "~hello")
    ]


async def test_call_id_at_the_key_budget_with_a_long_root_is_refused_before_any_request(ledgers, bucket_url, s3_client):
    bucket, _ = split_bucket_url(bucket_url)
    root = "/".join(["a" * 200, "b" * 200, "c" * 215])  # 617 bytes: the rollout prefix of "r" is 629
    ledger = ledgers(url=f"s3://{bucket}/{root}")
    prefix = ledger.layout.rollout("r")
    assert len(prefix) == 629
    cid = "k" * (1024 - 140 - len(prefix))  # exactly what check_call_id allows
    ledger.layout.check_call_id(prefix, cid)
    commit = make_commit("r", cid, REQ, assistant_output("x"))
    try:
        await ledger.record(commit)
    except ValueError:
        assert list_keys(s3_client, bucket, prefix) == []  # refused before any request
        return
    # Accepted: then every key it wrote must fit S3's limit (moto does not enforce it, AWS S3 does).
    too_long = [len(k.encode()) for k in list_keys(s3_client, bucket, prefix) if len(k.encode()) > 1024]
    assert too_long == []


async def test_failure_row_of_an_unstorable_call_id_lands_under_the_longest_rollout_prefix(
    ledgers, bucket_url, s3_client
):
    # ledger/fail/~h<sha256>/<sha256>.json is the longest key s3capture writes (148 bytes after the
    # rollout prefix): a prefix that left no room for it made record_failure fail on Ceph and
    # SeaweedFS, or, with a spill, acknowledge a row that could never be stored.
    bucket, _ = split_bucket_url(bucket_url)
    root = "/".join(["p" * 174] * 4)  # 699 bytes
    rid = "R" * (876 - len(root) - len("/rollouts/") - 1)
    ledger = ledgers(url=f"s3://{bucket}/{root}")
    prefix = ledger.layout.rollout(rid)
    assert len(prefix.encode()) == 876
    with pytest.raises(ValueError, match="1024-byte limit"):
        await ledger.record_failure(rid + "R", "c" * 300, "worker_capture_failed")
    await ledger.record_failure(rid, "c" * 300, "worker_capture_failed")
    keys = list_keys(s3_client, bucket, prefix)
    assert len(keys) == 1 and len(keys[0].encode()) == 1024
    manifest = await ledgers(url=f"s3://{bucket}/{root}").manifest(rid)
    assert [f["reason"] for f in manifest["failures"]] == ["worker_capture_failed"]


# =========================================================================== crafted objects
def _row_key(client: Any, bucket_url: str, rid: str, cid: str) -> str:
    (key,) = _keys(client, bucket_url, f"{rid}/ledger/row/{cid}/")
    return key


async def test_a_row_filed_under_another_call_id_never_resolves(ledgers, s3_client, bucket_url):
    rid = "misfiled"
    y = make_commit(rid, "call-y", REQ, assistant_output("yy"))
    w = ledgers()
    await w.record(y)
    # Y is conflicted under another fingerprint: Y must count as zero candidates.
    with pytest.raises(LedgerConflictError):
        await w.record(make_commit(rid, "call-y", REQ, assistant_output("other")))
    bucket, root = split_bucket_url(bucket_url)
    fp = assistant_fingerprint(REQ + assistant_output("yy"))
    (index_key,) = _keys(s3_client, bucket_url, f"{rid}/ledger-index/{fp}/call-y/")
    sha = index_key.rsplit("/", 1)[-1]
    body = get_bytes(s3_client, bucket, f"{root}rollouts/{rid}/ledger/row/call-y/{sha}.json")
    # Y's row of this fingerprint, re-filed under call-x (row and index); Y's index entry gone.
    put_bytes(s3_client, bucket, f"{root}rollouts/{rid}/ledger/row/call-x/{sha}.json", body)
    put_bytes(s3_client, bucket, f"{root}rollouts/{rid}/ledger-index/{fp}/call-x/{sha}", b"")
    s3_client.delete_object(Bucket=bucket, Key=index_key)
    manifest = await ledgers().manifest(rid)
    assert not manifest["records"] and manifest["failures"]
    r = await ledgers().resolve(rid, continuation(y))
    assert r.status == UNRESOLVED, r


async def test_index_entries_pointing_at_other_rows_never_resolve(ledgers, s3_client, bucket_url):
    """Index entries naming another call's row, another rollout's row, or a row of another fingerprint."""
    bucket, root = split_bucket_url(bucket_url)
    a = make_commit("ra", "call-a", REQ, assistant_output("aa"))
    b = make_commit("rb", "call-b", REQ, assistant_output("aa"))  # same fingerprint, other rollout
    w = ledgers()
    await w.record(a)
    await w.record(b)
    b_key = _row_key(s3_client, bucket_url, "rb", "call-b")
    b_sha = b_key.rsplit("/", 1)[-1][:-5]
    fp = json.loads(get_bytes(s3_client, bucket, b_key))["fingerprint"]
    # 1. rollout rb's row copied into rollout rc with its index: it belongs to another rollout.
    put_bytes(
        s3_client, bucket, f"{root}rollouts/rc/ledger/row/call-b/{b_sha}.json", get_bytes(s3_client, bucket, b_key)
    )
    put_bytes(s3_client, bucket, f"{root}rollouts/rc/ledger-index/{fp}/call-b/{b_sha}", b"")
    reader = ledgers()
    assert (await reader.resolve("rc", continuation(b))).status == UNRESOLVED
    m = await reader.manifest("rc")
    assert m["records"] == [] and m["failures"] == [
        {"schema_version": 2, "model_call_id": "call-b", "reason": LEDGER_UNREADABLE_ROW_REASON}
    ]
    # 2. in ra, an index entry of call-z naming rb's row sha (no such row under call-z).
    put_bytes(s3_client, bucket, f"{root}rollouts/ra/ledger-index/{fp}/call-z/{b_sha}", b"")
    assert (await reader.resolve("ra", continuation(a))).status == UNRESOLVED
    # 3. in rd, a row filed under a fingerprint it does not carry.
    d = make_commit("rd", "call-d", REQ, assistant_output("dd"))
    await w.record(d)
    d_key = _row_key(s3_client, bucket_url, "rd", "call-d")
    d_sha = d_key.rsplit("/", 1)[-1][:-5]
    put_bytes(s3_client, bucket, f"{root}rollouts/rd/ledger-index/{fp}/call-d/{d_sha}", b"")
    r = await ledgers().resolve("rd", continuation(a))  # a continuation of "aa" must not find call-d
    assert r.status == UNRESOLVED
    # 4. Odd keys under the index are ignored, never crash.
    for junk in (
        f"ledger-index/{fp}/",
        f"ledger-index/{fp}/call-a/",
        f"ledger-index/{fp}/.ZZ/{b_sha}",
        f"ledger-index/{fp}/call-a/{b_sha}/extra",
        f"ledger-index/{fp}//{b_sha}",
    ):
        put_bytes(s3_client, bucket, f"{root}rollouts/re/{junk}", b"")
    assert (await ledgers().resolve("re", continuation(a))).status == UNRESOLVED


@pytest.mark.parametrize("kind", ["zstd_bomb", "huge_plain", "huge_zstd_frame_header", "empty", "truncated_zstd"])
async def test_hostile_row_bodies_fail_closed(ledgers, s3_client, bucket_url, kind):
    rid = f"hostile-{kind}"
    bucket, root = split_bucket_url(bucket_url)
    c = make_commit(rid, "call-1", REQ, assistant_output("x"))
    await ledgers().record(c)
    key = _row_key(s3_client, bucket_url, rid, "call-1")
    if kind == "zstd_bomb":
        body = zstandard.ZstdCompressor(level=19).compress(b"\x00" * (64 * 1024 * 1024))
    elif kind == "huge_plain":
        body = b" " * (5 * 1024 * 1024)
    elif kind == "huge_zstd_frame_header":
        body = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(b"[" * (8 * 1024 * 1024))
    elif kind == "empty":
        body = b""
    else:
        body = zstandard.ZstdCompressor().compress(get_bytes(s3_client, bucket, key) * 3)[:-7]
    put_bytes(s3_client, bucket, key, body)
    reader = ledgers(cache_bytes=1024)
    m = await reader.manifest(rid)
    assert m["records"] == []
    assert m["failures"] == [{"schema_version": 2, "model_call_id": "call-1", "reason": LEDGER_UNREADABLE_ROW_REASON}]
    assert (await reader.resolve(rid, continuation(c))).status == UNRESOLVED


async def test_keys_that_unescape_to_invalid_call_ids_still_give_a_valid_poisoned_manifest(
    ledgers, s3_client, bucket_url
):
    bucket, root = split_bucket_url(bucket_url)
    await ledgers().record(make_commit("odd", "call-1", REQ, assistant_output("x")))
    for rel in ("ledger/intent/~", "ledger/intent/.ED.A0.80"):
        put_bytes(s3_client, bucket, f"{root}rollouts/odd/{rel}", b"")
    manifest = await ledgers().manifest("odd")
    validate_manifest(manifest)
    assert manifest["failures"]


async def test_foreign_and_odd_keys_under_the_ledger_poison_the_manifest(ledgers, s3_client, bucket_url):
    bucket, root = split_bucket_url(bucket_url)
    c = make_commit("fk", "call-1", REQ, assistant_output("x"))
    await ledgers().record(c)
    sha = "0" * 64
    odd = [
        f"ledger/row/call-1/{sha.upper()}.json",  # upper-case sha: not s3capture's
        f"ledger/row/call-2/{sha}.JSON",
        f"ledger/row/call.2f/{sha}.json",  # non-canonical escape
        f"ledger/row/~h{sha}/{sha}.json",  # a hashed id never names a committed row
        f"ledger/fail/call-3/{sha}",
        "ledger/intent/call-4/extra",
        "ledger/",
        "ledger/row/",
    ]
    for rel in odd:
        put_bytes(s3_client, bucket, f"{root}rollouts/fk/{rel}", b"junk")
    manifest = await ledgers().manifest("fk")
    validate_manifest(manifest)
    # call-1's row is joined by a foreign object in its own directory: at least it must not look clean.
    assert manifest["failures"]
    reasons = {f["model_call_id"]: f["reason"] for f in manifest["failures"]}
    assert "call-1" in reasons or f"ledger/row/call-1/{sha.upper()}.json" in reasons
    # A foreign object in a call's row directory blocks that call's resolution (never a guess).
    assert (await ledgers().resolve("fk", continuation(c))).status == UNRESOLVED


async def test_failure_rows_crafted_for_other_calls_or_rollouts_never_unpoison(ledgers, s3_client, bucket_url):
    """A failure row whose body names another call or rollout still poisons, and never resolves."""
    bucket, root = split_bucket_url(bucket_url)
    w = ledgers()
    await w.record_failure("f1", "call-1", "worker_capture_failed")
    (key,) = _keys(s3_client, bucket_url, "f1/ledger/fail/")
    body = get_bytes(s3_client, bucket, key)
    sha = key.rsplit("/", 1)[-1][:-5]
    put_bytes(s3_client, bucket, f"{root}rollouts/f2/ledger/fail/call-1/{sha}.json", body)  # other rollout
    put_bytes(s3_client, bucket, f"{root}rollouts/f1/ledger/fail/call-9/{sha}.json", body)  # other call
    for rid, cid in (("f2", "call-1"), ("f1", "call-9")):
        m = await ledgers().manifest(rid)
        assert {"schema_version": 2, "model_call_id": cid, "reason": LEDGER_UNREADABLE_ROW_REASON} in m["failures"]


# =========================================================================== store failures mid-operation
class _FailingPuts(S3CaptureLedger):
    """Refuses PUTs whose key contains ``self.fail_on`` (a store that answered 500 five times)."""

    fail_on = "\0"

    async def _put(self, key: str, body: bytes) -> None:
        if self.fail_on in key:
            raise StoreError(f"PUT {key} failed: injected 500")
        await super()._put(key, body)


@pytest.mark.parametrize("fail_on", ["/ledger/row/", "/ledger-index/"])
async def test_record_that_half_fails_never_yields_a_wrong_parent(ledgers, fail_on):
    rid = f"half-{fail_on.strip('/').replace('/', '-')}"
    c = make_commit(rid, "call-1", REQ, assistant_output("x"))
    w = ledgers()
    w.__class__ = _FailingPuts
    w.fail_on = fail_on
    with pytest.raises(StoreError):
        await w.record(c)
    for reader in (w, ledgers()):
        r = await reader.resolve(rid, continuation(c))
        assert r.status == UNRESOLVED  # the row is missing (index residue) or was never indexed
    # The caller saw the error and records a failure row, as the protocol says: never trainable.
    await ledgers().record_failure(rid, "call-1", "worker_capture_failed")
    assert (await ledgers().manifest(rid))["failures"]
    # A retry of the record is refused now, as Gym's ledgers refuse it: the call has a failure row.
    with pytest.raises(LedgerConflictError, match="failure row"):
        await ledgers().record(c)
    manifest = await ledgers().manifest(rid)
    assert _cids(manifest) == ["call-1"] and [f["model_call_id"] for f in manifest["failures"]] == ["call-1"]


async def test_retire_and_delete_that_half_fail_leave_the_rollout_retired(ledgers, s3_client, bucket_url):
    rid = "half-retire"
    for c in _chain(rid, 3):
        await ledgers().record(c)
    w = ledgers()
    w.__class__ = _FailingPuts
    # An open rollout's retire writes the retired fence, then the tombstone: the fence lands, the
    # tombstone's PUT fails. The retire did not happen (readers go by the tombstone): the ledger
    # stays whole and readable, never half-removed; a second retire finishes.
    w.fail_on = f"{rid}/retired"
    with pytest.raises(StoreError):
        await w.retire([rid])
    assert len((await ledgers().manifest(rid))["records"]) == 3
    assert (await ledgers().retire([rid]))["removed"] == [rid]
    with pytest.raises(RolloutRetiredError):
        await ledgers().manifest(rid)

    d = ledgers()
    orig = d._delete_one

    async def tombstone_delete_fails(key: str) -> None:
        if key.endswith(f"{rid}/retired"):  # rows gone, tombstone and fence not
            raise StoreError("DELETE failed: injected")
        await orig(key)

    d._delete_one = tombstone_delete_fails
    await ledgers().record(_chain(rid, 1)[0])  # a late row beside the fence
    with pytest.raises(StoreError):
        await d.delete([rid])
    with pytest.raises(RolloutRetiredError):
        await ledgers().manifest(rid)  # still retired, never a half-deleted live ledger
    await ledgers().delete([rid])
    assert await ledgers().has_rows(rid) is False


# =========================================================================== input Gym accepts
async def test_commits_gym_accepts_at_the_edges_are_stored_and_read_back(ledgers):
    require_gym()  # skip without Gym, fail under CI
    import nemo_gym.token_id_capture.staging.records as gym

    base = make_commit("edges", "c", REQ, assistant_output("x"))
    variants = []
    for i, patch in enumerate(
        [
            {"weight_version": 2**70},
            {"prev_len": 0, "delta_len": 2**64, "cum_len": 2**64},
            {"admitted_at": None},
            {"admitted_at": 1e308},
            {"response_id": "r" * 100_000},
            {"staging_key": "🦜/\u0000/" + "k" * 5000},
        ]
    ):
        c = copy.deepcopy(base)
        c["record"]["model_call_id"] = f"c{i}"
        c["response_items"] = assistant_output(f"x{i}")
        c["record"].update(patch)
        gym.CaptureLedgerCommit.model_validate(c)
        variants.append(c)
    w = ledgers()
    for c in variants:
        await w.record(gym.CaptureLedgerCommit.model_validate(c))
        await w.record(c)  # the dict form is the same payload: a no-op
    m = await ledgers().manifest("edges")
    validate_manifest(m)
    assert m["failures"] == []
    got = {r["model_call_id"]: r for r in m["records"]}
    for c in variants:
        want = gym.CaptureLedgerCommit.model_validate(c).record.model_dump(mode="json")
        assert got[c["record"]["model_call_id"]] == want
        gym.RolloutManifest.model_validate(m)


def _big_chain(n: int) -> list[str]:
    return [f"s3://staging/big/{i:08d}/{uuid.UUID(int=i).hex}" for i in range(n)]


def _row_bytes(commit: dict) -> int:
    """Bytes of the JSON row ``record`` would store for ``commit`` (before compression)."""
    from s3capture.fingerprint import FINGERPRINT_VERSION, conversation_digest
    from s3capture.ledger import _ROW_FORMAT, _Row
    from s3capture.ledger_records import validate_commit

    c = validate_commit(commit)
    request = list(c.request_items)
    row = _Row(
        format=_ROW_FORMAT,
        rollout_id=c.rollout_id,
        record=c.record,
        staging_chain=list(c.staging_chain),
        fingerprint=assistant_fingerprint(request + list(c.response_items)) or None,
        fingerprint_version=FINGERPRINT_VERSION,
        context_len=len(request),
        context_digest=conversation_digest(request),
    )
    return len(msgspec.json.encode(row, order="sorted"))


def _commit_near_the_row_limit(rid: str, cid: str, *, over: bool) -> dict:
    """A commit whose row is the largest ``record`` accepts (within one chain key), or one key over it."""
    from s3capture.ledger import _MAX_ROW_BYTES

    c = make_commit(rid, cid, REQ, assistant_output("x"))
    per_key = len(json.dumps(_big_chain(2)[1])) + 1
    c["staging_chain"] = _big_chain(2)
    n = 2 + (_MAX_ROW_BYTES - _row_bytes(c)) // per_key  # fills the row up to the limit
    while True:
        c["staging_chain"] = _big_chain(n)
        size = _row_bytes(c)
        if size > _MAX_ROW_BYTES:
            n -= 1
        elif _row_bytes({**c, "staging_chain": _big_chain(n + 1)}) <= _MAX_ROW_BYTES:
            n += 1
        else:
            break
    if over:
        c["staging_chain"] = _big_chain(n + 1)
        assert _row_bytes(c) > _MAX_ROW_BYTES
    else:
        assert _MAX_ROW_BYTES - per_key < _row_bytes(c) <= _MAX_ROW_BYTES
    return c


async def test_a_row_record_accepts_is_readable_by_every_client(ledgers):
    """The largest row ``record`` accepts (its JSON within one chain key of the reader's limit) is
    read back whole by other clients: resolve hands back its staging chain, manifest lists it."""
    c = _commit_near_the_row_limit("big", "call-1", over=False)
    await ledgers().record(c)
    r_other = await ledgers().resolve("big", continuation(c))
    assert r_other.status == RESOLVED, r_other
    assert r_other.match.model_call_id == "call-1"
    assert list(r_other.match.staging_chain) == c["staging_chain"]
    assert r_other.match.prev_len == c["record"]["cum_len"]
    m = await ledgers().manifest("big")
    assert m["failures"] == [] and _cids(m) == ["call-1"]
    validate_manifest(m)


async def test_a_row_over_the_limit_is_refused_before_any_request(ledgers, s3_client, bucket_url):
    """One chain key more and ``record`` refuses the row (a RecordError, a ValueError) without storing it."""
    c = _commit_near_the_row_limit("big-over", "call-1", over=True)
    w = ledgers()
    with pytest.raises(ValueError, match="limit"):
        await w.record(c)
    assert await _request_count(w) == 0
    assert _keys(s3_client, bucket_url, "big-over/") == []


# =========================================================================== the conformance suite
class _ResolveIgnoresOtherFingerprints(S3CaptureLedger):
    """Broken: resolve skips the per-candidate LIST of all its rows, so a conflict filed under another
    fingerprint is invisible to it (record still refuses the second payload, manifest still poisons)."""

    async def resolve(self, rollout_id: str, request_items: list[dict]) -> Any:
        self._resolving = True
        try:
            return await super().resolve(rollout_id, request_items)
        finally:
            self._resolving = False

    async def _list(self, prefix: str) -> list:
        items = await super()._list(prefix)
        if getattr(self, "_resolving", False) and "/ledger/row/" in prefix:
            return items[:1]
        return items


async def test_conformance_catches_a_resolve_that_ignores_conflicts_under_other_fingerprints(ledgers, bucket_url):
    import aioboto3

    session = aioboto3.Session()
    broken = _ResolveIgnoresOtherFingerprints(bucket_url, session=session)
    # It really is broken: a conflicted call id resolves.
    first = make_commit("gap", "call-1", REQ, assistant_output("a"))
    await broken.record(first)
    with pytest.raises(LedgerConflictError):
        await broken.record(make_commit("gap", "call-1", REQ, assistant_output("b")))
    assert (await broken.resolve("gap", continuation(first))).status == RESOLVED
    await broken.close()
    report = await run_conformance(
        ledger_factory=lambda: _ResolveIgnoresOtherFingerprints(bucket_url, session=session),
        only=[
            "ledger_record_visibility",
            "ledger_idempotent_record",
            "ledger_conflicting_record",
            "ledger_failure_rows",
            "ledger_retire",
            "ledger_delete_reuse",
        ],
    )
    assert report.failed, [(r.name, r.status) for r in report.results]


def _run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from s3capture.cli import main; sys.exit(main(sys.argv[1:]))", *args],
        env={**os.environ, **env, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=300,
    )


async def test_conformance_cli_on_a_missing_bucket_is_a_clear_error(s3_server):
    proc = _run_cli(
        ["conformance", f"s3://no-such-bucket-{uuid.uuid4().hex[:10]}/p", "--endpoint", s3_server.endpoint_url],
        s3_server.env(),
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "does not exist" in proc.stderr and "NOT CONFORMANT" not in proc.stdout
    assert "Traceback" not in proc.stderr


async def test_conformance_cli_with_bad_credentials_never_reports_conformant(s3_server, bucket_url):
    if s3_server.kind == "moto":
        pytest.skip("moto does not check credentials (the seaweedfs run checks this)")
    env = {**s3_server.env(), "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0", "AWS_SECRET_ACCESS_KEY": "wrong"}
    proc = _run_cli(
        ["conformance", bucket_url, "--endpoint", s3_server.endpoint_url, "--check", "ledger_record_visibility"], env
    )
    assert proc.returncode != 0, proc.stdout
    assert "refused" in (proc.stdout + proc.stderr) or "InvalidAccessKeyId" in (proc.stdout + proc.stderr)


# --------------------------------------------------------------------------- a ledger breaker (reliability.md, finding 19)
@pytest.mark.all_transports
async def test_a_call_with_a_failure_row_is_refused_and_never_a_parent(ledgers):
    """Gym's ledgers refuse ``record`` for a call whose failure row they hold, and never resolve
    to it; s3capture acknowledged the row and resolved to the failed call."""
    commit = make_commit("r1", "c1", REQ, assistant_output("red"))
    writer = ledgers()
    await writer.record_failure("r1", "c1", "worker_capture_failed")
    with pytest.raises(LedgerConflictError, match="failure row"):
        await writer.record(commit)
    resolution = await ledgers().resolve("r1", continuation(commit))
    assert (resolution.status, resolution.reason) == (UNRESOLVED, "failed_candidate")
    # The other order: committed first, then the failure. Never a parent either.
    other = make_commit("r2", "c1", REQ, assistant_output("red"))
    await writer.record(other)
    assert (await ledgers().resolve("r2", continuation(other))).status == RESOLVED
    await writer.record_failure("r2", "c1", "worker_capture_failed")
    resolution = await ledgers().resolve("r2", continuation(other))
    assert (resolution.status, resolution.reason) == (UNRESOLVED, "failed_candidate")


@pytest.mark.all_transports
async def test_has_rows_is_not_decided_by_one_listing_that_lost_the_only_key(ledgers, proxy):
    """Gym's sink admits an unresolved continuation as a fresh root when ``has_rows`` is False:
    one LIST answer that left out the only row made it False."""
    from faultproxy import ListSkip, once

    writer = ledgers()
    await writer.record(make_commit("r", "c1", REQ, assistant_output("red")))
    reader = ledgers(endpoint_url=proxy.endpoint)
    proxy.rule = once(lambda r: r.is_list and r.params.get("prefix", "").endswith("/ledger/row/"), ListSkip(0))
    assert await reader.has_rows("r") is True
    assert proxy.rule.left == [0], "the LIST was not answered short: the test proves nothing"
    assert await ledgers().has_rows("nobody") is False  # and an empty one is still empty


@pytest.mark.all_transports
async def test_a_cut_404_answer_is_read_again(ledgers, proxy):
    """A 404 whose error document was cut (the retire tombstone's GET on a live rollout) failed
    manifest, has_rows and resolve with StoreError, where a cut object body is read again."""
    from faultproxy import CutBody, once

    commit = make_commit("r", "c1", REQ, assistant_output("red"))
    await ledgers().record(commit)
    reader = ledgers(endpoint_url=proxy.endpoint)
    tombstone = lambda r: r.method == "GET" and not r.is_list and r.key.endswith("/retired")  # noqa: E731
    for call in (reader.manifest("r"), reader.has_rows("r"), reader.resolve("r", continuation(commit))):
        proxy.rule = once(tombstone, CutBody(0.5))
        assert await call
        assert proxy.rule.left == [0], "the answer was not cut: the test proves nothing"


@pytest.mark.all_transports
async def test_two_short_bodies_in_a_row_do_not_make_a_healthy_row_damage(ledgers, proxy):
    """A row body cut short with a matching Content-Length twice in a row (identical bytes, which
    the transport takes as the object's where ETags are not MD5s) read as a corrupt row: the
    manifest called the rollout damaged (``unreadable_ledger_row``)."""
    from faultproxy import ShortBody, once

    await ledgers().record(make_commit("r", "c1", REQ, assistant_output("red")))
    reader = ledgers(endpoint_url=proxy.endpoint)
    proxy.rule = once(lambda r: r.method == "GET" and "/ledger/row/" in r.key, ShortBody(0.5), 2)
    manifest = await reader.manifest("r")
    assert proxy.rule.left == [0], "the bodies were not cut: the test proves nothing"
    assert [record["model_call_id"] for record in manifest["records"]] == ["c1"] and manifest["failures"] == []
