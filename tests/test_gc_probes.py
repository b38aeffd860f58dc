"""A rollout prefix holding nothing but leftover listing probes, and ``s3capture gc`` removing it.

A ``probe_listing`` client (``S3TokenStore``'s retire/delete, ``S3CaptureLedger``'s manifest,
has_rows, retire, delete) PUTs an empty ``rollouts/<rid>/ledger/.probe/<32 hex>`` before some LISTs
and deletes it after. When the transport retried that PUT and the store applied the first attempt
late, after the call's DELETE, the probe outlives the call; under an id nothing else was written to
(a probed ``has_rows`` on an unused id, say) it is then the only key under the rollout prefix
(docs/reliability.md, finding 36). The tests make such a probe with a plain boto3 PUT of the empty
key, then check:

* ``rollouts`` (``ls``), ``status`` and ``export`` take such a prefix for no rollout at all: it is
  not listed in any state, counted nowhere, never exported, and ``gc`` before this change never
  saw it either, so nothing removed it;
* ``gc`` reports it as its own action (``delete_probes``) in a dry run and deletes nothing; with
  ``--yes`` deletes exactly its probes once every one is older than ``--retired-older-than``,
  after a second listing just before the delete shows the same keys; leaves a prefix alone that
  holds anything else (a rollout's entry beside a probe, a folder marker, a key named like a probe
  that is none), a probe younger than the age, and a prefix that changed since the listing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from helpers import list_keys, simple_entry, split_bucket_url

from s3capture.export import export
from s3capture.ops import status

FAR = 10.0  # seconds added to "now" so that everything already written counts as old


def _probe_rel() -> str:
    return f"ledger/.probe/{uuid.uuid4().hex}"


def _put(s3_client: Any, bucket_url: str, rollout_id: str, rel: str, body: bytes = b"") -> str:
    """A plain PUT of ``rollouts/<rollout_id>/<rel>`` (what a late-applied probe PUT leaves)."""
    bucket, root = split_bucket_url(bucket_url)
    key = f"{root}rollouts/{rollout_id}/{rel}"
    s3_client.put_object(Bucket=bucket, Key=key, Body=body)
    return key


def _keys(s3_client: Any, bucket_url: str, rollout_id: str) -> list[str]:
    bucket, root = split_bucket_url(bucket_url)
    prefix = f"{root}rollouts/{rollout_id}/"
    return [key[len(prefix) :] for key in list_keys(s3_client, bucket, prefix)]


async def _root(make: Any, s3_client: Any, bucket_url: str) -> dict[str, list[str]]:
    """``ghost``: two probes alone; ``neighbour``: a rollout's entry and a probe; ``folder``: a
    folder marker and a probe; ``lookalike``: a key under ``ledger/.probe/`` that is no probe.
    Returns each id's keys (relative to its rollout prefix). ``make`` builds S3TokenStore clients."""
    await make().put(simple_entry("neighbour", "c1"))
    _put(s3_client, bucket_url, "ghost", _probe_rel())
    _put(s3_client, bucket_url, "ghost", _probe_rel())
    _put(s3_client, bucket_url, "neighbour", _probe_rel())
    _put(s3_client, bucket_url, "folder", "")  # rollouts/folder/: a console's "Create folder"
    _put(s3_client, bucket_url, "folder", _probe_rel())
    _put(s3_client, bucket_url, "lookalike", "ledger/.probe/not-a-probe")
    return {rid: _keys(s3_client, bucket_url, rid) for rid in ("ghost", "neighbour", "folder", "lookalike")}


async def test_a_prefix_of_probes_alone_is_no_rollout_to_ls_status_or_export(
    fresh: Any, ledgers: Any, s3_client: Any, bucket_url: str, tmp_path: Any
) -> None:
    """What the listing makes of a prefix of probes alone: nothing. Not "open", not counted, not
    exported; a ledger client does not list it either."""
    await _root(fresh, s3_client, bucket_url)
    store = fresh()
    listed = {info.rollout_id: info.state async for info in store.rollouts()}
    assert listed == {"neighbour": "open", "lookalike": "open"}  # no ghost, no folder
    neighbour = [info async for info in store.rollouts(prefix="neighbour")][0]
    assert neighbour.objects == 1  # the probe beside the entry is not counted either
    assert [info.rollout_id async for info in ledgers().rollouts()] == ["lookalike"]  # a ledger key to it

    result = await status(store, now=time.time() + FAR)
    assert {state: counts.rollouts for state, counts in result.states.items()} == {
        "open": 2,
        "frozen": 0,
        "retired": 0,
    }
    assert result.states["open"].objects == 2 and result.bare_fences == 0

    summary = await export(bucket_url, str(tmp_path / "out"), workers=0, min_age=0, ids=["ghost", "neighbour"])
    assert summary.listed == 1 and summary.exported == 1
    assert summary.skipped == 1 and any(
        line.startswith("ghost: ") for lines in summary.skipped_examples.values() for line in lines
    )
    assert not summary.root_empty
