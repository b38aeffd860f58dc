"""``S3TokenStore``'s shared private machinery: stored entry objects and the tokens they hold.

``_StoreCore`` is the one base of the store's private mixins (``s3capture.store_writes``,
``store_snapshots``, ``store_lifecycle`` and ``store_lineage``; ``s3capture.store`` combines them).
It declares the state ``S3TokenStore.__init__`` sets, encodes, decompresses and decodes entry
objects (the envelope of ``s3capture.objects``), loads them through the cache, reads delta
checkpoints and rebuilds a delta entry's cumulative tokens through its ancestors (``_cumulative``:
``resolve`` uses it, and ``put`` for a checkpoint). ``_packed_tokens`` is the memo format of those
tokens (the cache counts its bytes).
"""

from __future__ import annotations

import array
import asyncio
import collections
import hashlib
import io
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import zstandard

from s3capture.cache import CallKeys
from s3capture.cache import Stored as _Stored
from s3capture.cache import entry_heap_estimate as _heap_estimate
from s3capture.errors import StoreError
from s3capture.layout import is_checkpoint_rel
from s3capture.objects import (
    _CHECKPOINT_MAX_BYTES,
    _ENVELOPE_FORMAT,
    _ENVELOPE_TAIL,
    _ZSTD_MAGIC,
    _checked_chain,
    _checkpoint_matches,
    _decode_tokens,
    _Envelope,
)
from s3capture.records import (
    _DIGEST_DOMAIN,
    OversizeRecordError,
    RecordError,
    compute_digest,
    decode_canonical_entry,
)
from s3capture.rollouts import RolloutObjects

log = logging.getLogger("s3capture")


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


class _StoreCore(RolloutObjects):
    """State and object machinery every part of ``S3TokenStore`` uses (private)."""

    # Set by ``S3TokenStore.__init__`` (declared here for the mixins' type checks).
    entry_type: str
    _call_keys: CallKeys
    _compression_level: int
    _compressors: threading.local
    _max_entry_bytes: int
    _fence_grace: float
    _fence_seen: collections.OrderedDict[str, tuple[float, int, str]]

    def _forget_rollout(self, rollout_id: str) -> None:
        self._call_keys.forget(rollout_id)
        self._fence_seen.pop(rollout_id, None)

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
        what = f"the {limit}-byte limit" if limit is not None else f"max_entry_bytes={self._max_entry_bytes}"
        if limit is None:
            limit = self._max_entry_bytes + 64 * 1024
        if not data.startswith(_ZSTD_MAGIC):
            if len(data) > limit:
                raise OversizeRecordError(f"object is larger than {what}")
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
                raise OversizeRecordError(f"object decompresses beyond {what}")
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
            raise OversizeRecordError(f"entry is {len(payload)} bytes, over max_entry_bytes={self._max_entry_bytes}")
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
