"""An audit of every place s3capture decides that a key or a file name is its own (2026-12-04, after
``gc --yes`` deleted a foreign ``ledger/.probe/<32 hex>\\n``: reliability.md finding 38).

Each test shows a classification through a public path (``freeze``, ``rollouts``, ``gc``,
``export``) on a real server: a name s3capture never writes must be foreign (reported, masked or
refused, never deleted as its own), and a name it does write must stay its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from helpers import list_keys, put_chain, split_bucket_url  # noqa: E402
from s3capture.export import export  # noqa: E402
from s3capture.layout import Layout  # noqa: E402
from s3capture.ops import GcAction, gc  # noqa: E402

MOTO = pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
HEX = "0123456789abcdef" * 2
FULLWIDTH = str.maketrans("0123456789", "\uff10\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18\uff19")
"""Digits as a Unicode font draws them: ``\\d`` of a ``str`` regular expression matches them (and
``int()`` reads them), though no export names a file with anything but ASCII digits."""


def _prefix(bucket_url: str, rollout_id: str) -> tuple[str, str]:
    bucket, root = split_bucket_url(bucket_url)
    return bucket, Layout(root.rstrip("/")).rollout(rollout_id)


async def _frozen(fresh: Any, ids: list[str]) -> None:
    writer, builder = fresh(), fresh()
    for rid in ids:
        await put_chain(writer, rid, 2)
        await builder.freeze(rid)


# --------------------------------------------------------------------------- export destinations
@MOTO
@pytest.mark.parametrize("where", ["local", "s3"])
async def test_a_shard_name_with_non_ascii_digits_is_a_foreign_file_not_an_orphan(
    fresh: Any, bucket_url: str, s3_client: Any, tmp_path: Path, where: str
) -> None:
    """``part-０００07.parquet`` (fullwidth digits) is no export's file: ``\\d`` took it for shard 7,
    so a re-run into a destination holding a manifest deleted it as an unfinished shard, never
    telling; a hidden ``.part-０００01.parquet.tmp`` went as an export's temp file. Both are
    foreign: the data file is refused (a dataset reader would read it), the hidden one left alone."""
    await _frozen(fresh, ["k1"])
    bucket, _ = split_bucket_url(bucket_url)
    stray, hidden = "part-00007.parquet".translate(FULLWIDTH), ".part-00001.parquet.tmp".translate(FULLWIDTH)
    body = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": [1]}), body)
    if where == "local":
        dest = str(tmp_path / "out")
        first = await export(bucket_url, dest, workers=0, min_age=0)
        assert first.ok and first.exported == 1
        (tmp_path / "out" / stray).write_bytes(body.getvalue().to_pybytes())
        (tmp_path / "out" / hidden).write_bytes(b"mine")

        def present() -> set[str]:
            return {p.name for p in (tmp_path / "out").iterdir()}
    else:
        dest = bucket_url + "-exports/run"
        first = await export(bucket_url, dest, workers=0, min_age=0)
        assert first.ok and first.exported == 1
        s3_client.put_object(Bucket=bucket, Key=f"t-exports/run/{stray}", Body=body.getvalue().to_pybytes())
        s3_client.put_object(Bucket=bucket, Key=f"t-exports/run/{hidden}", Body=b"mine")

        def present() -> set[str]:
            return {key.rsplit("/", 1)[-1] for key in list_keys(s3_client, bucket, "t-exports/run/")}

    with pytest.raises(ValueError, match="holds files no export wrote"):
        await export(bucket_url, dest, workers=0, min_age=0)
    assert {stray, hidden} <= present()


@MOTO
async def test_only_a_named_claim_counts_in_an_s3_destination_s_claim_folder(
    fresh: Any, bucket_url: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every key under ``<dest>/.s3capture-export.lock/`` was read as another export's claim: the
    folder's own marker (what a console's "Create folder" or ``rclone mkdir`` writes) refused every
    export for ``CLAIM_LEASE`` seconds ("being written by another export") and was then deleted as a
    dead export's claim, as was any key in a folder below it. A claim is a name directly in that
    folder; the others are neither waited for nor deleted."""
    import s3capture.export.destination_s3 as destination_s3

    await _frozen(fresh, ["k1"])
    bucket, _ = split_bucket_url(bucket_url)
    claims = "t-exports/run/.s3capture-export.lock/"
    foreign = [claims, claims + "notes/readme.txt"]
    for key in foreign:
        s3_client.put_object(Bucket=bucket, Key=key, Body=b"")
    summary = await export(bucket_url, bucket_url + "-exports/run", workers=0, min_age=0)
    assert summary.ok and summary.exported == 1
    monkeypatch.setattr(destination_s3, "CLAIM_LEASE", -1.0)  # every other claim is a dead export's
    again = await export(bucket_url, bucket_url + "-exports/run", workers=0, min_age=0)
    assert again.ok and again.already_exported == 1
    assert list_keys(s3_client, bucket, claims) == sorted(foreign)


# --------------------------------------------------------------------------- a rollout's own keys
async def test_keys_under_snap_and_drop_that_no_freeze_or_drop_writes_are_foreign(
    fresh: Any, bucket_url: str, s3_client: Any, s3_server: Any
) -> None:
    """s3capture writes ``snap/<version:020d>-<snapshot_id>`` and ``drop/<32 hex>`` there; any other
    key under ``snap/`` was read as a sealed manifest and under ``drop/`` as a drop's tombstone:
    outside the version and the snapshot id, so a foreign object there left the snapshot complete
    (``foreign_object`` anywhere else masks it), ``rollouts`` agreed, and ``status`` counted the
    rollout as being dropped. Keys of exactly s3capture's shapes stay its own."""
    await _frozen(fresh, ["r"])
    bucket, prefix = _prefix(bucket_url, "r")
    clean = await fresh().freeze("r")
    assert not clean.incomplete
    own = [f"snap/{1:020d}-{HEX}", f"drop/{HEX}"]  # a crashed drop's tombstone, a stale manifest
    for rel in own:
        s3_client.put_object(Bucket=bucket, Key=prefix + rel, Body=b"")
    still = await fresh().freeze("r")
    assert (still.version, still.snapshot_id, still.incomplete) == (clean.version, clean.snapshot_id, False)
    odd = ["snap/README", f"snap/{1:020d}-{HEX.upper()}", "drop/notes.txt"]
    if s3_server.kind == "seaweedfs":  # moto refuses a key holding a newline
        odd += [f"snap/{1:020d}-{HEX}\n", f"drop/{HEX}\n"]
    for rel in odd:
        s3_client.put_object(Bucket=bucket, Key=prefix + rel, Body=b"")
    snapshot = await fresh().freeze("r")
    assert snapshot.version == clean.version + len(odd)
    assert sorted(r for r in snapshot.reasons if r.startswith("foreign_object:")) == sorted(
        f"foreign_object:{rel}" for rel in odd
    )
    (info,) = [info async for info in fresh().rollouts()]
    assert (info.version, info.snapshot_id, info.sealed) == (snapshot.version, snapshot.snapshot_id, True)


# --------------------------------------------------------------------------- gc: prefixes of probes alone
async def test_gc_removes_probes_alone_only_at_prefixes_s3capture_writes(
    bucket_url: str, s3_client: Any, s3_server: Any, fresh: Any
) -> None:
    """``gc --yes`` deletes the keys of a rollout prefix whose every key is a leftover listing probe;
    the prefix must be one s3capture writes (a canonical escape of a storable id) and every name
    exactly ``ledger/.probe/<32 lower-case hex>``. Look-alikes of each part (a final newline or a
    tab, lower-case hex in an escape, a non-canonical escape, an empty or ``.`` segment, an
    over-long id, upper-case hex, a longer name, a trailing ``/``, an empty segment) are left, and
    ``rollouts`` shows those at a storable id as open rollouts holding a foreign object (a folder
    marker aside), the others not at all."""
    bucket, root = split_bucket_url(bucket_url)
    base = f"{root}rollouts/"
    probe = f"ledger/.probe/{HEX}"
    foreign = [
        f"{base}r1\t/{probe}",
        f"{base}caf.c3.a9/{probe}",  # escape_id("café") is "caf.C3.A9"
        f"{base}.41/{probe}",  # "A" escapes as itself
        f"{base}~/{probe}",  # the empty id
        f"{base}r2/ledger/.probe/{HEX.upper()}",
        f"{base}r3/ledger/.probe/{HEX}0",
        f"{base}r7/ledger/.probe/{HEX[:31]}",
    ]
    if s3_server.kind == "seaweedfs":  # moto refuses a newline in a key
        foreign += [f"{base}r1\n/{probe}", f"{base}r4/ledger/.probe/{HEX}\n"]
    else:  # SeaweedFS refuses a segment over 255 bytes, and makes '//' and a final '/' folders
        foreign += [f"{base}{'a' * 256}/{probe}", f"{base}r5/ledger/.probe/{HEX}/", f"{base}r6/ledger//.probe/{HEX}"]
    leftover = f"{base}r8/{probe}"
    for key in [*foreign, leftover]:
        s3_client.put_object(Bucket=bucket, Key=key, Body=b"")
    actions: list[GcAction] = []
    report = await gc(fresh(), 3600.0, now=time.time() + 7200.0, dry_run=False, on_action=actions.append)
    done = [(a.rollout_id, a.action, a.keys) for a in actions if a.action != "abandoned"]
    assert done == [("r8", "delete_probes", [probe])] and report.deleted_objects == 1
    assert list_keys(s3_client, bucket, base) == sorted(foreign)
    opened = {"r2", "r3", "r7"} | ({"r4"} if s3_server.kind == "seaweedfs" else {"r6"})
    assert {info.rollout_id: (info.state, info.objects) async for info in fresh().rollouts()} == dict.fromkeys(
        opened, ("open", 1)
    )


# --------------------------------------------------------------------------- folder markers s3capture never writes
@pytest.mark.parametrize("probe_listing", [False, True])
async def test_folder_markers_of_the_row_folders_are_no_rows_for_has_rows(
    ledgers: Any, bucket_url: str, s3_client: Any, probe_listing: bool
) -> None:
    """``ledger/row/`` and ``ledger/fail/`` as folder markers (s3fs, ``rclone mkdir``, a console's
    "Create folder"): ``manifest`` reads no row, and ``has_rows``'s one-key LISTs, which took any
    key for a row, answered True, so Gym's admission refused to take a continuation of a rollout
    without rows as a fresh root. A row still counts."""
    from helpers import assistant_output, make_commit, user

    bucket, prefix = _prefix(bucket_url, "r")
    for rel in ("ledger/row/", "ledger/fail/"):
        s3_client.put_object(Bucket=bucket, Key=prefix + rel, Body=b"")
    ledger = ledgers(probe_listing=probe_listing)
    assert (await ledger.manifest("r"))["records"] == []
    assert await ledger.has_rows("r") is False
    await ledger.record(make_commit("r", "c0", [user("hi")], assistant_output("a")))
    assert await ledger.has_rows("r") is True


async def test_a_folder_marker_of_drop_is_no_drop_for_mark_incomplete(
    fresh: Any, bucket_url: str, s3_client: Any
) -> None:
    """After a freeze a marker reads ``drop/`` for drops' tombstones: its folder marker (s3fs,
    ``rclone mkdir``, a console) was read as a drop deciding, so every later ``mark_incomplete`` of
    the rollout raised ``TokenCaptureRetiredError`` ("being dropped") though no drop ran, and the
    marker, which landed and masks the rollout, was never acknowledged. A real drop's tombstone
    (``drop/<32 hex>``) still refuses the acknowledgement."""
    from s3capture.protocols import TokenCaptureRetiredError

    await _frozen(fresh, ["r"])
    bucket, prefix = _prefix(bucket_url, "r")
    s3_client.put_object(Bucket=bucket, Key=prefix + "drop/", Body=b"")
    await fresh(fence_grace=0.0).mark_incomplete("r", "late")
    assert "marked_incomplete:late" in (await fresh().freeze("r")).reasons
    s3_client.put_object(Bucket=bucket, Key=prefix + f"drop/{HEX}", Body=b"")
    with pytest.raises(TokenCaptureRetiredError, match="being dropped"):
        await fresh(fence_grace=0.0).mark_incomplete("r", "later")
