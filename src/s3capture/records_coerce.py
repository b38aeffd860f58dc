"""``coerce_entry`` and ``prepare_entry``: validated private copies of entries, and their fast paths.

``coerce_entry`` turns an s3capture ``TokenEntry``, NeMo Gym's pydantic ``TokenEntry`` or a dict into
a validated private copy; ``prepare_entry`` also returns its canonical bytes (the put path). Each
tries ``_fast_copy`` (one ``msgspec`` conversion per part, checked in C) and falls back to
``_coerce_general``, the reference conversion that decides every other case and raises every error.
The record type, its contract checks and the canonical encoding are in ``s3capture.records``, which
re-exports every name here (import them from there).
"""

from __future__ import annotations

import copy
import math
from typing import Annotated, Any

import msgspec

# records imports this module at its end (to re-export its names), once everything below is defined.
from s3capture.fingerprint import MAX_JSON_DEPTH
from s3capture.records import (
    _BYTES_TYPES,
    _FIELD_NAMES,
    TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    RecordError,
    TokenEntry,
    _check_schema_version,
    _checked_extra,
    _from_mapping,
    _json_encoder,
    _nested_plain,
    encode_entry,
)

__all__ = ["coerce_entry", "prepare_entry"]


def coerce_entry(entry: Any) -> TokenEntry:
    """Return a validated private copy of an s3capture entry, a Gym pydantic entry or a dict.

    The copy shares no mutable object with ``entry``. A Gym ``TokenEntry`` keeps its extra fields.
    Raises ``TypeError`` for other objects and ``RecordError`` for invalid data.
    """
    fast = _fast_copy(entry)
    if fast is not None:
        return fast[0]
    return _coerce_general(entry)


def prepare_entry(entry: Any) -> tuple[TokenEntry, bytes]:
    """Validate ``entry`` once and return ``(coerce_entry(entry), encode_entry(coerce_entry(entry)))``.

    The put path: one validation, one private copy, one encode. Raises like ``coerce_entry`` and
    ``encode_entry``.
    """
    fast = _fast_copy(entry)
    if fast is not None:
        record, plain = fast
        if plain and -1e16 < record.created_at < 1e16:
            extra = record.__dict__.get("_extra")
            try:
                if not extra:
                    return record, _json_encoder.encode(record)
                out = msgspec.to_builtins(record)
                out.update(extra)
                return record, _json_encoder.encode(out)
            except (TypeError, ValueError):
                pass  # e.g. a lone surrogate: encode_entry below raises the documented RecordError
        return record, encode_entry(record)
    record = _coerce_general(entry)
    return record, encode_entry(record)


def _coerce_general(entry: Any) -> TokenEntry:
    """The reference conversion (every input, every error message); ``_fast_copy`` must agree with it."""
    try:
        return _coerce_general_unguarded(entry)
    except RecursionError:  # a copy of content nested far deeper than MAX_JSON_DEPTH
        raise RecordError(
            f"entry nests containers far deeper than the {MAX_JSON_DEPTH} levels Gym's encoder writes"
        ) from None


def _unencodable(entry: TokenEntry, error: TypeError) -> str:
    """The ``RecordError`` text for an entry holding a value JSON cannot hold: the first field
    that holds one, and what to do about numpy values (the usual cause)."""
    field = next(
        (name for name in TokenEntry.__struct_fields__ if not _converts(getattr(entry, name, None))),
        "?",
    )
    hint = " (numpy arrays and scalars: convert them with .tolist())" if "numpy" in str(error) else ""
    return f"{field} of model call {entry.model_call_id!r} holds a value JSON cannot hold: {error}{hint}"


def _converts(value: Any) -> bool:
    try:
        msgspec.to_builtins(value, builtin_types=_BYTES_TYPES)
    except TypeError:
        return False
    return True


def _coerce_general_unguarded(entry: Any) -> TokenEntry:
    if isinstance(entry, TokenEntry):
        # The constructor checks no types; a round trip through builtins checks them all and
        # returns a copy the caller cannot mutate behind our back. Bytes stay bytes: to_builtins
        # would turn ``rollout_id=b"r1"`` into the base64 text "cjE=", an id nobody asked for (an
        # API breaker, 2026-12-03: acknowledged, then invisible under "r1"); the conversion below
        # refuses them as the dict path does.
        _checked_extra(entry)
        try:
            raw = msgspec.to_builtins(entry, builtin_types=_BYTES_TYPES)
        except TypeError as error:  # e.g. numpy scalars or arrays: msgspec names no field
            raise RecordError(_unencodable(entry, error)) from None
        raw.update(copy.deepcopy(entry.extra_fields))
        return _from_mapping(raw)
    if isinstance(entry, dict):
        record = _from_mapping(entry)
        # msgspec.convert copies containers of known types only: copy what the caller still shares.
        record.output_items = copy.deepcopy(record.output_items)
        record.routed_experts = copy.deepcopy(record.routed_experts)
        return record
    dump = getattr(entry, "model_dump", None)
    if callable(dump):
        return _from_mapping(dump(mode="json"))
    raise TypeError(f"expected a TokenEntry (s3capture or NeMo Gym) or a dict, got {type(entry).__name__}")


# The fast path checks the token arrays inside msgspec's C conversion: ids up to 2**63 - 1 (the
# rest of Gym's u64 range takes the general path) and log probabilities in (-1e16, 1e16), which
# excludes NaN and infinities and is where msgspec spells a float exactly as orjson does.
_FAST_IDS = list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]]
_FAST_PROBS = list[Annotated[float, msgspec.Meta(gt=-1e16, lt=1e16)]]
_ARRAYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
_gym_fast_types: dict[type, bool] = {}


def _is_plain_gym_type(cls: type) -> bool:
    """Whether ``cls`` is NeMo Gym's own pydantic ``TokenEntry`` with no custom serialization, so its
    ``__dict__`` plus ``__pydantic_extra__`` hold exactly what ``model_dump(mode="json")`` dumps."""
    known = _gym_fast_types.get(cls)
    if known is None:
        decorators = getattr(cls, "__pydantic_decorators__", None)
        known = (
            cls.__name__ == "TokenEntry"
            and cls.__module__ == "nemo_gym.token_id_capture.records"
            and decorators is not None
            and not decorators.field_serializers
            and not decorators.model_serializers
            and not getattr(cls, "__pydantic_computed_fields__", None)
            and set(getattr(cls, "__pydantic_fields__", ())) <= _FIELD_NAMES
        )
        _gym_fast_types[cls] = known
    return known


def _fast_copy(entry: Any) -> tuple[TokenEntry, bool] | None:
    """A validated private copy of ``entry`` in one pass, and whether its nested content is "plain"
    (no float msgspec spells differently from orjson). ``None`` sends the caller to
    ``_coerce_general``, which decides every case this path does not prove (and raises its errors).

    Equivalent to ``_coerce_general`` where it returns: the token arrays are checked and copied by
    one ``msgspec.convert`` each, the other known fields by one ``convert`` of the struct, and the
    nested JSON values (output items, routed experts, extra fields) are scanned for non-JSON types
    and deep-copied by ``msgspec.to_builtins``, which is the identity on plain JSON values.
    """
    kind = type(entry)
    if kind is TokenEntry:
        fields = msgspec.structs.asdict(entry)
        extra = _checked_extra(entry)
    elif kind is dict:
        fields = {k: v for k, v in entry.items() if k in _FIELD_NAMES}
        extra = {k: v for k, v in entry.items() if k not in _FIELD_NAMES} if len(fields) != len(entry) else None
    elif _is_plain_gym_type(kind):
        raw = entry.__dict__
        fields = {k: v for k, v in raw.items() if k in _FIELD_NAMES}
        extra = dict(entry.__pydantic_extra__ or {}) or None
        if len(fields) != len(raw):
            return None
    else:
        return None
    try:
        _check_schema_version(fields.get("schema_version", TOKEN_ENTRY_RECORD_SCHEMA_VERSION))
        prompt = msgspec.convert(fields["prompt_token_ids"], _FAST_IDS, strict=False)
        generation = msgspec.convert(fields["generation_token_ids"], _FAST_IDS, strict=False)
        probs = msgspec.convert(fields["generation_log_probs"], _FAST_PROBS, strict=False)
        nested = [fields.get("output_items"), fields.get("routed_experts"), extra]
        plain = _nested_plain(nested[0], nested[1], extra)  # raises ValueError for content Gym cannot write
        items, routed, extra = msgspec.to_builtins(nested)
        for name in _ARRAYS:
            fields[name] = ()
        if "output_items" in fields:
            fields["output_items"] = items
        record = msgspec.convert(fields, TokenEntry, strict=False)
    except (KeyError, ValueError, TypeError, msgspec.ValidationError):
        return None
    record.prompt_token_ids = prompt
    record.generation_token_ids = generation
    record.generation_log_probs = probs
    record.routed_experts = routed
    if extra:
        record.__dict__["_extra"] = extra
    created_at = record.created_at
    if not math.isfinite(created_at):
        return None
    try:
        record._validate_contract()
    except RecordError:
        return None
    return record, plain
