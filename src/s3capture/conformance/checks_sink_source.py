"""The conformance checks of ``TokenSink`` and ``TokenSource``: put, freeze, drop, retire, delete.

Visibility and idempotency of ``put`` and ``freeze``, conflicting payloads, ``mark_incomplete``,
conditional ``drop``, the ``begin_call`` extension, and the frozen/retired fences
(``TokenCaptureFrozenError``, ``TokenCaptureRetiredError``) with ``retire`` and ``delete``.
"""

from __future__ import annotations

from s3capture.conformance.framework import _check_removal, _Ctx, _dump, _expect_error, _has_error, _Skip


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
