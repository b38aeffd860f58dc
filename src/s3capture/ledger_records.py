"""The token-free capture-ledger records of NeMo Gym, as msgspec structs.

Source of the contract: ``nemo_gym/token_id_capture/staging/records.py`` of nemo-gym 0.7.0
(``CallRecord``, ``CaptureLedgerCommit``, ``ManifestFailure``, ``RolloutManifest``), plus
``RolloutRemoval``, which the protocol reference names (``RolloutRemovalPayload`` "validates as
staging.records.RolloutRemoval") but 0.7.0 does not ship yet.

The rules are Gym's pydantic rules, reproduced so that on JSON-shaped input (dicts, lists, str,
int, float, bool, None) every record Gym's models accept is accepted here with the same values, and
every record they reject is rejected here (``tests/test_ledger_records_differential.py`` checks it
against Gym's models with generated records). In particular:

* unknown fields are refused (``extra="forbid"``); NaN and infinity are refused in float fields;
* ``schema_version`` is 2, ``digest_version`` 2 and ``extras_digest_version`` 1, and like pydantic's
  ``Literal`` an equal float (``2.0``) or bool (``True`` for 1) is accepted and stored as the int;
* identifiers are non-empty strings without lone surrogates; digests are 64 lowercase hex characters
  and nothing else (no trailing newline); counts are ints >= 0 (bool and float refused, no upper
  bound);
* a ``CallRecord`` describes a non-empty contiguous delta (``cum_len == prev_len + delta_len``,
  ``delta_len > 0``); a root (no ``parent_call_id``) has ``prev_len == 0`` and mode ``"text"``, a
  child ``prev_len > 0`` and mode ``"token_in"``.

Every ``validate_*`` function raises ``s3capture.records.RecordError`` (a ``ValueError``) naming the
field at fault. This module imports only msgspec and the standard library.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final, Literal

import msgspec

from s3capture.records import RecordError

__all__ = [
    "STAGING_SCHEMA_VERSION",
    "STAGING_DIGEST_VERSION",
    "EXTRAS_DIGEST_VERSION",
    "CallRecord",
    "CaptureLedgerCommit",
    "ManifestFailure",
    "RolloutManifest",
    "RolloutRemoval",
    "validate_call_record",
    "validate_commit",
    "validate_failure",
    "validate_manifest",
    "validate_removal",
    "to_wire",
    "LEDGER_ROW_MISSING_RESPONSE_ID_REASON",
    "LEDGER_ROW_MISSING_CHAIN_HASH_REASON",
    "UNCOMMITTED_CALL_REASON",
    "LEDGER_CONFLICTING_ROWS_REASON",
    "LEDGER_UNREADABLE_ROW_REASON",
    "LEDGER_FOREIGN_OBJECT_REASON",
    "LEDGER_MISSING_PARENT_REASON",
]

STAGING_SCHEMA_VERSION: Final = 2
STAGING_DIGEST_VERSION: Final = 2
EXTRAS_DIGEST_VERSION: Final = 1

# Gym's reason codes (``nemo_gym.token_id_capture.records``), reproduced: they are wire contract.
LEDGER_ROW_MISSING_RESPONSE_ID_REASON = "ledger_row_missing_response_id"
LEDGER_ROW_MISSING_CHAIN_HASH_REASON = "ledger_row_missing_chain_hash"
UNCOMMITTED_CALL_REASON = "request_finished_without_staged_coordinates"
"""Gym's reason for an admitted call that never committed; s3capture gives it to a dangling intent."""
# s3capture's own poison reasons in ``RolloutManifest.failures``; see docs/ledger.md.
LEDGER_CONFLICTING_ROWS_REASON = "conflicting_ledger_rows"
"""One model call id has more than one distinct committed row (two writers, no compare-and-swap)."""
LEDGER_UNREADABLE_ROW_REASON = "unreadable_ledger_row"
"""A stored row is corrupt, from a newer schema, or filed under the wrong call id."""
LEDGER_FOREIGN_OBJECT_REASON = "foreign_ledger_object"
"""An object s3capture did not write sits under the rollout's ledger prefix."""
LEDGER_MISSING_PARENT_REASON = "missing_parent_row"
"""A committed row names a ``parent_call_id`` with no committed row in the manifest: the chain has
a hole (a lost row, or a listing that skipped a key)."""

# No lone surrogates: pydantic refuses a str that is not valid Unicode (``string_unicode``).
Identifier = Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[^\ud800-\udfff]*\Z")]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
# ``\Z``, not ``$``: Gym's pydantic (Rust regex) refuses a trailing newline that Python's ``$`` allows.
DigestHex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}\Z")]
CaptureMode = Literal["token_in", "text"]


class _Wire(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    schema_version: Literal[2] = STAGING_SCHEMA_VERSION


class CallRecord(_Wire, kw_only=True, forbid_unknown_fields=True):
    """One token-free call manifest row in a rollout's capture ledger (Gym's ``CallRecord``).

    Lengths are in tokens; ``digest`` is the staged record's digest, ``chain_hash`` and
    ``cumulative_hash`` the staging chain digests, ``admitted_at`` seconds since the epoch.
    """

    digest_version: Literal[2] = STAGING_DIGEST_VERSION
    extras_digest_version: Literal[1] = EXTRAS_DIGEST_VERSION
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    digest: DigestHex
    extras_digest: DigestHex
    staging_key: Identifier
    mode: CaptureMode = "token_in"
    chain_hash: DigestHex
    cumulative_hash: DigestHex
    response_id: Identifier
    admitted_at: float | None = None
    output_fingerprint: DigestHex | None = None
    continuation_fingerprint: DigestHex | None = None
    fingerprint_version: NonNegativeInt = 0

    def __post_init__(self) -> None:
        if self.admitted_at is not None and not math.isfinite(self.admitted_at):
            raise ValueError("admitted_at must be a finite number")
        if self.delta_len == 0 or self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("manifest lengths must describe a non-empty contiguous delta")
        if self.parent_call_id is None and self.prev_len != 0:
            raise ValueError("a parentless manifest row must have prev_len == 0")
        if self.parent_call_id is not None and self.prev_len == 0:
            raise ValueError("a child manifest row must have prev_len > 0")
        if self.parent_call_id is None and self.mode != "text":
            raise ValueError("a parentless manifest row must use text mode")
        if self.parent_call_id is not None and self.mode != "token_in":
            raise ValueError("a child manifest row must use token_in mode")


class CaptureLedgerCommit(_Wire, kw_only=True, forbid_unknown_fields=True):
    """One successfully staged call, as handed to ``CaptureLedger.record`` (Gym's model).

    ``record`` is the manifest row; ``staging_chain`` (the staging keys whose deltas form this
    call's cumulative tokens, this call's last), ``request_items`` and ``response_items`` feed
    parent resolution and are not part of the manifest.
    """

    rollout_id: Identifier
    record: CallRecord
    staging_chain: tuple[Identifier, ...] = ()
    request_items: list[dict]
    response_items: list[dict]


class ManifestFailure(_Wire, kw_only=True, forbid_unknown_fields=True):
    """A call whose token capture did not complete (``reason`` is a machine-readable code)."""

    model_call_id: Identifier
    reason: Identifier


class RolloutManifest(_Wire, kw_only=True, forbid_unknown_fields=True):
    """The token-free ledger of one rollout: committed rows and failure rows."""

    rollout_id: Identifier
    records: list[CallRecord] = msgspec.field(default_factory=list)
    failures: list[ManifestFailure] = msgspec.field(default_factory=list)


class RolloutRemoval(_Wire, kw_only=True, forbid_unknown_fields=True):
    """The result of retiring or deleting rollouts: ids that held something, and ids that did not."""

    removed: list[Identifier] = msgspec.field(default_factory=list)
    absent: list[Identifier] = msgspec.field(default_factory=list)


_LITERAL_INTS: dict[type, dict[str, int]] = {
    CallRecord: {"schema_version": 2, "digest_version": 2, "extras_digest_version": 1},
    CaptureLedgerCommit: {"schema_version": 2},
    ManifestFailure: {"schema_version": 2},
    RolloutManifest: {"schema_version": 2},
    RolloutRemoval: {"schema_version": 2},
}


def _literal_floats(value: Any, kind: type) -> Any:
    """Turn a float or bool equal to an int literal into that int, as pydantic does.

    pydantic's ``Literal[2]`` takes ``2.0``, and its ``Literal[1]`` takes ``True`` (``True == 1``).
    """
    if not isinstance(value, dict):
        return value
    literals = _LITERAL_INTS[kind]
    out = value
    for name, expected in literals.items():
        got = value.get(name)
        if type(got) in (float, bool) and got == expected:
            if out is value:
                out = dict(value)
            out[name] = expected
    nested: list[tuple[str, type]] = []
    if kind is CaptureLedgerCommit:
        nested = [("record", CallRecord)]
    for name, sub in nested:
        if isinstance(value.get(name), dict):
            if out is value:
                out = dict(value)
            out[name] = _literal_floats(value[name], sub)
    if kind is RolloutManifest:
        for name, sub in (("records", CallRecord), ("failures", ManifestFailure)):
            if isinstance(value.get(name), list):
                if out is value:
                    out = dict(value)
                out[name] = [_literal_floats(item, sub) for item in value[name]]
    return out


def _builtins(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        # Bytes stay bytes, for the conversion to refuse (``rollout_id=b"r1"`` became the base64
        # text "cjE=": a row acknowledged under an id nobody asked for; an API breaker, 2026-12-03).
        return msgspec.to_builtins(value, builtin_types=(bytes, bytearray, memoryview))
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # a pydantic model, e.g. NeMo Gym's own record
        return dump(mode="json")
    return value


_WIDE_FLOAT_JSON = msgspec.json.Decoder(float_hook=float)


def _validate(value: Any, kind: type) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        try:
            try:
                value = msgspec.json.decode(value)
            except msgspec.DecodeError:
                # ``1e400`` is valid JSON that overflows a double: pydantic reads it as infinity
                # (kept in free-form items, refused in float fields), so read it the same way.
                value = _WIDE_FLOAT_JSON.decode(value)
        except (msgspec.DecodeError, UnicodeEncodeError, RecursionError) as error:  # a lone surrogate; too deep
            raise RecordError(f"{kind.__name__} is not valid JSON: {error}") from None
    raw = _literal_floats(_builtins(value), kind)
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as error:
        raise RecordError(f"invalid {kind.__name__}: {error}") from None


def validate_call_record(value: Any) -> CallRecord:
    """Validate a ``CallRecord`` given as a dict, JSON bytes, Gym's model or this struct."""
    return _validate(value, CallRecord)


def validate_commit(value: Any) -> CaptureLedgerCommit:
    """Validate a ``CaptureLedgerCommit`` given as a dict, JSON bytes, Gym's model or this struct."""
    return _validate(value, CaptureLedgerCommit)


def validate_failure(value: Any) -> ManifestFailure:
    """Validate a ``ManifestFailure``."""
    return _validate(value, ManifestFailure)


def validate_manifest(value: Any) -> RolloutManifest:
    """Validate a ``RolloutManifest`` (for example what ``CaptureLedger.manifest`` returned)."""
    return _validate(value, RolloutManifest)


def validate_removal(value: Any) -> RolloutRemoval:
    """Validate a ``RolloutRemoval`` (what ``retire`` and ``delete`` return)."""
    return _validate(value, RolloutRemoval)


def to_wire(record: msgspec.Struct) -> dict:
    """Plain JSON-compatible data, every field present, as Gym's ``model_dump(mode="json")`` gives."""
    return msgspec.json.decode(msgspec.json.encode(record))
