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

    await put_chain(writer, "plain", 1)
    await getattr(fresh(endpoint_url=proxy.endpoint), removal)(["plain"])
    assert any(k.startswith("log/e/") for k in left("plain"))  # the limitation the option exists for

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
