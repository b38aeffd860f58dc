"""One shard: read its rollouts (from the parent's listing), build their trajectories, write and
publish the data file, then the manifest (``export_shard``, the function every engine runs)."""

from __future__ import annotations

import asyncio
import collections
import datetime as _dt
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from s3capture.export.destinations import _Destination, _open_destination, _S3Destination
from s3capture.export.records import ExportJob, RolloutRecord, ShardManifest, ShardResult, source_endpoint_of
from s3capture.export.writers import _Built, _open_writer, _Writer

_REPORT: Callable[[tuple[int, int, int, int]], Any] | None = None
"""Where ``export_shard`` reports progress, once per rollout: ``(rollouts, trajectories, tokens,
bytes_read)``. Set in each pool worker by the local engine (a queue's ``put``), in the parent for
in-process shards; ``None``: no progress."""


class _Clients:
    """The source store and destination client of one thread of a worker, kept across shards.

    Opening an S3 client costs about half a second of CPU (botocore's endpoint rules), so a
    worker opens one per (job source, destination) on a long-lived event loop of its own and
    reuses it for every shard it runs; they are closed at exit (``close``)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.session: Any = None
        self.opened: dict[tuple, tuple[Any, _Destination]] = {}

    def get(self, job: ExportJob) -> tuple[Any, _Destination]:
        from s3capture.store import S3TokenStore

        key = (
            job.url,
            job.dest,
            job.endpoint_url,
            job.transport,
            job.cache_bytes,
            job.concurrency,
            job.lock_token,
            job.probe_listing,
        )
        found = self.opened.get(key)
        if found is None:
            if (
                self.session is None
                and (job.transport or os.environ.get("S3CAPTURE_TRANSPORT", "aioboto3")) != "obstore"
            ):
                import aioboto3

                self.session = aioboto3.Session()  # credentials and the service model load once
            store = S3TokenStore(
                job.url,
                endpoint_url=job.endpoint_url,
                session=self.session,
                transport=job.transport,
                cache_bytes=job.cache_bytes,
                probe_listing=job.probe_listing,
                max_concurrency=max(8, min(64, 4 * job.concurrency)),
            )
            found = self.opened[key] = (store, _open_destination(job, self.session))
        if isinstance(found[1], _S3Destination):
            # The client outlives one export in a long-lived worker (a Ray worker process): it
            # checks the claim of the export it works for now, not of the first one it served
            # (whose claim is gone once that export ended; a breaker, 2026-12-02).
            found[1].owner = job.run_tag
        return found

    def close(self) -> None:
        async def close_all() -> None:
            for store, dest in self.opened.values():
                for client in (store, dest):
                    try:
                        await client.close()
                    except Exception:  # noqa: BLE001 - closing at exit is best effort
                        pass

        if self.loop.is_closed():
            return
        try:
            self.loop.run_until_complete(close_all())
        finally:
            self.opened.clear()
            self.loop.close()


_THREAD = threading.local()


def _clients() -> _Clients:
    """This thread's ``_Clients`` (created on first use; closed at interpreter exit)."""
    clients = getattr(_THREAD, "clients", None)
    if clients is None:
        import atexit

        clients = _THREAD.clients = _Clients()
        atexit.register(clients.close)
    return clients


def _close_clients() -> None:
    """Close this thread's clients now (the in-process engine's thread, when it is done)."""
    clients = getattr(_THREAD, "clients", None)
    if clients is not None:
        _THREAD.clients = None
        clients.close()


def _verdict(build: Any, snapshot: Any) -> tuple[bool, list[str]]:
    """``(masked, reasons)`` of a build: masked when the builder or the snapshot says so, or when
    nothing trainable came out (no trajectory, misaligned arrays, no generated token)."""
    reasons = list(getattr(build, "mask_reasons", None) or [])
    masked = bool(build.masked)
    if snapshot.incomplete:
        masked = True
        for reason in getattr(snapshot, "reasons", ()) or ("capture_incomplete",):
            if reason not in reasons:
                reasons.append(reason)
    trajectories = list(build.trajectories or ())
    if not trajectories:
        masked = True
        if not reasons:
            reasons.append("no_trajectory")
    for t in trajectories:
        if not (len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)):
            masked = True
            reasons.append(f"misaligned_trajectory:{t.chain_id}")
        elif not masked and not any(t.loss_mask):
            masked = True
            reasons.append(f"no_generated_tokens:{t.chain_id}")
    if masked and not reasons:
        reasons.append("masked")
    return masked, reasons


NOT_SEALED = "not_sealed: frozen, but changed since its freeze (or its freeze did not finish); --freeze seals it again"
"""The skip reason of a frozen rollout that has no sealed manifest of its listed state."""


class ListedRollout(msgspec.Struct, frozen=True):
    """A rollout of a shard task with the objects the parent's listing showed under its prefix
    (``S3TokenStore.rollouts``' own listing): ``export_shard`` reads its snapshot from them
    (``read_snapshot(listing=...)``) instead of listing the rollout again. ``info`` is its
    ``RolloutInfo``; ``listing`` its ``ListedObject``s. ``supersedes``: the destination holds
    trainable rows of an earlier snapshot of it, so a masked build is written (``masked=true``)
    even under ``masked="skip"``, and the newest rows of the rollout are never trainable."""

    info: Any
    listing: tuple = ()
    supersedes: bool = False
    mask_only: bool = False
    """A frozen rollout changed since its freeze (unsealed, and no ``--freeze`` to seal it again)
    whose trainable rows the destination holds: it is read unsealed and written only if that
    state is masked (rows ``masked=true`` over the trainable ones); otherwise it is skipped
    ``not_sealed`` as before."""

    @property
    def rollout_id(self) -> str:
        return self.info.rollout_id


async def _read(
    store: Any, job: ExportJob, info: Any, listing: Any = None, mask_only: bool = False
) -> tuple[Any, bool]:
    """The snapshot to export and whether it is sealed (a ``drop`` can consume it). With
    ``listing`` (the parent's listing of the rollout) the snapshot is that listed state's, read
    without a LIST; when that read fails (the manifest vanished: a drop or retire since the
    listing) or finds objects vanished, the rollout is read again from a fresh LIST, so the
    outcome is the one of its current state."""
    from s3capture.errors import SnapshotNotSealedError, StoreError

    if info.state == "open" or mask_only:
        if job.freeze and not mask_only:
            return await store.freeze(info.rollout_id), True
        return await store.read_snapshot(info.rollout_id, sealed=False, listing=listing), False
    if listing is not None:
        try:
            snapshot = await store.read_snapshot(info.rollout_id, sealed=True, listing=listing)
        except (StoreError, SnapshotNotSealedError):
            pass  # judged again below, on a fresh listing
        else:
            if not any(reason.startswith("vanished:") for reason in snapshot.reasons):
                return snapshot, True
    try:
        return await store.read_snapshot(info.rollout_id, sealed=True), True
    except SnapshotNotSealedError:
        if not job.freeze:
            raise
        return await store.freeze(info.rollout_id), True


async def _read_and_build(
    store: Any, job: ExportJob, info: Any, listing: Any = None, mask_only: bool = False
) -> _Built:
    from s3capture.errors import SnapshotNotSealedError, StoreError
    from s3capture.protocols import TokenCaptureRetiredError
    from s3capture.trajectory import build_rollout_async

    built = _Built(info=info)
    try:
        snapshot, built.sealed = await _read(store, job, info, listing, mask_only)
    except SnapshotNotSealedError as error:
        built.skipped = f"not_sealed: {error}"
        return built
    except TokenCaptureRetiredError as error:
        built.skipped = f"retired: {error}"
        return built
    except StoreError as error:
        built.failed = f"store_error: {type(error).__name__}: {error}"
        return built
    except ValueError as error:  # an id the store cannot hold
        built.failed = f"bad_rollout: {error}"
        return built
    built.snapshot_id, built.version = snapshot.snapshot_id, snapshot.version
    try:
        build = await build_rollout_async(snapshot, builder=job.builder, engine=job.build_with)
    except Exception as error:  # noqa: BLE001 - one rollout's build failure never aborts its shard
        built.failed = f"build_error: {type(error).__name__}: {error}"
        return built
    built.build = build
    built.masked, built.reasons = _verdict(build, snapshot)
    if mask_only and not built.masked:
        built.build, built.skipped = None, NOT_SEALED
    return built


def _consume(built: _Built, writer: _Writer, result: ShardResult, job: ExportJob, supersedes: bool = False) -> None:
    info = built.info
    rid = info.rollout_id
    if built.skipped:
        result.skipped.append((rid, built.skipped))
        return
    if built.failed:
        result.failed.append((rid, built.failed))
        return
    rows = tokens = 0
    # masked="skip" leaves a masked rollout out, except over trainable rows of an earlier export:
    # "the highest version per rollout_id" must then be the masked one.
    written = not built.masked or job.masked == "include" or supersedes
    if written:
        try:
            rows, tokens = writer.add(built)
        except OverflowError as error:
            result.failed.append((rid, f"token_overflow: {error}"))
            return
        if writer.clipped:
            result.clipped.append((rid, writer.clipped))
    result.records.append(
        RolloutRecord(
            rollout_id=rid,
            snapshot_id=built.snapshot_id,
            version=built.version,
            masked=built.masked,
            mask_reasons=list(built.reasons) if built.masked else [],
            written=written,
            rows=rows,
            tokens=tokens,
            sealed=built.sealed,
        )
    )
    result.rows += rows
    result.tokens += tokens
    result.bytes_read += int(getattr(info, "bytes", 0) or 0)
    if _REPORT is not None:
        _REPORT((1, rows, tokens, int(getattr(info, "bytes", 0) or 0)))


async def _export_shard(job: ExportJob, shard: int, rollouts: list[Any], store: Any, dest: _Destination) -> ShardResult:
    started = time.monotonic()
    result = ShardResult(shard=shard)
    source_before = collections.Counter(store.request_counts)
    dest_before = collections.Counter(dest.requests)
    writer = _open_writer(job, dest, shard)
    window: collections.deque[tuple[asyncio.Task, bool]] = collections.deque()
    try:
        for item in rollouts:
            info, listing = (item.info, item.listing) if isinstance(item, ListedRollout) else (item, None)
            supersedes = bool(getattr(item, "supersedes", False))
            mask_only = bool(getattr(item, "mask_only", False))
            window.append((asyncio.create_task(_read_and_build(store, job, info, listing, mask_only)), supersedes))
            if len(window) >= job.concurrency:
                task, supersedes = window.popleft()
                _consume(await task, writer, result, job, supersedes)
        while window:
            task, supersedes = window.popleft()
            _consume(await task, writer, result, job, supersedes)
        result.data, result.bytes_written = await writer.publish()
        if result.data is None and not result.records:
            return result  # every rollout failed or was skipped: nothing decided, nothing to record
        manifest = ShardManifest(
            shard=shard,
            data=result.data,
            data_format=job.format,
            data_bytes=result.bytes_written,
            rows=result.rows,
            builder=job.builder,
            build_with=job.build_with,
            source=job.url,
            source_endpoint=(
                job.source_endpoint if job.source_endpoint is not None else source_endpoint_of(job.endpoint_url)
            ),
            created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            rollouts=result.records,
            token_ids=job.parquet_token_ids(),
        )
        body = msgspec.json.format(msgspec.json.encode(manifest), indent=1)
        result.manifest = job.manifest_name(shard)
        await dest.publish_bytes(result.manifest, body)
        result.bytes_written += len(body)
    except BaseException:
        for task, _ in window:
            task.cancel()
        writer.discard()
        raise
    finally:
        source = collections.Counter(store.request_counts) - source_before
        target = collections.Counter(dest.requests) - dest_before
        result.requests = {f"source:{k}": v for k, v in source.items()}
        result.requests.update({f"dest:{k}": v for k, v in target.items()})
        result.seconds = time.monotonic() - started
    return result


def export_shard(job: ExportJob, shard: int, rollouts: list[Any]) -> ShardResult:
    """Read, build and write one whole shard; the function every engine runs (picklable arguments).

    ``rollouts`` are ``ListedRollout``s (a ``RolloutInfo`` with its listed objects: read without
    a LIST, and from a fresh LIST only when that read finds the rollout changed since) or plain
    ``s3capture.rollouts.RolloutInfo``s (listed again). Each is read with
    ``read_snapshot`` (sealed for a frozen rollout, unsealed for an open one; ``freeze`` instead
    with ``job.freeze``), at most ``job.concurrency`` in flight, built with
    ``s3capture.trajectory.build_rollout_async`` and written in listing order. Then the data file
    ``part-<shard>.parquet`` (or ``.jsonl``) is published atomically, then the manifest
    ``_part-<shard>.manifest.json`` (none when every rollout of the shard failed or was skipped:
    nothing was decided). A rollout that is not sealed, retired, unreadable or fails to
    build is reported in ``skipped`` / ``failed`` and never aborts the shard.

    Raises (nothing durable then) when the shard cannot be written: ``StoreError`` or ``OSError``
    from the destination. Runs on an event loop of its own thread, with clients that stay open for
    the next shard of the same job on that thread: call it from a thread without a running loop.
    An interrupt (``KeyboardInterrupt``: SIGINT, or Ray's ``ray.cancel``) propagates after the
    shard's unfinished work on that loop is cancelled, so the thread's next shard starts clean.
    """
    clients = _clients()
    store, dest = clients.get(job)
    try:
        return clients.loop.run_until_complete(_export_shard(job, shard, list(rollouts), store, dest))
    except (KeyboardInterrupt, SystemExit):
        _settle_after_interrupt(clients)
        raise


def _settle_after_interrupt(clients: _Clients) -> None:
    """Cancel what an interrupt left pending on ``clients.loop`` and let it unwind.

    An interrupt raised in a task escapes ``run_until_complete`` at once and leaves the shard's
    other tasks pending on the loop, which is kept for the next shard: they would wake in that
    shard's run and raise the interrupt again there. Cancelled here, the shard's own clean-up runs
    (its in-flight reads cancelled, its unfinished data file discarded). A loop that does not
    settle is abandoned with its clients; the thread's next shard opens new ones.
    """
    loop = clients.loop
    for _ in range(8):
        pending = asyncio.all_tasks(loop)  # the tasks of this loop not done yet
        if not pending:
            return
        for task in pending:
            task.cancel()
        try:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        except BaseException:  # noqa: BLE001 - a task re-raising the interrupt as it unwinds: go again
            continue
    if getattr(_THREAD, "clients", None) is clients:
        _THREAD.clients = None
