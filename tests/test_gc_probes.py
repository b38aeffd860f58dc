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

import asyncio
import json
import time
import uuid
from typing import Any

import pytest
from helpers import list_keys, simple_entry, split_bucket_url

from s3capture.cli import main
from s3capture.export import export
from s3capture.ops import GcAction, format_gc, gc, status
from s3capture.store import S3TokenStore

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


async def test_gc_dry_run_reports_a_prefix_of_old_probes_alone_and_deletes_nothing(
    fresh: Any, s3_client: Any, bucket_url: str
) -> None:
    before = await _root(fresh, s3_client, bucket_url)
    actions: list[GcAction] = []
    report = await gc(fresh(), 0.0, now=time.time() + FAR, on_action=actions.append)
    probes = [a for a in actions if a.action == "delete_probes"]
    assert [(a.rollout_id, a.keys, a.objects, a.bytes) for a in probes] == [("ghost", before["ghost"], 2, 0)]
    assert probes[0].last_write is not None
    # The rollout beside them: an open one, reported as abandoned and never touched.
    assert {(a.rollout_id, a.action) for a in actions} == {
        ("ghost", "delete_probes"),
        ("neighbour", "abandoned"),
        ("lookalike", "abandoned"),
    }
    assert (report.deleted_probe_prefixes, report.deleted_objects, report.deleted_rollouts) == (1, 2, 0)
    assert "would remove 2 objects" in format_gc(report)
    assert "leftover listing probes under 1 otherwise empty rollout prefix" in format_gc(report)
    assert {rid: _keys(s3_client, bucket_url, rid) for rid in before} == before  # nothing deleted


def test_gc_yes_deletes_only_the_old_probes_alone(
    s3_env: Any, s3_client: Any, bucket_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async def run(work: Any) -> Any:
        stores: list[S3TokenStore] = []

        def make() -> S3TokenStore:
            stores.append(S3TokenStore(bucket_url))
            return stores[-1]

        try:
            return await work(make)
        finally:
            for store in stores:
                await store.close()

    before = asyncio.run(run(lambda make: _root(make, s3_client, bucket_url)))
    capsys.readouterr()
    assert main(["ls", bucket_url, "--json"]) == 0  # no row for ghost or folder
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["rollout_id"], row["state"]) for row in rows] == [("lookalike", "open"), ("neighbour", "open")]

    # Younger than the age: stays, counted as too young.
    young = asyncio.run(run(lambda make: gc(make(), 3600.0, dry_run=False)))
    assert (young.deleted_probe_prefixes, young.deleted_objects, young.too_young) == (0, 0, 1)
    assert {rid: _keys(s3_client, bucket_url, rid) for rid in before} == before

    # A threshold of 0, once a second has passed: gc reads the store's clock from the Date header
    # of its LIST answers, whole seconds truncated, so a key written within the last second can
    # read as written after "now" where LastModified has milliseconds (the Ceph gateway: CI of
    # 2026-12-04 saw the probes counted too young). Never older than they are, only younger.
    time.sleep(1.1)
    assert main(["gc", bucket_url, "--retired-older-than", "0s"]) == 0
    out = capsys.readouterr().out
    assert "would delete the probes of ghost (2 objects" in out and "dry run" in out
    assert {rid: _keys(s3_client, bucket_url, rid) for rid in before} == before
    assert main(["gc", bucket_url, "--retired-older-than", "0s", "--yes", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    summary = lines[-1]
    assert summary["type"] == "summary" and summary["deleted_probe_prefixes"] == 1
    assert (summary["deleted_objects"], summary["deleted_rollouts"], summary["skipped"]) == (2, 0, 0)
    assert [(line["rollout_id"], line["keys"]) for line in lines[:-1] if line["action"] == "delete_probes"] == [
        ("ghost", before["ghost"])
    ]
    after = {rid: _keys(s3_client, bucket_url, rid) for rid in before}
    assert after == {**before, "ghost": []}

    async def read_back(make: Any) -> Any:
        # The neighbour's entry reads back (the probe beside it is retire's and delete's business),
        # and a second run finds nothing more to do.
        snapshot = await make().freeze("neighbour")
        assert [e.model_call_id for e in snapshot.entries] == ["c1"]
        return await gc(make(), 0.0, now=time.time() + FAR, dry_run=False)

    again = asyncio.run(run(read_back))
    assert again.deleted_probe_prefixes == 0 and again.deleted_objects == 0


async def test_gc_leaves_a_prefix_of_probes_that_changed_since_the_listing(
    fresh: Any, s3_client: Any, bucket_url: str
) -> None:
    """A write under the id between the listing and the re-check (a call probing it again, a put
    using it): the id is someone's now; nothing is deleted, not even the old probe."""
    old = _put(s3_client, bucket_url, "ghost", _probe_rel())
    store = fresh()
    original = store._list
    racer: list[str] = []

    async def racing_list(prefix: str, **kwargs: Any) -> Any:
        racer.append(_put(s3_client, bucket_url, "ghost", _probe_rel()))  # lands after the streaming listing
        return await original(prefix, **kwargs)

    store._list = racing_list
    actions: list[GcAction] = []
    report = await gc(store, 0.0, now=time.time() + FAR, dry_run=False, on_action=actions.append)
    assert [(a.rollout_id, a.action) for a in actions] == [("ghost", "skipped")]
    assert (report.skipped, report.deleted_probe_prefixes, report.deleted_objects) == (1, 0, 0)
    bucket, root = split_bucket_url(bucket_url)
    assert list_keys(s3_client, bucket, root) == sorted([old, *racer])
