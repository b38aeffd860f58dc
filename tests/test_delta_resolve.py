"""Cold resolve of delta-prompt rollouts through checkpoints, against real local S3 servers.

Gym's ``delta_records: true`` stores every continuation as a delta, so without help a fresh client
rebuilds the parent's cumulative tokens through every ancestor back to the root. ``put`` writes a
checkpoint (``cum/<digest>.zst``: the entry's cumulative tokens) beside every ``CHECKPOINT_EVERY``-th
delta entry, and the envelope names the chain back to it, so a fresh resolve is LIST, GET of the
candidate, then one parallel round trip. These tests show the bound, that a damaged checkpoint
never yields a wrong RESOLVED, that checkpoints are derived data (outside version and snapshot id,
removed with the rollout), and that objects written before checkpoints still resolve both ways.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec
import pytest
import zstandard
from helpers import (
    RequestRecorder,
    build_conversation,
    entry_key,
    list_keys,
    next_request,
    put_bytes,
    put_chain,
    read_envelope,
    round_trips,
    rollout_prefix,
    turn_entry,
    write_envelope,
)

from s3capture.layout import Layout
from s3capture.records import ParentResolutionStatus, compute_digest, encode_entry, encode_token_ids
from s3capture.store import CHAIN_KEYS, CHECKPOINT_EVERY, S3TokenStore

K = CHECKPOINT_EVERY
RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED
GET, LIST = "GetObject", "ListObjectsV2"


def assert_resolved_to(resolution: Any, turn: Any) -> None:
    assert resolution.status == RESOLVED, resolution
    assert resolution.match.model_call_id == turn.call_id
    assert list(resolution.match.cumulative_token_ids) == turn.cumulative
    assert resolution.match.digest == compute_digest(turn.cumulative)


def checkpoint_key(prefix: str, entry: Any) -> str:
    return f"{prefix}cum/{entry.digest}.zst"


# --------------------------------------------------------------------------- the bound


async def test_fresh_client_resolves_a_1000_call_delta_rollout_in_three_round_trips(
    fresh, s3_client, bucket_url, s3_server
):
    # 1,000 calls on SeaweedFS (the quickest server here: 1,000 puts on moto cost CI ~50 s); the
    # same bound at 160 calls (ten checkpoints) on the others keeps CI under its budget: the
    # request pattern does not depend on the depth beyond the first K.
    depth = 1000 if s3_server.kind == "seaweedfs" else 160
    writer = fresh()
    turns, entries = await put_chain(writer, "r-long", depth)
    bucket, prefix = rollout_prefix(bucket_url, "r-long")

    # One checkpoint beside every K-th delta call, named by that call's digest, holding its tokens.
    checkpoints = sorted(k for k in list_keys(s3_client, bucket, prefix) if k.startswith(prefix + "cum/"))
    assert checkpoints == sorted(checkpoint_key(prefix, entries[i]) for i in range(K, depth, K))
    body = s3_client.get_object(Bucket=bucket, Key=checkpoint_key(prefix, entries[5 * K]))["Body"].read()
    assert zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 24) == encode_token_ids(
        turns[5 * K].cumulative
    )

    for index in (1, 2, K - 1, K, K + 1, 2 * K - 1, depth // 2, depth - 9, depth - 8, depth - 7, depth - 2, depth - 1):
        resolver = fresh()
        rec = await RequestRecorder.attach(resolver)
        resolution = await resolver.resolve("r-long", next_request(turns[index]))
        assert_resolved_to(resolution, turns[index])
        counts = rec.counts()
        assert set(counts) <= {LIST, GET} and counts[LIST] == 1, (index, counts)
        assert counts[GET] <= K + 1, (index, counts)
        assert round_trips(rec) <= 3, (index, rec.sequence)
        # What it fetched: the candidate, and either its own checkpoint or the nearest checkpoint (or
        # the root) with the deltas after it, never anything deeper.
        since = index % K
        fetched = set(rec.keys(GET))
        if index < K:
            assert fetched == {entry_key(prefix, e) for e in entries[: index + 1]}
        elif since == 0:
            assert fetched == {entry_key(prefix, entries[index]), checkpoint_key(prefix, entries[index])}
        else:
            base = index - since
            assert fetched == {
                checkpoint_key(prefix, entries[base]),
                *(entry_key(prefix, e) for e in entries[base : index + 1]),
            }
        # Warm: the same client again needs only the LIST.
        rec.reset()
        assert_resolved_to(await resolver.resolve("r-long", next_request(turns[index])), turns[index])
        assert rec.counts() == {LIST: 1}


async def test_workers_that_never_saw_the_chain_write_checkpoints_too(fresh, s3_client, bucket_url):
    """Gym's flow: each call resolved by one fresh worker and put by another (every put learns the
    parent's keys from the bucket), and the last call's continuation resolved cold in 3 round trips."""
    depth = 2 * K + 3
    turns = build_conversation("r-gym", depth)
    for index, turn in enumerate(turns):
        parent_cumulative = None
        if index:
            resolution = await fresh().resolve("r-gym", turn.request_items)
            assert_resolved_to(resolution, turns[index - 1])
            parent_cumulative = list(resolution.match.cumulative_token_ids)
        await fresh().put(turn_entry("r-gym", turn, delta=True, parent_cumulative=parent_cumulative))
    bucket, prefix = rollout_prefix(bucket_url, "r-gym")
    assert len([k for k in list_keys(s3_client, bucket, prefix) if k.startswith(prefix + "cum/")]) == 2
    resolver = fresh()
    rec = await RequestRecorder.attach(resolver)
    assert_resolved_to(await resolver.resolve("r-gym", next_request(turns[-1])), turns[-1])
    assert (
        round_trips(rec) <= 3 and rec.counts()[GET] == 2 + (depth - 1) % K
    )  # candidate, deltas since call 2K, checkpoint


async def test_no_checkpoint_is_written_past_what_a_reader_accepts(fresh, s3_client, bucket_url, monkeypatch):
    """Readers take a checkpoint of at most ``_CHECKPOINT_MAX_TOKENS`` token ids; writers used to
    PUT larger ones anyway, which every fresh resolve then fetched and discarded (a memory breaker,
    2026-12-03). With the bound between the two checkpointed calls' lengths, only the first is
    written, and the deepest call still resolves (walking past the missing one)."""
    import s3capture.store_writes

    depth = 2 * K + 3
    turns = build_conversation("r-cap", depth)
    bound = (len(turns[K].cumulative) + len(turns[2 * K].cumulative)) // 2
    monkeypatch.setattr(s3capture.store_writes, "_CHECKPOINT_MAX_TOKENS", bound)
    _, entries = await put_chain(fresh(), "r-cap", depth)
    bucket, prefix = rollout_prefix(bucket_url, "r-cap")
    checkpoints = [k for k in list_keys(s3_client, bucket, prefix) if k.startswith(prefix + "cum/")]
    assert checkpoints == [checkpoint_key(prefix, entries[K])]
    assert_resolved_to(await fresh().resolve("r-cap", next_request(turns[-1])), turns[-1])


# --------------------------------------------------------------------------- damaged checkpoints

DEPTH = 2 * K + 5  # checkpoints beside calls K and 2K; the deepest call's base is call 2K


@pytest.mark.parametrize(
    "damage",
    ["garbage", "other-tokens", "wrong-length", "truncated", "deleted", "swapped-base", "swapped-self", "foreign-hint"],
)
async def test_damaged_checkpoint_never_gives_a_wrong_resolved(fresh, s3_client, bucket_url, damage):
    writer = fresh()
    turns, entries = await put_chain(writer, "r-cp", DEPTH)
    bucket, prefix = rollout_prefix(bucket_url, "r-cp")
    victim = checkpoint_key(prefix, entries[2 * K])
    deepest_key = entry_key(prefix, entries[-1])
    if damage == "garbage":
        put_bytes(s3_client, bucket, victim, b"\x28\xb5\x2f\xfd not zstd at all")
    elif damage == "other-tokens":
        # Well-formed, under the right key, but not the tokens the digest names.
        wrong = list(turns[2 * K].cumulative)
        wrong[-1] += 1
        put_bytes(s3_client, bucket, victim, zstandard.ZstdCompressor().compress(encode_token_ids(wrong)))
    elif damage == "wrong-length":
        raw = encode_token_ids(turns[2 * K].cumulative)
        put_bytes(
            s3_client,
            bucket,
            victim,
            zstandard.ZstdCompressor().compress(raw[:1] + (10**6).to_bytes(8, "big") + raw[9:]),
        )
    elif damage == "truncated":
        body = s3_client.get_object(Bucket=bucket, Key=victim)["Body"].read()
        put_bytes(s3_client, bucket, victim, body[: len(body) // 2])
    elif damage == "deleted":
        s3_client.delete_object(Bucket=bucket, Key=victim)
    elif damage == "swapped-base":
        # The deepest call's envelope names a genuine checkpoint, but of another call.
        envelope = read_envelope(s3_client, bucket, deepest_key)
        envelope["cum_base"] = f"cum/{entries[K].digest}.zst"
        write_envelope(s3_client, bucket, deepest_key, envelope)
    elif damage == "swapped-self":
        key = entry_key(prefix, entries[2 * K])
        envelope = read_envelope(s3_client, bucket, key)
        assert envelope["cum_self"] == f"cum/{entries[2 * K].digest}.zst"
        envelope["cum_self"] = f"cum/{entries[K].digest}.zst"
        write_envelope(s3_client, bucket, key, envelope)
    else:
        # A hint outside the checkpoint shape is never fetched (it could name any key).
        envelope = read_envelope(s3_client, bucket, deepest_key)
        envelope["cum_base"] = "retired"
        write_envelope(s3_client, bucket, deepest_key, envelope)

    # The checkpoint's own call and the calls above it still resolve right: they walk the chain to
    # the previous checkpoint instead (one more round trip).
    for index in (2 * K, 2 * K + 1, DEPTH - 1):
        resolver = fresh()
        rec = await RequestRecorder.attach(resolver)
        assert_resolved_to(await resolver.resolve("r-cp", next_request(turns[index])), turns[index])
        assert round_trips(rec) <= 5, rec.sequence
        assert not any(k.endswith("/retired") for k in rec.keys(GET))
        if index == 2 * K + 1 and damage in ("garbage", "other-tokens", "wrong-length", "truncated", "deleted"):
            assert victim in rec.keys(GET)  # it was tried, judged and passed over
    # Calls that never needed it are unaffected.
    assert_resolved_to(await fresh().resolve("r-cp", next_request(turns[K + 3])), turns[K + 3])


async def test_damaged_checkpoint_and_broken_walk_is_unresolved(fresh, s3_client, bucket_url):
    """Without a usable checkpoint and with an ancestor of the walk gone, nothing can be proven."""
    writer = fresh()
    turns, entries = await put_chain(writer, "r-cp", DEPTH)
    bucket, prefix = rollout_prefix(bucket_url, "r-cp")
    wrong = list(turns[2 * K].cumulative)
    wrong[0] += 1
    put_bytes(
        s3_client,
        bucket,
        checkpoint_key(prefix, entries[2 * K]),
        zstandard.ZstdCompressor().compress(encode_token_ids(wrong)),
    )
    s3_client.delete_object(Bucket=bucket, Key=entry_key(prefix, entries[K + 5]))
    resolution = await fresh().resolve("r-cp", next_request(turns[-1]))
    assert resolution.status == UNRESOLVED and resolution.match is None, resolution
    assert resolution.reason.startswith("unreadable_parent"), resolution.reason


async def test_a_failed_checkpoint_put_does_not_fail_the_put(fresh, s3_client, bucket_url, monkeypatch):
    """The checkpoint is derived data: when its PUT fails the entry is still acknowledged, and
    readers walk the chain instead."""
    from s3capture.errors import StoreError

    writer = fresh()
    original = writer._put

    async def refuse_checkpoints(key: str, body: bytes) -> None:
        if "/cum/" in key:
            raise StoreError("injected: checkpoint PUT refused")
        await original(key, body)

    monkeypatch.setattr(writer, "_put", refuse_checkpoints)
    turns, _ = await put_chain(writer, "r-nocp", K + 3)
    bucket, prefix = rollout_prefix(bucket_url, "r-nocp")
    assert not [k for k in list_keys(s3_client, bucket, prefix) if "/cum/" in k]
    assert_resolved_to(await fresh().resolve("r-nocp", next_request(turns[-1])), turns[-1])


# --------------------------------------------------------------------------- derived data


async def test_checkpoints_do_not_count_in_version_or_snapshot_id(fresh, s3_client, bucket_url):
    writer = fresh()
    turns, entries = await put_chain(writer, "r-v", 2 * K + 1)
    bucket, prefix = rollout_prefix(bucket_url, "r-v")
    checkpoints = [k for k in list_keys(s3_client, bucket, prefix) if k.startswith(prefix + "cum/")]
    assert len(checkpoints) == 2
    first = await fresh().freeze("r-v")
    assert not first.incomplete, first.reasons
    assert first.version == len(entries)
    # The sealed manifest lists the log, not the derived checkpoints.
    (manifest_key,) = [k for k in list_keys(s3_client, bucket, prefix + "snap/")]
    manifest = json.loads(s3_client.get_object(Bucket=bucket, Key=manifest_key)["Body"].read())
    assert not [o for o in manifest["objects"] if o["key"].startswith("cum/")]
    # Without them the state is the same state.
    for key in checkpoints:
        s3_client.delete_object(Bucket=bucket, Key=key)
    second = await fresh().freeze("r-v")
    assert (second.version, second.snapshot_id, second.incomplete) == (first.version, first.snapshot_id, False)
    # And freeze hands back the same entries either way (it never reads checkpoints).
    assert [e.model_call_id for e in second.entries] == [e.model_call_id for e in first.entries]

    # A key under cum/ that is not checkpoint-shaped is foreign: it counts and masks.
    put_bytes(s3_client, bucket, prefix + "cum/not-a-digest.zst", b"x")
    third = await fresh().freeze("r-v")
    assert third.incomplete and "foreign_object:cum/not-a-digest.zst" in third.reasons
    assert third.version == first.version + 1


async def test_retire_drop_and_delete_remove_checkpoints(fresh, s3_client, bucket_url):
    writer = fresh()
    for rollout_id in ("r-retire", "r-drop", "r-delete"):
        await put_chain(writer, rollout_id, K + 2)
        bucket, prefix = rollout_prefix(bucket_url, rollout_id)
        assert len([k for k in list_keys(s3_client, bucket, prefix) if k.startswith(prefix + "cum/")]) == 1

    builder = fresh()
    assert (await builder.retire(["r-retire"]))["removed"] == ["r-retire"]
    snapshot = await builder.freeze("r-drop")
    assert not snapshot.incomplete
    assert await builder.drop("r-drop", snapshot.snapshot_id, snapshot.version)
    assert (await builder.delete(["r-delete"]))["removed"] == ["r-delete"]

    for rollout_id, left in (("r-retire", {"fence", "retired"}), ("r-drop", {"fence", "retired"}), ("r-delete", set())):
        bucket, prefix = rollout_prefix(bucket_url, rollout_id)
        assert {k[len(prefix) :] for k in list_keys(s3_client, bucket, prefix)} == left, rollout_id


# --------------------------------------------------------------------------- compatibility


class _OldEnvelope(msgspec.Struct, kw_only=True):
    """The envelope as readers before checkpoints decode it."""

    format: str
    entry: msgspec.Raw
    chain: list[str] = []


async def test_objects_written_before_checkpoints_still_resolve(fresh, s3_client, bucket_url):
    """A delta chain stored by the previous writer (16-key sliding window, no checkpoint fields)
    resolves from a fresh client; a new writer continuing it starts checkpointing at once, and
    from then on a fresh resolve is three round trips again."""
    depth = 2 * CHAIN_KEYS + 8
    turns = build_conversation("r-old", depth + K + 2)
    bucket, prefix = rollout_prefix(bucket_url, "r-old")
    layout = Layout("")
    chains: list[list[str]] = []
    rels: list[str] = []
    for index, turn in enumerate(turns[:depth]):
        entry = turn_entry(
            "r-old", turn, delta=bool(index), parent_cumulative=turns[index - 1].cumulative if index else None
        )
        payload = encode_entry(entry)
        rel = layout.entry_rel(
            prefix, entry.continuation_fingerprint, entry.model_call_id, hashlib.sha256(payload).hexdigest()
        )
        chain = [] if not index else ([rels[-1]] if index == 1 else (chains[-1] + [rels[-1]])[-CHAIN_KEYS:])
        body = (
            b'{"chain":'
            + json.dumps(chain, separators=(",", ":")).encode()
            + b',"entry":'
            + payload
            + b',"format":"s3capture.entry/1"}'
        )
        put_bytes(s3_client, bucket, prefix + rel, zstandard.ZstdCompressor().compress(body))
        chains.append(chain)
        rels.append(rel)

    resolver = fresh()
    assert_resolved_to(await resolver.resolve("r-old", next_request(turns[depth - 1])), turns[depth - 1])
    # A new worker continues the old chain (it resolved the parent, as Gym does).
    worker = fresh()
    for index in range(depth, depth + K + 2):
        resolution = await worker.resolve("r-old", turns[index].request_items)
        assert_resolved_to(resolution, turns[index - 1])
        await worker.put(
            turn_entry("r-old", turns[index], delta=True, parent_cumulative=list(resolution.match.cumulative_token_ids))
        )
    assert [k for k in list_keys(s3_client, bucket, prefix) if k.startswith(prefix + "cum/")]
    cold = fresh()
    rec = await RequestRecorder.attach(cold)
    assert_resolved_to(await cold.resolve("r-old", next_request(turns[-1])), turns[-1])
    assert round_trips(rec) <= 3 and rec.counts()[GET] <= K + 1


async def test_readers_that_predate_checkpoints_read_new_objects(fresh, s3_client, bucket_url, monkeypatch):
    """The new envelope fields are extra JSON members: the old envelope type decodes them away, and
    the chain alone (contiguous ancestors ending at the parent) still rebuilds every call."""
    writer = fresh()
    turns, entries = await put_chain(writer, "r-new", 2 * K + 5)
    bucket, prefix = rollout_prefix(bucket_url, "r-new")
    for index in (1, K, K + 1, 2 * K + 4):
        raw = zstandard.ZstdDecompressor().decompress(
            s3_client.get_object(Bucket=bucket, Key=entry_key(prefix, entries[index]))["Body"].read(),
            max_output_size=1 << 24,
        )
        old = msgspec.json.decode(raw, type=_OldEnvelope)
        assert bytes(old.entry) == encode_entry(entries[index])  # canonical bytes unchanged
        ancestors = [entry_key(prefix, e)[len(prefix) :] for e in entries[:index]]
        assert old.chain == ancestors[-len(old.chain) :] and 1 <= len(old.chain) <= CHAIN_KEYS

    # An old reader is this one with the hints ignored: it still rebuilds every depth.
    original = S3TokenStore._decode_object

    def without_hints(self: S3TokenStore, data: bytes, sha: str | None) -> Any:
        stored = original(self, data, sha)
        stored.cum_base = stored.cum_self = ""
        return stored

    monkeypatch.setattr(S3TokenStore, "_decode_object", without_hints)
    for index in (K, 2 * K + 4):
        resolver = fresh()
        rec = await RequestRecorder.attach(resolver)
        assert_resolved_to(await resolver.resolve("r-new", next_request(turns[index])), turns[index])
        assert not [k for k in rec.keys(GET) if "/cum/" in k]
