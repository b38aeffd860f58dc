"""A breaker on two changes of 2026-12-04 (reliability.md, findings 31 and 32): a freeze's GET of
the retire tombstone, and root listings on a store that ignores ``StartAfter``.

Each case failed on the code before its fix: a retired rollout left fenced "frozen" when the
tombstone GET failed; the last rollout's marker hidden from the root listing when every root LIST
is cut and ``StartAfter`` ignored; rollouts after a cut silently left out when the last key listed
was deleted before the relisting; a ``ListingError`` when a drop's tombstone landed before the
first listed key. The others are what held. Not here, documented instead: a store that cuts
*every* listing of a rollout's prefix and ignores ``StartAfter`` can hide its last keys from a
freeze too (docs/design.md, "What the retries do not bound").
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import pytest

from faultproxy import DropResponse, ListCutShort, ListIgnoreStartAfter, ListPaged, s3_error
from helpers import get_bytes, list_keys, simple_entry, split_bucket_url
from s3capture.protocols import TokenCaptureRetiredError
from s3capture.rollouts import FENCE_FROZEN, FENCE_RETIRED

pytestmark = pytest.mark.all_transports
GRACE = 0.2


def _strip_start_after(request: Any) -> None:
    params = [(k, v) for k, v in parse_qsl(request.query, keep_blank_values=True) if k != "start-after"]
    request.target = urlsplit(request.target).path + "?" + urlencode(sorted(params), quote_via=quote, safe="-_.~")


def root_rule(prefix: str, cut: int | None, page: int | None, before_confirm=None, cut_confirm: int | None = None):
    """Root LISTs: the first (no token, no start-after) cut to `cut` keys; every LIST with
    start-after has it stripped (store ignores StartAfter) and is paged at `page` (or cut at
    `cut_confirm`); continuation pages paged at `page`."""
    state = {"cut": 0, "confirm": 0}

    async def rule(request: Any) -> Any:
        p = request.params
        if not (request.is_list and p.get("prefix") == prefix):
            return None
        if "start-after" in p:
            state["confirm"] += 1
            if before_confirm is not None and state["confirm"] == 1:
                await before_confirm()
            _strip_start_after(request)
            if cut_confirm is not None:
                return ListCutShort(cut_confirm)
            return ListPaged(page) if page else ListIgnoreStartAfter()
        if "continuation-token" not in p and not state["cut"] and cut is not None:
            state["cut"] += 1
            return ListCutShort(cut)
        if cut_confirm is not None and "continuation-token" not in p:
            return ListCutShort(cut_confirm)
        return ListPaged(page) if page else None

    rule.state = state
    return rule


# ---------------------------------------------------------------- cfb7a73 (root listing)


async def test_30_rollouts_cut_then_ignored_and_paged(fresh, proxy, bucket_url, s3_client):
    writer = fresh()
    ids = [f"r{i:02d}" for i in range(30)]
    for rid in ids:
        await writer.put(simple_entry(rid, "c1"))
    _, root = split_bucket_url(bucket_url)
    rule = proxy.rule = root_rule(f"{root}rollouts/", cut=7, page=4)
    listed = [info.rollout_id async for info in fresh(endpoint_url=proxy.endpoint).rollouts()]
    assert rule.state["confirm"] == 1, rule.state
    assert listed == ids, listed


async def test_last_listed_key_deleted_before_ignored_relisting(fresh, proxy, bucket_url, s3_client):
    """Root cut after rollout a's keys; a is dropped (its snap manifest and entries deleted) before
    the confirming LIST, which ignores StartAfter. Expected: b and c still listed."""
    writer, builder = fresh(), fresh(fence_grace=GRACE)
    for rid in ("a", "b", "c"):
        await writer.put(simple_entry(rid, "c1"))
    snap = await builder.freeze("a")
    await asyncio.sleep(GRACE + 0.1)
    bucket, root = split_bucket_url(bucket_url)
    a_keys = len(list_keys(s3_client, bucket, f"{root}rollouts/a/"))

    async def drop_a() -> None:
        assert await builder.drop("a", snap.snapshot_id, snap.version)

    rule = proxy.rule = root_rule(f"{root}rollouts/", cut=a_keys, page=None, before_confirm=drop_a)
    listed = [info.rollout_id async for info in fresh(endpoint_url=proxy.endpoint).rollouts()]
    assert rule.state == {"cut": 1, "confirm": 1}, rule.state
    assert listed == ["a", "b", "c"], listed


async def test_drop_tombstone_sorting_first_before_ignored_relisting(fresh, proxy, bucket_url, s3_client):
    """One rollout r; a drop's tombstone r/drop/<token> (sorting before r/fence) lands between the
    root LIST and its confirming LIST, which ignores StartAfter. Expected: r listed, no error."""
    writer, builder = fresh(), fresh(fence_grace=GRACE)
    await writer.put(simple_entry("r", "c1"))
    await builder.freeze("r")
    bucket, root = split_bucket_url(bucket_url)

    async def land() -> None:
        s3_client.put_object(Bucket=bucket, Key=f"{root}rollouts/r/drop/0000deadbeef", Body=b"")

    rule = proxy.rule = root_rule(f"{root}rollouts/", cut=None, page=None, before_confirm=land)
    listed = [info.rollout_id async for info in fresh(endpoint_url=proxy.endpoint).rollouts()]
    assert rule.state["confirm"] == 1, rule.state
    assert listed == ["r"], listed


async def test_store_that_cuts_every_listing_and_ignores_start_after_hides_last_rollouts_marker(
    fresh, proxy, bucket_url, s3_client
):
    """Every fresh root LIST is cut at the same count (hiding r's marker) and StartAfter is ignored.
    Before cfb7a73 the last rollout was listed on its own prefix (confirm_end). Expected: r's
    unsealed snapshot from the listing is incomplete (its marker), or the listing refuses."""
    writer = fresh()
    await writer.put(simple_entry("a", "c1"))
    for cid in ("c1", "c2", "c3"):
        await writer.put(simple_entry("r", cid))
    await writer.mark_incomplete("r", "c3")
    bucket, root = split_bucket_url(bucket_url)
    a_keys = len(list_keys(s3_client, bucket, f"{root}rollouts/a/"))
    r_keys = list_keys(s3_client, bucket, f"{root}rollouts/r/")
    n = a_keys + len(r_keys) - 1  # the marker (last key) is hidden
    proxy.rule = root_rule(f"{root}rollouts/", cut=n, page=None, cut_confirm=n)
    reader = fresh(endpoint_url=proxy.endpoint)
    listed = [(info, items) async for info, items in reader.rollouts_listed()]
    proxy.rule = None
    assert [i.rollout_id for i, _ in listed] == ["a", "r"]
    r_items = listed[1][1]
    snapshot = await reader.read_snapshot("r", sealed=False, listing=r_items)
    assert snapshot.incomplete, (snapshot, [i.key for i in r_items], r_keys)


# ---------------------------------------------------------------- 2f637d5 (freeze tombstone GET)


def tomb_rule(action_factory, times: int | None = None):
    n = [0]

    async def rule(request: Any) -> Any:
        if request.method == "GET" and not request.is_list and request.path.endswith("/rollouts/r/retired"):
            n[0] += 1
            if times is None or n[0] <= times:
                return action_factory()
        return None

    rule.n = n
    return rule


async def _retired(fresh) -> Any:
    writer = fresh(fence_grace=GRACE)
    await writer.put(simple_entry("r", "c1"))
    snapshot = await writer.freeze("r")
    await asyncio.sleep(GRACE + 0.1)
    assert await writer.drop("r", snapshot.snapshot_id, snapshot.version)
    return writer


@pytest.mark.parametrize("fault", ["503", "drop"])
async def test_tombstone_get_failing_on_retired_rollout(fresh, proxy, bucket_url, s3_client, fault):
    await _retired(fresh)
    proxy.rule = tomb_rule(lambda: s3_error(503, "SlowDown") if fault == "503" else DropResponse())
    freezer = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)
    err = None
    try:
        await asyncio.wait_for(freezer.freeze("r"), 60)
    except Exception as e:  # noqa: BLE001
        err = e
    bucket, root = split_bucket_url(bucket_url)
    fence = get_bytes(s3_client, bucket, f"{root}rollouts/r/fence")
    proxy.rule = None
    put_err = None
    try:
        await fresh().put(simple_entry("r", "c2"))
    except Exception as e:  # noqa: BLE001
        put_err = e
    assert isinstance(put_err, TokenCaptureRetiredError), (type(put_err), put_err, type(err), fence)
    assert isinstance(err, TokenCaptureRetiredError) or fence == FENCE_RETIRED, (type(err), err, fence)


@pytest.mark.parametrize("fault", ["503", "drop"])
async def test_tombstone_get_failing_transiently_on_open_rollout(fresh, proxy, bucket_url, fault):
    writer = fresh()
    await writer.put(simple_entry("r", "c1"))
    proxy.rule = tomb_rule(lambda: s3_error(503, "SlowDown") if fault == "503" else DropResponse(), times=1)
    snap = await asyncio.wait_for(fresh(endpoint_url=proxy.endpoint).freeze("r"), 60)
    assert snap.version == 1 and not snap.incomplete


@pytest.mark.parametrize("body", ["foreign", "oversize"])
async def test_foreign_object_at_retired_key(fresh, bucket_url, s3_client, body):
    writer = fresh()
    await writer.put(simple_entry("r", "c1"))
    bucket, root = split_bucket_url(bucket_url)
    data = b"hello" if body == "foreign" else b"x" * (5 << 20)
    s3_client.put_object(Bucket=bucket, Key=f"{root}rollouts/r/retired", Body=data)
    f1 = f2 = None
    try:
        await fresh().freeze("r")
    except Exception as e:  # noqa: BLE001
        f1 = e
    try:
        await fresh().read_snapshot("r", sealed=False)
    except Exception as e:  # noqa: BLE001
        f2 = e
    # consistent with the listing's view (a key named retired reads as retired)
    assert type(f1) is type(f2), (f1, f2)


async def test_cancelled_freeze_leaves_nothing_running(fresh, proxy, bucket_url, s3_client):
    writer = fresh()
    await writer.put(simple_entry("r", "c1"))
    bucket, root = split_bucket_url(bucket_url)
    hold = asyncio.Event()

    async def rule(request: Any) -> Any:
        if request.method == "GET" and request.path.endswith("/rollouts/r/retired"):
            await hold.wait()
        return None

    proxy.rule = rule
    freezer = fresh(endpoint_url=proxy.endpoint)
    before = set(asyncio.all_tasks())
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            await freezer.freeze("r")
    await asyncio.sleep(0.2)
    left = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]
    hold.set()
    assert get_bytes(s3_client, bucket, f"{root}rollouts/r/fence") == FENCE_FROZEN
    assert not [t for t in left if "retired" in repr(t) or "_present" in repr(t)], left
    snap = await fresh().freeze("r")
    assert snap.version == 1


async def test_freeze_after_delete_and_reuse(fresh, bucket_url, s3_client):
    writer = await _retired(fresh)
    await writer.delete(["r"])
    await writer.put(simple_entry("r", "c9"))
    snap = await fresh().freeze("r")
    assert snap.version == 1 and not snap.incomplete


async def test_export_drop_and_gc_when_last_listed_key_deleted(fresh, proxy, bucket_url, s3_client, tmp_path):
    from s3capture.export import export, read_manifests

    writer, builder = fresh(), fresh(fence_grace=GRACE)
    snaps = {}
    for rid in ("a", "b", "c"):
        for cid in ("c1", "c2"):
            await writer.put(simple_entry(rid, cid))
        snaps[rid] = await builder.freeze(rid)
    await asyncio.sleep(GRACE + 0.1)
    bucket, root = split_bucket_url(bucket_url)
    a_keys = len(list_keys(s3_client, bucket, f"{root}rollouts/a/"))

    async def drop_a() -> None:  # another consumer drops a meanwhile
        await builder.drop("a", snaps["a"].snapshot_id, snaps["a"].version)

    rule = proxy.rule = root_rule(f"{root}rollouts/", cut=a_keys, page=None, before_confirm=drop_a)
    dest = tmp_path / "out"
    summary = await export(
        bucket_url, str(dest), workers=0, min_age=0, endpoint_url=proxy.endpoint, build_with="builtin", drop=True
    )
    exported = sorted(r.rollout_id for m in await read_manifests(str(dest)) for r in m.rollouts)
    # gc (dry run) through a store cutting after b's keys, b retired meanwhile
    left = sorted(
        {k[len(root) + len("rollouts/") :].split("/")[0] for k in list_keys(s3_client, bucket, f"{root}rollouts/")}
    )
    print("SUMMARY", summary, "EXPORTED", exported, "LEFT", left)
    assert exported == ["b", "c"], (exported, summary, rule.state)


@pytest.mark.parametrize("hold", ["first_list", "confirm_list"])
async def test_drop_racing_freeze(fresh, proxy, bucket_url, s3_client, hold):
    writer = fresh(fence_grace=GRACE)
    await writer.put(simple_entry("r", "c1"))
    snap = await writer.freeze("r")
    await asyncio.sleep(GRACE + 0.1)
    bucket, root = split_bucket_url(bucket_url)
    prefix = f"{root}rollouts/r/"
    held, release = asyncio.Event(), asyncio.Event()

    async def rule(request: Any) -> Any:
        p = request.params
        if request.is_list and p.get("prefix") == prefix and not held.is_set():
            if (hold == "first_list") == ("start-after" not in p):
                held.set()
                await release.wait()
        return None

    proxy.rule = rule
    freezing = asyncio.ensure_future(fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE).freeze("r"))
    await asyncio.wait_for(held.wait(), 30)
    await asyncio.sleep(GRACE + 0.1)
    dropped = await writer.drop("r", snap.snapshot_id, snap.version)
    release.set()
    try:
        out = await asyncio.wait_for(freezing, 60)
    except Exception as e:  # noqa: BLE001
        out = e
    fence = get_bytes(s3_client, bucket, prefix + "fence")
    if dropped:
        assert fence == FENCE_RETIRED, (out, fence)
        assert isinstance(out, TokenCaptureRetiredError) or (not isinstance(out, Exception)), out
        with pytest.raises(TokenCaptureRetiredError):
            await writer.put(simple_entry("r", "c2"))
    print("DROPPED", dropped, "OUT", out, "FENCE", fence)
