"""S3CaptureLedger against real S3 endpoints (moto and SeaweedFS in server mode).

The protocol contracts are also checked by the conformance suite (tests/test_conformance.py); this
file covers what is specific to the S3 design (docs/ledger.md): the acceptance facts of issue 3,
conflicts that only readers can see (concurrent writers, conflicts across fingerprints), crash
residue, corrupt and foreign objects, request budgets, Gym interoperability, several processes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Any

import pytest

from helpers import (
    put_bytes_at_folder_key,
    assistant_output,
    continuation,
    forkserver_context,
    get_bytes,
    list_keys,
    make_commit,
    put_bytes,
    split_bucket_url,
    system,
    user,
)
from s3capture.ledger import LedgerConflictError, S3CaptureLedger
from s3capture.ledger_records import (
    LEDGER_CONFLICTING_ROWS_REASON,
    LEDGER_FOREIGN_OBJECT_REASON,
    LEDGER_UNREADABLE_ROW_REASON,
    to_wire,
    validate_commit,
    validate_manifest,
)
from s3capture.protocols import CaptureLedger, RolloutRetiredError
from s3capture.records import ParentResolutionStatus, RecordError

RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED
ROOT = ParentResolutionStatus.ROOT
PUT, GET, LIST = "PutObject", "GetObject", "ListObjectsV2"

REQ = [system("Be brief."), user("Name a colour.")]


# --------------------------------------------------------------------------- acceptance of issue 3


async def test_record_after_retire_is_discarded_and_delete_starts_an_empty_ledger(ledgers, s3_client, bucket_url):
    writer, builder, late = ledgers(), ledgers(), ledgers()
    first = make_commit("r", "call-1", REQ, assistant_output("red"))
    await writer.record(first)
    assert (await builder.manifest("r"))["records"][0]["model_call_id"] == "call-1"
    assert await builder.retire(["r"]) == {"removed": ["r"], "absent": []}

    # A second execution of the finished rollout writes after the retire: discarded.
    stale = make_commit("r", "call-2", continuation(first), assistant_output("blue"), parent=first)
    await late.record(stale)
    await late.record_failure("r", "call-3", "worker_capture_failed")
    with pytest.raises(RolloutRetiredError):
        await builder.manifest("r")
    with pytest.raises(RolloutRetiredError):
        await ledgers().has_rows("r")
    resolution = await ledgers().resolve("r", continuation(stale))
    assert resolution.status == UNRESOLVED and resolution.reason == "retired"
    bucket, root = split_bucket_url(bucket_url)
    late_keys = list_keys(s3_client, bucket, f"{root}rollouts/r/ledger")  # ledger/ and ledger-index/
    assert len(late_keys) == 3  # row, index and failure row: discarded, not yet removed
    # Retiring again removes what landed late (and says so); the fence stays.
    assert await builder.retire(["r"]) == {"removed": ["r"], "absent": []}
    assert list_keys(s3_client, bucket, f"{root}rollouts/r/ledger") == []
    assert await builder.retire(["r"]) == {"removed": [], "absent": ["r"]}

    assert await builder.delete(["r"]) == {"removed": ["r"], "absent": []}
    assert list_keys(s3_client, bucket, f"{root}rollouts/r/") == []
    fresh = ledgers()
    assert await fresh.has_rows("r") is False
    assert await fresh.manifest("r") == {"schema_version": 2, "rollout_id": "r", "records": [], "failures": []}
    assert (await fresh.resolve("r", continuation(first))).status == UNRESOLVED
    await fresh.record(make_commit("r", "call-new", REQ, assistant_output("green")))
    assert [row["model_call_id"] for row in (await ledgers().manifest("r"))["records"]] == ["call-new"]
    assert await fresh.delete(["r"]) == {"removed": ["r"], "absent": []}
    assert await fresh.delete(["r"]) == {"removed": [], "absent": ["r"]}


async def test_manifest_validates_with_gyms_rollout_manifest_and_is_token_free(ledgers):
    from gymcompat import require_gym

    require_gym()
    from nemo_gym.token_id_capture.staging.records import CaptureLedgerCommit, RolloutManifest

    ledger = ledgers()
    root = make_commit("r", "call-1", REQ, assistant_output("red"))
    child = make_commit("r", "call-2", continuation(root), assistant_output("blue"), parent=root)
    # Gym's own pydantic commit is accepted as it is.
    await ledger.record(CaptureLedgerCommit.model_validate(root))
    await ledger.record(child)
    await ledger.record_failure("r", "call-3", "worker_capture_failed")
    manifest = await ledgers().manifest("r")
    parsed = RolloutManifest.model_validate(manifest)
    assert parsed.model_dump(mode="json") == manifest
    assert [r.model_call_id for r in parsed.records] == ["call-1", "call-2"]
    assert manifest["records"][1] == to_wire(validate_commit(child).record)
    assert [(f.model_call_id, f.reason) for f in parsed.failures] == [("call-3", "worker_capture_failed")]
    assert "token_ids" not in json.dumps(manifest) and "log_probs" not in json.dumps(manifest)


async def test_resolve_match_carries_the_rows_custody_and_no_tokens(ledgers):
    root = make_commit("r", "call-1", REQ, assistant_output("red"), delta=7)
    child = make_commit("r", "call-2", continuation(root), assistant_output("blue"), parent=root, delta=5)
    await ledgers().record(root)
    await ledgers().record(child)
    reader = ledgers()
    first = await reader.resolve("r", continuation(root))
    assert first.status == RESOLVED and first.match.model_call_id == "call-1"
    second = await reader.resolve("r", continuation(child, "and then?"))
    assert second.status == RESOLVED
    match = second.match
    assert match.model_call_id == "call-2"
    assert match.staging_chain == ("r/call-1", "r/call-2")
    assert match.prev_len == 12
    assert match.chain_hash == child["record"]["chain_hash"]
    assert match.digest == child["record"]["cumulative_hash"]
    assert match.cumulative_token_ids == ()
    assert (await reader.resolve("r", REQ)).status == ROOT
    rewritten = [system("Be verbose."), user("Name a colour."), *assistant_output("red"), user("next")]
    assert (await reader.resolve("r", rewritten)).status == UNRESOLVED
    assert (await reader.resolve("r", [{"role": "assistant", "content": object()}])).status == UNRESOLVED


async def test_identical_outputs_resolve_to_one_parent_only_when_their_tokens_agree(ledgers):
    ledger = ledgers()
    a = make_commit("r", "call-a", REQ, assistant_output("red"))
    b = make_commit("r", "call-b", REQ, assistant_output("red"))
    await ledger.record(a)
    await ledger.record(b)
    # Different cumulative hashes for the same conversation: never guess.
    resolution = await ledgers().resolve("r", continuation(a))
    assert resolution.status == UNRESOLVED and resolution.reason == "ambiguous"
    c = make_commit("s", "call-c", REQ, assistant_output("red"))
    d = make_commit("s", "call-d", REQ, assistant_output("red"))
    d["record"] = dict(c["record"], model_call_id="call-d", staging_key="s/call-d", response_id="resp-d")
    await ledger.record(c)
    await ledger.record(d)
    same = await ledgers().resolve("s", continuation(c))
    assert same.status == RESOLVED and same.match.model_call_id == "call-c"


# --------------------------------------------------------------------------- conflicts without CAS


async def test_conflicting_record_fails_at_the_writer_that_sees_the_first_row(ledgers):
    first = make_commit("r", "call-1", REQ, assistant_output("red"), delta=4)
    second = make_commit("r", "call-1", REQ, assistant_output("red"), delta=5)
    await ledgers().record(first)
    await ledgers().record(first)  # the same payload again: a no-op
    with pytest.raises(LedgerConflictError, match="call-1"):
        await ledgers().record(second)
    assert isinstance(LedgerConflictError("x"), ValueError)
    reader = ledgers()
    manifest = await reader.manifest("r")
    assert manifest["records"] == []
    assert manifest["failures"] == [
        {"schema_version": 2, "model_call_id": "call-1", "reason": LEDGER_CONFLICTING_ROWS_REASON}
    ]
    resolution = await reader.resolve("r", continuation(first))
    assert resolution.status == UNRESOLVED and resolution.reason == "conflicting_payloads"


async def test_concurrent_conflicting_writers_are_seen_by_every_reader(ledgers):
    payloads = [make_commit("r", "call-1", REQ, assistant_output("red"), delta=n) for n in range(1, 9)]
    writers = [ledgers() for _ in payloads]
    outcomes = await asyncio.gather(*(w.record(p) for w, p in zip(writers, payloads)), return_exceptions=True)
    assert all(o is None or isinstance(o, LedgerConflictError) for o in outcomes)
    manifest = await ledgers().manifest("r")
    assert manifest["records"] == [] and manifest["failures"][0]["reason"] == LEDGER_CONFLICTING_ROWS_REASON
    assert (await ledgers().resolve("r", continuation(payloads[0]))).status == UNRESOLVED


async def test_a_conflict_under_another_fingerprint_still_blocks_resolution(ledgers):
    first = make_commit("r", "call-1", REQ, assistant_output("red"))
    other = make_commit("r", "call-1", REQ, assistant_output("a different answer"))
    await ledgers().record(first)
    with pytest.raises(LedgerConflictError):
        await ledgers().record(other)
    # The fingerprint index of "red" lists only call-1's first row; the row LIST sees both.
    resolution = await ledgers().resolve("r", continuation(first))
    assert resolution.status == UNRESOLVED and resolution.reason == "conflicting_payloads"


async def test_failure_rows_never_resolve_and_are_deduplicated(ledgers):
    ledger = ledgers()
    root = make_commit("r", "call-1", REQ, assistant_output("red"))
    await ledger.record(root)
    await ledger.record_failure("r", "call-1", "worker_capture_failed")
    await ledger.record_failure("r", "call-1", "worker_capture_failed")
    await ledger.record_failure("r", "call-2", "unresolved_parent")
    manifest = await ledgers().manifest("r")
    # As in Gym: the committed row stays, and the failure row poisons the rollout.
    assert [r["model_call_id"] for r in manifest["records"]] == ["call-1"]
    assert [(f["model_call_id"], f["reason"]) for f in manifest["failures"]] == [
        ("call-1", "worker_capture_failed"),
        ("call-2", "unresolved_parent"),
    ]
    # Stricter than Gym (which still resolves to a call recorded before its failure row): a call
    # whose capture failed is never a parent, in either order (test_adversarial_ledger.py).
    resolution = await ledgers().resolve("r", continuation(root))
    assert (resolution.status, resolution.reason) == (ParentResolutionStatus.UNRESOLVED, "failed_candidate")
    only_failures = ledgers()
    await only_failures.record_failure("s", "call-9", "worker_capture_failed")
    assert await ledgers().has_rows("s") is True
    for bad in ("", None):
        with pytest.raises(ValueError):
            await only_failures.record_failure("s", bad, "x")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await only_failures.record_failure("s", "call-9", bad)  # type: ignore[arg-type]
    # A lone surrogate raised a bare UnicodeEncodeError from the row's encoder (a breaker, 2026-12-02).
    with pytest.raises(ValueError, match="model_call_id .* lone surrogate"):
        await only_failures.record_failure("s", "\ud800", "x")
    with pytest.raises(ValueError, match="reason .* lone surrogate"):
        await only_failures.record_failure("s", "call-9", "x\ud800")


async def test_failure_row_for_a_call_id_too_long_for_a_key_keeps_its_real_id(ledgers):
    long_id = "c" * 600
    await ledgers().record_failure("r", long_id, "worker_capture_failed")
    manifest = await ledgers().manifest("r")
    assert manifest["failures"] == [{"schema_version": 2, "model_call_id": long_id, "reason": "worker_capture_failed"}]
    with pytest.raises(ValueError, match="too long"):
        await ledgers().record(make_commit("r", long_id, REQ, assistant_output("red")))


async def test_a_failure_reason_of_megabytes_is_stored_cut_and_still_masks(ledgers):
    """A 5 MiB reason was PUT and acknowledged, then every reader refused the row as over its
    4 MiB limit: the manifest said ``unreadable_ledger_row`` and the reason was lost (a scale
    breaker, 2026-12-03). It is now cut to 64 KiB with a note of its length, before any request."""
    reason = "traceback line é\n" * (5 * 1024 * 1024 // 18)
    ledger = ledgers()
    await ledger.record_failure("r", "call-1", reason)
    await ledger.record_failure("r", "call-1", reason)  # the same cut: one row
    manifest = await ledgers().manifest("r")
    [failure] = manifest["failures"]
    assert failure["model_call_id"] == "call-1"
    stored = failure["reason"]
    note = f" [... cut: the reason was {len(reason.encode('utf-8'))} bytes]"
    assert stored.endswith(note) and reason.startswith(stored[: -len(note)])
    assert len(stored.encode("utf-8")) <= 64 * 1024
    # A call id of megabytes cannot make a readable row at all: refused before any request.
    sent = ledger.request_counts.total()
    with pytest.raises(ValueError, match="over the 4194304-byte limit of a ledger row"):
        await ledger.record_failure("r", "c" * (5 * 1024 * 1024), "worker_capture_failed")
    assert ledger.request_counts.total() == sent


# --------------------------------------------------------------------------- damage in the bucket


def _rollout_keys(client: Any, bucket_url: str, rollout: str, part: str) -> list[str]:
    bucket, root = split_bucket_url(bucket_url)
    return list_keys(client, bucket, f"{root}rollouts/{rollout}/ledger/{part}/")


async def test_a_fingerprint_index_without_its_row_is_unresolved_not_a_guess(ledgers, s3_client, bucket_url):
    root = make_commit("r", "call-1", REQ, assistant_output("red"))
    await ledgers().record(root)
    bucket, _ = split_bucket_url(bucket_url)
    (row_key,) = _rollout_keys(s3_client, bucket_url, "r", "row")
    s3_client.delete_object(Bucket=bucket, Key=row_key)  # a crash between the two PUTs
    resolution = await ledgers().resolve("r", continuation(root))
    assert resolution.status == UNRESOLVED and resolution.reason == "unreadable_candidate"
    assert (await ledgers().manifest("r"))["records"] == []


@pytest.mark.parametrize(
    "damage",
    ["garbage", "wrong_sha", "newer_format", "other_rollout"],
)
async def test_corrupt_rows_poison_the_manifest_and_never_resolve(ledgers, s3_client, bucket_url, damage):
    root = make_commit("r", "call-1", REQ, assistant_output("red"))
    await ledgers().record(root)
    bucket, _ = split_bucket_url(bucket_url)
    (row_key,) = _rollout_keys(s3_client, bucket_url, "r", "row")
    body = json.loads(get_bytes(s3_client, bucket, row_key))
    if damage == "garbage":
        new = b"\x00not json"
    elif damage == "wrong_sha":
        body["record"]["weight_version"] = 99
        new = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    else:
        if damage == "newer_format":
            body["format"] = "s3capture.ledger-row/9"
        else:
            body["rollout_id"] = "another-rollout"
        new = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        # Content-addressed under its new bytes, so only the format or the rollout is at fault.
        new_key = row_key.rsplit("/", 1)[0] + f"/{hashlib.sha256(new).hexdigest()}.json"
        s3_client.delete_object(Bucket=bucket, Key=row_key)
        row_key = new_key
    put_bytes(s3_client, bucket, row_key, new)
    manifest = await ledgers().manifest("r")
    assert manifest["records"] == []
    assert manifest["failures"] == [
        {"schema_version": 2, "model_call_id": "call-1", "reason": LEDGER_UNREADABLE_ROW_REASON}
    ]
    assert (await ledgers().resolve("r", continuation(root))).status == UNRESOLVED
    validate_manifest(manifest)


async def test_foreign_objects_under_the_ledger_poison_the_manifest(ledgers, s3_client, bucket_url):
    await ledgers().record(make_commit("r", "call-1", REQ, assistant_output("red")))
    bucket, root = split_bucket_url(bucket_url)
    put_bytes(s3_client, bucket, f"{root}rollouts/r/ledger/notes.txt", b"hello")
    manifest = await ledgers().manifest("r")
    assert [r["model_call_id"] for r in manifest["records"]] == ["call-1"]
    assert manifest["failures"] == [
        {"schema_version": 2, "model_call_id": "ledger/notes.txt", "reason": LEDGER_FOREIGN_OBJECT_REASON}
    ]


async def test_folder_markers_under_the_ledger_are_no_rows(ledgers, s3_client, bucket_url):
    # An s3fs or rclone mount writes an empty "<folder>/" object per level. ``ledger/`` was
    # reported as a foreign ledger object, and a marker in a call's row or failure folder made
    # ``record`` raise a conflict and ``resolve`` answer UNRESOLVED (a review, 2026-12-03).
    commit = make_commit("r", "call-1", REQ, assistant_output("red"))
    bucket, root = split_bucket_url(bucket_url)
    for rel in ("ledger/", "ledger/row/", "ledger/row/call-1/", "ledger/fail/", "ledger/fail/call-1/"):
        put_bytes(s3_client, bucket, f"{root}rollouts/r/{rel}", b"")
    await ledgers().record(commit)  # no conflict with a marker
    manifest = await ledgers().manifest("r")
    assert [r["model_call_id"] for r in manifest["records"]] == ["call-1"] and manifest["failures"] == []
    resolution = await ledgers().resolve("r", continuation(commit))
    assert resolution.status == RESOLVED and resolution.match.model_call_id == "call-1"
    # A non-empty "ledger/" key is no marker.
    put_bytes_at_folder_key(s3_client, bucket, f"{root}rollouts/r/ledger/", b"x")
    manifest = await ledgers().manifest("r")
    if s3_client.head_object(Bucket=bucket, Key=f"{root}rollouts/r/ledger/")["ContentLength"]:
        assert manifest["failures"] == [
            {"schema_version": 2, "model_call_id": "ledger/", "reason": LEDGER_FOREIGN_OBJECT_REASON}
        ]
    else:  # SeaweedFS makes a key ending in "/" a folder and keeps none of its bytes
        assert manifest["failures"] == []


async def test_invalid_commits_are_refused_before_any_request(ledgers):
    ledger = ledgers()
    good = make_commit("r", "call-1", REQ, assistant_output("red"))
    bad_cases = [
        dict(good, record=dict(good["record"], mode="token_in")),  # a root must be text mode
        dict(good, record=dict(good["record"], digest="ABC")),
        dict(good, record=dict(good["record"], cum_len=99)),
        dict(good, unexpected=1),
        dict(good, request_items=["not an item"]),
        dict(good, rollout_id=""),
        {"schema_version": 3, **{k: v for k, v in good.items() if k != "schema_version"}},
    ]
    for bad in bad_cases:
        with pytest.raises(RecordError):
            await ledger.record(bad)
    with pytest.raises(ValueError):
        await ledger.record(dict(good, rollout_id="x" * 2000))
    assert sum(ledger.request_counts.values()) == 0


# --------------------------------------------------------------------------- request budgets


# One server, not all three: the budgets are the client's (which requests it sends, how many
# together). Each server's LIST paging past 1,000 keys is covered on every server elsewhere
# (test_store_source.py's >1,000-object rollout, test_adversarial_fence.py's two-page drop), and the
# 1,200 records this needs to cross a LIST page take 40 s per server in CI. SeaweedFS: a real S3
# implementation, the quickest of the three here.
@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
async def test_request_budgets(ledgers):
    from helpers import RequestRecorder

    writer = ledgers()
    commits = [make_commit("r", f"call-{i}", [user(f"q{i}")], assistant_output(f"a{i}")) for i in range(1200)]
    limit = asyncio.Semaphore(48)

    async def record(c: dict) -> None:
        async with limit:
            await writer.record(c)

    await asyncio.gather(*(record(c) for c in commits))

    probe = ledgers()
    rec = await RequestRecorder.attach(probe)
    await probe.record(make_commit("r", "call-new", REQ, assistant_output("red")))
    assert rec.counts() == {PUT: 2, LIST: 2}  # row and index; the call's rows and its failure rows
    assert _rounds(rec) == 1 and rec.max_in_flight == 4

    for target in (commits[0], commits[-1]):
        reader = ledgers()
        rec = await RequestRecorder.attach(reader)
        resolution = await reader.resolve("r", continuation(target))
        assert resolution.status == RESOLVED
        # index LIST + tombstone GET, then row GET + row LIST + failure-row LIST
        assert rec.counts() == {LIST: 3, GET: 2}
        assert _rounds(rec) == 2
        rec.reset()
        await reader.resolve("r", continuation(target))  # warm: the row GET is cached
        assert rec.counts() == {LIST: 3, GET: 1} and _rounds(rec) == 2

    reader = ledgers()
    rec = await RequestRecorder.attach(reader)
    manifest = await reader.manifest("r")
    assert len(manifest["records"]) == 1201
    # The fingerprint index lives beside ledger/, so the LIST pages hold rows only.
    # Rows, and the retire tombstone before the LIST, after it, and after the LIST that confirms
    # the listing's end (which goes with the rows' GETs; the tombstone lies outside ledger/).
    assert rec.counts()[LIST] == 3 and rec.counts()[GET] == 1201 + 3
    rec.reset()
    await reader.manifest("r")
    assert rec.counts() == {LIST: 3, GET: 3}  # warm: every row is cached

    rec.reset()
    assert await reader.has_rows("r") is True
    assert rec.counts() == {LIST: 2, GET: 1} and _rounds(rec) == 2  # the tombstone is read after the LISTs


def _rounds(rec: Any) -> int:
    """Sequential round trips: groups of sends separated by the answers they waited for."""
    rounds, receiving = 0, True
    for kind, _ in rec.sequence:
        if kind == "send" and receiving:
            rounds += 1
            receiving = False
        elif kind == "recv":
            receiving = True
    return rounds


# --------------------------------------------------------------------------- several processes


def _record_worker(url: str, env: dict[str, str], commits: list[dict], results: Any) -> None:
    """A child process (``helpers.forkserver_context``) recording ``commits``; ``env`` is its whole environment."""
    import os

    os.environ.clear()
    os.environ.update(env)

    async def main() -> None:
        ledger = S3CaptureLedger(url)
        try:
            for commit in commits:
                await ledger.record(commit)
        finally:
            await ledger.close()

    try:
        asyncio.run(main())
        results.put(("ok", len(commits)))
    except Exception as error:  # noqa: BLE001 - reported to the parent
        results.put(("error", repr(error)))


async def test_rows_from_several_processes_are_all_in_the_manifest(ledgers, s3_env, bucket_url):
    root = make_commit("r", "call-0", REQ, assistant_output("start"))
    await ledgers().record(root)
    per_process = [
        [
            make_commit(
                "r", f"call-{p}-{i}", continuation(root, f"q{p}-{i}"), assistant_output(f"a{p}-{i}"), parent=root
            )
            for i in range(15)
        ]
        for p in range(3)
    ]
    context = forkserver_context()  # a preloaded forkserver: no interpreter start-up per process
    results = context.Queue()
    env = {**os.environ, **s3_env.env()}
    processes = [
        context.Process(target=_record_worker, args=(bucket_url, env, commits, results)) for commits in per_process
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    assert outcomes == [("ok", 15)] * 3
    manifest = await ledgers().manifest("r")
    assert len(manifest["records"]) == 46 and manifest["failures"] == []
    reader = ledgers()
    for commits in per_process:
        resolution = await reader.resolve("r", continuation(commits[-1]))
        assert (
            resolution.status == RESOLVED and resolution.match.model_call_id == commits[-1]["record"]["model_call_id"]
        )


async def test_the_ledger_is_a_capture_ledger_and_shares_fences_with_the_token_store(ledgers, fresh):
    ledger = ledgers()
    assert isinstance(ledger, CaptureLedger) and ledger.is_process_shared() is True
    await ledger.record(make_commit("r", "call-1", REQ, assistant_output("red")))
    # A token store on the same URL sees the ledger's rows as objects it did not write: masked.
    snapshot = await fresh().freeze("r")
    assert snapshot.incomplete and any(reason.startswith("foreign_object:ledger/") for reason in snapshot.reasons)
    assert await fresh().retire(["r"]) == {"removed": ["r"], "absent": []}
    with pytest.raises(RolloutRetiredError):
        await ledger.manifest("r")


async def test_a_dangling_begin_call_intent_poisons_the_manifest(ledgers):
    ledger = ledgers()
    kept = make_commit("r", "call-kept", REQ, assistant_output("red"))
    for cid in ("call-kept", "call-failed", "call-lost"):
        await ledger.begin_call("r", cid)
    await ledger.record(kept)
    await ledger.record_failure("r", "call-failed", "worker_capture_failed")
    # call-lost: the worker died after admission; neither record nor record_failure ever ran.
    manifest = await ledgers().manifest("r")
    assert [r["model_call_id"] for r in manifest["records"]] == ["call-kept"]
    assert [(f["model_call_id"], f["reason"]) for f in manifest["failures"]] == [
        ("call-failed", "worker_capture_failed"),
        ("call-lost", "request_finished_without_staged_coordinates"),
    ]
    # Intents are not rows, and never parents.
    assert await ledgers().has_rows("q") is False
    await ledger.begin_call("q", "call-1")
    assert await ledgers().has_rows("q") is False
    assert (await ledgers().resolve("r", continuation(kept))).match.model_call_id == "call-kept"


async def test_deep_rows_are_stored_compressed_and_read_back(ledgers, s3_client, bucket_url):
    parent = make_commit("r", "call-0", REQ, assistant_output("a0"))
    commits = [parent]
    for i in range(1, 60):
        parent = make_commit("r", f"call-{i}", continuation(parent, f"q{i}"), assistant_output(f"a{i}"), parent=parent)
        commits.append(parent)
    writer = ledgers()
    for commit in commits:
        await writer.record(commit)
    bucket, root = split_bucket_url(bucket_url)
    deepest = list_keys(s3_client, bucket, f"{root}rollouts/r/ledger/row/call-59/")[0]
    stored = get_bytes(s3_client, bucket, deepest)
    import zstandard

    assert stored.startswith(b"\x28\xb5\x2f\xfd")  # zstd
    row = zstandard.ZstdDecompressor().decompress(stored)
    assert hashlib.sha256(row).hexdigest() == deepest.rsplit("/", 1)[-1][: -len(".json")]
    assert len(row) > 1024 and len(stored) < len(row) / 2
    assert json.loads(row)["staging_chain"] == commits[-1]["staging_chain"]
    shallow = get_bytes(s3_client, bucket, list_keys(s3_client, bucket, f"{root}rollouts/r/ledger/row/call-0/")[0])
    assert shallow.startswith(b"{")  # short rows stay plain JSON
    reader = ledgers()
    manifest = await reader.manifest("r")
    assert len(manifest["records"]) == 60 and not manifest["failures"]
    resolution = await reader.resolve("r", continuation(commits[-1]))
    assert resolution.match.staging_chain == tuple(commits[-1]["staging_chain"])
    # A zstd bomb under a row key is refused, not decompressed without bound.
    bomb = zstandard.ZstdCompressor().compress(b" " * (8 * 1024 * 1024))
    put_bytes(s3_client, bucket, deepest, bomb)
    manifest = await ledgers().manifest("r")
    assert ("call-59", LEDGER_UNREADABLE_ROW_REASON) in [
        (f["model_call_id"], f["reason"]) for f in manifest["failures"]
    ]


async def test_a_failure_row_spills_when_the_store_is_down_and_is_replayed(ledgers, s3_server, bucket_url, tmp_path):
    from botocore.config import Config
    from faultproxy import FaultProxy, Outage

    from s3capture.store import StoreError

    # The store goes down and comes back at the same endpoint: a spill belongs to its endpoint.
    proxy = await FaultProxy(s3_server.port).start()
    outage = proxy.rule = Outage()
    config = Config(retries={"mode": "standard", "max_attempts": 1}, s3={"addressing_style": "path"})
    try:
        long_id = "c" * 600  # stored under a hashed stand-in: the spilled body keeps the real id
        dead = ledgers(endpoint_url=proxy.endpoint, botocore_config=config, spill_dir=tmp_path)
        await dead.record_failure("r", "call-7", "worker_capture_failed")  # must not raise: the spill holds it
        await dead.record_failure("r", long_id, "unresolved_parent")
        (spill,) = tmp_path.glob("spill-*.jsonl")
        assert len(spill.read_bytes().splitlines()) == 2
        assert (await ledgers().manifest("r"))["failures"] == []  # not stored yet: the known window

        outage.down = False
        live = ledgers(endpoint_url=proxy.endpoint, botocore_config=config, spill_dir=tmp_path)
        await live.record_failure("q", "call-1", "worker_capture_failed")  # a successful write replays the spill
        assert not spill.exists()
        manifest = await ledgers().manifest("r")
        assert [(f["model_call_id"], f["reason"]) for f in manifest["failures"]] == [
            ("call-7", "worker_capture_failed"),
            (long_id, "unresolved_parent"),
        ]
        outage.down = True
        no_spill = ledgers(endpoint_url=proxy.endpoint, botocore_config=config)
        with pytest.raises(StoreError):
            await no_spill.record_failure("r", "call-8", "worker_capture_failed")
    finally:
        await proxy.stop()
