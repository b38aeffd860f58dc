"""An export destination's foreign-file check and the empty-selection hints, from a breaker session
of 2026-12-02 on that day's changes: a folder marker is not a foreign file, a refused folder keeps
no lock file, a hint never fails a command or names the root's own rollouts, and ``--prefix``
matching nothing is not "an empty root"."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import capture_chains
from s3capture.cli import main
from s3capture.errors import StoreError
from s3capture.transport import Transport

pytest.importorskip("pyarrow")

from s3capture.export import export, format_summary

MOTO = pytest.mark.parametrize("s3_server", ["moto"], indirect=True)


@pytest.mark.parametrize("s3_server", ["moto", "seaweedfs"], indirect=True)
async def test_an_s3_folder_marker_is_the_destination_not_a_foreign_file(
    fresh: Any, bucket_url: str, s3_client: Any
) -> None:
    """A console's "Create folder" (and rclone or s3fs mkdir) writes the zero-byte key 'exports/'."""
    await capture_chains(bucket_url)
    bucket = bucket_url[len("s3://") :].split("/", 1)[0]
    s3_client.put_object(Bucket=bucket, Key="exports/", Body=b"")
    summary = await export(bucket_url, f"s3://{bucket}/exports", workers=0)
    assert summary.ok and summary.exported == 1, format_summary(summary)


@MOTO
async def test_a_refused_folder_is_left_as_it_was(fresh: Any, bucket_url: str, tmp_path: Path) -> None:
    """Refused before anything is written: the user's folder keeps no lock file either."""
    await capture_chains(bucket_url)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="no export wrote"):
        await export(bucket_url, str(out), workers=0)
    assert sorted(os.listdir(out)) == ["notes.txt"]


@MOTO
def test_a_rollout_id_named_rollouts_is_not_a_root_inside(s3_env: Any, bucket_url: str, capsys: Any) -> None:
    """A root may not contain a 'rollouts' segment, so no key of this root's own rollouts/ is another
    root's: an empty selection of ``ls`` names none."""
    asyncio.run(capture_chains(bucket_url, ("rollouts",), frozen=False))
    assert main(["ls", bucket_url, "--prefix", "zzz"]) == 0
    assert "roots inside this URL" not in capsys.readouterr().err


@MOTO
def test_a_listing_narrowed_to_the_rollouts_gets_no_hint_and_no_error(
    s3_env: Any, bucket_url: str, capsys: Any, monkeypatch: Any, tmp_path: Path
) -> None:
    """docs/permissions.md narrows a role's s3:ListBucket to ROOT/rollouts/*: the hint's LIST of
    ROOT/ is refused there, which must not fail an empty selection."""
    asyncio.run(capture_chains(bucket_url, frozen=False))
    root = bucket_url.split("/", 3)[3] + "/"
    original = Transport.list_page

    async def narrowed(self: Any, prefix: str, max_keys: int = 1000, token: Any = None, start_after: Any = None) -> Any:
        if prefix.startswith(root) and not prefix.startswith(root + "rollouts/"):
            raise StoreError(f"access refused: AccessDenied (LIST {prefix})", operation="LIST", key=prefix)
        return await original(self, prefix, max_keys, token, start_after)

    monkeypatch.setattr(Transport, "list_page", narrowed)
    assert main(["ls", bucket_url, "--state", "frozen"]) == 0
    assert main(["status", bucket_url, "--prefix", "zzz", "--no-manifests"]) == 0
    capsys.readouterr()
    summary = asyncio.run(export(bucket_url, str(tmp_path / "o"), states=["frozen"], workers=0))
    assert summary.ok and summary.exported == 0 and summary.not_selected == {"open": 1}


@MOTO
def test_a_prefix_matching_nothing_is_not_an_empty_root(s3_env: Any, bucket_url: str, tmp_path: Path) -> None:
    asyncio.run(capture_chains(bucket_url))
    summary = asyncio.run(export(bucket_url, str(tmp_path / "o"), prefix="zzz", workers=0))
    assert summary.ok and not summary.root_empty
    assert "no rollouts under" not in format_summary(summary)


@MOTO
def test_a_selection_matching_nothing_says_so_instead_of_naming_other_roots(
    s3_env: Any, bucket_url: str, capsys: Any
) -> None:
    """A walkthrough: ``ls ROOT --state open`` on a root of frozen rollouts said "no rollouts here;
    roots beside this URL ...", which reads as a mistyped URL. A selection that matches nothing in
    a root that holds rollouts now says that; an empty root still gets the roots nearby."""
    parent = bucket_url.rstrip("/")
    asyncio.run(capture_chains(parent + "/run-42", ("r-0", "r-1")))
    capsys.readouterr()
    for args in (["ls", parent + "/run-42", "--state", "open"], ["status", parent + "/run-42", "--prefix", "zzz"]):
        assert main(args) == 0
        err = capsys.readouterr().err
        assert "no rollouts match --state/--prefix; this root holds others" in err and "roots beside" not in err, err
    assert main(["ls", parent + "/run-43"]) == 0  # a typo in the root's last segment
    assert f"no rollouts here; roots beside this URL (among its parent's first 1,000 keys): {parent}/run-42" in (
        capsys.readouterr().err
    )


@MOTO
def test_an_export_of_a_root_without_rollouts_exits_3_not_ok(
    s3_env: Any, bucket_url: str, tmp_path: Path, capsys: Any
) -> None:
    """A new user's walkthrough (2026-12-04): ``export`` of a mistyped root printed the roots beside
    it, then ``result: OK``, and exited 0, so a script took it for a finished export. It now exits
    3 with ``result: NO ROLLOUTS ...``; a root whose rollouts are all retired or left out is not
    empty, and an export that failed still exits 1."""
    parent = bucket_url.rstrip("/")
    asyncio.run(capture_chains(parent + "/run-42", ("r-0",)))
    capsys.readouterr()
    assert main(["export", parent + "/run-4", "--out", str(tmp_path / "typo"), "--workers", "0"]) == 3
    out = capsys.readouterr().out
    assert "result: NO ROLLOUTS under the source root" in out and "roots beside this URL" in out, out
    assert not (tmp_path / "typo").exists()  # no folder (or lock file) left behind for the typo
    assert main(["export", parent + "/run-42", "--out", str(tmp_path / "ok"), "--workers", "0"]) == 0
    assert "result: OK" in capsys.readouterr().out
    # Exported already: a re-run reads nothing new, and is no empty root.
    assert main(["export", parent + "/run-42", "--out", str(tmp_path / "ok"), "--workers", "0"]) == 0
    # A selection on a mistyped root is a typo too (a breaker, 2026-12-04); on the real root, a
    # selection that matches nothing is not.
    ids = tmp_path / "ids.txt"
    ids.write_text("r-0\n")
    for selection in (["--prefix", "r-"], ["--ids", str(ids)]):
        assert main(["export", parent + "/run-4", "--out", str(tmp_path / "sel"), "--workers", "0", *selection]) == 3
        assert "result: NO ROLLOUTS under the source root" in capsys.readouterr().out
    assert main(["export", parent + "/run-42", "--out", str(tmp_path / "z"), "--workers", "0", "--prefix", "zzz"]) == 0
    # Consumed by this destination (--drop, then gc): the root is empty, but it is no typo.
    assert main(["export", parent + "/run-42", "--out", str(tmp_path / "ok"), "--workers", "0", "--drop"]) == 0
    time.sleep(1.1)  # gc's clock is the store's Date header (whole seconds): let the drop age past 0 s
    assert main(["gc", parent + "/run-42", "--retired-older-than", "0s", "--yes"]) == 0
    assert main(["export", parent + "/run-42", "--out", str(tmp_path / "new"), "--workers", "0"]) == 3  # empty now
    capsys.readouterr()
    assert main(["export", parent + "/run-42", "--out", str(tmp_path / "ok"), "--workers", "0"]) == 0
    assert "result: OK" in capsys.readouterr().out


@MOTO
async def test_an_id_listed_in_a_state_not_selected_is_counted_once(
    fresh: Any, bucket_url: str, tmp_path: Path
) -> None:
    """A breaker (2026-12-04): ``--ids`` naming a retired rollout counted it "not selected" and
    also skipped it as "not_listed: no such rollout", three outcomes for two ids."""
    snapshots = await capture_chains(bucket_url, ("r-0", "r-1"))
    dropper = fresh()
    assert await dropper.drop("r-1", snapshots["r-1"].snapshot_id, snapshots["r-1"].version)
    summary = await export(bucket_url, str(tmp_path / "out"), workers=0, ids=["r-0", "r-1", "r-9"])
    assert (summary.exported, summary.not_selected) == (1, {"retired": 1})
    assert summary.skipped == 1 and summary.skipped_examples["not_listed"] == [
        "r-9: not_listed: no such rollout in the selected states and prefix"
    ]


@MOTO
def test_a_mistyped_root_holding_only_a_folder_marker_exits_3_with_a_selection_too(
    s3_env: Any, bucket_url: str, s3_client: Any, tmp_path: Path, capsys: Any
) -> None:
    """A breaker (2026-12-04): the one-key LIST behind ``--prefix`` took the folder marker
    ``ROOT/rollouts/`` (a console's "Create folder") for a rollout, and exited 0."""
    bucket, root = bucket_url[len("s3://") :].split("/", 1)
    s3_client.put_object(Bucket=bucket, Key=f"{root}/typo/rollouts/", Body=b"")
    for selection in ([], ["--prefix", "r-"]):
        assert main(["export", bucket_url + "/typo", "--out", str(tmp_path / "o"), "--workers", "0", *selection]) == 3
        assert "result: NO ROLLOUTS under the source root" in capsys.readouterr().out
