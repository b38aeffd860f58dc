"""NeMo Gym's ``CaptureLedger`` on S3-compatible storage, without compare-and-swap.

Contract: ``CaptureLedger`` in ``shared/spec/protocols-reference.txt`` (record, record_failure,
manifest, has_rows, resolve, retire, delete). The design, the requests of each operation and the
races that remain are in ``docs/ledger.md``; the keys are in ``s3capture.layout``.

A framework that stages token arrays itself (in its inference workers or a transfer queue) keeps
only token-free rows here: one committed row per staged model call, failure rows for calls that did
not commit, and request-time parent resolution over the committed rows. Staged token data is never
read, written or deleted by this class.

Usage::

    ledger = S3CaptureLedger("s3://bucket/capture")
    resolution = await ledger.resolve(rollout_id, request_items)   # parent of the next call
    await ledger.record(commit)            # a CaptureLedgerCommit (s3capture's, Gym's, or a dict)
    await ledger.record_failure(rollout_id, model_call_id, "worker_capture_failed")
    manifest = await ledger.manifest(rollout_id)   # validates as Gym's RolloutManifest
    await ledger.retire([rollout_id])
    await ledger.close()

``ledger.rollouts(state)`` lists the root's rollouts that hold ledger objects (one streaming LIST).
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
from typing import Any

import msgspec
import zstandard

from s3capture import fingerprint as _fp
from s3capture.layout import MAX_KEY_BYTES, escape_id, parse_ledger_key
from s3capture.ledger_manifest import _LedgerManifest
from s3capture.ledger_records import validate_commit
from s3capture.ledger_rows import (
    _COMPRESS_ABOVE,
    _FAILURE_FORMAT,
    _MAX_ROW_BYTES,
    _ROW_FORMAT,
    _Cached,
    _Failure,
    _heap_estimate,
    _Row,
    _sha,
    _without_folder_markers,
    bounded_reason,
)
from s3capture.protocols import LineageMatch, LineageResolution, RolloutRemovalPayload
from s3capture.records import ParentResolutionStatus, RecordError
from s3capture.rollouts import RolloutScan
from s3capture.store_lineage import request_fingerprint
from s3capture.transport import ListedObject

__all__ = ["S3CaptureLedger", "LedgerConflictError"]


class LedgerConflictError(ValueError):
    """``record`` found a different committed row for the same model call id.

    Gym's reference ledgers raise ``ValueError`` here too. The caller's row was written before the
    conflict was seen, so readers also see the conflict: the call id resolves as zero candidates
    and the manifest lists it under ``failures`` with reason ``conflicting_ledger_rows``.
    """


class S3CaptureLedger(_LedgerManifest):
    """NeMo Gym's ``CaptureLedger`` (and so a ``LineageResolver``) on S3.

    Parameters:
        url: ``s3://bucket/prefix``; shares the layout (and the rollout fences) of an
            ``S3TokenStore`` on the same URL. A rollout id is used by one family or the other.
        endpoint_url: S3 endpoint; defaults to ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``,
            then the AWS profile's ``endpoint_url`` (then AWS itself).
        botocore_config: a ``botocore.config.Config``; defaults to
            ``default_botocore_config(max(max_concurrency, 10))`` (a pool of that many connections).
        session: an ``aioboto3.Session``; defaults to one from the standard credential chain.
        cache_bytes: bound on the estimated heap of decoded rows kept in memory (bytes).
        max_concurrency: bound on requests in flight from this client.
        transport: ``"aioboto3"`` (default), ``"obstore"`` (``pip install 's3capture[obstore]'``,
            2.3-3.9x less client CPU per capture call across the runs in ``docs/benchmarks.md``) or a
            ``s3capture.transport.Transport``;
            ``None`` reads ``S3CAPTURE_TRANSPORT``.
        spill_dir: a local directory where ``record_failure`` durably spills a failure row it could
            not store; spilled rows are replayed by the next ``record_failure``, ``replay_spill``
            or ``close`` (the same spill file ``S3TokenStore`` uses for its markers).
        probe_listing: for a store whose listings lag writes (``s3capture doctor``'s
            list-after-write check): ``manifest`` first PUTs an empty probe key under the
            rollout's ``ledger/`` and lists until the listing shows it, so every row acknowledged
            before the call is in the manifest, then deletes the probe beside its GETs; a
            ``has_rows`` whose one-key LISTs show no row does the same before it answers False,
            and ``retire`` and ``delete`` list behind a probe too (removing it with the rest).
            Costs one more round trip and two requests per manifest, and PutObject and DeleteObject
            permission for the reader; waits out the lag, or raises ``ListingError`` after the
            transport's ``list_attempts`` (docs/reliability.md, "Listings that lag"). Off by
            default: every store s3capture is tested on, and AWS S3, GCS and MinIO, list
            read-after-write.

    Every method raises ``ValueError``/``TypeError`` for an id or record that cannot be stored,
    before any request, and ``StoreError`` when the store refuses an operation.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        botocore_config: Any = None,
        session: Any = None,
        cache_bytes: int = 64 * 1024 * 1024,
        max_concurrency: int = 32,
        spill_dir: str | os.PathLike | None = None,
        transport: str | Any = None,
        probe_listing: bool = False,
    ) -> None:
        super().__init__(
            url,
            endpoint_url=endpoint_url,
            botocore_config=botocore_config,
            session=session,
            cache_bytes=cache_bytes,
            max_concurrency=max_concurrency,
            spill_dir=spill_dir,
            transport=transport,
        )
        self._compressors = threading.local()  # a ZstdCompressor must not be shared by two threads
        self._probe_listing = bool(probe_listing)

    def _fail_prefix(self, prefix: str, model_call_id: str) -> str:
        """The prefix of a call's failure rows: ``<rollout prefix>ledger/fail/<call segment>/``."""
        return f"{prefix}ledger/fail/{self.layout.marker_call_segment(prefix, model_call_id)}/"

    def _compressor(self) -> zstandard.ZstdCompressor:
        """This thread's compressor (it releases the GIL while compressing, so it must never be
        used by two threads at once; within a thread it is never held across an await)."""
        compressor = getattr(self._compressors, "zstd", None)
        if compressor is None:
            compressor = self._compressors.zstd = zstandard.ZstdCompressor(level=3)
        return compressor

    # ------------------------------------------------------------------ writes
    async def record(self, commit: Any) -> None:
        """Publish a completed call for request-time resolution; visible to every client on return.

        ``commit`` is a ``CaptureLedgerCommit`` (s3capture's struct, NeMo Gym's pydantic model, or
        its wire dict), validated by Gym's rules. Requests, sent together (one round trip): PUT the
        content-addressed row, PUT its fingerprint index, LIST the call id's rows and LIST its
        failure rows. Repeating the same payload writes the same keys and is a no-op.

        Raises ``RecordError`` (a ``ValueError``) for an invalid commit or one whose request or
        response items cannot be fingerprinted; ``ValueError`` for an id too long to store;
        ``LedgerConflictError`` when another payload for the call id is already stored (readers
        see that conflict too) or the call id has a failure row (as Gym's ledgers refuse it; the
        row stays stored, and ``resolve`` never answers with the call); ``StoreError`` when a request fails. A ``record`` for a retired
        rollout is discarded: it lands beside the fence, and no reader ever uses it
        (``manifest``/``has_rows`` raise ``RolloutRetiredError``, ``resolve`` is UNRESOLVED).
        """
        c = validate_commit(commit)
        prefix = self.layout.rollout(c.rollout_id, writing=True)
        cid = c.record.model_call_id
        segment = self.layout.check_call_id(prefix, cid)
        request_items = list(c.request_items)
        try:
            fingerprint = _fp.assistant_fingerprint(request_items + list(c.response_items)) or None
            context_digest = _fp.conversation_digest(request_items)
        except Exception as error:  # noqa: BLE001 - any unhashable item is a bad commit
            raise RecordError(f"commit {cid!r} has items that cannot be fingerprinted: {error}") from None
        row = _Row(
            format=_ROW_FORMAT,
            rollout_id=c.rollout_id,
            record=c.record,
            staging_chain=list(c.staging_chain),
            fingerprint=fingerprint,
            fingerprint_version=_fp.FINGERPRINT_VERSION,
            context_len=len(request_items),
            context_digest=context_digest,
        )
        body = msgspec.json.encode(row, order="sorted")
        if len(body) > _MAX_ROW_BYTES:
            # Readers refuse larger rows, so storing one would acknowledge a row nobody can read.
            raise RecordError(f"the ledger row of {cid!r} is {len(body)} bytes, over the {_MAX_ROW_BYTES}-byte limit")
        sha = _sha(body)
        row_key = f"{prefix}ledger/row/{segment}/{sha}.json"
        index_key = f"{prefix}ledger-index/{escape_id(fingerprint)}/{segment}/{sha}" if fingerprint else ""
        if len(index_key.encode()) > MAX_KEY_BYTES:
            raise ValueError(
                f"model_call_id is too long to store: its index key would exceed S3's {MAX_KEY_BYTES}-byte limit"
            )
        stored = self._compressor().compress(body) if len(body) > _COMPRESS_ABOVE else body
        requests = [
            self._put(row_key, stored),
            self._list(f"{prefix}ledger/row/{segment}/"),
            self._list(self._fail_prefix(prefix, cid)),
        ]
        if index_key:
            requests.append(self._put(index_key, b""))
        results = await asyncio.gather(*requests, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        self._cache.put(row_key, _Cached(row, _heap_estimate(row, len(body))))
        listed, failed = results[1], results[2]
        assert not isinstance(listed, BaseException) and listed is not None  # raised above; the LIST's items
        assert not isinstance(failed, BaseException) and failed is not None
        listed, failed = _without_folder_markers(prefix, listed), _without_folder_markers(prefix, failed)
        if failed:
            # Gym's ledgers refuse a row for a call whose failure row they hold (a conflicting
            # lineage record); the row is stored here, and resolve never answers with the call.
            raise LedgerConflictError(
                f"model call {cid!r} in rollout {c.rollout_id!r} has a failure row (record_failure): its capture "
                "did not complete, so it cannot be committed (the row is stored now; readers list the call "
                "under failures and never resolve to it)"
            )
        others = sorted(item.key.rsplit("/", 1)[-1][: -len(".json")] for item in listed if item.key != row_key)
        if others:
            raise LedgerConflictError(
                f"conflicting ledger row for model call {cid!r} in rollout {c.rollout_id!r}: "
                f"stored {others[0][:12]}..., this payload {sha[:12]}... (both rows are stored now, so readers see "
                "the call as conflicted; a retry must resend the identical commit, admitted_at included)"
            )

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Record a call whose token capture did not complete (one PUT; the first write after a
        failure also replays this client's spill, as the constructor says).

        Failure rows never take part in resolution; ``manifest`` lists them under ``failures`` so
        finalization rejects the rollout. The same ``(model_call_id, reason)`` twice is one row; a
        call id too long for a key is stored under a hashed stand-in and keeps its real id in the
        row. A reason over 64 KiB of UTF-8 is stored cut to that, with a note of its length
        (``ledger_rows.bounded_reason``). Raises ``ValueError`` for an empty or non-str id or reason
        (or a call id so long that the row would pass the 4 MiB a reader accepts), and
        ``StoreError`` when the
        PUT fails and no ``spill_dir`` is configured; with one, the row is spilled locally (fsynced,
        also when the caller cancels the call before the store answered)
        and stored by the next replay, because ``record`` and ``record_failure`` failing together
        is the silent-loss case. Discarded for a retired rollout, like ``record``.
        """
        for name, value in (("model_call_id", model_call_id), ("reason", reason)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{name} {value!r} is not valid Unicode text (it contains a lone surrogate)") from None
        prefix = self.layout.rollout(rollout_id, writing=True)
        reason = bounded_reason(reason)
        body = msgspec.json.encode(
            _Failure(format=_FAILURE_FORMAT, rollout_id=rollout_id, model_call_id=model_call_id, reason=reason),
            order="sorted",
        )
        if len(body) > _MAX_ROW_BYTES:  # only a call id of megabytes gets here: its readers would refuse the row
            raise ValueError(
                f"the failure row of a {len(model_call_id.encode('utf-8'))}-byte call id is {len(body)} bytes, "
                f"over the {_MAX_ROW_BYTES}-byte limit of a ledger row"
            )
        key = f"{self._fail_prefix(prefix, model_call_id)}{_sha(body)}.json"
        try:
            await self._put(key, body)
        except asyncio.CancelledError:
            self._spill_on_cancel(key, body, f"record_failure({rollout_id!r}, {model_call_id!r})")
            raise
        except Exception as error:  # noqa: BLE001 - re-raised by _spill_after_failure unless spilled
            self._spill_after_failure(key, body, error, f"record_failure({rollout_id!r}, {model_call_id!r})")
            return
        await self._replay_spill_quietly()

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record that a call was admitted, before generation (one PUT; optional extension).

        Like ``S3TokenStore.begin_call``: an intent with neither a committed row nor a failure row
        when the manifest is read is listed under ``failures`` with Gym's reason
        ``request_finished_without_staged_coordinates``, so a call whose ``record`` and
        ``record_failure`` were both lost (a crashed worker, a killed harness) still masks the
        rollout. Call it only for calls whose rows will be read after they finished.

        Requests: one PUT of the (empty) intent ``ledger/intent/<cid>``.

        Raises:
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed the PUT.
        """
        prefix = self.layout.rollout(rollout_id, writing=True)
        segment = self.layout.check_call_id(prefix, model_call_id)
        await self._put(f"{prefix}ledger/intent/{segment}", b"")

    # ------------------------------------------------------------------ reads (manifest, has_rows: _LedgerManifest)
    async def resolve(self, rollout_id: str, request_items: list[dict]) -> LineageResolution:
        """ROOT, RESOLVED (exactly one proven parent row) or UNRESOLVED with a reason.

        A match carries the row's ``staging_chain``, ``prev_len`` = its ``cum_len``, its
        ``chain_hash``, ``digest`` = its ``cumulative_hash`` and empty ``cumulative_token_ids``
        (the tokens are staged elsewhere). Requests: LIST the request fingerprint's index with a
        GET of the retire tombstone, then for each candidate call a GET of its row, a LIST of all
        its rows and a LIST of its failure rows (two round trips). A call id with more than one
        committed row anywhere, or with a failure row (``failed_candidate``), counts as zero
        candidates and, as in ``S3TokenStore.resolve``, makes the answer UNRESOLVED rather than
        letting another call win by elimination; candidates must match
        the recorded request context; several candidates count as one only when their cumulative
        hash and length agree (the smallest call id wins, as in Gym). Failure rows never take
        part. A retired rollout is UNRESOLVED (``retired``); every reason: ``docs/reasons.md``.
        Malformed request items give UNRESOLVED, never an error.

        Raises:
            ValueError: an unstorable ``rollout_id`` (before any request).
            StoreError: the store failed a LIST or a GET.
        """
        prefix = self.layout.rollout(rollout_id)
        fingerprint = request_fingerprint(request_items)
        if isinstance(fingerprint, LineageResolution):
            return fingerprint
        listing, retired = await asyncio.gather(
            self._list(f"{prefix}ledger-index/{escape_id(fingerprint)}/"), self._retired(prefix)
        )
        if retired:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="retired")
        by_call: dict[str, set[str]] = collections.defaultdict(set)
        for item in listing:
            parsed = parse_ledger_key(item.key[len(prefix) :])
            if parsed is not None and parsed[0] == "fp" and parsed[2] == fingerprint:
                by_call[parsed[1]].add(parsed[3])
        if not by_call:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="no_match")
        if any(len(shas) > 1 for shas in by_call.values()):
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="conflicting_payloads")

        async def candidate(cid: str, sha: str) -> tuple[str, Any]:
            segment = escape_id(cid)
            key = f"{prefix}ledger/row/{segment}/{sha}.json"

            async def load() -> Any:
                try:
                    return await self._load(key, sha, _Row)
                except RecordError:
                    return None

            row, variants, failed = await asyncio.gather(
                load(),
                self._list(f"{prefix}ledger/row/{segment}/"),
                self._list(self._fail_prefix(prefix, cid)),
            )
            variants, failed = _without_folder_markers(prefix, variants), _without_folder_markers(prefix, failed)
            if len(variants) > 1:
                return "conflict", None
            if failed:
                return "failed", None
            if row is None:
                return "unreadable", None
            return "ok", row

        checked = await asyncio.gather(*(candidate(cid, next(iter(shas))) for cid, shas in by_call.items()))
        if any(state == "conflict" for state, _ in checked):
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="conflicting_payloads")
        if any(state == "failed" for state, _ in checked):
            # A call whose capture failed is never a parent, and no other call wins by elimination.
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="failed_candidate")
        if any(state == "unreadable" for state, _ in checked):
            # An unreadable or missing row might be the parent: never win by elimination.
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="unreadable_candidate")
        candidates: list[_Row] = []
        if any(row.record.model_call_id != cid for cid, (_, row) in zip(by_call, checked)):
            # A row filed under another call id's key is damage: it may hide a conflict.
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="unreadable_candidate")
        for _, row in checked:
            if row.rollout_id != rollout_id or row.fingerprint != fingerprint:
                continue
            if row.fingerprint_version != _fp.FINGERPRINT_VERSION or not row.context_digest:
                continue
            if len(request_items) < row.context_len:
                continue
            try:
                context = _fp.conversation_digest(request_items[: row.context_len])
            except Exception as error:  # noqa: BLE001 - malformed request items: UNRESOLVED
                return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=f"malformed_request: {error}")
            if context == row.context_digest:
                candidates.append(row)
        if len(candidates) > 1:
            shapes = {(row.record.cumulative_hash, row.record.cum_len) for row in candidates}
            if len(shapes) == 1:
                candidates = [min(candidates, key=lambda row: row.record.model_call_id)]
        if len(candidates) != 1:
            return LineageResolution(
                ParentResolutionStatus.UNRESOLVED, reason="ambiguous" if candidates else "no_match"
            )
        record = candidates[0].record
        return LineageResolution(
            ParentResolutionStatus.RESOLVED,
            match=LineageMatch(
                model_call_id=record.model_call_id,
                cumulative_token_ids=(),
                digest=record.cumulative_hash,
                staging_chain=tuple(candidates[0].staging_chain),
                prev_len=record.cum_len,
                chain_hash=record.chain_hash,
            ),
        )

    # ------------------------------------------------------------------ listing
    def _owned(self, scan: RolloutScan) -> list[ListedObject]:
        """Ledger objects of a listed rollout, for ``rollouts``: every key under ``ledger/`` (rows,
        failure rows, intents, and keys ``manifest`` reports as ``foreign_ledger_object``) and
        under ``ledger-index/``. Token-store keys in a shared root are not the ledger's."""
        plen = len(scan.prefix)
        return [item for item in scan.foreign if item.key.startswith(("ledger/", "ledger-index/"), plen)]

    # ------------------------------------------------------------------ removal
    async def retire(self, rollout_ids: Any) -> RolloutRemovalPayload:
        """Remove the ledgers of rollouts and fence them (idempotent); staged tokens untouched.

        Returns ``{"removed": [...], "absent": [...]}`` (absent: nothing stored, or retired
        already). Later ``record``/``record_failure`` calls for a retired rollout are discarded,
        and ``manifest``/``has_rows`` raise ``RolloutRetiredError`` until the id is deleted.
        Requests per rollout: one LIST page per 1,000 keys and one LIST that confirms its end, three
        PUTs for a live ledger (the retired fence, the tombstone, the fence again; two when a fence
        exists), one DeleteObjects per 1,000 keys. With ``probe_listing``, a PUT of a listing probe
        before the LIST (one more round trip), so a listing that lags still shows every row; the
        probe goes with the rest.

        Raises:
            TypeError: ``rollout_ids`` is a single str.
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request.
                No rollout is started after the first failure, and the ones under way
                finish before it is raised (its note counts them); run it again to finish.
        """
        return await super().retire(rollout_ids)

    async def delete(self, rollout_ids: Any) -> RolloutRemovalPayload:
        """Remove the ledgers and fences of rollouts (idempotent); the id then reads as unused.

        Delete only once nothing of those attempts can still write: a late ``record`` after the
        delete starts a new ledger; run one removal of an id at a time. A live ledger is retired
        first, so a delete that fails midway leaves it retired, never a smaller ledger that reads
        as whole. Returns ``{"removed": [...], "absent": [...]}``. Requests per rollout: one LIST
        page per 1,000 keys and one LIST after the last key (confirming the end), for a live ledger
        up to three PUTs (fence, tombstone, fence), one DeleteObjects per 1,000 records (none when
        there are none), then a DELETE of the tombstone and one of the fence, in that order. With
        ``probe_listing``, a PUT of a listing probe before the LIST (one more round trip), so a
        listing that lags still shows every key to delete; the probe goes with the rest.

        Raises:
            TypeError: ``rollout_ids`` is a single str.
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request.
                No rollout is started after the first failure, and the ones under way
                finish before it is raised (its note counts them); run it again to finish.
        """
        return await super().delete(rollout_ids)
