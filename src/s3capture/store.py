"""The S3 implementation of ``TokenSink``, ``TokenSource`` and ``LineageResolver``.

Contracts: ``shared/spec/protocols-reference.txt`` (NeMo Gym's token-capture protocols). The
design, every request an operation issues and every race that remains without compare-and-swap are
written down in ``docs/design.md``; the bucket layout is in ``s3capture.layout``. The pieces this
module builds on each have one home: the S3 transport and its verified listing
(``s3capture.transport``), the rollout scan, fences, retire and delete (``s3capture.rollouts``),
the cache (``s3capture.cache``) and the local spill (``s3capture.spill``).

Usage::

    store = S3TokenStore("s3://bucket/capture")       # credentials and AWS_ENDPOINT_URL from the environment
    await store.begin_call(rollout_id, call_id)       # optional custody intent, before generation
    await store.put(entry)                            # one round trip; durable and visible on return
    resolution = await store.resolve(rollout_id, request_items)
    snapshot = await store.freeze(rollout_id)
    await store.drop(rollout_id, snapshot.snapshot_id, snapshot.version)
    await store.close()

Offline, with read-only credentials (GET and LIST: ``docs/permissions.md``)::

    async for info in store.rollouts("frozen"):        # one streaming LIST of the root
        snapshot = await store.read_snapshot(info.rollout_id)   # what freeze returned, unchanged since
"""

from __future__ import annotations

import array
import asyncio
import collections
import hashlib
import io
import logging
import math
import operator
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zstandard

from s3capture import fingerprint as _fp
from s3capture.cache import CallKeys
from s3capture.cache import Stored as _Stored
from s3capture.cache import entry_heap_estimate as _heap_estimate
from s3capture.clocks import awake_clock
from s3capture.errors import ListingError, SnapshotNotSealedError, StoreError, install_hint
from s3capture.layout import (
    checkpoint_rel,
    escape_id,
    is_checkpoint_rel,
    parse_log_key,
)
from s3capture.objects import (
    _CHECKPOINT_MAX_BYTES,
    _ENVELOPE_FORMAT,
    _ENVELOPE_TAIL,
    _MANIFEST_BASE_BYTES,
    _MANIFEST_BYTES_PER_OBJECT,
    _MANIFEST_FORMAT,
    _MANIFEST_REMEDY,
    _ZSTD_MAGIC,
    CHAIN_KEYS,
    CHECKPOINT_EVERY,
    _checked_chain,
    _checkpoint_matches,
    _decode_tokens,
    _Envelope,
    _Link,
    _Manifest,
    _manifest_key,
)
from s3capture.protocols import (
    LineageMatch,
    LineageResolution,
    RolloutRemovalPayload,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenCaptureSnapshot,
)
from s3capture.records import (
    ParentResolutionStatus,
    RecordError,
    TokenEntry,
    _DIGEST_DOMAIN,
    compute_digest,
    cumulative_tokens,
    decode_canonical_entry,
    encode_token_ids,
    prepare_entry,
    to_gym,
)
from s3capture.rollouts import (
    FENCE_FROZEN,
    FENCE_RETIRED,
    RolloutInfo,
    RolloutObjects,
    RolloutScan,
    parse_s3_url,
    scan_listing,
)
from s3capture.transport import ListedObject, beside_confirmation, default_botocore_config

__all__ = [
    "S3TokenStore",
    "FrozenSnapshot",
    "StoreError",
    "ListingError",
    "SnapshotNotSealedError",
    "RolloutInfo",
    "parse_s3_url",
    "default_botocore_config",
    "CHAIN_KEYS",
    "CHECKPOINT_EVERY",
]

log = logging.getLogger("s3capture")

_CLOCK_SLACK = 0.1
"""Seconds ``drop`` adds to ``fence_grace``: monotonic clocks of two hosts may run at slightly
different rates, and a put measures its own duration on its host's clock."""

_FENCE_SEEN_LIMIT = 10_000
"""Rollouts whose freeze time ``drop`` remembers (~300 bytes each, measured: under 3 MiB). A
forgotten one only makes its drop wait ``fence_grace`` from the drop's own LIST instead."""


@dataclass(frozen=True)
class FrozenSnapshot(TokenCaptureSnapshot):
    """A ``TokenCaptureSnapshot`` that also says why it is incomplete.

    Fields: ``rollout_id``; ``entries``, a tuple of entries (``S3TokenStore.entry_type``: s3capture's
    ``TokenEntry`` or Gym's), one per call id, in call-id order; ``incomplete`` (True exactly when
    ``reasons`` is not empty); ``snapshot_id``, a hex digest of the listed keys and ETags;
    ``version``, the number of log objects (entries, intents, markers); ``reasons``.

    ``reasons`` is a sorted tuple of strings ``"<code>:<argument>"`` such as
    ``"conflicting_payloads:<cid>"``, ``"dangling_intent:<cid>"``, ``"marked_incomplete:<cid>"``,
    ``"missing_parent:<cid>"``, ``"broken_chain:<cid>"``, ``"unreadable:<key>:<why>"``,
    ``"vanished:<key>"``, ``"misfiled:<key>"`` and ``"foreign_object:<key>"`` (``<key>`` relative to
    the rollout's prefix); empty when complete. Every code and its meaning: ``docs/reasons.md``.
    """

    reasons: tuple[str, ...] = ()


def _packed_tokens(tokens: Sequence[int]) -> tuple[Sequence[int], int]:
    """A memo of cumulative token ids and its heap bytes: packed 8 bytes per token (an unsigned
    64-bit array, what the cache's bound counts), or, for ids that do not fit it, a tuple (a
    pointer and an int object per token). Packed because the ids of a checkpoint or of a rebuilt
    chain are int objects of their own (about 36 bytes each, not the 8 of a pointer to an int an
    entry also holds), which made ``cache_bytes`` undercount memoized tokens about 4x."""
    try:
        packed = array.array("Q", tokens)
    except (OverflowError, TypeError):
        return tuple(tokens), sys.getsizeof(()) + 36 * len(tokens)
    return packed, sys.getsizeof(packed)


def _marker_retired(rollout_id: str) -> TokenCaptureRetiredError:
    """``mark_incomplete``'s error for a retired rollout (there is no snapshot left to mask)."""
    return TokenCaptureRetiredError(f"rollout {rollout_id!r} is retired; its capture can no longer be marked")


def _shallow_copy(entry: TokenEntry) -> TokenEntry:
    """A copy of a cached entry whose scalar fields, token-id and log-probability lists and
    top-level containers are its own; nested items are shared (see ``S3TokenStore._hand_out``)."""
    out = entry.__copy__()  # type: ignore[attr-defined]  # msgspec.Struct defines it; its stubs do not
    out.prompt_token_ids = list(entry.prompt_token_ids)
    out.generation_token_ids = list(entry.generation_token_ids)
    out.generation_log_probs = list(entry.generation_log_probs)
    out.output_items = list(entry.output_items)
    extra = entry.__dict__.get("_extra")
    if extra:
        out.__dict__["_extra"] = dict(extra)
    return out


def _nested_encoding(entry: TokenEntry) -> bytes | None:
    """JSON of the parts of a cached entry that ``_shallow_copy`` shares (``routed_experts``, the
    items of ``output_items``, the extra fields); None when a caller made them unencodable."""
    try:
        return _nested_encoder.encode((entry.routed_experts, entry.output_items, entry.__dict__.get("_extra")))
    except (TypeError, ValueError, OverflowError, UnicodeError, RecursionError):  # e.g. an item made to contain itself
        return None


def _nested_digest(nested: bytes) -> bytes:
    return hashlib.blake2b(nested, digest_size=16).digest()


def _detached_copy(entry: TokenEntry, nested: bytes) -> TokenEntry:
    """A copy of a cached entry sharing nothing mutable with it: ``_shallow_copy`` with its nested
    parts decoded from ``nested`` (``_nested_encoding`` of ``entry``)."""
    out = _shallow_copy(entry)
    routed, items, extra = _nested_decoder.decode(nested)
    out.routed_experts, out.output_items = routed, items
    if extra:
        out.__dict__["_extra"] = extra
    return out


_nested_encoder = msgspec.json.Encoder()
_nested_decoder = msgspec.json.Decoder()


def _interchangeable(entries: Sequence[TokenEntry]) -> bool:
    """Whether several candidates for one request are one parent: Gym's rule (``lineage.py``,
    ``resolve_node``), equal non-empty ``digest`` and equal ``cum_len``, a missing ``cum_len``
    counted as the entry's token count as Gym's ``add_entry`` does; and, stricter than Gym, every
    full-prompt candidate's tokens hash to that digest (one whose tokens do not is damage, and
    the request may continue its tokens: never guess). Delta candidates are checked once one of
    them wins (``digest_mismatch``)."""
    shapes = {
        (entry.digest, entry.cum_len if entry.cum_len is not None else _cumulative_len(entry)) for entry in entries
    }
    if len(shapes) != 1 or not entries[0].digest:
        return False
    return all(entry.prompt_is_delta or compute_digest(cumulative_tokens(entry)) == entry.digest for entry in entries)


def _cumulative_len(entry: TokenEntry) -> int:
    """``len(prompt_token_ids) + len(generation_token_ids)``: what Gym counts for a missing ``cum_len``."""
    return len(entry.prompt_token_ids) + len(entry.generation_token_ids)


class S3TokenStore(RolloutObjects):
    """NeMo Gym's ``TokenSink`` (plus ``begin_call``), ``TokenSource`` and ``LineageResolver`` on S3.

    Parameters:
        url: ``s3://bucket/prefix``; every key lives under the prefix.
        endpoint_url: S3 endpoint; defaults to ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``,
            then the AWS profile's ``endpoint_url`` (then AWS itself).
        botocore_config: a ``botocore.config.Config``; defaults to
            ``default_botocore_config(max(max_concurrency, 10))`` (a pool of that many connections).
        session: an ``aioboto3.Session``; defaults to one built from the standard credential chain.
        entry_type: ``"s3capture"`` (``s3capture.records.TokenEntry``) or ``"gym"`` (NeMo Gym's
            pydantic ``TokenEntry``) for entries handed back by ``freeze``.
        cache_bytes: bound on the estimated heap of decoded immutable objects kept in memory (bytes).
        max_concurrency: bound on requests in flight from this client (at most the pool size).
        compression_level: zstd level for stored entries (default 1: see ``docs/design.md``,
            "Encode CPU"; every level is readable by every reader).
        max_entry_bytes: largest canonical entry accepted by ``put`` or decoded by a reader.
        transport: ``"aioboto3"`` (default), ``"obstore"`` (``pip install 's3capture[obstore]'``,
            3.5-3.9x less client CPU per capture call, measured in ``docs/design.md``) or a
            ``s3capture.transport.Transport``;
            ``None`` reads ``S3CAPTURE_TRANSPORT``.
        spill_dir: a local directory where ``mark_incomplete`` durably spills markers it could not
            store; they are replayed after the next successful ``put`` or ``mark_incomplete`` (which
            waits at most 0.5 s for it), by ``replay_spill``, or at ``close`` (at most 10 s).
        fence_grace: seconds. A ``put`` slower than this reads the fence again after landing, and
            ``drop`` waits until ``fence_grace`` + 0.1 s have passed on this client's own monotonic
            clock (``CLOCK_BOOTTIME``) since it knew the fence existed, before its final LIST (no
            two machines' clocks are compared); together they close the stale-drop window (``docs/design.md``). Every client of
            a bucket must use the same value.

    Every method raises ``ValueError`` (or ``TypeError``) for an id that cannot be stored, before
    any request, and ``StoreError`` when the store refuses an operation.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        botocore_config: Any = None,
        session: Any = None,
        entry_type: str = "s3capture",
        cache_bytes: int = 256 * 1024 * 1024,
        max_concurrency: int = 32,
        compression_level: int = 1,
        max_entry_bytes: int = 256 * 1024 * 1024,
        spill_dir: str | os.PathLike | None = None,
        transport: str | Any = None,
        fence_grace: float = 1.0,
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
        if entry_type not in ("s3capture", "gym"):
            raise ValueError(f"entry_type must be 's3capture' or 'gym', got {entry_type!r}")
        if entry_type == "gym":
            try:
                import nemo_gym.token_id_capture.records  # noqa: F401 - fail early, before any request
            except ImportError as error:
                raise ImportError(
                    f"entry_type='gym' needs NeMo Gym's records ({error}): {install_hint('gym')}, then "
                    "pip install --no-deps --ignore-requires-python nemo-gym==0.7.0"
                ) from None
        self.entry_type = entry_type
        self._call_keys = CallKeys()
        """(rollout, call id) -> keys of its entries; bounded by rows and bytes, forgotten when the
        rollout is frozen, dropped, retired or deleted."""
        self._compression_level = compression_level
        self._compressors = threading.local()
        self._compressor()  # a bad level fails here, not in the first put
        self._max_entry_bytes = max_entry_bytes
        if isinstance(fence_grace, bool) or not isinstance(fence_grace, (int, float)):
            raise TypeError(
                f"fence_grace must be a number of seconds, got {type(fence_grace).__name__} {fence_grace!r}"
            )
        if not 0 <= fence_grace < math.inf:  # NaN would turn off drop's wait and the slow-put re-read
            raise ValueError(f"fence_grace must be a finite number of seconds >= 0, got {fence_grace!r}")
        self._fence_grace = fence_grace
        self._fence_seen: collections.OrderedDict[str, tuple[float, int, str]] = collections.OrderedDict()
        """rollout id -> (``awake_clock()`` after this client's freeze's fence PUT returned, and
        that freeze's version and snapshot id); bounded. ``drop`` trusts the time only for that
        exact snapshot, so a stale record (the id deleted and reused by another client) is never
        used to shorten its wait."""

    def _forget_rollout(self, rollout_id: str) -> None:
        self._call_keys.forget(rollout_id)
        self._fence_seen.pop(rollout_id, None)

    def _saw_fence(self, rollout_id: str, when: float, version: int, snapshot_id: str) -> None:
        """Remember when this client's freeze knew its fence existed, for that snapshot."""
        self._fence_seen[rollout_id] = (when, version, snapshot_id)
        self._fence_seen.move_to_end(rollout_id)
        while len(self._fence_seen) > _FENCE_SEEN_LIMIT:
            self._fence_seen.popitem(last=False)

    def _snapshot_fields(self, scan: RolloutScan) -> dict[str, Any]:
        """``rollouts``: the version and snapshot id a freeze of the listed state would give, and
        whether its sealed manifest is listed."""
        version, snapshot_id = scan.version_and_id()
        manifest_key = _manifest_key(scan.prefix, version, snapshot_id)
        return {
            "version": version,
            "snapshot_id": snapshot_id,
            "sealed": any(item.key == manifest_key for item in scan.snaps),
        }

    # ------------------------------------------------------------------ encoding
    def _decompressor(self) -> zstandard.ZstdDecompressor:
        """This thread's decompressor (as ``_compressor``: one thread at a time, never across an await)."""
        decompressor = getattr(self._compressors, "unzstd", None)
        if decompressor is None:
            decompressor = self._compressors.unzstd = zstandard.ZstdDecompressor()
        return decompressor

    def _compressor(self) -> zstandard.ZstdCompressor:
        """This thread's compressor. A ``ZstdCompressor`` must not be used by two threads at once
        (it releases the GIL while compressing); within a thread, ``put`` compresses without
        awaiting, so one event loop's tasks never share it concurrently either."""
        compressor = getattr(self._compressors, "zstd", None)
        if compressor is None:
            compressor = self._compressors.zstd = zstandard.ZstdCompressor(level=self._compression_level)
        return compressor

    def _encode_object(self, payload: bytes, chain: Sequence[str], cum_base: str = "", cum_self: str = "") -> bytes:
        parts = [b'{"chain":', msgspec.json.encode(list(chain))]
        if cum_base:
            parts += [b',"cum_base":', msgspec.json.encode(cum_base)]
        if cum_self:
            parts += [b',"cum_self":', msgspec.json.encode(cum_self)]
        parts += [b',"entry":', payload, _ENVELOPE_TAIL]
        return self._compressor().compress(b"".join(parts))

    def _decompress(self, data: bytes, limit: int | None = None) -> bytes:
        # The envelope adds its format tag and up to CHAIN_KEYS ancestor keys to the entry bytes.
        if limit is None:
            limit = self._max_entry_bytes + 64 * 1024
        if not data.startswith(_ZSTD_MAGIC):
            if len(data) > limit:
                raise RecordError(f"object is larger than max_entry_bytes={self._max_entry_bytes}")
            return data
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError:
            size = -1
        if 0 <= size <= limit:
            # One frame that states its size (what put writes): one call on a reused decompressor.
            try:
                return self._decompressor().decompress(data, allow_extra_data=False)
            except zstandard.ZstdError:
                pass  # several frames, or damage: the streaming path below decides
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
        out = io.BytesIO()
        while True:
            chunk = reader.read(1 << 20)
            if not chunk:
                break
            out.write(chunk)
            if out.tell() > limit:
                raise RecordError(f"object decompresses beyond max_entry_bytes={self._max_entry_bytes}")
        return out.getvalue()

    def _decode_object(self, data: bytes, sha: str | None) -> _Stored:
        """Decode a stored entry object; raises ``RecordError`` for anything unreadable."""
        try:
            raw = self._decompress(data)
        except zstandard.ZstdError as error:
            raise RecordError(f"object is not valid zstd: {error}") from None
        chain: tuple[str, ...] = ()
        cum_base = cum_self = ""
        payload = raw
        if raw.startswith(b'{"chain":'):
            try:
                envelope = msgspec.json.decode(raw, type=_Envelope)
            except (msgspec.DecodeError, RecursionError) as error:  # RecursionError: nested past the stack
                raise RecordError(f"object is not an s3capture entry envelope: {error}") from None
            if envelope.format != _ENVELOPE_FORMAT:
                raise RecordError(f"unknown envelope format {envelope.format!r}")
            payload = bytes(envelope.entry)
            # The chain is a hint outside the key's SHA-256: only entry keys of this rollout's
            # shape are ever fetched; a chain with anything else is dropped whole (a walk then
            # reports the chain as missing: UNRESOLVED, never a request for a forged key).
            chain = tuple(envelope.chain)  # checked on first use: _checked_chain
            # Checkpoint hints of another shape are ignored, never fetched: they are only hints.
            cum_base = envelope.cum_base if is_checkpoint_rel(envelope.cum_base) else ""
            cum_self = envelope.cum_self if is_checkpoint_rel(envelope.cum_self) else ""
        if len(payload) > self._max_entry_bytes:
            raise RecordError(f"entry is {len(payload)} bytes, over max_entry_bytes={self._max_entry_bytes}")
        if sha is not None and hashlib.sha256(payload).hexdigest() != sha:
            raise RecordError("stored entry bytes do not match the SHA-256 in their key")
        entry = decode_canonical_entry(payload)
        return _Stored(entry, chain, _heap_estimate(entry, payload), cum_base=cum_base, cum_self=cum_self)

    def _remember(self, rollout_id: str, model_call_id: str, rel: str) -> None:
        self._call_keys.add(rollout_id, model_call_id, rel)

    def _read_limit(self) -> int:
        # A zstd frame of incompressible data is at most a little larger than the data itself.
        return self._max_entry_bytes + self._max_entry_bytes // 64 + 128 * 1024

    async def _load(self, key: str, sha: str | None, size: int | None = None) -> _Stored | None:
        """The decoded object at ``key`` from the cache or one GET; ``None`` when absent.

        ``size`` (from a LIST) lets an oversize object be refused without reading it. Raises
        ``RecordError`` when the object is unreadable or oversize.
        """
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        limit = self._read_limit()
        if size is not None and size > limit:
            raise RecordError(f"object is {size} bytes, over what max_entry_bytes={self._max_entry_bytes} allows")
        stored = await self._get_checked(key, limit, lambda data: self._decode_object(data, sha))
        if stored is None:
            return None
        self._cache.put(key, stored)
        return stored

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
        state = (await asyncio.gather(*requests))[1]
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
        if not keys:
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
        if (record.cum_len is not None and record.cum_len != len(tokens)) or compute_digest(tokens) != digest:
            log.warning("no checkpoint for %r: its delta prompt does not rebuild its digest", record.model_call_id)
            return None
        return tokens

    async def _put_checkpoint(self, key: str, body: bytes) -> None:
        try:
            await self._put(key, body)
        except StoreError as error:
            log.warning("checkpoint %s was not stored (readers walk the chain instead): %s", key, error)

    async def _load_checkpoint(self, prefix: str, rel: str) -> tuple[list[int], str] | None:
        """Token ids stored in checkpoint ``rel`` and their digest (``compute_digest``, taken over the
        stored bytes, which are the digest encoding); ``None`` when it is missing, oversize or
        malformed. Not verified here: the caller checks the digest against the entry it belongs to."""
        try:
            # Bounded far below max_entry_bytes: a forged checkpoint must not become a gigabyte of
            # Python ints before its digest is checked.
            data = await self._get(prefix + rel, _CHECKPOINT_MAX_BYTES + _CHECKPOINT_MAX_BYTES // 64 + 1024)
            if data is None:
                return None
            raw = self._decompress(data, _CHECKPOINT_MAX_BYTES)
            tokens = _decode_tokens(raw)
            if tokens is None:
                return None
            return tokens, (hashlib.sha256(_DIGEST_DOMAIN + raw).hexdigest() if tokens else compute_digest(()))
        except (RecordError, StoreError, zstandard.ZstdError) as error:
            log.warning("checkpoint %s%s is unreadable: %s", prefix, rel, error)
            return None

    def _memoize(self, key: str, stored: _Stored, tokens: list[int]) -> None:
        if stored.cumulative is None:
            stored.cumulative, nbytes = _packed_tokens(tokens)
            self._cache.grow(key, stored, nbytes)

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
            if drops:
                raise TokenCaptureRetiredError(
                    f"rollout {rollout_id!r} is being dropped (or a drop of it crashed): the marker landed and masks "
                    "the rollout unless the drop consumed it first, so it is not acknowledged"
                )
            state = "retired" if await self._present(prefix + "retired") else fence
        if state == "retired":
            raise _marker_retired(rollout_id)
        await self._replay_spill_quietly()

    # ------------------------------------------------------------------ TokenSource
    async def freeze(self, rollout_id: str) -> FrozenSnapshot:
        """Freeze a rollout and return one atomic snapshot (idempotent across clients).

        Requests: PUT the fence, then one LIST page per 1,000 keys, one GET per entry not yet
        cached and one LIST after the listing's last key that confirms its end (in parallel), and
        one PUT of the sealed manifest unless it already exists.
        ``version`` is the number of log and foreign objects and ``snapshot_id`` a digest of their
        sorted keys (and of the foreign objects' ETags: s3capture's own keys name their content),
        so two clients freezing the same state agree. The snapshot is ``incomplete`` when
        any call id has conflicting payloads, an intent has no entry, a marker exists, or any object
        is unreadable or foreign.

        Every entry whose ``parent_call_id`` is not in the snapshot masks it (``missing_parent``):
        a listing that hid one key cannot make a chain with a hole trainable. A lost *last* call
        leaves no such trace; ``begin_call`` intents close that gap (``docs/design.md``).

        The snapshot is built from the listing exactly as ``read_snapshot`` builds it (one private
        method), so a read-only reader of an unchanged frozen rollout gets the same one.

        Returns a ``FrozenSnapshot``: the entries in ``entry_type``, ``version``, ``snapshot_id``,
        ``incomplete`` and its ``reasons`` (``docs/reasons.md``).

        Raises:
            TokenCaptureRetiredError: the rollout is retired (delete it to reuse the id).
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request; ``ListingError`` (a ``StoreError``) for a
                listing that does not show the fence this freeze wrote, after retries.
        """
        prefix = self.layout.rollout(rollout_id)
        await self._put(prefix + "fence", FENCE_FROZEN)
        fenced_at = awake_clock()
        # A listing that does not show the fence just written is stale or incomplete: never build a
        # snapshot on it (retried, then ListingError).
        listing = await self._list(prefix, require=[prefix + "fence"])

        # Its end is confirmed by one more LIST, sent beside the entries' GETs rather than before
        # them (Transport.confirm_listing_end): a listing cut short would hide the rollout's last
        # keys, its intents, markers and retire tombstone.
        # A drop's own tombstone (``drop/<token>``) without the retire tombstone means that drop had
        # not decided to succeed (it writes ``retired`` before deleting anything): nothing is gone.
        # It is still deciding, or it crashed and left the rollout fenced; this freeze's fence
        # re-opens nothing but lets the rollout be consumed again. If that drop then succeeds, the
        # entries this freeze loads vanish (masked) and its drop fails (retired).
        async def snapshot_of(listed: list[ListedObject]) -> tuple[RolloutScan, FrozenSnapshot | None]:
            scan = scan_listing(prefix, listed, seen_at=awake_clock())
            return scan, None if scan.retired else await self._snapshot_of(rollout_id, scan)

        scan, snapshot = await beside_confirmation(
            self.transport.confirm_listing_end(prefix, listing), listing, snapshot_of
        )
        if snapshot is None:
            await self._put(prefix + "fence", FENCE_RETIRED)  # undo our overwrite of the retired fence
            raise TokenCaptureRetiredError(f"rollout {rollout_id!r} is retired; delete it before reusing the id")
        version, snapshot_id, reasons = snapshot.version, snapshot.snapshot_id, snapshot.reasons
        self._saw_fence(rollout_id, fenced_at, version, snapshot_id)
        # A frozen rollout takes no more writes: its call-key map is not needed again.
        self._call_keys.forget(rollout_id)
        manifest_key = _manifest_key(prefix, version, snapshot_id)
        if all(item.key != manifest_key for item in scan.snaps):
            # Awaited, not written in the background: a background PUT could land after another
            # client's retire or delete of the rollout and leave a stray object there (docs/design.md).
            plen = len(prefix)
            manifest = {
                "format": _MANIFEST_FORMAT,
                "rollout_id": rollout_id,
                "version": version,
                "snapshot_id": snapshot_id,
                "incomplete": snapshot.incomplete,
                "reasons": list(reasons),
                "objects": [
                    {"key": i.key[plen:], "etag": i.etag, "size": i.size}
                    for i in sorted(scan.log + scan.foreign, key=lambda i: i.key)
                ],
            }
            await self._put(manifest_key, msgspec.json.encode(manifest))
        if snapshot.incomplete:
            log.info("rollout %r froze incomplete: %s", rollout_id, "; ".join(reasons[:5]))
        return snapshot

    async def read_snapshot(
        self, rollout_id: str, *, sealed: bool = True, listing: Sequence[ListedObject] | None = None
    ) -> FrozenSnapshot:
        """The snapshot ``freeze`` would return for the rollout's listed state, without writing.

        Read-only (GET and LIST permission only: ``docs/permissions.md``): nothing is written, no
        fence is set, and this client's freeze bookkeeping is left alone. The snapshot is built
        from the listing by the same private method ``freeze`` uses, so its ``entries`` (in
        ``entry_type``), ``version``, ``snapshot_id``, ``incomplete`` and ``reasons`` are exactly
        what a ``freeze`` of that state gives; a consumer can then ``drop`` it conditionally as usual
        (with write permission).

        ``sealed=True`` (the exporter's default): the rollout must be frozen and unchanged since
        its freeze, i.e. the sealed manifest ``snap/<version:020d>-<snapshot_id>`` of exactly the
        listed state exists. That manifest is read and checked against the listing (its format,
        ``rollout_id``, ``version``, ``snapshot_id`` and the keys of its objects); a manifest that
        does not match is damage or a foreign object, never trusted. ``sealed=False``: the snapshot
        of the listed state whatever it is (an open rollout, or one written to after its freeze);
        an open rollout can still change, so such a snapshot is a moment's view.

        ``listing``: the rollout's objects as a listing already showed them (every key under its
        prefix, as ``rollouts_listed`` yields them); the snapshot is then that listed state's,
        judged and checked against its sealed manifest exactly as above, without a LIST of its
        own. An exporter that listed the root reads each rollout this way; the listed state may be
        older than a fresh listing (a rollout dropped since shows its objects ``vanished``).

        Requests: one LIST page per 1,000 keys of the rollout (none with ``listing``), then in
        parallel one GET per entry not cached, (``sealed=True``) one GET of the manifest and
        (without ``listing``) one LIST after the listing's last key that confirms its end.

        Raises:
            TokenCaptureRetiredError: the rollout is retired (its records are gone or going).
            SnapshotNotSealedError: ``sealed=True`` and the rollout is open (``state="open"``) or
                changed since its freeze, or its freeze did not finish (``state="changed"``).
            StoreError: the store failed (e.g. ``AccessDenied``), the listed manifest vanished, or
                it is corrupt or does not match the listing (the message names its key).
            ValueError: an id that cannot be stored, or a ``listing`` key outside the rollout's prefix.
        """
        prefix = self.layout.rollout(rollout_id)
        if listing is None:
            # The listing's end is confirmed by one more LIST, beside the snapshot's GETs (as in
            # freeze); where it shows more keys, the snapshot is read again with them.
            listed = await self._list(prefix)
            return await beside_confirmation(
                self.transport.confirm_listing_end(prefix, listed),
                listed,
                lambda whole: self.read_snapshot(rollout_id, sealed=sealed, listing=whole),
            )
        else:
            outside = next((item.key for item in listing if not item.key.startswith(prefix)), None)
            if outside is not None:
                raise ValueError(f"listing of rollout {rollout_id!r} holds {outside!r}, outside its prefix {prefix!r}")
            scan = scan_listing(prefix, listing, seen_at=awake_clock())
        if scan.retired:
            raise TokenCaptureRetiredError(f"rollout {rollout_id!r} is retired; it has no snapshot to read")
        version, snapshot_id = scan.version_and_id()
        manifest_key = _manifest_key(prefix, version, snapshot_id)
        if not sealed:
            return await self._snapshot_of(rollout_id, scan)
        if not scan.fence:
            if not (scan.contents or scan.retired):  # folder markers alone: nothing written
                raise SnapshotNotSealedError(
                    f"rollout {rollout_id!r} has no objects under {prefix!r}: never written, or deleted "
                    "(a mistyped id or root reads like this too)",
                    state="open",
                    key=manifest_key,
                )
            raise SnapshotNotSealedError(
                f"rollout {rollout_id!r} is open (never frozen): it has no sealed snapshot; freeze it first, "
                "or read its current state with sealed=False",
                state="open",
                key=manifest_key,
            )
        if all(item.key != manifest_key for item in scan.snaps):
            sealed_versions = sorted(item.key[len(prefix) + len("snap/") :] for item in scan.snaps)
            newest = (
                f"; the newest sealed manifest is snap/{sealed_versions[-1]}"
                if sealed_versions
                else "; no sealed manifest exists (its freeze did not finish)"
            )
            raise SnapshotNotSealedError(
                f"rollout {rollout_id!r} changed since its freeze: its listed state (version {version}, snapshot "
                f"{snapshot_id}) has no sealed manifest{newest}; freeze it again, or read it with sealed=False",
                state="changed",
                key=manifest_key,
            )
        objects = sorted(item.key[len(prefix) :] for item in scan.log + scan.foreign)
        limit = _MANIFEST_BASE_BYTES + _MANIFEST_BYTES_PER_OBJECT * len(objects)
        # Both always finish (a failure of one never leaves the other running unobserved); the
        # manifest's error is the one raised when both fail.
        manifest, snapshot = await asyncio.gather(
            self._read_manifest(manifest_key, limit), self._snapshot_of(rollout_id, scan), return_exceptions=True
        )
        for outcome in (manifest, snapshot):
            if isinstance(outcome, BaseException):
                raise outcome
        assert isinstance(manifest, _Manifest) and isinstance(snapshot, FrozenSnapshot)
        problem = ""
        if manifest.format != _MANIFEST_FORMAT:
            problem = f"its format is {manifest.format!r}, not {_MANIFEST_FORMAT!r}"
        elif manifest.rollout_id != rollout_id:
            problem = f"it names rollout {manifest.rollout_id!r}"
        elif (manifest.version, manifest.snapshot_id) != (version, snapshot_id):
            problem = f"it names version {manifest.version} and snapshot {manifest.snapshot_id!r}"
        elif [item.key for item in manifest.objects] != objects:
            problem = f"its {len(manifest.objects)} object keys are not the {len(objects)} listed ones"
        if problem:
            raise StoreError(
                f"sealed manifest {manifest_key} does not match the listing of rollout {rollout_id!r} "
                f"(version {version}, snapshot {snapshot_id}): {problem}; it is damaged or not s3capture's "
                f"({_MANIFEST_REMEDY})",
                operation="GET",
                key=manifest_key,
            )
        return snapshot

    async def _read_manifest(self, key: str, limit: int) -> _Manifest:
        """The sealed manifest at ``key``; ``StoreError`` naming the key when it vanished, is larger
        than ``limit`` bytes, or is not a manifest."""
        try:
            data = await self._get(key, limit)
        except RecordError as error:
            raise StoreError(
                f"sealed manifest {key} is unreadable: {error} ({_MANIFEST_REMEDY})", operation="GET", key=key
            ) from None
        if data is None:
            raise StoreError(
                f"sealed manifest {key} was listed but vanished (the rollout is being dropped, retired or deleted)",
                operation="GET",
                key=key,
            )
        try:
            return msgspec.json.decode(data, type=_Manifest)
        except (msgspec.DecodeError, RecursionError) as error:  # RecursionError: nested past the stack
            raise StoreError(
                f"sealed manifest {key} is not an s3capture manifest: {error} ({_MANIFEST_REMEDY})",
                operation="GET",
                key=key,
            ) from None

    async def _snapshot_of(self, rollout_id: str, scan: RolloutScan) -> FrozenSnapshot:
        """The snapshot of a scanned rollout: the one builder ``freeze`` and ``read_snapshot`` share.

        Loads every listed entry (cache, else one GET each, in parallel), judges the log (conflicting
        payloads, dangling intents, markers, foreign, unreadable, vanished and misfiled objects,
        missing parents and broken delta chains), derives ``version`` and ``snapshot_id`` from the
        listing and hands the chosen entries out in ``entry_type``. Reads only; touches no freeze
        bookkeeping. Raises ``StoreError`` when the store fails.
        """
        prefix = scan.prefix
        reasons: list[str] = []
        plen = len(prefix)
        # call id -> SHA-256 -> every listed key holding those bytes, with its fingerprint (a copy
        # under another fingerprint's key has the same SHA-256 and must be read and judged too).
        # Each key was parsed once, by the scan.
        by_call: dict[str, dict[str, list[tuple[ListedObject, str]]]] = {}
        intents: set[str] = set()
        for item, (kind, cid, fp, sha) in zip(scan.log, scan.parsed):
            if kind == "e":
                by_call.setdefault(cid, {}).setdefault(sha, []).append((item, fp))
            elif kind == "i":
                intents.add(cid)
            else:
                reasons.append(f"marked_incomplete:{cid}")
        for item in scan.foreign:
            reasons.append(f"foreign_object:{item.key[plen:]}")

        wanted = [
            (item, cid, fp, sha)
            for cid, variants in by_call.items()
            for sha, items in variants.items()
            for item, fp in items
        ]
        # Cached entries are taken without a task each (a warm freeze is one LIST and no GET); only
        # the misses are fetched, in parallel.
        loaded: list[tuple[_Stored | None, str]] = [(None, "")] * len(wanted)
        misses: list[int] = []
        cache = self._cache
        for index, (item, _, _, _) in enumerate(wanted):
            stored = cache.get(item.key)
            if stored is None:
                misses.append(index)
            else:
                loaded[index] = (stored, "")

        async def load(item: ListedObject, sha: str) -> tuple[_Stored | None, str]:
            try:
                stored = await self._load(item.key, sha, item.size)
            except RecordError as error:
                return None, f"unreadable:{item.key[plen:]}:{error}"
            if stored is None:
                return None, f"vanished:{item.key[plen:]}"
            return stored, ""

        if misses:
            fetched = await asyncio.gather(*(load(wanted[i][0], wanted[i][3]) for i in misses))
            for index, result in zip(misses, fetched):
                loaded[index] = result
        payloads: dict[str, dict[str, tuple[str, _Stored]]] = {}
        for (item, cid, fp, sha), (stored, problem) in zip(wanted, loaded):
            if problem:
                reasons.append(problem)
                continue
            assert stored is not None
            entry = stored.entry
            if entry.rollout_id != rollout_id or entry.model_call_id != cid or entry.continuation_fingerprint != fp:
                reasons.append(f"misfiled:{item.key[plen:]}")
                continue
            payloads.setdefault(cid, {})[sha] = (item.key, stored)
        chosen: list[tuple[str, str, _Stored]] = []
        for cid in sorted(by_call):
            if len(by_call[cid]) > 1:
                reasons.append(f"conflicting_payloads:{cid}")
                continue
            if cid in payloads and len(payloads[cid]) == 1:
                ((sha, (key, stored)),) = payloads[cid].items()
                chosen.append((key, sha, stored))
        for cid in sorted(intents - by_call.keys()):
            reasons.append(f"dangling_intent:{cid}")
        present = {stored.entry.model_call_id for _, _, stored in chosen}
        for _, _, stored in chosen:
            entry = stored.entry
            if entry.parent_call_id is not None and entry.parent_call_id not in present:
                # A continuation whose parent is not in the snapshot: the chain has a hole (a lost
                # entry, or a listing that skipped a key), whatever the prompt's storage.
                reasons.append(f"missing_parent:{entry.model_call_id}")
                if entry.prompt_is_delta:
                    # Its prompt is only a suffix: it cannot even be rebuilt.
                    reasons.append(f"broken_chain:{entry.model_call_id}")
        version, snapshot_id = scan.version_and_id()
        reasons.sort()
        if self.entry_type == "gym":
            out: tuple[Any, ...] = tuple(to_gym(stored.entry) for _, _, stored in chosen)
        else:
            out = tuple(await self._hand_out(chosen))
        return FrozenSnapshot(rollout_id, out, bool(reasons), snapshot_id, version, tuple(reasons))

    async def _hand_out(self, chosen: list[tuple[str, str, _Stored]]) -> list[TokenEntry]:
        """The entries a snapshot returns, none of which shares a mutable part with what internal
        readers use.

        Internal readers (``resolve``, delta chains, ``freeze``'s checks) use only an entry's
        scalar fields and its token-id lists. So the first hand-out of a cached entry is a shallow
        copy with its own token-id and log-probability lists (microseconds, not a validated
        re-decode); its nested ``output_items``, ``routed_experts`` and extra fields are shared with
        the cache, which marks the entry ``lent`` with a digest of their encoding (usually a few
        hundred bytes: no token lists). A later hand-out of a lent entry encodes those nested parts
        again: unchanged, it hands out a shallow copy whose nested parts are an independent decode
        of that encoding; changed or unencodable (a caller mutated a nested part in place), it
        drops the cached object and GETs the entry again. No caller ever sees another caller's
        mutations.
        """
        out: list[TokenEntry] = []
        refetch: list[tuple[int, str, str]] = []
        for key, sha, stored in chosen:
            nested = _nested_encoding(stored.entry)
            if nested is not None:
                if not stored.lent:
                    stored.lent = _nested_digest(nested)
                    out.append(_shallow_copy(stored.entry))
                    continue
                if _nested_digest(nested) == stored.lent:
                    out.append(_detached_copy(stored.entry, nested))
                    continue
            self._cache.discard(key)
            refetch.append((len(out), key, sha))
            out.append(stored.entry)  # placeholder, replaced below
        for position, key, sha in refetch:
            data = await self._get(key, self._read_limit())
            if data is None:
                raise StoreError(f"{key} vanished while its snapshot was handed out", operation="GET", key=key)
            out[position] = self._decode_object(data, sha).entry
        return out

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire the exact frozen snapshot that was consumed; False if anything changed since.

        Contract: ``TokenSource.drop`` (a conditional drop: it fails, keeping the evidence, when a
        write raced the freeze). Steps: LIST; unless the rollout is frozen at exactly ``version``
        and ``snapshot_id``, return False. Wait until ``fence_grace`` has passed, on this client's
        monotonic clock, since it knew the fence existed (its own freeze's fence PUT returned, or
        this LIST showed the fence) — never by comparing timestamps of different machines. Then PUT
        a unique drop tombstone and the retired fence, and LIST again (the decisive LIST, which must
        show that tombstone): if the version or id changed, restore the frozen fence, delete only
        its own tombstone and return False; else write the retire tombstone and delete the records
        (drop tombstones included, all after the retire tombstone: ``mark_incomplete`` relies on
        that order, as no fence read can be trusted once a late-delivered fence PUT may overwrite it).
        So every acknowledged put or marker is in the snapshot or fails the drop.

        Requests: one LIST page per 1,000 keys of the rollout; when it matches, a wait of up to
        ``fence_grace`` seconds, a PUT of the drop tombstone, a PUT of the fence, the decisive LIST;
        then either a PUT of the fence and a DELETE of the tombstone (False), or PUTs of the retire
        tombstone and the fence and one DeleteObjects per 1,000 records (True).

        Returns True when the snapshot was retired (its records are deleted), False when the
        rollout is not frozen at exactly ``version`` and ``snapshot_id`` (changed, open, or retired
        already); nothing is removed then.

        Raises:
            TypeError: ``snapshot_id`` not a str or ``version`` not an int (before any request:
                swapped or mistyped arguments answered False, "changed since the freeze", and a
                caller then retired the rollout without ever hearing of its mistake).
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request; ``ListingError`` (a ``StoreError``) for a
                decisive listing without the tombstone, after retries.
        """
        if not isinstance(snapshot_id, str):
            raise TypeError(
                f"snapshot_id must be the str FrozenSnapshot.snapshot_id, got {type(snapshot_id).__name__}"
                " (drop takes rollout_id, snapshot_id, version in that order)"
            )
        if isinstance(version, bool):
            raise TypeError("version must be the int FrozenSnapshot.version, got bool")
        try:
            version = operator.index(version)
        except TypeError:
            raise TypeError(
                f"version must be the int FrozenSnapshot.version, got {type(version).__name__} {version!r}"
                " (drop takes rollout_id, snapshot_id, version in that order)"
            ) from None
        prefix = self.layout.rollout(rollout_id)
        scan = await self._scan(rollout_id)
        if not scan.fence or scan.retired or scan.version_and_id() != (version, snapshot_id):
            self._fence_seen.pop(rollout_id, None)
            return False
        # Wait from when this client's own freeze of exactly this snapshot had its fence in place,
        # else from this LIST (which showed the fence, so it returned after the fence existed).
        seen_at, seen_version, seen_id = self._fence_seen.get(rollout_id, (scan.seen_at, version, snapshot_id))
        if (seen_version, seen_id) != (version, snapshot_id):
            seen_at = scan.seen_at
        wait = seen_at + self._fence_grace + _CLOCK_SLACK - awake_clock()
        if wait > 0:
            await asyncio.sleep(wait)
        tombstone = f"drop/{uuid.uuid4().hex}"
        await self._put(prefix + tombstone, b"")
        await self._put(prefix + "fence", FENCE_RETIRED)
        # A marker may land after the first LIST having read the fence before it said retired (it
        # must succeed after freeze); this LIST, after the retired fence, sees every such marker.
        # Our tombstone may be gone only because a drop (or retire) beside this one decided
        # first: it writes the retire tombstone before it deletes anything, ours included. A
        # listing that shows the retire tombstone answers False at once; any other listing
        # without our tombstone cannot be trusted (retried, then ListingError).
        after = await self._scan(rollout_id, require=[tombstone], unless=["retired"])
        if after.retired or not after.fence or after.version_and_id() != (version, snapshot_id):
            if not after.retired:
                await self._put(prefix + "fence", FENCE_FROZEN)
            await self._delete_one(prefix + tombstone)  # ours alone: a unique key
            return False
        await self._write_retired(prefix)  # before any delete: a drop tombstone goes only after it
        await self._delete_keys([i.key for i in after.records])
        self._cache.discard_prefix(prefix)
        self._forget_rollout(rollout_id)
        return True

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and keep a fence, whatever their state (idempotent).

        Returns ``{"removed": [...], "absent": [...]}``: removed are ids that had records or an
        unretired fence (including refused late writes a retired rollout kept, which no reader
        uses); absent are ids with nothing to remove (never written, or retired already). Later
        writes to a retired rollout raise ``TokenCaptureRetiredError``. Contract:
        ``TokenSource.retire`` in the protocol reference.

        Requests per rollout (up to 8 rollouts at a time): one LIST page per 1,000 keys, PUTs of
        the retired fence (for an open rollout, first), the retire tombstone and the retired fence,
        one DeleteObjects per 1,000 records.

        Raises:
            TypeError: ``rollout_ids`` is a single str.
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request.
        """
        removal = await super().retire(rollout_ids)
        for rollout_id in rollout_ids:
            self._forget_rollout(rollout_id)  # no more writes: its call keys and fence time go
        return removal

    # ------------------------------------------------------------------ LineageResolver
    async def resolve(self, rollout_id: str, request_items: list[dict]) -> LineageResolution:
        """Return ROOT, RESOLVED (exactly one proven parent) or UNRESOLVED with a reason.

        Requests: one LIST of the request fingerprint's prefix and GETs of the candidates not yet
        cached (two round trips), plus, for a delta winner whose tokens are not memoized, one
        parallel round trip: its own checkpoint, or its nearest checkpoint and the entries after it
        (more only where a checkpoint is missing or fails its digest). A call id
        with more than one payload under the fingerprint counts as zero candidates; candidates
        must match the recorded request context (``conversation_digest`` of the leading items);
        several candidates count as one only when their cumulative tokens are identical.

        ``request_items``: the continuation request's input items (Responses-API dicts), in order.
        Returns a ``LineageResolution``: ROOT (no assistant turn in the request); RESOLVED with a
        ``LineageMatch`` (``model_call_id``, the parent's ``cumulative_token_ids``, its ``digest``,
        ``prev_len`` = their count); or UNRESOLVED with a ``reason`` (``docs/reasons.md``,
        "Unresolved lineage reasons"). Malformed request items give UNRESOLVED, never an error.

        Raises:
            ValueError: an unstorable ``rollout_id`` (before any request).
            StoreError: the store failed the LIST or a GET.
        """
        prefix = self.layout.rollout(rollout_id)
        try:
            fingerprint = _fp.assistant_fingerprint(request_items)
        except Exception as error:  # noqa: BLE001 - any malformed request is UNRESOLVED, never a crash
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=f"malformed_request: {error}")
        if not fingerprint:
            return LineageResolution(ParentResolutionStatus.ROOT)
        listing = await self._list(f"{prefix}log/e/{escape_id(fingerprint)}/")
        by_call: dict[str, list[str]] = collections.defaultdict(list)
        sizes: dict[str, int] = {}
        for item in listing:
            parsed = parse_log_key(item.key[len(prefix) :])
            if parsed is not None and parsed[0] == "e" and parsed[2] == fingerprint:
                by_call[parsed[1]].append(item.key)
                sizes[item.key] = item.size
        if not by_call:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="no_match")
        conflicted = sorted(cid for cid, keys in by_call.items() if len(keys) > 1)
        if conflicted:
            # A call id with several payloads is zero candidates, and it must not let another call
            # with the same model output win by elimination either: that would be a guess.
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="conflicting_payloads")
        singles = [keys[0] for cid, keys in by_call.items() if len(keys) == 1]

        async def load(key: str) -> _Stored | None:
            try:
                return await self._load(key, key.rsplit("/", 1)[-1][:-4], sizes.get(key))
            except RecordError:
                return None

        # The common single candidate is loaded in this task (no task and gathering future for it).
        loaded = [await load(singles[0])] if len(singles) == 1 else await asyncio.gather(*(load(k) for k in singles))
        if any(stored is None for stored in loaded):
            # An unreadable or vanished candidate might be the parent: never win by elimination.
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="unreadable_candidate")
        candidates: list[tuple[str, _Stored]] = []
        for key, stored in zip(singles, loaded):
            assert stored is not None
            entry = stored.entry
            if entry.rollout_id != rollout_id or entry.continuation_fingerprint != fingerprint:
                continue
            if entry.fingerprint_version is not None and entry.fingerprint_version != _fp.FINGERPRINT_VERSION:
                continue
            if not entry.continuation_context_digest or len(request_items) < entry.continuation_context_len:
                continue
            try:
                context = _fp.conversation_digest(request_items[: entry.continuation_context_len])
            except Exception as error:  # noqa: BLE001 - malformed request items: UNRESOLVED
                return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=f"malformed_request: {error}")
            if context != entry.continuation_context_digest:
                continue
            self._remember(rollout_id, entry.model_call_id, key[len(prefix) :])
            candidates.append((key, stored))
        if len(candidates) > 1 and _interchangeable([stored.entry for _, stored in candidates]):
            candidates = [min(candidates, key=lambda c: c[1].entry.model_call_id)]
        if len(candidates) != 1:
            reason = "ambiguous" if candidates else "no_match"
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=reason)
        key, stored = candidates[0]
        if stored.entry.prompt_is_delta and not stored.entry.digest:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="unverifiable_parent")
        try:
            tokens = await self._cumulative(prefix, key, stored)
            digest = compute_digest(tokens)
        except (RecordError, ValueError) as error:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=f"unreadable_parent: {error}")
        entry = stored.entry
        if entry.digest and digest != entry.digest:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="digest_mismatch")
        return LineageResolution(
            ParentResolutionStatus.RESOLVED,
            match=LineageMatch(
                model_call_id=entry.model_call_id,
                cumulative_token_ids=tuple(tokens),
                digest=digest,
                prev_len=len(tokens),
            ),
        )

    async def _cumulative(self, prefix: str, key: str, stored: _Stored) -> list[int]:
        """Cumulative tokens of an entry, rebuilding a delta prompt through its ancestors.

        An entry with its own checkpoint (``cum_self``) costs one GET. Otherwise its envelope names
        its nearest ancestors back to the last checkpoint or anchor (farthest first, at most
        ``CHAIN_KEYS``) and the checkpoint of the farthest (``cum_base``): one round trip fetches
        them all in parallel. A checkpoint counts only if its tokens match the digest (and
        ``cum_len``) of the entry it belongs to; a missing, corrupt or forged one is ignored and the
        walk goes on window by window, stopping at the nearest ancestor whose cumulative tokens are
        memoized or at a full-prompt anchor. Every parent link is checked, a key seen twice (a
        forged cycle) or a chain over 100,000 calls is refused, and the rebuilt tokens must match
        the entry's digest. Raises ``RecordError`` for a missing or broken chain, and for a delta
        entry without a digest (nothing could verify its rebuilt tokens).
        """
        if stored.cumulative is not None:
            return list(stored.cumulative)
        if not stored.entry.prompt_is_delta:
            return [*stored.entry.prompt_token_ids, *stored.entry.generation_token_ids]
        if not stored.entry.digest:
            # Nothing could prove the rebuilt tokens: the envelope's chain is a hint outside the
            # key's SHA-256, and its writer may have named a conflicting payload, another
            # attempt's key or a forged copy. Gym stamps a digest on every delta it writes.
            raise RecordError(
                f"delta entry {stored.entry.model_call_id!r} carries no digest, so its rebuilt tokens cannot be verified"
            )
        if stored.cum_self:
            own = await self._load_checkpoint(prefix, stored.cum_self)
            if own is not None and _checkpoint_matches(stored.cum_self, own, stored.entry):
                self._memoize(key, stored, own[0])
                return own[0]
        # path: (key, stored) from the entry back towards the base, nearest first.
        path: list[tuple[str, _Stored]] = [(key, stored)]
        seen = {key}
        base: list[int] | None = None
        current = stored
        while base is None:
            chain = _checked_chain(current)
            if not chain:
                raise RecordError(f"delta entry {current.entry.model_call_id!r} carries no ancestor keys")
            keys = [prefix + rel for rel in chain]
            if seen.intersection(keys) or len(path) > 100_000:
                raise RecordError(f"delta chain of {stored.entry.model_call_id!r} is cyclic or too deep")
            loads: list[Any] = [self._load(k, k.rsplit("/", 1)[-1][:-4]) for k in keys]
            farthest_cached = self._cache.get(keys[0])
            if current.cum_base and (farthest_cached is None or farthest_cached.cumulative is None):
                loads.append(self._load_checkpoint(prefix, current.cum_base))
            fetched = await asyncio.gather(*loads)
            ancestors = fetched[: len(keys)]
            base_tokens = fetched[len(keys)] if len(fetched) > len(keys) else None
            window: list[tuple[str, _Stored]] = []
            for ancestor_key, ancestor in zip(keys, ancestors):
                if ancestor is None:
                    raise RecordError(f"ancestor {ancestor_key} of {stored.entry.model_call_id!r} is missing")
                window.append((ancestor_key, ancestor))
            for nearer, farther in zip([current, *(a for _, a in reversed(window))], [a for _, a in reversed(window)]):
                if (
                    nearer.entry.parent_call_id != farther.entry.model_call_id
                    or farther.entry.rollout_id != stored.entry.rollout_id
                ):
                    raise RecordError(
                        f"ancestor chain of {stored.entry.model_call_id!r} is broken at {farther.entry.model_call_id!r}"
                    )
            seen.update(keys)
            farthest_key, farthest = window[0]
            if base_tokens is not None and _checkpoint_matches(current.cum_base, base_tokens, farthest.entry):
                self._memoize(farthest_key, farthest, base_tokens[0])
            for ancestor_key, ancestor in reversed(window):
                if ancestor.cumulative is not None:
                    base = list(ancestor.cumulative)
                    break
                if not ancestor.entry.prompt_is_delta:
                    base = [*ancestor.entry.prompt_token_ids, *ancestor.entry.generation_token_ids]
                    break
                path.append((ancestor_key, ancestor))
            else:
                current = window[0][1]
        tokens = base
        for _, link in reversed(path):
            tokens.extend(link.entry.prompt_token_ids)
            tokens.extend(link.entry.generation_token_ids)
        if stored.entry.digest and compute_digest(tokens) != stored.entry.digest:
            raise RecordError(f"rebuilt tokens of {stored.entry.model_call_id!r} fail their digest")
        self._memoize(key, stored, tokens)
        return tokens
