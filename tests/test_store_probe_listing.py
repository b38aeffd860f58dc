"""``S3TokenStore(probe_listing=True)``: ``retire`` and ``delete`` through a listing that lags
writes still remove every entry written before them (docs/reliability.md, "Listings that lag").

Without the probe a delete listing within the lag of a ``put`` misses that entry, which outlives
the delete: a reused id's next freeze would then hold the earlier attempt's entry.
"""

from __future__ import annotations

from typing import Any

import pytest

from faultproxy import ListHideYoung
from helpers import list_keys, put_chain, split_bucket_url

pytestmark = pytest.mark.all_transports

LAG_MS = 250.0


def lagging(proxy: Any) -> None:
    async def rule(request: Any) -> Any:
        return ListHideYoung(LAG_MS) if request.is_list else None

    proxy.rule = rule


@pytest.mark.parametrize("removal", ["retire", "delete"])
async def test_a_probed_removal_through_a_lagging_listing_leaves_no_entry(
    fresh, proxy, s3_client, bucket_url, removal: str
):
    lagging(proxy)
    writer = fresh(endpoint_url=proxy.endpoint)
    bucket, root = split_bucket_url(bucket_url)

    def left(rid: str) -> list[str]:
        return [k.rsplit(f"/{rid}/", 1)[1] for k in list_keys(s3_client, bucket, f"{root}rollouts/{rid}/")]

    async def long_lag(request: Any) -> Any:
        # The plain removal waits for nothing, so a long lag keeps this demonstration independent
        # of the machine's load (under 250 ms the entry had aged past the lag on a loaded host).
        return ListHideYoung(5_000.0) if request.is_list else None

    proxy.rule = long_lag
    await put_chain(writer, "plain", 1)
    await getattr(fresh(endpoint_url=proxy.endpoint), removal)(["plain"])
    assert any(k.startswith("log/e/") for k in left("plain"))  # the limitation the option exists for
    lagging(proxy)

    await put_chain(writer, "r", 2)
    await writer.begin_call("r", "call-x")
    result = await getattr(fresh(endpoint_url=proxy.endpoint, probe_listing=True), removal)(["r"])
    assert result == {"removed": ["r"], "absent": []}
    assert sorted(left("r")) == ([] if removal == "delete" else ["fence", "retired"])
    probes = [r for r in proxy.requests if "/ledger/.probe/" in r.path]
    assert [r.method for r in probes] == ["PUT"]  # deleted with the rest, in the DeleteObjects


async def test_a_probed_store_reads_and_writes_as_a_plain_one(fresh, s3_client, bucket_url):
    probed = fresh(probe_listing=True)
    entries, _ = await put_chain(probed, "r", 3)
    snapshot = await probed.freeze("r")
    plain = await fresh().freeze("r")
    assert (snapshot.version, snapshot.snapshot_id) == (plain.version, plain.snapshot_id) == (3, snapshot.snapshot_id)
    assert await probed.drop("r", snapshot.snapshot_id, snapshot.version) is True
    assert await probed.delete(["r", "unused"]) == {"removed": ["r"], "absent": ["unused"]}
    bucket, root = split_bucket_url(bucket_url)
    assert list_keys(s3_client, bucket, root) == []


def _probes(s3_client: Any, bucket_url: str) -> list[str]:
    bucket, root = split_bucket_url(bucket_url)
    return [k for k in list_keys(s3_client, bucket, root) if "/ledger/.probe/" in k]


@pytest.mark.parametrize("kind", ["store", "ledger"])
@pytest.mark.parametrize("pair", [("delete", "delete"), ("retire", "delete")])
async def test_two_probed_removals_racing_through_a_lagging_listing_both_answer(
    fresh, ledgers, proxy, s3_client, bucket_url, kind: str, pair: tuple[str, str]
):
    """A breaker (2026-12-04): the first removal's listing showed the second's probe and deleted
    it with the rest; the second then listed five times for it and raised ``ListingError``, where
    two plain removals both return. It now probes once more and answers for what the first left."""
    import asyncio

    lagging(proxy)
    make = fresh if kind == "store" else ledgers
    await put_chain(fresh(), "r", 1)
    await asyncio.sleep(LAG_MS / 1000 + 0.05)  # the entry is listed by now
    first = make(endpoint_url=proxy.endpoint, probe_listing=True)
    second = make(endpoint_url=proxy.endpoint, probe_listing=True)

    async def later() -> Any:
        await asyncio.sleep(0.1)  # its probe lands while the first one waits out the lag
        return await getattr(second, pair[1])(["r"])

    a, b = await asyncio.gather(getattr(first, pair[0])(["r"]), later())  # neither raises
    assert "r" in a["removed"] + b["removed"], (a, b)  # whichever finished first removed it
    assert a["removed"] + a["absent"] == b["removed"] + b["absent"] == ["r"]
    bucket, root = split_bucket_url(bucket_url)
    left = [k.rsplit("/r/", 1)[1] for k in list_keys(s3_client, bucket, root)]
    assert set(left) <= {"fence", "retired"}, left  # a retire that ran after the delete fences the id
    assert _probes(s3_client, bucket_url) == []


@pytest.mark.parametrize("kind", ["store", "ledger"])
@pytest.mark.parametrize("removal", ["retire", "delete"])
async def test_a_probed_removal_whose_listing_never_shows_the_probe_raises_and_deletes_it(
    fresh, ledgers, proxy, s3_client, bucket_url, kind: str, removal: str
):
    from s3capture.errors import ListingError

    from faultproxy import ListHideYoung as Hide

    await put_chain(fresh(), "r", 1)

    async def rule(request: Any) -> Any:
        return Hide(60_000) if request.is_list else None

    proxy.rule = rule
    probed = (fresh if kind == "store" else ledgers)(endpoint_url=proxy.endpoint, probe_listing=True)
    with pytest.raises(ListingError, match="ledger/.probe/"):
        await getattr(probed, removal)(["r", "unused"])
    assert _probes(s3_client, bucket_url) == []  # before: one probe left per rollout, unused ids too


class _CreationTimes(dict):
    """``FaultProxy.put_times`` of a store whose listings lag the *creation* of keys: a key written
    again (a re-freeze's fence) keeps the time it was first written, so it is listed at once (as in
    the model's ``lag`` fault, tests/model_machines.py)."""

    def __setitem__(self, key: str, value: float) -> None:
        if key not in self:
            super().__setitem__(key, value)


@pytest.mark.parametrize("write", ["marker", "conflict"])
async def test_a_probed_refreeze_through_a_listing_that_lags_creations_sees_what_landed_before_it(
    fresh, proxy, s3_client, bucket_url, write: str
):
    """A re-freeze's fence exists already, so a listing that lags the creation of keys shows it at
    once: without the probe the re-freeze handed out the first snapshot, trainable, although a
    marker (acknowledged) or a conflicting payload (refused as frozen, but landed) was written
    after it. With ``probe_listing`` the freeze PUTs a probe beside its fence and lists until the
    probe shows, so the snapshot is masked. docs/reliability.md, "Listings that lag"."""
    import asyncio

    from helpers import simple_entry
    from s3capture.protocols import TokenCaptureFrozenError

    proxy.put_times = _CreationTimes()
    worker = fresh(endpoint_url=proxy.endpoint)
    await worker.put(simple_entry("r", "c1"))
    first = await fresh(endpoint_url=proxy.endpoint).freeze("r")
    assert not first.incomplete
    await asyncio.sleep(LAG_MS / 1000 + 0.1)  # everything so far is listed

    async def long_lag(request: Any) -> Any:
        # The plain re-freeze waits for nothing (its fence is old), so a long lag keeps this
        # demonstration independent of the machine's load (CI, 2026-12-04: under 250 ms the
        # refused put had aged past the lag before the plain freeze listed).
        return ListHideYoung(5_000.0) if request.is_list else None

    for key in list(proxy.put_times):  # the keys written so far (the fence) count as long listed
        dict.__setitem__(proxy.put_times, key, 0.0)
    proxy.rule = long_lag

    async def written_after_the_freeze() -> None:
        if write == "marker":
            await worker.mark_incomplete("r", "c2")  # acknowledged
        else:
            with pytest.raises(TokenCaptureFrozenError):  # refused, but its object landed
                await fresh(endpoint_url=proxy.endpoint).put(simple_entry("r", "c1", text="other"))

    await written_after_the_freeze()
    plain = await fresh(endpoint_url=proxy.endpoint).freeze("r")
    assert (plain.version, plain.snapshot_id, plain.incomplete) == (first.version, first.snapshot_id, False)

    # The same again under a new id, read by a probed client (which waits for its probe, so the
    # lag is the short one).
    proxy.rule = None
    await worker.put(simple_entry("s", "c1"))
    await fresh(endpoint_url=proxy.endpoint).freeze("s")
    await asyncio.sleep(LAG_MS / 1000 + 0.1)
    lagging(proxy)
    if write == "marker":
        await worker.mark_incomplete("s", "c2")
    else:
        with pytest.raises(TokenCaptureFrozenError):
            await fresh(endpoint_url=proxy.endpoint).put(simple_entry("s", "c1", text="other"))
    probed = await fresh(endpoint_url=proxy.endpoint, probe_listing=True).freeze("s")
    expected = "marked_incomplete:c2" if write == "marker" else "conflicting_payloads:c1"
    assert probed.incomplete and expected in probed.reasons, probed.reasons
    assert _probes(s3_client, bucket_url) == []  # deleted beside the manifest PUT


async def test_a_probed_freeze_gives_the_plain_snapshot_and_leaves_no_probe(fresh, proxy, s3_client, bucket_url):
    """The probe's PUT goes beside the fence's and its DELETE beside the manifest's; a probed
    freeze gives the same snapshot as a plain one; a freeze refused as retired deletes its probe
    too."""
    from helpers import simple_entry
    from s3capture.protocols import TokenCaptureRetiredError

    writer = fresh()
    for cid in ("c1", "c2"):
        await writer.put(simple_entry("r", cid))
    probed = fresh(endpoint_url=proxy.endpoint, probe_listing=True)
    snapshot = await probed.freeze("r")
    again = await probed.freeze("r")
    plain = await fresh().freeze("r")
    assert (
        (snapshot.version, snapshot.snapshot_id)
        == (again.version, again.snapshot_id)
        == (
            plain.version,
            plain.snapshot_id,
        )
    )
    probe_ops = [r.method for r in proxy.requests if "/ledger/.probe/" in r.path]
    assert probe_ops.count("PUT") == 2 and probe_ops.count("DELETE") == 2, probe_ops
    assert _probes(s3_client, bucket_url) == []

    assert await writer.drop("r", snapshot.snapshot_id, snapshot.version) is True
    with pytest.raises(TokenCaptureRetiredError):
        await probed.freeze("r")
    assert _probes(s3_client, bucket_url) == []


async def test_an_export_with_probe_listing_freezes_behind_a_probe(fresh, proxy, s3_client, bucket_url, tmp_path):
    """``export(..., freeze=True, probe_listing=True)`` (the CLI's ``--probe-listing``) builds its
    clients with the option: each freeze PUTs a probe and deletes it; none is left."""
    from s3capture.cli import build_parser
    from s3capture.export import export

    await put_chain(fresh(), "open-a", 2)
    summary = await export(
        bucket_url,
        str(tmp_path / "out"),
        workers=0,
        min_age=0,
        freeze=True,
        endpoint_url=proxy.endpoint,
        probe_listing=True,
    )
    assert summary.exported == 1, summary
    assert sorted(r.method for r in proxy.requests if "/ledger/.probe/" in r.path) == ["DELETE", "PUT"]
    assert _probes(s3_client, bucket_url) == []
    args = build_parser().parse_args(
        ["export", bucket_url, "--out", str(tmp_path / "x"), "--freeze", "--probe-listing"]
    )
    assert args.probe_listing is True
