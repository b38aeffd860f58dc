"""The client-side cache of decoded immutable objects.

Every object s3capture caches is immutable and named by its content (an entry's key carries the
SHA-256 of its canonical bytes), so a decoded object can be kept by key forever. The cache is
bounded by an *estimate of Python heap*, not by stored bytes, so ``cache_bytes`` is a real bound.
"""

from __future__ import annotations

import collections
import itertools
import math
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
    """Python heap of a decoded, cached entry in bytes, within 1.5x of what tracemalloc measures
    (both ways, ``tests/test_memory.py``): 36 per token id (an int object and its list slot; 8
    for the small ids Python shares, judged from a sample of about 16 ids of an array of 256 or
    more), 32 per log probability (a float and its slot), ``ENTRY_OVERHEAD``, and the rest of its
    JSON at 1.4 bytes per byte when that rest is under a tenth of the arrays' heap and there is
    no MoE routing; otherwise what the nested fields hold (``output_items``, ``routed_experts``,
    extra fields: ``nested_heap``), but never less than a quarter of the rest; never less than
    the JSON itself. Structure past the walk's bounds (32 levels, 4,096 containers) counts its
    containers only.

    ``payload`` is the entry's canonical bytes (or their length). "The rest" leaves out the
    arrays' typical text (``ID_TEXT``, ``PROB_TEXT`` per element). Counting the rest at a fixed
    rate per byte, as before 2026-12-03, was up to 5x low for nested lists of small ints and for
    many small dicts: an audit measured a cache of MoE ``routed_experts`` entries holding 3.15x
    its count.
    """
    size = payload if isinstance(payload, int) else len(payload)
    prompt, generation = entry.prompt_token_ids, entry.generation_token_ids
    ids = len(prompt) + len(generation)
    probs = len(entry.generation_log_probs)
    rest = max(0, size - ID_TEXT * ids - PROB_TEXT * probs)
    base = ENTRY_OVERHEAD + _ids_heap(prompt) + _ids_heap(generation) + 32 * probs
    if rest * _WALK_RATIO <= base and entry.routed_experts is None:
        # The token arrays hold nearly all the heap: even structure at 5x its JSON (a Responses
        # API logprob dict) could not move the total out of 1.5x. No walk (it would cost about
        # half of the entry's decode for a small entry). MoE routing is always walked: a top-1
        # expert list is 72 bytes of heap for 4 of JSON (a review: 0.35x without the walk).
        return max(size, base + (7 * rest) // 5)
    # Walk (sampled, bounded) what holds structure: output items, MoE routing, extra fields.
    # Structure costs far more than its JSON text (a list of 8 small ints is about 120 bytes of
    # heap for 26 of JSON), text about its size; a quarter of the rest of the JSON is the floor,
    # for what a sample missed (JSON escapes make text longer than its heap).
    walked = _walk(entry.output_items, 0, [_WALK_BUDGET])
    if entry.routed_experts is not None:
        walked += _walk(entry.routed_experts, 0, [_WALK_BUDGET])
    extra = getattr(entry, "__dict__", {}).get("_extra")
    if extra:
        walked += _walk(extra, 0, [_WALK_BUDGET])
    return max(size, base + max(walked, rest // 4))


_WALK_RATIO = 10
"""An entry's nested fields are walked when it has ``routed_experts`` or its non-array JSON is over
a tenth of its array heap."""


def _ids_heap(ids: Sequence[int]) -> int:
    """Heap of a decoded list of token ids: 8 bytes per slot plus 28 per int object, except for
    the ints from -5 to 256 that Python shares (estimated from about 16 evenly spaced ids)."""
    n = len(ids)
    if n < 256:  # at most 7 KiB over-counted: not worth the sample
        return 36 * n
    sample = ids[:: n // 16]
    small = sum(map((256).__ge__, sample))  # ids are never negative
    return 8 * n + (28 * n * (len(sample) - small)) // len(sample)


_SAMPLE = 16
_MAX_DEPTH = 32
_WALK_BUDGET = 4096


def nested_heap(value: Any) -> int:
    """Estimated heap in bytes of a decoded JSON value (lists, tuples, dicts, str, int, float,
    bool, None).

    A list or dict of more than 16 members is judged from 16 of them spread over it (a list's
    with an odd stride prime to its length, so a pattern that repeats every few members is not
    sampled in one phase; a dict's evenly), so the cost is bounded by the nesting, not the size
    (a ``routed_experts`` of 1,200 x 48 x 8 ids visits about 2,000 values; a dict's sample still
    iterates its items once, in C). A str costs ``sys.getsizeof`` plus 2 bytes per character
    when it is not ASCII (it then keeps its UTF-8 form too, once encoded); in a dict of up to 16
    keys, a key of up to 32 ASCII characters costs nothing (msgspec's decoder shares such keys
    between dicts). At most 4,096 containers are opened (past that, and below 32 levels, a
    container counts its own size only).
    """
    return _walk(value, 0, [_WALK_BUDGET])


def _stride(n: int) -> int:
    """An odd step prime to ``n`` that spreads 16 samples over ``n`` members (``n > 16``)."""
    step = (-(-n // _SAMPLE)) | 1
    while math.gcd(step, n) != 1:
        step += 2
    return step


def _walk(value: Any, depth: int, budget: list[int]) -> int:
    kind = type(value)
    if kind is str:
        return _getsizeof(value) if value.isascii() else _getsizeof(value) + 2 * len(value)
    if kind is int:
        return 0 if -5 <= value <= 256 else 28
    if kind is float:
        return 24
    if kind is dict:
        n = len(value)
        own = _getsizeof(value)
        if not n or depth >= _MAX_DEPTH or budget[0] <= 0:
            return own
        budget[0] -= 1
        items: Any = value.items()
        if n > _SAMPLE:
            items = list(itertools.islice(items, 0, None, -(-n // _SAMPLE)))
        total = 0
        depth += 1
        shared = n <= _SAMPLE  # msgspec's decoder shares short keys, as a record's repeat: not a wide dict's
        for key, member in items:
            if not shared or type(key) is not str or len(key) > 32 or not key.isascii():
                total += _walk(key, depth, budget)
            member_kind = type(member)
            if member_kind is str:  # the common case, inline
                total += _getsizeof(member) if member.isascii() else _getsizeof(member) + 2 * len(member)
            elif member is not None and member_kind is not bool:
                total += _walk(member, depth, budget)
        return own + (total if n <= _SAMPLE else total * n // len(items))
    if kind is list or kind is tuple:
        n = len(value)
        own = (56 if kind is list else 40) + 8 * n
        if not n or depth >= _MAX_DEPTH or budget[0] <= 0:
            return own
        budget[0] -= 1
        depth += 1
        if n <= _SAMPLE:
            total = 0
            for member in value:
                total += _walk(member, depth, budget)
            return own + total
        step = _stride(n)
        total = 0
        for i in range(_SAMPLE):
            total += _walk(value[(i * step) % n], depth, budget)
        return own + total * n // _SAMPLE
    return 0  # None, True, False: shared objects


_getsizeof = sys.getsizeof


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
