"""The stored shapes of the capture ledger's objects and the byte-level helpers around them.

A committed row (``_Row``) and a failure row (``_Failure``) are sorted-key JSON named by the SHA-256
of their bytes, zstd-compressed above ``_COMPRESS_ABOVE`` bytes and refused by readers above
``_MAX_ROW_BYTES``; ``_Cached`` is what the row cache holds. Shared by the writes of
``s3capture.ledger.S3CaptureLedger`` and its reads (``s3capture.ledger_manifest``); ``s3capture.ledger``
re-exports the names tests and tools import from there.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

import msgspec
import zstandard

from s3capture.layout import is_folder_marker
from s3capture.ledger_records import CallRecord
from s3capture.records import OversizeRecordError, RecordError
from s3capture.transport import ListedObject

_ROW_FORMAT = "s3capture.ledger-row/1"
_FAILURE_FORMAT = "s3capture.ledger-failure/1"
_MAX_ROW_BYTES = 4 * 1024 * 1024
"""Largest ledger object a reader decodes (after decompression): rows are token-free."""
_MAX_REASON_BYTES = 64 * 1024
"""Longest failure reason stored (UTF-8 bytes); ``bounded_reason`` cuts a longer one, so the row of
``record_failure`` always fits ``_MAX_ROW_BYTES`` and its readers never refuse it."""
_COMPRESS_ABOVE = 1024
"""Rows longer than this (bytes of JSON) are stored zstd-compressed: a deep call's row repeats its
whole ``staging_chain``, which compresses about tenfold."""
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def bounded_reason(reason: str) -> str:
    """``reason`` itself when it is at most ``_MAX_REASON_BYTES`` of UTF-8; otherwise its longest
    prefix that fits with a note of the full length, cut on a character boundary. The same input
    always gives the same text, so a repeated ``record_failure`` is still one row."""
    data = reason.encode("utf-8")
    if len(data) <= _MAX_REASON_BYTES:
        return reason
    note = f" [... cut: the reason was {len(data)} bytes]"
    return data[: _MAX_REASON_BYTES - len(note)].decode("utf-8", errors="ignore") + note


class _Row(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A stored committed row: the manifest row plus what resolution needs (no request items)."""

    format: str
    rollout_id: str
    record: CallRecord
    staging_chain: list[str]
    fingerprint: str | None
    fingerprint_version: int
    context_len: int
    context_digest: str


class _Failure(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: str
    rollout_id: str
    model_call_id: str
    reason: str


@dataclass
class _Cached:
    """A decoded immutable ledger object (cached by key: the key names the SHA-256 of its bytes)."""

    value: Any
    nbytes: int


def _sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _heap_estimate(value: Any, json_bytes: int) -> int:
    """Bytes a decoded row holds on the heap: about 2x its JSON, plus a str object per chain key.

    Each ``staging_chain`` key is its own ``str`` (about 50 bytes of header and list slot), which
    dominates a row of many short keys; counting it keeps ``cache_bytes`` a real bound.
    """
    return 2 * json_bytes + 1024 + 64 * len(getattr(value, "staging_chain", ()))


def _decompress(data: bytes) -> bytes:
    """Decompress a stored row, refusing more than ``_MAX_ROW_BYTES``; raises ``RecordError``."""
    out = io.BytesIO()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
        while chunk := reader.read(1 << 16):
            out.write(chunk)
            if out.tell() > _MAX_ROW_BYTES:
                raise OversizeRecordError(f"ledger object decompresses beyond {_MAX_ROW_BYTES} bytes")
    except zstandard.ZstdError as error:
        raise RecordError(f"ledger object is not valid zstd: {error}") from None
    return out.getvalue()


def _without_folder_markers(prefix: str, listed: list[ListedObject]) -> list[ListedObject]:
    """``listed`` without folder markers (``layout.is_folder_marker``: an s3fs or rclone mount's
    ``.../row/<call>/``), which are no rows."""
    return [item for item in listed if not is_folder_marker(item.key[len(prefix) :], item.size)]
