"""The read side of ``S3CaptureLedger``: ``manifest``, ``has_rows`` and the checked, cached row reader.

``_LedgerManifest`` is a private mixin of ``s3capture.ledger.S3CaptureLedger`` (whose ``resolve``
reads rows through ``_load`` too); the stored row shapes are in ``s3capture.ledger_rows``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from s3capture.layout import is_folder_marker, parse_ledger_key
from s3capture.ledger_records import (
    LEDGER_CONFLICTING_ROWS_REASON,
    LEDGER_FOREIGN_OBJECT_REASON,
    LEDGER_MISSING_PARENT_REASON,
    LEDGER_UNREADABLE_ROW_REASON,
    UNCOMMITTED_CALL_REASON,
    CallRecord,
    ManifestFailure,
    RolloutManifest,
    to_wire,
)
from s3capture.ledger_rows import (
    _FAILURE_FORMAT,
    _MAX_ROW_BYTES,
    _ROW_FORMAT,
    _ZSTD_MAGIC,
    _Cached,
    _decompress,
    _Failure,
    _heap_estimate,
    _Row,
    _sha,
)
from s3capture.protocols import RolloutRetiredError
from s3capture.errors import ListingError
from s3capture.records import RecordError
from s3capture.rollouts import RolloutObjects
from s3capture.transport import ListedObject, beside_confirmation, gather_fail_fast

log = logging.getLogger("s3capture")

_T = TypeVar("_T")


class _LedgerManifest(RolloutObjects):
    """``manifest``, ``has_rows`` and the row reader of ``S3CaptureLedger`` (private mixin)."""

    # ------------------------------------------------------------------ reads
    async def _retired(self, prefix: str) -> bool:
        # The tombstone, not the fence: it is written before the retired fence, and delete removes
        # it (after the rows) before the fence.
        return await self._present(prefix + "retired")

    async def _load(self, key: str, sha: str, kind: type) -> Any:
        """The decoded row at ``key`` (cache or one GET); ``None`` if absent. Raises ``RecordError``."""
        cached = self._cache.get(key)
        if cached is not None:
            return cached.value

        def check(data: bytes) -> tuple[Any, int]:
            if data.startswith(_ZSTD_MAGIC):
                data = _decompress(data)
            if _sha(data) != sha:
                raise RecordError("ledger object bytes do not match the SHA-256 in their key")
            try:
                value: Any = msgspec.json.decode(data, type=kind)
            except (msgspec.DecodeError, RecursionError) as error:  # RecursionError: nested past the stack
                raise RecordError(f"not an s3capture ledger object: {error}") from None
            expected = _ROW_FORMAT if kind is _Row else _FAILURE_FORMAT
            if value.format != expected:
                raise RecordError(f"unknown ledger object format {value.format!r} (newer s3capture?)")
            if msgspec.json.encode(value, order="sorted") != data:
                # Valid JSON that is not what a writer produces (a repeated key decodes last-wins, ...).
                raise RecordError("ledger object bytes are not the canonical encoding of what they decode to")
            return value, len(data)

        checked = await self._get_checked(key, _MAX_ROW_BYTES, check)
        if checked is None:
            return None
        value, size = checked
        self._cache.put(key, _Cached(value, _heap_estimate(value, size)))
        return value

    async def manifest(self, rollout_id: str) -> dict:
        """The rollout's token-free ledger as plain wire data (validates as Gym's ``RolloutManifest``).

        Shape: ``{"schema_version": 2, "rollout_id", "records": [CallRecord...], "failures":
        [{"schema_version", "model_call_id", "reason"}...]}``; records sorted by ``admitted_at``
        then call id. A call id with more than one committed row is listed under ``failures`` with
        reason ``conflicting_ledger_rows`` instead of under ``records``; an unreadable row gives
        ``unreadable_ledger_row``, an object s3capture did not write ``foreign_ledger_object`` (its
        key as the call id), and a ``begin_call`` intent without any row Gym's
        ``request_finished_without_staged_coordinates``, and a row whose ``parent_call_id`` has no
        committed row ``missing_parent_row``, so such a rollout never looks trainable. Requests: one LIST page per 1,000 ledger keys with a GET of the retire tombstone, then one
        GET per uncached row beside one LIST after the last key (confirming the end) and a second
        GET of the tombstone, then a third GET of the tombstone: three round trips (``docs/ledger.md``). Every failure code
        and its meaning: ``docs/reasons.md``.

        Raises:
            RolloutRetiredError: the rollout was retired before or while the manifest was read.
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request (``ListingError`` for a listing that cannot
                be trusted after retries).
        """
        prefix = self.layout.rollout(rollout_id)
        if not self._probe_listing:
            return await self._manifest_listed(rollout_id, prefix, ())
        return await self._probed(
            rollout_id, prefix, lambda require, listed: self._manifest_listed(rollout_id, prefix, require, listed)
        )

    async def _probed(
        self,
        rollout_id: str,
        prefix: str,
        read: Callable[[tuple[str, ...], asyncio.Event], Awaitable[_T]],
    ) -> _T:
        """``read(require, listed)`` behind a listing probe (``probe_listing``): PUT an empty
        ``ledger/.probe/<uuid>``, let ``read`` list ``ledger/`` requiring it and set ``listed``
        once its listing showed it, and delete the probe then (beside ``read``'s GETs), or when
        ``read`` fails or its caller cancels it.

        A retire or delete racing the read removes the probe with the rest, and the listing never
        shows it: retired, that is ``RolloutRetiredError``, as without the probe (a breaker,
        2026-12-04: it was ``ListingError``); deleted, the id is unused now, and one more probe
        reads it so."""
        # A listing that shows a key created after the call began shows every row acknowledged
        # before it, where a listing lags creations (docs/reliability.md, "Listings that lag").
        for attempt in range(2):
            probe = f"{prefix}ledger/.probe/{uuid.uuid4().hex}"
            listed = asyncio.Event()

            async def remove_probe(probe: str = probe, listed: asyncio.Event = listed) -> None:
                try:
                    await listed.wait()
                finally:  # also when the read failed or its caller cancelled it
                    await self._remove_probe(probe)

            remover = asyncio.ensure_future(remove_probe())
            try:
                await self._put(probe, b"")
                try:
                    return await read((probe,), listed)
                except ListingError as error:
                    if await self._present(probe):
                        raise
                    removed = error
            finally:
                listed.set()
                await asyncio.shield(remover)
            if await self._retired(prefix):
                raise RolloutRetiredError(f"rollout {rollout_id!r} was retired while it was read") from None
            if attempt:
                raise removed
        raise AssertionError("unreachable")  # pragma: no cover

    async def _manifest_listed(
        self, rollout_id: str, prefix: str, require: tuple[str, ...], listed: asyncio.Event | None = None
    ) -> dict:
        """``manifest`` from a listing of ``ledger/`` that shows ``require`` (the probe), setting
        ``listed`` once it does."""
        listing, retired = await asyncio.gather(self._list(f"{prefix}ledger/", require=require), self._retired(prefix))
        if listed is not None:
            listed.set()  # the probe has done its work: it is deleted beside the GETs
        if retired:
            raise RolloutRetiredError(f"rollout {rollout_id!r} is retired; delete it to reuse the id")

        # The listing's end is confirmed by one more LIST, beside the rows' GETs: a listing cut
        # short hides the ledger's last keys (its rows, which sort after the failures and
        # intents), and the manifest would read as whole (Transport.confirm_listing_end).
        async def confirmed_end() -> list[ListedObject]:
            more = await self.transport.confirm_listing_end(f"{prefix}ledger/", listing)
            # The tombstone lies outside ledger/, so this LIST cannot show it: read it again after
            # the LIST, as _manifest_of's own GET follows the first one, or a retire that deleted
            # rows while this LIST ran would go unseen (a breaker, 2026-12-02).
            if not more and await self._retired(prefix):
                raise RolloutRetiredError(f"rollout {rollout_id!r} was retired while its manifest was read")
            return more

        return await beside_confirmation(
            confirmed_end(), listing, lambda whole: self._manifest_of(rollout_id, prefix, whole)
        )

    async def _manifest_of(self, rollout_id: str, prefix: str, listing: list[ListedObject]) -> dict:
        """``manifest``'s result for the listed ledger keys (GETs of the rows not cached and of the
        retire tombstone, in parallel)."""
        rows: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
        fails: list[tuple[str, str, bool, str]] = []
        intents: set[str] = set()
        failures: set[tuple[str, str]] = set()
        for item in listing:
            rel = item.key[len(prefix) :]
            parsed = parse_ledger_key(rel)
            if parsed is None and is_folder_marker(rel, item.size):
                continue  # ``ledger/`` or a deeper folder of an s3fs or rclone mount: no row
            if parsed is None:
                failures.add((rel, LEDGER_FOREIGN_OBJECT_REASON))
            elif parsed[0] == "row":
                rows[parsed[1]].append((item.key, parsed[3]))
            elif parsed[0] == "fail":
                fails.append((item.key, parsed[1], parsed[2] == "~h", parsed[3]))
            elif parsed[0] == "intent":
                intents.add(parsed[1])
            # parsed[0] == "probe": a manifest's listing probe (``probe_listing``), no row
        records: list[CallRecord] = []

        async def load_row(cid: str, key: str, sha: str) -> None:
            try:
                row = await self._load(key, sha, _Row)
            except RecordError as error:
                log.warning("unreadable ledger row %s: %s", key, error)
                row = None
            if row is None or row.rollout_id != rollout_id or row.record.model_call_id != cid:
                failures.add((cid, LEDGER_UNREADABLE_ROW_REASON))
            else:
                records.append(row.record)

        async def load_failure(key: str, cid: str, hashed: bool, sha: str) -> None:
            try:
                failure = await self._load(key, sha, _Failure)
            except RecordError as error:
                log.warning("unreadable ledger failure row %s: %s", key, error)
                failure = None
            if failure is None or failure.rollout_id != rollout_id or not failure.reason or not failure.model_call_id:
                failures.add((cid, LEDGER_UNREADABLE_ROW_REASON))
            elif hashed and _sha(failure.model_call_id.encode("utf-8", "surrogatepass")) != cid[2:]:
                failures.add((cid, LEDGER_UNREADABLE_ROW_REASON))
            elif not hashed and failure.model_call_id != cid:
                failures.add((cid, LEDGER_UNREADABLE_ROW_REASON))
            else:
                failures.add((failure.model_call_id, failure.reason))

        jobs = []
        for cid, variants in rows.items():
            if len(variants) > 1:
                failures.add((cid, LEDGER_CONFLICTING_ROWS_REASON))
            else:
                jobs.append(load_row(cid, *variants[0]))
        jobs.extend(load_failure(*f) for f in fails)

        async def still_live() -> None:
            # Retire writes its tombstone before deleting a row, so a LIST that missed rows a
            # retire deleted is always followed by a tombstone this GET sees: never hand back a
            # ledger with a hole as live.
            if await self._retired(prefix):
                raise RolloutRetiredError(f"rollout {rollout_id!r} was retired while its manifest was read")

        # Reads only: the first failure cancels the rest, so they do not hold the transport's
        # request slots while the confirming LIST waits behind them (a review, 2026-12-04).
        await gather_fail_fast([still_live(), *jobs])
        accounted = set(rows) | {cid for cid, _ in failures}
        failures.update((cid, UNCOMMITTED_CALL_REASON) for cid in intents - accounted)
        committed = {record.model_call_id for record in records}
        failures.update(
            (record.model_call_id, LEDGER_MISSING_PARENT_REASON)
            for record in records
            if record.parent_call_id is not None and record.parent_call_id not in committed
        )
        records.sort(key=lambda r: (r.admitted_at is None, r.admitted_at or 0.0, r.model_call_id))
        manifest = RolloutManifest(
            rollout_id=rollout_id,
            records=records,
            failures=[ManifestFailure(model_call_id=c, reason=r) for c, r in sorted(failures)],
        )
        return to_wire(manifest)

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether any committed or failure row exists (two round trips).

        Requests: two LISTs (one key each) together, then a GET of the retire tombstone: read after
        the LISTs, it also catches a retire that deleted rows while they were listed. When neither
        LIST shows a key, both are asked again beside that GET: Gym's sink admits an unresolved
        continuation of a rollout without rows as a fresh root, so one LIST answer that left out
        the only key (a store's bug, a page lost on the way) must not decide it alone. With
        ``probe_listing``, a False answer comes instead from a whole listing of ``ledger/`` that
        shows a probe PUT after those LISTs (one page per 1,000 intents, and a LIST confirming
        its end), then the tombstone GET beside the probe's DELETE: five round trips in all, and
        a row acknowledged before the call is never missed through a listing that lags it.

        Raises:
            RolloutRetiredError: the rollout is retired, so admission can refuse its late calls.
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request.
        """
        prefix = self.layout.rollout(rollout_id)
        prefixes = (f"{prefix}ledger/row/", f"{prefix}ledger/fail/")
        # After the folder itself: its marker (``ledger/row/``, what s3fs, ``rclone mkdir`` or a
        # console writes) is no row, and a one-key LIST that showed it answered True with no row
        # stored (an audit, 2026-12-04). A store that ignores StartAfter still shows it: True, the
        # answer that admits nothing as a fresh root.
        pages = await asyncio.gather(*(self._list_page(p, 1, start_after=p) for p in prefixes))
        # A truncated page says keys follow, even when it shows none itself.
        found = any(page.objects or page.next_token for page in pages)
        if found:
            retired = await self._retired(prefix)
        elif self._probe_listing:
            # Behind a probe, a listing shows every row acknowledged before the call, where
            # listings lag creations (docs/reliability.md, "Listings that lag").
            return await self._probed(
                rollout_id, prefix, lambda require, listed: self._rows_listed(rollout_id, prefix, require, listed)
            )
        else:
            row_page, fail_page, retired = await asyncio.gather(
                self._list_page(prefixes[0], 1, start_after=prefixes[0]),
                self._list_page(prefixes[1], 1, start_after=prefixes[1]),
                self._retired(prefix),
            )
            found = any(page.objects or page.next_token for page in (row_page, fail_page))
        if retired:
            raise RolloutRetiredError(f"rollout {rollout_id!r} is retired; delete it to reuse the id")
        return found

    async def _rows_listed(self, rollout_id: str, prefix: str, require: tuple[str, ...], listed: asyncio.Event) -> bool:
        """``has_rows`` from a whole listing of ``ledger/`` that shows ``require`` (the probe)
        and whose end is confirmed, then a GET of the retire tombstone."""
        listing = await self._list(f"{prefix}ledger/", require=require, confirm_end=True)
        listed.set()
        kinds = (parse_ledger_key(item.key[len(prefix) :]) for item in listing)
        found = any(parsed is not None and parsed[0] in ("row", "fail") for parsed in kinds)
        if await self._retired(prefix):
            raise RolloutRetiredError(f"rollout {rollout_id!r} is retired; delete it to reuse the id")
        return found
