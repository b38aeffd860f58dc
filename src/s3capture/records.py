"""Record types with NeMo Gym's ``TokenEntry`` wire shape, and their canonical encoding.

The wire shape is NeMo Gym 0.7.0's ``nemo_gym.token_id_capture.records.TokenEntry`` (pydantic,
``extra="allow"``). s3capture holds the same fields in a ``msgspec.Struct``, which decodes and
encodes an entry an order of magnitude faster than the pydantic path.

Canonical encoding (the identity of an entry)
---------------------------------------------
``encode_entry(entry)`` returns the UTF-8 JSON object of every field of the entry, known fields
and unknown extra fields alike, with keys sorted by code point, no insignificant whitespace,
integers in decimal and floats in their shortest round-trip form. Two entries are "the same
payload" exactly when these bytes are equal (the protocol reference: "byte-for-byte, timestamps
included"); the SHA-256 of these bytes names the stored object. Non-finite floats have no JSON
form, so ``generation_log_probs`` containing NaN or infinities is rejected with a ``ValueError``
that names the offending index rather than being stored as ``null``.

Validation (``decode_entry`` and ``coerce_entry``) follows Gym's model validator: a newer
``schema_version`` is refused with ``UnsupportedSchemaError`` naming the version this reader
supports; generation ids and log probabilities must have the same length; ``token_item_index``
must index ``output_items``; parent metadata must agree with ``parent_resolution``; a delta
prompt needs a RESOLVED parent. Token ids must be non-negative integers.
"""

from __future__ import annotations

import array
import copy
import enum
import hashlib
import math
import re
import struct
import sys
from typing import Annotated, Any

import msgspec

# No import cycle: fingerprint imports no s3capture module.
from s3capture.fingerprint import MAX_JSON_DEPTH, _scan_plain

__all__ = [
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_ENTRY_MIN_SCHEMA_VERSION",
    "ParentResolutionStatus",
    "TokenEntry",
    "RecordError",
    "UnsupportedSchemaError",
    "encode_entry",
    "decode_entry",
    "decode_canonical_entry",
    "coerce_entry",
    "prepare_entry",
    "to_gym",
    "compute_digest",
    "cumulative_tokens",
    "stamp_lineage",
    "store_prompt_as_delta",
]

TOKEN_ENTRY_RECORD_SCHEMA_VERSION = 1
"""The newest ``TokenEntry.schema_version`` this reader understands (Gym 0.7.0: 1)."""
TOKEN_ENTRY_MIN_SCHEMA_VERSION = 1

DIGEST_VERSION = 1
_DIGEST_DOMAIN = b"nemo-gym-tokens"
_EMPTY_DIGEST = hashlib.sha256(_DIGEST_DOMAIN).hexdigest()


class RecordError(ValueError):
    """A record is malformed or violates the ``TokenEntry`` contract."""


class OversizeRecordError(RecordError):
    """A stored object holds more than the reader's limit (decompressed, or as it is): reading the
    same bytes again cannot change that, so it is never read again (a body cut short is only ever
    smaller than the object)."""


class UnsupportedSchemaError(RecordError):
    """A record was written by a newer (or older, unsupported) schema than this reader knows."""


class ParentResolutionStatus(str, enum.Enum):
    """Whether a model call has a proven captured predecessor (Gym's ``ParentResolutionStatus``)."""

    ROOT = "root"
    RESOLVED = "resolved"
    UNRESOLVED = "unresolved"

    def __str__(self) -> str:  # StrEnum behaviour on 3.11 without importing StrEnum semantics
        return self.value


TokenId = Annotated[int, msgspec.Meta(ge=0)]
_MAX_TOKEN_ID = 2**64 - 1  # what Gym's digest encoding (big-endian u64) can hold
_I64_MIN = -(2**63)  # orjson's smallest integer
# Integer fields whose range nothing else bounds (schema_version and token_item_index are checked).
_WIDE_INT_FIELDS = ("cum_len", "continuation_context_len", "fingerprint_version")


class TokenEntry(msgspec.Struct, kw_only=True, dict=True):
    """One model call's training data, in NeMo Gym's ``TokenEntry`` wire shape.

    Fields mirror Gym 0.7.0 (same names, defaults and meaning). Unknown fields found on the wire
    are kept in ``extra_fields`` (a ``dict[str, Any]``) and written back unchanged by
    ``encode_entry``. Construct entries through ``coerce_entry`` (or ``TokenEntry(...)`` followed by
    ``validate()``) so the contract checks run.
    """

    schema_version: int = TOKEN_ENTRY_RECORD_SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[TokenId]
    generation_token_ids: list[TokenId]
    generation_log_probs: list[float]
    routed_experts: Any = None
    output_items: list[dict] = msgspec.field(default_factory=list)
    token_item_index: int | None = None
    response_id: str | None = None
    created_at: float = 0.0
    parent_call_id: str | None = None
    cum_len: int | None = None
    digest: str | None = None
    parent_resolution: ParentResolutionStatus | None = None
    continuation_fingerprint: str = ""
    continuation_context_len: int = 0
    continuation_context_digest: str = ""
    parent_resolution_reason: str = ""
    fingerprint_version: int | None = None
    prompt_is_delta: bool = False
    prefix_requested: bool = False
    prefix_supplied: bool = False

    @property
    def extra_fields(self) -> dict[str, Any]:
        """Unknown wire fields carried through unchanged (Gym's ``extra="allow"``)."""
        return self.__dict__.setdefault("_extra", {})

    def validate(self) -> "TokenEntry":
        """Check Gym's record contract, every field's type included; return ``self``.

        The constructor checks no types (a msgspec ``Struct``): ``TokenEntry(...,
        parent_resolution="ROOT")`` builds, and this raises, as ``put`` would. Accepted
        ``parent_resolution`` values are ``ParentResolutionStatus`` members or their values
        (``"root"``, ``"resolved"``, ``"unresolved"``), as Gym's pydantic entry accepts them.

        Raises ``UnsupportedSchemaError`` for an unsupported ``schema_version`` and
        ``RecordError`` for every other violation.
        """
        _checked_extra(self)
        _from_mapping(self.model_dump())  # the types (through a checked copy), then the contract
        return self

    def _check(self) -> "TokenEntry":
        """``validate`` of an entry whose field types are already checked (a typed decode or convert)."""
        _check_schema_version(self.schema_version)
        for name in ("prompt_token_ids", "generation_token_ids"):
            ids = getattr(self, name)
            if ids and max(ids) > _MAX_TOKEN_ID:
                raise RecordError(f"{name} holds a token id over 2**64 - 1, which Gym's digest cannot encode")
        return self._validate_contract()

    def _validate_contract(self) -> "TokenEntry":
        """``validate`` without the schema version and token id range checks (already done by the caller)."""
        for name in _WIDE_INT_FIELDS:
            value = getattr(self, name)
            if value is not None and not _I64_MIN <= value <= _MAX_TOKEN_ID:
                # orjson (Gym's encoder) refuses integers beyond 64 bits: no Gym reader could load it.
                raise RecordError(f"{name} {value} exceeds 64 bits, which Gym's JSON encoding cannot hold")
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise RecordError(
                "generation_token_ids and generation_log_probs must have the same length "
                f"(got {len(self.generation_token_ids)} and {len(self.generation_log_probs)})"
            )
        if self.token_item_index is not None and not 0 <= self.token_item_index < len(self.output_items):
            raise RecordError(
                f"token_item_index {self.token_item_index} is outside output_items of length {len(self.output_items)}"
            )
        status = self.parent_resolution
        if status == ParentResolutionStatus.RESOLVED and not self.parent_call_id:
            raise RecordError("resolved parent metadata requires parent_call_id")
        if (
            status in (ParentResolutionStatus.ROOT, ParentResolutionStatus.UNRESOLVED)
            and self.parent_call_id is not None
        ):
            raise RecordError(f"{status.value} parent metadata cannot carry parent_call_id")
        if self.prompt_is_delta and (self.parent_call_id is None or status != ParentResolutionStatus.RESOLVED):
            raise RecordError("a delta prompt requires a RESOLVED parent_call_id to reconstruct from")
        return self

    # Gym-style conveniences, so code written against Gym's pydantic entry keeps working.
    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        """Return the entry as a plain dict (known fields then extra fields), like pydantic's."""
        out = msgspec.to_builtins(self)
        out.update(copy.deepcopy(self.extra_fields))
        return out


_FIELD_NAMES = frozenset(TokenEntry.__struct_fields__)
_BYTES_TYPES = (bytes, bytearray, memoryview)
"""Kept as they are by ``msgspec.to_builtins`` on the way to validation (it would write base64)."""
_json_encoder = msgspec.json.Encoder(order="sorted")
_json_decoder = msgspec.json.Decoder()
_typed_decoder = msgspec.json.Decoder(TokenEntry)
# msgspec spells a float with a positive exponent "1e16" where orjson (Gym) spells "1e+16".
_EXPONENT_DIGIT = re.compile(rb"e[0-9]")
_NUMBER_BYTES = frozenset(b"0123456789.-")


def _nested_fits_json(entry: TokenEntry) -> bool:
    """Whether the free-form fields (``output_items``, ``routed_experts``) hold only what Gym's
    encoder (orjson) and ``encode_entry`` write: no integer beyond 64 bits (the typed decode takes
    one, and msgspec writes it back unchanged) and no nesting deeper than ``MAX_JSON_DEPTH`` (an
    older writer acknowledged it; a reader's copy of it can exhaust the stack). False sends the
    decode to its general path, which refuses both with ``RecordError``. One walk of the fields:
    cheaper than the C-speed regex prefilter it replaces (a run of 19 digits, which the small log
    probabilities of real entries contain early, so the walk nearly always ran after it)."""
    if not entry.output_items and entry.routed_experts is None:
        return True
    try:
        _scan_plain([entry.output_items, entry.routed_experts], MAX_JSON_DEPTH)
    except ValueError:
        return False
    return True


def _has_msgspec_only_float(data: bytes) -> bool:
    """Whether compact JSON ``data`` may hold a number spelled like ``1e16`` (no ``+``).

    Every ``e`` followed by a digit is walked back over digits, ``.`` and ``-``: a JSON number in
    compact JSON starts right after ``:``, ``,`` or ``[``. Hex digests and words stop the walk at a
    letter or a quote; text that happens to look like a number inside a string is a false alarm,
    which only sends the caller down its general path.
    """
    for match in _EXPONENT_DIGIT.finditer(data):
        at = match.start() - 1
        while at >= 0 and data[at] in _NUMBER_BYTES:
            at -= 1
        if at < match.start() - 1 and (at < 0 or data[at] in b":,["):
            return True
    return False


def _check_schema_version(version: Any) -> None:
    if not isinstance(version, int) or isinstance(version, bool):
        raise RecordError(f"schema_version must be an integer, got {version!r}")
    if version > TOKEN_ENTRY_RECORD_SCHEMA_VERSION:
        raise UnsupportedSchemaError(
            f"token record is schema_version {version}, but this reader (s3capture) supports schema_version "
            f"{TOKEN_ENTRY_MIN_SCHEMA_VERSION} to {TOKEN_ENTRY_RECORD_SCHEMA_VERSION}; upgrade s3capture to read it"
        )
    if version < TOKEN_ENTRY_MIN_SCHEMA_VERSION:
        raise UnsupportedSchemaError(
            f"token record is schema_version {version}, below the supported minimum {TOKEN_ENTRY_MIN_SCHEMA_VERSION}"
        )


def _checked_extra(entry: TokenEntry) -> dict[str, Any] | None:
    """The extra fields of an s3capture entry, or ``None``; ``RecordError`` when one is named like a
    known field (``entry.extra_fields["model"] = ...``): encoded after the known fields it would
    replace their checked values in the stored bytes."""
    extra = entry.__dict__.get("_extra") or None
    if extra:
        shadowed = sorted(name for name in extra if name in _FIELD_NAMES)
        if shadowed:
            raise RecordError(
                f"extra_fields {shadowed} are named like TokenEntry fields: set the fields themselves instead"
            )
    return extra


def _from_mapping(raw: Any) -> TokenEntry:
    if not isinstance(raw, dict):
        raise RecordError(f"a token entry must be a JSON object, got {type(raw).__name__}")
    _check_schema_version(raw.get("schema_version", TOKEN_ENTRY_RECORD_SCHEMA_VERSION))
    known = {k: v for k, v in raw.items() if k in _FIELD_NAMES}
    try:
        entry = msgspec.convert(known, TokenEntry, strict=False)
    except msgspec.ValidationError as error:
        hint = ""
        if "$.parent_resolution" in str(error):
            hint = f" (one of {[s.value for s in ParentResolutionStatus]}, or a ParentResolutionStatus)"
        raise RecordError(f"invalid token entry: {error}{hint}") from None
    extra = {k: v for k, v in raw.items() if k not in _FIELD_NAMES}
    if extra:
        entry.__dict__["_extra"] = copy.deepcopy(extra)
    return entry._check()


def decode_entry(data: bytes | str) -> TokenEntry:
    """Decode one JSON-encoded entry (canonical or not) and validate it.

    Raises ``UnsupportedSchemaError`` for a newer ``schema_version`` and ``RecordError`` for JSON
    that is not a valid ``TokenEntry``.
    """
    try:
        return _from_mapping(_json_decoder.decode(data))
    except msgspec.DecodeError as error:
        raise RecordError(f"token entry is not valid JSON: {error}") from None
    except RecursionError:  # its copy (or a decoder) of content nested too deeply for the stack
        raise RecordError(f"token entry nests containers far deeper than {MAX_JSON_DEPTH} levels") from None


def decode_canonical_entry(data: bytes) -> TokenEntry:
    """Decode entry bytes that must be the canonical encoding of the entry they decode to.

    Equivalent to ``decode_entry(data)`` followed by the check ``encode_entry(entry) == data``, at
    about 0.8x its CPU for canonical bytes (``tools/bench_encode.py``): one typed decode (the field types are checked while
    parsing) and one encode, compared with ``data``. Anything the fast path cannot prove
    canonical (extra fields, a repeated key, a float with a positive exponent, an integer beyond 64
    bits in output items or routed experts, a non-canonical spelling) takes the general path,
    which decides.

    Raises ``UnsupportedSchemaError`` for a newer ``schema_version`` and ``RecordError`` for bytes
    that are not valid, or not the canonical encoding of a valid ``TokenEntry``.
    """
    try:
        entry = _typed_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        entry = None
    except RecursionError:  # content nested far deeper than MAX_JSON_DEPTH (an older writer's)
        raise RecordError(f"token entry nests containers far deeper than {MAX_JSON_DEPTH} levels") from None
    if entry is not None and not entry.__dict__ and _json_encoder.encode(entry) == data:
        if not _has_msgspec_only_float(data) and _nested_fits_json(entry):
            _check_schema_version(entry.schema_version)
            for name in ("prompt_token_ids", "generation_token_ids"):
                ids = getattr(entry, name)
                # The typed decode proved every id >= 0, so a sum in range bounds each id (C speed).
                if ids and sum(ids) > _MAX_TOKEN_ID and max(ids) > _MAX_TOKEN_ID:
                    raise RecordError(f"{name} holds a token id over 2**64 - 1, which Gym's digest cannot encode")
            return entry._validate_contract()
    entry = decode_entry(data)
    if encode_entry(entry) != data:
        # Valid JSON that is not the canonical encoding (a repeated key decodes last-wins, a
        # reordered or respaced object, ...): its digest and its tokens may disagree.
        raise RecordError("stored entry bytes are not the canonical encoding of the entry they decode to")
    return entry


def _nested_plain(output_items: Any, routed_experts: Any, extra: dict | None) -> bool:
    """``_scan_plain`` of an entry's free-form content, with the depth each part has in the
    canonical JSON (the entry object is depth 1: output items and routed experts are its values,
    and so are the extra fields). Raises ``ValueError`` for what Gym's encoder (orjson) cannot write
    (nesting deeper than ``MAX_JSON_DEPTH``: a reader's copy of it could exhaust the stack) and for
    non-finite floats, which orjson would write as ``null``: refused as in log probabilities, or
    the writer's cache would hold NaN where every reader decodes ``None``."""
    plain = _scan_plain([output_items, routed_experts], MAX_JSON_DEPTH, finite=True)
    return _scan_plain(extra or {}, MAX_JSON_DEPTH, finite=True) and plain


def _check_finite(entry: TokenEntry) -> None:
    probs = entry.generation_log_probs
    # One C-speed sum is finite for all-finite input unless it overflows; only then look closer.
    for index, value in enumerate(probs if not math.isfinite(sum(probs, 0.0)) else ()):
        if not math.isfinite(value):
            raise RecordError(
                f"generation_log_probs[{index}] of model call {entry.model_call_id!r} is {value!r}; "
                "JSON has no non-finite numbers, so s3capture refuses it instead of storing null"
            )
    if entry.created_at is not None and not math.isfinite(entry.created_at):
        raise RecordError(f"created_at of model call {entry.model_call_id!r} is {entry.created_at!r}")


def _has_big_float(entry: TokenEntry, extra: dict | None) -> bool:
    """Whether the entry holds a float msgspec would spell differently from orjson (``|x| >= 1e16``)."""
    probs = entry.generation_log_probs
    # The sum of magnitudes bounds each one (one C-speed pass); only past the bound look closer.
    if probs and not sum(map(abs, probs)) < 1e16 and (min(probs) <= -1e16 or max(probs) >= 1e16):
        return True
    if abs(entry.created_at) >= 1e16:
        return True
    try:
        return not _nested_plain(entry.output_items, entry.routed_experts, extra)
    except ValueError as error:
        raise RecordError(
            f"entry of model call {entry.model_call_id!r} is not JSON-encodable like Gym's: {error}"
        ) from None


def encode_entry(entry: TokenEntry) -> bytes:
    """Return the canonical bytes of an entry (sorted-key compact JSON, see the module docstring).

    The bytes equal ``orjson.dumps(gym_entry.model_dump(mode="json"), option=OPT_SORT_KEYS)``, the
    identity Gym's file store hashes. Raises ``RecordError`` for non-finite floats and for content
    orjson cannot encode (integers beyond 64 bits, non-string keys).
    """
    _check_finite(entry)
    extra = _checked_extra(entry)
    if not extra and not _has_big_float(entry, None):
        try:
            return _json_encoder.encode(entry)
        except (TypeError, ValueError) as error:  # a lone surrogate in a string field
            raise RecordError(f"entry of model call {entry.model_call_id!r} is not JSON-encodable: {error}") from None
    out = msgspec.to_builtins(entry)
    if extra:
        out.update(extra)
    if _has_big_float(entry, extra):
        from s3capture.fingerprint import canonical_json

        try:
            return canonical_json(out).encode("utf-8")
        except ValueError as error:
            raise RecordError(f"entry of model call {entry.model_call_id!r} is not JSON-encodable: {error}") from None
    try:
        return _json_encoder.encode(out)
    except (TypeError, ValueError) as error:  # a lone surrogate, a set, ... in the extra fields
        raise RecordError(f"extra fields are not JSON-encodable: {error}") from None


def to_gym(entry: TokenEntry) -> Any:
    """Convert to NeMo Gym's pydantic ``TokenEntry`` (requires ``nemo_gym``; raises ``ImportError``)."""
    from nemo_gym.token_id_capture.records import TokenEntry as GymTokenEntry

    return GymTokenEntry.model_validate(entry.model_dump())


def encode_token_ids(token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Gym's digest encoding: version byte, big-endian u64 length, big-endian u64 ids."""
    header = struct.pack(">BQ", DIGEST_VERSION, len(token_ids))
    if not token_ids:
        return header
    if _U64_ARRAY:
        # array packs in C about 4x faster than struct.pack(*ids); same bytes after the byte swap.
        try:
            packed = array.array("Q", token_ids)
        except OverflowError:
            raise ValueError("token ids must be non-negative integers below 2**64") from None
        except (TypeError, ValueError):
            packed = None  # e.g. a str, or bytes of a length that is not a multiple of 8
        # array takes bytes and bytearray as raw machine words (b"\x01" * 8 -> one id, not eight):
        # whenever it did not make one id per item, struct decides, like Gym.
        if packed is not None and len(packed) == len(token_ids):
            if sys.byteorder == "little":
                packed.byteswap()
            return header + packed.tobytes()
    try:
        return header + struct.pack(f">{len(token_ids)}Q", *token_ids)
    except struct.error:
        raise ValueError("token ids must be non-negative integers below 2**64") from None


_U64_ARRAY = array.array("Q").itemsize == 8


def compute_digest(token_ids: list[int] | tuple[int, ...]) -> str:
    """Digest of an exact token sequence, equal to Gym's ``records.compute_digest``."""
    if not token_ids:
        return _EMPTY_DIGEST
    return hashlib.sha256(_DIGEST_DOMAIN + encode_token_ids(token_ids)).hexdigest()


def stamp_lineage(
    entry: TokenEntry,
    parent_call_id: str | None,
    *,
    parent_resolution: ParentResolutionStatus | None = None,
    reason: str = "",
) -> TokenEntry:
    """Fill ``cum_len``, ``digest`` and the parent decision of a full-prompt entry (Gym's ``stamp_lineage``).

    ``cum_len`` and ``digest`` cover ``prompt_token_ids + generation_token_ids``; call this before
    ``store_prompt_as_delta``. Raises ``RecordError`` for parent metadata that contradicts the status.
    """
    cumulative = cumulative_tokens(entry)
    entry.cum_len = len(cumulative)
    entry.digest = compute_digest(cumulative)
    if parent_resolution is not None:  # Gym's enum (a resolve on an entry_type="gym" store) -> ours
        parent_resolution = ParentResolutionStatus(getattr(parent_resolution, "value", parent_resolution))
    entry.parent_call_id = parent_call_id
    entry.parent_resolution = parent_resolution
    entry.parent_resolution_reason = reason
    if parent_resolution is ParentResolutionStatus.RESOLVED and parent_call_id is None:
        raise RecordError("resolved parent metadata requires parent_call_id")
    if (
        parent_resolution in (ParentResolutionStatus.ROOT, ParentResolutionStatus.UNRESOLVED)
        and parent_call_id is not None
    ):
        raise RecordError(f"{parent_resolution.value} parent metadata cannot carry parent_call_id")
    return entry


def store_prompt_as_delta(entry: TokenEntry, parent_cumulative: list[int] | tuple[int, ...]) -> TokenEntry:
    """Keep only the prompt suffix after the RESOLVED parent's cumulative tokens (``prompt_is_delta``).

    ``cum_len`` and ``digest`` keep describing the full sequence. Raises ``RecordError`` when the
    entry is not RESOLVED or its prompt does not start with ``parent_cumulative``.
    """
    parent = list(parent_cumulative)
    if entry.parent_resolution != ParentResolutionStatus.RESOLVED or not entry.parent_call_id:
        raise RecordError("a delta prompt requires a RESOLVED parent_call_id to reconstruct from")
    if entry.prompt_is_delta or entry.prompt_token_ids[: len(parent)] != parent:
        raise RecordError("the full prompt does not start with the parent's cumulative tokens")
    entry.prompt_token_ids = entry.prompt_token_ids[len(parent) :]
    entry.prompt_is_delta = True
    return entry


def cumulative_tokens(entry: TokenEntry) -> list[int]:
    """Prompt plus generation of a full-prompt entry; raises ``ValueError`` for a delta entry."""
    if entry.prompt_is_delta:
        raise ValueError(
            f"model call {entry.model_call_id} stores a delta prompt; reconstruct through its parent chain"
        )
    return list(entry.prompt_token_ids) + list(entry.generation_token_ids)


# Defined in s3capture.records_coerce, which imports the names above from this module: imported last,
# once they exist. coerce_entry and prepare_entry are public here; _coerce_general and _fast_copy are
# re-exported for tests/test_encode_fast_path.py and tools/bench_encode.py.
from s3capture.records_coerce import _coerce_general, _fast_copy, coerce_entry, prepare_entry  # noqa: E402, F401
