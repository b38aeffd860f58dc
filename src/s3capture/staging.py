"""NeMo Gym's staging digests, and helpers to stage one model call as a framework would.

Contract source: ``nemo_gym/token_id_capture/staging/digest.py`` of nemo-gym 0.7.0 (schema 2,
digest 2, extras digest 1), ported rather than imported: Gym is not a dependency of s3capture.
``tests/test_staging.py`` proves every function here equal to Gym's (values and refusals) with
generated inputs, and checks that a record built by ``stage_call`` validates as Gym's
``StagedCallRecord``, which recomputes the digest.

A framework that stages token arrays itself (``S3CaptureLedger`` keeps only token-free rows) stores
one *delta* per model call: the prompt suffix after the parent's cumulative tokens, then the
generation. Three digests bind the pieces together:

* ``cumulative_hash = hash_token_ids(prompt + generation)``: the call's whole token sequence;
* ``chain_hash = compute_chain_hash(parent_chain_hash, token_ids_delta)``: the deltas from the root
  to this call, so a consumer verifies continuity without rebuilding the sequence;
* ``digest = compute_staging_digest(...)``: the staged record itself (metadata, token ids, masks and
  log probabilities as float32 bit patterns, the extras digest and both chain digests).

Helpers: ``stage_call`` turns a call's full prompt, generation and log probabilities plus its parent
(a ``LineageMatch`` from ``resolve``, or ``None`` for a root) into a ``StagedCall`` (the wire shape
of Gym's ``StagedCallRecord``); ``call_record`` turns that into the token-free ledger row
(``s3capture.ledger_records.CallRecord``) that goes into ``CaptureLedger.record``.

Token ids are unsigned 64-bit ints; lengths count tokens; digests are lowercase SHA-256 hex.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import msgspec

from s3capture.ledger_records import CallRecord, DigestHex, Identifier, NonNegativeInt, to_wire, validate_call_record

__all__ = [
    "STAGING_SCHEMA_VERSION",
    "STAGING_DIGEST_VERSION",
    "EXTRAS_DIGEST_VERSION",
    "EMPTY_EXTRAS_DIGEST",
    "encode_token_ids",
    "hash_token_ids",
    "compute_chain_hash",
    "compute_extras_digest",
    "compute_staging_digest",
    "build_staging_delta",
    "staging_key",
    "StagedCall",
    "stage_call",
    "call_record",
]

STAGING_SCHEMA_VERSION: Final = 2
STAGING_DIGEST_VERSION: Final = 2
EXTRAS_DIGEST_VERSION: Final = 1

_CALL_DIGEST_DOMAIN = b"nemo-gym-staging-call-v2"
_EXTRAS_DIGEST_DOMAIN = b"nemo-gym-staging-extras-v1"
_TOKEN_DIGEST_DOMAIN = b"nemo-gym-staging-prefix-v2"
_CHAIN_DIGEST_DOMAIN = b"nemo-gym-staging-chain-v1"
_HEX_DIGEST_LENGTH = 64
_U64_MAX = 2**64 - 1


# --------------------------------------------------------------------------- primitive encodings
def _encode_bytes(value: bytes) -> bytes:
    return struct.pack(">Q", len(value)) + value


def _encode_text(value: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return _encode_bytes(value.encode("utf-8"))


def _encode_optional_text(value: str | None) -> bytes:
    return b"\x00" if value is None else b"\x01" + _encode_text(value)


def _encode_uint(value: int, *, field: str) -> bytes:
    if type(value) is not int or not 0 <= value <= _U64_MAX:
        raise ValueError(f"{field} must be an unsigned 64-bit integer, got {value!r}")
    return struct.pack(">Q", value)


def _validate_digest(value: str, *, field: str) -> None:
    if (
        not isinstance(value, str)
        or len(value) != _HEX_DIGEST_LENGTH
        or any(character not in "0123456789abcdef" for character in value)
    ):
        raise ValueError(f"{field} must be a lowercase SHA-256 hex digest")


def _encode_present_digest(value: str, *, field: str) -> bytes:
    # Gym's v2 layout keeps a presence byte; every staged record carries both chain digests.
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a digest string")
    _validate_digest(value, field=field)
    return b"\x01" + bytes.fromhex(value)


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Encode token ids: 8-byte big-endian count, then each id as an 8-byte big-endian unsigned int.

    Raises ``ValueError`` naming the first id that is not an ``int`` (bool and numpy ints refused)
    in ``[0, 2**64)``; ``TypeError`` when ``token_ids`` has no length.
    """
    head = _encode_uint(len(token_ids), field="token_ids length")
    if all(type(token_id) is int for token_id in token_ids):
        try:  # one C call for the common case; the loop below names the offending id
            return head + struct.pack(f">{len(token_ids)}Q", *token_ids)
        except struct.error:
            pass
    encoded = bytearray(head)
    for token_id in token_ids:
        encoded.extend(_encode_uint(token_id, field="token_id"))
    return bytes(encoded)


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """SHA-256 hex of one exact cumulative token sequence (a call's ``cumulative_hash``)."""
    return hashlib.sha256(_TOKEN_DIGEST_DOMAIN + encode_token_ids(token_ids)).hexdigest()


def compute_chain_hash(parent_chain_hash: str | None, token_ids_delta: Sequence[int]) -> str:
    """Chain one staged delta onto its parent's chain hash (``None`` for a root).

    ``chain_hash_N = SHA-256(domain || 0x01 || chain_hash_{N-1} || encode(delta_N))``; a root uses
    a ``0x00`` marker instead of the parent. Raises ``ValueError`` for a parent that is not a
    lowercase SHA-256 hex digest or an invalid token id.
    """
    payload = bytearray()
    if parent_chain_hash is None:
        payload += b"\x00"
    else:
        _validate_digest(parent_chain_hash, field="parent_chain_hash")
        payload += b"\x01" + bytes.fromhex(parent_chain_hash)
    payload += encode_token_ids(token_ids_delta)
    return hashlib.sha256(_CHAIN_DIGEST_DOMAIN + bytes(payload)).hexdigest()


def _encode_float32_values(values: Sequence[float], *, field: str) -> bytes:
    head = _encode_uint(len(values), field=f"{field} length")
    if all(type(value) is float and math.isfinite(value) for value in values):
        try:  # the common case in one C call; the loop below names the offending value
            packed = struct.pack(f">{len(values)}f", *values)
            if not any(math.isinf(value) for value in struct.unpack(f">{len(values)}f", packed)):
                return head + packed
        except (OverflowError, struct.error):
            pass
    encoded = bytearray(head)
    for value in values:
        if type(value) is not float or not math.isfinite(value):
            raise ValueError(f"{field} values must be finite Python floats, got {value!r}")
        try:
            one = struct.pack(">f", value)
        except (OverflowError, struct.error) as error:
            raise ValueError(f"{field} value cannot be represented as float32: {value!r}") from error
        if not math.isfinite(struct.unpack(">f", one)[0]):
            raise ValueError(f"{field} value overflows float32: {value!r}")
        encoded.extend(one)
    return bytes(encoded)


def _encode_extra(value: Any) -> bytes:
    if value is None:
        return b"N"
    if type(value) is bool:
        return b"B\x01" if value else b"B\x00"
    if type(value) is int:
        if not -(2**63) <= value <= (2**63 - 1):
            raise ValueError(f"extras integer is outside signed 64-bit range: {value}")
        return b"I" + struct.pack(">q", value)
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"extras floats must be finite, got {value!r}")
        return b"F" + struct.pack(">d", value)
    if type(value) is str:
        return b"S" + _encode_text(value)
    if type(value) is list:
        return (
            b"L"
            + _encode_uint(len(value), field="extras list length")
            + b"".join(_encode_extra(item) for item in value)
        )
    if type(value) is dict:
        if any(type(key) is not str for key in value):
            raise TypeError("extras mappings must have string keys")
        keys = sorted(value, key=lambda key: key.encode("utf-8"))
        return (
            b"D"
            + _encode_uint(len(keys), field="extras mapping length")
            + b"".join(_encode_text(key) + _encode_extra(value[key]) for key in keys)
        )
    raise TypeError(f"extras contain unsupported value type {type(value).__name__}")


def compute_extras_digest(extras: Mapping[str, Any] | None) -> str:
    """SHA-256 hex of a call's optional extras (typed binary encoding, keys sorted by UTF-8 bytes).

    Values: ``None``, exact ``bool``/``int`` (signed 64-bit)/``float`` (finite)/``str``, lists and
    string-keyed dicts. Raises ``TypeError`` for any other type (tuples, bytes, numpy scalars) or a
    non-mapping ``extras``, ``ValueError`` for NaN, infinity, an out-of-range int or nesting too
    deep for the encoder's recursion.
    """
    normalized: dict[str, Any] | None
    if extras is None:
        normalized = None
    elif isinstance(extras, Mapping):
        normalized = dict(extras)
    else:
        raise TypeError(f"extras must be a mapping or None, got {type(extras).__name__}")
    try:
        payload = struct.pack(">B", EXTRAS_DIGEST_VERSION) + _encode_extra(normalized)
    except RecursionError:  # nested past the stack (a hostile staged object, or a caller's extras)
        raise ValueError("extras nest too deeply to encode") from None
    return hashlib.sha256(_EXTRAS_DIGEST_DOMAIN + payload).hexdigest()


EMPTY_EXTRAS_DIGEST = compute_extras_digest(None)
"""The extras digest of a call without extras."""


def compute_staging_digest(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
) -> str:
    """The v2 digest (SHA-256 hex) of one staged call delta, as Gym computes it.

    Raises ``ValueError`` (``TypeError`` for a non-str id) when the fields do not describe a valid
    staged call: versions other than 2/2/1; an empty id; a root (no parent) that is not text mode
    with ``prev_len == 0``, or a child that is not ``token_in`` with ``prev_len > 0``; an empty
    delta; ``delta_len`` or column lengths that disagree; masks other than 0.0/1.0; a non-zero log
    probability under mask 0.0; ``cum_len != prev_len + delta_len``; a malformed digest; lengths
    or ids outside unsigned 64 bits; floats that are not finite Python floats fitting float32.
    """
    if type(schema_version) is not int or schema_version != STAGING_SCHEMA_VERSION:
        raise ValueError(f"unsupported staging schema version {schema_version}")
    if type(digest_version) is not int or digest_version != STAGING_DIGEST_VERSION:
        raise ValueError(f"unsupported staging digest version {digest_version}")
    if type(extras_digest_version) is not int or extras_digest_version != EXTRAS_DIGEST_VERSION:
        raise ValueError(f"unsupported extras digest version {extras_digest_version}")
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    if parent_call_id == "":
        raise ValueError("parent_call_id must be non-empty when present")
    if mode not in ("text", "token_in"):
        raise ValueError(f"unsupported capture mode {mode!r}")
    if parent_call_id is None and (prev_len != 0 or mode != "text"):
        raise ValueError("a parentless call must be a text-mode root with prev_len == 0")
    if parent_call_id is not None and (prev_len == 0 or mode != "token_in"):
        raise ValueError("a child call must use token_in mode with prev_len > 0")
    if delta_len == 0:
        raise ValueError("a staged call delta must contain at least one token")
    if delta_len != len(token_ids_delta):
        raise ValueError(f"delta_len {delta_len} does not match {len(token_ids_delta)} token IDs")
    if not (len(token_ids_delta) == len(token_mask_delta) == len(generation_log_probs_delta)):
        raise ValueError("token IDs, masks, and log probabilities must have equal lengths")
    if any(mask not in (0.0, 1.0) for mask in token_mask_delta):
        raise ValueError("token_mask_delta must contain only 0.0 or 1.0")
    if any(mask == 0.0 and log_prob != 0.0 for mask, log_prob in zip(token_mask_delta, generation_log_probs_delta)):
        raise ValueError("prompt-carry log probabilities must be 0.0")
    if cum_len != prev_len + delta_len:
        raise ValueError(f"cum_len {cum_len} does not equal prev_len + delta_len ({prev_len + delta_len})")
    _validate_digest(extras_digest, field="extras_digest")

    payload = bytearray(struct.pack(">BBB", schema_version, digest_version, extras_digest_version))
    payload.extend(_encode_text(rollout_id))
    payload.extend(_encode_text(model_call_id))
    payload.extend(_encode_optional_text(parent_call_id))
    payload.extend(_encode_text(mode))
    payload.extend(_encode_uint(prev_len, field="prev_len"))
    payload.extend(_encode_uint(delta_len, field="delta_len"))
    payload.extend(_encode_uint(cum_len, field="cum_len"))
    payload.extend(_encode_uint(weight_version, field="weight_version"))
    payload.extend(_encode_bytes(encode_token_ids(token_ids_delta)))
    payload.extend(_encode_bytes(_encode_float32_values(token_mask_delta, field="token_mask_delta")))
    payload.extend(
        _encode_bytes(_encode_float32_values(generation_log_probs_delta, field="generation_log_probs_delta"))
    )
    payload.extend(bytes.fromhex(extras_digest))
    payload.extend(_encode_present_digest(chain_hash, field="chain_hash"))
    payload.extend(_encode_present_digest(cumulative_hash, field="cumulative_hash"))
    return hashlib.sha256(_CALL_DIGEST_DOMAIN + bytes(payload)).hexdigest()


def build_staging_delta(
    *,
    prompt_token_ids: list[int],
    generated_token_ids: list[int],
    generated_log_probs: list[float],
    prev_len: int,
) -> tuple[list[int], list[float], list[float]]:
    """Slice a call's full prompt and generation into its staged delta.

    Returns ``(token_ids_delta, token_mask_delta, generation_log_probs_delta)``: the prompt after
    the first ``prev_len`` tokens (the parent's cumulative tokens) with mask 0.0 and log prob 0.0,
    then the generation with mask 1.0 and its log probs. Raises ``ValueError`` when ``prev_len``
    is outside ``[0, len(prompt)]``, the generation and log probs differ in length, or the delta
    is empty.
    """
    if prev_len < 0 or prev_len > len(prompt_token_ids):
        raise ValueError(f"prev_len={prev_len} is outside prompt length {len(prompt_token_ids)}")
    if len(generated_token_ids) != len(generated_log_probs):
        raise ValueError(
            "generated token and log-probability lengths differ: "
            f"{len(generated_token_ids)} != {len(generated_log_probs)}"
        )
    prompt_delta = prompt_token_ids[prev_len:]
    token_ids_delta = prompt_delta + generated_token_ids
    token_mask_delta = [0.0] * len(prompt_delta) + [1.0] * len(generated_token_ids)
    generation_log_probs_delta = [0.0] * len(prompt_delta) + generated_log_probs
    if not token_ids_delta:
        raise ValueError("staging delta must contain at least one token")
    return token_ids_delta, token_mask_delta, generation_log_probs_delta


def staging_key(rollout_id: str, model_call_id: str) -> str:
    """Gym's default staging key, ``"{rollout_id}/{model_call_id}"``; ``ValueError`` for an empty id."""
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    return f"{rollout_id}/{model_call_id}"


# --------------------------------------------------------------------------- staging one call
class StagedCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One staged call delta: the fields (and JSON shape) of Gym's ``StagedCallRecord``.

    ``to_wire()`` gives the dict Gym's ``StagedCallRecord.model_validate`` accepts; ``encode()``
    and ``decode()`` are its JSON bytes (what a framework's staging store holds). Build one with
    ``stage_call``; ``verify()`` recomputes both digests.
    """

    schema_version: Literal[2] = STAGING_SCHEMA_VERSION
    digest_version: Literal[2] = STAGING_DIGEST_VERSION
    extras_digest_version: Literal[1] = EXTRAS_DIGEST_VERSION
    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    mode: Literal["token_in", "text"]
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    digest: DigestHex
    token_ids_delta: list[int]
    token_mask_delta: list[float]
    generation_log_probs_delta: list[float]
    extras_digest: DigestHex = EMPTY_EXTRAS_DIGEST
    chain_hash: DigestHex
    cumulative_hash: DigestHex
    extras: dict[str, Any] | None = None

    @property
    def staging_key(self) -> str:
        return staging_key(self.rollout_id, self.model_call_id)

    @property
    def generated_len(self) -> int:
        """Tokens of the delta the policy generated (mask 1.0)."""
        return sum(1 for mask in self.token_mask_delta if mask == 1.0)

    def verify(self) -> None:
        """Recompute the staging digest and the extras digest; ``ValueError`` on any mismatch."""
        if any(token_id < 0 for token_id in self.token_ids_delta):
            raise ValueError("token_ids_delta must be non-negative")
        actual = compute_staging_digest(
            schema_version=self.schema_version,
            digest_version=self.digest_version,
            extras_digest_version=self.extras_digest_version,
            rollout_id=self.rollout_id,
            model_call_id=self.model_call_id,
            parent_call_id=self.parent_call_id,
            mode=self.mode,
            prev_len=self.prev_len,
            delta_len=self.delta_len,
            cum_len=self.cum_len,
            weight_version=self.weight_version,
            token_ids_delta=self.token_ids_delta,
            token_mask_delta=self.token_mask_delta,
            generation_log_probs_delta=self.generation_log_probs_delta,
            extras_digest=self.extras_digest,
            chain_hash=self.chain_hash,
            cumulative_hash=self.cumulative_hash,
        )
        if actual != self.digest:
            raise ValueError(f"{self.model_call_id}: digest does not match staged call contents")
        if compute_extras_digest(self.extras) != self.extras_digest:
            raise ValueError(f"{self.model_call_id}: extras_digest does not match extras")

    def to_wire(self) -> dict:
        """Plain JSON-compatible dict, every field present (Gym's ``model_dump(mode="json")``)."""
        return to_wire(self)

    def encode(self) -> bytes:
        """Compact JSON bytes of ``to_wire()``; floats round-trip exactly."""
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes | str) -> StagedCall:
        """Parse and ``verify()`` staged JSON bytes; ``ValueError`` for anything else."""
        try:
            staged = msgspec.json.decode(data, type=cls)
        except (msgspec.DecodeError, RecursionError) as error:  # ValidationError included; nested past the stack
            raise ValueError(f"not a staged call record: {error}") from None
        staged.verify()
        return staged


def _floats(values: Sequence[float], field: str) -> list[float]:
    out: list[float] = []
    for value in values:
        if type(value) is int:  # an engine's exact 0 or -1: the same number as a float
            value = float(value)
        if type(value) is not float:
            raise ValueError(f"{field} values must be floats, got {value!r}")
        out.append(value)
    return out


def stage_call(
    *,
    rollout_id: str,
    model_call_id: str,
    prompt_token_ids: Sequence[int],
    generation_token_ids: Sequence[int],
    generation_log_probs: Sequence[float],
    parent: Any = None,
    weight_version: int = 0,
    extras: Mapping[str, Any] | None = None,
) -> StagedCall:
    """Build the staged record of one model call, as Gym's ``RolloutTokenCapture.complete_call`` does.

    ``prompt_token_ids`` is the call's full prompt, ``generation_token_ids`` its generation and
    ``generation_log_probs`` one log prob (nats) per generated token (ints are taken as floats).
    ``parent`` is ``None`` for a text-mode root, else the ``LineageMatch`` that ``resolve`` returned
    (any object with ``model_call_id``, ``prev_len`` = the parent's ``cum_len``, ``chain_hash`` and
    ``digest`` = the parent's ``cumulative_hash``): the call is then a ``token_in`` child whose
    delta starts after the parent's ``prev_len`` tokens.

    Raises ``ValueError`` when the prompt does not begin with the parent's tokens (its first
    ``prev_len`` tokens do not hash to the parent's cumulative hash; Gym's worker reports such a
    call as ``capture_failed``), and for anything ``build_staging_delta``/``compute_staging_digest``
    refuse (empty delta, bad lengths, ids or floats).
    """
    prompt = list(prompt_token_ids)
    generation = list(generation_token_ids)
    log_probs = _floats(generation_log_probs, "generation_log_probs")
    if parent is None:
        parent_call_id, mode, prev_len, parent_chain_hash = None, "text", 0, None
    else:
        parent_call_id, mode = parent.model_call_id, "token_in"
        prev_len, parent_chain_hash = parent.prev_len, parent.chain_hash
        if not parent_chain_hash:
            raise ValueError(f"parent {parent_call_id!r} carries no chain_hash")
        if prev_len > len(prompt) or hash_token_ids(prompt[:prev_len]) != parent.digest:
            raise ValueError(
                f"the prompt of {model_call_id!r} does not begin with the {prev_len} tokens of parent {parent_call_id!r}"
            )
    token_ids_delta, token_mask_delta, log_probs_delta = build_staging_delta(
        prompt_token_ids=prompt, generated_token_ids=generation, generated_log_probs=log_probs, prev_len=prev_len
    )
    delta_len = len(token_ids_delta)
    extras_dict = None if extras is None else dict(extras)
    fields: dict[str, Any] = dict(
        schema_version=STAGING_SCHEMA_VERSION,
        digest_version=STAGING_DIGEST_VERSION,
        extras_digest_version=EXTRAS_DIGEST_VERSION,
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        parent_call_id=parent_call_id,
        mode=mode,
        prev_len=prev_len,
        delta_len=delta_len,
        cum_len=prev_len + delta_len,
        weight_version=weight_version,
        token_ids_delta=token_ids_delta,
        token_mask_delta=token_mask_delta,
        generation_log_probs_delta=log_probs_delta,
        extras_digest=compute_extras_digest(extras_dict),
        chain_hash=compute_chain_hash(parent_chain_hash, token_ids_delta),
        cumulative_hash=hash_token_ids(prompt + generation),
    )
    digest = compute_staging_digest(**fields)
    return StagedCall(digest=digest, extras=extras_dict, **fields)


def call_record(
    staged: StagedCall,
    *,
    response_id: str,
    staging_key: str | None = None,
    admitted_at: float | None = None,
    request_items: list[dict] | None = None,
    response_items: list[dict] | None = None,
) -> CallRecord:
    """The token-free ledger row of a staged call (``CaptureLedgerCommit.record``).

    ``staging_key`` is where the framework stored the delta (default: Gym's
    ``"{rollout_id}/{model_call_id}"``); ``response_id`` is the served response envelope's id and
    ``admitted_at`` the admission time (seconds since the epoch). With ``response_items`` (the
    call's output items, token fields stripped) the row carries Gym's content witnesses, computed
    as Gym's external capture does: ``output_fingerprint`` over the output and
    ``continuation_fingerprint`` over ``request_items + response_items`` (``None`` where nothing
    can be fingerprinted). Raises ``ValueError`` for a row Gym's ``CallRecord`` would refuse.
    """
    from s3capture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint

    output_fp = continuation_fp = None
    if response_items is not None:
        try:
            output_fp = assistant_fingerprint(list(response_items)) or None
            continuation_fp = assistant_fingerprint(list(request_items or []) + list(response_items)) or None
        except (TypeError, ValueError):
            output_fp = continuation_fp = None
    record = CallRecord(
        model_call_id=staged.model_call_id,
        parent_call_id=staged.parent_call_id,
        prev_len=staged.prev_len,
        delta_len=staged.delta_len,
        cum_len=staged.cum_len,
        weight_version=staged.weight_version,
        digest=staged.digest,
        extras_digest=staged.extras_digest,
        staging_key=staging_key if staging_key is not None else staged.staging_key,
        mode=staged.mode,
        chain_hash=staged.chain_hash,
        cumulative_hash=staged.cumulative_hash,
        response_id=response_id,
        admitted_at=admitted_at,
        output_fingerprint=output_fp,
        continuation_fingerprint=continuation_fp,
        fingerprint_version=FINGERPRINT_VERSION if response_items is not None else 0,
    )
    return validate_call_record(to_wire(record))  # the constraints a direct construction skips
