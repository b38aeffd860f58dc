"""The client-side cache of decoded immutable objects.

Every object s3capture caches is immutable and named by its content (an entry's key carries the
SHA-256 of its canonical bytes), so a decoded object can be kept by key forever. The cache is
bounded by an *estimate of Python heap*, not by stored bytes, so ``cache_bytes`` is a real bound.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LRU", "Stored", "CallKeys", "entry_heap_estimate"]


ENTRY_OVERHEAD = 2_500
"""Heap of a decoded entry besides its arrays and content (the struct, its small fields, list
headers) plus its cache slot (``Stored``, the key string, the LRU's link), measured."""
ID_TEXT = 7
"""Typical bytes of one token id in canonical JSON (up to 6 digits and a comma)."""
PROB_TEXT = 20
"""Typical bytes of one log probability in canonical JSON (a float32 in shortest float64 form)."""


def entry_heap_estimate(entry: Any, payload: bytes | int) -> int:
    """Python heap of a decoded, cached entry, within 1.5x of what tracemalloc measures (both ways,
    ``tests/test_memory.py``): 36 bytes per token id (an int object and its list slot), 32 per log
    probability (a float and its slot), 1.5 per byte of the rest of its canonical JSON (text, dicts,
    small fields), plus ``ENTRY_OVERHEAD``; never less than the JSON itself. O(1): no scan.

    ``payload`` is the entry's canonical bytes (or their length). "The rest" leaves out the
    arrays' typical text (``ID_TEXT``, ``PROB_TEXT`` per element): the earlier estimate (3 bytes per
    JSON byte on top of the per-token counts) counted that text twice and over-counted 2-3x.
    """
    size = payload if isinstance(payload, int) else len(payload)
    ids = len(entry.prompt_token_ids) + len(entry.generation_token_ids)
    probs = len(entry.generation_log_probs)
    rest = max(0, size - ID_TEXT * ids - PROB_TEXT * probs)
    return max(size, ENTRY_OVERHEAD + 36 * ids + 32 * probs + (3 * rest) // 2)


@dataclass
class Stored:
    """A decoded entry object, immutable and therefore cacheable by key forever."""

    entry: Any
    chain: tuple[str, ...]
    nbytes: int
    cumulative: Sequence[int] | None = None
    """Memo of the entry's cumulative tokens once rebuilt (counted in ``nbytes``): an unsigned
    64-bit ``array.array``, or a tuple for ids that do not fit one (``store._packed_tokens``)."""
    lent: bytes = b""
    """Set when ``freeze`` handed out a copy sharing this entry's nested items (``output_items``,
    ``routed_experts``, extra fields): a 16-byte digest of their encoding then, which a later
    hand-out checks them against (``S3TokenStore._hand_out``)."""
    cum_base: str = ""
    """Envelope hint: key (relative to the rollout) of the checkpoint of ``chain[0]``'s tokens."""
    cum_self: str = ""
    """Envelope hint: key (relative to the rollout) of the checkpoint of this entry's own tokens."""
    chain_checked: bool = False
    """Whether ``chain`` was checked (every key has the shape of an entry key; otherwise it was
    emptied). Checked on first use, not on decode: most objects read are never walked from."""


class LRU:
    """A byte-bounded LRU of immutable decoded objects (key -> object with an ``nbytes`` field)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._data: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def get(self, key: str) -> Any:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: str, value: Any) -> None:
        if value.nbytes > self.max_bytes:
            return
        old = self._data.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._data[key] = value
        self.nbytes += value.nbytes
        while self.nbytes > self.max_bytes:
            _, evicted = self._data.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def grow(self, key: str, value: Any, extra: int) -> None:
        """Add ``extra`` bytes to ``value`` (memoized data), keeping the byte count and the bound."""
        if key in self._data and self._data[key] is value:
            self.nbytes -= value.nbytes
            del self._data[key]
        value.nbytes += extra
        self.put(key, value)

    def discard(self, key: str) -> None:
        value = self._data.pop(key, None)
        if value is not None:
            self.nbytes -= value.nbytes

    def discard_prefix(self, prefix: str) -> None:
        for key in [k for k in self._data if k.startswith(prefix)]:
            self.nbytes -= self._data.pop(key).nbytes

    def __len__(self) -> int:
        return len(self._data)


class CallKeys:
    """Bounded map (rollout id, call id) -> keys of that call's entries, relative to the rollout.

    Kept per rollout, least recently used rollout evicted first, and bounded both by rows and by an
    estimate of its heap (``nbytes``, measured with tracemalloc within 1.5x: ``tests/test_memory.py``).
    It is only a shortcut: a key that is not here costs one LIST of the rollout's entries.
    ``forget`` drops a rollout at once (freeze, drop, retire, delete: it takes no more writes).
    """

    ROW_BYTES = 180
    """Heap of one row besides its two strings: the dict slot (with the dict's spare capacity) and
    the one-element tuple of keys (measured)."""
    ROLLOUT_BYTES = 400
    """Heap of one rollout's own dict and its place in the LRU (measured)."""

    def __init__(self, max_rows: int = 100_000, max_bytes: int = 16 * 1024 * 1024) -> None:
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.rows = 0
        self.nbytes = 0
        self._data: collections.OrderedDict[str, tuple[dict[str, tuple[str, ...]], list[int]]] = (
            collections.OrderedDict()
        )

    def get(self, key: tuple[str, str]) -> tuple[str, ...] | None:
        rollout_id, model_call_id = key
        slot = self._data.get(rollout_id)
        if slot is None:
            return None
        self._data.move_to_end(rollout_id)
        return slot[0].get(model_call_id)

    def add(self, rollout_id: str, model_call_id: str, rel: str) -> None:
        slot = self._data.get(rollout_id)
        if slot is None:
            slot = self._data[rollout_id] = ({}, [self.ROLLOUT_BYTES + sys.getsizeof(rollout_id)])
            self.nbytes += slot[1][0]
        else:
            self._data.move_to_end(rollout_id)
        calls, size = slot
        keys = calls.get(model_call_id)
        if keys is None:
            grown = self.ROW_BYTES + sys.getsizeof(model_call_id) + sys.getsizeof(rel)
            calls[model_call_id] = (rel,)
            self.rows += 1
        elif rel in keys:
            return
        else:
            grown = 8 + sys.getsizeof(rel)
            calls[model_call_id] = (*keys, rel)
        size[0] += grown
        self.nbytes += grown
        self._shrink()

    def forget(self, rollout_id: str) -> None:
        slot = self._data.pop(rollout_id, None)
        if slot is not None:
            self.rows -= len(slot[0])
            self.nbytes -= slot[1][0]

    def _shrink(self) -> None:
        while self.rows > self.max_rows or self.nbytes > self.max_bytes:
            rollout_id, (calls, size) = next(iter(self._data.items()))
            if len(self._data) > 1 or not calls:
                self.forget(rollout_id)
                continue
            # One rollout alone is over the bound: drop its oldest calls.
            cid, keys = next(iter(calls.items()))
            del calls[cid]
            freed = self.ROW_BYTES + sys.getsizeof(cid) + sum(sys.getsizeof(k) + 8 for k in keys) - 8
            size[0] -= freed
            self.nbytes -= freed
            self.rows -= 1

    def __len__(self) -> int:
        return self.rows
