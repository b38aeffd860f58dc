"""Time in s3capture: ages are taken when the listing showed a rollout, and a host's durations count
the time it was suspended (``s3capture.clocks``). Found by a clock breaker (docs/reliability.md,
finding 15): an export that took a while to reach a rollout aged it by that while and exported a
rollout written just before its listing as quiescent; a writer whose clock stopped during a suspend
had a late put acknowledged that a drop had already left out."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from helpers import build_conversation, put_chain, turn_entry
from s3capture import ops
from s3capture.clocks import awake_clock, store_time

MOTO = pytest.mark.parametrize("s3_server", ["moto"], indirect=True)


def test_awake_clock_counts_suspended_time_where_the_system_can() -> None:
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:
        pytest.skip("no CLOCK_BOOTTIME here: awake_clock is time.monotonic")
    before, reading, after = time.clock_gettime(boottime), awake_clock(), time.clock_gettime(boottime)
    assert before <= reading <= after


def test_store_time_is_the_earlier_of_the_stores_clock_and_this_machines() -> None:
    ahead = types.SimpleNamespace(transport=types.SimpleNamespace(store_now=lambda: time.time() + 3600))
    behind = types.SimpleNamespace(transport=types.SimpleNamespace(store_now=lambda: time.time() - 3600))
    assert abs(store_time(ahead) - time.time()) < 5
    assert abs(store_time(behind) - (time.time() - 3600)) < 5
    assert abs(store_time(None) - time.time()) < 5


def test_a_write_stamped_after_the_listing_is_said_to_be_in_the_future() -> None:
    assert ops._ago(300.0) == "5.0m ago"
    assert ops._ago(-660.0).startswith("11.0m in the future by the store's clock")


@MOTO
@pytest.mark.parametrize("paged", [False, True], ids=["one-page", "zz-on-page-2"])
async def test_export_takes_a_rollouts_age_when_its_listing_showed_it(
    fresh: Any, tmp_path: Path, bucket_url: str, proxy: Any, monkeypatch: pytest.MonkeyPatch, paged: bool
) -> None:
    """Rollout zz is written just before the export lists the root; the shard before it is slow
    (a GET held 5 s). Its age used to be taken when its turn came, 5 s later, so it passed
    ``--min-age 3`` and was exported as trainable while its model calls went on. On a later LIST
    page (fetched ahead, awaited after the slow shard) the time was still taken when the page was
    awaited, not answered (a review of the fix)."""
    from s3capture.export import export, read_manifests
    from s3capture.rollouts import RolloutObjects

    writer = fresh()
    for rid in ("a0", "a1"):
        await put_chain(writer, rid, 2)
    await asyncio.sleep(3.5)  # a0 and a1 are quiet for --min-age 3
    turns = build_conversation("zz", 2)
    await writer.put(turn_entry("zz", turns[0]))
    if paged:  # pages of a0's and a1's keys: zz is on the second page
        keys = await writer._list(writer.layout.root + "rollouts/")
        first = sum(1 for item in keys if "/rollouts/zz/" not in item.key)
        monkeypatch.setattr(RolloutObjects, "_rollouts_page_keys", first)
    held: list[str] = []

    async def rule(request: Any) -> None:
        if request.method == "GET" and "/rollouts/a0/log/e/" in request.path and not held:
            held.append(request.path)
            await asyncio.sleep(5.0)  # the first shard takes 5 s
        return None

    proxy.rule = rule
    dest = tmp_path / "out"
    summary = await export(
        bucket_url, str(dest), workers=0, shard_rollouts=1, min_age=3, endpoint_url=proxy.endpoint, build_with="builtin"
    )
    assert held, "the first shard's GET was not held: the test proves nothing"
    assert summary.skipped_reasons == {"not_quiescent": 1}, summary
    written = {r.rollout_id for m in await read_manifests(str(dest)) for r in m.rollouts if r.written}
    assert written == {"a0", "a1"}


@MOTO
async def test_gc_takes_a_rollouts_age_when_its_listing_showed_it(fresh: Any, bucket_url: str, proxy: Any) -> None:
    """The same for gc: a rollout dropped just before gc's listing must stay too young for
    ``older_than`` however long gc took over the rollouts before it (its fence is what refuses
    a late put: removing it early lets a put be acknowledged after the drop)."""
    from s3capture.store import S3TokenStore

    writer = fresh()
    for rid in ("a0", "zz"):
        await put_chain(writer, rid, 1)
    await writer.retire(["a0"])
    await asyncio.sleep(3.5)  # a0's leftovers are older than older_than=3
    await writer.retire(["zz"])
    held: list[str] = []

    async def rule(request: Any) -> None:
        # gc lists a0's prefix again before it deletes: hold that LIST 5 s
        if request.is_list and request.params.get("prefix", "").endswith("/rollouts/a0/") and not held:
            held.append(request.target)
            await asyncio.sleep(5.0)
        return None

    collector = S3TokenStore(bucket_url, endpoint_url=proxy.endpoint)
    try:
        proxy.rule = rule
        report = await ops.gc(collector, older_than=3.0, dry_run=False)
    finally:
        await collector.close()
    assert held, "gc's LIST of a0 was not held: the test proves nothing"
    assert report.too_young == 1, report
    left = {info.rollout_id async for info in fresh().rollouts("retired")}
    assert "zz" in left


@MOTO
async def test_a_put_whose_host_was_suspended_mid_request_re_reads_the_fence(
    fresh: Any, bucket_url: str, proxy: Any
) -> None:
    """A writer's machine is suspended while its entry PUT is on the way: the store receives the
    PUT 2.5 s late, after a freeze, and the writer's ``CLOCK_MONOTONIC`` stood still meanwhile
    (simulated for the writer's thread: ``time.monotonic`` stops, ``CLOCK_BOOTTIME`` goes on, as
    in a suspend). Measured on the monotonic clock the put looked fast, skipped its re-read of the
    fence and was acknowledged, and the drop had consumed a snapshot without it."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:
        pytest.skip("no CLOCK_BOOTTIME here: a suspend is not measurable")
    import s3capture.clocks
    import s3capture.rollouts
    import s3capture.store_writes
    from s3capture.protocols import TokenCaptureFrozenError, TokenCaptureRetiredError
    from s3capture.store import S3TokenStore

    real = time
    window: dict[str, float] = {}
    writer_thread: dict[str, threading.Thread] = {}

    class Suspended(types.ModuleType):
        """``time`` for the writer's thread: monotonic stands still from the held PUT's start
        until it is let through, as CLOCK_MONOTONIC does in a suspend."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def monotonic() -> float:
            now = real.monotonic()
            if (
                threading.current_thread() is not writer_thread.get("t")
                or "start" not in window
                or now < window["start"]
            ):
                return now
            if "end" not in window:
                return window["start"]
            return now - (window["end"] - window["start"])

    shim = Suspended("time")
    modules = (s3capture.clocks, s3capture.rollouts, s3capture.store_writes)  # store_writes: the store's ``time``
    saved = {module: module.time for module in modules if hasattr(module, "time")}
    for module in saved:
        module.time = shim  # type: ignore[attr-defined]
    turns = build_conversation("r", 2)
    builder = fresh()
    await builder.put(turn_entry("r", turns[0]))

    async def rule(request: Any) -> None:
        if request.method == "PUT" and "/log/e/" in request.path and turns[1].call_id in request.path:
            window["start"] = real.monotonic()
            await asyncio.sleep(2.5)
            window["end"] = real.monotonic()
        return None

    proxy.rule = rule
    outcome: dict[str, Any] = {}

    async def write() -> None:
        store = S3TokenStore(bucket_url, endpoint_url=proxy.endpoint)
        try:
            await store.transport.client()
            await store.put(turn_entry("r", turns[1]))
            outcome["acknowledged"] = True
        except (TokenCaptureFrozenError, TokenCaptureRetiredError) as error:
            outcome["refused"] = error
        finally:
            await store.close()

    def run() -> None:
        writer_thread["t"] = threading.current_thread()
        asyncio.run(write())

    thread = threading.Thread(target=run)
    try:
        thread.start()
        await asyncio.sleep(0.5)  # the writer's fence GET said open; its PUT is held
        snapshot = await builder.freeze("r")
        dropped = await builder.drop("r", snapshot.snapshot_id, snapshot.version)
        await asyncio.to_thread(thread.join, 30)
    finally:
        for module, original in saved.items():
            module.time = original  # type: ignore[attr-defined]
    assert "start" in window and "end" in window, "the PUT was not held: the test proves nothing"
    consumed = {entry.model_call_id for entry in snapshot.entries}
    lost = outcome.get("acknowledged") and dropped and turns[1].call_id not in consumed
    assert not lost, "an acknowledged put is in no consumed snapshot"
    assert "refused" in outcome, outcome
