"""Adversarial: bad input (weird numbers, malformed request items) and root-prefix collisions."""

from __future__ import annotations

import pytest
from helpers import (
    assistant_output,
    list_keys,
    simple_entry,
    split_bucket_url,
    system,
    user,
)

from s3capture.records import ParentResolutionStatus, RecordError, TokenEntry

REQ = [system("Be brief."), user("Big?")]


# Regression test (found by the adversarial review, fixed in 0d86cd4): token ids >= 2**64 pass validation
# (TokenId has no upper bound) although Gym cannot serialize them and compute_digest cannot encode them
async def test_token_id_beyond_u64_is_refused_by_put(fresh):
    entry = TokenEntry(
        rollout_id="r-big",
        model_call_id="c1",
        prompt_token_ids=[2**64],
        generation_token_ids=[1],
        generation_log_probs=[-0.5],
        output_items=assistant_output("x"),
        created_at=1.0,
    )
    with pytest.raises(RecordError):
        await fresh().put(entry)


# Regression test (found by the adversarial review, fixed in 0d86cd4): resolve lets compute_digest's
# ValueError escape for a stored entry with a token id >= 2**64 (accepted by put) instead of answering
# UNRESOLVED
async def test_resolve_survives_a_stored_entry_with_a_token_beyond_u64(fresh, s3_client, bucket_url):
    """The object is written directly (as an older s3capture or a foreign writer could have): a
    reader must answer UNRESOLVED, never raise."""
    import hashlib

    import zstandard
    from helpers import put_bytes

    from s3capture.fingerprint import stamp_continuation
    from s3capture.records import encode_entry

    entry = TokenEntry(
        rollout_id="r-big2",
        model_call_id="c1",
        prompt_token_ids=[2**64],
        generation_token_ids=[1],
        generation_log_probs=[-0.5],
        output_items=assistant_output("x"),
        created_at=1.0,
        parent_resolution=ParentResolutionStatus.ROOT,
    )
    stamp_continuation(entry, REQ)
    payload = encode_entry(entry)
    store = fresh()
    prefix = store.layout.rollout("r-big2")
    key = prefix + store.layout.entry_rel(
        prefix, entry.continuation_fingerprint, "c1", hashlib.sha256(payload).hexdigest()
    )
    body = b'{"chain":[],"entry":' + payload + b',"format":"s3capture.entry/1"}'
    bucket, _ = split_bucket_url(bucket_url)
    put_bytes(s3_client, bucket, key, zstandard.ZstdCompressor().compress(body))
    resolution = await store.resolve("r-big2", REQ + assistant_output("x") + [user("next")])
    assert resolution.status == ParentResolutionStatus.UNRESOLVED


# Regression test (found by the adversarial review, fixed in 0d86cd4): resolve catches only
# ValueError/TypeError from the fingerprint functions; malformed tool_calls raise AttributeError, which
# escapes instead of UNRESOLVED malformed_request
@pytest.mark.parametrize(
    "items",
    [
        [{"role": "assistant", "tool_calls": "abc"}],
        [{"role": "assistant", "tool_calls": [1]}],
        [{"role": "assistant", "content": "hi", "tool_calls": [{"function": 3}]}],
    ],
    ids=["tool_calls-str", "tool_calls-int", "function-int"],
)
async def test_malformed_tool_calls_in_request_are_unresolved(fresh, items):
    resolution = await fresh().resolve("r-malformed", [user("q"), *items, user("next")])
    assert resolution.status == ParentResolutionStatus.UNRESOLVED


# Regression test (found by the adversarial review, fixed in 0d86cd4): a store rooted at P/r/<id> lives inside
# rollout <id> of a store rooted at P; retire/delete of that rollout deletes it
@pytest.mark.parametrize("spelling", ["{outer}", "/{outer}/", "{outer}/deeper", "{outer}/rollouts/again"])
async def test_a_root_inside_another_roots_rollout_is_refused(fresh, bucket_url, spelling):
    """Two stores in one bucket: ``s3://B/t`` and ``s3://B/t/rollouts/shared``. Rollout ``shared`` of the
    first store would contain the whole second store, and retiring it would delete the second store's
    acknowledged entries. The layout refuses any root with a ``rollouts`` segment, before any request."""
    bucket, _ = split_bucket_url(bucket_url)
    outer_rollout = fresh().layout.rollout("shared").rstrip("/")  # "t/rollouts/shared"
    inner_url = f"s3://{bucket}/" + spelling.format(outer=outer_rollout)
    with pytest.raises(ValueError, match="rollouts"):
        fresh(url=inner_url)


async def test_retire_in_one_root_never_deletes_another_roots_entries(fresh, s3_client, bucket_url):
    """Roots that a store does accept beside ``s3://B/t``: ``t/shared`` (named like the rollout),
    ``t/rollouts-shared`` and ``t-rollouts/shared`` (near the reserved segment). Retiring and deleting
    rollout ``shared`` of the outer store leaves every one of their acknowledged entries in place, and
    those of the outer store's rollout ``shared2`` (whose prefix extends ``shared``'s without its slash)."""
    bucket, _ = split_bucket_url(bucket_url)
    outer = fresh()  # root "t"
    await outer.put(simple_entry("shared", "c1"))
    await outer.put(simple_entry("shared2", "c1"))
    inner_urls = [f"s3://{bucket}/t/shared", f"s3://{bucket}/t/rollouts-shared", f"s3://{bucket}/t-rollouts/shared"]
    for url in inner_urls:
        await fresh(url=url).put(simple_entry("shared", "c1"))
        await fresh(url=url).put(simple_entry("victim", "c1"))
    await outer.retire(["shared"])
    assert [k for k in list_keys(s3_client, bucket, outer.layout.rollout("shared")) if "/log/" in k] == []
    await outer.delete(["shared"])
    neighbour = await fresh().freeze("shared2")
    assert len(neighbour.entries) == 1 and not neighbour.incomplete, neighbour.reasons
    for url in inner_urls:
        inner = fresh(url=url)
        for rid in ("shared", "victim"):
            left = [k for k in list_keys(s3_client, bucket, inner.layout.rollout(rid)) if "/log/e/" in k]
            snapshot = await fresh(url=url).freeze(rid)
            assert len(left) == 1 and len(snapshot.entries) == 1, f"{url}: the acknowledged entry of {rid} was deleted"
            assert not snapshot.incomplete, snapshot.reasons


# Regression test (found by the adversarial review, fixed in 0d86cd4): mark_incomplete refuses the same call
# ids put refuses (ValueError), so for an unstorable model_call_id put and mark_incomplete fail together - the
# protocol's silent-loss case
@pytest.mark.parametrize("cid", ["呼" * 30, "call-\ud800"], ids=["30-cjk-chars", "lone-surrogate"])
async def test_mark_incomplete_accepts_a_call_id_that_put_cannot_store(fresh, cid):
    """A 30-character CJK call id escapes to 270 bytes (over the 255-byte segment limit). put must
    refuse it, but the marker's call id is only a label: refusing the marker too means the call
    leaves no trace and the rollout freezes complete with a hole."""
    store = fresh()
    await store.put(simple_entry("r-cid", "c0"))
    with pytest.raises(ValueError):
        await store.put(simple_entry("r-cid", cid))
    await store.mark_incomplete("r-cid", cid)  # the caller's fallback after a failed put
    assert (await fresh().freeze("r-cid")).incomplete


@pytest.mark.parametrize(
    ("name", "value"),
    [("prompt_token_ids", [99, 98]), ("model", 5), ("parent_call_id", "someone-else"), ("rollout_id", "other")],
)
async def test_an_extra_field_named_like_a_known_field_is_refused_by_put(fresh, s3_client, bucket_url, name, value):
    """``entry.extra_fields[name]`` for a known field name: the encoder wrote extras after the
    checked fields, so the stored bytes held the unchecked value (``prompt_token_ids`` gave a
    complete snapshot with tokens put never validated; others an unreadable or misfiled object).
    put and validate() now refuse it before any request (a breaker, 2026-12-02)."""
    entry = simple_entry("r-shadow", "c1")
    entry.extra_fields[name] = value
    with pytest.raises(RecordError, match=f"extra_fields \\['{name}'\\] are named like TokenEntry fields"):
        entry.validate()
    with pytest.raises(RecordError, match="named like TokenEntry fields"):
        await fresh().put(entry)
    bucket, root = split_bucket_url(bucket_url)
    assert list_keys(s3_client, bucket, root) == []  # nothing was written
    entry.extra_fields.pop(name)
    entry.extra_fields["note"] = value  # an extra field of its own name is kept, as Gym keeps it
    await fresh().put(entry)
    (stored,) = (await fresh().freeze("r-shadow")).entries
    assert stored.extra_fields == {"note": value}


def nested(depth: int) -> list:
    """``depth`` arrays, one inside the other, around a string."""
    value: list | str = "x"
    for _ in range(depth):
        value = [value]
    assert isinstance(value, list)
    return value


@pytest.mark.parametrize("where", ["extra", "output_items", "routed_experts"])
async def test_content_nested_deeper_than_gyms_encoder_writes_is_refused_by_put(fresh, s3_client, bucket_url, where):
    """Content nested 700 deep was acknowledged by put (msgspec writes it), then crashed every other
    client's freeze, read_snapshot, resolve and export with RecursionError (a copy of the decoded
    extra fields), while the writer's own cache called the snapshot complete (a breaker,
    2026-12-02). Gym's encoder, orjson, refuses more than 254 levels, counting the entry object:
    put refuses the same with RecordError and writes nothing. 253 levels below a top-level field
    (254 in all) are stored and read back by a fresh client."""
    from s3capture.fingerprint import MAX_JSON_DEPTH

    def entry_with(depth: int, rid: str):
        entry = simple_entry(rid, "c1")
        if where == "extra":
            entry.extra_fields["meta"] = nested(depth)
        elif where == "output_items":
            entry.output_items[0]["meta"] = nested(depth - 2)  # inside the list, inside an item
        else:
            entry.routed_experts = nested(depth)
        return entry

    store = fresh()
    for depth in (MAX_JSON_DEPTH, 700, 5000):
        with pytest.raises(RecordError, match="deeper than"):
            await store.put(entry_with(depth, "r-deep"))
    bucket, root = split_bucket_url(bucket_url)
    assert list_keys(s3_client, bucket, root) == []  # nothing was written
    await store.put(entry_with(MAX_JSON_DEPTH - 1, "r-ok"))
    (stored,) = (await fresh().freeze("r-ok")).entries
    assert stored == entry_with(MAX_JSON_DEPTH - 1, "r-ok")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["extra", "output_items"])
async def test_non_finite_numbers_in_free_form_content_are_refused_by_put(fresh, s3_client, bucket_url, where, value):
    """NaN or an infinity inside an extra field or an output item was acknowledged and stored as
    JSON null, while the writer's cache kept the float: two clients handed out different entries
    under one snapshot id (a breaker, 2026-12-02). put refuses them as it refuses them in
    ``generation_log_probs``, before any request."""
    entry = simple_entry("r-nan", "c1")
    if where == "extra":
        entry.extra_fields["reward"] = {"score": [value]}
    else:
        entry.output_items[0]["score"] = value
    with pytest.raises(RecordError, match="non-finite"):
        await fresh().put(entry)
    bucket, root = split_bucket_url(bucket_url)
    assert list_keys(s3_client, bucket, root) == []


def plant_deep(store, s3_client, bucket_url, rid: str, where: str, depth: int) -> TokenEntry:
    """Store, as an older s3capture or a foreign writer could have, the canonical bytes of an entry
    whose ``where`` holds ``depth`` nested arrays (spliced into the bytes: no encoder recursion)."""
    import hashlib

    import msgspec
    import zstandard
    from helpers import put_bytes

    from s3capture.fingerprint import stamp_continuation
    from s3capture.records import encode_entry

    entry = simple_entry(rid, "c1")
    stamp_continuation(entry, REQ)
    fields = msgspec.json.decode(encode_entry(entry))
    if where == "routed_experts":
        fields["routed_experts"] = "@@"
    elif where == "output_items":
        fields["output_items"][0]["meta"] = "@@"
    else:
        fields["meta"] = "@@"
    deep = b"[" * depth + b'"x"' + b"]" * depth
    payload = msgspec.json.Encoder(order="sorted").encode(fields).replace(b'"@@"', deep)
    prefix = store.layout.rollout(rid)
    key = prefix + store.layout.entry_rel(
        prefix, entry.continuation_fingerprint, "c1", hashlib.sha256(payload).hexdigest()
    )
    body = b'{"chain":[],"entry":' + payload + b',"format":"s3capture.entry/1"}'
    bucket, _ = split_bucket_url(bucket_url)
    put_bytes(s3_client, bucket, key, zstandard.ZstdCompressor().compress(body))
    return entry


@pytest.mark.parametrize(
    ("where", "depth"),
    [("output_items", 300), ("routed_experts", 300), ("extra", 900), ("routed_experts", 1500), ("output_items", 3000)],
)
async def test_a_stored_entry_nested_too_deeply_is_unreadable_not_a_crash(fresh, s3_client, bucket_url, where, depth):
    """An object an older s3capture acknowledged (it refused no depth) or a foreign writer stored:
    every reader marks it ``unreadable:`` (masked) and resolve answers UNRESOLVED, with no
    RecursionError, on the fast path (no extra fields; it read 300-deep content as healthy, and
    its typed decode raised RecursionError from about 945 levels) and the general one (extra
    fields), and a healthy rollout beside it freezes as before (breakers, 2026-12-02)."""
    store = fresh()
    entry = plant_deep(store, s3_client, bucket_url, "r-old", where, depth)
    await store.put(simple_entry("r-fine", "c1"))
    for read in (fresh().freeze, fresh().read_snapshot):
        snapshot = await read("r-old")
        assert snapshot.incomplete and any(r.startswith("unreadable:") for r in snapshot.reasons), snapshot.reasons
        assert snapshot.entries == ()
    resolution = await fresh().resolve("r-old", REQ + list(entry.output_items) + [user("next")])
    assert resolution.status == ParentResolutionStatus.UNRESOLVED
    assert not (await fresh().freeze("r-fine")).incomplete


async def test_an_export_beside_a_deeply_nested_entry_exports_the_healthy_rollouts(
    fresh, s3_client, bucket_url, tmp_path
):
    """One rollout holding content nested 1,500 deep failed its whole shard, the healthy rollouts
    with it (a breaker, 2026-12-02): it is now masked and left out, and the others exported."""
    pytest.importorskip("pyarrow")
    from s3capture.export import export

    store = fresh()
    plant_deep(store, s3_client, bucket_url, "r-deep", "routed_experts", 1500)
    for rid in ("r-a", "r-b"):
        await store.put(simple_entry(rid, "c1"))
    summary = await export(bucket_url, str(tmp_path / "out"), workers=0, min_age=0, freeze=True)
    assert summary.ok and summary.failed == 0
    assert summary.exported == 2 and summary.masked_excluded == 1


@pytest.mark.parametrize("body", [b"[" * 100_000, b"{" + b" " * (1 << 20) + b"}"], ids=["nested", "one-MiB"])
async def test_a_foreign_fence_of_any_shape_or_size_still_fences(fresh, s3_client, bucket_url, body):
    """A fence object s3capture did not write: JSON nested 100,000 deep made put, begin_call and
    mark_incomplete raise RecursionError from the fence's parse, and a large one was downloaded
    whole on every write (a breaker, 2026-12-02). An unreadable fence fences: writes fail with
    TokenCaptureFrozenError (a fence over the 64 KiB read limit is refused by the GET's limit,
    which checks the object's length before reading its body)."""
    from helpers import put_bytes

    from s3capture.protocols import TokenCaptureFrozenError

    store = fresh()
    bucket, _ = split_bucket_url(bucket_url)
    put_bytes(s3_client, bucket, store.layout.rollout("r-fence") + "fence", body)
    received: list[int] = []
    store.transport.add_hook(
        after=lambda operation, key, continuation: received.append(1) if operation == "GetObject" else None
    )
    with pytest.raises(TokenCaptureFrozenError):
        await store.put(simple_entry("r-fence", "c1"))
    with pytest.raises(TokenCaptureFrozenError):
        await store.begin_call("r-fence", "c2")
    await store.mark_incomplete("r-fence", "c3")  # a marker after a freeze is acknowledged
    assert received  # the fence was read
