"""Adversarial: mark_incomplete's local spill (torn files, replay racing new spills, double replay).

The store is made to fail on the wire by a fault proxy in front of the real test server
(``test_adversarial_faultproxy.FaultProxy``): marker PUTs for chosen call ids are answered 503
(the store is "down" for them) or held (a slow replay).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from helpers import simple_entry
from test_adversarial_faultproxy import FaultProxy, Respond, not_implemented_xml

from s3capture.store import default_botocore_config


def _no_retry_config() -> Any:
    return default_botocore_config(16, retries={"mode": "standard", "max_attempts": 1}, s3={"addressing_style": "path"})


async def _proxy(s3_server: Any) -> FaultProxy:
    return await FaultProxy(s3_server.port).start()


def _marker_put_for(request: Any, cid: str) -> bool:
    return request.method == "PUT" and f"/log/x/{cid}/" in request.path


# Regression test (found by the adversarial review, fixed in 0d86cd4): one torn line in the spill file makes
# every later replay raise, so spilled markers never reach the bucket and a rollout with a hole freezes
# complete
async def test_torn_spill_line_does_not_block_replay_of_the_others(s3_server, fresh, tmp_path):
    proxy = await _proxy(s3_server)
    try:
        down = {"c1"}

        async def rule(request: Any) -> Any:
            if any(_marker_put_for(request, cid) for cid in down):
                return Respond(503, not_implemented_xml("ServiceUnavailable", "down"), "Service Unavailable")
            return None

        proxy.rule = rule
        spill = tmp_path / "spill"
        worker = fresh(endpoint_url=proxy.endpoint, spill_dir=spill, botocore_config=_no_retry_config())
        await worker.put(simple_entry("r-hole", "c0"))
        await worker.mark_incomplete("r-hole", "c1")  # store "down": spilled, and acknowledged
        (path,) = list(spill.iterdir())
        # Another writer of the same spill file died mid-append (or the disk filled up): a torn line.
        with open(path, "ab") as handle:
            handle.write(b'{"bucket": "' + worker.bucket.encode() + b'", "ke')
        down.clear()
        await worker.mark_incomplete("r-other", "c9")  # store back: replays the spill ... or not
        await worker.close()
        snapshot = await fresh().freeze("r-hole")
        assert snapshot.incomplete, "mark_incomplete('r-hole', 'c1') was acknowledged, yet the rollout froze complete"
    finally:
        await proxy.stop()


# Regression test (found by the adversarial review, fixed in 0d86cd4): replay_spill reads the file, awaits the
# PUTs, then os.remove()s it, deleting markers spilled meanwhile by the same (or another) client
async def test_marker_spilled_during_a_replay_is_not_lost(s3_server, fresh, tmp_path):
    proxy = await _proxy(s3_server)
    try:
        mode = {"c1": "fail", "c2": "fail"}
        held = asyncio.Event()
        release = asyncio.Event()

        async def rule(request: Any) -> Any:
            for cid, what in mode.items():
                if _marker_put_for(request, cid):
                    if what == "fail":
                        return Respond(503, not_implemented_xml("ServiceUnavailable", "down"), "Service Unavailable")
                    if what == "hold":
                        held.set()
                        await release.wait()
            return None

        proxy.rule = rule
        worker = fresh(endpoint_url=proxy.endpoint, spill_dir=tmp_path / "spill", botocore_config=_no_retry_config())
        await worker.put(simple_entry("r-race", "c0"))
        await worker.mark_incomplete("r-race", "c1")  # spilled
        mode["c1"] = "hold"  # the store is back but slow for this marker
        replaying = asyncio.create_task(worker.mark_incomplete("r-race", "c3"))  # lands, then replays c1
        await asyncio.wait_for(held.wait(), 20)
        await worker.put(simple_entry("r-race2", "c0"))
        await worker.mark_incomplete("r-race2", "c2")  # fails now: spilled while the replay is in flight
        release.set()
        await replaying
        mode.clear()
        await worker.close()  # replays whatever is still spilled
        snapshot = await fresh().freeze("r-race2")
        assert snapshot.incomplete, "mark_incomplete('r-race2', 'c2') was acknowledged, yet the rollout froze complete"
    finally:
        await proxy.stop()


# Fixed: was a strict xfail (BUG) until the fix landed; now a regression test.
async def test_concurrent_replays_do_not_raise(s3_server, fresh, tmp_path):
    proxy = await _proxy(s3_server)
    try:
        down = {"c1"}

        async def rule(request: Any) -> Any:
            if any(_marker_put_for(request, cid) for cid in down):
                return Respond(503, not_implemented_xml("ServiceUnavailable", "down"), "Service Unavailable")
            return None

        proxy.rule = rule
        spill = tmp_path / "spill"
        worker = fresh(endpoint_url=proxy.endpoint, spill_dir=spill, botocore_config=_no_retry_config())
        await worker.mark_incomplete("r-dbl", "c1")
        down.clear()
        other = fresh(spill_dir=spill)  # a second client (same host, same spill_dir)
        results = await asyncio.gather(worker.replay_spill(), other.replay_spill(), return_exceptions=True)
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert not os.path.exists(worker._spill_file.path)
    finally:
        await proxy.stop()


# Fixed: was a strict xfail (BUG) until the fix landed; now a regression test.
async def test_spilled_marker_reaches_the_bucket_once_the_store_is_back(s3_server, fresh, tmp_path):
    proxy = await _proxy(s3_server)
    try:
        down = {"on": True}

        async def rule(request: Any) -> Any:
            if down["on"] and _marker_put_for(request, "c1"):
                return Respond(503, not_implemented_xml("ServiceUnavailable", "down"), "Service Unavailable")
            return None

        proxy.rule = rule
        worker = fresh(endpoint_url=proxy.endpoint, spill_dir=tmp_path / "spill", botocore_config=_no_retry_config())
        await worker.put(simple_entry("r-late", "c0"))
        await worker.mark_incomplete("r-late", "c1")  # acknowledged (spilled)
        down["on"] = False
        # The store is healthy again; the worker keeps serving other calls for a while.
        for i in range(5):
            await worker.put(simple_entry("r-busy", f"c{i}", text=f"t{i}"))
            await worker.begin_call("r-busy", f"d{i}")
        snapshot = await fresh().freeze("r-late")
        assert snapshot.incomplete, "acknowledged marker for r-late is still only in the worker's local spill"
    finally:
        await proxy.stop()


def _spill_many(url: str, spill_dir: str, keys: list[str]) -> None:
    """Another worker process of the host: spills its markers through the real locking path."""
    from s3capture.store import S3TokenStore

    store = S3TokenStore(url, spill_dir=spill_dir)
    for key in keys:
        store._spill(key)


async def test_markers_spilled_by_other_processes_during_replays_are_never_lost(s3_env, fresh, tmp_path, bucket_url):
    """Three processes spill 40 markers each (flock + inode check) while this one replays in a loop;
    every marker must end up in the bucket."""
    import concurrent.futures
    import multiprocessing

    spill = str(tmp_path / "spill")
    store = fresh(spill_dir=spill)
    prefix = store.layout.rollout("r-many")
    per_process = [[f"{prefix}log/x/c{p}-{i}/{p:04d}{i:04d}" for i in range(40)] for p in range(3)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(3, mp_context=ctx) as pool:
        futures = [pool.submit(_spill_many, bucket_url, spill, keys) for keys in per_process]
        while not all(f.done() for f in futures):
            await store.replay_spill()
            await asyncio.sleep(0.01)
        for future in futures:
            future.result()
    await store.replay_spill()
    listed = set()
    for item in await store._list(prefix + "log/x/"):
        listed.add(item.key)
    missing = [k for keys in per_process for k in keys if k not in listed]
    assert not missing, f"{len(missing)} spilled markers never reached the bucket, e.g. {missing[:3]}"


def _down(proxy: FaultProxy, *cids: str) -> None:
    async def rule(request: Any) -> Any:
        if any(_marker_put_for(request, cid) for cid in cids):
            return Respond(503, not_implemented_xml("ServiceUnavailable", "down"), "Service Unavailable")
        return None

    proxy.rule = rule


# Regression tests for a spill breaker (docs/reliability.md, finding 18).
async def test_a_marker_spilled_after_a_torn_line_is_replayed(s3_server, fresh, tmp_path):
    """A full disk (or a killed writer) tore a line; the next acknowledged marker was appended onto
    the fragment and skipped with it at replay: lost."""
    proxy = await _proxy(s3_server)
    try:
        _down(proxy, "c1")
        spill = tmp_path / "spill"
        worker = fresh(endpoint_url=proxy.endpoint, spill_dir=spill, botocore_config=_no_retry_config())
        await worker.put(simple_entry("r-torn", "c0"))
        await worker.put(simple_entry("r-after", "c0"))
        await worker.mark_incomplete("r-torn", "c1")  # spilled
        (path,) = list(spill.iterdir())
        with open(path, "ab") as handle:  # the disk filled up mid-append: no newline
            handle.write(b'{"bucket": "' + worker.bucket.encode() + b'", "ke')
        await worker.mark_incomplete("r-after", "c1")  # spilled after the torn line, acknowledged
        proxy.rule = None
        assert await worker.replay_spill() == 2
        await worker.close()
        for rid in ("r-torn", "r-after"):
            assert (await fresh().freeze(rid)).incomplete, rid
    finally:
        await proxy.stop()


async def test_a_spill_that_fails_keeps_the_callers_error_and_cancellation(s3_server, fresh, tmp_path):
    """A spill folder that cannot be written (read-only, full, a dangling link) turned the store's
    error into a bare OSError, and a cancellation into an OSError the caller never asked for."""
    proxy = await _proxy(s3_server)
    try:
        _down(proxy, "c1")
        target = tmp_path / "gone"
        spill = tmp_path / "spill"
        worker = fresh(endpoint_url=proxy.endpoint, spill_dir=spill, botocore_config=_no_retry_config())
        # Made when the store was built; broken afterwards (a dangling link: makedirs raises
        # FileExistsError), as a folder removed or unmounted under a running worker is.
        spill.rmdir()
        spill.symlink_to(target, target_is_directory=True)
        await worker.put(simple_entry("r", "c0"))
        from s3capture.errors import StoreError

        try:
            await worker.mark_incomplete("r", "c1")
        except StoreError as error:
            assert any("could not be spilled" in note for note in getattr(error, "__notes__", ())), error
            assert isinstance(error.__cause__, OSError)
        else:
            raise AssertionError("a marker neither stored nor spilled was acknowledged")
        held = asyncio.Event()

        async def hold(request: Any) -> Any:
            if _marker_put_for(request, "c2"):
                held.set()
                await asyncio.sleep(30)
            return None

        proxy.rule = hold
        task = asyncio.ensure_future(worker.mark_incomplete("r", "c2"))
        await asyncio.wait_for(held.wait(), 10)
        task.cancel()
        await asyncio.wait([task], timeout=10)
        assert task.cancelled(), task  # the caller's cancellation, not an OSError
    finally:
        await proxy.stop()


async def test_a_marker_for_a_retired_rollout_is_refused_even_when_its_put_fails(s3_server, fresh, tmp_path):
    """The fence read said retired while the PUT failed: the marker was spilled and acknowledged,
    where a healthy store refuses it (there is no snapshot left to mask)."""
    from s3capture.protocols import TokenCaptureRetiredError

    await fresh().put(simple_entry("r", "c0"))
    builder = fresh(fence_grace=0.0)
    snapshot = await builder.freeze("r")
    assert await builder.drop("r", snapshot.snapshot_id, snapshot.version)
    proxy = await _proxy(s3_server)
    try:
        _down(proxy, "c1")
        worker = fresh(endpoint_url=proxy.endpoint, spill_dir=tmp_path / "spill", botocore_config=_no_retry_config())
        try:
            await worker.mark_incomplete("r", "c1")
        except TokenCaptureRetiredError:
            pass
        else:
            raise AssertionError("a marker for a retired rollout was acknowledged")
        assert not list((tmp_path / "spill").glob("*.jsonl"))
    finally:
        await proxy.stop()


async def test_a_replay_into_a_retired_rollout_is_reported(s3_server, fresh, tmp_path, caplog):
    """The spill's documented exception: a marker spilled while the store was down and replayed
    after a drop consumed the rollout. The replay said nothing; its owner must hear of it."""
    proxy = await _proxy(s3_server)
    try:
        _down(proxy, "c1")
        worker = fresh(endpoint_url=proxy.endpoint, spill_dir=tmp_path / "spill", botocore_config=_no_retry_config())
        await worker.put(simple_entry("r", "c0"))
        await worker.mark_incomplete("r", "c1")  # spilled
        builder = fresh(fence_grace=0.0)
        snapshot = await builder.freeze("r")  # before the replay: it cannot see the marker
        assert await builder.drop("r", snapshot.snapshot_id, snapshot.version)
        proxy.rule = None
        with caplog.at_level("ERROR", logger="s3capture"):
            assert await worker.replay_spill() == 1
        assert "after it was retired" in caplog.text and "log/x/c1/" in caplog.text
    finally:
        await proxy.stop()


def test_lines_a_spill_cannot_replay_are_kept_aside(tmp_path):
    """Lines of another store, with a key outside the root or over S3's key limit, or with fields
    of a newer writer were logged and deleted with the claim; they are now kept in
    ``<spill file>.rejected``."""
    import json

    from s3capture.spill import Spill

    spill = Spill(tmp_path, endpoint="http://a", bucket="b", root="run/")
    spill.append("run/rollouts/r/log/x/c1/1-x")
    ours = dict(spill.identity)
    lines = [
        dict(ours, endpoint="http://other", key="run/rollouts/r/log/x/c2/1-y"),
        dict(ours, key="elsewhere/rollouts/r/log/x/c3/1-z"),
        dict(ours, key="run/rollouts/r/log/x/c4/1-w", v=2, body_zstd="AAAA"),
        # Spilled before a rollout prefix had to leave room for a hashed marker: S3 refuses the
        # key, so every replay failed on it and re-sent it for ever (a review, 2026-12-02).
        dict(ours, key="run/rollouts/" + "R" * 950 + "/log/x/~h" + "a" * 64 + "/1-v"),
    ]
    with open(spill.path, "ab") as handle:
        for line in lines:
            handle.write(json.dumps(line).encode() + b"\n")
    claims = spill.claim()
    assert list(spill.read(claims)) == ["run/rollouts/r/log/x/c1/1-x"]
    for claim in claims:
        claim.release()
    kept = [json.loads(line) for line in open(spill.path + ".rejected", "rb")]
    assert [item["key"] for item in kept] == [line["key"] for line in lines]


def test_two_profiles_with_their_own_endpoints_get_their_own_spill_files(tmp_path, monkeypatch):
    """The spill named its store by the configured endpoint only: two clients whose AWS profiles
    point at different stores (same bucket and prefix) shared one spill file, and one replayed the
    other's markers into the wrong store."""
    from s3capture.store import S3TokenStore

    config = tmp_path / "config"
    config.write_text(
        "[profile a]\nendpoint_url = http://127.0.0.1:1\nregion = us-east-1\n"
        "[profile b]\nendpoint_url = http://127.0.0.1:2\nregion = us-east-1\n"
    )
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    paths = {}
    for profile in ("a", "b"):
        monkeypatch.setenv("AWS_PROFILE", profile)
        store = S3TokenStore("s3://bucket/run", spill_dir=tmp_path / "spill")
        assert store._spill_file is not None
        paths[profile] = (store._spill_file.path, store._spill_file.identity["endpoint"])
    assert paths["a"][1] == "http://127.0.0.1:1" and paths["b"][1] == "http://127.0.0.1:2"
    assert paths["a"][0] != paths["b"][0]


def test_a_spill_file_an_earlier_version_named_aws_is_replayed_after_an_upgrade(tmp_path):
    """Before 2026-12-02 a store whose endpoint came from an AWS profile was named ``aws`` in the
    spill; after the upgrade it is named by that endpoint, and its old file was never replayed (a
    review of the fix): an acknowledged marker never landed."""
    from s3capture.spill import Spill

    old = Spill(tmp_path, endpoint=None, bucket="b", root="run/")
    old.append("run/rollouts/r/log/x/c1/1-x")
    new = Spill(tmp_path, endpoint="http://127.0.0.1:1", bucket="b", root="run/", legacy_endpoints=(None,))
    assert new.path != old.path and new.pending()
    claims = new.claim()
    assert list(new.read(claims)) == ["run/rollouts/r/log/x/c1/1-x"]
    for claim in claims:
        claim.release()
    assert not new.pending() and not old.pending()
    # A store that is AWS S3 itself has no legacy name beside its own.
    plain = Spill(tmp_path, endpoint=None, bucket="b", root="run/", legacy_endpoints=(None,))
    assert plain._legacy == []


def test_a_rejected_file_that_cannot_be_written_does_not_stop_the_replay(tmp_path, caplog):
    """A full disk made writing ``<spill>.rejected`` fail, and with it every replay of the markers
    beside the unreplayable line (a review of the fix)."""
    import json

    from s3capture.spill import Spill

    spill = Spill(tmp_path, endpoint="http://a", bucket="b", root="run/")
    spill.append("run/rollouts/r/log/x/c1/1-x")
    with open(spill.path, "ab") as handle:
        handle.write(json.dumps(dict(spill.identity, key="run/rollouts/r/log/x/c2/1-y", v=2)).encode() + b"\n")
    os.mkdir(spill.path + ".rejected")  # cannot be opened for appending, as on a full disk
    claims = spill.claim()
    with caplog.at_level("ERROR", logger="s3capture"):
        assert list(spill.read(claims)) == ["run/rollouts/r/log/x/c1/1-x"]
    assert "could not keep 1 unreplayable spill line" in caplog.text and "c2/1-y" in caplog.text
    for claim in claims:
        claim.release()
