"""Continuation fingerprints over message lists (NeMo Gym's algorithm, FINGERPRINT_VERSION 2).

Contract source: ``nemo_gym/token_id_capture/fingerprint.py`` of nemo-gym 0.7.0. The protocol
reference asks external stores to embed Gym's matcher rather than re-hash, so when ``nemo_gym`` is
importable ``assistant_fingerprint`` and ``conversation_digest`` below are Gym's own functions.
Without Gym, s3capture uses ``native_assistant_fingerprint`` and ``native_conversation_digest``: an
independent implementation of the same layout, proven equal by ``tests/test_fingerprint.py``
(a differential test against Gym and golden vectors kept in ``tests/golden``).

Layout (version 2): SHA-256 over a domain string followed by tagged, length-delimited UTF-8 fields
(tag byte, 8-byte big-endian length, bytes). ``assistant_fingerprint`` covers only model-authored
items (role ``assistant`` or type ``function_call``; reasoning items are excluded) and returns ``""``
when there are none; ``conversation_digest`` covers every item, tool results included. Structured
content is hashed as sorted-key compact JSON (orjson's format: shortest floats, ``e+NN`` exponents).

Entries stamped with another ``fingerprint_version`` are never matched (always UNRESOLVED, which is
safe).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = [
    "FINGERPRINT_VERSION",
    "assistant_fingerprint",
    "conversation_digest",
    "native_assistant_fingerprint",
    "native_conversation_digest",
    "canonicalize_tool_arguments",
    "USING_GYM",
]

FINGERPRINT_VERSION = 2

_FINGERPRINT_DOMAIN = b"nemo-gym-lineage"
_CONTEXT_DOMAIN = b"nemo-gym-lineage-context"
_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1
_encoder = msgspec.json.Encoder(order="sorted")


_BIG_FLOAT = 1e16
"""From here on msgspec writes ``1e16`` where orjson (and so Gym) writes ``1e+16``."""
_INFINITY = float("inf")


_JSON_TYPES = (bool, str, float, int, dict, list, tuple)
"""The types ``_scan_plain`` accepts, in the order a subclass is matched (bool before int)."""


def _json_type(item: Any) -> type:
    """The JSON type ``item``'s class extends; ``ValueError`` for anything else."""
    for kind in _JSON_TYPES:
        if isinstance(item, kind):
            return kind
    raise ValueError(f"unsupported prompt content: {type(item).__name__}")


MAX_JSON_DEPTH = 254
"""Deepest nesting of containers (objects and arrays) that orjson, Gym's encoder, writes: a
document whose outermost container counts as 1 may nest 254 deep; orjson refuses one more."""


def _scan_plain(value: Any, max_depth: int | None = None, *, finite: bool = False) -> bool:
    """True when msgspec's sorted output of ``value`` is already orjson's: no float of magnitude >= 1e16.

    Raises ``ValueError`` for content orjson refuses (65-bit integers, non-string keys, non-JSON
    types); with ``max_depth``, for containers nested deeper than that (``value`` itself, when a
    container, is at depth 1); with ``finite``, for NaN and infinities (which orjson writes as
    ``null``). Iterative, one level at a time: no depth of input exhausts the stack.
    """
    plain = True
    limit = max_depth if max_depth is not None else -1
    level = [value]
    depth = 0
    while level:
        depth += 1  # of the containers in ``level``
        deeper: list[Any] = []
        extend = deeper.extend
        for item in level:
            if item is None:
                continue
            kind = type(item)
            if kind not in _JSON_TYPES:  # a subclass is judged as the JSON type it extends
                kind = _json_type(item)
            if kind is str or kind is bool:
                continue
            if kind is dict:
                if depth == limit + 1:
                    raise ValueError(f"unsupported content: containers nested deeper than {limit} levels")
                for key in item:
                    if not isinstance(key, str):
                        raise ValueError(f"unsupported prompt content: non-string key {key!r}")
                extend(item.values())
            elif kind is list or kind is tuple:
                if depth == limit + 1:
                    raise ValueError(f"unsupported content: containers nested deeper than {limit} levels")
                extend(item)
            elif kind is float:
                if not abs(item) < _BIG_FLOAT:  # also NaN
                    if item != item or abs(item) == _INFINITY:
                        if finite:
                            raise ValueError(f"unsupported content: {item!r} (JSON has no non-finite numbers)")
                    else:
                        plain = False
            elif not _I64_MIN <= item <= _U64_MAX:  # int
                raise ValueError(f"unsupported prompt content: integer {item} exceeds 64 bits")
        level = deeper
    return plain


def _encode_slow(value: Any, out: list[bytes]) -> None:
    if isinstance(value, float):
        text = _encoder.encode(value)
        cut = text.find(b"e")
        if cut >= 0 and text[cut + 1 : cut + 2] != b"-":
            text = text[: cut + 1] + b"+" + text[cut + 1 :]
        out.append(text)
    elif isinstance(value, dict):
        out.append(b"{")
        for position, key in enumerate(sorted(value)):
            if position:
                out.append(b",")
            out.append(_encoder.encode(key))
            out.append(b":")
            _encode_slow(value[key], out)
        out.append(b"}")
    elif isinstance(value, (list, tuple)):
        out.append(b"[")
        for position, inner in enumerate(value):
            if position:
                out.append(b",")
            _encode_slow(inner, out)
        out.append(b"]")
    else:
        out.append(_encoder.encode(value))


def canonical_json(value: Any) -> str:
    """Sorted-key compact JSON, byte-equal to ``orjson.dumps(value, option=OPT_SORT_KEYS)``.

    Raises ``ValueError`` for content orjson would refuse (non-string keys, 65-bit integers,
    non-JSON types).
    """
    if _scan_plain(value):
        return _encoder.encode(value).decode("utf-8")
    parts: list[bytes] = []
    _encode_slow(value, parts)
    return b"".join(parts).decode("utf-8")


def canonicalize_tool_arguments(value: Any) -> str:
    """Normalize tool-call arguments for comparison (sorted-key JSON; unparsable strings stripped)."""
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (TypeError, ValueError):
            return value.strip()
    else:
        parsed = value
    return canonical_json(parsed)


def _field(hasher: Any, tag: bytes, value: str) -> None:
    data = value.encode("utf-8")
    hasher.update(tag + len(data).to_bytes(8, "big") + data)


def _is_model_authored(item: dict) -> bool:
    return item.get("role") == "assistant" or item.get("type") == "function_call"


_TEXT_BLOCK_TYPES = frozenset({"", "text", "input_text", "output_text"})


def _content_parts(content: Any) -> list[tuple[str, str]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)] if content else []
    if not isinstance(content, list):
        raise ValueError(f"unsupported message content: {type(content).__name__}")
    parts: list[tuple[str, str]] = []
    for block in content:
        if isinstance(block, str):
            if block:
                parts.append(("text", block))
            continue
        if not isinstance(block, dict):
            raise ValueError(f"unsupported content block: {type(block).__name__}")
        kind = str(block.get("type") or "")
        if kind in ("tool_use", "tool_result"):
            continue
        text = block.get("text")
        if isinstance(text, str) and kind in _TEXT_BLOCK_TYPES:
            if text:
                parts.append(("text", text))
            continue
        if not kind:
            raise ValueError("content block has no supported type")
        parts.append((kind, canonical_json(block)))
    return parts


def _tool_calls(item: dict) -> list[tuple[str, str, str]]:
    calls: list[tuple[str, str, str]] = []
    if item.get("type") == "function_call":
        name = str(item.get("name", ""))
        if item.get("namespace"):
            name = f"{item['namespace']}__{name}"
        calls.append(
            (str(item.get("call_id") or item.get("id") or ""), name, canonicalize_tool_arguments(item.get("arguments")))
        )
    content = item.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                calls.append(
                    (
                        str(block.get("id") or ""),
                        str(block.get("name", "")),
                        canonicalize_tool_arguments(block.get("input")),
                    )
                )
    for call in item.get("tool_calls") or []:
        function = (call or {}).get("function") or {}
        calls.append(
            (
                str((call or {}).get("id") or ""),
                str(function.get("name", "")),
                canonicalize_tool_arguments(function.get("arguments")),
            )
        )
    return calls


def _tool_results(item: dict) -> list[tuple[str, str]]:
    results: list[tuple[str, str]] = []
    if item.get("type") == "function_call_output":
        output = item.get("output")
        results.append(
            (
                str(item.get("call_id") or item.get("id") or ""),
                output if isinstance(output, str) else canonical_json(output),
            )
        )
    elif item.get("role") == "tool":
        content = item.get("content")
        results.append(
            (str(item.get("tool_call_id") or ""), content if isinstance(content, str) else canonical_json(content))
        )
    content = item.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                inner = block.get("content")
                results.append(
                    (
                        str(block.get("tool_use_id") or block.get("id") or ""),
                        inner if isinstance(inner, str) else canonical_json(inner),
                    )
                )
    return results


def native_assistant_fingerprint(messages: list[dict]) -> str:
    """Fingerprint the model-authored items of a request, in order; ``""`` when there are none.

    Raises ``ValueError`` for an item that is not an object or for unsupported content.
    """
    hasher = hashlib.sha256(_FINGERPRINT_DOMAIN)
    count = 0
    for item in messages or []:
        if not isinstance(item, dict):
            raise ValueError(f"request item is not an object: {type(item).__name__}")
        if not _is_model_authored(item):
            continue
        count += 1
        for kind, payload in _content_parts(item.get("content")):
            _field(hasher, b"\x00", kind)
            _field(hasher, b"\x01", payload)
        for call_id, name, arguments in _tool_calls(item):
            _field(hasher, b"\x02", call_id)
            _field(hasher, b"\x03", name)
            _field(hasher, b"\x04", arguments)
    return hasher.hexdigest() if count else ""


def native_conversation_digest(messages: list[dict]) -> str:
    """Hash every item of a conversation (model-authored or not, tool results included)."""
    hasher = hashlib.sha256(_CONTEXT_DOMAIN)
    for item in messages or []:
        if not isinstance(item, dict):
            raise ValueError(f"request item is not an object: {type(item).__name__}")
        _field(hasher, b"\x00", str(item.get("role") or item.get("type") or ""))
        for kind, payload in _content_parts(item.get("content")):
            _field(hasher, b"\x01", kind)
            _field(hasher, b"\x02", payload)
        for call_id, name, arguments in _tool_calls(item):
            _field(hasher, b"\x03", call_id)
            _field(hasher, b"\x04", name)
            _field(hasher, b"\x05", arguments)
        for call_id, output in _tool_results(item):
            _field(hasher, b"\x06", call_id)
            _field(hasher, b"\x07", output)
    return hasher.hexdigest()


assistant_fingerprint: Callable[[list[dict]], str]
"""Gym's ``assistant_fingerprint`` when ``nemo_gym`` is importable, else ``native_assistant_fingerprint``."""
conversation_digest: Callable[[list[dict]], str]
"""Gym's ``conversation_digest`` when ``nemo_gym`` is importable, else ``native_conversation_digest``."""
USING_GYM: bool
"""Whether the two above are Gym's."""
# Annotated, not assigned: the first access goes through the module's __getattr__ (_bind_matcher).


def _bind_matcher() -> None:
    """Bind ``assistant_fingerprint``, ``conversation_digest`` and ``USING_GYM``: Gym's matcher when
    ``nemo_gym`` is importable (the protocol reference asks for that), else the native one, proven
    equal. Done on first use, not at import: importing Gym (and pydantic) costs about half a second
    of CPU that a process that never matches (an export worker, ``s3capture ls``) need not pay."""
    global assistant_fingerprint, conversation_digest, USING_GYM
    try:
        from nemo_gym.token_id_capture import fingerprint as gym

        if getattr(gym, "FINGERPRINT_VERSION", None) != FINGERPRINT_VERSION:  # pragma: no cover
            raise ImportError("a Gym with another fingerprint algorithm version")
        assistant_fingerprint, conversation_digest, USING_GYM = gym.assistant_fingerprint, gym.conversation_digest, True
    except Exception:  # noqa: BLE001 - Gym absent or broken: the native implementation is proven equal
        assistant_fingerprint, conversation_digest = native_assistant_fingerprint, native_conversation_digest
        USING_GYM = False


def __getattr__(name: str) -> Any:  # PEP 562: the matcher's names, bound on first use
    if name in ("assistant_fingerprint", "conversation_digest", "USING_GYM"):
        _bind_matcher()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stamp_continuation(entry: Any, request_items: list[dict]) -> Any:
    """Fill an entry's continuation lookup fields from its request (Gym's ``stamp_continuation``)."""
    if "USING_GYM" not in globals():  # bound last by _bind_matcher
        _bind_matcher()
    entry.continuation_fingerprint = assistant_fingerprint(list(request_items) + list(entry.output_items))
    entry.continuation_context_len = len(request_items)
    entry.continuation_context_digest = conversation_digest(request_items)
    entry.fingerprint_version = FINGERPRINT_VERSION
    return entry
