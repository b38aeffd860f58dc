"""The conformance checks of ``CaptureLedger``: record, failure rows, manifest, retire, delete.

Cross-client visibility of ``record``, idempotent and conflicting records, failure rows, the
``begin_call`` extension, an unused rollout, ``retire`` (``RolloutRetiredError``) and ``delete``
with id reuse; every manifest is checked to be plain, token-free wire data (``_manifest``).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from s3capture.conformance.framework import (
    _REQUEST,
    RESOLVED,
    ROOT,
    UNRESOLVED,
    ConformanceError,
    _check_removal,
    _Ctx,
    _expect_error,
    _output,
    _Skip,
)
from s3capture.ledger_records import RecordError, to_wire, validate_commit, validate_manifest


# ---------------------------------------------------------------------------------------- ledger
def _token_free(value: Any, path: str = "$") -> str:
    """'' when no token arrays appear anywhere in ``value``, else the path of the first one."""
    if isinstance(value, dict):
        for key, item in value.items():
            if "token_ids" in str(key) or "log_probs" in str(key) or "token_mask" in str(key):
                return f"{path}.{key}"
            found = _token_free(item, f"{path}.{key}")
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _token_free(item, f"{path}[{index}]")
            if found:
                return found
    return ""


def _records(manifest: dict) -> dict[str, dict]:
    return {row["model_call_id"]: row for row in manifest.get("records", [])}


async def _manifest(ctx: _Ctx, ledger: Any, rid: str) -> dict:
    manifest = await ledger.manifest(rid)
    ctx.require(isinstance(manifest, dict), f"manifest returned {type(manifest).__name__}, not plain wire data")
    # Token-freeness first: RolloutManifest forbids unknown fields, so validating first would report
    # a leaked token array as a mere schema error and this contract's own message could never show.
    leak = _token_free(manifest)
    ctx.require(not leak, f"the manifest carries token data at {leak}")
    try:
        validate_manifest(manifest)
    except RecordError as error:
        raise ConformanceError(ctx.name, f"the manifest does not validate as RolloutManifest: {error}") from None
    ctx.require(manifest["rollout_id"] == rid, f"the manifest names rollout {manifest['rollout_id']!r}")
    return manifest


async def ledger_record_visibility(ctx: _Ctx) -> None:
    rid = ctx.rollout(ledger=True)
    commit = ctx.commit(rid, "call-1", text="It is sunny.")
    await (await ctx.ledger()).record(commit)
    reader = await ctx.ledger()  # constructed after record returned: cross-client visibility
    ctx.require(await reader.has_rows(rid) is True, "has_rows is not True after record returned")
    faithful = list(_REQUEST) + _output("It is sunny.") + [{"role": "user", "content": "And tomorrow?"}]
    resolution = await reader.resolve(rid, faithful)
    ctx.require(
        resolution.status == RESOLVED, f"a faithful continuation resolved as {resolution.status}: {resolution.reason}"
    )
    match, record = resolution.match, commit.record
    ctx.require(match.model_call_id == "call-1", f"resolved to the wrong parent {match.model_call_id!r}")
    ctx.require(
        tuple(match.staging_chain) == tuple(commit.staging_chain), f"match.staging_chain is {match.staging_chain!r}"
    )
    ctx.require(
        match.prev_len == record.cum_len, f"match.prev_len is {match.prev_len}, the row's cum_len {record.cum_len}"
    )
    ctx.require(match.chain_hash == record.chain_hash, "match.chain_hash is not the row's chain_hash")
    ctx.require(match.digest == record.cumulative_hash, "match.digest is not the row's cumulative_hash")
    ctx.require(tuple(match.cumulative_token_ids) == (), "a ledger match carries cumulative token ids")
    rewritten = await reader.resolve(rid, [{"role": "user", "content": "REWRITTEN"}] + _output("It is sunny."))
    ctx.require(rewritten.status == UNRESOLVED, f"a rewritten context resolved as {rewritten.status}")
    root = await reader.resolve(rid, [{"role": "user", "content": "fresh question"}])
    ctx.require(root.status == ROOT, f"a request without model history resolved as {root.status}")
    manifest = await _manifest(ctx, reader, rid)
    ctx.require(
        _records(manifest).get("call-1") == to_wire(validate_commit(commit).record),
        f"the manifest row differs from the recorded CallRecord: {_records(manifest).get('call-1')!r}",
    )
    ctx.require(not manifest["failures"], f"a clean ledger lists failures {manifest['failures']}")


async def ledger_idempotent_record(ctx: _Ctx) -> None:
    rid = ctx.rollout(ledger=True)
    await (await ctx.ledger()).record(ctx.commit(rid, "call-1"))
    await (await ctx.ledger()).record(ctx.commit(rid, "call-1"))
    manifest = await _manifest(ctx, await ctx.ledger(), rid)
    ctx.require(len(manifest["records"]) == 1, f"a repeated identical record gave {len(manifest['records'])} rows")
    ctx.require(not manifest["failures"], f"a repeated identical record gave failures {manifest['failures']}")


async def ledger_conflicting_record(ctx: _Ctx) -> None:
    rid = ctx.rollout(ledger=True)
    reader = await ctx.ledger()
    # call-1: two payloads with the same output (one fingerprint); call-2: two payloads whose
    # outputs differ, so a resolver that looks only under one fingerprint cannot see the conflict.
    cases = {
        "call-1": (ctx.commit(rid, "call-1", delta=3), ctx.commit(rid, "call-1", delta=4)),
        "call-2": (ctx.commit(rid, "call-2", text="b", delta=3), ctx.commit(rid, "call-2", text="c", delta=3)),
    }
    raised: dict[str, bool] = {}
    for cid, (first, second) in cases.items():
        await (await ctx.ledger()).record(first)
        try:
            await (await ctx.ledger()).record(second)
            raised[cid] = False
        except Exception:  # noqa: BLE001 - "reusing a model call id with different data must fail"
            raised[cid] = True
    manifest = await _manifest(ctx, reader, rid)
    for cid, (first, second) in cases.items():
        row = _records(manifest).get(cid)
        conflicted = any(f["model_call_id"] == cid for f in manifest["failures"])
        ctx.require(
            row != to_wire(validate_commit(second).record),
            f"{cid}: the conflicting second payload became the manifest row",
        )
        ctx.require(raised[cid] or conflicted, f"{cid}: a conflicting record neither raised nor shows as a conflict")
        if not conflicted:
            continue
        ctx.require(row is None, f"{cid}: a conflicted call id is listed under both records and failures")
        for commit in (first, second):
            faithful = list(commit.request_items) + list(commit.response_items) + [{"role": "user", "content": "more"}]
            resolution = await reader.resolve(rid, faithful)
            ctx.require(
                resolution.status != RESOLVED,
                f"{cid}: a call id with conflicting rows still resolved as a parent (through the continuation of "
                f"{'the first' if commit is first else 'the second'} payload)",
            )


async def ledger_failure_rows(ctx: _Ctx) -> None:
    rid = ctx.rollout(ledger=True)
    ledger = await ctx.ledger()
    await ledger.record_failure(rid, "call-failed", "worker_capture_failed")
    reader = await ctx.ledger()
    ctx.require(await reader.has_rows(rid) is True, "has_rows is not True for a ledger with only a failure row")
    await ledger.record_failure(rid, "call-failed", "worker_capture_failed")
    await ledger.record(ctx.commit(rid, "call-ok", text="ok"))
    manifest = await _manifest(ctx, reader, rid)
    ctx.require(
        manifest["failures"]
        == [{"schema_version": 2, "model_call_id": "call-failed", "reason": "worker_capture_failed"}],
        f"expected one failure row (deduplicated), got {manifest['failures']}",
    )
    ctx.require(list(_records(manifest)) == ["call-ok"], f"records are {list(_records(manifest))}")
    # A failure row has no items: no request may resolve to it, whatever it carries.
    for request in (
        [*_REQUEST, *_output("ok"), {"role": "user", "content": "next"}],
        [*_REQUEST, *_output("a"), {"role": "user", "content": "next"}],
    ):
        resolution = await reader.resolve(rid, request)
        ctx.require(
            resolution.match is None or resolution.match.model_call_id != "call-failed",
            "a failure row was resolved as a parent",
        )


async def ledger_retire(ctx: _Ctx) -> None:
    rid, unused = ctx.rollout("used", ledger=True), ctx.rollout("unused", ledger=True)
    await (await ctx.ledger()).record(ctx.commit(rid, "call-1"))
    _check_removal(ctx, await (await ctx.ledger()).retire([rid, unused]), removed=[rid], absent=[unused])
    _check_removal(ctx, await (await ctx.ledger()).retire([rid]), removed=[], absent=[rid])
    late = await ctx.ledger()
    await _expect_error(
        ctx,
        late.record(ctx.commit(rid, "call-late", text="late")),
        ["TokenCaptureFrozenError"],
        "a record after retire",
    )
    await _expect_error(
        ctx,
        late.record_failure(rid, "call-late-2", "worker_capture_failed"),
        ["TokenCaptureFrozenError"],
        "a record_failure after retire",
    )
    reader = await ctx.ledger()
    await _expect_retired(ctx, reader.manifest(rid), "manifest")
    await _expect_retired(ctx, reader.has_rows(rid), "has_rows")
    resolution = await reader.resolve(rid, [*_REQUEST, *_output("late"), {"role": "user", "content": "next"}])
    ctx.require(resolution.status != RESOLVED, "a record discarded after retire resolved as a parent")


async def _expect_retired(ctx: _Ctx, awaitable: Awaitable[Any], what: str) -> None:
    error = await _expect_error(ctx, awaitable, ["RolloutRetiredError"], f"{what} of a retired rollout")
    ctx.require(error is not None, f"{what} of a retired rollout returned instead of raising RolloutRetiredError")
    ctx.require(isinstance(error, LookupError), "RolloutRetiredError is not a LookupError")


async def ledger_delete_reuse(ctx: _Ctx) -> None:
    rid, unused = ctx.rollout("used", ledger=True), ctx.rollout("unused", ledger=True)
    ledger = await ctx.ledger()
    await ledger.record(ctx.commit(rid, "call-old", text="old"))
    await ledger.record_failure(rid, "call-bad", "worker_capture_failed")
    await ledger.retire([rid])
    _check_removal(ctx, await (await ctx.ledger()).delete([rid, unused]), removed=[rid], absent=[unused])
    _check_removal(ctx, await (await ctx.ledger()).delete([rid]), removed=[], absent=[rid])
    reader = await ctx.ledger()
    ctx.require(await reader.has_rows(rid) is False, "has_rows is True after delete")
    manifest = await _manifest(ctx, reader, rid)
    ctx.require(
        not manifest["records"] and not manifest["failures"], f"after delete the ledger is not empty: {manifest}"
    )
    old = await reader.resolve(rid, [*_REQUEST, *_output("old"), {"role": "user", "content": "next"}])
    ctx.require(old.status != RESOLVED, "a deleted row still resolved as a parent")
    await (await ctx.ledger()).record(ctx.commit(rid, "call-new", text="new"))
    manifest = await _manifest(ctx, await ctx.ledger(), rid)
    ctx.require(
        list(_records(manifest)) == ["call-new"] and not manifest["failures"],
        f"a reused id does not start from an empty ledger: {manifest}",
    )


async def ledger_begin_call_custody(ctx: _Ctx) -> None:
    rid = ctx.rollout(ledger=True)
    ledger = await ctx.ledger()
    if getattr(ledger, "begin_call", None) is None:
        raise _Skip("the ledger has no begin_call extension")
    for cid in ("call-kept", "call-lost"):
        await ledger.begin_call(rid, cid)
    await ledger.record(ctx.commit(rid, "call-kept"))
    manifest = await _manifest(ctx, await ctx.ledger(), rid)
    ctx.require(
        any(f["model_call_id"] == "call-lost" for f in manifest["failures"]),
        f"a dangling begin_call intent did not poison the manifest: failures={manifest['failures']}",
    )
    ctx.require(list(_records(manifest)) == ["call-kept"], f"records are {list(_records(manifest))}")


async def ledger_unused_rollout(ctx: _Ctx) -> None:
    rid = ctx.rollout(ledger=True)
    reader = await ctx.ledger()
    ctx.require(await reader.has_rows(rid) is False, "has_rows is True for a rollout never written")
    manifest = await _manifest(ctx, reader, rid)
    ctx.require(not manifest["records"] and not manifest["failures"], f"an unused rollout has rows: {manifest}")
    resolution = await reader.resolve(rid, [*_REQUEST, *_output("a"), {"role": "user", "content": "next"}])
    ctx.require(resolution.status == UNRESOLVED, f"a continuation in an empty ledger resolved as {resolution.status}")
