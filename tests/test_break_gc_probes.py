"""Breaking ``s3capture gc``'s removal of leftover listing probes (rule 7, ``delete_probes``) and
the probed export (``export(..., probe_listing=True)``), on the real servers through the fault proxy.

A probe whose LastModified lies far back while its call is still running (a store node whose
clock runs behind: ``now=`` ``SKEW`` seconds ahead stands for it) is the only way ``gc`` can take a
live probe for a leftover one; these tests let it, and check that the probed call still answers
as a plain one would. The others race ``gc``'s listing, its re-check and its delete with writes
under the same id through listings that lag, and reuse ids whose probes cancelled or failing
calls left behind.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import botocore.exceptions
import pytest

from faultproxy import ApplyLate, ListHideYoung
from helpers import (
    assistant_output,
    build_conversation,
    turn_entry,
    list_keys,
    make_commit,
    put_chain,
    simple_entry,
    split_bucket_url,
    user,
)
from s3capture.export import export, format_summary
from s3capture.layout import Layout, is_ledger_probe_rel
from s3capture.ops import GcAction, gc

pytestmark = pytest.mark.usefixtures("not_on_the_ceph_gateway")

AGE = 3600.0  # gc's threshold: the smallest the command line takes without a warning
SKEW = 7200.0  # seconds "now" is ahead of the LastModified the store gave (a node clock behind)
LAG_MS = 300.0
REQ = [user("hello")]


def _keys(s3_client: Any, bucket_url: str, rollout_id: str) -> list[str]:
    """The keys under the rollout prefix of ``rollout_id``, relative to it."""
    bucket, root = split_bucket_url(bucket_url)
    prefix = Layout(root.rstrip("/")).rollout(rollout_id)
    return [key[len(prefix) :] for key in list_keys(s3_client, bucket, prefix)]


def _probes(s3_client: Any, bucket_url: str) -> list[str]:
    bucket, root = split_bucket_url(bucket_url)
    return [key for key in list_keys(s3_client, bucket, root) if "/ledger/.probe/" in key]


def _put_probe(s3_client: Any, bucket_url: str, rollout_id: str, hex32: str = "a" * 32) -> str:
    """A leftover probe (a late-applied probe PUT), written directly to the server."""
    bucket, root = split_bucket_url(bucket_url)
    rel = f"ledger/.probe/{hex32}"
    s3_client.put_object(Bucket=bucket, Key=Layout(root.rstrip("/")).rollout(rollout_id) + rel, Body=b"")
    return rel


async def _until(predicate: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _settled(proxy: Any, seconds: float = 10.0) -> None:
    """Wait until nothing a client sent through the proxy can still land at the server."""
    await _until(lambda: not proxy.in_flight(), seconds)


async def _gc(store: Any, *, now: float, prefix: str = "") -> tuple[Any, list[tuple[str, str, list[str]]]]:
    actions: list[GcAction] = []
    report = await gc(store, AGE, now=now, dry_run=False, prefix=prefix, on_action=actions.append)
    return report, [(a.rollout_id, a.action, a.keys) for a in actions]


# --------------------------------------------------------------------------- gc takes a live probe
async def test_gc_deleting_the_probe_of_a_probed_freeze_whose_fence_put_is_in_flight(
    fresh: Any, proxy: Any, s3_client: Any, bucket_url: str
) -> None:
    """A probed freeze of an unused id: its probe PUT has landed, its fence PUT is held, so the
    probe is the prefix's only key. ``gc --yes`` (the probe looking two hours old) deletes it; the
    freeze then lists without its probe, probes again and answers an empty, complete snapshot,
    the one a plain freeze gives; its fence stands and no probe is left."""
    release = asyncio.Event()

    async def rule(request: Any) -> Any:
        if request.method == "PUT" and request.path.endswith("/rollouts/r/fence"):
            await release.wait()
        return None

    proxy.rule = rule
    freezer = fresh(endpoint_url=proxy.endpoint, probe_listing=True)
    task = asyncio.ensure_future(freezer.freeze("r"))
    await _until(lambda: bool(_keys(s3_client, bucket_url, "r")))
    (probe,) = _keys(s3_client, bucket_url, "r")
    assert is_ledger_probe_rel(probe)

    report, actions = await _gc(fresh(), now=time.time() + SKEW)
    assert actions == [("r", "delete_probes", [probe])] and report.deleted_objects == 1
    release.set()
    snapshot = await asyncio.wait_for(task, 60)
    await _settled(proxy)
    assert (snapshot.version, snapshot.entries, snapshot.incomplete) == (0, (), False)
    keys = _keys(s3_client, bucket_url, "r")
    assert keys[0] == "fence" and len(keys) == 2 and keys[1].startswith("snap/"), keys
    plain = await fresh().freeze("r")
    assert (plain.version, plain.snapshot_id) == (snapshot.version, snapshot.snapshot_id)
    assert {info.rollout_id: info.state async for info in fresh().rollouts()} == {"r": "frozen"}


@pytest.mark.parametrize("call", ["manifest", "has_rows", "retire", "delete"])
async def test_gc_deleting_the_probe_of_a_probed_ledger_call_on_an_unused_id(
    ledgers: Any, proxy: Any, s3_client: Any, bucket_url: str, call: str
) -> None:
    """A probed ``manifest``/``has_rows``/``retire``/``delete`` of an unused id: its probe is the
    prefix's only key while the call's LIST is held. ``gc --yes`` deletes it; the call answers as
    a plain one does (an empty manifest, no rows, absent), leaves no probe, and the id then takes
    a row that a manifest reads back."""
    release = asyncio.Event()
    held: list[str] = []

    probe_put: list[str] = []

    async def rule(request: Any) -> Any:
        if request.method == "PUT" and "/ledger/.probe/" in request.path:
            probe_put.append(request.path)
        elif request.is_list and probe_put and not held:  # the first LIST after the probe PUT
            held.append(request.params["prefix"])
            await release.wait()
        return None

    proxy.rule = rule
    probed = ledgers(endpoint_url=proxy.endpoint, probe_listing=True)
    task = asyncio.ensure_future(getattr(probed, call)(["r"] if call in ("retire", "delete") else "r"))
    await _until(lambda: bool(held))
    (probe,) = _keys(s3_client, bucket_url, "r")
    report, actions = await _gc(ledgers(), now=time.time() + SKEW)
    assert actions == [("r", "delete_probes", [probe])] and report.deleted_objects == 1
    release.set()
    answer = await asyncio.wait_for(task, 60)
    await _settled(proxy)
    plain = ledgers()
    expected = {
        "manifest": lambda: plain.manifest("other"),
        "has_rows": lambda: plain.has_rows("other"),
        "retire": lambda: plain.retire(["other"]),
        "delete": lambda: plain.delete(["other"]),
    }[call]
    same = await expected()
    if call in ("retire", "delete"):
        assert answer == {"removed": [], "absent": ["r"]} and same == {"removed": [], "absent": ["other"]}
    else:
        if call == "manifest":
            answer = {**answer, "rollout_id": "other"}
        assert answer == same
    assert _probes(s3_client, bucket_url) == []
    # What a retire leaves (fence and tombstone) is what a plain retire of "other" left.
    assert _keys(s3_client, bucket_url, "r") == _keys(s3_client, bucket_url, "other")
    if call != "retire":
        await plain.record(make_commit("r", "c0", REQ, assistant_output("a")))
        assert [r["model_call_id"] for r in (await plain.manifest("r"))["records"]] == ["c0"]


# --------------------------------------------------------------------------- an old probe and a new key
async def _write(kind: str, fresh: Any, ledgers: Any, endpoint: str, rollout_id: str) -> list[str]:
    """Write ``kind`` under ``rollout_id`` through ``endpoint``; returns what must read back."""
    if kind == "put":
        await fresh(endpoint_url=endpoint).put(simple_entry(rollout_id, "c1"))
    elif kind == "begin_call":
        await fresh(endpoint_url=endpoint).begin_call(rollout_id, "c1")
    elif kind == "mark_incomplete":
        await fresh(endpoint_url=endpoint).mark_incomplete(rollout_id, "c1")
    elif kind == "record":
        await ledgers(endpoint_url=endpoint).record(make_commit(rollout_id, "c1", REQ, assistant_output("a")))
    elif kind == "ledger_begin_call":
        await ledgers(endpoint_url=endpoint).begin_call(rollout_id, "c1")
    elif kind == "freeze":
        await fresh(endpoint_url=endpoint, probe_listing=True).freeze(rollout_id)
    elif kind == "retire":
        await fresh(endpoint_url=endpoint, probe_listing=True).retire([rollout_id])
    return [kind]


KINDS = ["put", "begin_call", "mark_incomplete", "record", "ledger_begin_call", "freeze", "retire"]


@pytest.mark.parametrize("rollout_id", ["r", "é r/1.x"])
@pytest.mark.parametrize("kind", KINDS)
async def test_an_old_probe_beside_a_key_written_between_gc_listing_and_its_delete(
    fresh: Any, ledgers: Any, proxy: Any, s3_client: Any, bucket_url: str, kind: str, rollout_id: str
) -> None:
    """An old leftover probe alone at an id; between ``gc``'s listing and its re-check a client
    writes under the id (an entry, an intent, a marker, a ledger row or intent, a probed freeze's
    fence and manifest, a probed retire's fence and tombstone), and the re-check lists through a
    listing that lags creations, so it shows the old probe alone again. ``gc`` deletes that probe
    and nothing else: every key the write left is still there and reads back. ``--prefix`` (the
    id's first character) with an id that needs escaping selects the same prefix."""
    old = _put_probe(s3_client, bucket_url, rollout_id)
    proxy.put_times = {}

    lagging: list[bool] = []

    async def rule(request: Any) -> Any:
        # gc's re-check lists through a listing that lags creations (the writer's own listings,
        # before it, do not: a probed freeze or retire needs its probe listed within its retries).
        return ListHideYoung(LAG_MS * 10) if request.is_list and lagging else None

    proxy.rule = rule
    store = fresh(endpoint_url=proxy.endpoint)
    original = store._list
    written: list[list[str]] = []
    before: list[list[str]] = []

    async def racing_list(prefix: str, **kwargs: Any) -> Any:
        if not written:
            written.append(await _write(kind, fresh, ledgers, proxy.endpoint, rollout_id))
            before.append(_keys(s3_client, bucket_url, rollout_id))
            lagging.append(True)
        return await original(prefix, **kwargs)

    store._list = racing_list
    report, actions = await _gc(store, now=time.time() + SKEW, prefix=rollout_id[0])
    assert written, "gc never re-listed the prefix"
    if old in before[0]:
        assert actions == [(rollout_id, "delete_probes", [old])], actions
        assert report.deleted_objects == 1
    else:  # a probed retire deletes the probes it lists with the rest: the re-check differs
        assert kind == "retire" and actions == [(rollout_id, "skipped", [])], actions
    after = _keys(s3_client, bucket_url, rollout_id)
    assert after == [rel for rel in before[0] if rel != old]  # the old probe, and only it
    assert not any(is_ledger_probe_rel(rel) for rel in after)

    # What the write acknowledged reads back.
    reader = fresh()
    if kind == "put":
        assert [e.model_call_id for e in (await reader.freeze(rollout_id)).entries] == ["c1"]
    elif kind in ("begin_call", "mark_incomplete"):
        snapshot = await reader.freeze(rollout_id)
        assert snapshot.incomplete and snapshot.entries == ()
        assert snapshot.reasons == ("marked_incomplete:c1" if kind == "mark_incomplete" else "dangling_intent:c1",)
    elif kind in ("record", "ledger_begin_call"):
        manifest = await ledgers().manifest(rollout_id)
        if kind == "record":
            assert [r["model_call_id"] for r in manifest["records"]] == ["c1"]
        else:
            assert [f["model_call_id"] for f in manifest["failures"]] == ["c1"]
    elif kind == "freeze":
        assert {i.rollout_id: i.state async for i in reader.rollouts()} == {rollout_id: "frozen"}
        assert (await reader.read_snapshot(rollout_id)).version == 0
    elif kind == "retire":
        assert {i.rollout_id: i.state async for i in reader.rollouts()} == {rollout_id: "retired"}
        from s3capture.protocols import TokenCaptureRetiredError

        with pytest.raises(TokenCaptureRetiredError):
            await reader.put(simple_entry(rollout_id, "late"))


# --------------------------------------------------------------------------- probes left behind, then reuse
@pytest.mark.parametrize("call", ["has_rows", "manifest", "freeze", "delete"])
async def test_a_probe_a_finished_call_left_behind_gc_then_reuse_of_the_id(
    fresh: Any, ledgers: Any, proxy: Any, s3_client: Any, bucket_url: str, call: str
) -> None:
    """A probed call on an unused id whose probe PUT's first attempt the store applies after the
    call deleted the probe (``ApplyLate``): the probe alone is left. Nothing lists it; ``gc --yes``
    deletes exactly it; then the id is reused (a put and a freeze, a ledger row and a manifest)
    and reads as a new rollout's."""
    late: list[str] = []

    async def rule(request: Any) -> Any:
        if request.method == "PUT" and "/ledger/.probe/" in request.path and not late:
            late.append(request.path)
            return ApplyLate(2.0)  # after the call and its DELETE, on either transport
        return None

    proxy.rule = rule
    if call in ("has_rows", "manifest"):
        answer = await getattr(ledgers(endpoint_url=proxy.endpoint, probe_listing=True), call)("r")
        assert answer in (False,) or answer.get("records") == []
    elif call == "freeze":
        assert (await fresh(endpoint_url=proxy.endpoint, probe_listing=True).freeze("r")).version == 0
        await fresh().delete(["r"])  # the snapshot consumed: the id is to be reused
    else:
        assert await fresh(endpoint_url=proxy.endpoint, probe_listing=True).delete(["r"]) == {
            "removed": [],
            "absent": ["r"],
        }
    await _settled(proxy)
    left = _keys(s3_client, bucket_url, "r")
    assert len(left) == 1 and is_ledger_probe_rel(left[0]), left
    assert [i async for i in fresh().rollouts()] == []

    dry = await gc(fresh(), AGE, now=time.time() + SKEW)
    assert dry.deleted_probe_prefixes == 1 and _keys(s3_client, bucket_url, "r") == left
    report, actions = await _gc(fresh(), now=time.time() + SKEW)
    assert actions == [("r", "delete_probes", left)] and _keys(s3_client, bucket_url, "r") == []

    writer = fresh()
    _, entries = await put_chain(writer, "r", 2)
    snapshot = await fresh(probe_listing=True).freeze("r")
    assert [e.model_call_id for e in snapshot.entries] == [e.model_call_id for e in entries]
    assert not snapshot.incomplete and snapshot.version == 2
    await ledgers().record(make_commit("r", "c0", REQ, assistant_output("a")))
    assert [r["model_call_id"] for r in (await ledgers(probe_listing=True).manifest("r"))["records"]] == ["c0"]
    assert _probes(s3_client, bucket_url) == []


@pytest.mark.parametrize("after_ms", [0, 30, 120])
async def test_a_cancelled_probed_manifest_then_gc_then_reuse(
    ledgers: Any, proxy: Any, s3_client: Any, bucket_url: str, after_ms: int
) -> None:
    """A probed manifest of an unused id cancelled at 0-120 ms, its probe PUT slow and applied
    late: whatever probe it leaves is alone and ``gc --yes`` deletes it; a later probed manifest
    of the reused id holds the row recorded after."""

    late: set[str] = set()

    async def rule(request: Any) -> Any:
        if request.method == "PUT" and "/ledger/.probe/" in request.path and request.path not in late:
            late.add(request.path)  # the first attempt of each probe PUT lands after its retry
            return ApplyLate(0.3)
        return None

    proxy.rule = rule
    task = asyncio.ensure_future(ledgers(endpoint_url=proxy.endpoint, probe_listing=True).manifest("r"))
    await asyncio.sleep(after_ms / 1000)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await _settled(proxy)
    left = _keys(s3_client, bucket_url, "r")
    assert all(is_ledger_probe_rel(rel) for rel in left)
    report, actions = await _gc(ledgers(), now=time.time() + SKEW)
    assert actions == ([("r", "delete_probes", left)] if left else [])
    assert _keys(s3_client, bucket_url, "r") == []
    await ledgers().record(make_commit("r", "c0", REQ, assistant_output("a")))
    proxy.rule = None
    manifest = await ledgers(endpoint_url=proxy.endpoint, probe_listing=True).manifest("r")
    assert [r["model_call_id"] for r in manifest["records"]] == ["c0"]
    await _settled(proxy)
    assert _probes(s3_client, bucket_url) == []


class _CreationTimes(dict):
    """A listing that lags the *creation* of keys only (an overwritten fence shows at once)."""

    def __setitem__(self, key: str, value: float) -> None:
        if key not in self:
            super().__setitem__(key, value)


@pytest.mark.parametrize("probe_listing", [True, False])
async def test_a_probed_export_with_drop_through_a_lagging_listing(
    fresh: Any, proxy: Any, s3_client: Any, bucket_url: str, tmp_path: Any, probe_listing: bool
) -> None:
    """``export(freeze=True, drop=True, probe_listing=...)`` through a listing that lags creations.
    Rollouts ``a`` and ``b`` were frozen at two calls; a third was put since by a writer that read
    the fence as open before it landed (unsealed now), and a fourth is put (acknowledged) the same
    way as the export's freeze of the rollout begins, before its fence reaches the store. A plain
    re-freeze's listing (the fence exists already, so it shows at once) misses the fourth call: the
    export writes the chain without it and the drop fails, keeping every object. The probed
    freeze's listing shows it: the exported chain is the whole one and the drop consumes exactly
    that snapshot. A leftover probe alone (``ghost``) and one beside a rollout are no rollouts to
    the export; it leaves no probe of its own; ``gc`` then removes the ghost's probe only."""
    import pyarrow.parquet as pq

    ids = ["a", "b"]
    chains: dict[str, list[Any]] = {}
    racer = fresh(endpoint_url=proxy.endpoint)

    async def read_open(prefix: str) -> str:
        return "open"  # its fence GET was answered before the freeze's fence PUT landed

    racer._fence_state = read_open  # type: ignore[method-assign]
    for rid in ids:
        turns = build_conversation(rid, 4)
        chains[rid] = [
            turn_entry(rid, t, delta=bool(i), parent_cumulative=turns[i - 1].cumulative if i else None)
            for i, t in enumerate(turns)
        ]
        for entry in chains[rid][:2]:
            await fresh().put(entry)
        assert (await fresh().freeze(rid)).version == 2
        await racer.put(chains[rid][2])  # not through a lagging listing yet: every listing shows it
    ghost = _put_probe(s3_client, bucket_url, "ghost")
    beside = _put_probe(s3_client, bucket_url, "a", "b" * 32)
    bucket, root = split_bucket_url(bucket_url)
    # The fences exist already (created long ago, as far as the proxy's lag goes).
    proxy.put_times = _CreationTimes({f"{root}rollouts/{rid}/fence": 0.0 for rid in ids})
    last: dict[str, asyncio.Future[None]] = {}

    async def rule(request: Any) -> Any:
        if request.is_list:
            return ListHideYoung(LAG_MS)
        parts = request.key.split("/")
        rid = parts[2] if len(parts) > 3 else ""
        if (
            request.method == "PUT"
            and rid in ids
            and (request.key.endswith("/fence") or "/ledger/.probe/" in request.key)
        ):
            if rid not in last:
                last[rid] = asyncio.ensure_future(racer.put(chains[rid][3]))
            await last[rid]
        return None

    proxy.rule = rule
    summary = await export(
        bucket_url,
        str(tmp_path / "out"),
        workers=0,
        min_age=0,
        freeze=True,
        drop=True,
        probe_listing=probe_listing,
        endpoint_url=proxy.endpoint,
    )
    await _settled(proxy)
    assert sorted(last) == ids  # each rollout was frozen by the export, its fourth call put meanwhile
    rows = [row for path in sorted((tmp_path / "out").rglob("*.parquet")) for row in pq.read_table(path).to_pylist()]
    calls = [f"call-00{i}" for i in range(4)]
    states = {i.rollout_id: i.state async for i in fresh().rollouts()}
    if probe_listing:
        assert summary.ok and summary.exported == 2 and summary.dropped == 2, format_summary(summary)
        assert sorted((row["rollout_id"], row["call_ids"], row["version"], row["masked"]) for row in rows) == [
            (rid, calls, 4, False) for rid in ids
        ]
        assert states == {"a": "retired", "b": "retired"}
        for rid in ids:
            assert _keys(s3_client, bucket_url, rid) == ["fence", "retired"]  # every record dropped
    else:
        # The limitation the option exists for: a chain without its last call is exported, and
        # the drop, whose decisive listing shows that call, fails and keeps every object.
        assert summary.exported == 2 and summary.dropped == 0, format_summary(summary)
        assert sorted((row["rollout_id"], row["call_ids"]) for row in rows) == [(rid, calls[:3]) for rid in ids]
        assert states == {"a": "frozen", "b": "frozen"}
        for rid in ids:
            assert [e.model_call_id for e in (await fresh().freeze(rid)).entries] == calls
    assert _keys(s3_client, bucket_url, "ghost") == [ghost]
    assert (beside in _keys(s3_client, bucket_url, "a")) == (not probe_listing)
    assert [p for p in _probes(s3_client, bucket_url) if not p.endswith((ghost, beside))] == []
    proxy.rule = None
    report, actions = await _gc(fresh(), now=time.time() + SKEW)
    assert [a for a in actions if a[1] == "delete_probes"] == [("ghost", "delete_probes", [ghost])]
    assert _keys(s3_client, bucket_url, "ghost") == []


# --------------------------------------------------------------------------- a key named almost like a probe
async def test_gc_leaves_a_key_that_is_a_probe_name_and_a_newline(fresh: Any, s3_client: Any, bucket_url: str) -> None:
    """``ledger/.probe/<32 hex>`` followed by a newline is no probe s3capture writes (its probes
    end in the hex digits): a foreign object, which rule 7 never touches and which ``ls`` shows
    as an open rollout, like any other key under ``ledger/.probe/`` that is not a probe. A
    regular expression ending in ``$`` matched it (``$`` also matches before a final newline), so
    ``gc --yes`` deleted it as a leftover probe and every listing hid it."""
    bucket, root = split_bucket_url(bucket_url)
    key = Layout(root.rstrip("/")).rollout("x") + "ledger/.probe/" + "a" * 32 + "\n"
    try:
        s3_client.put_object(Bucket=bucket, Key=key, Body=b"")
    except botocore.exceptions.ClientError:  # moto routes such a key nowhere (404)
        pytest.skip("this server takes no key ending in a newline")
    assert list_keys(s3_client, bucket, root) == [key]
    report, actions = await _gc(fresh(), now=time.time() + SKEW)
    assert [a for a in actions if a[1] == "delete_probes"] == [] and report.deleted_objects == 0
    assert list_keys(s3_client, bucket, root) == [key]
    assert {i.rollout_id: i.state async for i in fresh().rollouts()} == {"x": "open"}


@pytest.mark.parametrize("skew", [SKEW, -SKEW])
async def test_a_store_clock_ahead_or_behind_never_makes_a_young_probe_old(
    fresh: Any, proxy: Any, s3_client: Any, bucket_url: str, skew: float
) -> None:
    """``gc`` without ``now`` through a proxy whose answers' ``Date`` runs two hours ahead of (or
    behind) the server that stamps LastModified: a probe written just now is too young for the
    one-hour threshold either way (the age is taken at the earlier of the store's clock and this
    machine's), and nothing is deleted."""
    probe = _put_probe(s3_client, bucket_url, "ghost")
    proxy.date_skew = skew
    actions: list[GcAction] = []
    report = await gc(fresh(endpoint_url=proxy.endpoint), AGE, dry_run=False, on_action=actions.append)
    assert (report.too_young, report.deleted_probe_prefixes, report.deleted_objects, actions) == (1, 0, 0, [])
    assert _keys(s3_client, bucket_url, "ghost") == [probe]
