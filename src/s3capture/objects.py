"""The objects ``S3TokenStore`` writes beside the protocol's records, and their checks.

- **Entry envelopes** (``e/<call>/<sha>.zst``): the canonical entry bytes (Gym's, byte for byte)
  wrapped with the keys of the entry's nearest delta ancestors and checkpoint hints, compressed
  with zstd (``_Envelope``).
- **Sealed manifests** (``snap/<version:020d>-<snapshot_id>``): the keys, ETags and sizes a freeze
  saw, and its verdict (``_Manifest``).
- **Checkpoints** (``cum/<digest>.zst``): a delta chain's cumulative tokens in Gym's digest encoding
  (``_decode_tokens``, ``_checkpoint_matches``).

The layout of the keys is ``s3capture.layout``'s; every request and race is in ``docs/design.md``.
Names with a leading underscore are internal to the package (the store, the tools and tests).
"""

from __future__ import annotations

import array
import struct
import sys

import msgspec

from s3capture.cache import Stored as _Stored
from s3capture.layout import MAX_KEY_BYTES, MAX_SEGMENT_BYTES, parse_log_key
from s3capture.records import TokenEntry

__all__ = ["CHAIN_KEYS", "CHECKPOINT_EVERY"]

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ENVELOPE_FORMAT = "s3capture.entry/1"
_ENVELOPE_TAIL = b',"format":"' + _ENVELOPE_FORMAT.encode() + b'"}'
_MANIFEST_FORMAT = "s3capture.manifest/1"
_MANIFEST_BASE_BYTES = 1 << 20
_MANIFEST_BYTES_PER_OBJECT = 8 * 1024
"""Largest sealed manifest ``read_snapshot`` reads: 1 MiB plus 8 KiB per listed object (a key is at
most 1,024 bytes, which JSON escapes at most sixfold, plus its ETag and size)."""

CHAIN_KEYS = 16
"""How many nearest ancestor keys a delta entry's envelope carries at most (bounded, so storage is
O(1) per entry). A chain deeper than this is rebuilt from a checkpoint, or without one in one more
round trip per ``CHAIN_KEYS`` ancestors."""

CHECKPOINT_EVERY = CHAIN_KEYS
"""K: ``put`` writes a checkpoint (the entry's cumulative tokens, ``cum/<digest>.zst``) beside every
delta entry that is K calls below its chain's last checkpoint or full-prompt anchor, so a fresh
resolver rebuilds any delta entry from one checkpoint and at most K - 1 deltas (``docs/design.md``)."""

_TOKEN_HEADER = 9  # encode_token_ids: version byte + big-endian u64 count


class _Envelope(msgspec.Struct, kw_only=True):
    """The stored object: canonical entry bytes plus the keys of its delta ancestors.

    ``chain``: keys of the nearest ancestors, farthest first, ending at the parent. ``cum_base``:
    the checkpoint of ``chain[0]``'s cumulative tokens; ``cum_self``: the checkpoint of this
    entry's own. Both are optional hints outside the canonical bytes (a reader verifies what they
    name against the entries' digests); objects written before them decode with ``""``, and
    readers that predate them ignore them (unknown fields are skipped).
    """

    format: str
    entry: msgspec.Raw
    chain: list[str] = []
    cum_base: str = ""
    cum_self: str = ""


class _ManifestObject(msgspec.Struct):
    key: str
    etag: str = ""
    size: int = 0


class _Manifest(msgspec.Struct):
    """A sealed manifest (``snap/<version:020d>-<snapshot_id>``), as ``freeze`` writes it."""

    format: str
    rollout_id: str
    version: int
    snapshot_id: str
    objects: list[_ManifestObject]
    incomplete: bool = False
    reasons: list[str] = []


def _manifest_key(prefix: str, version: int, snapshot_id: str) -> str:
    """Key of the sealed manifest of a rollout state (``prefix`` is the rollout's)."""
    return f"{prefix}snap/{version:020d}-{snapshot_id}"


class _Link(msgspec.Struct):
    """Where a new delta entry hangs: its envelope's chain and base checkpoint, and its parent."""

    chain: tuple[str, ...]
    cum_base: str
    parent_key: str
    parent: _Stored


_CHECKPOINT_MAX_TOKENS = 4_000_000
"""Largest checkpoint read: cumulative tokens are bounded by a model's context window (today at
most a few million tokens); a longer one is ignored (readers walk the chain instead)."""
_CHECKPOINT_MAX_BYTES = _TOKEN_HEADER + 8 * _CHECKPOINT_MAX_TOKENS


def _decode_tokens(raw: bytes) -> list[int] | None:
    """Token ids from Gym's digest encoding (``encode_token_ids``); ``None`` if malformed."""
    if len(raw) < _TOKEN_HEADER or raw[0] != 1:
        return None
    count = int.from_bytes(raw[1:_TOKEN_HEADER], "big")
    if len(raw) != _TOKEN_HEADER + 8 * count:
        return None
    ids = array.array("Q")
    if ids.itemsize != 8:  # pragma: no cover - a platform whose unsigned long long is not 64 bits
        return list(struct.unpack(f">{count}Q", raw[_TOKEN_HEADER:]))
    ids.frombytes(raw[_TOKEN_HEADER:])
    if sys.byteorder == "little":
        ids.byteswap()
    return ids.tolist()


def _is_entry_rel(rel: str) -> bool:
    """Whether ``rel`` (relative to a rollout prefix) is an entry key s3capture writes: its shape,
    and segments no longer than the layout ever builds (Ceph answers an over-long key with an
    error, not a 404)."""
    if len(rel) > MAX_KEY_BYTES or any(len(segment.encode()) > MAX_SEGMENT_BYTES for segment in rel.split("/")):
        return False
    parsed = parse_log_key(rel)
    return parsed is not None and parsed[0] == "e"


def _checked_chain(stored: _Stored) -> tuple[str, ...]:
    """``stored``'s ancestor keys (its envelope's chain hint) once checked: a chain of more than
    ``CHAIN_KEYS`` keys (no writer builds one; a walk GETs a window's keys all at once) or holding
    anything but keys of an entry's shape is dropped whole (a walk then reports the chain as
    missing: UNRESOLVED, never a request for a forged key). Checked once per cached object."""
    if not stored.chain_checked:
        chain = stored.chain
        if len(chain) > CHAIN_KEYS or not all(isinstance(rel, str) and _is_entry_rel(rel) for rel in chain):
            stored.chain = ()
        stored.chain_checked = True
    return stored.chain


def _checkpoint_matches(rel: str, checkpoint: tuple[list[int], str], entry: TokenEntry) -> bool:
    """Whether checkpoint ``rel`` (its tokens and their digest) holds exactly ``entry``'s cumulative tokens."""
    digest = entry.digest
    tokens, tokens_digest = checkpoint
    if not digest or rel != f"cum/{digest}.zst":
        return False
    if entry.cum_len is not None and entry.cum_len != len(tokens):
        return False
    return tokens_digest == digest


_MANIFEST_REMEDY = (
    "a sealed manifest is derived data: delete that object and freeze the rollout again, which writes it anew"
)
