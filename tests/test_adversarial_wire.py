"""Adversarial: lost responses on every request kind, and what "the same payload" means on the wire."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import build_conversation, next_request, simple_entry, turn_entry
from test_adversarial_faultproxy import DropResponse, FaultProxy

from s3capture.protocols import TokenCaptureFrozenError
from s3capture.records import ParentResolutionStatus


async def test_first_response_of_every_request_lost_keeps_every_invariant(s3_server, fresh):
    """Holds: each distinct request executes on the server but its first response never arrives
    (botocore retries it). begin_call/put/resolve/freeze/drop still give a complete snapshot
    with every entry, RESOLVED lineage and a successful drop."""
    proxy = await FaultProxy(s3_server.port).start()
    lost: set[tuple[str, str, str]] = set()

    async def rule(request: Any) -> Any:
        ident = (request.method, request.path, request.query)
        if ident not in lost:
            lost.add(ident)
            return DropResponse()
        return None

    proxy.rule = rule
    try:

        def make():
            return fresh(endpoint_url=proxy.endpoint, fence_grace=1.0)

        turns = build_conversation("r-lossy", 4)
        cum = None
        for turn in turns:
            worker = make()
            if turn.parent_call_id is not None:
                resolution = await worker.resolve("r-lossy", turn.request_items)
                assert resolution.status == ParentResolutionStatus.RESOLVED, resolution
                assert resolution.match.model_call_id == turn.parent_call_id
            await worker.begin_call("r-lossy", turn.call_id)
            await worker.put(turn_entry("r-lossy", turn, delta=cum is not None, parent_cumulative=cum))
            cum = turn.cumulative
        last = await make().resolve("r-lossy", next_request(turns[-1]))
        assert last.status == ParentResolutionStatus.RESOLVED
        snapshot = await make().freeze("r-lossy")
        assert not snapshot.incomplete, snapshot.reasons
        assert {e.model_call_id for e in snapshot.entries} == {t.call_id for t in turns}
        assert await make().drop("r-lossy", snapshot.snapshot_id, snapshot.version)
        assert len(lost) > 10
    finally:
        await proxy.stop()


# Fixed: was a strict xfail (BUG) until the fix landed; now a regression test.
async def test_identical_retry_from_another_client_keeps_the_snapshot_id(fresh):
    entry = simple_entry("r-etag", "c1", generation=list(range(200)), log_probs=[-0.5] * 200)
    await fresh(compression_level=3).put(entry)
    first = await fresh().freeze("r-etag")
    with pytest.raises(TokenCaptureFrozenError):
        await fresh(compression_level=19).put(entry)  # the identical payload: "a no-op"
    second = await fresh().freeze("r-etag")
    assert (second.version, len(second.entries)) == (first.version, len(first.entries))
    assert second.snapshot_id == first.snapshot_id


# Fixed: was a strict xfail (BUG) until the fix landed; now a regression test.
async def test_cached_entries_do_not_alias_extra_fields(fresh):
    import json

    from s3capture.records import encode_entry

    raw = json.loads(encode_entry(simple_entry("r-alias", "c1")))
    raw["harness_meta"] = {"tags": ["a"]}
    store = fresh()
    await store.put(raw)
    raw["harness_meta"]["tags"].append("mutated-after-put")  # the caller reuses its dict
    first = await store.freeze("r-alias")
    first.entries[0].extra_fields["harness_meta"]["tags"].append("mutated-by-consumer")
    again = await store.freeze("r-alias")
    stored = await fresh().freeze("r-alias")  # what the bucket holds
    assert again.entries[0].extra_fields == stored.entries[0].extra_fields == {"harness_meta": {"tags": ["a"]}}
