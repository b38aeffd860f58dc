"""Waves of requests that fail: nothing of a failed call is still running when it raises.

A review of every plain ``asyncio.gather`` (2026-12-04) found that a failed ``delete`` of several
rollouts went on removing the others after it raised; the orphaned removal then deleted the
acknowledged entry of an attempt that reused an id after a second ``delete`` had finished. A put
whose fence GET failed raised while its entry PUT was still on the wire, and a ledger ``manifest``
whose row GET failed left the other row GETs holding the client's request slots. Faults are on the
wire (``FaultProxy`` in front of the real test server); requests are held on events, not timed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from faultproxy import s3_error
from helpers import assistant_output, list_keys, make_commit, simple_entry, split_bucket_url, system, user

from s3capture.errors import StoreError
from s3capture.layout import Layout

REQ = [system("Be brief."), user("Name a colour.")]


def _keys(s3_client: Any, bucket_url: str, rollout_id: str) -> list[str]:
    bucket, root = split_bucket_url(bucket_url)
    return list_keys(s3_client, bucket, Layout(root.rstrip("/")).rollout(rollout_id))


def _prefix(bucket_url: str, rollout_id: str) -> str:
    return Layout(split_bucket_url(bucket_url)[1].rstrip("/")).rollout(rollout_id)


@pytest.mark.all_transports
async def test_a_failed_delete_leaves_no_removal_running_to_hit_a_reused_id(
    proxy, fresh, s3_client, bucket_url
) -> None:
    writer = fresh()
    remover = fresh(endpoint_url=proxy.endpoint)
    await writer.put(simple_entry("a", "c1"))
    await writer.put(simple_entry("b", "c1", text="old attempt"))
    prefix_a, prefix_b = _prefix(bucket_url, "a"), _prefix(bucket_url, "b")
    held_once = asyncio.Event()
    release = asyncio.Event()

    async def rule(request: Any) -> Any:
        prefix = request.params.get("prefix") if request.is_list else None
        if prefix == prefix_a:
            return s3_error(403, "AccessDenied", "injected: no access to this rollout", "Forbidden")
        if prefix == prefix_b and not held_once.is_set():
            held_once.set()
            await release.wait()  # b's removal is under way while a's fails
        return None

    proxy.rule = rule
    asyncio.get_running_loop().call_later(0.5, release.set)
    with pytest.raises(StoreError) as failed:
        await remover.delete(["a", "b"])
    # When delete raises, b's removal has finished (it was under way): none of it is still running.
    assert release.is_set()
    assert _keys(s3_client, bucket_url, "b") == []
    assert any("1 of 2 rollouts failed" in note for note in getattr(failed.value, "__notes__", []))

    proxy.rule = None
    assert await remover.delete(["a", "b"]) == {"removed": ["a"], "absent": ["b"]}
    # The id is reused; the new attempt's acknowledged entry must survive.
    await writer.put(simple_entry("b", "c1", text="new attempt"))
    await asyncio.sleep(0.5)
    snapshot = await writer.freeze("b")
    assert [e.model_call_id for e in snapshot.entries] == ["c1"] and not snapshot.incomplete


async def test_after_the_first_failed_rollout_no_other_removal_starts(proxy, fresh, s3_client, bucket_url) -> None:
    writer = fresh()
    ids = [f"r{i:02d}" for i in range(20)]
    for rollout_id in ids:
        await writer.put(simple_entry(rollout_id, "c1"))
    failing = _prefix(bucket_url, ids[0])

    async def rule(request: Any) -> Any:
        if request.is_list and request.params.get("prefix") == failing:
            return s3_error(403, "AccessDenied", "injected", "Forbidden")
        return None

    proxy.rule = rule
    remover = fresh(endpoint_url=proxy.endpoint)
    with pytest.raises(StoreError) as failed:
        await remover.retire(ids)
    note = " ".join(getattr(failed.value, "__notes__", []))
    assert "not started after the failure" in note
    untouched = [
        r
        for r in ids
        if _keys(s3_client, bucket_url, r) and not any(k.endswith("/fence") for k in _keys(s3_client, bucket_url, r))
    ]
    # At most the first wave of eight was under way; the rest were never started.
    assert len(untouched) >= len(ids) - 8
    await asyncio.sleep(0.5)  # nothing left running retires them later
    assert len([r for r in ids if not any(k.endswith("/fence") for k in _keys(s3_client, bucket_url, r))]) == len(
        untouched
    )
    proxy.rule = None
    assert set((await remover.retire(ids))["removed"]) >= set(untouched)


@pytest.mark.all_transports
async def test_a_put_that_raises_has_no_request_still_on_the_wire(proxy, fresh, s3_client, bucket_url) -> None:
    store = fresh(endpoint_url=proxy.endpoint)
    release = asyncio.Event()
    prefix = _prefix(bucket_url, "r-put")

    async def rule(request: Any) -> Any:
        if request.method == "GET" and request.key.endswith(prefix + "fence"):
            return s3_error(403, "AccessDenied", "injected: fence unreadable", "Forbidden")
        if request.method == "PUT" and "/log/e/" in request.key:
            await release.wait()
        return None

    proxy.rule = rule
    asyncio.get_running_loop().call_later(0.5, release.set)
    with pytest.raises(StoreError):
        await store.put(simple_entry("r-put", "c1"))
    # The entry PUT was awaited before the error was raised: it has landed, and lands no later.
    assert release.is_set()
    assert any("/log/e/" in key for key in _keys(s3_client, bucket_url, "r-put"))


async def test_a_ledger_manifest_fails_at_its_first_failed_row(proxy, ledgers, bucket_url) -> None:
    writer = ledgers()
    rid = "r-ledger"
    for i in range(12):
        await writer.record(make_commit(rid, f"call-{i:02d}", REQ, assistant_output(f"a{i}")))
    release = asyncio.Event()
    failing = "/ledger/row/call-03/"

    async def rule(request: Any) -> Any:
        if request.method == "GET" and failing in request.key:
            return s3_error(403, "AccessDenied", "injected: row unreadable", "Forbidden")
        if request.method == "GET" and "/ledger/row/" in request.key:
            await release.wait()  # the other rows are held until the test lets them go
        return None

    proxy.rule = rule
    reader = ledgers(endpoint_url=proxy.endpoint, max_concurrency=4)
    try:
        with pytest.raises(StoreError, match="call-03"):
            await asyncio.wait_for(reader.manifest(rid), 30)
        # It raised while the other row GETs were still held: they were cancelled, not waited for.
        assert not release.is_set()
    finally:
        release.set()


def _is_delete_objects(request: Any) -> bool:
    return request.method == "POST" and "delete" in request.query.split("&")


@pytest.mark.all_transports
async def test_a_failing_delete_wave_starts_no_more_keys_after_the_first_failure(
    proxy, fresh, s3_client, bucket_url
) -> None:
    """A breaker (2026-12-04) on the first version of the fix: a wave of single DELETEs (a store
    without DeleteObjects) settled, but every queued DELETE still went out, with its retries,
    after the first had failed: 124 requests and 78 s for 24 keys. Now no key is started after
    the first failure."""
    writer = fresh()
    for i in range(24):
        await writer.put(simple_entry("r-del", f"c{i:02d}"))
    deletes: list[str] = []

    async def rule(request: Any) -> Any:
        if _is_delete_objects(request):
            return s3_error(501, "NotImplemented", "injected: no DeleteObjects", "Not Implemented")
        if request.method == "DELETE":
            deletes.append(request.key)
            return s3_error(403, "AccessDenied", "injected: no DELETE", "Forbidden")
        return None

    proxy.rule = rule
    remover = fresh(endpoint_url=proxy.endpoint, max_concurrency=4)
    with pytest.raises(StoreError) as failed:
        await remover.retire(["r-del"])
    assert 1 <= len(deletes) <= 4, deletes  # the first wave at most, never the 24
    notes = " ".join(getattr(failed.value, "__notes__", []))
    assert "keys failed" in notes and "not started after the failure" in notes, notes
    proxy.rule = None
    assert (await remover.retire(["r-del"]))["removed"] == ["r-del"]
    assert [k for k in _keys(s3_client, bucket_url, "r-del") if "/log/" in k] == []


@pytest.mark.parametrize("how", ["cacheless", "after_a_failed_retire"])
async def test_a_delta_put_after_another_client_reused_the_id_lists_instead_of_failing(
    proxy, fresh, bucket_url, how
) -> None:
    """A breaker (2026-12-04): a client whose map of call keys named an entry another client had
    deleted since (the id reused) failed every delta put of the new attempt ("parent disappeared")
    until restarted: a client without a cache, or one whose ``retire`` of several ids failed for
    another id (the finished ones kept their map). A failed retire now forgets its ids too, and
    the map is a shortcut: when the object it names is gone, the parent is looked up by a listing."""
    from helpers import build_conversation, turn_entry

    if how == "cacheless":
        old_writer = fresh(cache_bytes=0)
    else:
        old_writer = fresh(endpoint_url=proxy.endpoint)
    other = fresh()
    old = build_conversation("x", 2)
    await old_writer.put(turn_entry("x", old[0]))
    await old_writer.put(turn_entry("x", old[1], delta=True, parent_cumulative=old[0].cumulative))
    if how == "after_a_failed_retire":
        await old_writer.put(simple_entry("y", "c1"))
        refused = _prefix(bucket_url, "y")

        async def rule(request: Any) -> Any:
            if request.is_list and request.params.get("prefix") == refused:
                return s3_error(403, "AccessDenied", "injected", "Forbidden")
            return None

        proxy.rule = rule
        with pytest.raises(StoreError):
            await old_writer.retire(["x", "y"])
        proxy.rule = None
    assert (await other.delete(["x"]))["removed"] == ["x"]
    new = build_conversation("x", 2, token_base=5000)
    await other.put(turn_entry("x", new[0]))
    await old_writer.put(turn_entry("x", new[1], delta=True, parent_cumulative=new[0].cumulative))
    snapshot = await other.freeze("x")
    assert not snapshot.incomplete and [e.model_call_id for e in snapshot.entries] == ["call-000", "call-001"]
    resolution = await fresh().resolve("x", list(new[1].request_items) + list(new[1].output_items) + [user("more")])
    assert resolution.status.name == "RESOLVED" and resolution.match.model_call_id == "call-001"
    assert list(resolution.match.cumulative_token_ids) == list(new[1].prompt) + list(new[1].generation)
