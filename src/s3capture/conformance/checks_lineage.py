"""The conformance checks of ``LineageResolver``: resolving a continuation to its parent call.

A faithful continuation resolves to its parent (through the same client, and through a fresh one),
a rewritten context does not, a request without model history is ``ROOT``, and two committed
payloads for one call id never resolve.
"""

from __future__ import annotations

from s3capture.conformance.framework import _REQUEST, RESOLVED, ROOT, UNRESOLVED, _Ctx


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
