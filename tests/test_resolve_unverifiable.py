"""No wrong parent is ever RESOLVED: attacks from a breaker session of 2026-12-02 on
``S3TokenStore.resolve``.

A delta entry without a ``digest`` (Gym's schema allows it; Gym's own capture always stamps one)
was rebuilt through its envelope's ``chain``, a hint outside the key's SHA-256, and nothing checked
the result: a writer whose call-key map was stale (a conflicting payload, a rollout deleted and
reused) or a forged hint produced RESOLVED with another payload's tokens. Such a winner is now
UNRESOLVED ``unverifiable_parent``; an ancestor of another rollout breaks the chain. Each test fails
when resolve returns RESOLVED with a parent or cumulative tokens that are not the true ones.
"""

from __future__ import annotations

from typing import Any

import pytest

from helpers import (
    RequestRecorder,
    assistant_output,
    build_conversation,
    entry_key,
    make_entry,
    next_request,
    put_bytes,
    read_envelope,
    rollout_prefix,
    round_trips,
    turn_entry,
    write_envelope,
)
from s3capture.records import ParentResolutionStatus, encode_entry

RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED


def assert_not_wrong(resolution: Any, true_call: str, true_tokens: list[int]) -> None:
    """The promise: UNRESOLVED, or RESOLVED to the true parent with exactly its tokens."""
    if resolution.status == RESOLVED:
        got = list(resolution.match.cumulative_token_ids)
        assert resolution.match.model_call_id == true_call, resolution
        assert got == true_tokens, (
            f"RESOLVED {resolution.match.model_call_id} with wrong cumulative tokens:\n got  {got}\n true {true_tokens}"
        )


def digestless(entry: Any) -> Any:
    """A delta entry whose writer did not stamp ``digest``/``cum_len`` (both Optional in Gym's schema;
    put accepts it)."""
    entry.digest = None
    entry.cum_len = None
    return entry


# --------------------------------------------------------------------------- A: legit writers only
@pytest.mark.parametrize("with_digest", [False, True])
async def test_A_stale_call_keys_of_a_writer_build_a_wrong_chain(fresh, with_digest):
    """Two workers write call-000 (race 5: a regenerated retry with another output lands under another
    fingerprint). Worker W wrote the loser c0'; worker R resolves call-001's request to the true c0;
    W then puts the delta call-001: its CallKeys still name only c0' (no LIST), so the envelope chain
    names c0'. Without a digest nothing checks the chain: a cold resolve of call-002's request returns
    c0'.cumulative + delta instead of c0.cumulative + delta."""
    rid = "r-a"
    turns = build_conversation(rid, 3)
    w, w2, r = fresh(), fresh(), fresh()
    loser = make_entry(
        rid,
        turns[0].call_id,
        turns[0].request_items,
        assistant_output("a regenerated answer"),
        turns[0].prompt,
        [9001, 9002, 9003, 9004],
    )
    await w.put(loser)
    await w2.put(turn_entry(rid, turns[0]))
    first = await r.resolve(rid, turns[1].request_items)
    assert first.status == RESOLVED and list(first.match.cumulative_token_ids) == turns[0].cumulative
    child = turn_entry(rid, turns[1], delta=True, parent_cumulative=list(first.match.cumulative_token_ids))
    if not with_digest:
        digestless(child)
    await w.put(child)
    resolution = await fresh().resolve(rid, next_request(turns[1]))
    assert_not_wrong(resolution, turns[1].call_id, turns[1].cumulative)


# --------------------------------------------------------------------------- B: foreign chain hint
@pytest.mark.parametrize("with_digest", [False, True], ids=["no-digest", "digest"])
async def test_B_forged_chain_names_a_misfiled_copy_of_another_rollout(fresh, s3_client, bucket_url, with_digest):
    """An object of rollout "other" (same call id, other tokens) copied under r's prefix at an
    entry-shaped key with a valid SHA-256; the delta's envelope chain (a hint outside the key's SHA)
    is rewritten to name it. Ancestors' rollout_id was never checked. Without a digest the delta is
    never rebuilt; with one, the walk stops at the other rollout's object and names it (the digest
    check would also refuse the spliced tokens, but could not say why)."""
    rid = f"r-b-{with_digest}"
    turns = build_conversation(rid, 3)
    writer = fresh()
    await writer.put(turn_entry(rid, turns[0]))
    child = turn_entry(rid, turns[1], delta=True, parent_cumulative=turns[0].cumulative)
    if not with_digest:
        digestless(child)
    await writer.put(child)
    bucket, prefix = rollout_prefix(bucket_url, rid)
    foreign = make_entry("other", turns[0].call_id, turns[0].request_items, turns[0].output_items, [5, 5, 5], [6, 6, 6])
    foreign_key = entry_key(prefix, foreign)
    true_key = entry_key(prefix, turn_entry(rid, turns[0]))
    # the same shape of body put writes
    body = writer._encode_object(encode_entry(foreign), ())
    put_bytes(s3_client, bucket, foreign_key, body)
    child_key = entry_key(prefix, child)
    envelope = read_envelope(s3_client, bucket, child_key)
    assert envelope["chain"] == [true_key[len(prefix) :]]
    envelope["chain"] = [foreign_key[len(prefix) :]]
    write_envelope(s3_client, bucket, child_key, envelope)
    resolution = await fresh().resolve(rid, next_request(turns[1]))
    assert_not_wrong(resolution, turns[1].call_id, turns[1].cumulative)
    if with_digest:
        assert resolution.status == UNRESOLVED, resolution
        assert f"is broken at {turns[0].call_id!r}" in resolution.reason, resolution.reason


# --------------------------------------------------------------------------- D: budget
async def test_D_a_digestless_delta_chain_is_unresolved_within_2_round_trips(fresh):
    """The budget claim: at most 3 sequential round trips from a fresh client at any length. A chain of
    digest-less deltas never gets a checkpoint (put needs a digest to name and verify one); it took
    7 round trips and 70 GETs to resolve, unverified."""
    rid = "r-d"
    depth = 70
    turns = build_conversation(rid, depth)
    writer = fresh()
    for index, turn in enumerate(turns):
        entry = turn_entry(
            rid, turn, delta=bool(index), parent_cumulative=turns[index - 1].cumulative if index else None
        )
        if index:
            digestless(entry)
        await writer.put(entry)
    resolver = fresh()
    rec = await RequestRecorder.attach(resolver)
    resolution = await resolver.resolve(rid, next_request(turns[-1]))
    # Nothing could verify a walk of 70 unchecked links: UNRESOLVED at once, not after 70 GETs.
    assert (resolution.status, resolution.reason) == (UNRESOLVED, "unverifiable_parent"), resolution
    assert round_trips(rec) <= 2, f"{round_trips(rec)} sequential round trips, {rec.counts()}"


# --------------------------------------------------------------------------- E: delete + reuse, no conflict
async def test_E_reused_rollout_id_and_a_worker_cache_give_wrong_tokens(fresh):
    """The reference's rule: delete a rollout id before reusing it. Worker W (long-lived) wrote
    call-000 of the old attempt; a builder deletes the rollout; the new attempt's call-000 (same items,
    other tokens: e.g. a changed chat template) is written by W2 and resolved by R. W puts the new
    digest-less delta call-001: W's CallKeys still name the old call-000 key and W's cache still holds
    that object, so the chain names a key that no longer exists. W's own resolve of call-002's
    request walks it through its cache: RESOLVED with the OLD attempt's tokens. No conflict, no
    foreign bytes; the new attempt freezes complete."""
    rid = "r-e"
    old = build_conversation(rid, 3, token_base=1000)
    new = build_conversation(rid, 3, token_base=5000)
    w, w2, r, builder = fresh(), fresh(), fresh(), fresh()
    await w.put(turn_entry(rid, old[0]))
    assert (await builder.delete([rid]))["removed"] == [rid]
    await w2.put(turn_entry(rid, new[0]))
    first = await r.resolve(rid, new[1].request_items)
    assert first.status == RESOLVED and list(first.match.cumulative_token_ids) == new[0].cumulative
    await w.put(digestless(turn_entry(rid, new[1], delta=True, parent_cumulative=new[0].cumulative)))
    snapshot = await fresh().freeze(rid)
    assert not snapshot.incomplete, snapshot.reasons  # the new attempt looks trainable
    resolution = await w.resolve(rid, next_request(new[1]))
    assert_not_wrong(resolution, new[1].call_id, new[1].cumulative)


async def test_E2_the_same_with_a_digest_is_unresolved_not_wrong(fresh):
    """The same with a digest: the chain W wrote names the deleted key, so the digest check refuses
    it and every client answers UNRESOLVED for the continuations of call-001 (a liveness cost,
    docs/design.md race 8), never a wrong RESOLVED."""
    rid = "r-e2"
    old = build_conversation(rid, 3, token_base=1000)
    new = build_conversation(rid, 3, token_base=5000)
    w, w2, r, builder = fresh(), fresh(), fresh(), fresh()
    await w.put(turn_entry(rid, old[0]))
    await builder.delete([rid])
    await w2.put(turn_entry(rid, new[0]))
    await r.resolve(rid, new[1].request_items)
    await w.put(turn_entry(rid, new[1], delta=True, parent_cumulative=new[0].cumulative))
    mine = await w.resolve(rid, next_request(new[1]))
    cold = await fresh().resolve(rid, next_request(new[1]))
    assert_not_wrong(mine, new[1].call_id, new[1].cumulative)
    assert_not_wrong(cold, new[1].call_id, new[1].cumulative)


async def test_F_stale_keys_of_a_conflicted_parent_are_listed_again_not_taken_for_a_conflict(fresh):
    """The Ceph chaos run of 2026-12-02: a writer whose map held two keys for call-000 (it had
    listed the old attempt's conflict) refused the new attempt's delta call-001 as "conflicting"
    after the id was deleted and reused, then put call-002 on its stale key of call-001: that
    continuation resolved UNRESOLVED although every call of the new attempt had been put in order.
    A map with other than one key for the parent is now checked by a listing first."""
    rid = "r-f"
    turns = build_conversation(rid, 3)
    w, other, builder = fresh(), fresh(), fresh()
    await other.put(turn_entry(rid, turns[0]))
    forked = make_entry(
        rid,
        turns[0].call_id,
        turns[0].request_items,
        turns[0].output_items,
        turns[0].prompt,
        [*turns[0].generation, 77],
    )
    await other.put(forked)  # a conflicting payload of call-000 (same output, other tokens)
    with pytest.raises(ValueError, match="conflicting stored entries"):  # a real conflict: refused
        await w.put(turn_entry(rid, turns[1], delta=True, parent_cumulative=turns[0].cumulative))
    assert (await builder.delete([rid]))["removed"] == [rid]
    # The new attempt, served in order by the same writer: nothing conflicts any more.
    await w.put(turn_entry(rid, turns[0]))
    await w.put(turn_entry(rid, turns[1], delta=True, parent_cumulative=turns[0].cumulative))
    await w.put(turn_entry(rid, turns[2], delta=True, parent_cumulative=turns[1].cumulative))
    for resolver in (w, fresh()):
        resolution = await resolver.resolve(rid, next_request(turns[2]))
        assert resolution.status == RESOLVED and list(resolution.match.cumulative_token_ids) == turns[2].cumulative
    snapshot = await fresh().freeze(rid)
    assert not snapshot.incomplete and len(snapshot.entries) == 3, snapshot.reasons
