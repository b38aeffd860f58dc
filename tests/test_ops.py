"""``s3capture ls``, ``status`` and ``gc`` (``s3capture.ops``) against real local servers.

A handful of rollouts in every state is built with the store API (open, frozen trainable, frozen
masked two ways, frozen and written to since, dropped, retired with a straggler object, a bare
fence), then: ``ls`` (table and JSON lines), the ``status`` numbers, a ``gc`` dry run that deletes
nothing, and ``gc --yes`` that removes exactly the retired leftovers older than the threshold
(the server's LastModified decides which: two groups written about a second apart), keeps every
entry of open and frozen rollouts, retires a straggler's rollout again instead of removing its
fence, skips a rollout written to between the listing and the re-check, and leaves an id that
reads as unused (a put succeeds again, as after ``delete``).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
import time
from typing import Any

import pytest
from helpers import list_keys, simple_entry, split_bucket_url

import s3capture.clocks
from s3capture.cli import main
from s3capture.ops import GcAction, format_rollout_row, format_status, gc, status
from s3capture.protocols import TokenCaptureFrozenError, TokenCaptureRetiredError
from s3capture.rollouts import FENCE_RETIRED, RolloutInfo
from s3capture.store import S3TokenStore

FAR = 10.0  # seconds added to "now" so that everything already written counts as old


def keys_under(s3_client: Any, bucket_url: str, rollout_id: str) -> list[str]:
    bucket, root = split_bucket_url(bucket_url)
    prefix = f"{root}rollouts/{rollout_id}/"
    return [key[len(prefix) :] for key in list_keys(s3_client, bucket, prefix)]


def newest_modified(s3_client: Any, bucket_url: str, rollout_ids: list[str]) -> tuple[float, float]:
    """(oldest, newest) LastModified (store clock) over every key of the rollouts."""
    bucket, root = split_bucket_url(bucket_url)
    times = []
    for rid in rollout_ids:
        page = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{root}rollouts/{rid}/")
        times += [item["LastModified"].timestamp() for item in page.get("Contents", [])]
    return min(times), max(times)


async def build(make: Any, s3_client: Any, bucket_url: str) -> None:
    """Rollouts in every state; ``make`` builds S3TokenStore clients (fence_grace 0: drops don't wait)."""
    writer, builder = make(fence_grace=0.0), make(fence_grace=0.0)
    await writer.put(simple_entry("open-1", "c1"))
    await writer.begin_call("open-2", "c1")
    await writer.put(simple_entry("frozen-ok", "c1"))
    await builder.freeze("frozen-ok")
    await writer.put(simple_entry("frozen-intent", "c1"))
    await writer.begin_call("frozen-intent", "c2")  # no entry: dangling_intent
    await builder.freeze("frozen-intent")
    await writer.put(simple_entry("frozen-marked", "c1"))
    await writer.mark_incomplete("frozen-marked", "c2")
    await builder.freeze("frozen-marked")
    await writer.put(simple_entry("frozen-late", "c1"))
    await builder.freeze("frozen-late")
    with pytest.raises(TokenCaptureFrozenError):
        await writer.put(simple_entry("frozen-late", "c2"))
    for rid in ("dropped-1", "dropped-2"):
        await writer.put(simple_entry(rid, "c1"))
        snap = await builder.freeze(rid)
        assert await builder.drop(rid, snap.snapshot_id, snap.version)
    await writer.put(simple_entry("straggled", "c1"))
    await builder.retire(["straggled"])
    with pytest.raises(TokenCaptureRetiredError):  # a straggler: refused, but its intent landed
        await writer.begin_call("straggled", "late")
    # A fence alone: what a delete (or gc) that crashed between its two deletes leaves.
    await writer._put(writer.layout.rollout("bare") + "fence", FENCE_RETIRED)


OLD = ["dropped-1", "dropped-2", "straggled", "bare"]


async def test_status_then_gc_dry_run_deletes_nothing_then_yes_removes_exactly_the_old_leftovers(
    fresh: Any, s3_client: Any, bucket_url: str
) -> None:
    await build(fresh, s3_client, bucket_url)
    store = fresh()
    result = await status(store, now=time.time() + FAR)
    states = {state: counts.rollouts for state, counts in result.states.items()}
    assert states == {"open": 2, "frozen": 5, "retired": 3}  # the bare fence reads as frozen
    assert result.bare_fences == 1
    assert result.states["open"].objects == 2
    assert result.oldest_open is not None and result.oldest_open.rollout_id == "open-1"
    assert result.oldest_open.age_seconds >= FAR - 5
    assert (result.frozen_sealed, result.frozen_changed, result.frozen_without_manifest) == (3, 1, 1)
    assert (result.complete, result.masked, result.manifest_errors) == (2, 2, 0)  # frozen-late's manifest: trainable
    assert result.complete_changed == 1  # ... and stale: frozen-late changed since that freeze
    assert result.masked_by_reason == {"dangling_intent": 1, "marked_incomplete": 1}
    # Two dropped rollouts keep fence + tombstone each; the straggled one also its straggler intent.
    assert result.retired_leftover_objects == 2 + 2 + 3
    assert result.retired_leftover_bytes > 0
    listed_only = await status(store, manifests=False)
    assert (listed_only.complete, listed_only.masked, listed_only.manifests_read) == (0, 0, False)
    assert listed_only.states["retired"].rollouts == 3
    # A new user's walkthrough: "0 complete, 0 masked" read as "nothing masked" when no manifest was read.
    assert "newest manifests: not read (--no-manifests)" in format_status(listed_only)
    assert (
        "newest manifests: 2 complete (1 of them changed since that freeze: a later write, a marker say, "
        "may mask them; a freeze or an export reads them again), 2 masked" in format_status(result)
    )
    bucket, root = split_bucket_url(bucket_url)
    _, old_newest = newest_modified(s3_client, bucket_url, OLD)
    await asyncio.sleep(1.2)  # LastModified has one-second resolution on some servers
    writer, builder = fresh(fence_grace=0.0), fresh(fence_grace=0.0)
    await writer.put(simple_entry("dropped-young", "c1"))
    snap = await builder.freeze("dropped-young")
    assert await builder.drop("dropped-young", snap.snapshot_id, snap.version)
    young_oldest, _ = newest_modified(s3_client, bucket_url, ["dropped-young"])
    assert young_oldest > old_newest
    now = time.time()
    ops = store
    threshold = now - (old_newest + young_oldest) / 2  # the old group is older, the young one younger
    before = list_keys(s3_client, bucket, root)

    actions: list[GcAction] = []
    plan = await gc(ops, threshold, now=now, on_action=actions.append)
    assert list_keys(s3_client, bucket, root) == before  # a dry run deletes nothing
    assert plan.dry_run and plan.retired_seen == 4 and plan.too_young == 1
    assert (plan.deleted_rollouts, plan.retired_again, plan.deleted_objects) == (3, 1, 2 + 2 + 1 + 1)
    by_id = {a.rollout_id: a for a in actions if a.action != "abandoned"}
    assert sorted(by_id) == sorted(OLD)
    assert by_id["dropped-1"].action == "delete" and by_id["dropped-1"].keys == ["fence", "retired"]
    assert by_id["bare"].keys == ["fence"]
    assert by_id["straggled"].action == "retire_again" and by_id["straggled"].keys == ["log/i/late"]
    abandoned = sorted(a.rollout_id for a in actions if a.action == "abandoned")
    assert abandoned == ["open-1", "open-2"] and plan.abandoned == 2

    # A late put into a dropped rollout is refused, but its entry landed (a straggler): that makes
    # dropped-1 young again, so this gc leaves it alone.
    with pytest.raises(TokenCaptureRetiredError):
        await writer.put(simple_entry("dropped-1", "c9"))
    before = list_keys(s3_client, bucket, root)
    done = await gc(ops, threshold, now=now, dry_run=False)
    assert (done.deleted_rollouts, done.retired_again, done.deleted_objects, done.skipped, done.too_young) == (
        2,
        1,
        4,
        0,
        2,
    )
    after = list_keys(s3_client, bucket, root)
    prefix = f"{root}rollouts/"
    assert sorted(set(before) - set(after)) == sorted(
        [
            prefix + "dropped-2/fence",
            prefix + "dropped-2/retired",
            prefix + "bare/fence",
            prefix + "straggled/log/i/late",
        ]
    )
    assert set(after) <= set(before)  # nothing else removed; the re-retire only rewrote fence and tombstone
    # Every key of open and frozen rollouts, and of the young retired ones, is still there.
    for rid in (
        "open-1",
        "open-2",
        "frozen-ok",
        "frozen-intent",
        "frozen-marked",
        "frozen-late",
        "dropped-young",
        "dropped-1",
    ):
        assert keys_under(s3_client, bucket_url, rid) == [
            k[len(prefix + rid) + 1 :] for k in before if k.startswith(prefix + rid + "/")
        ]
    assert keys_under(s3_client, bucket_url, "straggled") == ["fence", "retired"]  # fence kept, rewritten
    assert (
        json.loads(s3_client.get_object(Bucket=bucket, Key=prefix + "straggled/fence")["Body"].read())["state"]
        == "retired"
    )

    # The straggled rollout was retired again just now: its fence goes only once it is old again.
    again = await gc(ops, threshold, now=now, dry_run=False)
    assert again.deleted_objects == 0 and again.retired_seen == 3 and again.too_young == 3
    # With everything old: dropped-1's straggler entry is removed (fence kept), the rest loses its fence.
    later = await gc(ops, 0.0, now=time.time() + FAR, dry_run=False)
    assert (later.deleted_rollouts, later.retired_again) == (2, 1)
    assert (
        keys_under(s3_client, bucket_url, "straggled") == []
        and keys_under(s3_client, bucket_url, "dropped-young") == []
    )
    assert keys_under(s3_client, bucket_url, "dropped-1") == ["fence", "retired"]
    with pytest.raises(TokenCaptureRetiredError):  # still fenced
        await writer.put(simple_entry("dropped-1", "c8"))
    await gc(ops, 0.0, now=time.time() + FAR, dry_run=False)  # removes c8's straggler entry
    last = await gc(ops, 0.0, now=time.time() + FAR, dry_run=False)
    assert last.deleted_rollouts == 1 and keys_under(s3_client, bucket_url, "dropped-1") == []

    # Id reuse: after gc the id reads as unused, as after delete; a put lands in a new open rollout.
    reuse = fresh()
    await reuse.put(simple_entry("dropped-1", "c9"))
    infos = {info.rollout_id: info async for info in ops.rollouts(prefix="dropped-1")}
    assert infos["dropped-1"].state == "open" and infos["dropped-1"].objects == 1
    snapshot = await reuse.freeze("dropped-1")
    assert [e.model_call_id for e in snapshot.entries] == ["c9"] and not snapshot.incomplete


async def test_gc_skips_a_rollout_written_between_listing_and_recheck(
    fresh: Any, s3_client: Any, bucket_url: str
) -> None:
    writer, builder = fresh(fence_grace=0.0), fresh(fence_grace=0.0)
    await writer.put(simple_entry("r1", "c1"))
    snap = await builder.freeze("r1")
    assert await builder.drop("r1", snap.snapshot_id, snap.version)
    store = fresh()
    original = store._list

    async def racing_list(prefix: str, **kwargs: Any) -> Any:
        await writer._put(f"{prefix}log/i/racer", b"")  # lands after the streaming listing
        return await original(prefix, **kwargs)

    store._list = racing_list
    actions: list[GcAction] = []
    report = await gc(store, 0.0, now=time.time() + FAR, dry_run=False, on_action=actions.append)
    assert report.skipped == 1 and report.deleted_objects == 0
    assert [a.action for a in actions] == ["skipped"]
    assert keys_under(s3_client, bucket_url, "r1") == ["fence", "log/i/racer", "retired"]


def test_gc_rejects_a_negative_age() -> None:
    with pytest.raises(ValueError, match="older_than"):
        asyncio.run(gc(S3TokenStore("s3://bucket/x"), -1.0))


def test_cli_ls_status_gc(
    s3_env: Any, s3_client: Any, bucket_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def setup() -> None:
        writer, builder = S3TokenStore(bucket_url, fence_grace=0.0), S3TokenStore(bucket_url, fence_grace=0.0)
        try:
            await writer.put(simple_entry("open-1", "c1"))
            await writer.put(simple_entry("masked", "c1"))
            await writer.begin_call("masked", "c2")
            await builder.freeze("masked")
            await writer.put(simple_entry("dropped", "c1"))
            snap = await builder.freeze("dropped")
            assert await builder.drop("dropped", snap.snapshot_id, snap.version)
        finally:
            await writer.close()
            await builder.close()

    asyncio.run(setup())
    capsys.readouterr()

    assert main(["ls", bucket_url, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["rollout_id"], row["state"], row["objects"]) for row in rows] == [
        ("dropped", "retired", 0),
        ("masked", "frozen", 3),
        ("open-1", "open", 1),
    ]
    assert all({"bytes", "last_write", "version", "snapshot_id", "sealed"} <= set(row) for row in rows)
    # --state takes comma-separated names and repeats (export's --state alike); both forms add up.
    assert main(["ls", bucket_url, "--json", "--state", "retired,open", "--state", "open"]) == 0
    picked = [json.loads(line)["rollout_id"] for line in capsys.readouterr().out.splitlines()]
    assert picked == ["dropped", "open-1"]
    assert main(["ls", bucket_url, "--state", "opne"]) == 2
    assert "comma-separated list of open, frozen, retired" in capsys.readouterr().err
    with monkeypatch.context() as patch:  # a terminal: the table
        patch.setattr(sys.stdout, "isatty", lambda: True)
        assert main(["ls", bucket_url, "--state", "frozen"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["state", "objects", "bytes", "last_write", "rollout_id"]
    assert len(table) == 2 and table[1].split()[:2] == ["frozen", "3"] and table[1].split()[-1] == "masked"
    # The id is the last column: ids of any length leave the other columns where the header has them.
    long_id = "rollout-" + "x" * 120
    when = datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)
    rows = [
        format_rollout_row(
            RolloutInfo(rollout_id=rid, state="open", objects=12, bytes=3000, last_write=when), table=True
        )
        for rid in ("a", long_id)
    ]
    header = format_rollout_row(None, table=True)
    for row, rid in zip(rows, ("a", long_id)):
        assert row.index(rid) == header.index("rollout_id") and row.endswith(rid)
        assert row[: row.index(rid)] == rows[0][: rows[0].index("a")]
    assert format_rollout_row(None, table=False) == "rollout_id\tstate\tobjects\tbytes\tlast_write"
    # An empty listing still shows its columns; a listing that fails shows only its error.
    assert main(["ls", bucket_url, "--prefix", "no-such-"]) == 0
    assert capsys.readouterr().out.splitlines() == [format_rollout_row(None, table=False)]
    assert main(["ls", "s3://s3capture-no-such-bucket-7f3a/x"]) != 0
    out, err = capsys.readouterr()
    assert out == "" and "does not exist" in err

    # A URL one level above the root (the bucket, here) lists nothing and names the root inside it.
    parent = bucket_url.rsplit("/", 1)[0]
    assert parent.count("/") >= 2 and bucket_url.startswith(parent + "/")
    assert main(["ls", parent]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [format_rollout_row(None, table=False)]
    assert f"no rollouts here; roots inside this URL (among its first 1,000 keys): {bucket_url}" in err
    assert main(["status", parent]) == 0
    assert f"roots inside this URL (among its first 1,000 keys): {bucket_url}" in capsys.readouterr().err
    # A typo in the root's last segment names the roots beside it.
    for command in ("ls", "status"):
        assert main([command, bucket_url + "-typo"]) == 0
        assert f"roots beside this URL (among its parent's first 1,000 keys): {bucket_url}" in capsys.readouterr().err

    assert main(["status", bucket_url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["states"]["retired"]["rollouts"] == 1 and data["masked_by_reason"] == {"dangling_intent": 1}
    assert data["oldest_open"]["rollout_id"] == "open-1" and data["retired_leftover_objects"] == 2
    assert main(["status", bucket_url]) == 0
    text = capsys.readouterr().out
    assert "masked by dangling_intent: 1" in text and "retired leftovers: 2 objects" in text
    assert "'s3capture gc' removes them" in text

    bucket, root = split_bucket_url(bucket_url)
    before = list_keys(s3_client, bucket, root)
    # A threshold of 0, once a second has passed: gc's clock is the store's Date header (whole
    # seconds), so a key written within the last second can read as younger than 0 s.
    time.sleep(1.1)
    assert main(["gc", bucket_url, "--retired-older-than", "0s"]) == 0
    out, err = capsys.readouterr()
    assert "would delete dropped" in out and "dry run" in out and "under 3600s" in err
    assert list_keys(s3_client, bucket, root) == before
    assert main(["gc", bucket_url, "--retired-older-than", "0s", "--yes", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[-1]["type"] == "summary" and lines[-1]["deleted_rollouts"] == 1 and lines[-1]["abandoned"] == 1
    assert {(line["rollout_id"], line["action"]) for line in lines[:-1]} == {
        ("dropped", "delete"),
        ("open-1", "abandoned"),
    }
    assert sorted(set(before) - set(list_keys(s3_client, bucket, root))) == [
        f"{root}rollouts/dropped/fence",
        f"{root}rollouts/dropped/retired",
    ]
    assert main(["status", bucket_url]) == 0
    text = capsys.readouterr().out
    assert "retired leftovers: 0 objects" in text and "gc' removes" not in text  # nothing to suggest (a walkthrough)


class _ClockAhead:
    """This machine's wall clock a day ahead of the store's; the monotonic clock untouched."""

    AHEAD = 86_400.0

    monotonic = staticmethod(time.monotonic)
    perf_counter = staticmethod(time.perf_counter)
    clock_gettime = staticmethod(time.clock_gettime)

    @staticmethod
    def time() -> float:
        return time.time() + _ClockAhead.AHEAD


@pytest.mark.all_transports
async def test_status_counts_rollouts_a_drop_is_deciding_or_crashed_on(fresh: Any) -> None:
    """A drop's own tombstone without the retire tombstone: a drop deciding, or one that crashed
    (markers on the rollout are not acknowledged until it is dropped again). status names them; a
    drop that finished leaves none."""
    writer, builder = fresh(fence_grace=0.0), fresh(fence_grace=0.0)
    for rid in ("crashed", "fine", "done"):
        await writer.put(simple_entry(rid, "c1"))
        snap = await builder.freeze(rid)
    assert await builder.drop("done", snap.snapshot_id, snap.version)
    await writer._put(writer.layout.rollout("crashed") + "drop/" + "0123abcd" * 4, b"")  # a dead drop's (uuid4 hex)
    with pytest.raises(TokenCaptureRetiredError):
        await writer.mark_incomplete("crashed", "c1")
    result = await status(fresh())
    assert result.dropping == 1
    assert result.states["frozen"].rollouts == 2 and result.states["retired"].rollouts == 1
    from s3capture.ops import format_status

    assert "frozen with a drop deciding or crashed (a drop/ tombstone, no retire): 1" in format_status(result)
    # Frozen and dropped again by a builder: nothing is left deciding.
    snap = await builder.freeze("crashed")
    assert await builder.drop("crashed", snap.snapshot_id, snap.version)
    assert (await status(fresh())).dropping == 0


async def test_a_clock_running_ahead_does_not_age_what_gc_and_status_see(
    fresh: Any, s3_client: Any, bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3capture.ops as ops

    writer, builder = fresh(fence_grace=0.0), fresh(fence_grace=0.0)
    await writer.put(simple_entry("dropped", "c1"))
    snap = await builder.freeze("dropped")
    assert await builder.drop("dropped", snap.snapshot_id, snap.version)
    await writer.put(simple_entry("open", "c1"))
    before = keys_under(s3_client, bucket_url, "dropped")
    assert before  # fence and tombstone

    store = fresh()
    monkeypatch.setattr(s3capture.clocks, "time", _ClockAhead)  # store_time's "this machine's clock"
    report = await gc(store, 3600.0, dry_run=False)
    # By this machine's clock everything is a day old; by the store's it was written just now.
    assert (report.retired_seen, report.too_young, report.deleted_rollouts, report.abandoned) == (1, 1, 0, 0)
    assert keys_under(s3_client, bucket_url, "dropped") == before
    store_now = store.transport.store_now()
    assert store_now is not None and abs(store_now - time.time()) < 5  # the same machine's clock, via Date
    result = await status(store, manifests=False)
    assert result.oldest_open is not None and result.oldest_open.age_seconds < 60
    # A clock behind the store's counts the same way: the earlier clock is the one ages use.
    assert ops.store_time(store) <= time.time() + 1


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # exporter logic: one server is enough
async def test_export_min_age_is_not_fooled_by_a_clock_running_ahead(
    fresh: Any, bucket_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s3capture.export import export

    await fresh().put(simple_entry("open-a", "c1"))
    monkeypatch.setattr(s3capture.clocks, "time", _ClockAhead)  # store_time's "this machine's clock"
    young = await export(bucket_url, str(tmp_path / "out"), workers=0, min_age=3600)
    assert (young.exported, young.skipped, young.skipped_reasons) == (0, 1, {"not_quiescent": 1})


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # CLI plumbing: one server is enough
def test_ls_into_a_closed_pipe_ends_quietly(s3_env: Any, bucket_url: str) -> None:
    import os
    import subprocess

    async def setup() -> None:
        async with S3TokenStore(bucket_url) as writer:
            await asyncio.gather(*(writer.put(simple_entry(f"r{i:03d}", "c1")) for i in range(40)))

    asyncio.run(setup())
    read, write = os.pipe()
    os.close(read)  # `s3capture ls URL | head -0`: the reader is gone before the first row
    with os.fdopen(write, "wb") as stdout:
        done = subprocess.run(
            [sys.executable, "-c", "import sys; from s3capture.cli import main; sys.exit(main())", "ls", bucket_url],
            stdout=stdout,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    assert (done.returncode, done.stderr.decode()) == (0, "")


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # CLI plumbing: one server is enough
def test_gc_yes_into_a_closed_pipe_finishes_its_deletions(s3_env: Any, bucket_url: str) -> None:
    """``gc --yes | head -3`` stopped after the rows head read and exited 0, leaving 16 of 20
    retired rollouts' leftovers (a new user's walkthrough, 2026-12-02). It now finishes the run,
    says so on stderr with its summary, and a dry run into a closed pipe still ends quietly."""
    import os
    import subprocess

    from s3capture.ops import status

    async def setup() -> None:
        async with S3TokenStore(bucket_url) as writer:
            for i in range(12):
                await writer.put(simple_entry(f"r{i:03d}", "c1"))
            await writer.retire([f"r{i:03d}" for i in range(12)])

    async def retired_objects() -> int:
        async with S3TokenStore(bucket_url) as reader:
            return (await status(reader)).retired_leftover_objects

    asyncio.run(setup())
    before = asyncio.run(retired_objects())
    assert before > 0
    command = [sys.executable, "-c", "import sys; from s3capture.cli import main; sys.exit(main())", "gc", bucket_url]
    for extra, expected_left in (([], before), (["--yes"], 0)):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first row
        with os.fdopen(write, "wb") as stdout:
            done = subprocess.run(
                [*command, "--retired-older-than", "0", *extra], stdout=stdout, stderr=subprocess.PIPE, timeout=300
            )
        assert done.returncode == 0, done.stderr.decode()
        assert asyncio.run(retired_objects()) == expected_left
        if extra:
            assert "finishing the run" in done.stderr.decode()


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # CLI plumbing: one server is enough
def test_output_that_cannot_be_written_never_stops_ls_or_gc_part_way(s3_env: Any, bucket_url: str) -> None:
    """A CLI breaker (2026-12-03): under an output encoding without ``ü`` (``PYTHONIOENCODING=ascii``,
    an ISO-8859 locale) ``ls`` stopped at the id ``c-ü`` and ``gc --yes`` deleted it unreported,
    then exited 2 with two rollouts never handled; ``gc --yes > /dev/full`` stopped after one
    rollout; ``ls >&-`` (stdout closed) printed a traceback. Ids the encoding lacks are now written
    as ``\\uXXXX`` (valid in ``--json`` too), and ``gc --yes`` finishes whatever its output does."""
    import json
    import os
    import subprocess

    from s3capture.ops import status

    ids = ["a-1", "b-2", "c-\u00fc", "d-4", "e-5"]

    async def setup() -> None:
        async with S3TokenStore(bucket_url) as writer:
            for rid in ids:
                await writer.put(simple_entry(rid, "c1"))
            await writer.retire(ids)

    async def retired_objects() -> int:
        async with S3TokenStore(bucket_url) as reader:
            return (await status(reader)).retired_leftover_objects

    asyncio.run(setup())
    command = [sys.executable, "-c", "import sys; from s3capture.cli import main; sys.exit(main())"]
    ascii_env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    shown = subprocess.run([*command, "ls", bucket_url], capture_output=True, env=ascii_env, timeout=120)
    assert shown.returncode == 0, shown.stderr.decode()
    rows = shown.stdout.decode("ascii").splitlines()[1:]
    assert [row.split("\t")[0] for row in rows] == ["a-1", "b-2", "c-\\u00fc", "d-4", "e-5"]
    listed = subprocess.run([*command, "ls", "--json", bucket_url], capture_output=True, env=ascii_env, timeout=120)
    assert listed.returncode == 0, listed.stderr.decode()
    assert [json.loads(line)["rollout_id"] for line in listed.stdout.decode("ascii").splitlines()] == ids
    closed = subprocess.run(f"{subprocess.list2cmdline([*command, 'ls', bucket_url])} >&-", shell=True,
                            capture_output=True, timeout=120)  # fmt: skip
    assert (closed.returncode, closed.stderr.decode()) == (0, "")
    before = asyncio.run(retired_objects())
    assert before > 0
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [*command, "gc", bucket_url, "--retired-older-than", "0", "--yes"],
            stdout=full,
            stderr=subprocess.PIPE,
            env=ascii_env,
            timeout=300,
        )
    said = done.stderr.decode("ascii")
    assert done.returncode == 1, said  # finished, but its report was not written: a script must see it
    assert "cannot write the output" in said and "finishing the run" in said
    assert asyncio.run(retired_objects()) == 0  # every retired rollout handled


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # output formatting: one server is enough
def test_ids_with_control_characters_keep_one_row_each_and_read_back_in_a_shell(
    s3_env: Any, bucket_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tab or newline in a rollout id is valid; printed as it is, it split a TSV row in two or
    into six fields, and an escape sequence reached the terminal. Such ids are printed in bash's
    ``$'...'`` quoting, which reads back as the id; ``--json`` keeps them unchanged."""
    import subprocess

    ids = ["tab\there", "new\nline", "esc\x1b[31mred", "plain-id"]

    async def setup() -> None:
        async with S3TokenStore(bucket_url) as writer:
            for rid in ids:
                await writer.put(simple_entry(rid, "c1"))

    asyncio.run(setup())
    assert main(["ls", bucket_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(ids) and all(len(line.split("\t")) == 5 for line in lines)
    assert not any("\x1b" in line for line in lines)
    shown = [line.split("\t")[0] for line in lines[1:]]
    assert "plain-id" in shown  # an ordinary id is printed as it is
    back = subprocess.run(
        ["bash", "-c", "for id in " + " ".join(shown) + '; do printf "%s\\0" "$id"; done'],
        capture_output=True,
        check=True,
    ).stdout.decode()
    assert sorted(back.split("\0")[:-1]) == sorted(ids)
    with monkeypatch.context() as patch:  # a terminal: the same quoting in the table
        patch.setattr(sys.stdout, "isatty", lambda: True)
        assert main(["ls", bucket_url]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 1 + len(ids) and sorted(line.split()[-1] for line in table[1:]) == sorted(shown)
    assert main(["ls", bucket_url, "--json"]) == 0
    assert sorted(json.loads(line)["rollout_id"] for line in capsys.readouterr().out.splitlines()) == sorted(ids)


async def test_the_roots_beside_a_mistyped_url_come_closest_first(fresh, bucket_url):
    """Six roots beside a typo of one of them: the hint named the first five in key order, and
    the root the typo missed (``run-44`` for ``run-4``) was left out (a walkthrough, 2026-12-03)."""
    from s3capture.ops import roots_beside

    for name in ("alpha", "beta", "delta", "epsilon", "gamma", "run-44"):
        await fresh(url=f"{bucket_url}/{name}").put(simple_entry("r", "c1"))
    found = await roots_beside(fresh(url=f"{bucket_url}/run-4"))
    assert len(found) == 5 and found[0] == f"{bucket_url}/run-44", found


async def test_status_counts_a_frozen_rollout_nothing_was_written_to_as_empty(fresh: Any, bucket_url: str) -> None:
    """A new user's walkthrough (2026-12-04): Gym's consumer given a mistyped id freezes it, and
    ``status`` counted that empty snapshot "complete", which export then masks (no token records)."""
    writer = fresh()
    await writer.put(simple_entry("real", "c1"))
    await writer.freeze("real")
    empty = await writer.freeze("mistyped")
    assert not empty.entries and empty.version == 0 and not empty.incomplete
    result = await status(fresh())
    assert (result.complete, result.empty, result.masked) == (2, 1, 0)
    assert "newest manifests: 2 complete (1 of them empty: frozen with nothing written" in format_status(result)
    # A late put lands after that freeze: its manifest of nothing is no longer the listed state
    # (a breaker: status still called it empty).
    with pytest.raises(TokenCaptureFrozenError):
        await writer.put(simple_entry("mistyped", "c1"))
    result = await status(fresh())
    assert (result.complete, result.empty, result.frozen_changed, result.complete_changed) == (2, 0, 1, 1)
    # A walkthrough (2026-12-04) read "2 complete" for a rollout a late write had made stale.
    assert "newest manifests: 2 complete (1 of them changed since that freeze" in format_status(result)
