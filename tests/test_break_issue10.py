"""Adversarial review of issue 10 (ops gc/ls/status, the s3:// export claim, doctor, serve, the
Gym registry, ``--masked skip`` supersedes, obstore settle). Each test shows one defect."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers import simple_entry

from s3capture.errors import StoreError

MOTO = pytest.mark.parametrize("s3_server", ["moto"], indirect=True)


@MOTO
async def test_a_renewal_that_lands_after_a_takeover_does_not_resurrect_the_claim(
    fresh: Any, bucket_url: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export paused between its renewal's GET (claim still there) and its PUT for longer than
    the lease is taken over: the next export sees the claim stale, deletes it and proceeds. The
    paused export then resumes, its PUT re-creates the deleted claim and resets ``_renewed``, so
    ``check_held`` passes and both exports hold the prefix (and drop) at once. ``_renew`` never
    asks whether the time since its previous renewal already exceeded ``CLAIM_HOLD``. Found by
    reading ``_S3Destination._renew`` (GET, then an unconditional PUT); a process pause (SIGSTOP,
    a VM pause, a put stuck in retries) between the two is enough. Fix: after the PUT, treat the
    claim as lost when ``time.monotonic() - self._renewed`` (the previous renewal) exceeds
    ``CLAIM_HOLD``."""
    import s3capture.export.destination_s3 as export_module  # the claim's constants are read there

    monkeypatch.setattr(export_module, "CLAIM_RENEW", 0.05)
    monkeypatch.setattr(export_module, "CLAIM_HOLD", 0.5)
    monkeypatch.setattr(export_module, "CLAIM_LEASE", 1.0)
    bucket = bucket_url[len("s3://") :].split("/")[0]
    dest = f"s3://{bucket}/exports-claim"
    first = export_module._S3Destination(dest, endpoint_url=None, transport=None)
    second = export_module._S3Destination(dest, endpoint_url=None, transport=None)
    taken_over = asyncio.Event()
    paused = asyncio.Event()
    real_put = first.transport.put

    async def put_after_pause(key: str, body: bytes, *args: Any, **kwargs: Any) -> Any:
        if key == getattr(first, "_claim", None) and not taken_over.is_set():
            paused.set()  # the renewal's GET found the claim; the process stalls before its PUT
            await taken_over.wait()
        return await real_put(key, body, *args, **kwargs)

    try:
        await first.lock()
        first.transport.put = put_after_pause  # type: ignore[method-assign]
        await asyncio.wait_for(paused.wait(), 10)
        await asyncio.sleep(2.2)  # longer than the lease by the store's clock (1 s LastModified resolution)
        await second.lock()  # the first's claim is stale: taken over (and deleted)
        taken_over.set()
        for _ in range(40):  # the paused renewal resumes and lands its PUT
            await asyncio.sleep(0.05)
        with pytest.raises(StoreError, match="no longer hold"):
            first.check_held()  # two exports must never both hold one prefix
    finally:
        await first.close()
        await second.close()


@MOTO
async def test_a_taken_over_export_never_overwrites_the_new_export_s_shards(
    fresh: Any, bucket_url: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused export whose claim was taken over still publishes the shard it was writing when it
    resumes: the shard number is the one the new export also used (both start from the highest
    shard they found), so its data file and manifest replace the new export's, whose rollouts are
    already dropped. Their rows are gone from the destination and from the bucket. ``check_held``
    guards only the drops; the workers' ``publish`` never checks the claim. Found by pausing the
    first export's data-file PUT (a SIGSTOPped process group behaves alike) while a second export
    takes the prefix over and drops. Fix: a shard publishes under a name no other export can
    choose (e.g. the claim id in the data and manifest names), or the parent checks the claim and
    the destination (no manifest of that number) right before a worker publishes."""
    import io
    import threading

    import s3capture.export.destination_s3 as export_module  # the claim's constants are read there
    from s3capture.export import export, read_manifests

    pq = pytest.importorskip("pyarrow.parquet")
    writer, builder = fresh(), fresh()
    for rid in ("a1", "b1"):
        await writer.put(simple_entry(rid, "c1"))
        await builder.freeze(rid)
    # Below the lease, as CLAIM_HOLD < CLAIM_LEASE; wide enough that the second export's own
    # renewals (every 0.1 s) keep its hold under a loaded machine's slow round trips.
    # (A CI run under heavy load once starved the second export's renewals past a 1.5 s hold.)
    monkeypatch.setattr(export_module, "CLAIM_LEASE", 3.0)
    monkeypatch.setattr(export_module, "CLAIM_HOLD", 2.5)
    monkeypatch.setattr(export_module, "CLAIM_RENEW", 0.1)
    real_renew = export_module._S3Destination._renew
    renewing: list[Any] = []

    async def renew_unless_first(self: Any) -> None:
        renewing.append(self)
        if len(renewing) > 1:  # the first export is "paused": it never renews
            await real_renew(self)

    monkeypatch.setattr(export_module._S3Destination, "_renew", renew_unless_first)
    bucket = bucket_url[len("s3://") :].split("/")[0]
    dest = f"s3://{bucket}/exports-takeover"
    resume = threading.Event()
    first_publish = threading.Event()
    real_publish = export_module._S3Destination.publish

    async def paused_publish(self: Any, name: str, temp: str) -> int:
        if not first_publish.is_set():
            first_publish.set()
            resume.wait(30)  # the first export stalls right before its data file lands
        return await real_publish(self, name, temp)

    monkeypatch.setattr(export_module._S3Destination, "publish", paused_publish)
    first = asyncio.ensure_future(export(bucket_url, dest, workers=0, ids=["a1"], drop=True, fence_grace=0.0))
    for _ in range(200):
        if first_publish.is_set():
            break
        await asyncio.sleep(0.05)
    assert first_publish.is_set()
    await asyncio.sleep(4.2)  # the first export's claim is stale by the store's clock (1 s resolution)
    try:
        second = await export(bucket_url, dest, workers=0, ids=["b1"], drop=True, fence_grace=0.0)
    finally:
        resume.set()
        await first
    assert second.dropped == 1, second
    exported: set[str] = set()
    for manifest in await read_manifests(dest):
        body = s3_client.get_object(Bucket=bucket, Key=f"exports-takeover/{manifest.data}")["Body"].read()
        exported |= {row["rollout_id"] for row in pq.read_table(io.BytesIO(body)).to_pylist()}
    dropped = {info.rollout_id async for info in fresh().rollouts("retired")}
    assert dropped <= exported, f"dropped {sorted(dropped)} but the destination holds rows of {sorted(exported)} only"


@MOTO
async def test_gc_removes_a_retired_rollout_that_has_a_folder_marker(
    fresh: Any, s3_client: Any, bucket_url: str
) -> None:
    """A retired rollout whose prefix also holds a zero-byte "folder" object ``rollouts/<rid>/``
    (what the S3 console's "Create folder", s3fs or rclone's directory markers write) is never
    cleaned: the dry run promises "would delete", but ``gc --yes`` reports it ``skipped (changed
    since the listing)`` on every run, because the streaming listing drops the key ``<prefix>``
    (an empty rel) while the re-check ``_list(prefix)`` returns it, so ``_same_listing`` never
    agrees. Found by comparing the two listings' filters (``_rollout_groups``' ``not rel`` against
    ``S3TokenStore._list``). Fix: compare the re-check with the same filter (drop ``key ==
    rollout_prefix``), or treat the marker as a straggler to delete."""
    import time

    from helpers import split_bucket_url

    from s3capture.ops import gc

    store = fresh()
    await store.put(simple_entry("marked", "c1"))
    await store.retire(["marked"])
    bucket, root = split_bucket_url(bucket_url)
    s3_client.put_object(Bucket=bucket, Key=f"{root}rollouts/marked/", Body=b"")
    plan = await gc(store, 0, now=time.time() + 10)
    assert plan.deleted_rollouts + plan.retired_again == 1, plan
    done = await gc(store, 0, dry_run=False, now=time.time() + 10)
    assert done.skipped == 0 and done.deleted_rollouts + done.retired_again == 1, done


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_doctor_stopped_by_a_signal_leaves_nothing_behind(
    s3_env: Any, s3_client: Any, bucket_url: str, signum: str
) -> None:
    """``s3capture doctor`` promises to delete everything it wrote, but SIGTERM (``timeout``, a CI
    job cancelled, ``kill``, Kubernetes stopping a pod) ends the process at once: nothing handles
    it, the ``finally`` never runs and every probe object stays under
    ``<prefix>/_s3capture-doctor-<uuid>/`` (about 200 with ``--samples 200``). SIGINT (Ctrl-C) is
    the control: it cancels the run and cleans up. Found by killing a doctor run with each signal
    and listing the bucket. Fix: install a SIGTERM handler for the run (as ``s3capture serve``
    does) that cancels the main task, so the cleanup runs."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import split_bucket_url

    bucket, root = split_bucket_url(bucket_url)
    src = os.path.join(os.path.dirname(__file__), os.pardir, "src")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    # Ctrl-C's handler as in a terminal (a shell's background job would inherit SIGINT ignored).
    launcher = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['s3capture'] + sys.argv[1:]; runpy.run_module('s3capture.cli', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, "doctor", bucket_url, "--samples", "1000"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{root}_s3capture-doctor-")
            if listed.get("KeyCount", 0) >= 20:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(getattr(signal, signum))
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{root}_s3capture-doctor-").get("KeyCount", 0)
    assert left == 0, f"{signum}: {left} probe objects left behind (exit {proc.returncode}); stderr: {err[-300:]!r}"
