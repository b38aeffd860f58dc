"""Adversarial review of issue 8 (transport seam, delta checkpoints, freeze hand-out, encoder).

Each test here failed on the branch it was written against (h-break from main) except the
checkpoint-bomb test, written with its fix; each one states the promise it checks.
"""

from __future__ import annotations

import pytest
import zstandard
from helpers import (
    build_conversation,
    entry_key,
    next_request,
    put_bytes,
    put_chain,
    read_envelope,
    rollout_prefix,
    simple_entry,
    split_bucket_url,
    turn_entry,
    write_envelope,
)

from s3capture.errors import StoreError
from s3capture.records import ParentResolutionStatus, RecordError, prepare_entry

RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED


# --------------------------------------------------------------------------- forged chain hints
# The envelope's ``chain`` is, like ``cum_base``/``cum_self``, outside the SHA-256 in the key: a
# hint. The checkpoint hints are shape-checked (``is_checkpoint_rel``) and "never fetched" when
# odd; the chain's entries are not checked at all and are joined to the rollout prefix and GET.
# design.md: "Nothing in a rollout's prefix can crash a reader"; resolve's contract: UNRESOLVED.

FORGED_RELS = {
    "dotdot": "../other/log/e/x/c/" + "0" * 64 + ".zst",
    "empty": "",
    "double-slash": "log/e//c/" + "0" * 64 + ".zst",
    "too-long": "log/e/" + "a" * 2000 + "/c/" + "0" * 64 + ".zst",
}


@pytest.mark.all_transports
@pytest.mark.parametrize("forged", sorted(FORGED_RELS))
async def test_forged_chain_hint_gives_unresolved_not_a_crash(fresh, s3_client, bucket_url, forged, transport_kind):
    writer = fresh()
    turns, entries = await put_chain(writer, "r-forge", 4)
    bucket, prefix = rollout_prefix(bucket_url, "r-forge")
    key = entry_key(prefix, entries[-1])
    envelope = read_envelope(s3_client, bucket, key)
    envelope["chain"] = [FORGED_RELS[forged]]
    write_envelope(s3_client, bucket, key, envelope)
    resolution = await fresh().resolve("r-forge", next_request(turns[-1]))  # must not raise
    assert resolution.status in (UNRESOLVED, RESOLVED), resolution
    if resolution.status == RESOLVED:
        assert list(resolution.match.cumulative_token_ids) == turns[-1].cumulative


@pytest.mark.all_transports
@pytest.mark.parametrize("forged", ["dotdot", "double-slash"])
async def test_forged_chain_hint_of_parent_does_not_fail_the_childs_put(
    fresh, s3_client, bucket_url, forged, transport_kind
):
    """A put of a delta child whose parent carries a forged chain hint: checkpoints are derived data
    ("a checkpoint that cannot be computed gets none"), so the put must still land and return."""
    from s3capture.store import CHECKPOINT_EVERY

    writer = fresh()
    depth = CHECKPOINT_EVERY + 1  # the child at index depth is the first that wants a checkpoint
    turns = build_conversation("r-forge2", depth + 1)
    entries = []
    for index, turn in enumerate(turns[:depth]):
        entry = turn_entry(
            "r-forge2", turn, delta=bool(index), parent_cumulative=turns[index - 1].cumulative if index else None
        )
        await writer.put(entry)
        entries.append(entry)
    bucket, prefix = rollout_prefix(bucket_url, "r-forge2")
    key = entry_key(prefix, entries[-1])
    envelope = read_envelope(s3_client, bucket, key)
    envelope["chain"] = [FORGED_RELS[forged]] * (CHECKPOINT_EVERY - 1) + envelope["chain"][-1:]
    envelope.pop("cum_base", None)
    envelope.pop("cum_self", None)  # so the parent's tokens must be rebuilt through its chain
    write_envelope(s3_client, bucket, key, envelope)
    child = turn_entry("r-forge2", turns[depth], delta=True, parent_cumulative=turns[depth - 1].cumulative)
    other = fresh()  # a worker that never saw the chain (cold cache)
    await other.put(child)  # must not raise: the entry itself is fine
    snapshot = await fresh().freeze("r-forge2")
    assert child.model_call_id in {e.model_call_id for e in snapshot.entries}


# --------------------------------------------------------------------------- freeze hand-out


async def test_mutated_hand_out_does_not_break_a_later_freeze(fresh):
    """design.md: a caller mutating a handed-out entry's nested items is detected at the next
    hand-out and the entry is fetched again: "No caller ever sees another caller's mutations".
    A mutation that makes the cached entry unencodable (a set, a 65-bit int) must not make every
    later freeze of the rollout raise."""
    store = fresh()
    entry = simple_entry("r-mut", "c1")
    await store.put(entry)
    first = await store.freeze("r-mut")
    first.entries[0].output_items[0]["content"] = {"not", "json"}  # the caller's own copy...
    second = await store.freeze("r-mut")  # ...must not crash the next consumer
    assert not second.incomplete
    assert second.entries[0].output_items == entry.output_items


async def test_mutated_hand_out_big_int_does_not_break_a_later_freeze(fresh):
    store = fresh()
    entry = simple_entry("r-mut2", "c1")
    await store.put(entry)
    first = await store.freeze("r-mut2")
    first.entries[0].output_items[0]["n"] = 2**70
    second = await store.freeze("r-mut2")
    assert second.entries[0].output_items == entry.output_items


# --------------------------------------------------------------------------- encoder


def test_prepare_entry_raises_record_error_for_unencodable_extra_like_coerce_entry():
    """put documents RecordError for an entry that violates the record contract; the old path
    (coerce_entry + encode_entry) raised RecordError for a lone surrogate in an extra field, the
    fast path leaks a bare UnicodeEncodeError."""
    raw = {
        "rollout_id": "r",
        "model_call_id": "c",
        "prompt_token_ids": [1],
        "generation_token_ids": [2],
        "generation_log_probs": [-0.5],
        "note": "\ud800",
    }
    with pytest.raises(RecordError):
        prepare_entry(raw)


# --------------------------------------------------------------------------- transport error mapping


@pytest.mark.all_transports
async def test_get_from_a_missing_bucket_is_an_error_not_absent(s3_env, bucket_url, transport_kind):
    """A GET answered 404 NoSuchBucket is not "no such object": the aioboto3 transport raises
    StoreError naming the bucket; the obstore transport must not read it as absent (a reader would
    then judge entries "vanished" or a fence "open")."""
    from s3capture.store import S3TokenStore

    bucket, root = split_bucket_url(bucket_url)
    store = S3TokenStore(f"s3://{bucket}-missing/{root}")
    try:
        with pytest.raises(StoreError, match="does not exist"):
            await store.transport.get("t/rollouts/x/fence")
    finally:
        await store.close()


def test_obstore_list_parser_refuses_a_malformed_size_as_an_unverified_listing():
    """A ListObjectsV2 body with a non-integer <Size> is a malformed listing: botocore refuses it
    with ResponseParserError, which the aioboto3 transport turns into a retried ListingError. The
    obstore parser lets a bare ValueError escape, which leaves as a plain StoreError after one
    attempt instead of being retried like every other unverifiable page."""
    pytest.importorskip("obstore")
    from s3capture.errors import ListingError
    from s3capture.transport_obstore import _parse_list

    body = (
        b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><IsTruncated>false</IsTruncated>'
        b"<Contents><Key>p/a</Key><Size>12x</Size></Contents></ListBucketResult>"
    )
    with pytest.raises(ListingError):
        _parse_list(body, "p/")


# --------------------------------------------------------------------------- a checkpoint bomb
async def test_a_forged_checkpoint_bomb_is_refused_before_it_is_decoded(fresh, s3_client, bucket_url):
    """A checkpoint is derived data outside any SHA-256 until its digest is checked: a small zstd
    frame that inflates to 64 MiB under an entry's ``cum/<digest>.zst`` must be refused by size
    (readers then walk the chain) instead of becoming ~250 MB of Python ints first."""
    import tracemalloc

    from s3capture.store import CHAIN_KEYS

    writer = fresh()
    depth = CHAIN_KEYS + 2
    turns, entries = await put_chain(writer, "r-bomb", depth)
    bucket, prefix = rollout_prefix(bucket_url, "r-bomb")
    victim = entries[CHAIN_KEYS]  # the first entry with its own checkpoint
    key = f"{prefix}cum/{victim.digest}.zst"
    s3_client.head_object(Bucket=bucket, Key=key)  # the checkpoint exists
    count = 8 * 1024 * 1024  # 8M token ids: 64 MiB once decoded
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\x01" + count.to_bytes(8, "big") + bytes(8 * count))
    assert len(bomb) < 64 * 1024
    put_bytes(s3_client, bucket, key, bomb)
    reader = fresh()
    tracemalloc.start()
    try:
        resolution = await reader.resolve("r-bomb", next_request(turns[CHAIN_KEYS]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert resolution.status == RESOLVED, resolution
    assert list(resolution.match.cumulative_token_ids) == turns[CHAIN_KEYS].cumulative
    assert peak < 48 * 1024 * 1024, f"resolve peaked at {peak / 2**20:.0f} MiB reading a forged checkpoint"
