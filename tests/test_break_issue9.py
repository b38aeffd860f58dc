"""Adversarial review of issue 9 (listing, read-only snapshots, trajectory builder, export)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from helpers import process_alive, put_chain, simple_entry  # noqa: E402
from s3capture.export import export, format_summary, read_manifests  # noqa: E402

MOTO = pytest.mark.parametrize("s3_server", ["moto"], indirect=True)


def rows_of(dest: Path) -> list[dict]:
    rows: list[dict] = []
    for path in sorted(dest.glob("part-*.parquet")):
        rows.extend(pq.read_table(path).to_pylist())
    return rows


async def frozen_chains(fresh: Any, ids: list[str], depth: int = 2) -> None:
    writer, builder = fresh(), fresh()
    for rid in ids:
        await put_chain(writer, rid, depth)
        await builder.freeze(rid)


@MOTO
async def test_a_second_export_into_a_busy_folder_is_refused_and_nothing_dropped_is_lost(
    fresh: Any, tmp_path: Path, bucket_url: str
) -> None:
    """Two exports into one folder took the same shard numbers; the second replaced the first's
    shard and both dropped their rollouts: the first's rows were gone from the destination and from
    the bucket. Found by running two exports (other ids, --drop) at once."""
    await frozen_chains(fresh, ["a1", "a2", "b1", "b2"])
    dest = tmp_path / "out"
    results = await asyncio.gather(
        export(bucket_url, str(dest), workers=0, ids=["a1", "a2"], drop=True),
        export(bucket_url, str(dest), workers=0, ids=["b1", "b2"], drop=True),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(refused) == 1 and isinstance(refused[0], ValueError) and "another export" in str(refused[0])
    dropped = {info.rollout_id async for info in fresh().rollouts("retired")}
    assert len(dropped) == 2 and dropped <= {row["rollout_id"] for row in rows_of(dest)}
    # Once the first is done the folder is free again.
    assert (await export(bucket_url, str(dest), workers=0, drop=True)).dropped == 2
    assert {row["rollout_id"] for row in rows_of(dest)} == {"a1", "a2", "b1", "b2"}


@MOTO
async def test_two_exports_into_one_s3_prefix_never_drop_a_rollout_whose_rows_are_gone(
    fresh: Any, bucket_url: str, s3_client: Any
) -> None:
    """Two exports into one s3:// prefix numbered their shards alike, replaced each other's shards
    and dropped rollouts whose rows were gone. Was a strict xfail ("S3 has no lock without
    compare-and-swap"); an export now claims the prefix (PUT a claim, LIST the claims)."""
    import io

    await frozen_chains(fresh, ["a1", "a2", "b1", "b2"])
    dest = bucket_url + "-exports/run"
    results = await asyncio.gather(
        export(bucket_url, dest, workers=0, ids=["a1", "a2"], drop=True),
        export(bucket_url, dest, workers=0, ids=["b1", "b2"], drop=True),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, BaseException)]
    assert refused and all(isinstance(r, ValueError) and "another export" in str(r) for r in refused), results
    bucket = bucket_url[len("s3://") :].split("/")[0]
    exported = set()
    for manifest in await read_manifests(dest):
        body = s3_client.get_object(Bucket=bucket, Key=f"t-exports/run/{manifest.data}")["Body"].read()
        exported |= {row["rollout_id"] for row in pq.read_table(io.BytesIO(body)).to_pylist()}
    dropped = {info.rollout_id async for info in fresh().rollouts("retired")}
    assert dropped <= exported, (dropped, exported)
    # Every claim is gone afterwards, so the next export proceeds at once and takes the rest.
    claims = s3_client.list_objects_v2(Bucket=bucket, Prefix="t-exports/run/.s3capture-export.lock/").get("KeyCount", 0)
    assert claims == 0
    again = await export(bucket_url, dest, workers=0, drop=True)
    assert again.ok and {info.rollout_id async for info in fresh().rollouts("retired")} == {"a1", "a2", "b1", "b2"}


@MOTO
async def test_a_dead_export_s_claim_is_taken_over_after_the_lease(
    fresh: Any, bucket_url: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed export leaves its claim; the next export is refused while the claim is younger than
    the lease (by the store's clock) and takes the destination over after it."""
    import s3capture.export.destination_s3 as export_module  # the claim's constants are read there

    await frozen_chains(fresh, ["k1"])
    bucket = bucket_url[len("s3://") :].split("/")[0]
    dest = bucket_url + "-exports/dead"
    s3_client.put_object(Bucket=bucket, Key="t-exports/dead/.s3capture-export.lock/deadbeef", Body=b"{}")
    with pytest.raises(ValueError, match="another export"):
        await export(bucket_url, dest, workers=0)
    monkeypatch.setattr(export_module, "CLAIM_LEASE", -1.0)  # every other claim is older than the lease
    summary = await export(bucket_url, dest, workers=0, drop=True)
    assert summary.ok and summary.exported == 1 and summary.dropped == 1, format_summary(summary)
    assert (
        s3_client.list_objects_v2(Bucket=bucket, Prefix="t-exports/dead/.s3capture-export.lock/").get("KeyCount", 0)
        == 0
    )


@MOTO
async def test_an_export_whose_claim_was_taken_over_publishes_and_drops_nothing(
    fresh: Any, bucket_url: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export paused past the lease may have been taken over: once its claim is gone its
    workers publish no shard (each checks the claim before its PUTs; an export resumed after a
    takeover used to publish its shards beside the new export's, every row twice) and it drops
    nothing (the rollouts stay frozen, for the export that took over)."""
    import s3capture.export.destination_s3 as export_module  # the claim's constants are read there

    await frozen_chains(fresh, ["p1", "p2"])
    bucket = bucket_url[len("s3://") :].split("/")[0]
    monkeypatch.setattr(export_module, "CLAIM_RENEW", 0.05)
    real_lock = export_module._S3Destination.lock

    async def lock_then_lose(self: Any) -> None:
        await real_lock(self)
        s3_client.delete_object(Bucket=bucket, Key=self._claim)  # another export took over
        for _ in range(200):
            await asyncio.sleep(0.05)
            if getattr(self, "_lost", None):
                return
        raise AssertionError("the renewal never noticed its claim was gone")

    monkeypatch.setattr(export_module._S3Destination, "lock", lock_then_lose)
    summary = await export(bucket_url, bucket_url + "-exports/lost", workers=0, drop=True)
    assert not summary.ok and summary.exported == 0 and summary.failed == 2, format_summary(summary)
    assert summary.dropped == 0 and summary.shards_written == 0, format_summary(summary)
    assert "no longer holds it" in format_summary(summary)
    published = s3_client.list_objects_v2(Bucket=bucket, Prefix="t-exports/lost/").get("Contents", [])
    assert not [o["Key"] for o in published if ".s3capture-export.lock/" not in o["Key"]]
    assert {info.rollout_id async for info in fresh().rollouts("frozen")} == {"p1", "p2"}


@MOTO
async def test_a_rerun_never_drops_a_rollout_whose_data_file_is_gone(
    fresh: Any, tmp_path: Path, bucket_url: str
) -> None:
    """A manifest whose data file was removed still counted as durable: the re-run called its
    rollouts already exported and --drop dropped them, with no row of them anywhere."""
    await frozen_chains(fresh, ["g1", "g2"])
    dest = tmp_path / "out"
    first = await export(bucket_url, str(dest), workers=0)
    assert first.exported == 2
    (manifest,) = await read_manifests(str(dest))
    (dest / manifest.data).unlink()  # an operator removed the data file (or it never finished copying)
    again = await export(bucket_url, str(dest), workers=0, drop=True)
    assert again.ok and again.already_exported == 0 and again.exported == 2 and again.dropped == 2, format_summary(
        again
    )
    assert sorted(row["rollout_id"] for row in rows_of(dest)) == ["g1", "g2"]
    assert len(await read_manifests(str(dest))) == 1 and not (dest / "_part-00000.manifest.json").exists()


@MOTO
async def test_an_s3_shard_whose_data_object_was_replaced_is_not_durable(
    fresh: Any, bucket_url: str, s3_client: Any
) -> None:
    """The same on an s3:// DEST, with the data object replaced by a shorter one (a partial copy)."""
    import io

    await frozen_chains(fresh, ["s1", "s2"])
    bucket = bucket_url[len("s3://") :].split("/")[0]
    dest = f"s3://{bucket}/exports"
    assert (await export(bucket_url, dest, workers=0)).exported == 2
    (manifest,) = await read_manifests(dest)
    s3_client.put_object(Bucket=bucket, Key=f"exports/{manifest.data}", Body=b"PAR1")
    again = await export(bucket_url, dest, workers=0, drop=True)
    assert again.ok and again.exported == 2 and again.dropped == 2 and again.orphans_removed == 2, format_summary(again)
    (manifest,) = await read_manifests(dest)
    body = s3_client.get_object(Bucket=bucket, Key=f"exports/{manifest.data}")["Body"].read()
    assert sorted(row["rollout_id"] for row in pq.read_table(io.BytesIO(body)).to_pylist()) == ["s1", "s2"]


@MOTO
async def test_shard_100000_is_newer_than_shard_99999(fresh: Any, tmp_path: Path, bucket_url: str) -> None:
    """Resume reads the destination's records newest shard last; shard numbers pass five digits."""
    import json

    writer = fresh()
    await put_chain(writer, "grow", 2)
    dest = tmp_path / "out"
    assert (await export(bucket_url, str(dest), workers=0, min_age=0)).exported == 1
    # Renumber that shard 99999, as after a long-lived destination's 99,999 earlier shards.
    manifest = json.loads((dest / "_part-00000.manifest.json").read_text())
    (dest / "part-00000.parquet").rename(dest / "part-99999.parquet")
    manifest.update(shard=99999, data="part-99999.parquet")
    (dest / "_part-99999.manifest.json").write_text(json.dumps(manifest))
    (dest / "_part-00000.manifest.json").unlink()
    turns, _ = await put_chain(fresh(), "grow", 3)  # the open rollout grows: a new snapshot
    second = await export(bucket_url, str(dest), workers=0, min_age=0)
    assert second.changed_since_export == 1 and (dest / "_part-100000.manifest.json").exists()
    third = await export(bucket_url, str(dest), workers=0, min_age=0)
    assert third.already_exported == 1 and third.exported == 0, format_summary(third)


@MOTO
async def test_pending_drops_hold_the_listing_back(
    fresh: Any, tmp_path: Path, bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory stays bounded: a re-run with --drop scheduled one task per already-exported frozen
    rollout as fast as the listing streamed (about 1.8 KB each, while drops run 32 at a time and wait
    fence_grace): 1,000,000 rollouts held ~2 GB of pending drops. Found by measuring with tracemalloc."""
    import s3capture.export.driver as export_module  # the export run reads _DROPS_AHEAD there
    from s3capture.store import S3TokenStore

    ids = [f"d{i}" for i in range(5)]
    await frozen_chains(fresh, ids)
    dest = tmp_path / "out"
    assert (await export(bucket_url, str(dest), workers=0)).exported == len(ids)

    counts = {"listed": 0, "dropped": 0, "ahead": 0}
    listing, dropping = S3TokenStore.rollouts, S3TokenStore.drop

    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        async for info in listing(self, *args, **kwargs):
            counts["listed"] += 1
            counts["ahead"] = max(counts["ahead"], counts["listed"] - counts["dropped"])
            yield info

    async def drop(self: Any, *args: Any) -> bool:
        try:
            return await dropping(self, *args)
        finally:
            counts["dropped"] += 1

    monkeypatch.setattr(S3TokenStore, "rollouts", counted)
    monkeypatch.setattr(S3TokenStore, "drop", drop)
    monkeypatch.setattr(export_module, "_DROPS_AHEAD", 2)
    again = await export(bucket_url, str(dest), workers=0, drop=True, fence_grace=0)  # no writer: no grace needed
    assert again.already_exported == len(ids) and again.dropped == len(ids), format_summary(again)
    assert counts["ahead"] <= 3, counts  # at most _DROPS_AHEAD pending and the one being looked at


def _group(pgid: int) -> list[str]:
    import subprocess

    return subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()


@MOTO
async def test_workers_stop_when_the_export_process_is_killed(fresh: Any, tmp_path: Path, bucket_url: str) -> None:
    """SIGKILL of the export process alone (``kill -9 PID``) left its pool workers running: they
    finished the shards already handed to them and published them, numbered by a dead parent,
    while a re-run could number its own shards alike (and drop rollouts whose rows an orphan then
    replaced), and then stayed alive for good. Found by killing the parent only (not its group)."""
    import signal
    import subprocess
    import sys
    import time

    from s3capture.export import HOLD_ENV

    writer, builder = fresh(), fresh()
    ids = [f"k{i:02d}" for i in range(8)]
    for rid in ids:
        await put_chain(writer, rid, 2)
        await builder.freeze(rid)
    dest = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "s3capture.cli",
        "export",
        bucket_url,
        "--out",
        str(dest),
        "--shard-rollouts",
        "2",
        "--workers",
        "1",
        "--concurrency",
        "1",
        "--no-progress",
    ]
    proc = subprocess.Popen(
        command, env={**os.environ, HOLD_ENV: "1"}, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "holding after" not in line:
            line = await asyncio.to_thread(proc.stderr.readline)
            assert (line or proc.poll() is None) and time.monotonic() < deadline, "no hold"
        os.kill(proc.pid, signal.SIGKILL)  # the parent alone
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _group(proc.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not _group(proc.pid), "export workers outlived their parent"
        files = sorted(p.name for p in dest.iterdir())
        await asyncio.sleep(1)
        assert sorted(p.name for p in dest.iterdir()) == files
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.stderr.close()


@MOTO
async def test_gym_jsonl_never_drops_the_calls_of_a_per_request_build(
    fresh: Any, tmp_path: Path, bucket_url: str, capsys: pytest.CaptureFixture
) -> None:
    """``--format gym-jsonl --builder per_request`` wrote one Gym response per rollout holding only
    the first of its per-call trajectories (the manifest still counted every call's tokens as
    written) and ``--drop`` then dropped the rollout: the other calls' tokens were gone. Gym's
    consumer returns one chain per rollout and has no per_request builder, so the pair is refused."""
    await frozen_chains(fresh, ["pr"], depth=3)
    with pytest.raises(ValueError, match="per_request"):
        await export(bucket_url, str(tmp_path / "o"), workers=0, format="gym-jsonl", builder="per_request", drop=True)
    assert [info.state async for info in fresh().rollouts()] == ["frozen"]
    from s3capture.cli import main

    args = ["export", bucket_url, "--out", str(tmp_path / "c"), "--format", "gym-jsonl", "--builder", "per_request"]
    assert await asyncio.to_thread(main, args) == 2
    err = capsys.readouterr().err
    assert "per_request" in err and len(err.strip().splitlines()) == 1


@MOTO
@pytest.mark.parametrize("where", ["the source root", "the bucket root"])
async def test_a_destination_holding_the_captures_is_refused(fresh: Any, bucket_url: str, where: str) -> None:
    """The destination scan lists every key under DEST (and keeps each one, ~350 bytes with its
    'seen' entry) to find the shards beside it: an ``--out`` that contains the source's rollouts
    (the capture root itself, or the bucket root) made every run list and hold every captured
    object, O(captures) memory and LIST requests. Found reading ``_S3Destination.scan``."""
    await frozen_chains(fresh, ["h1"])
    bucket = bucket_url[len("s3://") :].split("/")[0]
    dest = bucket_url if where == "the source root" else f"s3://{bucket}"
    with pytest.raises(ValueError, match="contains the rollouts"):
        await export(bucket_url, dest, workers=0)


@MOTO
async def test_an_open_rollout_of_unknown_age_is_not_quiescent(
    fresh: Any, tmp_path: Path, bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing without LastModified (a server that omits it, or one the obstore transport cannot
    parse: it is then left out) gives ``last_write=None``, and the exporter took an open rollout of
    unknown age as quiescent: a rollout being written was exported at once. Unknown age must wait."""
    import msgspec

    from s3capture.store import S3TokenStore

    writer = fresh()
    await put_chain(writer, "live", 2)
    listing = S3TokenStore.rollouts

    async def timeless(self: Any, *args: Any, **kwargs: Any) -> Any:
        async for info in listing(self, *args, **kwargs):
            yield msgspec.structs.replace(info, last_write=None)

    monkeypatch.setattr(S3TokenStore, "rollouts", timeless)
    summary = await export(bucket_url, str(tmp_path / "o"), workers=0, min_age=600)
    assert summary.exported == 0 and summary.skipped_reasons == {"not_quiescent": 1}, format_summary(summary)
    assert (await export(bucket_url, str(tmp_path / "o"), workers=0, min_age=0)).exported == 1


@MOTO
async def test_the_exporters_drop_waits_the_fleets_fence_grace(
    fresh: Any, tmp_path: Path, bucket_url: str, s3_server: Any
) -> None:
    """Every client of a bucket must share ``fence_grace`` (README, design.md), but ``export --drop``
    dropped with the default 1 s whatever the writers used. A put that read the fence as open before
    the freeze and landed after the drop's decisive LIST, yet within the writers' larger grace, was
    acknowledged and lost. ``export(fence_grace=)`` / ``--fence-grace`` now set the drop's grace."""
    from faultproxy import FaultProxy

    from s3capture.errors import StoreError
    from s3capture.protocols import TokenCaptureRetiredError
    from s3capture.store import S3TokenStore

    grace = 5.0
    first = fresh(fence_grace=grace)
    await first.put(simple_entry("slow", "c1"))
    release = asyncio.Event()
    async with FaultProxy.for_server(s3_server) as proxy:

        async def hold(request: Any) -> Any:
            if request.method == "PUT" and "/slow/log/e/" in request.path and "/c2/" in request.path:
                await asyncio.wait_for(release.wait(), 30)
            return None

        proxy.rule = hold
        async with S3TokenStore(bucket_url, endpoint_url=proxy.endpoint, fence_grace=grace) as writer:
            put = asyncio.create_task(writer.put(simple_entry("slow", "c2", prompt=[11, 12, 13, 14, 15])))
            while not any(r.method == "GET" and r.path.endswith("/slow/fence") for r in proxy.requests):
                await asyncio.sleep(0.01)  # the put read the fence: open
            await fresh(fence_grace=grace).freeze("slow")
            summary = await export(bucket_url, str(tmp_path / "o"), workers=0, drop=True, fence_grace=grace)
            release.set()
            try:
                await put
                acknowledged = True
            except (TokenCaptureRetiredError, StoreError):
                acknowledged = False
    exported = {tuple(row["call_ids"]) for row in rows_of(tmp_path / "o")}
    if acknowledged:  # then it is in the export, or the rollout was not dropped
        assert summary.dropped == 0 or any("c2" in ids for ids in exported), (format_summary(summary), exported)


@MOTO
async def test_a_rollout_masked_after_an_unsealed_export_leaves_no_trainable_latest_row(
    fresh: Any, tmp_path: Path, bucket_url: str
) -> None:
    """An open rollout exported unsealed (trainable), then masked by a marker: --masked skip must
    still write its masked rows, or "keep the highest version per rollout_id" trains on the stale
    trainable ones. Found by a breaker session; was a strict xfail."""
    writer = fresh()
    await put_chain(writer, "paused", 2)  # an agent waiting on a long tool call: open, quiescent
    dest = tmp_path / "o"
    assert (await export(bucket_url, str(dest), workers=0, min_age=0)).exported == 1
    await writer.mark_incomplete("paused", "call-002")  # its next call failed to capture
    again = await export(bucket_url, str(dest), workers=0, min_age=0)
    assert again.changed_since_export == 1 and again.masked_written == 1 and again.masked_excluded == 0
    rows = [row for row in rows_of(dest) if row["rollout_id"] == "paused"]
    latest = max(row["version"] for row in rows)
    assert all(row["masked"] for row in rows if row["version"] == latest)
    assert any(not row["masked"] for row in rows if row["version"] < latest)  # the earlier export stays
    third = await export(bucket_url, str(dest), workers=0, min_age=0)  # resumable: nothing to write again
    assert third.already_exported == 1 and third.shards_written == 0


@MOTO
async def test_a_frozen_rollout_masked_after_its_sealed_export_leaves_no_trainable_latest_row(
    fresh: Any, tmp_path: Path, bucket_url: str
) -> None:
    """The same for a frozen rollout exported sealed, then changed (a tester's finding): every
    re-run without --freeze skipped it ``not_sealed`` and its newest rows stayed trainable while its
    state was masked. Now it is read unsealed and its masked rows written over (read-only: no
    freeze); a change that masks nothing is still skipped ``not_sealed``."""
    writer, builder = fresh(), fresh()
    for rid in ("late-marker", "late-entry"):
        await put_chain(writer, rid, 2)
        await builder.freeze(rid)
    dest = tmp_path / "o"
    assert (await export(bucket_url, str(dest), workers=0)).exported == 2
    # Writes after the freeze land (relaxed fence) and change the listed state.
    from s3capture.protocols import TokenCaptureFrozenError

    await writer.mark_incomplete("late-marker", "call-002")  # a failure report is always recorded
    from helpers import build_conversation, turn_entry

    turns = build_conversation("late-entry", 3)  # the chain's next call: a change that masks nothing
    with pytest.raises(TokenCaptureFrozenError):  # the writer is told; its object landed all the same
        await writer.put(turn_entry("late-entry", turns[2], delta=True, parent_cumulative=turns[1].cumulative))
    again = await export(bucket_url, str(dest), workers=0)
    assert again.changed_since_export == 2 and again.masked_written == 1, format_summary(again)
    assert again.skipped_reasons == {"not_sealed": 1} and again.skipped_examples["not_sealed"][0].startswith(
        "late-entry"
    )
    for rid, masked_now in (("late-marker", True), ("late-entry", False)):
        rows = [row for row in rows_of(dest) if row["rollout_id"] == rid]
        latest = max(row["version"] for row in rows)
        assert all(row["masked"] == masked_now for row in rows if row["version"] == latest), rid
    third = await export(bucket_url, str(dest), workers=0)
    assert third.already_exported == 1 and third.shards_written == 0, format_summary(third)
    sealed = await export(bucket_url, str(dest), workers=0, freeze=True)  # sealing again supersedes both
    assert sealed.masked_written + sealed.exported + sealed.already_exported == 2, format_summary(sealed)


@MOTO
async def test_a_shard_that_decided_nothing_leaves_no_manifest(
    fresh: Any, tmp_path: Path, bucket_url: str, s3_client: Any
) -> None:
    """A shard whose rollouts all failed or were skipped published an empty manifest (no data, no
    record), and every re-run of a persistent failure added one more: the destination filled with
    manifests each later scan must GET. Found by re-running an export of a damaged rollout."""
    import json

    from helpers import put_bytes, rollout_prefix

    await frozen_chains(fresh, ["damaged"])
    bucket, prefix = rollout_prefix(bucket_url, "damaged")
    (info,) = [i async for i in fresh().rollouts()]
    manifest_key = f"{prefix}snap/{info.version:020d}-{info.snapshot_id}"
    body = json.loads(s3_client.get_object(Bucket=bucket, Key=manifest_key)["Body"].read())
    put_bytes(s3_client, bucket, manifest_key, json.dumps({**body, "rollout_id": "someone-else"}).encode())
    dest = tmp_path / "o"
    for _ in range(2):
        summary = await export(bucket_url, str(dest), workers=0)
        assert summary.failed == 1 and summary.shards_written == 0, format_summary(summary)
    assert await read_manifests(str(dest)) == [] and not list(dest.glob("_part-*"))


@MOTO
async def test_files_named_like_shards_in_a_destination_no_export_wrote_are_refused_not_deleted(
    fresh: Any, tmp_path: Path, bucket_url: str, s3_client: Any
) -> None:
    """An export breaker (2026-12-03): a destination holding another tool's ``part-00000.parquet``
    (or data files copied without their ``_part-*`` manifests), with no sign of any export, had
    them deleted as "orphans of an interrupted run" and exited 0. They are now refused like any
    foreign file, and kept; a refused run leaves no lock behind that would let the next run
    delete them. An interrupted export's orphans are still removed (``test_export.py``'s kill test)."""
    import io

    import pyarrow as pa

    await frozen_chains(fresh, ["f1"])
    buffer = io.BytesIO()
    pq.write_table(pa.table({"precious": [1, 2, 3]}), buffer)
    precious = buffer.getvalue()
    dest = tmp_path / "out"
    dest.mkdir()
    for name in ("part-00000.parquet", "part-00007-0123abcd.parquet"):
        (dest / name).write_bytes(precious)
    for _ in range(2):  # the second run finds the folder as the first left it
        with pytest.raises(ValueError, match="holds data files without shard manifests .*part-00000.parquet"):
            await export(bucket_url, str(dest), workers=0)
        assert sorted(p.name for p in dest.iterdir()) == ["part-00000.parquet", "part-00007-0123abcd.parquet"]
    bucket = bucket_url[len("s3://") :].split("/")[0]
    s3_client.put_object(Bucket=bucket, Key="elsewhere/part-00000.parquet", Body=precious)
    for _ in range(2):
        with pytest.raises(ValueError, match="holds data files without shard manifests"):
            await export(bucket_url, f"s3://{bucket}/elsewhere", workers=0)
        listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="elsewhere/").get("Contents", [])
        assert [item["Key"] for item in listed] == ["elsewhere/part-00000.parquet"]
    assert s3_client.get_object(Bucket=bucket, Key="elsewhere/part-00000.parquet")["Body"].read() == precious
    # An s3:// export's own unfinished shard carries its run tag, which is what proves it one, not
    # its claim: a run that failed between a data file and its manifest deletes its claim, and a
    # run that takes a dead claim over deletes that (a review of the first version of this fix,
    # which took claims as the evidence, found both re-runs refused).
    s3_client.put_object(Bucket=bucket, Key="unfinished/part-00000-0123456789abcdef.parquet", Body=b"PAR1")
    resumed = await export(bucket_url, f"s3://{bucket}/unfinished", workers=0)
    assert resumed.ok and resumed.exported == 1 and resumed.orphans_removed == 1, format_summary(resumed)
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="unfinished/part-").get("Contents", [])
    assert len(listed) == 1 and "0123456789abcdef" not in listed[0]["Key"]


@MOTO
async def test_a_local_run_that_fails_after_publishing_a_data_file_is_resumed(
    fresh: Any, tmp_path: Path, bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that fails (here, interrupted) between a shard's data file and its manifest keeps the
    lock file it created (``_LocalDestination._published_files``), so that its re-run removes that
    data file as its own instead of refusing it as foreign (a review found no test of this)."""
    import s3capture.export.destination_local as local

    await frozen_chains(fresh, ["i1", "i2"])
    dest = tmp_path / "out"

    async def interrupted(self: Any, name: str, body: bytes) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(local._LocalDestination, "publish_bytes", interrupted)
        with pytest.raises(KeyboardInterrupt):
            await export(bucket_url, str(dest), workers=0)
    assert sorted(p.name for p in dest.iterdir()) == [".s3capture-export.lock", "part-00000.parquet"]
    again = await export(bucket_url, str(dest), workers=0)
    assert again.ok and again.exported == 2 and again.orphans_removed == 1, format_summary(again)
    assert sorted(row["rollout_id"] for row in rows_of(dest)) == ["i1", "i2"]


@MOTO
async def test_a_destination_written_before_the_manifest_rename_keeps_its_rows(
    fresh: Any, tmp_path: Path, bucket_url: str
) -> None:
    """Exports made before 57e594b named their manifests ``part-NNNNN.manifest.json``; the current
    scan did not see them as manifests, called their data files orphans and deleted them. After an
    export with --drop those rows existed nowhere else. Found by pointing a re-run at such a folder."""
    await frozen_chains(fresh, ["old1", "old2"])
    dest = tmp_path / "out"
    assert (await export(bucket_url, str(dest), workers=0, drop=True)).dropped == 2
    (dest / "_part-00000.manifest.json").rename(dest / "part-00000.manifest.json")  # the earlier name
    again = await export(bucket_url, str(dest), workers=0, drop=True)
    assert again.ok and again.orphans_removed == 0 and again.shards_existing == 1, format_summary(again)
    assert sorted(row["rollout_id"] for row in rows_of(dest)) == ["old1", "old2"]


@MOTO
async def test_an_s3_destination_without_delete_permission_keeps_its_export_and_reports_the_refused_put(
    fresh: Any, bucket_url: str, s3_server: Any, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Destination credentials that may PUT but not DELETE: the export's shards are durable, so
    the claim's delete at the end warns instead of failing the run (it raised from ``close``, and
    the summary of a finished export was lost), and its request is in the summary. Stale claims it
    cannot delete are ignored after the lease. Without PUT either, the error is the refused PUT,
    not the clean-up's refused DELETE."""
    import s3capture.export.destination_s3 as export_module  # the claim's constants are read there
    from faultproxy import FaultProxy, s3_error

    from s3capture.errors import StoreError

    await frozen_chains(fresh, ["n1", "n2"])
    bucket = bucket_url[len("s3://") :].split("/")[0]
    dest = bucket_url + "-exports/nodelete"
    deny_put = False

    async def refuse(request: Any) -> Any:
        # DeleteObjects names its keys in the body: refuse every delete (this export drops nothing)
        deleting = request.method == "DELETE" or (request.method == "POST" and "delete" in request.params)
        if deleting or (deny_put and request.method == "PUT" and "-exports/nodelete" in request.path):
            return s3_error(403, "AccessDenied", "no permission on the destination")
        return None

    async with FaultProxy.for_server(s3_server) as proxy:
        proxy.rule = refuse
        summary = await export(bucket_url, dest, endpoint_url=proxy.endpoint, workers=0)
        assert summary.ok and summary.exported == 2, format_summary(summary)
        assert summary.requests.get("dest:DeleteObjects", 0) >= 1  # the claim's delete, counted
        assert len(await read_manifests(dest, endpoint_url=proxy.endpoint)) == 1
        claims = f"t-exports/nodelete/{export_module._LOCK}/"
        assert s3_client.list_objects_v2(Bucket=bucket, Prefix=claims).get("KeyCount", 0) == 1  # left to expire
        with pytest.raises(ValueError, match="another export"):
            await export(bucket_url, dest, endpoint_url=proxy.endpoint, workers=0)
        monkeypatch.setattr(export_module, "CLAIM_LEASE", -1.0)  # the left claims are past the lease
        again = await export(bucket_url, dest, endpoint_url=proxy.endpoint, workers=0)
        assert again.ok and again.already_exported == 2, format_summary(again)
        deny_put = True
        with pytest.raises(StoreError) as refused:
            await export(bucket_url, dest + "2", endpoint_url=proxy.endpoint, workers=0)
        assert refused.value.operation == "PUT" and "AccessDenied" in str(refused.value)


def _spawn_children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
                if parent == pid:
                    with open(f"/proc/{name}/cmdline", "rb") as handle:
                        if b"spawn_main" in handle.read():
                            out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


@MOTO
async def test_export_workers_die_with_an_export_killed_while_they_start(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    """A SIGKILL of ``s3capture export`` while its pool workers still start (spawn re-imports)
    left them running for good: ``_init_worker`` read ``os.getppid()`` after the imports, already
    1 when the parent had died, so the watchdog watched pid 1, and the workers published the shards
    queued to them after the kill, over a re-run's files (a tester's repro: rollouts dropped by the
    re-run ended in no shard). The parent now passes its own pid."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    writer = fresh()
    for i in range(16):
        await put_chain(writer, f"r{i:02d}", 3)
        await writer.freeze(f"r{i:02d}")
    dest = tmp_path / "dest"
    command = [
        sys.executable,
        "-m",
        "s3capture.cli",
        "export",
        bucket_url,
        "--out",
        str(dest),
        "--workers",
        "2",
        "--shard-rollouts",
        "2",
        "--no-progress",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no workers started"
            workers = _spawn_children(proc.pid)
            time.sleep(0.005)  # noqa: ASYNC251 - a tight poll, to kill while the workers start
        os.kill(proc.pid, signal.SIGKILL)  # the export process alone (the OOM killer)
        proc.wait()
        before = set(os.listdir(dest))
        await asyncio.sleep(5)
        late = sorted(set(os.listdir(dest)) - before)
        left = [pid for pid in workers if process_alive(pid)]
        assert not left and not [n for n in late if n.endswith(".manifest.json")], (
            f"5 s after the export process was killed: workers alive {left}, shards published since: {late}"
        )
    finally:
        for pid in workers:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_a_worker_publishes_only_while_its_export_holds_the_folder(tmp_path: Path) -> None:
    """The last guard against a worker that outlived its export (a Ray task, a worker that missed
    its watchdog): a local shard is published only while the folder's lock is held under the
    token of the export the worker works for."""
    from s3capture.errors import StoreError
    from s3capture.export import _LocalDestination

    folder = tmp_path / "out"
    parent = _LocalDestination(str(folder))
    await parent.lock()
    worker = _LocalDestination(str(folder), owner=parent.token)
    await worker.publish_bytes("_part-00000.manifest.json", b"{}")  # its export holds the folder
    assert (folder / "_part-00000.manifest.json").exists()
    await parent.close()  # the export ended (a SIGKILL releases the flock the same way)
    with pytest.raises(StoreError, match="shard not published"):
        await worker.publish_bytes("_part-00001.manifest.json", b"{}")
    rerun = _LocalDestination(str(folder))
    await rerun.lock()  # another export took the folder over
    try:
        with pytest.raises(StoreError, match="shard not published"):
            await worker.publish_bytes("_part-00001.manifest.json", b"{}")
        assert sorted(os.listdir(folder)) == [".s3capture-export.lock", "_part-00000.manifest.json"]  # no temp left
        await _LocalDestination(str(folder), owner=rerun.token).publish_bytes("_part-00001.manifest.json", b"{}")
    finally:
        await rerun.close()


@MOTO
async def test_a_killed_worker_stops_the_export_with_a_run_failure_and_a_rerun_resumes(
    fresh: Any, bucket_url: str, tmp_path: Path, s3_server: Any
) -> None:
    """A local-engine worker killed mid-export (as the out-of-memory killer does) stopped the run
    with exit status 2 ("usage or setup error") and a hint about ``__main__`` guards irrelevant to
    the command line. It is a failed run (1), says what happened and that a re-run resumes; the
    re-run completes the export without a duplicate."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    from faultproxy import FaultProxy

    ids = [f"w{i:02d}" for i in range(24)]
    await frozen_chains(fresh, ids)
    dest = tmp_path / "dest"
    async with FaultProxy.for_server(s3_server) as proxy:

        async def slow(request: Any) -> Any:
            if request.method == "GET" and not request.is_list:
                await asyncio.sleep(0.05)  # the export lasts long enough to lose a worker midway
            return None

        proxy.rule = slow
        command = [sys.executable, "-m", "s3capture.cli", "export", bucket_url, "--out", str(dest)]
        command += ["--endpoint", proxy.endpoint, "--workers", "2", "--shard-rollouts", "2", "--concurrency", "1"]
        proc = subprocess.Popen(command + ["--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while not (dest.is_dir() and any(name.endswith(".manifest.json") for name in os.listdir(dest))):
                assert proc.poll() is None and time.monotonic() < deadline, "no shard was published"
                await asyncio.sleep(0.02)
            workers = _spawn_children(proc.pid)
            assert workers
            os.kill(workers[0], signal.SIGKILL)
            while proc.poll() is None:
                assert time.monotonic() < deadline, "the export did not end after losing a worker"
                await asyncio.sleep(0.05)
            err = proc.stderr.read().decode() if proc.stderr else ""
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        assert proc.returncode == 1, err
        assert "export worker process died" in err and "a re-run resumes" in err and "Traceback" not in err, err
        assert "The shards published before are durable" in err
        again = await export(bucket_url, str(dest), endpoint_url=proxy.endpoint, workers=0)
    assert again.ok, format_summary(again)
    rows = rows_of(dest)
    assert sorted(row["rollout_id"] for row in rows) == ids  # every rollout once


async def test_an_export_that_locked_a_lock_file_a_failed_export_removed_takes_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed export removes the lock file it created before it releases its ``flock``. An export
    that had opened that file just before got its ``flock`` on the removed file, and a third export
    then created a new lock file and locked that too: two exports held one folder, and the
    second's start-of-run scan could remove the third's data file before its manifest was written.
    Found by a concurrency breaker; the window between open and flock is widened with a sleep."""
    import fcntl
    import threading

    from s3capture.export import destinations

    folder = str(tmp_path / "out")
    first = destinations._LocalDestination(folder)
    await first.lock()
    real_flock, opened = fcntl.flock, threading.Event()

    def slow_flock(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_EX and threading.current_thread().name == "second":
            opened.set()
            time.sleep(0.5)  # the second export has opened the lock file; the first fails meanwhile
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", slow_flock)
    second = destinations._LocalDestination(folder)
    outcome: dict[str, Any] = {}

    def take() -> None:
        try:
            asyncio.run(second.lock())
            outcome["locked"] = True
        except ValueError as error:
            outcome["refused"] = error

    thread = threading.Thread(target=take, name="second")
    thread.start()
    assert await asyncio.to_thread(opened.wait, 10)
    await first.close(failed=True)  # the first export failed: its folder and lock file go
    await asyncio.to_thread(thread.join, 10)
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert outcome == {"locked": True}
    held = os.fstat(second._lock.fileno())
    there = os.stat(os.path.join(folder, destinations._LOCK))
    assert (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)  # the lock file others will open
    third = destinations._LocalDestination(folder)
    with pytest.raises(ValueError, match="another export"):
        await third.lock()
    await second.close()
