"""s3capture's conformance suite: every contract of the token-capture protocol reference.

Source of the contracts: ``shared/spec/protocols-reference.txt`` (``TokenSink``, ``TokenSource``,
``LineageResolver``, ``CaptureLedger``, the frozen and retired errors, the install functions).
NeMo Gym 0.7.0's ``nemo_gym.token_id_capture.conformance`` has ten checks and predates ``retire``,
``delete``, ``TokenCaptureRetiredError``, ``RolloutRetiredError`` and the ledger; this suite keeps
its ten checks (same names) and adds the rest. ``docs/conformance.md`` lists every check, and which
of them Gym's own reference stores pass.

Usage (a library call; importable without aioboto3 or NeMo Gym)::

    report = await run_conformance(
        sink_factory=lambda: MySink(...),         # each factory returns a FRESH client
        source_factory=lambda: MySource(...),     # over the same shared backend
        resolver_factory=lambda: MyResolver(...),
        ledger_factory=lambda: MyLedger(...),
    )
    print(format_report(report))
    assert report.ok, report.failed

or from a shell against a real bucket: ``s3capture conformance s3://bucket/prefix``.

Every factory is optional: checks whose parts are missing are reported as skipped. A factory may
return the client or an awaitable of it. Each check gets its own rollout ids (``<prefix>-<check>-
<random>``) and fresh clients, closes every client it opened, and deletes its rollouts afterwards
when a source or ledger offers ``delete``. A failure names the check and what was observed; an
unexpected exception is a failure of that check, never a crash of the suite.
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from s3capture import protocols
from s3capture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, stamp_continuation
from s3capture.ledger_records import RecordError, to_wire, validate_commit, validate_manifest, validate_removal
from s3capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage, to_gym

__all__ = [
    "CheckResult",
    "ConformanceReport",
    "ConformanceError",
    "CHECKS",
    "run_conformance",
    "format_report",
    "format_result",
    "format_summary",
    "run_s3_conformance",
]

Factory = Callable[[], Any]
RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED
ROOT = ParentResolutionStatus.ROOT


class ConformanceError(AssertionError):
    """One named contract check failed (``check`` names it, ``detail`` says what was observed)."""

    def __init__(self, check: str, detail: str) -> None:
        self.check = check
        self.detail = detail
        super().__init__(f"{check}: {detail}")


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``status`` is ``"passed"``, ``"failed"`` or ``"skipped"``."""

    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class ConformanceReport:
    """Every check's result, in suite order."""

    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> list[str]:
        return [r.name for r in self.results if r.status == "passed"]

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if r.status == "failed"]

    @property
    def skipped(self) -> list[str]:
        return [r.name for r in self.results if r.status == "skipped"]

    @property
    def ok(self) -> bool:
        """True when no check failed and at least one ran."""
        return not self.failed and bool(self.passed)


# ---------------------------------------------------------------------------------------- fixtures
_REQUEST = [{"role": "user", "content": "What is the weather in Paris?"}]


def _has_error(error: BaseException, name: str) -> bool:
    """Whether ``error`` is (a subclass of) the protocol error ``name``, s3capture's or Gym's."""
    return any(klass.__name__ == name for klass in type(error).__mro__)


def _output(text: str) -> list[dict]:
    return [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]


class _Ctx:
    """Per-check state: fresh clients, rollout ids, and cleanup."""

    def __init__(self, suite: "_Suite", name: str) -> None:
        self.suite = suite
        self.name = name
        self.opened: list[Any] = []
        self.rollouts: list[str] = []
        self.ledger_rollouts: list[str] = []

    def rollout(self, tag: str = "", *, ledger: bool = False) -> str:
        rid = f"{self.suite.prefix}-{self.name.replace('_', '-')}{'-' + tag if tag else ''}-{uuid.uuid4().hex[:10]}"
        (self.ledger_rollouts if ledger else self.rollouts).append(rid)
        return rid

    async def _open(self, factory: Factory | None) -> Any:
        assert factory is not None
        client = factory()
        if inspect.isawaitable(client):
            client = await client
        self.opened.append(client)
        return client

    async def sink(self) -> Any:
        return await self._open(self.suite.sink_factory)

    async def source(self) -> Any:
        return await self._open(self.suite.source_factory)

    async def resolver(self) -> Any:
        return await self._open(self.suite.resolver_factory)

    async def ledger(self) -> Any:
        return await self._open(self.suite.ledger_factory)

    def require(self, condition: bool, detail: str) -> None:
        if not condition:
            raise ConformanceError(self.name, detail)

    def entry(
        self,
        rollout_id: str,
        call_id: str,
        *,
        prompt: list[int],
        generation: list[int],
        request: list[dict] | None = None,
        text: str = "a",
    ) -> Any:
        """A committed ROOT entry with the lookup metadata ``capture_tokens`` records."""
        entry = TokenEntry(
            rollout_id=rollout_id,
            model_call_id=call_id,
            model="conformance-model",
            prompt_token_ids=list(prompt),
            generation_token_ids=list(generation),
            generation_log_probs=[-0.1] * len(generation),
            output_items=_output(text),
            token_item_index=0,
            created_at=1700000000.0,  # fixed, so a retry resends byte-identical payloads
        )
        stamp_continuation(entry, list(request if request is not None else _REQUEST))
        stamp_lineage(entry, None, parent_resolution=ROOT)
        return to_gym(entry) if self.suite.entry_type == "gym" else entry

    def commit(
        self,
        rollout_id: str,
        call_id: str,
        *,
        text: str = "a",
        request: list[dict] | None = None,
        delta: int = 3,
        weight_version: int = 0,
    ) -> Any:
        """A valid root ``CaptureLedgerCommit`` whose digests are distinct per payload.

        Its record carries the fingerprints Gym's capture stamps (``external_capture``): a ledger
        may, like Gym's ``FileLineageStore``, resolve only rows of the current fingerprint version.
        """
        seed = f"{rollout_id}/{call_id}/{text}/{delta}/{weight_version}"
        request_items = list(request if request is not None else _REQUEST)

        def hexdigest(tag: str) -> str:
            import hashlib

            return hashlib.sha256(f"{tag}:{seed}".encode()).hexdigest()

        wire = {
            "rollout_id": rollout_id,
            "record": {
                "model_call_id": call_id,
                "parent_call_id": None,
                "prev_len": 0,
                "delta_len": delta,
                "cum_len": delta,
                "weight_version": weight_version,
                "digest": hexdigest("digest"),
                "extras_digest": hexdigest("extras"),
                "staging_key": f"{rollout_id}/{call_id}",
                "mode": "text",
                "chain_hash": hexdigest("chain"),
                "cumulative_hash": hexdigest("cumulative"),
                "response_id": f"resp-{call_id}",
                "admitted_at": 1700000000.0,
                "output_fingerprint": assistant_fingerprint(_output(text)) or None,
                "continuation_fingerprint": assistant_fingerprint(request_items + _output(text)) or None,
                "fingerprint_version": FINGERPRINT_VERSION,
            },
            "staging_chain": [f"{rollout_id}/{call_id}"],
            "request_items": request_items,
            "response_items": _output(text),
        }
        commit = validate_commit(wire)
        if self.suite.entry_type == "gym":
            from nemo_gym.token_id_capture.staging.records import CaptureLedgerCommit

            return CaptureLedgerCommit.model_validate(to_wire(commit))
        return commit

    async def close(self) -> None:
        for client in reversed(self.opened):
            try:
                result = client.close()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - closing is best effort
                pass


def _dump(entry: Any) -> Any:
    return entry.model_dump(mode="json")


async def _expect_error(ctx: _Ctx, awaitable: Awaitable[Any], names: Sequence[str], what: str) -> BaseException | None:
    """Await; return the raised error when it is one of ``names``; fail the check otherwise."""
    try:
        await awaitable
    except Exception as error:
        if any(_has_error(error, name) for name in names):
            return error
        raise ConformanceError(
            ctx.name, f"{what} raised {type(error).__name__}: {error}; expected {' or '.join(names)}"
        ) from error
    return None


# ---------------------------------------------------------------------------------------- sink + source
async def put_then_freeze_visibility(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    entry = ctx.entry(rid, "call-1", prompt=[11, 12], generation=[13, 14])
    await (await ctx.sink()).put(entry)
    snapshot = await (await ctx.source()).freeze(rid)
    ctx.require(len(snapshot.entries) == 1, f"expected one entry, got {len(snapshot.entries)}")
    ctx.require(not snapshot.incomplete, "a clean rollout froze incomplete")
    ctx.require(bool(snapshot.snapshot_id), "snapshot_id is empty")
    ctx.require(_dump(snapshot.entries[0]) == _dump(entry), "the frozen entry does not round-trip the stored payload")


async def idempotent_reput(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    entry = ctx.entry(rid, "call-1", prompt=[11, 12], generation=[13, 14])
    sink = await ctx.sink()
    await sink.put(entry)
    await (await ctx.sink()).put(ctx.entry(rid, "call-1", prompt=[11, 12], generation=[13, 14]))
    snapshot = await (await ctx.source()).freeze(rid)
    ctx.require(len(snapshot.entries) == 1, f"a byte-identical retry duplicated: {len(snapshot.entries)} entries")
    ctx.require(not snapshot.incomplete, "a byte-identical retry marked the rollout incomplete")


async def conflicting_reput(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    sink = await ctx.sink()
    await sink.put(ctx.entry(rid, "call-1", prompt=[11, 12], generation=[13, 14], text="a"))
    try:
        await sink.put(ctx.entry(rid, "call-1", prompt=[11, 12], generation=[15], text="b"))
    except Exception:  # noqa: BLE001 - fail-closed at the writer
        return
    snapshot = await (await ctx.source()).freeze(rid)
    ctx.require(snapshot.incomplete, "a conflicting payload for one call id was accepted without raising or masking")


async def mark_incomplete_durability(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    sink = await ctx.sink()
    await sink.put(ctx.entry(rid, "call-1", prompt=[11, 12], generation=[13, 14]))
    before = await (await ctx.source()).freeze(rid)
    await sink.mark_incomplete(rid, "call-2")
    after = await (await ctx.source()).freeze(rid)
    ctx.require(after.incomplete, "a fresh source does not see the incomplete marker")
    ctx.require(after.version != before.version, "mark_incomplete after freeze did not change the version")
    dropped = await (await ctx.source()).drop(rid, snapshot_id=before.snapshot_id, version=before.version)
    ctx.require(not dropped, "a drop staled by mark_incomplete succeeded")


async def freeze_idempotency(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    await (await ctx.sink()).put(ctx.entry(rid, "call-1", prompt=[11, 12], generation=[13, 14]))
    first = await (await ctx.source()).freeze(rid)
    second = await (await ctx.source()).freeze(rid)
    ctx.require(first.snapshot_id == second.snapshot_id, "snapshot_id changed across idempotent freezes")
    ctx.require(first.version == second.version, "version changed across idempotent freezes")
    ctx.require(
        {e.model_call_id: e.digest for e in first.entries} == {e.model_call_id: e.digest for e in second.entries},
        "the entry set changed across idempotent freezes",
    )


async def post_freeze_write_safety(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    sink, source = await ctx.sink(), await ctx.source()
    await sink.put(ctx.entry(rid, "call-1", prompt=[11, 12], generation=[13, 14]))
    snapshot = await source.freeze(rid)
    try:
        await sink.put(ctx.entry(rid, "call-2", prompt=[11, 12, 13, 14], generation=[15], text="b"))
    except Exception:  # noqa: BLE001 - a hard fence is acceptable
        return
    dropped = await source.drop(rid, snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    ctx.require(not dropped, "a write raced freeze, yet the stale snapshot was dropped")


async def conditional_retirement(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    source = await ctx.source()
    await (await ctx.sink()).put(ctx.entry(rid, "call-1", prompt=[11, 12], generation=[13, 14]))
    snapshot = await source.freeze(rid)
    stale = await source.drop(rid, snapshot_id=snapshot.snapshot_id, version=snapshot.version + 1)
    ctx.require(not stale, "a stale-version drop succeeded")
    evidence = await source.freeze(rid)
    ctx.require(len(evidence.entries) == 1, "a failed drop discarded the evidence")
    dropped = await source.drop(rid, snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    ctx.require(dropped, "dropping the exact consumed snapshot failed")


async def _lineage_visibility(ctx: _Ctx, *, fresh_client: bool) -> None:
    rid = ctx.rollout()
    store = None if fresh_client else await ctx.resolver()
    entry = ctx.entry(rid, "call-1", prompt=[101, 102, 103], generation=[201, 202], text="It is sunny.")
    await (await ctx.sink()).put(entry)
    if store is None:
        store = await ctx.resolver()
    faithful = list(_REQUEST) + list(entry.output_items) + [{"role": "user", "content": "And tomorrow?"}]
    resolution = await store.resolve(rid, faithful)
    ctx.require(
        resolution.status == RESOLVED, f"a faithful continuation resolved as {resolution.status}: {resolution.reason}"
    )
    ctx.require(
        resolution.match.model_call_id == "call-1", f"resolved to the wrong parent {resolution.match.model_call_id!r}"
    )
    ctx.require(
        list(resolution.match.cumulative_token_ids) == [101, 102, 103, 201, 202],
        "the resolved parent carries the wrong cumulative tokens",
    )
    rewritten = await store.resolve(rid, [{"role": "user", "content": "REWRITTEN"}] + list(entry.output_items))
    ctx.require(rewritten.status == UNRESOLVED, f"a rewritten context resolved as {rewritten.status}")
    root = await store.resolve(rid, [{"role": "user", "content": "fresh question"}])
    ctx.require(root.status == ROOT, f"a request without model history resolved as {root.status}")


async def lineage_visibility(ctx: _Ctx) -> None:
    await _lineage_visibility(ctx, fresh_client=False)


async def fresh_client_lineage_visibility(ctx: _Ctx) -> None:
    await _lineage_visibility(ctx, fresh_client=True)


async def begin_call_custody(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    sink = await ctx.sink()
    if getattr(sink, "begin_call", None) is None:
        raise _Skip("the sink has no begin_call extension")
    await sink.begin_call(rid, "call-lost")
    await sink.begin_call(rid, "call-kept")
    await (await ctx.sink()).put(ctx.entry(rid, "call-kept", prompt=[1], generation=[2]))
    snapshot = await (await ctx.source()).freeze(rid)
    ctx.require(snapshot.incomplete, "a dangling pre-dispatch intent did not mask the rollout")


# ---------------------------------------------------------------------------------------- frozen / retired
async def frozen_error_on_late_put(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    await (await ctx.sink()).put(ctx.entry(rid, "call-1", prompt=[1], generation=[2]))
    await (await ctx.source()).freeze(rid)
    late = ctx.entry(rid, "call-2", prompt=[1, 2], generation=[3], text="b")
    error = await _expect_error(ctx, (await ctx.sink()).put(late), ["TokenCaptureFrozenError"], "a put after freeze")
    ctx.require(
        error is not None, "a put issued after freeze returned succeeded (it must raise TokenCaptureFrozenError)"
    )


async def source_retire_fences_late_put(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    await (await ctx.sink()).put(ctx.entry(rid, "call-1", prompt=[1], generation=[2]))
    removal = await (await ctx.source()).retire([rid])
    _check_removal(ctx, removal, removed=[rid], absent=[])
    late = ctx.entry(rid, "call-2", prompt=[1, 2], generation=[3], text="b")
    error = await _expect_error(ctx, (await ctx.sink()).put(late), ["TokenCaptureRetiredError"], "a put after retire")
    ctx.require(error is not None, "a put after retire succeeded (it must raise TokenCaptureRetiredError)")
    assert error is not None  # for the type checker: require() raised otherwise
    ctx.require(
        _has_error(error, "TokenCaptureFrozenError"), "TokenCaptureRetiredError is not a TokenCaptureFrozenError"
    )


async def source_retire_idempotent(ctx: _Ctx) -> None:
    rid, unused = ctx.rollout("used"), ctx.rollout("unused")
    await (await ctx.sink()).put(ctx.entry(rid, "call-1", prompt=[1], generation=[2]))
    first = await (await ctx.source()).retire([rid, unused])
    _check_removal(ctx, first, removed=[rid], absent=[unused])
    second = await (await ctx.source()).retire([rid, unused])
    _check_removal(ctx, second, removed=[], absent=[rid, unused])


async def mark_incomplete_after_retire(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    sink = await ctx.sink()
    await sink.put(ctx.entry(rid, "call-1", prompt=[1], generation=[2]))
    await (await ctx.source()).retire([rid])
    await _expect_error(
        ctx, sink.mark_incomplete(rid, "call-2"), ["TokenCaptureFrozenError"], "mark_incomplete after retire"
    )
    again = await (await ctx.source()).retire([rid])
    # A store that refuses the marker has nothing left to remove (absent); one whose write paths
    # never delete a key keeps the refused marker until this retire removes it (removed).
    ctx.require(
        isinstance(again, dict) and sorted([*again.get("removed", []), *again.get("absent", [])]) == [rid],
        f"retire of a retired rollout must name it once, as removed or absent; got {again}",
    )
    late = ctx.entry(rid, "call-3", prompt=[1, 2], generation=[3], text="c")
    error = await _expect_error(ctx, (await ctx.sink()).put(late), ["TokenCaptureRetiredError"], "a put after retire")
    ctx.require(error is not None, "after mark_incomplete on a retired rollout, a put succeeded: the fence was lost")


async def source_delete_reuse(ctx: _Ctx) -> None:
    rid, unused = ctx.rollout("used"), ctx.rollout("unused")
    await (await ctx.sink()).put(ctx.entry(rid, "call-old", prompt=[1], generation=[2]))
    source = await ctx.source()
    await source.retire([rid])
    _check_removal(ctx, await source.delete([rid, unused]), removed=[rid], absent=[unused])
    _check_removal(ctx, await (await ctx.source()).delete([rid]), removed=[], absent=[rid])
    entry = ctx.entry(rid, "call-new", prompt=[5], generation=[6], text="new")
    await (await ctx.sink()).put(entry)
    snapshot = await (await ctx.source()).freeze(rid)
    ctx.require(
        [e.model_call_id for e in snapshot.entries] == ["call-new"] and not snapshot.incomplete,
        f"after delete the id did not start empty: froze {[e.model_call_id for e in snapshot.entries]}, "
        f"incomplete={snapshot.incomplete}",
    )


async def resolver_conflict_zero_candidates(ctx: _Ctx) -> None:
    rid = ctx.rollout()
    first = ctx.entry(rid, "call-1", prompt=[1, 2], generation=[3], text="same output")
    other = ctx.entry(rid, "call-1", prompt=[1, 2], generation=[4], text="same output")
    await (await ctx.sink()).put(first)
    try:
        await (await ctx.sink()).put(other)
    except Exception:  # noqa: BLE001 - refused at the writer: only the first payload exists
        return
    faithful = list(_REQUEST) + list(first.output_items) + [{"role": "user", "content": "more"}]
    resolution = await (await ctx.resolver()).resolve(rid, faithful)
    ctx.require(
        resolution.status != RESOLVED,
        f"two committed payloads for one call id resolved to {resolution.match and resolution.match.model_call_id!r}",
    )


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


def _check_removal(ctx: _Ctx, removal: Any, *, removed: list[str], absent: list[str]) -> None:
    try:
        validate_removal(dict(removal))
    except (RecordError, TypeError, ValueError) as error:
        raise ConformanceError(ctx.name, f"retire/delete returned {removal!r}, not a RolloutRemoval: {error}") from None
    ctx.require(
        sorted(removal["removed"]) == sorted(removed) and sorted(removal["absent"]) == sorted(absent),
        f"expected removed={removed} absent={absent}, got {dict(removal)}",
    )


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


# ---------------------------------------------------------------------------------------- shapes
async def protocol_shapes_and_install(ctx: _Ctx) -> None:
    suite = ctx.suite
    pairs: list[tuple[Any, type, Callable[[Any], None], Callable[[], Any]]] = [
        (suite.sink_factory, protocols.TokenSink, protocols.install_token_sink, protocols.installed_token_sink),
        (suite.source_factory, protocols.TokenSource, protocols.install_token_source, protocols.installed_token_source),
        (
            suite.resolver_factory,
            protocols.LineageResolver,
            protocols.install_lineage_store,
            protocols.installed_lineage_store,
        ),
        (
            suite.ledger_factory,
            protocols.CaptureLedger,
            protocols.install_lineage_store,
            protocols.installed_lineage_store,
        ),
    ]
    saved = (protocols.installed_token_sink(), protocols.installed_token_source(), protocols.installed_lineage_store())
    try:
        for factory, protocol, install, installed in pairs:
            if factory is None:
                continue
            client = await ctx._open(factory)
            ctx.require(isinstance(client, protocol), f"{type(client).__name__} lacks methods of {protocol.__name__}")
            if protocol is protocols.LineageResolver or protocol is protocols.CaptureLedger:
                ctx.require(isinstance(client.is_process_shared(), bool), "is_process_shared() is not a bool")
            install(client)
            ctx.require(installed() is client, f"{install.__name__} did not install the client")
            install(None)
            ctx.require(installed() is None, f"{install.__name__}(None) did not clear the default")
        try:
            protocols.install_token_sink(object())  # type: ignore[arg-type]  # the wrong type is the test
        except TypeError:
            pass
        else:
            raise ConformanceError(ctx.name, "install_token_sink accepted an object without put/mark_incomplete/close")
    finally:
        protocols.install_token_sink(saved[0])
        protocols.install_token_source(saved[1])
        protocols.install_lineage_store(saved[2])


class _Skip(Exception):
    pass


# name, needs, function. needs: letters s(ink) o(source) r(esolver) l(edger)
CHECKS: list[tuple[str, str, Callable[[_Ctx], Awaitable[None]]]] = [
    ("put_then_freeze_visibility", "so", put_then_freeze_visibility),
    ("idempotent_reput", "so", idempotent_reput),
    ("conflicting_reput", "so", conflicting_reput),
    ("mark_incomplete_durability", "so", mark_incomplete_durability),
    ("freeze_idempotency", "so", freeze_idempotency),
    ("post_freeze_write_safety", "so", post_freeze_write_safety),
    ("conditional_retirement", "so", conditional_retirement),
    ("lineage_visibility", "sr", lineage_visibility),
    ("fresh_client_lineage_visibility", "sr", fresh_client_lineage_visibility),
    ("begin_call_custody", "so", begin_call_custody),
    ("frozen_error_on_late_put", "so", frozen_error_on_late_put),
    ("source_retire_fences_late_put", "so", source_retire_fences_late_put),
    ("source_retire_idempotent", "so", source_retire_idempotent),
    ("mark_incomplete_after_retire", "so", mark_incomplete_after_retire),
    ("source_delete_reuse", "so", source_delete_reuse),
    ("resolver_conflict_zero_candidates", "sr", resolver_conflict_zero_candidates),
    ("ledger_record_visibility", "l", ledger_record_visibility),
    ("ledger_idempotent_record", "l", ledger_idempotent_record),
    ("ledger_conflicting_record", "l", ledger_conflicting_record),
    ("ledger_failure_rows", "l", ledger_failure_rows),
    ("ledger_begin_call_custody", "l", ledger_begin_call_custody),
    ("ledger_unused_rollout", "l", ledger_unused_rollout),
    ("ledger_retire", "l", ledger_retire),
    ("ledger_delete_reuse", "l", ledger_delete_reuse),
    ("protocol_shapes_and_install", "", protocol_shapes_and_install),
]
"""Every check in suite order: ``(name, parts needed, check)``; the first ten are Gym 0.7.0's."""


@dataclass
class _Suite:
    sink_factory: Factory | None
    source_factory: Factory | None
    resolver_factory: Factory | None
    ledger_factory: Factory | None
    prefix: str
    entry_type: str


async def run_conformance(
    *,
    sink_factory: Factory | None = None,
    source_factory: Factory | None = None,
    resolver_factory: Factory | None = None,
    ledger_factory: Factory | None = None,
    only: Sequence[str] | None = None,
    rollout_prefix: str = "conformance",
    entry_type: str = "s3capture",
    progress: Callable[[CheckResult], None] | None = None,
) -> ConformanceReport:
    """Run every check whose parts are given; return a report (never raises for a failed check).

    Parameters:
        sink_factory, source_factory, resolver_factory, ledger_factory: zero-argument callables
            returning a FRESH client (or an awaitable of one) over one shared backend.
        only: names of checks to run (``CHECKS``); ``ValueError`` for an unknown name.
        rollout_prefix: rollout ids are ``<rollout_prefix>-<check>-<random>``.
        entry_type: ``"s3capture"`` hands the clients s3capture's ``TokenEntry`` and
            ``CaptureLedgerCommit``; ``"gym"`` hands NeMo Gym's pydantic models (requires nemo_gym).
        progress: called with each ``CheckResult`` as it completes.
    """
    if entry_type not in ("s3capture", "gym"):
        raise ValueError(f"entry_type must be 's3capture' or 'gym', got {entry_type!r}")
    names = [name for name, _, _ in CHECKS]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise ValueError(f"unknown conformance checks {unknown}; known: {', '.join(names)}")
    suite = _Suite(sink_factory, source_factory, resolver_factory, ledger_factory, rollout_prefix, entry_type)
    parts = {"s": sink_factory, "o": source_factory, "r": resolver_factory, "l": ledger_factory}
    labels = {"s": "sink", "o": "source", "r": "resolver", "l": "ledger"}
    report = ConformanceReport()
    for name, needs, check in CHECKS:
        if only and name not in only:
            continue
        missing = [labels[p] for p in needs if parts[p] is None]
        if missing:
            result = CheckResult(name, "skipped", f"no {' or '.join(missing)} factory given")
        else:
            result = await _run_one(suite, name, check)
        report.results.append(result)
        if progress is not None:
            progress(result)
    return report


async def _run_one(suite: _Suite, name: str, check: Callable[[_Ctx], Awaitable[None]]) -> CheckResult:
    ctx = _Ctx(suite, name)
    started = time.monotonic()
    try:
        await check(ctx)
        status, detail = "passed", ""
    except _Skip as skip:
        status, detail = "skipped", str(skip)
    except ConformanceError as error:
        status, detail = "failed", error.detail
    except Exception as error:  # noqa: BLE001 - a raising backend is a failed check, not a crash
        status, detail = "failed", f"unexpected {type(error).__name__}: {error}"
    finally:
        await _cleanup(ctx)
        await ctx.close()
    return CheckResult(name, status, detail, time.monotonic() - started)


async def _cleanup(ctx: _Ctx) -> None:
    """Delete the check's rollouts where a client offers ``delete`` (best effort)."""
    for factory, rollouts in (
        (ctx.suite.source_factory, ctx.rollouts),
        (ctx.suite.ledger_factory, ctx.ledger_rollouts),
    ):
        if factory is None or not rollouts:
            continue
        try:
            client = await ctx._open(factory)
            if getattr(client, "delete", None) is not None:
                await client.delete(list(rollouts))
        except Exception:  # noqa: BLE001 - cleanup never changes a verdict
            pass


def format_result(result: CheckResult) -> str:
    """One report line: ``PASS|FAIL|SKIP  <name>  <seconds>  <detail>``."""
    mark = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[result.status]
    line = f"  {mark}  {result.name:<36} {result.seconds:6.2f} s"
    return f"{line}  {result.detail}" if result.detail else line


def format_summary(report: ConformanceReport) -> str:
    """The report's last line: counts, and ``NOT CONFORMANT`` when a check failed or none ran."""
    summary = f"{len(report.passed)} passed, {len(report.failed)} failed, {len(report.skipped)} skipped"
    return summary + ("" if report.ok else "  -- NOT CONFORMANT")


def format_report(report: ConformanceReport, *, where: str = "") -> str:
    """A human-readable report: a title, one line per check by name, then a summary line."""
    lines = [f"s3capture conformance{' against ' + where if where else ''}"]
    lines.extend(format_result(result) for result in report.results)
    lines.append(format_summary(report))
    return "\n".join(lines)


async def run_s3_conformance(
    url: str,
    *,
    endpoint_url: str | None = None,
    only: Sequence[str] | None = None,
    fence_grace: float = 1.0,
    progress: Callable[[CheckResult], None] | None = None,
) -> ConformanceReport:
    """Run the whole suite against ``S3TokenStore`` and ``S3CaptureLedger`` on ``url`` (needs aioboto3).

    Raises ``StoreError`` before any check when the bucket is missing or access is refused.

    Every factory call builds a new client with its own HTTP connection pool, caches and state;
    they share one ``aioboto3.Session`` (the credential chain and service model, ~0.1 s to load).
    Credentials come from the standard AWS chain; ``endpoint_url`` defaults to ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``.
    """
    import aioboto3

    from s3capture.ledger import S3CaptureLedger
    from s3capture.store import S3TokenStore

    session = aioboto3.Session()

    def store() -> Any:
        return S3TokenStore(url, endpoint_url=endpoint_url, fence_grace=fence_grace, session=session)

    def ledger() -> Any:
        return S3CaptureLedger(url, endpoint_url=endpoint_url, session=session)

    # A missing bucket or refused credentials is one clear StoreError, not every check failing.
    probe = store()
    try:
        await probe._list(probe.layout.root + "rollouts/conformance-")
    finally:
        await probe.close()
    return await run_conformance(
        sink_factory=store,
        source_factory=store,
        resolver_factory=store,
        ledger_factory=ledger,
        only=only,
        rollout_prefix=f"conformance-{uuid.uuid4().hex[:6]}",
        progress=progress,
    )
