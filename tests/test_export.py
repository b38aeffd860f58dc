"""``s3capture export``: captured rollouts to Parquet / Gym JSONL shards, resumable (docs/export.md).

Against real local servers: rollouts captured from the shared example files the way the demo's
model server does (full and delta prompts), a synthetic delta chain, and rollouts that must be
masked (a conflict, a dangling intent, a marker). Every exported trajectory's ``token_ids`` equals
the contiguous chain rebuilt from the snapshot's entries (``cumulative_prompt``) and NeMo Gym's own
consumer output; its loss mask and log-probabilities sit exactly on the generated tokens; no masked
rollout is written as trainable. Resume: an export killed with SIGKILL between shards (a test hook
holds it there) and run again gives exactly the rows of an uninterrupted export, and ``--drop``
dropped only rollouts of durable shards. The writer's limits (row groups, one token id type per export) and the
command line's usage errors are checked without a server.
"""

from __future__ import annotations

import asyncio
import collections
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gymcompat import running_under_ci  # noqa: E402
from helpers import capture_chains, put_chain, simple_entry, split_bucket_url  # noqa: E402
from test_read_only import read_only  # noqa: E402,F401 - the fixture: a bucket whose reader may only GET and LIST
from s3capture.cli import main  # noqa: E402
from s3capture.export import (  # noqa: E402
    HOLD_ENV,
    ExportJob,
    _Built,
    _LocalDestination,
    _ParquetWriter,
    export,
    format_summary,
    read_manifests,
)

from helpers import EXAMPLE_DATA  # noqa: E402

DATA = EXAMPLE_DATA
EXAMPLES = ("competitive_coding.jsonl", "hermes_math.jsonl")
MASKED = {"bad-conflict": "conflicting_payloads", "bad-intent": "dangling_intent", "bad-marker": "marked_incomplete"}


def example_paths() -> list[Path]:
    paths = [DATA / name for name in EXAMPLES]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        message = f"{missing[0]} is missing (tests read ../shared/data/gym-example-rollouts beside the checkout, or S3CAPTURE_EXAMPLE_DATA)"
        if running_under_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return paths


async def capture_examples(store: Any) -> list[str]:
    """Replay the example files' calls through ``store`` as the demo's model server does (resolve,
    begin_call, put); every other rollout stores RESOLVED prompts as deltas."""
    from s3capture.demo import _serve_call
    from s3capture.replay import load_rollouts

    ids = []
    for index, rollout in enumerate(load_rollouts(example_paths())):
        for call in rollout.calls:
            await _serve_call(store, 0, rollout.rollout_id, call, index % 2 == 0, None)
        ids.append(rollout.rollout_id)
    return ids


async def capture_masked(fresh: Any) -> None:
    """Three rollouts whose snapshots must be masked: a conflict, a dangling intent, a marker."""
    one, two = fresh(), fresh()
    await one.put(simple_entry("bad-conflict", "c1"))
    await two.put(simple_entry("bad-conflict", "c1", generation=[90, 91]))  # same call id, other payload
    await one.put(simple_entry("bad-intent", "c1"))
    await one.begin_call("bad-intent", "c2")
    await one.put(simple_entry("bad-marker", "c1"))
    await one.mark_incomplete("bad-marker", "c1")


async def capture_all(fresh: Any) -> tuple[list[str], dict[str, Any]]:
    """Capture and freeze everything; ``(trainable ids, snapshot by rollout id)``."""
    writer, builder = fresh(), fresh()
    ids = await capture_examples(writer)
    await put_chain(writer, "chain-delta", 5)
    ids.append("chain-delta")
    await capture_masked(fresh)
    snapshots = {}
    for rid in ids + sorted(MASKED):
        snapshots[rid] = await builder.freeze(rid)
    for rid in ids:
        assert not snapshots[rid].incomplete, (rid, snapshots[rid].reasons)
    for rid, reason in MASKED.items():
        assert snapshots[rid].incomplete and any(r.startswith(reason) for r in snapshots[rid].reasons)
    return ids, snapshots


def read_rows(dest: str, s3_client: Any = None) -> list[dict]:
    """Every row of the durable shards of ``dest`` (Parquet), in shard order."""
    rows: list[dict] = []
    for manifest in _manifests(dest):
        if manifest.data is None:
            continue
        if dest.startswith("s3://"):
            bucket, prefix = split_bucket_url(dest)
            body = s3_client.get_object(Bucket=bucket, Key=f"{prefix.rstrip('/')}/{manifest.data}")["Body"].read()
            table = pq.read_table(io.BytesIO(body))
        else:
            table = pq.read_table(os.path.join(dest, manifest.data))
        assert table.num_rows == manifest.rows
        rows.extend(table.to_pylist())
    return rows


def _manifests(dest: str) -> list[Any]:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # its own event loop, whatever the caller runs
        return pool.submit(asyncio.run, read_manifests(dest)).result()


def expected_chain(row: dict, snapshot: Any) -> tuple[list[int], list[int], list[float]]:
    """Token ids, loss mask and log-probabilities of the trajectory through ``row['call_ids']``,
    rebuilt from the snapshot's entries with ``cumulative_prompt`` (independent of any builder)."""
    from s3capture.trajectory import cumulative_prompt

    by_id = {entry.model_call_id: entry for entry in snapshot.entries}
    last = by_id[row["call_ids"][-1]]
    tokens = cumulative_prompt(last, by_id) + list(last.generation_token_ids)
    mask = [0] * len(tokens)
    logprobs = [0.0] * len(tokens)
    for cid in row["call_ids"]:
        entry = by_id[cid]
        start = len(cumulative_prompt(entry, by_id))
        assert tokens[start : start + len(entry.generation_token_ids)] == list(entry.generation_token_ids)
        for offset, logprob in enumerate(entry.generation_log_probs):
            mask[start + offset] = 1
            logprobs[start + offset] = logprob
    return tokens, mask, logprobs


async def gym_sequences(bucket_url: str, rollout_ids: list[str]) -> dict[str, dict]:
    """NeMo Gym's own consumer on each rollout: ``trajectories_from_source`` result by rollout id."""
    pytest.importorskip("nemo_gym")
    from nemo_gym.token_id_capture.consumer import trajectories_from_source

    from s3capture.store import S3TokenStore

    out = {}
    async with S3TokenStore(bucket_url, entry_type="gym") as source:
        for rid in rollout_ids:
            out[rid] = await trajectories_from_source(rid, source)
    return out


def gym_tokens(result: dict) -> list[int]:
    items = [i for i in result["rebuilt_response"]["output"] if i.get("generation_token_ids") is not None]
    return list(items[-1]["prompt_token_ids"]) + list(items[-1]["generation_token_ids"])


def check_rows(rows: list[dict], ids: list[str], snapshots: dict[str, Any], gym: dict[str, dict]) -> None:
    """Every trainable rollout is there, once per chain, equal to its rebuilt chain and to Gym's output."""
    assert {row["rollout_id"] for row in rows} == set(ids)
    keys = [(row["rollout_id"], row["chain_id"]) for row in rows]
    assert len(keys) == len(set(keys)), "a trajectory was written twice"
    for row in rows:
        snapshot = snapshots[row["rollout_id"]]
        assert not row["masked"] and row["mask_reasons"] == []
        assert (row["snapshot_id"], row["version"]) == (snapshot.snapshot_id, snapshot.version)
        tokens, mask, logprobs = expected_chain(row, snapshot)
        assert row["token_ids"] == tokens
        assert row["loss_mask"] == mask
        assert row["logprobs"] == pytest.approx(logprobs, abs=1e-6)
        assert row["num_calls"] == len(row["call_ids"])
        assert json.loads(row["metrics"]) is not None
        if row["chain_id"] == "main" or len([r for r in rows if r["rollout_id"] == row["rollout_id"]]) == 1:
            assert row["token_ids"] == gym_tokens(gym[row["rollout_id"]])


# --------------------------------------------------------------------------- against a server
async def test_export_writes_each_trainable_chain_once_and_never_a_masked_one(
    fresh: Any, bucket_url: str, s3_client: Any, tmp_path: Path
) -> None:
    ids, snapshots = await capture_all(fresh)
    gym = await gym_sequences(bucket_url, ids)
    bucket, _ = split_bucket_url(bucket_url)
    for dest in (str(tmp_path / "out"), f"s3://{bucket}/exports/run1"):
        summary = await export(bucket_url, dest, workers=0, min_age=0, shard_rollouts=4)
        assert summary.ok, format_summary(summary)
        assert summary.exported == len(ids) and summary.masked_excluded == len(MASKED) and summary.masked_written == 0
        assert summary.failed == summary.skipped == 0
        assert set(summary.masked_reasons) >= set(MASKED.values())
        rows = await asyncio.to_thread(read_rows, dest, s3_client)
        check_rows(rows, ids, snapshots, gym)
        assert not {row["rollout_id"] for row in rows} & set(MASKED)
        manifests = await read_manifests(dest)
        assert [m.shard for m in manifests] == list(range(len(manifests))) and len(manifests) == -(-(len(ids) + 3) // 4)
        recorded = {r.rollout_id: r for m in manifests for r in m.rollouts}
        assert set(recorded) == set(ids) | set(MASKED)
        for rid in MASKED:
            assert recorded[rid].masked and not recorded[rid].written and recorded[rid].rows == 0
            assert any(reason.startswith(MASKED[rid]) for reason in recorded[rid].mask_reasons)
        # Read-only: the exporter only listed and read the source (no PUT, no DELETE): one LIST page
        # for the listing (each rollout is read from it, never listed again), one GET per entry
        # object (the conflict's two payloads, of which its snapshot keeps neither) and one of each
        # rollout's sealed manifest.
        assert {k for k in summary.requests if k.startswith("source:")} == {"source:ListObjectsV2", "source:GetObject"}
        entry_objects = sum(len(snapshots[rid].entries) for rid in ids + sorted(MASKED)) + 2
        assert summary.requests["source:GetObject"] == entry_objects + len(ids) + len(MASKED)
        # the root's one page, and the LIST after its last key that confirms its end
        assert summary.requests["source:ListObjectsV2"] == 2
        if dest.startswith("s3://"):  # one PUT per data file and one per manifest, and the export's claim
            assert summary.requests["dest:PutObject"] == 2 * len(manifests) + 1

    # Run again: everything is already there at the same snapshot; nothing is read or written.
    again = await export(bucket_url, dest, workers=0, min_age=0, shard_rollouts=4)
    assert again.already_exported == len(ids) + len(MASKED) and again.exported == 0 and again.shards_written == 0
    assert "source:GetObject" not in again.requests
    assert again.requests.get("dest:PutObject", 0) == (1 if dest.startswith("s3://") else 0)  # only the claim
    assert await asyncio.to_thread(read_rows, dest, s3_client) == rows


async def test_an_s3_destination_scan_reads_its_shard_manifests_in_one_wave(
    fresh: Any, bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed export to ``s3://`` reads every shard manifest before its first rollout; one GET
    after another, a destination of 1,000 shards cost 1,000 round trips (an audit, 2026-12-04)."""
    from helpers import RequestRecorder, round_trips

    from s3capture.export.destinations import _S3Destination

    writer = fresh()
    for rid in ("a", "b", "c", "d", "e"):
        await put_chain(writer, rid, 2)
        await writer.freeze(rid)
    bucket, _ = split_bucket_url(bucket_url)
    dest = f"s3://{bucket}/exports/scan"
    summary = await export(bucket_url, dest, workers=0, min_age=0, shard_rollouts=1)
    assert summary.ok and summary.shards_written == 5, format_summary(summary)
    destination = _S3Destination(dest, endpoint_url=None, transport=None)
    try:
        rec = await RequestRecorder.attach(destination)
        existing = await destination.scan()
        assert sorted(r.rollout_id for m in existing.manifests for r in m.rollouts) == ["a", "b", "c", "d", "e"]
        assert rec.counts() == {"ListObjectsV2": 2, "GetObject": 5}
        # the LIST, the LIST that confirms its end, then the five manifest GETs together
        assert round_trips(rec) == 3, rec.sequence
        # In batches of 2: three waves, and still every manifest.
        import s3capture.export.destination_s3 as destination_s3

        monkeypatch.setattr(destination_s3, "_SCAN_BATCH", 2)
        rec = await RequestRecorder.attach(destination)
        existing = await destination.scan()
        assert sorted(r.rollout_id for m in existing.manifests for r in m.rollouts) == ["a", "b", "c", "d", "e"]
        assert rec.counts() == {"ListObjectsV2": 2, "GetObject": 5}
        assert round_trips(rec) == 5, rec.sequence
    finally:
        await destination.close()


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_masked_include_builtin_builder_and_gym_jsonl(fresh: Any, bucket_url: str, tmp_path: Path) -> None:
    ids, snapshots = await capture_all(fresh)
    gym = await gym_sequences(bucket_url, ids + sorted(MASKED))

    # Parquet, masked rollouts written with masked=true and their reasons, the built-in builder:
    # its chains equal the entries' and Gym's.
    dest = str(tmp_path / "parquet")
    summary = await export(bucket_url, dest, workers=0, min_age=0, masked="include", build_with="builtin")
    assert summary.masked_written == len(MASKED) and summary.exported == len(ids), format_summary(summary)
    rows = read_rows(dest)
    masked_rows = [row for row in rows if row["masked"]]
    assert {row["rollout_id"] for row in masked_rows} == set(MASKED)
    for row in masked_rows:
        assert any(reason.startswith(MASKED[row["rollout_id"]]) for reason in row["mask_reasons"])
    trainable = [row for row in rows if not row["masked"]]
    assert not {row["rollout_id"] for row in trainable} & set(MASKED)
    check_rows(trainable, ids, snapshots, gym)

    # Gym JSONL: each line is the dict Gym's consumer returns for the rollout (plus s3capture's reasons).
    folder = tmp_path / "jsonl"
    summary = await export(
        bucket_url,
        str(folder),
        workers=0,
        min_age=0,
        format="gym-jsonl",
        masked="include",
        build_with="gym",
        shard_rollouts=5,
    )
    assert summary.ok and summary.exported == len(ids) and summary.masked_written == len(MASKED)
    lines = [json.loads(line) for part in sorted(folder.glob("part-*.jsonl")) for line in part.read_text().splitlines()]
    assert sorted(line["rollout_id"] for line in lines) == sorted(ids + list(MASKED))
    for line in lines:
        extra = line.pop("_s3capture")
        assert extra["masked"] == line["mask_sample"]
        assert line == json.loads(json.dumps(gym[line["rollout_id"]]))
        if line["rollout_id"] in MASKED:
            assert line["mask_sample"] is True
            assert any(r.startswith(MASKED[line["rollout_id"]]) for r in extra["mask_reasons"])


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_open_rollouts_wait_for_min_age_and_freeze_makes_them_droppable(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    writer = fresh()
    await put_chain(writer, "open-a", 3)
    await put_chain(writer, "open-b", 2)
    young = await export(bucket_url, str(tmp_path / "young"), workers=0, min_age=3600)
    assert young.skipped == 2 and young.skipped_reasons == {"not_quiescent": 2} and young.exported == 0
    # Nothing to read in the destination (pyarrow fails on it): the summary says so, and what to do.
    text = format_summary(young)
    assert "nothing to read: no row was written, and the destination holds no data file" in text, text
    assert "2 open rollouts have not been quiet for --min-age: --min-age 0 takes them now" in text, text
    young.skipped_reasons = {"not_quiescent": 1}  # a new user (2026-12-04): "1 open rollouts have"
    assert "1 open rollout has not been quiet for --min-age: --min-age 0 takes it now" in format_summary(young)

    # A frozen rollout written to after its freeze (a late marker) is not sealed: skipped, unread,
    # until --freeze seals it again (then masked, by the marker).
    await put_chain(writer, "late", 2)
    await fresh().freeze("late")
    await writer.mark_incomplete("late", "call-001")
    unsealed_frozen = await export(bucket_url, str(tmp_path / "late"), workers=0, states=["frozen"])
    assert unsealed_frozen.skipped_reasons == {"not_sealed": 1} and "source:GetObject" not in unsealed_frozen.requests
    resealed = await export(bucket_url, str(tmp_path / "late"), workers=0, states=["frozen"], freeze=True)
    assert resealed.masked_excluded == 1 and resealed.masked_reasons.get("marked_incomplete") == 1
    assert "1 masked rollout was left out: --masked include writes them too" in format_summary(resealed)
    # Run again: the masked rollout left out is "already exported" with no rows, and says so (a
    # walkthrough read "already exported 41" over a destination of 39 rows).
    again = await export(bucket_url, str(tmp_path / "late"), workers=0, states=["frozen"], freeze=True)
    assert (again.already_exported, again.already_left_out, again.masked_excluded) == (1, 1, 0)
    assert "already exported 1 (1 of them masked and left out: no rows)" in format_summary(again)
    # by reason class, with a colon: "roots 1" read as "one root" for roots:2 (a walkthrough)
    line = next(x for x in format_summary(resealed).splitlines() if x.startswith("masked rollouts by reason"))
    assert line.startswith("masked rollouts by reason class (a rollout may have several): ") and (
        "marked_incomplete: 1" in line
    )
    assert "1 shard (" in format_summary(resealed) and "manifests only, no data file" in format_summary(resealed)
    # A re-run finds that rollout recorded (a manifest, no data file): still nothing to read.
    rerun = await export(bucket_url, str(tmp_path / "late"), workers=0, states=["frozen"], freeze=True)
    assert rerun.already_exported == 1 and rerun.data_files == 0
    assert "nothing to read" in format_summary(rerun)
    await fresh().delete(["late"])

    # Quiescent and read unsealed: exported, but a drop could not consume it (no fence): not dropped.
    # (What the hint above says: --min-age 0 takes them, into the same folder.)
    unsealed = await export(bucket_url, str(tmp_path / "young"), workers=0, min_age=0, drop=True)
    assert unsealed.exported == 2 and unsealed.dropped == 0 and unsealed.not_dropped == 2
    assert unsealed.data_files == 1 and "nothing to read" not in format_summary(unsealed)
    assert {"source:PutObject", "source:DeleteObject", "source:DeleteObjects"}.isdisjoint(unsealed.requests)
    assert all(not r.sealed for m in await read_manifests(str(tmp_path / "young")) for r in m.rollouts)

    # --freeze: frozen first, exported from the sealed snapshot, then dropped.
    frozen = await export(bucket_url, str(tmp_path / "frozen"), workers=0, min_age=0, freeze=True, drop=True)
    assert frozen.exported == 2 and frozen.dropped == 2, format_summary(frozen)
    states = {info.rollout_id: info.state async for info in fresh().rollouts()}
    assert states == {"open-a": "retired", "open-b": "retired"}
    assert read_rows(str(tmp_path / "frozen")) == read_rows(str(tmp_path / "young"))


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_a_rerun_with_freeze_seals_and_drops_what_an_earlier_run_exported_unsealed(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    """Exported read unsealed (open), the rollouts are "already exported" in a re-run. Under
    --drop alone they are reported not dropped (with what to do); with --freeze they are frozen,
    found unchanged, and dropped, without being exported again. One written to between the
    listing and that freeze is skipped, frozen, and the next run exports its sealed snapshot."""
    from s3capture.store import S3TokenStore

    writer = fresh()
    await put_chain(writer, "unsealed-a", 3)
    await put_chain(writer, "unsealed-b", 2)
    await put_chain(writer, "unsealed-c", 2)
    folder = str(tmp_path / "out")
    first = await export(bucket_url, folder, workers=0, min_age=0)
    assert first.exported == 3 and first.dropped == first.not_dropped == 0
    rows = read_rows(folder)

    drop_only = await export(bucket_url, folder, workers=0, min_age=0, drop=True)
    assert drop_only.already_exported == 3 and drop_only.exported == 0
    assert drop_only.dropped == 0 and drop_only.not_dropped == 3, format_summary(drop_only)
    assert all("--freeze" in line for line in drop_only.not_dropped_examples)
    assert {"source:PutObject", "source:DeleteObject", "source:DeleteObjects"}.isdisjoint(drop_only.requests)

    # unsealed-c gets a late marker after the listing, just before the export freezes it.
    freeze = S3TokenStore.freeze

    async def late_write_then_freeze(store: Any, rollout_id: str) -> Any:
        if rollout_id == "unsealed-c":
            await store.mark_incomplete(rollout_id, "late-call")
        return await freeze(store, rollout_id)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(S3TokenStore, "freeze", late_write_then_freeze)
        sealed = await export(bucket_url, folder, workers=0, min_age=0, freeze=True, drop=True)
    assert sealed.ok and sealed.already_exported == 2 and sealed.exported == 0, format_summary(sealed)
    assert sealed.dropped == 2 and sealed.not_dropped == 0
    assert sealed.skipped_reasons == {"changed_since_listing": 1}
    assert read_rows(folder) == rows  # nothing exported twice
    assert len(await read_manifests(folder)) == 1
    states = {info.rollout_id: info.state async for info in fresh().rollouts()}
    assert states == {"unsealed-a": "retired", "unsealed-b": "retired", "unsealed-c": "frozen"}

    # The next run reads unsealed-c's sealed snapshot: masked by the marker, superseding its rows.
    after = await export(bucket_url, folder, workers=0, min_age=0, freeze=True, drop=True)
    assert after.changed_since_export == 1 and after.masked_written == 1 and after.dropped == 0, format_summary(after)
    # Counted under "not dropped", with why (a breaker: the drop line read "not dropped: 0").
    assert after.not_dropped == 1 and after.not_dropped_examples[0].startswith("unsealed-c: masked ("), format_summary(
        after
    )
    assert after.not_dropped_examples[0].endswith("kept as evidence")


async def test_current_snapshots_name_the_latest_export_of_an_id_deleted_and_captured_again(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    """A breaker: export a trainable 5-call rollout (version 5), delete the id, capture it again
    with 1 call (trainable; or with a marker, masked), export again. The highest version per
    rollout_id then picked the deleted generation's rows; current_snapshots names the new one."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    from s3capture.export import current_snapshots

    folder = str(tmp_path / "out")
    for rid in ("again", "again-masked", "kept"):
        await put_chain(fresh(), rid, 5)
        await fresh().freeze(rid)
    first = await export(bucket_url, folder, workers=0)
    assert first.exported == 3
    old = await current_snapshots(folder)
    await fresh().delete(["again", "again-masked"])
    await put_chain(fresh(), "again", 1)
    await put_chain(fresh(), "again-masked", 1)
    await fresh().mark_incomplete("again-masked", "lost-call")
    for rid in ("again", "again-masked"):
        await fresh().freeze(rid)
    second = await export(bucket_url, folder, workers=0)
    assert second.changed_since_export == 2, format_summary(second)
    latest = await current_snapshots(folder)
    assert latest["kept"] == old["kept"] and latest["again"] != old["again"] != latest["again-masked"]
    assert latest == {
        info.rollout_id: info.snapshot_id
        async for info in fresh().rollouts()
        if info.rollout_id in ("again", "again-masked", "kept")
    }
    # The filter docs/export.md shows: each rollout's latest export only.
    table = ds.dataset(folder, format="parquet").to_table()
    keys = pc.binary_join_element_wise(table["rollout_id"], table["snapshot_id"], "\t")
    latest_rows = pc.is_in(keys, value_set=pa.array([f"{r}\t{s}" for r, s in latest.items()]))
    assert {(row["rollout_id"], row["version"], row["masked"]) for row in table.filter(latest_rows).to_pylist()} == {
        ("kept", 5, False),
        ("again", 1, False),
        ("again-masked", 2, True),  # written masked over its earlier trainable rows
    }
    table = table.filter(pc.and_(latest_rows, pc.invert(table["masked"])))  # never train on masked rows
    assert {(row["rollout_id"], row["version"]) for row in table.to_pylist()} == {("kept", 5), ("again", 1)}
    assert await current_snapshots(str(tmp_path / "nothing-here")) == {}


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_ids_and_prefix_select_rollouts(fresh: Any, bucket_url: str, tmp_path: Path) -> None:
    writer, builder = fresh(), fresh()
    for rid in ("team-a-1", "team-a-2", "team-b-1"):
        await put_chain(writer, rid, 2)
        await builder.freeze(rid)
    by_prefix = await export(bucket_url, str(tmp_path / "p"), workers=0, prefix="team-a-")
    assert sorted(row["rollout_id"] for row in read_rows(str(tmp_path / "p"))) == ["team-a-1", "team-a-2"]
    assert by_prefix.listed == 2
    by_ids = await export(bucket_url, str(tmp_path / "i"), workers=0, ids=["team-b-1", "team-a-2", "nobody"])
    assert sorted(row["rollout_id"] for row in read_rows(str(tmp_path / "i"))) == ["team-a-2", "team-b-1"]
    assert by_ids.skipped_reasons == {"not_listed": 1} and by_ids.skipped_examples["not_listed"][0].startswith("nobody")
    # The CLI's --state repeats as well as taking a comma-separated list (a user who learnt it from
    # `ls --state frozen --state open` once exported nothing: only the last one counted).
    await put_chain(writer, "team-c-open", 2)
    out = str(tmp_path / "states")
    status = await asyncio.to_thread(
        main,
        [
            "export",
            bucket_url,
            "--out",
            out,
            "--state",
            "frozen",
            "--state",
            "open",
            "--min-age",
            "0",
            "--workers",
            "0",
        ],
    )
    assert status == 0
    assert sorted(row["rollout_id"] for row in read_rows(out)) == ["team-a-1", "team-a-2", "team-b-1", "team-c-open"]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [({"min_age": float("nan")}, ValueError, "min_age must be >= 0"), ({"ids": "r1"}, TypeError, "single str")],
)
async def test_export_refuses_a_nan_min_age_and_ids_given_as_one_str(
    tmp_path: Path, options: dict, error: type, match: str
) -> None:
    # NaN compares false with every age (every open rollout would count as quiescent); a str of
    # ids would be read as a set of one-character ids. Both are refused before any request.
    with pytest.raises(error, match=match):
        await export("s3://no-such-bucket/root", str(tmp_path / "out"), workers=0, **options)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_a_destination_takes_one_source_root(
    fresh: Any, bucket_url: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Resume keys rows by rollout id. Two roots' exports in one folder (every run's ids alike:
    "r-0", ...) mixed silently, and the second root's rollouts read as "changed since their export".
    Another root is refused before anything is written; the same root (a trailing slash aside) resumes."""

    other_url = bucket_url + "-other"
    for url in (bucket_url, other_url):
        await capture_chains(url)
    out = tmp_path / "out"
    first = await export(bucket_url, str(out), workers=0)
    assert first.ok and first.exported == 1
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match="holds an export of .* one destination takes one source root"):
        await export(other_url, str(out), workers=0)
    assert sorted(p.name for p in out.iterdir()) == before
    again = await export(bucket_url + "/", str(out), workers=0)
    assert again.ok and again.exported == 0 and again.already_exported == 1, format_summary(again)
    # The CLI: one line, exit status 2.
    code = await asyncio.to_thread(main, ["export", other_url, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "holds an export of" in err and "Traceback" not in err, err

    # The same bucket and prefix on another endpoint (self-hosted stores reuse bucket names) is
    # another root too; a manifest written before the endpoint was recorded is taken at its word.
    (manifest_path,) = out.glob("_part-*.manifest.json")
    recorded = json.loads(manifest_path.read_text())
    assert recorded["source_endpoint"] == os.environ["AWS_ENDPOINT_URL"].rstrip("/").lower()
    manifest_path.write_text(json.dumps({**recorded, "source_endpoint": "http://other-s3.example:9000"}))
    with pytest.raises(ValueError, match="at http://other-s3.example:9000 .* one destination takes one source root"):
        await export(bucket_url, str(out), workers=0)
    manifest_path.write_text(json.dumps({k: v for k, v in recorded.items() if k != "source_endpoint"}))
    assert (await export(bucket_url, str(out), workers=0)).already_exported == 1


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_a_destination_holding_files_no_export_wrote_is_refused(
    fresh: Any, bucket_url: str, s3_client: Any, tmp_path: Path
) -> None:
    """A new user exported into a folder holding an unrelated ``old.parquet``: "result: OK", and
    ``pq.read_table(DEST)`` then returned old.parquet's rows and column only. Files (and folders) a
    dataset reader would read that no export wrote are refused before anything is written; hidden
    and ``_``-prefixed names, which those readers skip, are not."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    await capture_chains(bucket_url)
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), out / "old.parquet")
    with pytest.raises(ValueError, match=r"holds files no export wrote \(old\.parquet\)"):
        await export(bucket_url, str(out), workers=0)
    assert not list(out.glob("part-*"))
    (out / "old.parquet").unlink()
    (out / "more").mkdir()
    with pytest.raises(ValueError, match=r"holds files no export wrote \(more/\)"):
        await export(bucket_url, str(out), workers=0)
    (out / "more").rmdir()
    # A folder named like a data file (a breaker, 2026-12-04): pyarrow read its Parquet with the
    # export's, so every row came twice; one named like the shard about to be published failed
    # every rollout, and every re-run, with IsADirectoryError.
    for name in ("part-00009.parquet", "part-00000.parquet"):
        (out / name).mkdir()
        pq.write_table(pa.table({"x": [1]}), out / name / "inner.parquet")
        with pytest.raises(ValueError, match=rf"holds files no export wrote \({name.replace('.', '[.]')}/\)"):
            await export(bucket_url, str(out), workers=0)
        shutil.rmtree(out / name)
    # A data file's name and a final newline is no export's: '$' matched before it, so the name
    # read as a shard of an earlier export (a breaker's finding in the same class, 2026-12-04).
    stray = out / "part-00003.parquet\n"
    pq.write_table(pa.table({"x": [1]}), stray)
    with pytest.raises(ValueError, match=r"holds files no export wrote"):
        await export(bucket_url, str(out), workers=0)
    assert stray.exists() and not list(out.glob("part-*[0-9].parquet"))
    stray.unlink()
    (out / ".DS_Store").write_bytes(b"")
    (out / "_SUCCESS").write_bytes(b"")
    done = await export(bucket_url, str(out), workers=0)
    assert done.ok and done.exported == 1
    assert pq.read_table(out).num_rows == 1

    # An s3:// destination: any key under the prefix, at any depth, that a reader would read.
    bucket = bucket_url[len("s3://") :].split("/", 1)[0]
    s3_client.put_object(Bucket=bucket, Key="exports/notes/readme.txt", Body=b"x")
    with pytest.raises(ValueError, match=r"holds files no export wrote \(notes/\)"):
        await export(bucket_url, f"s3://{bucket}/exports", workers=0)
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="exports/").get("Contents", [])
    assert [item["Key"] for item in listed if "part-" in item["Key"]] == []
    s3_client.delete_object(Bucket=bucket, Key="exports/notes/readme.txt")
    s3_client.put_object(Bucket=bucket, Key="exports/part-00009.parquet/inner.parquet", Body=b"x")
    with pytest.raises(ValueError, match=r"holds files no export wrote \(part-00009[.]parquet/\)"):
        await export(bucket_url, f"s3://{bucket}/exports", workers=0)
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="exports/").get("Contents", [])
    assert [item["Key"] for item in listed] == ["exports/part-00009.parquet/inner.parquet"]  # kept, nothing added


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_an_export_that_reads_nothing_says_why(fresh: Any, bucket_url: str, tmp_path: Path) -> None:
    """A new user's typo'd or too-short root URL printed "exported 0 ... result: OK" with no reason,
    and a root whose rollouts were all dropped likewise. The summary now names the roots found
    inside the URL, and counts the rollouts left out by state."""
    from s3capture.store import S3TokenStore

    (snapshot,) = (await capture_chains(bucket_url)).values()
    assert (await export(bucket_url, str(tmp_path / "before"), workers=0)).exported == 1
    dropper = S3TokenStore(bucket_url)
    try:
        assert await dropper.drop("r-0", snapshot.snapshot_id, snapshot.version)
    finally:
        await dropper.close()
    # Into the folder of the export before the drop: it holds data, and the summary still says
    # what was not selected (a walkthrough: only a new folder's summary named the retired ones).
    text = format_summary(await export(bucket_url, str(tmp_path / "before"), workers=0))
    assert "1 retired rollouts were not selected (dropped or retired: their entries are gone)" in text, text
    assert "nothing to read" not in text
    parent = bucket_url.rsplit("/", 1)[0]
    summary = await export(parent, str(tmp_path / "a"), workers=0)
    assert summary.ok and summary.listed == 0 and summary.roots_below == [bucket_url]
    assert (
        f"no rollouts under {parent} (no rollout under its rollouts/ prefix); roots inside this URL (among its first 1,000 keys): {bucket_url}"
        in (format_summary(summary))
    )
    summary = await export(bucket_url, str(tmp_path / "b"), workers=0)
    assert summary.ok and summary.exported == 0 and summary.not_selected == {"retired": 1}
    text = format_summary(summary)
    assert "1 retired rollouts were not selected (dropped or retired: their entries are gone)" in text
    assert "no rollouts under" not in text
    # A typo in the root's last segment (run-43 for run-42) names the roots beside it (a new
    # user's walkthrough: ls, status and export printed nothing but zeros and OK).
    typo = bucket_url + "-typo"
    summary = await export(typo, str(tmp_path / "c"), workers=0)
    assert summary.ok and summary.listed == 0 and summary.roots_below == [] and summary.roots_beside == [bucket_url]
    assert f"roots beside this URL (among its parent's first 1,000 keys): {bucket_url}" in format_summary(summary)
    # A --prefix no id starts with (a breaker: "nothing to read" with no reason, result OK).
    hint = f"no rollout id under {bucket_url} starts with --prefix 'zzz', though the root holds rollouts"
    summary = await export(bucket_url, str(tmp_path / "d"), workers=0, prefix="zzz")
    assert summary.ok and summary.listed == 0 and not summary.root_empty
    assert hint in format_summary(summary)
    # Into an earlier export's folder, the usual resumable re-run, too (a second breaker).
    summary = await export(bucket_url, str(tmp_path / "before"), workers=0, prefix="zzz")
    assert summary.shards_existing and hint in format_summary(summary), format_summary(summary)


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
@pytest.mark.parametrize("how", ["file", "stdin"])
async def test_a_script_without_a_main_guard_is_told_so(
    s3_server: Any, fresh: Any, bucket_url: str, tmp_path: Path, how: str
) -> None:
    """Workers are spawned and re-import the calling script. A script that calls export() at top
    level (or one read from stdin, which cannot be re-imported) failed with "killed: out of
    memory?" first; it is now told what to do, and the re-imported copy starts no export."""

    await capture_chains(bucket_url)
    out = tmp_path / "out"
    script = (
        "import asyncio\n"
        "from s3capture.export import export\n"
        f"asyncio.run(export({bucket_url!r}, {str(out)!r}, workers=1))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env())
    if how == "file":
        path = tmp_path / "unguarded.py"
        path.write_text(script)
        command, stdin = [sys.executable, str(path)], None
    else:
        command, stdin = [sys.executable, "-"], script
    proc = await asyncio.to_thread(
        subprocess.run, command, input=stdin, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "no export worker process could start" in proc.stderr and "out of memory" not in proc.stderr, proc.stderr
    if how == "file":
        assert "export() was called while a spawned export worker re-imported the calling script" in proc.stderr
    assert not list(out.glob("part-*"))


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


async def _frozen_chains(fresh: Any, prefix: str, *, count: int, calls: int) -> None:
    """Rollouts ``<prefix>-0`` .. ``<prefix>-<count - 1>`` of ``calls`` chained calls each, frozen."""
    writer, builder = fresh(), fresh()
    for index in range(count):
        await put_chain(writer, f"{prefix}-{index}", calls)
        await builder.freeze(f"{prefix}-{index}")


async def _export_with_workers_started(script: Path, source: str, out: Path) -> subprocess.Popen:
    """Start ``script`` (which runs the CLI's ``main``) as ``export SOURCE --out OUT`` with two
    worker processes, in a session of its own; return once both workers exist."""
    command = [sys.executable, str(script), "export", source, "--out", str(out)]
    command += ["--workers", "2", "--shard-rollouts", "1", "--no-progress", "--min-age", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(_children(proc.pid)) < 2:  # the two workers (and the resource tracker, maybe)
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no two workers within 60 s: {proc.communicate(timeout=30)}")
        await asyncio.sleep(0.05)
    return proc


async def _signalled(proc: subprocess.Popen, signal_it: Callable[[], Awaitable[None]]) -> tuple[str, str]:
    """``signal_it()``, then the export's stdout and stderr once it ended (SIGKILL to its group if
    the test fails before)."""
    try:
        await signal_it()
        return await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads worker pids from /proc")
@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_ctrl_c_while_the_workers_start_prints_one_line_and_no_traceback(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    # A terminal's Ctrl-C reaches the whole process group, the workers included, which spend
    # seconds importing before they run anything (here: a script whose import as the workers'
    # __mp_main__ takes 3 s). They used to print KeyboardInterrupt tracebacks from inside
    # multiprocessing before the export's one-line message (a breaker's finding).
    await _frozen_chains(fresh, "int", count=2, calls=2)
    script = tmp_path / "run_export.py"
    script.write_text(
        "import sys, time\n"
        "if __name__ == '__mp_main__':\n"
        "    time.sleep(3)  # a worker's slow start-up\n"
        "from s3capture.cli import main\n"
        "if __name__ == '__main__':\n"
        "    sys.exit(main(sys.argv[1:]))\n"
    )
    proc = await _export_with_workers_started(script, bucket_url, tmp_path / "out")

    async def ctrl_c() -> None:
        await asyncio.sleep(0.5)  # inside the workers' 3 s start-up
        os.killpg(proc.pid, signal.SIGINT)

    out, err = await _signalled(proc, ctrl_c)
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert [line for line in err.splitlines() if line.strip()] == [
        line for line in err.splitlines() if "interrupted" in line
    ], err
    assert "resume" in err


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads worker pids from /proc")
@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_sigterm_ends_an_export_as_ctrl_c_does(fresh: Any, bucket_url: str, tmp_path: Path) -> None:
    # A new user's walkthrough: SIGTERM (`timeout`, `kill`, a pod's stop) to the export alone killed
    # it mid-shard with no word and a "leaked semaphore" warning; Ctrl-C says what is durable.
    await _frozen_chains(fresh, "term", count=2, calls=2)
    script = tmp_path / "run_export.py"
    script.write_text(
        "import sys\nfrom s3capture.cli import main\nif __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n"
    )
    proc = await _export_with_workers_started(script, bucket_url, tmp_path / "out")
    workers = _children(proc.pid)

    async def sigterm() -> None:
        proc.send_signal(signal.SIGTERM)  # the export process only, not its workers

    out, err = await _signalled(proc, sigterm)
    assert proc.returncode == 143, (proc.returncode, out, err)
    assert "Traceback" not in err and "leaked" not in err, err
    assert "interrupted by SIGTERM: shards published so far are durable" in err, err

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    deadline = time.monotonic() + 10
    while any(running(pid) for pid in workers) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not [pid for pid in workers if running(pid)], "workers left running"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads worker pids from /proc")
@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_an_export_that_ignores_sigint_is_not_stopped_by_its_workers(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    # Started with SIGINT ignored (a shell's `&`, a supervisor), the export carries on through a
    # Ctrl-C to its process group; its workers must too, instead of failing their shards.
    await _frozen_chains(fresh, "ign", count=6, calls=3)
    script = tmp_path / "run_export.py"
    script.write_text(
        "import signal, sys\n"
        "if __name__ == '__main__':\n"
        "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    from s3capture.cli import main\n"
        "    sys.exit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "out"
    proc = await _export_with_workers_started(script, bucket_url, out)

    async def ctrl_c_again_and_again() -> None:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            os.killpg(proc.pid, signal.SIGINT)
            await asyncio.sleep(0.02)

    out_text, err = await _signalled(proc, ctrl_c_again_and_again)
    assert proc.returncode == 0, (proc.returncode, out_text, err)
    assert sorted({row["rollout_id"] for row in read_rows(str(out))}) == [f"ign-{i}" for i in range(6)]


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_the_process_pool_reports_every_rollouts_progress_before_it_returns(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    # Two worker processes send progress through a multiprocessing queue; the engine ends on an
    # end marker put after the workers exited (no fixed sleep), so nothing they sent may be lost.
    from s3capture.export import _Progress

    writer, builder = fresh(), fresh()
    for index in range(6):
        await put_chain(writer, f"pool-{index}", 2)
        await builder.freeze(f"pool-{index}")
    progress = _Progress(False)
    summary = await export(bucket_url, str(tmp_path / "out"), workers=2, shard_rollouts=1, progress=progress)
    assert summary.ok and summary.exported == 6 and summary.shards_written == 6, format_summary(summary)
    assert (progress.rollouts, progress.trajectories, progress.tokens, progress.bytes) == (
        6,
        summary.trajectories,
        summary.tokens,
        summary.bytes_read,
    )
    assert progress.tokens > 0


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_a_failed_export_removes_the_folder_it_created_and_nothing_else(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    from s3capture.errors import StoreError

    missing = bucket_url.replace("s3://", "s3://no-such-bucket-", 1)
    with pytest.raises(StoreError):
        await export(missing, str(tmp_path / "new" / "out"), workers=0)
    assert not (tmp_path / "new").exists()  # a failed run leaves no empty dataset (nor its parents) behind
    (tmp_path / "mine").mkdir()
    with pytest.raises(StoreError):
        await export(missing, str(tmp_path / "mine"), workers=0)
    assert (tmp_path / "mine").is_dir()  # the user's own folder stays
    writer = fresh()
    await put_chain(writer, "r-1", 2)
    await writer.freeze("r-1")
    empty = await export(bucket_url, str(tmp_path / "none"), workers=0, ids=["nobody"])
    assert empty.ok and (tmp_path / "none").is_dir()  # a run that succeeds keeps its folder, empty or not
    done = await export(bucket_url, str(tmp_path / "done"), workers=0)
    assert done.exported == 1 and [row["rollout_id"] for row in read_rows(str(tmp_path / "done"))] == ["r-1"]


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_token_ids_auto_is_int32_in_every_shard_and_fails_a_rollout_that_needs_int64(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    import pyarrow.dataset as ds

    writer, builder = fresh(), fresh()
    for rid in ("a-small", "b-big", "c-small"):
        generation = [13, 2**31 + 5] if rid == "b-big" else [13, 14]
        await writer.put(simple_entry(rid, "c1", generation=generation))
        await builder.freeze(rid)

    # auto: every shard list<int32> (one dataset schema); the big rollout is failed, not written,
    # not dropped, with a reason naming --token-ids int64.
    auto = tmp_path / "auto"
    summary = await export(bucket_url, str(auto), workers=0, shard_rollouts=1, drop=True)
    assert not summary.ok and summary.failed == 1 and summary.failed_reasons == {"token_overflow": 1}
    (example,) = summary.failed_examples["token_overflow"]
    assert example.startswith("b-big: token_overflow: ") and "--token-ids int64" in example
    assert summary.exported == 2 and summary.dropped == 2
    parts = sorted(auto.glob("part-*.parquet"))
    assert len(parts) == 2
    assert {str(pq.ParquetFile(part).schema_arrow.field("token_ids").type) for part in parts} == {
        "list<element: int32>"
    }
    table = ds.dataset(str(auto), format="parquet").to_table()
    assert sorted(table.column("rollout_id").to_pylist()) == ["a-small", "c-small"]
    assert "b-big" not in {r.rollout_id for m in await read_manifests(str(auto)) for r in m.rollouts}
    states = {info.rollout_id: info.state async for info in fresh().rollouts()}
    assert states["b-big"] == "frozen" and states["a-small"] == states["c-small"] == "retired"

    # int64 into the int32 folder: refused before anything is read (the folder must stay one dataset).
    with pytest.raises(ValueError, match="list<int32> token ids .*--token-ids auto"):
        await export(bucket_url, str(auto), workers=0, token_type="int64")
    assert sorted(auto.glob("part-*.parquet")) == parts

    # int64: exported (every shard list<int64>), then dropped.
    wide = tmp_path / "int64"
    summary = await export(bucket_url, str(wide), workers=0, drop=True, token_type="int64")
    assert summary.ok and summary.exported == 1 and summary.dropped == 1, format_summary(summary)
    table = ds.dataset(str(wide), format="parquet").to_table()
    assert table.schema.field("token_ids").type == pa.list_(pa.int64())
    assert table.column("rollout_id").to_pylist() == ["b-big"] and 2**31 + 5 in table.column("token_ids")[0].as_py()
    assert {m.token_ids for m in await read_manifests(str(wide))} == {"int64"}
    with pytest.raises(ValueError, match="list<int64> token ids .*--token-ids int64"):
        await export(bucket_url, str(wide), workers=0)


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_a_shard_reads_rollouts_from_the_listing_and_lists_again_only_what_changed(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    import concurrent.futures

    from s3capture.export import ListedRollout, _close_clients, export_shard

    writer, builder = fresh(), fresh(fence_grace=0.0)
    snapshots = {}
    for rid in ("keep", "gone"):
        await put_chain(writer, rid, 3)
        snapshots[rid] = await builder.freeze(rid)
    reader = fresh()
    listed = {info.rollout_id: ListedRollout(info, tuple(items)) async for info, items in reader.rollouts_listed()}
    lists_before = reader.request_counts.get("ListObjectsV2", 0)
    from_listing = await reader.read_snapshot("keep", listing=listed["keep"].listing)
    assert reader.request_counts.get("ListObjectsV2", 0) == lists_before  # no LIST of its own
    fresh_read = await fresh().read_snapshot("keep")
    assert (from_listing.snapshot_id, from_listing.version, from_listing.entries, from_listing.incomplete) == (
        fresh_read.snapshot_id,
        fresh_read.version,
        fresh_read.entries,
        fresh_read.incomplete,
    )
    with pytest.raises(ValueError, match="outside its prefix"):
        await reader.read_snapshot("keep", listing=listed["gone"].listing)

    # Dropped after the listing: the shard finds its manifest gone, lists that rollout again and
    # skips it as retired; the other is read from the listing alone.
    assert await builder.drop("gone", snapshots["gone"].snapshot_id, snapshots["gone"].version)
    job = ExportJob(url=bucket_url, dest=str(tmp_path))  # a folder export()'s destination scan would have made
    with concurrent.futures.ThreadPoolExecutor(1) as thread:  # export_shard's clients live in its thread
        result = await asyncio.wrap_future(thread.submit(export_shard, job, 0, [listed["keep"], listed["gone"]]))
        await asyncio.wrap_future(thread.submit(_close_clients))
    assert [(r.rollout_id, r.snapshot_id, r.written) for r in result.records] == [
        ("keep", fresh_read.snapshot_id, True)
    ]
    assert [rid for rid, _ in result.skipped] == ["gone"] and result.skipped[0][1].startswith("retired")
    # "gone" listed again (its LIST and the LIST after its last key that confirms the end)
    assert result.requests["source:ListObjectsV2"] == 2 and not result.failed


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
async def test_sigkill_between_shards_then_rerun_equals_an_uninterrupted_export(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    writer, builder = fresh(), fresh()
    ids = [f"r{i:02d}" for i in range(8)]
    for rid in ids:
        await put_chain(writer, rid, 2 + int(rid[1:]) % 3)
    await writer.put(simple_entry("r-masked", "c1"))
    await writer.mark_incomplete("r-masked", "c1")
    for rid in ids + ["r-masked"]:
        await builder.freeze(rid)
    reference = tmp_path / "reference"
    assert (await export(bucket_url, str(reference), workers=0)).exported == len(ids)

    dest = tmp_path / "killed"
    command = [
        sys.executable,
        "-m",
        "s3capture.cli",
        "export",
        bucket_url,
        "--out",
        str(dest),
        "--drop",
        "--shard-rollouts",
        "1",
        "--workers",
        "1",
        "--no-progress",
    ]
    proc = subprocess.Popen(
        command, env={**os.environ, HOLD_ENV: "3"}, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "holding after" not in line:
            line = await asyncio.to_thread(proc.stderr.readline)
            assert line or proc.poll() is None, f"export ended before the hold ({proc.poll()})"
            assert time.monotonic() < deadline, "no hold within 120 s"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()

    durable = {r.rollout_id: r for m in await read_manifests(str(dest)) for r in m.rollouts}
    retired = {info.rollout_id async for info in fresh().rollouts("retired")}
    assert 3 <= len(durable) < len(ids) + 1, "the export was not interrupted mid-run"
    assert retired and retired <= {rid for rid, r in durable.items() if r.written and not r.masked}
    # An unfinished data file of a killed run: removed by the re-run, never read as a shard.
    (dest / "part-00042.parquet").write_bytes(b"not a finished shard")

    # The re-run in-process (--workers 0; the killed run had a worker process): same rows either way.
    rerun = subprocess.run([*command, "--workers", "0", "--json"], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    summary = json.loads(rerun.stdout)
    assert summary["orphans_removed"] >= 1 and summary["already_exported"] == len(durable) - len(
        retired
    )  # dropped: not listed
    assert summary["dropped"] == len(ids) - len(retired)
    assert not (dest / "part-00042.parquet").exists()
    written_now = [m for m in await read_manifests(str(dest)) if any(r.rollout_id not in durable for r in m.rollouts)]
    assert written_now and min(m.shard for m in written_now) >= 43  # numbered after every file found

    def key(row: dict) -> tuple:
        return (
            row["rollout_id"],
            row["chain_id"],
            row["snapshot_id"],
            tuple(row["token_ids"]),
            tuple(row["loss_mask"]),
        )

    resumed, uninterrupted = sorted(map(key, read_rows(str(dest)))), sorted(map(key, read_rows(str(reference))))
    assert resumed == uninterrupted and len(set(resumed)) == len(resumed)
    states = {info.rollout_id: info.state async for info in fresh().rollouts()}
    assert states == {**{rid: "retired" for rid in ids}, "r-masked": "frozen"}


async def test_a_read_only_exporter_exports_frozen_rollouts(
    read_only: Any,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Credentials with GetObject and ListBucket only (SeaweedFS identities, a Ceph bucket policy)."""
    import aioboto3

    from s3capture.store import S3TokenStore

    endpoint, admin_keys, reader_keys, url = read_only
    session = aioboto3.Session(
        aws_access_key_id=admin_keys[0], aws_secret_access_key=admin_keys[1], region_name="us-east-1"
    )
    async with S3TokenStore(url, endpoint_url=endpoint, session=session) as writer:
        for rid in ("ro-1", "ro-2"):
            await put_chain(writer, rid, 3)
            await writer.freeze(rid)
        await put_chain(writer, "ro-open", 2)
        keys_before = await writer._list("")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", reader_keys[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", reader_keys[1])
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)

    summary = await export(url, str(tmp_path / "out"), workers=0, states=["frozen"])
    assert summary.ok and summary.exported == 2, format_summary(summary)
    assert sorted(row["rollout_id"] for row in read_rows(str(tmp_path / "out"))) == ["ro-1", "ro-2"]
    # What needs a write fails per rollout, named, and never aborts the export: --freeze of the
    # open rollout and --drop of the frozen ones are refused; the frozen ones are still exported.
    denied = await export(url, str(tmp_path / "denied"), workers=0, min_age=0, freeze=True, drop=True)
    assert denied.exported == 2 and denied.failed == 1 and denied.drop_failed == 2, format_summary(denied)
    assert "AccessDenied" in denied.failed_examples["store_error"][0] and denied.failed_examples["store_error"][
        0
    ].startswith("ro-open")
    assert all("AccessDenied" in line for line in denied.drop_failed_examples)
    async with S3TokenStore(url, endpoint_url=endpoint, session=session) as writer:
        assert await writer._list("") == keys_before


# --------------------------------------------------------------------------- without a server
def _built(rid: str, tokens: list[int], *, masked: bool = False) -> _Built:
    trajectory = SimpleNamespace(
        chain_id="main",
        call_ids=["c1"],
        token_ids=tokens,
        loss_mask=[0] * (len(tokens) - 1) + [1],
        logprobs=[0.0] * (len(tokens) - 1) + [-0.5],
    )
    build = SimpleNamespace(
        rollout_id=rid,
        trajectories=[] if masked else [trajectory],
        masked=masked,
        mask_reasons=["marked_incomplete:c1"] if masked else [],
        metrics={"chains": 1, "roots": 1},
        gym_result=None,
    )
    return _Built(
        info=SimpleNamespace(rollout_id=rid, bytes=10),
        snapshot_id="s" * 32,
        version=1,
        build=build,
        masked=masked,
        reasons=list(build.mask_reasons),
    )


async def test_row_groups_are_bounded_and_token_ids_have_the_exports_one_type(tmp_path: Path) -> None:
    job = ExportJob(url="s3://bkt/p", dest=str(tmp_path), row_group_rows=2, masked="include")
    writer = _ParquetWriter(job, _LocalDestination(str(tmp_path)), 7)
    for i in range(3):
        writer.add(_built(f"r{i}", [1, 2, 3 + i]))
    writer.add(_built("masked", [], masked=True))
    # --token-ids auto: int32 in every shard; a larger id fails its rollout (nothing of it written).
    with pytest.raises(OverflowError, match=r"big \(2147483653\) does not fit int32.*--token-ids int64"):
        writer.add(_built("big", [5, 2**31 + 5]))
    writer.add(_built("r3", [2**31 - 1]))
    name, size = await writer.publish()
    assert name == "part-00007.parquet" and size == (tmp_path / name).stat().st_size
    assert not list(tmp_path.glob(".*.tmp"))
    parquet = pq.ParquetFile(tmp_path / name)
    assert parquet.metadata.num_row_groups == 3 and parquet.metadata.num_rows == 5
    assert parquet.schema_arrow.field("token_ids").type == pa.list_(pa.int32())
    rows = parquet.read().to_pylist()
    assert [row["token_ids"] for row in rows] == [[1, 2, 3], [1, 2, 4], [1, 2, 5], [], [2**31 - 1]]
    assert rows[3]["masked"] and rows[3]["mask_reasons"] == ["marked_incomplete:c1"] and rows[3]["chain_id"] == ""
    assert rows[0]["metric_chains"] == 1 and rows[0]["metric_delivered_fraction"] is None
    assert parquet.schema_arrow.field("loss_mask").type == pa.list_(pa.int8())
    assert parquet.schema_arrow.field("logprobs").type == pa.list_(pa.float32())

    # --token-ids int64: int64 in every shard, small ids too.
    wide = ExportJob(url="s3://bkt/p", dest=str(tmp_path), token_type="int64")
    for shard, tokens in ((8, [1, 2]), (9, [5, 2**31 + 5])):
        writer = _ParquetWriter(wide, _LocalDestination(str(tmp_path)), shard)
        writer.add(_built("r", tokens))
        name, _ = await writer.publish()
        table = pq.read_table(tmp_path / name)
        assert table.schema.field("token_ids").type == pa.list_(pa.int64())
        assert table.column("token_ids").to_pylist() == [tokens]
    with pytest.raises(OverflowError, match="64-bit"):
        _ParquetWriter(wide, _LocalDestination(str(tmp_path)), 10).add(_built("huge", [2**63]))


async def test_a_log_probability_beyond_float32_is_written_finite_and_huge_ids_name_the_way_out(
    tmp_path: Path,
) -> None:
    # A breaker: put accepts -1e39 (finite), and the float32 column held -inf with numpy's overflow
    # warning on stderr; ids of 2**63 and above failed under --token-ids int64 naming no way out.
    import warnings

    built = _built("tiny", [1, 2, 3])
    built.build.trajectories[0].logprobs = [0.0, 0.0, -1e39]
    writer = _ParquetWriter(ExportJob(url="s3://bkt/p", dest=str(tmp_path)), _LocalDestination(str(tmp_path)), 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning either
        writer.add(built)
    # A review (2026-12-03): the clipping was silent. It is counted, and the summary names it.
    assert writer.clipped == 1
    await writer.publish()
    (logprobs,) = pq.read_table(tmp_path / "part-00003.parquet").column("logprobs").to_pylist()
    assert logprobs[:2] == [0.0, 0.0] and logprobs[2] == float(np.finfo(np.float32).min)
    from s3capture.export.driver import _account
    from s3capture.export.records import ExportSummary, ShardResult

    summary = ExportSummary(source="s3://bkt/p", dest=str(tmp_path), format="parquet")
    _account(summary, ShardResult(shard=3, clipped=[("tiny", 1)]), collections.Counter())
    assert (summary.logprobs_clipped, summary.clipped_examples) == (1, ["tiny: 1"])
    assert "beyond float32's range, written as its nearest finite value: 1" in format_summary(summary)
    assert writer.add(_built("fine", [1, 2])) and writer.clipped == 0
    wide = ExportJob(url="s3://bkt/p", dest=str(tmp_path), token_type="int64")
    with pytest.raises(OverflowError, match="--format gym-jsonl"):
        _ParquetWriter(wide, _LocalDestination(str(tmp_path)), 4).add(_built("huge", [2**63]))


async def test_a_rollout_of_many_trajectories_fills_several_bounded_row_groups(tmp_path: Path) -> None:
    # A scale breaker: a 300-call per_request rollout was one row group of 300 rows and 40 MB under
    # --row-group-rows 32 --row-group-mb 4, all of it buffered at once.
    job = ExportJob(url="s3://bkt/p", dest=str(tmp_path), row_group_rows=32, row_group_bytes=40_000)
    writer = _ParquetWriter(job, _LocalDestination(str(tmp_path)), 1)
    built = _built("many", [1, 2, 3])
    built.build.trajectories = [
        SimpleNamespace(
            chain_id=f"c{i}",
            call_ids=[f"c{i}"],
            token_ids=list(range(1, 2 + i * 10)),
            loss_mask=[1] * (1 + i * 10),
            logprobs=[-0.5] * (1 + i * 10),
        )
        for i in range(300)
    ]
    built.build.trajectories[150].token_ids = built.build.trajectories[150].loss_mask = [1] * 9000  # over 40,000 bytes
    built.build.trajectories[150].logprobs = [-0.5] * 9000
    assert writer.add(built) == (300, sum(len(t.token_ids) for t in built.build.trajectories))
    await writer.publish()
    parquet = pq.ParquetFile(tmp_path / "part-00001.parquet")
    groups = [parquet.metadata.row_group(i) for i in range(parquet.metadata.num_row_groups)]
    assert sum(g.num_rows for g in groups) == 300 and len(groups) > 300 // 32
    sizes = [
        (g.num_rows, sum(len(t) for t in parquet.read_row_group(i, columns=["token_ids"]).column(0).to_pylist()))
        for i, g in enumerate(groups)
    ]
    for rows, tokens in sizes:
        assert rows <= 32
        assert 9 * tokens + 256 * rows <= 40_000 or rows == 1, (rows, tokens)  # one row over the bound: its own group
    assert (1, 9000) in sizes
    assert [row["chain_id"] for row in parquet.read(columns=["chain_id"]).to_pylist()] == [f"c{i}" for i in range(300)]


async def test_a_broken_pool_leaves_no_worker_alive_not_even_one_spawned_while_it_broke() -> None:
    """A breaker's export hung for good in about 1 of 20 SIGKILLs of a worker: a submit had
    spawned a worker while the pool broke (CPython marks it broken without submit's lock), the
    pool never terminated it, and shutdown and the interpreter's exit joined it for ever. Here the
    stray is put in the pool's table by hand once the pool broke; closing the pool must still leave
    none alive."""
    import concurrent.futures
    import multiprocessing

    from s3capture.export.engines import _close_pool

    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with pytest.raises(concurrent.futures.process.BrokenProcessPool):
        await asyncio.wrap_future(pool.submit(os._exit, 3))
    assert pool._broken
    # What the racing submit left: a live process in the pool's table that the break did not end
    # (spawned by hand: a spawn after the break fails, the pool's queue is closed by then).
    stray = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    stray.start()
    pool._processes[stray.pid] = stray
    await asyncio.wait_for(_close_pool(pool), 60)
    assert not stray.is_alive() and not multiprocessing.active_children()


def test_progress_is_a_plain_line_when_stderr_is_not_a_terminal() -> None:
    from s3capture.export import _Progress

    stream = io.StringIO()
    progress = _Progress(True, stream=stream, interval=0.0)
    progress.planned(3)
    progress.add((1, 2, 1500, 4_000_000))
    progress.planned(1, done=True)
    progress.add((1, 1, 500, 0))
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("export: 1/3+ rollouts, 2 trajectories, 1,500 tokens, ") and "ETA ?" in lines[0]
    assert lines[-1].startswith("export: 2/4 rollouts, 3 trajectories, 2,000 tokens, ") and "MB/s" in lines[-1]
    assert "ETA ?" not in lines[-1]
    # The ETA's rate counts from the first rollouts done, not from the start: a Ray runtime that
    # took five minutes to start made the first ETA 396 s for a 13 s export (a walkthrough).
    slow_start = _Progress(True, stream=io.StringIO(), interval=0.0)
    slow_start.started -= 300.0
    slow_start.planned(100, done=True)
    slow_start.add((10, 10, 10, 10))
    assert slow_start.first is not None
    slow_start.first = (slow_start.first[0] - 1.0, 10)  # ten more rollouts one second later
    slow_start.add((10, 10, 10, 10))
    assert slow_start.line().endswith("ETA 8s")
    silent = io.StringIO()
    quiet = _Progress(False, stream=silent, interval=0.0)
    quiet.add((1, 1, 1, 1))
    quiet.close()
    assert silent.getvalue() == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["export", "s3://bkt/p"], "--out"),
        (
            ["export", "s3://bkt/p", "--ouf", "x"],
            "unrecognized arguments: --ouf; the following arguments are required: --out",
        ),
        (["export", "s3://bkt/p", "--out", "x", "--state", "open,thawed"], "open, frozen, retired"),
        (["export", "s3://bkt/p", "--out", "x", "--min-age", "ten minutes"], "duration"),
        (["export", "s3://bkt/p", "--out", "x", "--workers", "-1"], "must be from 0"),
        (["export", "http://bkt/p", "--out", "x"], "s3://"),
        (["export", "s3://bkt/p", "--out", "s3://bkt/p/rollouts/x"], "inside the rollouts"),
        # Accepted before (a CLI breaker, 2026-12-03): SeaweedFS wrote the claim under a rewritten
        # key, failed with a misleading "stale listing" and blocked the real prefix for 10 minutes.
        (["export", "s3://bkt/p", "--out", "s3://out/a\\b"], "contains a backslash"),
        (["export", "s3://bkt/p", "--out", "s3://out/run7/../x"], "contains a '.' or '..' path segment"),
        (["export", "s3://bkt/p", "--out", "s3://out/./y"], "contains a '.' or '..' path segment"),
        (["export", "s3://bkt/p", "--out", "s3://out/a//b"], "empty path segment"),
        (["export", "s3://bkt/p", "--out", "x", "--builder", "per_request", "--build-with", "gym"], "per_request"),
    ],
)
def test_export_usage_errors_are_one_line(capsys: pytest.CaptureFixture, args: list[str], message: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_export_builds_with_the_requested_engine_and_builder(fresh: Any, bucket_url: str, tmp_path: Path) -> None:
    """The exporter hands ``build_with`` and ``builder`` to the build: ``per_request`` gives one row
    per call of a chain; a masked rollout built by Gym carries Gym's reasons, by the built-in
    engine none (a call that dropped either argument passed every other test)."""
    _, snapshots = await capture_all(fresh)
    dest = str(tmp_path / "per_request")
    await export(bucket_url, dest, workers=0, min_age=0, builder="per_request", build_with="builtin", row_group_rows=2)
    chain = [row for row in read_rows(dest) if row["rollout_id"] == "chain-delta"]
    assert len(chain) == len(snapshots["chain-delta"].entries) == 5
    # The row-group bound holds inside a rollout too (its 5 rows fill 3 groups; before, a rollout's
    # rows were always one row group, whatever its size).
    for part in Path(dest).glob("part-*.parquet"):
        metadata = pq.ParquetFile(part).metadata
        assert all(metadata.row_group(i).num_rows <= 2 for i in range(metadata.num_row_groups)), part
    for engine in ("builtin", "gym"):
        dest = str(tmp_path / engine)
        await export(bucket_url, dest, workers=0, min_age=0, masked="include", build_with=engine)
        masked = [row for row in read_rows(dest) if row["masked"]]
        assert masked
        from_gym = [any(reason.startswith("gym_") for reason in row["mask_reasons"]) for row in masked]
        assert all(from_gym) if engine == "gym" else not any(from_gym), (engine, [r["mask_reasons"] for r in masked])
        assert {m.build_with for m in await read_manifests(dest)} == {engine}  # the builder that ran
    # One destination, one builder: "auto" (Gym is importable here) over a built-in export is
    # refused, as another engine is; the same engine resumes.
    for other in ("auto", "gym"):
        with pytest.raises(ValueError, match="--build-with builtin"):
            await export(bucket_url, str(tmp_path / "builtin"), workers=0, min_age=0, build_with=other)
    again = await export(bucket_url, str(tmp_path / "builtin"), workers=0, min_age=0, build_with="builtin")
    assert again.ok and again.exported == 0 and again.already_exported > 0


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough (CI budget)
async def test_an_interrupted_shard_leaves_its_thread_ready_for_the_next(
    fresh: Any, bucket_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt inside a shard (SIGINT, or Ray's ``ray.cancel`` in a reused worker) escapes
    ``export_shard`` and publishes nothing; the thread's event loop, kept for its next shard, does
    not carry the interrupt into that shard (before the fix its leftover tasks re-raised it there)."""
    import s3capture.trajectory as trajectory
    from s3capture.export.shard import _close_clients, export_shard

    writer, builder = fresh(), fresh()
    for index in range(6):
        await put_chain(writer, f"r-{index}", 2)
        await builder.freeze(f"r-{index}")
    infos = sorted([info async for info in fresh().rollouts()], key=lambda info: info.rollout_id)
    real = trajectory.build_rollout_async
    interrupts = ["r-2"]

    async def interrupted(snapshot: Any, **options: Any) -> Any:
        if snapshot.rollout_id in interrupts:
            interrupts.remove(snapshot.rollout_id)
            raise KeyboardInterrupt  # as SIGINT delivers it: inside whatever task runs
        return await real(snapshot, **options)

    monkeypatch.setattr(trajectory, "build_rollout_async", interrupted)
    out = tmp_path / "out"
    out.mkdir()
    job = ExportJob(url=bucket_url, dest=str(out), concurrency=4)

    def two_shards() -> tuple[str, Any]:  # one thread: both shards run on its kept loop
        # Every KeyboardInterrupt is caught here: one reaching pytest would end the whole run.
        try:
            try:
                export_shard(job, 0, infos[:4])
                first = "finished"
            except KeyboardInterrupt:
                first = "interrupted"
            try:
                return first, export_shard(job, 1, infos[4:])
            except KeyboardInterrupt:
                return first, "the next shard was interrupted too"
        finally:
            try:
                _close_clients()
            except KeyboardInterrupt:
                pass

    first, second = await asyncio.to_thread(two_shards)
    assert first == "interrupted"
    assert not isinstance(second, str), second
    assert second.rows == 2 and not second.failed and not second.skipped
    assert sorted(path.name for path in out.iterdir()) == ["_part-00001.manifest.json", "part-00001.parquet"]


def test_the_summary_prints_each_example_on_one_line_whatever_the_id() -> None:
    from s3capture.export import ExportSummary

    summary = ExportSummary(source="s3://bkt/p", dest="out", format="parquet")
    summary.skipped, summary.skipped_reasons = 1, {"not_listed": 1}
    summary.skipped_examples = {"not_listed": ["two\nlines\x1b[2J: not_listed: no such rollout"]}
    text = format_summary(summary)
    (line,) = [line for line in text.splitlines() if "not_listed: no such" in line]
    assert line == "  skipped two\\nlines\\x1b[2J: not_listed: no such rollout" and "\x1b" not in text


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_export_json_stdout_is_the_summary_alone_whatever_an_engine_prints(
    s3_env: Any, bucket_url: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--json`` promises one JSON object on stdout. Ray's driver prints its raylet's and workers'
    messages there (a breaker's Ray export, a worker killed and the shard retried: five such lines
    before the summary); here an engine that prints like it, from Python and on the descriptor."""
    from s3capture.export import engines

    asyncio.run(capture_chains(bucket_url, ("j-1", "j-2"), 2))
    local = engines.ENGINES["local"]

    async def noisy(*args: Any, **kwargs: Any) -> Any:
        print("(raylet) A worker died or was killed while executing a task", flush=True)
        os.write(1, b"Task _ray_export_shard failed. There are 2 retries remaining\n")
        async for result in local(*args, **kwargs):
            yield result

    monkeypatch.setitem(engines.ENGINES, "local", noisy)
    capfd.readouterr()
    assert main(["export", bucket_url, "--out", str(tmp_path / "out"), "--workers", "0", "--json"]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("{"), (out[:500], err[-2000:])
    summary = json.loads(out)
    assert summary["ok"] and summary["exported"] == 2, out
    assert "(raylet) A worker died" in err and "retries remaining" in err
    print("after", flush=True)  # stdout is stdout again
    assert capfd.readouterr().out == "after\n"
    # Run with stdout closed (`>&-`: sys.stdout is None), it exports and says nothing, as without --json.
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["export", bucket_url, "--out", str(tmp_path / "closed"), "--workers", "0", "--json"]) == 0


def test_an_out_folder_that_cannot_be_created_is_a_one_line_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("in the way")
    assert main(["export", "s3://bkt/p", "--out", str(tmp_path / "a-file" / "sub"), "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot be created: Not a directory" in err and "a-file" in err, err
    assert "Errno" not in err


def test_an_interrupted_export_says_it_resumes(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Ctrl-C ends a command with status 130 and one line; for an export, that a re-run resumes
    (a tester's Ray export ended silently)."""
    import s3capture.export as export_module

    async def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "export", interrupted)
    assert main(["export", "s3://bkt/p", "--out", "x"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "s3capture export: interrupted: shards published so far are durable; the same command resumes from them"
    ]


@pytest.mark.parametrize("builder_masks", [False, True], ids=["builder-says-trainable", "builder-masks"])
def test_an_incomplete_snapshot_is_masked_whatever_the_builder_says(builder_masks: bool) -> None:
    """The exporter's own guarantee, not the builder's: a rollout whose snapshot is incomplete is
    never written as trainable, even when a builder (another Gym release, a user's) returns it
    unmasked. Both of today's engines mask it themselves, so only this test kills the mutant
    ``export-verdict-ignores-incomplete`` (``docs/mutation.md``)."""
    from s3capture.export.shard import _verdict
    from s3capture.trajectory import RolloutBuild, Trajectory

    trajectory = Trajectory(
        chain_id="c2", call_ids=["c1", "c2"], token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.25]
    )
    build = RolloutBuild(
        rollout_id="r",
        snapshot_id="s",
        version=3,
        trajectories=[trajectory],
        masked=builder_masks,
        mask_reasons=["gym_mask_sample"] if builder_masks else [],
        metrics={},
    )
    holed = SimpleNamespace(incomplete=True, reasons=("dangling_intent:c3",))
    masked, reasons = _verdict(build, holed)
    assert masked
    assert "dangling_intent:c3" in reasons
    complete = SimpleNamespace(incomplete=False, reasons=())
    assert _verdict(build, complete) == (builder_masks, ["gym_mask_sample"] if builder_masks else [])
