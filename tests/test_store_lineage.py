"""S3TokenStore as a LineageResolver, against real local S3 servers (moto and SeaweedFS).

Every resolution that matters is made by a FRESH client (a new ``S3TokenStore`` with an empty
cache), so these tests show cross-client visibility, not a process-local index. Raw objects are
corrupted with plain boto3 through the session ``s3_client`` fixture.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import zstandard
from helpers import (
    assistant_output,
    build_conversation,
    list_keys,
    make_entry,
    next_request,
    put_bytes,
    split_bucket_url,
    system,
    turn_entry,
    user,
)

from gymcompat import require_gym

from s3capture import fingerprint as fp
from s3capture.layout import Layout
from s3capture.protocols import LineageResolution
from s3capture.records import ParentResolutionStatus, RecordError, compute_digest
from s3capture.store import CHAIN_KEYS

ROOT = ParentResolutionStatus.ROOT
RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED


async def put_fresh(fresh: Any, entry: Any) -> None:
    """Put through a client that is used for nothing else."""
    await fresh().put(entry)


def assert_resolved(resolution: LineageResolution, call_id: str, cumulative: list[int]) -> None:
    assert resolution.status == RESOLVED, resolution
    assert resolution.match is not None
    assert resolution.match.model_call_id == call_id
    assert list(resolution.match.cumulative_token_ids) == list(cumulative)
    assert isinstance(resolution.match.cumulative_token_ids, tuple)
    assert resolution.match.digest == compute_digest(cumulative)
    assert resolution.match.prev_len == len(cumulative)


REQ = [system("Be brief."), user("What is 2+2?")]
OUT = assistant_output("4")


# --------------------------------------------------------------------------- basic outcomes


async def test_resolve_from_fresh_client_after_put(fresh):
    entry = make_entry("r", "call-1", REQ, OUT, [1, 2, 3], [4, 5])
    await put_fresh(fresh, entry)

    resolution = await fresh().resolve("r", [*REQ, *OUT, user("and 3+3?")])
    assert_resolved(resolution, "call-1", [1, 2, 3, 4, 5])
    assert resolution.reason == ""


async def test_a_gym_typed_store_resolves_to_gyms_own_types(fresh):
    """``entry_type="gym"``: resolve answers with Gym's LineageResolution, so Gym's capture path
    stamps its pydantic entry with Gym's enum; s3capture's enum there made every model_dump of that
    entry warn (a Gym-integration breaker, 2026-12-03). The default store keeps s3capture's types."""
    import warnings

    require_gym()
    from nemo_gym.token_id_capture import protocols as gym
    from nemo_gym.token_id_capture import records as grec

    entry = make_entry("r", "call-1", REQ, OUT, [1, 2, 3], [4, 5])
    await put_fresh(fresh, entry)
    request = [*REQ, *OUT, user("and 3+3?")]
    ours = await fresh().resolve("r", request)
    theirs = await fresh(entry_type="gym").resolve("r", request)
    assert isinstance(ours, LineageResolution) and isinstance(ours.status, ParentResolutionStatus)
    assert isinstance(theirs, gym.LineageResolution) and isinstance(theirs.match, gym.LineageMatch)
    assert theirs.status is grec.ParentResolutionStatus.RESOLVED
    assert_resolved(theirs, "call-1", [1, 2, 3, 4, 5])
    unresolved = await fresh(entry_type="gym").resolve("r", [*REQ, *assistant_output("5"), user("?")])
    assert unresolved.status is grec.ParentResolutionStatus.UNRESOLVED and unresolved.reason == ours_reason(
        await fresh().resolve("r", [*REQ, *assistant_output("5"), user("?")])
    )
    stamped = grec.TokenEntry(
        rollout_id="r",
        model_call_id="call-2",
        prompt_token_ids=[1],
        generation_token_ids=[2],
        generation_log_probs=[-0.1],
    )
    grec.stamp_lineage(stamped, "call-1", parent_resolution=theirs.status, cumulative=[1, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pydantic's "Expected enum" serialization warning fails here
        stamped.model_dump(mode="json")
    # s3capture's own helpers take Gym's status too (a review found delta continuations refused:
    # they tested it with `is` against s3capture's enum).
    from s3capture.records import stamp_lineage, store_prompt_as_delta

    child = make_entry("r", "call-2", [*REQ, *OUT, user("and 3+3?")], OUT, [1, 2, 3, 4, 5, 6], [7])
    stamp_lineage(child, "call-1", parent_resolution=theirs.status)
    assert child.parent_resolution is RESOLVED
    store_prompt_as_delta(child, theirs.match.cumulative_token_ids)
    await fresh(entry_type="gym").put(child)


def ours_reason(resolution: LineageResolution) -> str:
    assert resolution.status == UNRESOLVED
    return resolution.reason


async def test_resolve_with_tool_results_between_calls(fresh):
    """User and tool items appended after the parent's output do not disturb the match."""
    output = [{"type": "function_call", "call_id": "fc-1", "name": "add", "arguments": '{"b": 2, "a": 2}'}]
    entry = make_entry("r", "call-1", REQ, output, [1, 2], [3])
    await put_fresh(fresh, entry)

    # A harness re-serialises tool arguments with other key order and whitespace.
    echoed = [{"type": "function_call", "call_id": "fc-1", "name": "add", "arguments": '{"a": 2,  "b": 2}'}]
    request = [*REQ, *echoed, {"type": "function_call_output", "call_id": "fc-1", "output": "4"}]
    assert_resolved(await fresh().resolve("r", request), "call-1", [1, 2, 3])


async def test_rewritten_context_is_unresolved(fresh):
    entry = make_entry("r", "call-1", REQ, OUT, [1, 2, 3], [4, 5])
    await put_fresh(fresh, entry)

    # Same model-authored history (same fingerprint), but the user turn before it was rewritten.
    rewritten = [system("Be brief."), user("What is 2+3?"), *OUT, user("and 3+3?")]
    assert fp.assistant_fingerprint(rewritten) == entry.continuation_fingerprint
    resolution = await fresh().resolve("r", rewritten)
    assert resolution.status == UNRESOLVED
    assert resolution.match is None
    assert resolution.reason == "no_match"

    # A summarised (shortened) context is rejected too.
    shortened = [*OUT, user("and 3+3?")]
    assert (await fresh().resolve("r", shortened)).status == UNRESOLVED


async def test_no_model_history_is_root(fresh):
    # Empty rollout, and a rollout holding entries: ROOT either way, without a match.
    for rollout in ("r-empty", "r-full"):
        if rollout == "r-full":
            await put_fresh(fresh, make_entry(rollout, "call-1", REQ, OUT, [1], [2]))
        for request in (
            [],
            [user("hi")],
            [system("s"), user("hi"), {"type": "function_call_output", "call_id": "x", "output": "y"}],
        ):
            resolution = await fresh().resolve(rollout, request)
            assert resolution.status == ROOT, (rollout, request, resolution)
            assert resolution.match is None


async def test_unknown_history_is_unresolved_no_match(fresh):
    await put_fresh(fresh, make_entry("r", "call-1", REQ, OUT, [1], [2]))
    resolution = await fresh().resolve("r", [*REQ, *assistant_output("5"), user("?")])
    assert (resolution.status, resolution.reason) == (UNRESOLVED, "no_match")
    # The same history in another rollout does not resolve either (per-rollout prefixes).
    resolution = await fresh().resolve("r-other", [*REQ, *OUT, user("?")])
    assert (resolution.status, resolution.reason) == (UNRESOLVED, "no_match")


async def test_multi_turn_chain_each_step_through_fresh_clients(fresh):
    turns = build_conversation("r-chain", 6, tools_every=3)
    for index, turn in enumerate(turns):
        resolution = await fresh().resolve("r-chain", turn.request_items)
        if index == 0:
            assert resolution.status == ROOT
        else:
            assert_resolved(resolution, turns[index - 1].call_id, turns[index - 1].cumulative)
            # The child's full prompt really continues the parent's cumulative tokens.
            assert turn.prompt[: resolution.match.prev_len] == list(resolution.match.cumulative_token_ids)
        await put_fresh(fresh, turn_entry("r-chain", turn))
    assert_resolved(await fresh().resolve("r-chain", next_request(turns[-1])), turns[-1].call_id, turns[-1].cumulative)

    snapshot = await fresh().freeze("r-chain")
    assert not snapshot.incomplete
    assert sorted(e.model_call_id for e in snapshot.entries) == [t.call_id for t in turns]


# --------------------------------------------------------------------------- several candidates


async def test_identical_output_different_tokens_is_ambiguous(fresh):
    # Two samples of the same request produced the same visible output but different tokens.
    await put_fresh(fresh, make_entry("r", "call-a", REQ, OUT, [1, 2, 3], [4, 5]))
    await put_fresh(fresh, make_entry("r", "call-b", REQ, OUT, [1, 2, 3], [4, 6]))
    resolution = await fresh().resolve("r", [*REQ, *OUT, user("next")])
    assert resolution.status == UNRESOLVED
    assert resolution.reason == "ambiguous"
    assert resolution.match is None


async def test_identical_cumulative_tokens_resolve_to_smallest_call_id(fresh):
    # Put the larger id first: the winner must not depend on write or LIST order.
    for call_id in ("call-c", "call-a", "call-b"):
        await put_fresh(
            fresh, make_entry("r", call_id, REQ, OUT, [1, 2, 3], [4, 5], created_at=float(ord(call_id[-1])))
        )
    request = [*REQ, *OUT, user("next")]
    for _ in range(3):
        assert_resolved(await fresh().resolve("r", request), "call-a", [1, 2, 3, 4, 5])


async def test_candidates_without_cum_len_are_compared_by_their_token_count_as_gym_does(fresh):
    """A missing ``cum_len`` counts as the entry's token count (Gym's ``add_entry``). s3capture
    compared the raw fields: two candidates without ``cum_len`` carrying one digest were one parent
    even when their tokens differed (RESOLVED where Gym says ambiguous), and an honest entry with
    ``cum_len`` beside the same tokens without it was ambiguous where Gym resolves. Found by a
    differential breaker against Gym's file store."""
    digest = compute_digest([1, 2, 3])

    def entry(rid: str, cid: str, prompt: list[int], generation: list[int], cum_len: int | None) -> Any:
        made = make_entry(rid, cid, REQ, OUT, prompt, generation)
        made.digest, made.cum_len = digest, cum_len
        return made

    request = [*REQ, *OUT, user("next")]
    await put_fresh(fresh, entry("same", "a", [1, 2], [3], None))
    await put_fresh(fresh, entry("same", "b", [1, 2], [3], 3))
    assert_resolved(await fresh().resolve("same", request), "a", [1, 2, 3])
    # b carries a's digest over other, longer tokens: Gym sees (d, 3) and (d, 4).
    await put_fresh(fresh, entry("forged", "a", [1, 2], [3], None))
    await put_fresh(fresh, entry("forged", "b", [1, 2], [4, 5], None))
    resolution = await fresh().resolve("forged", request)
    assert (resolution.status, resolution.reason) == (UNRESOLVED, "ambiguous")
    # Stricter than Gym: the same length and digest over other tokens is not one parent either.
    await put_fresh(fresh, entry("same-length", "a", [1, 2], [3], None))
    await put_fresh(fresh, entry("same-length", "b", [1, 2], [4], None))
    resolution = await fresh().resolve("same-length", request)
    assert (resolution.status, resolution.reason) == (UNRESOLVED, "ambiguous")


async def test_conflicting_payloads_for_one_call_id_are_unresolved(fresh):
    await put_fresh(fresh, make_entry("r", "call-1", REQ, OUT, [1, 2, 3], [4, 5]))
    await put_fresh(fresh, make_entry("r", "call-1", REQ, OUT, [1, 2, 3], [4, 6]))
    resolution = await fresh().resolve("r", [*REQ, *OUT, user("next")])
    assert resolution.status == UNRESOLVED
    assert resolution.reason == "conflicting_payloads"
    assert resolution.match is None
    # Also when the two payloads carry identical tokens but differ elsewhere (created_at).
    await put_fresh(fresh, make_entry("r2", "call-1", REQ, OUT, [1, 2], [3], created_at=1.0))
    await put_fresh(fresh, make_entry("r2", "call-1", REQ, OUT, [1, 2], [3], created_at=2.0))
    assert (await fresh().resolve("r2", [*REQ, *OUT, user("next")])).status == UNRESOLVED


async def test_conflicted_call_does_not_let_another_candidate_win(fresh):
    await put_fresh(fresh, make_entry("r", "call-1", REQ, OUT, [1, 2, 3], [4, 5]))
    await put_fresh(fresh, make_entry("r", "call-1", REQ, OUT, [1, 2, 3], [4, 6]))
    await put_fresh(fresh, make_entry("r", "call-2", REQ, OUT, [1, 2, 3], [4, 7]))
    resolution = await fresh().resolve("r", [*REQ, *OUT, user("next")])
    # The request may continue call-1 (whose tokens are uncertain) or call-2: nothing is proven.
    assert resolution.status == UNRESOLVED


async def test_other_fingerprint_version_is_ignored(fresh):
    for version in (1, 3):
        old = make_entry(f"r{version}", "call-old", REQ, OUT, [1, 2], [3])
        old.fingerprint_version = version
        await put_fresh(fresh, old)
        request = [*REQ, *OUT, user("next")]
        resolution = await fresh().resolve(f"r{version}", request)
        assert (resolution.status, resolution.reason) == (UNRESOLVED, "no_match")
        # A current-version call with other tokens is the only candidate: not ambiguous.
        await put_fresh(fresh, make_entry(f"r{version}", "call-new", REQ, OUT, [1, 2], [9]))
        assert_resolved(await fresh().resolve(f"r{version}", request), "call-new", [1, 2, 9])


async def test_unstamped_entry_is_invisible(fresh):
    entry = make_entry("r", "call-1", REQ, OUT, [1, 2], [3])
    entry.continuation_fingerprint = ""
    entry.continuation_context_len = 0
    entry.continuation_context_digest = ""
    await put_fresh(fresh, entry)
    resolution = await fresh().resolve("r", [*REQ, *OUT, user("next")])
    assert resolution.status == UNRESOLVED


# --------------------------------------------------------------------------- malformed input


@pytest.mark.parametrize(
    "request_items",
    [
        [None],
        ["just a string"],
        [user("hi"), 42],
        [{"role": "assistant", "content": 5}],
        [{"role": "assistant", "content": [object()]}],
        [{"role": "assistant", "content": [{"no": "type"}]}],
    ],
    ids=["none-item", "str-item", "int-item", "int-content", "object-block", "untyped-block"],
)
async def test_malformed_request_items_are_unresolved(fresh, request_items):
    await put_fresh(fresh, make_entry("r", "call-1", REQ, OUT, [1, 2], [3]))
    resolution = await fresh().resolve("r", request_items)
    assert resolution.status == UNRESOLVED
    assert resolution.reason.startswith("malformed_request")
    assert resolution.match is None


async def test_malformed_item_inside_matched_context_is_unresolved(fresh):
    await put_fresh(fresh, make_entry("r", "call-1", REQ, OUT, [1, 2], [3]))
    # The assistant history matches call-1's fingerprint; the user item inside the recorded
    # context has unsupported content, which only conversation_digest inspects.
    bad = [system("Be brief."), {"role": "user", "content": 5}, *OUT, user("next")]
    assert fp.assistant_fingerprint(bad) != ""
    resolution = await fresh().resolve("r", bad)
    assert resolution.status == UNRESOLVED


async def test_unstorable_rollout_id_raises_value_error(fresh):
    with pytest.raises((ValueError, TypeError)):
        await fresh().resolve("", [*REQ, *OUT])


# --------------------------------------------------------------------------- delta entries

DEPTH = 40


async def build_delta_chain(fresh: Any, rollout_id: str, depth: int, *, fresh_each_step: bool = True) -> list[Any]:
    """Put a linear chain of ``depth`` calls: call 0 with a full prompt, every later call a delta
    entry RESOLVED to its predecessor. With ``fresh_each_step`` each step resolves through one fresh
    client and puts through another, so every put rebuilds its ancestor keys from the bucket;
    otherwise one client resolves and puts every step (the stored objects are the same)."""
    turns = build_conversation(rollout_id, depth)
    one = fresh()
    for index, turn in enumerate(turns):
        parent_cumulative = None
        if index:
            resolution = await (fresh() if fresh_each_step else one).resolve(rollout_id, turn.request_items)
            assert_resolved(resolution, turns[index - 1].call_id, turns[index - 1].cumulative)
            parent_cumulative = list(resolution.match.cumulative_token_ids)
        entry = turn_entry(rollout_id, turn, delta=True, parent_cumulative=parent_cumulative)
        assert entry.prompt_is_delta == bool(index)
        if index:
            # The stored prompt is only the suffix after the parent's cumulative tokens.
            assert entry.prompt_token_ids == turn.prompt[len(turns[index - 1].cumulative) :]
            assert entry.cum_len == len(turn.cumulative) and entry.digest == compute_digest(turn.cumulative)
        await (fresh() if fresh_each_step else one).put(entry)
    return turns


def entry_key_of(bucket_url: str, s3_client: Any, rollout_id: str, call_id: str) -> str:
    bucket, root = split_bucket_url(bucket_url)
    keys = [k for k in list_keys(s3_client, bucket, Layout(root).rollout(rollout_id) + "log/e/") if f"/{call_id}/" in k]
    assert len(keys) == 1, keys
    return keys[0]


# One server: the chain window and the ancestor-key rebuild are the client's (plain PUT, GET and
# LIST of a few keys, which every server's other lineage tests here exercise), and 80 fresh
# clients' cold resolves and puts take 15-18 s per server in CI. SeaweedFS: a real S3
# implementation, the quickest of the three here.
@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
async def test_delta_chain_deeper_than_chain_window_resolves(fresh):
    assert DEPTH > 2 * CHAIN_KEYS  # crosses the ancestor-key window more than once
    turns = await build_delta_chain(fresh, "r-delta", DEPTH)
    deepest = turns[-1]
    assert_resolved(await fresh().resolve("r-delta", next_request(deepest)), deepest.call_id, deepest.cumulative)
    # Every depth resolves right from a fresh client (window boundaries included).
    for index in (0, 1, CHAIN_KEYS - 1, CHAIN_KEYS, CHAIN_KEYS + 1, 2 * CHAIN_KEYS, DEPTH - 2):
        turn = turns[index]
        assert_resolved(await fresh().resolve("r-delta", next_request(turn)), turn.call_id, turn.cumulative)
    # Freeze hands back the delta entries as stored.
    snapshot = await fresh().freeze("r-delta")
    assert not snapshot.incomplete and len(snapshot.entries) == DEPTH
    assert sum(e.prompt_is_delta for e in snapshot.entries) == DEPTH - 1


async def test_delta_chain_resolves_with_one_client_reused(fresh):
    """A long-lived resolver that memoised shallower cumulatives returns the same tokens."""
    turns = await build_delta_chain(fresh, "r-delta", 20)
    resolver = fresh()
    for turn in turns:
        assert_resolved(await resolver.resolve("r-delta", next_request(turn)), turn.call_id, turn.cumulative)
    for turn in reversed(turns):
        assert_resolved(await resolver.resolve("r-delta", next_request(turn)), turn.call_id, turn.cumulative)


@pytest.mark.parametrize("damage", ["garbage", "re-encoded", "deleted", "chain-tampered"])
async def test_corrupted_ancestor_makes_delta_resolve_unresolved(fresh, s3_client, bucket_url, damage):
    turns = await build_delta_chain(fresh, "r-delta", DEPTH, fresh_each_step=False)
    bucket, _ = split_bucket_url(bucket_url)
    # The deepest call (39) is rebuilt from the checkpoint of call 32 and the deltas 33..38: call 36
    # is one of the ancestors its rebuild needs.
    victim = turns[DEPTH - 4]
    key = entry_key_of(bucket_url, s3_client, "r-delta", victim.call_id)
    if damage == "garbage":
        put_bytes(s3_client, bucket, key, b"\x00not an entry")
    elif damage == "re-encoded":
        # A well-formed entry with other tokens stored under the victim's (now wrong) key.
        forged = turn_entry("r-delta", victim, delta=True, parent_cumulative=turns[DEPTH - 5].cumulative)
        forged.generation_token_ids = [7, 7, 7]
        from s3capture.records import encode_entry

        envelope = b'{"chain":[],"entry":' + encode_entry(forged) + b',"format":"s3capture.entry/1"}'
        put_bytes(s3_client, bucket, key, zstandard.ZstdCompressor().compress(envelope))
    elif damage == "deleted":
        s3_client.delete_object(Bucket=bucket, Key=key)
    else:
        # The envelope's ancestor list is not covered by the key's SHA-256: drop one ancestor from
        # the middle of the deepest call's own chain.
        key = entry_key_of(bucket_url, s3_client, "r-delta", turns[-1].call_id)
        raw = (
            zstandard.ZstdDecompressor()
            .stream_reader(io.BytesIO(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()))
            .read()
        )
        cut = raw.index(b',"cum_base":')
        chain = json.loads(raw[len(b'{"chain":') : cut])
        assert len(chain) == (DEPTH - 1) % CHAIN_KEYS
        del chain[3]
        tampered = b'{"chain":' + json.dumps(chain, separators=(",", ":")).encode() + raw[cut:]
        put_bytes(s3_client, bucket, key, zstandard.ZstdCompressor().compress(tampered))

    deepest = turns[-1]
    resolution = await fresh().resolve("r-delta", next_request(deepest))
    assert resolution.status == UNRESOLVED, resolution
    assert resolution.match is None
    assert resolution.reason.startswith("unreadable_parent"), resolution.reason
    # Calls that do not descend from the damaged object still resolve.
    for early in (turns[3], turns[2 * CHAIN_KEYS]):
        assert_resolved(await fresh().resolve("r-delta", next_request(early)), early.call_id, early.cumulative)


async def test_delta_put_with_unknown_parent_raises(fresh, s3_client, bucket_url):
    turns = build_conversation("r-orphan", 2)
    # The parent was never stored in this rollout (it exists only in another rollout).
    await put_fresh(fresh, turn_entry("r-elsewhere", turns[0]))
    child = turn_entry("r-orphan", turns[1], delta=True, parent_cumulative=turns[0].cumulative)
    with pytest.raises(RecordError, match="parent"):
        await fresh().put(child)
    # Also from a client that knows nothing and from one that just stored another call.
    writer = fresh()
    await writer.put(make_entry("r-orphan", "unrelated", REQ, OUT, [1], [2]))
    with pytest.raises(RecordError):
        await writer.put(child)
    # Nothing of the child landed.
    bucket, root = split_bucket_url(bucket_url)
    keys = list_keys(s3_client, bucket, Layout(root).rollout("r-orphan"))
    assert not [k for k in keys if f"/{turns[1].call_id}/" in k]


async def test_delta_put_with_conflicted_parent_raises(fresh):
    turns = build_conversation("r", 2)
    await put_fresh(fresh, turn_entry("r", turns[0]))
    conflicting = turn_entry("r", turns[0])
    conflicting.generation_token_ids = [1, 2, 3]
    conflicting.digest = compute_digest(turns[0].prompt + [1, 2, 3])
    conflicting.cum_len = len(turns[0].prompt) + 3
    await put_fresh(fresh, conflicting)
    child = turn_entry("r", turns[1], delta=True, parent_cumulative=turns[0].cumulative)
    with pytest.raises(RecordError, match="conflicting"):
        await fresh().put(child)


async def test_mutating_an_entry_after_put_does_not_change_what_was_stored(fresh):
    entry = make_entry("r", "call-1", REQ, OUT, [1, 2], [3])
    writer = fresh()
    await writer.put(entry)
    entry.generation_token_ids[0] = 99  # the caller reuses its object after put returned
    mine = await writer.freeze("r")
    theirs = await fresh().freeze("r")
    assert mine.snapshot_id == theirs.snapshot_id
    assert mine.entries[0].generation_token_ids == theirs.entries[0].generation_token_ids == [3]
