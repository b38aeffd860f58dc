"""``S3CaptureLedger(probe_listing=True)``: a manifest read through a listing that lags writes
still holds every row acknowledged before it (docs/reliability.md, "Listings that lag").

The fault proxy's ``ListHideYoung`` leaves a key out of listings for ``LAG_MS`` after its PUT, as a
store whose listing index lags its writes would. Without the probe such a manifest misses a row
that ``record`` acknowledged just before it, and Gym's external staging, which writes no intents,
would finalize that rollout without the call. With the probe the manifest PUTs an empty key under
the rollout's ``ledger/``, lists until the listing shows it, and deletes it again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from faultproxy import ListHideYoung
from helpers import assistant_output, list_keys, make_commit, split_bucket_url, user
from s3capture.errors import ListingError
from s3capture.layout import parse_ledger_key

pytestmark = pytest.mark.all_transports

LAG_MS = 250.0
REQ = [user("hello")]


def lagging(proxy: Any) -> None:
    async def rule(request: Any) -> Any:
        return ListHideYoung(LAG_MS) if request.is_list else None

    proxy.rule = rule


def records(manifest: dict) -> list[str]:
    return [r["model_call_id"] for r in manifest["records"]]


async def test_a_probed_manifest_holds_the_row_acknowledged_just_before_it(ledgers, proxy, s3_client, bucket_url):
    lagging(proxy)
    writer = ledgers(endpoint_url=proxy.endpoint)
    plain = ledgers(endpoint_url=proxy.endpoint)
    probed = ledgers(endpoint_url=proxy.endpoint, probe_listing=True)

    await writer.record(make_commit("r", "call-0", REQ, assistant_output("a")))
    # The limitation the option exists for: the row is acknowledged, and the plain manifest
    # through the lagging listing does not hold it (nothing in it says the rollout lacks a call).
    stale = await plain.manifest("r")
    assert records(stale) == [] and stale["failures"] == []

    await writer.record(make_commit("r", "call-1", REQ, assistant_output("b")))
    fresh = await probed.manifest("r")
    assert sorted(records(fresh)) == ["call-0", "call-1"] and fresh["failures"] == []

    probes = [r for r in proxy.requests if "/ledger/.probe/" in r.path]
    assert [r.method for r in probes] == ["PUT", "DELETE"] and probes[0].path == probes[1].path
    bucket, root = split_bucket_url(bucket_url)
    assert not [k for k in list_keys(s3_client, bucket, root) if "/ledger/.probe/" in k]  # deleted again


async def test_a_probed_manifest_of_a_live_ledger_reads_like_a_plain_one_where_listings_keep_up(ledgers, proxy):
    writer = ledgers()
    first = make_commit("r", "call-0", REQ, assistant_output("a"))
    await writer.record(first)
    await writer.record(make_commit("r", "call-1", REQ, assistant_output("b"), parent=first))
    await writer.record_failure("r", "call-2", "timeout")
    await writer.begin_call("r", "call-3")
    plain = await ledgers().manifest("r")
    probed = await ledgers(probe_listing=True).manifest("r")
    assert probed == plain
    assert [f["model_call_id"] for f in plain["failures"]] == ["call-2", "call-3"]


async def test_a_probe_another_manifest_left_behind_is_no_row_and_no_foreign_object(ledgers, s3_client, bucket_url):
    """A manifest whose caller was killed between its probe's PUT and DELETE leaves the probe."""
    writer = ledgers()
    await writer.record(make_commit("r", "call-0", REQ, assistant_output("a")))
    bucket, root = split_bucket_url(bucket_url)
    left = f"{root}rollouts/r/ledger/.probe/{'0' * 32}"
    s3_client.put_object(Bucket=bucket, Key=left, Body=b"")
    assert parse_ledger_key(left[len(f"{root}rollouts/r/") :]) == ("probe", "", "", "0" * 32)
    for reader in (ledgers(), ledgers(probe_listing=True)):
        manifest = await reader.manifest("r")
        assert records(manifest) == ["call-0"] and manifest["failures"] == []
    # Not a probe: a foreign object, reported so that the rollout is not trainable.
    s3_client.put_object(Bucket=bucket, Key=f"{root}rollouts/r/ledger/.probe/not-a-uuid", Body=b"")
    manifest = await ledgers().manifest("r")
    assert [f["reason"] for f in manifest["failures"]] == ["foreign_ledger_object"]
    await writer.delete(["r"])
    assert list_keys(s3_client, bucket, f"{root}rollouts/r/") == []


async def test_a_listing_that_never_shows_the_probe_raises_and_the_probe_is_deleted(
    ledgers, proxy, s3_client, bucket_url
):
    async def rule(request: Any) -> Any:
        return ListHideYoung(60_000) if request.is_list else None

    await ledgers().record(make_commit("r", "call-0", REQ, assistant_output("a")))
    proxy.rule = rule
    with pytest.raises(ListingError, match="ledger/.probe/"):
        await ledgers(endpoint_url=proxy.endpoint, probe_listing=True).manifest("r")
    bucket, root = split_bucket_url(bucket_url)
    assert not [k for k in list_keys(s3_client, bucket, root) if "/ledger/.probe/" in k]


async def test_a_cancelled_probed_manifest_deletes_its_probe(ledgers, proxy, s3_client, bucket_url):
    lagging(proxy)
    await ledgers().record(make_commit("r", "call-0", REQ, assistant_output("a")))
    reader = ledgers(endpoint_url=proxy.endpoint, probe_listing=True)
    assert await reader.has_rows("r")  # the client is open: the deadline falls in the probe's listing
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(LAG_MS / 1000 / 3):  # while it lists again for its probe
            await reader.manifest("r")
    bucket, root = split_bucket_url(bucket_url)
    assert [r.method for r in proxy.requests if "/ledger/.probe/" in r.path] == ["PUT", "DELETE"]
    assert not [k for k in list_keys(s3_client, bucket, root) if "/ledger/.probe/" in k]


@pytest.mark.parametrize("removal", ["retire", "delete"])
async def test_a_probed_manifest_racing_a_removal_answers_as_a_plain_one(ledgers, proxy, removal: str):
    """A breaker (2026-12-04): the removal deletes the probe with the rest, and the probed
    manifest listed five times for it and raised ``ListingError``. Retired: ``RolloutRetiredError``,
    as the contract says; deleted: the id reads as unused (an empty manifest)."""
    from s3capture.protocols import RolloutRetiredError

    direct = ledgers()
    await direct.record(make_commit("r", "call-0", REQ, assistant_output("a")))
    released, probe_put = asyncio.Event(), asyncio.Event()

    async def rule(request: Any) -> Any:
        if request.method == "PUT" and "/ledger/.probe/" in request.path:
            probe_put.set()
        elif probe_put.is_set() and not released.is_set() and (request.is_list or request.path.endswith("/retired")):
            await released.wait()  # the manifest's first LIST and tombstone GET wait for the removal
        return None

    proxy.rule = rule
    task = asyncio.ensure_future(ledgers(endpoint_url=proxy.endpoint, probe_listing=True).manifest("r"))
    await asyncio.wait_for(probe_put.wait(), 10)
    await asyncio.sleep(0.1)
    assert await getattr(direct, removal)(["r"]) == {"removed": ["r"], "absent": []}
    released.set()
    if removal == "retire":
        with pytest.raises(RolloutRetiredError):
            await task
    else:
        assert await task == {"schema_version": 2, "rollout_id": "r", "records": [], "failures": []}


async def test_a_leftover_probe_is_no_rollout(ledgers, fresh, s3_client, bucket_url):
    """A breaker (2026-12-04): a probe left behind (its DELETE refused, or applied before a slow
    PUT) made an unused or deleted id list as an open rollout, and ``retire`` answer "removed"."""
    bucket, root = split_bucket_url(bucket_url)
    writer = ledgers()
    await writer.record(make_commit("r", "call-0", REQ, assistant_output("a")))
    for rid in ("r", "unused", "unused-2"):
        s3_client.put_object(Bucket=bucket, Key=f"{root}rollouts/{rid}/ledger/.probe/{'1' * 32}", Body=b"")
    for client in (writer, fresh()):
        listed = {info.rollout_id: (info.state, info.objects) async for info in client.rollouts()}
        assert listed == {"r": ("open", 2)}, listed  # its row and index key; no probe, no unused id
    assert await writer.delete(["unused", "r"]) == {"removed": ["r"], "absent": ["unused"]}
    assert await writer.retire(["unused-2"]) == {"removed": [], "absent": ["unused-2"]}
    assert [k for k in list_keys(s3_client, bucket, root) if "/.probe/" in k] == []  # removed with the rest


async def test_a_probed_has_rows_sees_the_first_row_acknowledged_just_before_it(ledgers, proxy, s3_client, bucket_url):
    """Finding 36: Gym's sink admits an unresolved continuation of a rollout without rows as a
    fresh root, so ``has_rows`` False for a ledger whose first row is acknowledged is a wrong
    admission. Through a lagging listing the plain ``has_rows`` answers so; the probed one does not."""
    lagging(proxy)
    writer = ledgers(endpoint_url=proxy.endpoint)
    plain = ledgers(endpoint_url=proxy.endpoint)
    probed = ledgers(endpoint_url=proxy.endpoint, probe_listing=True)

    await writer.record(make_commit("r", "call-0", REQ, assistant_output("a")))
    assert await plain.has_rows("r") is False  # the limitation the probe exists for
    assert await probed.has_rows("r") is True
    await writer.record_failure("r2", "call-0", "timeout")
    assert await probed.has_rows("r2") is True  # a failure row counts as a row

    probes = [(r.method, r.path) for r in proxy.requests if "/ledger/.probe/" in r.path]
    # One probe per call that found no row at first (two, unless a loaded machine let the lag of
    # r2's row pass before its LIST), each deleted again.
    puts = [path for method, path in probes if method == "PUT"]
    assert puts and sorted(puts) == sorted(path for method, path in probes if method == "DELETE"), probes
    bucket, root = split_bucket_url(bucket_url)
    assert not [k for k in list_keys(s3_client, bucket, root) if "/ledger/.probe/" in k]


async def test_a_probed_has_rows_probes_only_when_its_first_listings_show_no_row(ledgers, proxy, s3_client, bucket_url):
    writer = ledgers()
    await writer.record(make_commit("r", "call-0", REQ, assistant_output("a")))
    await writer.begin_call("intents-only", "call-0")
    probed = ledgers(endpoint_url=proxy.endpoint, probe_listing=True)
    assert await probed.has_rows("r") is True
    assert not [r for r in proxy.requests if "/ledger/.probe/" in r.path]  # a row seen needs no probe
    assert await probed.has_rows("unused") is False
    assert await probed.has_rows("intents-only") is False  # an intent is no row
    probes = [r for r in proxy.requests if "/ledger/.probe/" in r.path]
    assert [r.method for r in probes] == ["PUT", "DELETE"] * 2
    bucket, root = split_bucket_url(bucket_url)
    assert not [k for k in list_keys(s3_client, bucket, root) if "/ledger/.probe/" in k]
    assert await writer.retire(["unused"]) == {"removed": [], "absent": ["unused"]}  # the probe left nothing


async def test_a_probed_has_rows_of_a_retired_ledger_raises(ledgers, proxy):
    from s3capture.protocols import RolloutRetiredError

    writer = ledgers()
    await writer.begin_call("r", "call-0")
    await writer.retire(["r"])
    with pytest.raises(RolloutRetiredError):
        await ledgers(endpoint_url=proxy.endpoint, probe_listing=True).has_rows("r")


@pytest.mark.parametrize("removal", ["retire", "delete"])
async def test_a_probed_removal_through_a_lagging_listing_leaves_no_row(
    ledgers, proxy, s3_client, bucket_url, removal: str
):
    """Without the probe, a retire or delete listing through a lag misses a row recorded within
    it: the row outlives the removal (after a delete, a reused id's manifest would hold the earlier
    attempt's row). Behind a probe its listing shows every row written before the call."""
    lagging(proxy)
    writer = ledgers(endpoint_url=proxy.endpoint)
    bucket, root = split_bucket_url(bucket_url)

    def left(rid: str) -> list[str]:
        return [k.rsplit(f"/{rid}/", 1)[1] for k in list_keys(s3_client, bucket, f"{root}rollouts/{rid}/")]

    await writer.record(make_commit("plain", "call-0", REQ, assistant_output("a")))
    await getattr(ledgers(endpoint_url=proxy.endpoint), removal)(["plain"])
    assert any(k.startswith("ledger/row/call-0/") for k in left("plain"))  # the limitation

    await writer.record(make_commit("r", "call-0", REQ, assistant_output("a")))
    await writer.begin_call("r", "call-1")
    result = await getattr(ledgers(endpoint_url=proxy.endpoint, probe_listing=True), removal)(["r"])
    assert result == {"removed": ["r"], "absent": []}
    assert sorted(left("r")) == ([] if removal == "delete" else ["fence", "retired"])
    probes = [r for r in proxy.requests if "/ledger/.probe/" in r.path]
    assert [r.method for r in probes] == ["PUT"]  # deleted with the rest, in the DeleteObjects
    assert await ledgers(probe_listing=True).has_rows("unused") is False


@pytest.mark.parametrize("removal", ["retire", "delete"])
async def test_a_probed_removal_of_an_unused_id_leaves_no_probe(ledgers, s3_client, bucket_url, removal: str):
    probed = ledgers(probe_listing=True)
    assert await getattr(probed, removal)(["unused"]) == {"removed": [], "absent": ["unused"]}
    bucket, root = split_bucket_url(bucket_url)
    keys = [k.rsplit("/unused/", 1)[1] for k in list_keys(s3_client, bucket, f"{root}rollouts/unused/")]
    # retire of an unused id still fences it (as without the probe); nothing else is left
    assert sorted(keys) == ([] if removal == "delete" else ["fence", "retired"])
