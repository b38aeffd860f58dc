"""``S3TokenStore``'s write path (``TokenSink`` and the custody extension): ``put``, ``begin_call``
and ``mark_incomplete``, with the delta-chain envelope and checkpoint a delta ``put`` writes.

``_StoreWrites`` is a private mixin of ``s3capture.store.S3TokenStore``; the requests each method
sends and the races they close are in ``docs/design.md``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from typing import Any

from s3capture.cache import Stored as _Stored
from s3capture.cache import entry_heap_estimate as _heap_estimate
from s3capture.clocks import awake_clock
from s3capture.errors import StoreError
from s3capture.layout import checkpoint_rel, is_drop_tombstone_rel, parse_log_key
from s3capture.objects import _CHECKPOINT_MAX_TOKENS, CHAIN_KEYS, CHECKPOINT_EVERY, _checked_chain, _Link
from s3capture.protocols import TokenCaptureFrozenError, TokenCaptureRetiredError
from s3capture.records import RecordError, TokenEntry, compute_digest, encode_token_ids, prepare_entry
from s3capture.store_core import _packed_tokens, _StoreCore
from s3capture.transport import gather_settled

log = logging.getLogger("s3capture")


def _marker_retired(rollout_id: str) -> TokenCaptureRetiredError:
    """``mark_incomplete``'s error for a retired rollout (there is no snapshot left to mask)."""
    return TokenCaptureRetiredError(f"rollout {rollout_id!r} is retired; its capture can no longer be marked")


class _StoreWrites(_StoreCore):
    """``put``, ``begin_call`` and ``mark_incomplete`` of ``S3TokenStore`` (private mixin)."""

    # ------------------------------------------------------------------ TokenSink
    async def put(self, entry: Any) -> None:
        """Durably store one ``TokenEntry`` (s3capture's, NeMo Gym's pydantic one, or a dict).

        One round trip: the content-addressed PUT and a GET of the rollout's fence in parallel
        (and, beside every ``CHECKPOINT_EVERY``-th delta entry, the PUT of its checkpoint).
        When it returns, the entry is durable and visible to every client's ``resolve`` and
        ``freeze``. A byte-identical retry rewrites the same key (a no-op); a different payload
        for the same call id lands beside it and readers see the conflict.

        Raises:
            RecordError: the entry violates the record contract or has non-finite log probabilities.
            ValueError: an id that cannot be stored, or an entry over ``max_entry_bytes``.
            TokenCaptureFrozenError: the rollout was frozen; the entry landed and bumped the version.
            TokenCaptureRetiredError: the rollout was retired; the entry is discarded (it may have
                landed; no reader uses it, and only retire or delete removes it).
            StoreError: the store failed the request.
        """
        # A validated private copy and its canonical bytes, in one pass: what we store is what every
        # reader can decode, and a caller mutating its entry after put cannot change our cached
        # view of an immutable object.
        record, payload = prepare_entry(entry)
        prefix = self.layout.rollout(record.rollout_id, writing=True)
        if len(payload) > self._max_entry_bytes:
            raise ValueError(
                f"entry {record.model_call_id!r} is {len(payload)} bytes, over max_entry_bytes={self._max_entry_bytes}"
            )
        sha = hashlib.sha256(payload).hexdigest()
        rel = self.layout.entry_rel(prefix, record.continuation_fingerprint, record.model_call_id, sha)
        chain: tuple[str, ...] = ()
        cum_base = cum_self = ""
        checkpoint: list[int] | None = None
        if record.prompt_is_delta:
            link = await self._delta_chain(record, prefix)
            chain, cum_base = link.chain, link.cum_base
            if len(chain) >= CHECKPOINT_EVERY:
                checkpoint = await self._checkpoint_tokens(prefix, record, link)
                if checkpoint is not None:
                    cum_self = checkpoint_rel(record.digest or "")
        body = self._encode_object(payload, chain, cum_base, cum_self)
        key = prefix + rel
        await self.transport.client()  # opening a cold client is not part of the race window timed below
        requests = [self._put(key, body), self._fence_state(prefix)]
        if checkpoint is not None:
            # Derived, immutable and content-addressed: sent with the entry, so put stays one
            # round trip. A checkpoint that fails to land only costs readers a longer walk.
            requests.append(
                self._put_checkpoint(prefix + cum_self, self._compressor().compress(encode_token_ids(checkpoint)))
            )
        started = awake_clock()
        # Every request is awaited before an error is raised: a put that raised has nothing of
        # its own still in flight (its entry PUT may have landed, as the contract allows, but it
        # cannot land after the caller saw the error and, say, marked the call incomplete).
        state = (await gather_settled(requests))[1]
        if state == "open" and awake_clock() - started > self._fence_grace:
            # A slow put (retries, stalls) may have landed after a freeze's LIST although its fence
            # read came before the fence: read the fence again now that the entry has landed.
            state = await self._fence_state(prefix)
        mine = _Stored(record, chain, _heap_estimate(record, payload), cum_base=cum_base, cum_self=cum_self)
        if checkpoint is not None:
            mine.cumulative, nbytes = _packed_tokens(checkpoint)
            mine.nbytes += nbytes
        self._cache.put(key, mine)
        self._remember(record.rollout_id, record.model_call_id, rel)
        await self._replay_spill_quietly()
        if state == "retired":
            # Never delete the key: it is content-addressed, so an acknowledged put of the same
            # bytes may own it. A late object in a retired rollout is removed by retire or delete.
            raise TokenCaptureRetiredError(
                f"rollout {record.rollout_id!r} is retired (or a drop of it is deciding); the late entry "
                f"{record.model_call_id!r} may be discarded: it may have landed, but do not count it as captured"
            )
        if state == "frozen":
            raise TokenCaptureFrozenError(
                f"rollout {record.rollout_id!r} is frozen; the late entry {record.model_call_id!r} landed, and unless "
                "the freeze's listing already showed it, it changed the version, so the consumed snapshot's "
                "conditional drop fails and keeps the evidence"
            )

    async def _delta_chain(self, record: TokenEntry, prefix: str) -> _Link:
        """The envelope chain of a delta entry: keys (relative to the rollout prefix) of its
        ancestors back to the nearest checkpoint or full-prompt anchor (farthest first, at most
        ``CHAIN_KEYS``), and the checkpoint of the farthest one, if it has one."""
        parent_id = record.parent_call_id or ""
        keys = self._call_keys.get((record.rollout_id, parent_id))
        if keys and len(keys) != 1:
            # The map is a shortcut, and may hold keys of another attempt of a reused id (deleted by
            # another client since: docs/design.md, race 8): a conflict is decided by a listing.
            self._call_keys.forget(record.rollout_id)
            keys = None
        listed = not keys
        if listed:
            for item in await self._list(prefix + "log/e/"):
                parsed = parse_log_key(item.key[len(prefix) :])
                if parsed is not None:
                    self._remember(record.rollout_id, parsed[1], item.key[len(prefix) :])
            keys = self._call_keys.get((record.rollout_id, parent_id))
        if not keys or len(keys) != 1:
            raise RecordError(
                f"delta entry {record.model_call_id!r}: parent {parent_id!r} has "
                f"{'no' if not keys else 'conflicting'} stored entries, so its prompt cannot be reconstructed"
            )
        (parent_rel,) = keys
        parent = await self._load(prefix + parent_rel, parent_rel.rsplit("/", 1)[-1][:-4])
        if parent is None and not listed:
            # The map named an object deleted since (an earlier attempt of a reused id, removed by
            # another client: race 8): forget it and decide by a listing, once.
            self._call_keys.forget(record.rollout_id)
            return await self._delta_chain(record, prefix)
        if parent is None:
            raise RecordError(f"delta entry {record.model_call_id!r}: parent {parent_id!r} disappeared")
        parent_key = prefix + parent_rel
        if not parent.entry.prompt_is_delta:
            return _Link((parent_rel,), "", parent_key, parent)  # a full-prompt anchor
        if parent.cum_self:
            return _Link((parent_rel,), parent.cum_self, parent_key, parent)
        parent_chain = _checked_chain(parent)
        if len(parent_chain) < CHAIN_KEYS:
            # Same farthest ancestor as the parent's chain, so the same base checkpoint (if any).
            return _Link((*parent_chain, parent_rel), parent.cum_base, parent_key, parent)
        # The parent's window is full and it has no checkpoint (an object written before
        # checkpoints, or one whose checkpoint could not be computed): slide the window.
        return _Link((*parent_chain, parent_rel)[-CHAIN_KEYS:], "", parent_key, parent)

    async def _checkpoint_tokens(self, prefix: str, record: TokenEntry, link: _Link) -> list[int] | None:
        """The cumulative tokens of the delta entry ``record`` for its checkpoint, or ``None`` when
        they cannot be proven: no digest to name and verify them by, or a parent chain that does
        not rebuild. Free when the parent's tokens are memoized (this client resolved it)."""
        digest = record.digest or ""
        try:
            checkpoint_rel(digest)
            tokens = await self._cumulative(prefix, link.parent_key, link.parent)
        except (RecordError, ValueError, StoreError) as error:
            # Derived data: a chain that cannot be read now only costs readers a longer walk.
            log.info("no checkpoint for %r: %s", record.model_call_id, error)
            return None
        tokens.extend(record.prompt_token_ids)
        tokens.extend(record.generation_token_ids)
        if len(tokens) > _CHECKPOINT_MAX_TOKENS:  # no reader takes it (a forged one must stay small)
            log.info(
                "no checkpoint for %r: %d tokens, over the %d a reader accepts",
                record.model_call_id,
                len(tokens),
                _CHECKPOINT_MAX_TOKENS,
            )
            return None
        if (record.cum_len is not None and record.cum_len != len(tokens)) or compute_digest(tokens) != digest:
            log.warning("no checkpoint for %r: its delta prompt does not rebuild its digest", record.model_call_id)
            return None
        return tokens

    async def _put_checkpoint(self, key: str, body: bytes) -> None:
        try:
            await self._put(key, body)
        except StoreError as error:
            log.warning("checkpoint %s was not stored (readers walk the chain instead): %s", key, error)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record a pre-dispatch intent for a model call (the custody extension).

        The intent is PUT first and the fence read after it lands, so a ``begin_call`` that returns
        is always seen by a later freeze's LIST: an intent with no entry at freeze masks the rollout.
        Requests: a PUT of the (empty) intent ``log/i/<cid>``, then a GET of the fence (two round
        trips).

        Raises:
            TokenCaptureFrozenError: the rollout is frozen (fail the model call before generation).
            TokenCaptureRetiredError: the rollout is retired (likewise).
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed the PUT or the GET.
        """
        prefix = self.layout.rollout(rollout_id, writing=True)
        key = prefix + "log/i/" + self.layout.check_call_id(prefix, model_call_id)
        await self._put(key, b"")
        state = await self._fence_state(prefix)
        if state == "retired":
            # The intent key is shared by every begin_call of this call id: never delete it here.
            raise TokenCaptureRetiredError(
                f"rollout {rollout_id!r} is retired (or a drop of it is deciding); do not dispatch {model_call_id!r}"
            )
        if state == "frozen":
            raise TokenCaptureFrozenError(f"rollout {rollout_id!r} is frozen; do not dispatch {model_call_id!r}")

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Durably record that a call of this rollout failed to capture; the rollout is masked.

        One round trip: a PUT of a unique marker (so it always changes the version, also after
        freeze) and a GET of the fence. When the PUT fails, or the caller cancels the call (a
        deadline), and ``spill_dir`` is set, the marker is appended (fsynced) to a local spill file
        before this returns or the cancellation propagates, and is replayed after the next
        successful write or at ``close``, so ``put`` and ``mark_incomplete`` do not fail together.

        After a freeze (the fence read said so) or when the PUT took longer than
        ``fence_grace``, three more round trips: a LIST of the drop tombstones (its end confirmed
        by a second LIST) with a re-read of the fence, then a GET of the retire tombstone
        (``docs/design.md``, race 2). A marker is
        acknowledged only when it is in, or fails, every drop that could consume the rollout.

        Raises:
            TokenCaptureRetiredError: the rollout is retired (there is no snapshot left to mask),
                or a drop of it is deciding (or crashed): the marker landed and masks the rollout
                unless that drop consumed it first, so it is not acknowledged.
            StoreError: the store failed and no ``spill_dir`` is configured.
            ValueError: an id that cannot be stored.
        """
        prefix = self.layout.rollout(rollout_id, writing=True)
        cid = self.layout.marker_call_segment(prefix, model_call_id)
        key = f"{prefix}log/x/{cid}/{time.time_ns():020d}-{uuid.uuid4().hex}"
        started = awake_clock()
        try:
            stored, state = await asyncio.gather(self._put(key, b""), self._fence_state(prefix), return_exceptions=True)
        except asyncio.CancelledError:
            self._spill_on_cancel(key, b"", f"mark_incomplete({rollout_id!r}, {model_call_id!r})")
            raise
        if isinstance(stored, BaseException):
            # Failed, or cancelled from inside (close() cancels requests that outlive it): the PUT
            # may or may not have landed. Spill it; a replay of a marker that landed is a no-op.
            # Unless the fence read said retired: the store answers, and there is no snapshot
            # left to mask (the spill would acknowledge a marker that can mask nothing).
            if state == "retired":
                raise _marker_retired(rollout_id) from stored
            what = f"mark_incomplete({rollout_id!r}, {model_call_id!r})"
            if not isinstance(stored, Exception):
                self._spill_on_cancel(key, b"", what)
                raise stored
            self._spill_after_failure(key, b"", stored, what)
            return
        if state != "open" or awake_clock() - started > self._fence_grace:
            # After a freeze a drop may be racing: only reads after landing tell whether the marker
            # could still invalidate the consumed snapshot. The fence alone cannot: a freeze of a
            # retired rollout rewrites it as "frozen" until its LIST shows it the tombstone, and a
            # fence PUT the network delivers late (its client had retried and moved on) can turn a
            # drop's retired fence back into "frozen" after that drop's decisive LIST. So the
            # marker reads the keys nothing overwrites, in this order: the drop tombstones
            # (``drop/<token>``: a drop writes its own before its decisive LIST and deletes it
            # only when it fails, or, when it succeeds, after writing the retire tombstone), then
            # the retire tombstone. Seeing no drop tombstone, the marker landed before every
            # drop's decisive LIST (which then sees it and fails) or after a drop or retire wrote
            # the retire tombstone (which the GET after the LIST then sees). One that sees a drop
            # tombstone is not acknowledged: it landed, and masks the rollout unless that drop
            # consumed it first. If these reads fail, nothing says whether a drop consumed the
            # rollout: raise, never acknowledge.
            fence, drops = await asyncio.gather(
                self._fence_state(prefix), self._list(prefix + "drop/", confirm_end=True)
            )
            # Only a drop's own tombstone (``drop/<32 hex>``) says a drop ran: the folder's marker
            # (``drop/``, what s3fs, ``rclone mkdir`` or a console writes) refused every marker
            # after a freeze (an audit, 2026-12-04); any other key there is foreign and masks the
            # rollout in every snapshot anyway.
            if any(is_drop_tombstone_rel(item.key[len(prefix) :]) for item in drops):
                raise TokenCaptureRetiredError(
                    f"rollout {rollout_id!r} is being dropped (or a drop of it crashed): the marker landed and masks "
                    "the rollout unless the drop consumed it first, so it is not acknowledged"
                )
            state = "retired" if await self._present(prefix + "retired") else fence
        if state == "retired":
            raise _marker_retired(rollout_id)
        await self._replay_spill_quietly()
