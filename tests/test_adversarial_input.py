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
        rollout_id="r-big", model_call_id="c1", prompt_token_ids=[2**64], generation_token_ids=[1],
        generation_log_probs=[-0.5], output_items=assistant_output("x"), created_at=1.0,
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
        rollout_id="r-big2", model_call_id="c1", prompt_token_ids=[2**64], generation_token_ids=[1],
        generation_log_probs=[-0.5], output_items=assistant_output("x"), created_at=1.0,
        parent_resolution=ParentResolutionStatus.ROOT,
    )
    stamp_continuation(entry, REQ)
    payload = encode_entry(entry)
    store = fresh()
    prefix = store.layout.rollout("r-big2")
    key = prefix + store.layout.entry_rel(prefix, entry.continuation_fingerprint, "c1", hashlib.sha256(payload).hexdigest())
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
async def test_retire_in_one_root_never_deletes_another_roots_entries(fresh, s3_client, bucket_url):
    """Two stores in one bucket: ``s3://B/t`` and ``s3://B/t/<rollouts dir>/shared``. The layout's
    "every LIST prefix ends in /" isolates rollouts inside one root, but nothing stops a root
    from being ``<other root>/r/<escaped id>``: rollout ``shared`` of the first store then
    contains the whole second store, and retiring it deletes the second store's acknowledged
    entries (freeze shows them as foreign objects)."""
    bucket, _ = split_bucket_url(bucket_url)
    outer = fresh()  # root "t"
    inner_url = f"s3://{bucket}/{outer.layout.rollout('shared').rstrip('/')}"
    try:
        inner = fresh(url=inner_url)
    except ValueError:
        return  # a root that nests inside another root's rollout is refused up front: fixed
    await inner.put(simple_entry("victim", "c1"))
    await outer.retire(["shared"])
    left = [k for k in list_keys(s3_client, bucket, inner.layout.rollout("victim")) if "/log/e/" in k]
    snapshot = await fresh(url=inner_url).freeze("victim")
    assert left and len(snapshot.entries) == 1, "the inner store's acknowledged entry was deleted by the outer store"


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
