"""The client-side cache of decoded immutable objects.

Every object s3capture caches is immutable and named by its content (an entry's key carries the
SHA-256 of its canonical bytes), so a decoded object can be kept by key forever. The cache is
bounded by an *estimate of Python heap*, not by stored bytes, so ``cache_bytes`` is a real bound.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

__all__ = ["LRU", "Stored", "entry_heap_estimate"]


def entry_heap_estimate(entry: Any, json_bytes: int) -> int:
    """Estimated Python heap of a decoded entry: ~36 bytes per token id (int object and list slot),
    ~32 per float, and ~3 per byte of the rest of its JSON (measured). The cache counts this, so
    ``cache_bytes`` bounds heap rather than JSON bytes."""
    ids = len(entry.prompt_token_ids) + len(entry.generation_token_ids)
    return 36 * ids + 32 * len(entry.generation_log_probs) + 3 * json_bytes


@dataclass
class Stored:
    """A decoded entry object, immutable and therefore cacheable by key forever."""

    entry: Any
    chain: tuple[str, ...]
    nbytes: int
    cumulative: tuple[int, ...] | None = None
    """Memo of the entry's cumulative tokens once rebuilt (counted in ``nbytes``)."""
    cum_base: str = ""
    """Envelope hint: key (relative to the rollout) of the checkpoint of ``chain[0]``'s tokens."""
    cum_self: str = ""
    """Envelope hint: key (relative to the rollout) of the checkpoint of this entry's own tokens."""


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
        if self._data.get(key) is value:
            self.nbytes -= value.nbytes
            del self._data[key]
        value.nbytes += extra
        self.put(key, value)

    def discard_prefix(self, prefix: str) -> None:
        for key in [k for k in self._data if k.startswith(prefix)]:
            self.nbytes -= self._data.pop(key).nbytes

    def __len__(self) -> int:
        return len(self._data)
