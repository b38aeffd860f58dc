"""An entry object filed under another continuation fingerprint's key (integration, real local S3).

An entry's key names its rollout, its continuation fingerprint, its call id and the SHA-256 of its
canonical bytes (``s3capture.layout``). The SHA-256 covers the bytes but not the key they sit at, so
a valid object copied or moved to the key of another fingerprint (same call id, same SHA-256) reads
fine and only the comparison of the decoded entry with its key shows the damage. freeze must flag
such an object ``misfiled:<key>`` (docs/design.md) and mask the rollout, and resolve must never
return it as the parent of a request whose fingerprint is the one in its key.

tests/test_store_source.py covers an entry filed under another call id; this file covers the
fingerprint segment. Objects are placed with the plain boto3 ``s3_client`` fixture.
"""

from __future__ import annotations

from typing import Any

import pytest

from helpers import (
    DEFAULT_REQUEST,
    assistant_output,
    entry_sha,
    get_bytes,
    list_keys,
    put_bytes,
    simple_entry,
    split_bucket_url,
    user,
)
from s3capture.fingerprint import assistant_fingerprint
from s3capture.records import ParentResolutionStatus

RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED
CALL = "call-1"


def _request_after(text: str) -> list[dict]:
    """The request continuing a call that answered ``text`` to ``DEFAULT_REQUEST``."""
    return [*DEFAULT_REQUEST, *assistant_output(text), user("and tomorrow?")]


def _fingerprint_of(text: str) -> str:
    """The continuation fingerprint an entry answering ``text`` to ``DEFAULT_REQUEST`` carries."""
    return assistant_fingerprint([*DEFAULT_REQUEST, *assistant_output(text)])


def _other_answer(genuine: str, *, sorts_before: bool) -> str:
    """An answer whose fingerprint sorts before (or after) the genuine one's, so both LIST orders are covered."""
    for index in range(1000):
        text = f"other answer {index}"
        if (_fingerprint_of(text) < genuine) == sorts_before and _fingerprint_of(text) != genuine:
            return text
    raise AssertionError("no answer with a fingerprint on the wanted side")  # pragma: no cover


class _Bucket:
    def __init__(self, client: Any, bucket_url: str, store: Any) -> None:
        self.client = client
        self.bucket, _ = split_bucket_url(bucket_url)
        self.layout = store.layout

    def entry_key(self, rollout_id: str, fingerprint: str, call_id: str, sha: str) -> str:
        prefix = self.layout.rollout(rollout_id)
        return prefix + self.layout.entry_rel(prefix, fingerprint, call_id, sha)

    def rel(self, rollout_id: str, key: str) -> str:
        return key[len(self.layout.rollout(rollout_id)) :]

    def entry_keys(self, rollout_id: str) -> list[str]:
        return [k for k in list_keys(self.client, self.bucket, self.layout.rollout(rollout_id)) if "/log/e/" in k]


async def _put_and_misfile(fresh: Any, s3_client: Any, bucket_url: str, rid: str, other_text: str, *, move: bool):
    """Store one entry (answer "a"), then copy (or move) its object to ``other_text``'s fingerprint key.

    Returns ``(bucket, genuine_key, misfiled_key)``. Before misfiling, checks the control: the
    genuine continuation resolves to the entry and the other one does not.
    """
    entry = simple_entry(rid, CALL, text="a")
    writer = fresh()
    await writer.put(entry)
    bucket = _Bucket(s3_client, bucket_url, writer)
    sha = entry_sha(entry)
    genuine = bucket.entry_key(rid, entry.continuation_fingerprint, CALL, sha)
    assert entry.continuation_fingerprint == _fingerprint_of("a")
    assert bucket.entry_keys(rid) == [genuine]

    control = await fresh().resolve(rid, _request_after("a"))
    assert control.status == RESOLVED and control.match.model_call_id == CALL, control
    assert (await fresh().resolve(rid, _request_after(other_text))).status == UNRESOLVED

    misfiled = bucket.entry_key(rid, _fingerprint_of(other_text), CALL, sha)
    assert misfiled != genuine
    put_bytes(s3_client, bucket.bucket, misfiled, get_bytes(s3_client, bucket.bucket, genuine))
    if move:
        s3_client.delete_object(Bucket=bucket.bucket, Key=genuine)
    assert sorted(bucket.entry_keys(rid)) == sorted([misfiled] if move else [genuine, misfiled])
    return bucket, genuine, misfiled


@pytest.mark.parametrize("sorts_before", [True, False], ids=["fp-sorts-before", "fp-sorts-after"])
async def test_entry_moved_under_another_fingerprint_is_misfiled_and_never_resolves(
    fresh, s3_client, bucket_url, sorts_before
):
    rid = f"r-moved-{sorts_before}"
    other = _other_answer(_fingerprint_of("a"), sorts_before=sorts_before)
    bucket, _, misfiled = await _put_and_misfile(fresh, s3_client, bucket_url, rid, other, move=True)

    snapshot = await fresh().freeze(rid)
    assert snapshot.incomplete
    assert f"misfiled:{bucket.rel(rid, misfiled)}" in snapshot.reasons, snapshot.reasons
    assert snapshot.entries == ()  # the misfiled object is evidence, not a training entry

    # The request whose fingerprint the key names: its context matches the entry's (same leading
    # user message), so only the fingerprint comparison keeps the entry from being returned.
    wrong = await fresh().resolve(rid, _request_after(other))
    assert wrong.status == UNRESOLVED, wrong
    assert wrong.match is None
    # Its own continuation finds nothing under its own fingerprint any more.
    assert (await fresh().resolve(rid, _request_after("a"))).status == UNRESOLVED


# Regression (found by the mutation work): freeze filed the objects it lists by (call id, SHA-256),
# so of two objects with the same call id and bytes only the one listed last was read and compared
# with its key: a misfiled copy whose key sorted before the genuine one froze complete.
@pytest.mark.parametrize(
    "sorts_before",
    [pytest.param(True, id="fp-sorts-before"), pytest.param(False, id="fp-sorts-after")],
)
async def test_entry_copied_under_another_fingerprint_is_misfiled_and_never_resolves(
    fresh, s3_client, bucket_url, sorts_before
):
    """The genuine object stays: the copy has the same call id and SHA-256 as it, in either LIST order."""
    rid = f"r-copied-{sorts_before}"
    other = _other_answer(_fingerprint_of("a"), sorts_before=sorts_before)
    bucket, _, misfiled = await _put_and_misfile(fresh, s3_client, bucket_url, rid, other, move=False)

    snapshot = await fresh().freeze(rid)
    assert snapshot.incomplete, snapshot
    assert f"misfiled:{bucket.rel(rid, misfiled)}" in snapshot.reasons, snapshot.reasons

    wrong = await fresh().resolve(rid, _request_after(other))
    assert wrong.status == UNRESOLVED, wrong
    assert wrong.match is None


async def test_misfiled_entry_is_flagged_by_a_client_that_has_it_cached(fresh, s3_client, bucket_url):
    """The writer's own client caches the object by key; the copy's key is new to it, so it is read and checked."""
    rid = "r-misfiled-warm"
    entry = simple_entry(rid, CALL, text="a")
    store = fresh()
    await store.put(entry)
    bucket = _Bucket(s3_client, bucket_url, store)
    sha = entry_sha(entry)
    genuine = bucket.entry_key(rid, entry.continuation_fingerprint, CALL, sha)
    other = _other_answer(_fingerprint_of("a"), sorts_before=False)
    misfiled = bucket.entry_key(rid, _fingerprint_of(other), CALL, sha)
    put_bytes(s3_client, bucket.bucket, misfiled, get_bytes(s3_client, bucket.bucket, genuine))
    s3_client.delete_object(Bucket=bucket.bucket, Key=genuine)

    assert (await store.resolve(rid, _request_after(other))).status == UNRESOLVED
    snapshot = await store.freeze(rid)
    assert snapshot.incomplete and f"misfiled:{bucket.rel(rid, misfiled)}" in snapshot.reasons, snapshot.reasons


# --------------------------------------------------------------------------- misfiled chain links
# A delta entry's envelope names the keys of its ancestors; that list is not covered by the key's
# SHA-256. A link naming another call's object must make the rebuild fail (UNRESOLVED), not splice
# that call's tokens in. Two checks stand there: the parent link of every ancestor (which stops the
# walk at the forged link and names it in the reason) and the final digest check (the rebuilt tokens
# must match the entry's digest). A delta entry without a digest is never rebuilt at all
# (``unverifiable_parent``, tests/test_resolve_unverifiable.py).


def _envelope(payload: bytes, chain: list[str]) -> bytes:
    import json

    import zstandard

    body = b'{"chain":' + json.dumps(chain, separators=(",", ":")).encode() + b',"entry":' + payload
    return zstandard.ZstdCompressor().compress(body + b',"format":"s3capture.entry/1"}')


@pytest.mark.parametrize("digest", [True, False], ids=["digest", "no-digest"])
@pytest.mark.parametrize("link", ["parent", "other-call"])
async def test_a_delta_chain_link_naming_another_calls_object_never_resolves(
    fresh, s3_client, bucket_url, link, digest
):
    from helpers import build_conversation, next_request, turn_entry
    from s3capture.records import encode_entry

    rid = f"r-chain-{link}-{digest}"
    parent_turn, child_turn = build_conversation(rid, 2)
    parent = turn_entry(rid, parent_turn)
    other = simple_entry(rid, "call-other", prompt=[900, 901], generation=[902], text="unrelated")
    writer = fresh()
    await writer.put(parent)
    await writer.put(other)
    child = turn_entry(rid, child_turn, delta=True, parent_cumulative=parent_turn.cumulative)
    if not digest:
        child.digest = None  # an entry without a digest: nothing could check a rebuilt chain
        child.validate()
    payload = encode_entry(child)
    bucket = _Bucket(s3_client, bucket_url, writer)
    prefix = writer.layout.rollout(rid)
    linked = parent if link == "parent" else other
    chain = [
        bucket.rel(rid, bucket.entry_key(rid, linked.continuation_fingerprint, linked.model_call_id, entry_sha(linked)))
    ]
    put_bytes(
        s3_client,
        bucket.bucket,
        bucket.entry_key(rid, child.continuation_fingerprint, child.model_call_id, entry_sha(child)),
        _envelope(payload, chain),
    )
    assert all(key.startswith(prefix) for key in bucket.entry_keys(rid))

    resolution = await fresh().resolve(rid, next_request(child_turn))
    if not digest:  # even the honest link: a digest-less delta is never rebuilt (tests/test_resolve_unverifiable.py)
        assert (resolution.status, resolution.reason) == (UNRESOLVED, "unverifiable_parent"), resolution
    elif link == "parent":  # control: the honest link rebuilds the child's full sequence
        assert resolution.status == RESOLVED, resolution
        assert resolution.match.model_call_id == child_turn.call_id
        assert list(resolution.match.cumulative_token_ids) == child_turn.cumulative
    else:
        assert resolution.status == UNRESOLVED, resolution
        assert resolution.match is None
        assert resolution.reason.startswith("unreadable_parent"), resolution.reason
        # The parent-link check names the forged link (without it only the digest check would
        # notice, after splicing, and the reason could not say where the chain broke).
        assert "is broken at 'call-other'" in resolution.reason, resolution.reason
