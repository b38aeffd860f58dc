"""Client memory that is measured, not estimated: the cache's heap estimate and the per-call key
map against tracemalloc, the key map's bounds, and what freeze hands out (copies that share no
mutable part with what the client's own readers use).

The estimate tests need no S3; the freeze tests run against the selected servers.
"""

from __future__ import annotations

import gc
import hashlib
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from helpers import RequestRecorder, build_conversation, canonical, next_request, simple_entry, turn_entry
from s3capture.cache import LRU, CallKeys, entry_heap_estimate
from s3capture.records import ParentResolutionStatus, TokenEntry, encode_entry
from s3capture.store import S3TokenStore

ROOT = Path(__file__).resolve().parent.parent
from helpers import EXAMPLE_DATA  # noqa: E402

DATA = EXAMPLE_DATA
sys.path.insert(0, str(ROOT / "tools"))


def _real_entries() -> list[TokenEntry]:
    path = DATA / "competitive_coding.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not found (the project's shared data folder)")
    import _benchcommon

    _benchcommon.DATA_DIR = DATA
    return _benchcommon.replay_entries("competitive_coding")


def _synthetic_entries() -> list[TokenEntry]:
    from _benchcommon import synthetic_entry

    shapes = [(16, 8), (64, 32), (200, 100), (1100, 512), (8000, 1024), (30000, 2048)]
    return [synthetic_entry(n, generation_tokens=g, seed=i, call_id=f"c{i}") for i, (n, g) in enumerate(shapes)]


def _measured(build: Any) -> tuple[Any, int]:
    """(what ``build()`` returns, the heap it allocated and still holds, by tracemalloc)."""
    # gc.freeze first: the collections below then scan only objects made after it, not the whole heap
    # of a long test process (in a full CI run each full collection took seconds). Objects made
    # before tracemalloc starts are not traced, so collecting them or not cannot change the figure;
    # the full collection still empties the interpreter's free lists, so build()'s objects are
    # fresh (traced) allocations.
    gc.freeze()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        value = build()
        gc.collect()
        return value, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.unfreeze()


def _stored_object(store: S3TokenStore, entry: TokenEntry) -> tuple[str, bytes, str]:
    payload = encode_entry(entry)
    sha = hashlib.sha256(payload).hexdigest()
    prefix = store.layout.rollout(entry.rollout_id)
    key = prefix + store.layout.entry_rel(prefix, entry.continuation_fingerprint, entry.model_call_id, sha)
    return key, store._encode_object(payload, ()), sha


@pytest.mark.parametrize("source", ["competitive_coding", "synthetic"])
def test_cache_estimate_is_within_1_5x_of_the_measured_heap(source: str) -> None:
    """Decode each entry the way a reader does (zstd object -> ``_decode_object``) into a cache, and
    compare the cache's accounting with the heap tracemalloc sees the cache hold."""
    entries = _real_entries() if source == "competitive_coding" else _synthetic_entries()
    assert entries
    store = S3TokenStore("s3://bucket/root")  # no request is sent: decoding only
    objects = [_stored_object(store, entry) for entry in entries]
    for key, data, sha in objects:
        cache = LRU(1 << 40)

        def fill() -> None:
            cache.put(str(key), store._decode_object(data, sha))  # its own copy of the key, as a LIST gives

        _, heap = _measured(fill)
        ratio = cache.nbytes / heap
        assert 1 / 1.5 <= ratio <= 1.5, f"{key}: estimate {cache.nbytes} vs measured {heap} (x{ratio:.2f})"
    # And all of them in one cache (the bound a worker configures).
    cache = LRU(1 << 40)

    def fill_all() -> None:
        for key, data, sha in objects:
            cache.put(str(key), store._decode_object(data, sha))

    _, heap = _measured(fill_all)
    assert 1 / 1.5 <= cache.nbytes / heap <= 1.5, (cache.nbytes, heap)


@pytest.mark.parametrize("source", ["checkpoint", "rebuilt"])
def test_memoized_cumulative_tokens_are_counted_within_1_5x_of_the_measured_heap(source: str) -> None:
    """Memoized cumulative tokens are int objects of their own (a checkpoint's decoded ids, or a
    rebuilt chain once its entries are evicted): counted at 8 bytes per token, a cache of them held
    about 3.6x its ``cache_bytes`` (a scale breaker: 7.9 MiB counted, 28.5 MiB measured). They are
    packed now, and the count is the heap they hold."""
    from s3capture.objects import _decode_tokens
    from s3capture.records import encode_token_ids
    from s3capture.store import _packed_tokens

    ids = [1000 + (i * 7919) % 149_000 for i in range(20_000)]
    encoded = encode_token_ids(ids)

    def memo() -> Any:
        tokens = _decode_tokens(encoded) if source == "checkpoint" else [int(str(t)) for t in ids]
        assert tokens == ids
        return _packed_tokens(tokens)  # the source list is dropped, as after _memoize

    (packed, nbytes), heap = _measured(memo)
    assert list(packed) == ids
    assert 1 / 1.5 <= nbytes / heap <= 1.5, (nbytes, heap)
    assert nbytes <= 8 * len(ids) + 1024


def _shaped_entry(shape: str) -> TokenEntry:
    """Entries whose structure, not their text or token arrays, holds most of their heap."""
    import random

    from s3capture.records import coerce_entry

    rng = random.Random(shape)
    fields: dict[str, Any] = dict(
        rollout_id="r",
        model_call_id=f"c-{shape}",
        prompt_token_ids=[rng.randrange(1000, 150_000) for _ in range(500)],
        generation_token_ids=[rng.randrange(1000, 150_000) for _ in range(100)],
        generation_log_probs=[-rng.random() for _ in range(100)],
    )
    if shape == "moe_top8":  # vLLM's routed experts: tokens x layers x top-k expert ids
        fields["routed_experts"] = [[[rng.randrange(128) for _ in range(8)] for _ in range(48)] for _ in range(300)]
    elif shape == "moe_top1_generation_only":  # long prompt, routing of the generated tokens only
        fields["prompt_token_ids"] = [rng.randrange(1000, 150_000) for _ in range(30_000)]
        fields["routed_experts"] = [[[rng.randrange(128)] for _ in range(40)] for _ in range(600)]
    elif shape == "moe_top2":
        fields["routed_experts"] = [[[rng.randrange(64) for _ in range(2)] for _ in range(4)] for _ in range(1200)]
    elif shape == "many_small_items":
        fields["output_items"] = [{"type": "x", "i": i} for i in range(5000)]
    elif shape == "extra_short_strings":
        fields["token_texts"] = [rng.choice(["a", "bc", "def", " the", "\n"]) + str(i) for i in range(5000)]
    elif shape == "extra_floats":
        fields["scores"] = [rng.random() for _ in range(20_000)]
    elif shape == "small_token_ids":  # a byte-level vocabulary: Python shares ints up to 256
        fields["prompt_token_ids"] = [rng.randrange(256) for _ in range(5000)]
    elif shape == "cjk_text":
        text = "\u65e5\u672c\u8a9e" * 16_000
        fields["output_items"] = [{"type": "message", "content": [{"type": "output_text", "text": text}]}]
    elif shape == "output_text_logprobs":  # the Responses API's logprobs of an output_text part
        logprobs = [
            {
                "token": f"t{i}",
                "logprob": -rng.random(),
                "bytes": [116, 48 + i % 10],
                "top_logprobs": [{"token": f"u{j}", "logprob": -rng.random(), "bytes": [117]} for j in range(5)],
            }
            for i in range(300)
        ]
        fields["output_items"] = [
            {"type": "message", "content": [{"type": "output_text", "text": "x" * 300, "logprobs": logprobs}]}
        ]
    elif shape == "served_item_token_arrays":  # a vLLM server's output item, token arrays kept
        fields["output_items"] = [
            {"type": "reasoning", "id": "rs", "summary": []},
            {
                "type": "message",
                "id": "m",
                "content": [],
                "prompt_token_ids": [rng.randrange(1000, 150_000) for _ in range(3000)],
                "generation_token_ids": list(fields["generation_token_ids"]),
                "generation_log_probs": list(fields["generation_log_probs"]),
            },
        ]
    elif shape == "extra_wide_dict":
        fields["by_token"] = {f"k{i}": i + 1000 for i in range(20_000)}
    elif shape == "ascii_text":
        fields["output_items"] = [
            {"type": "message", "content": [{"type": "output_text", "text": "ab, [c]\n" * 25_000}]}
        ]
    else:
        raise AssertionError(shape)
    return coerce_entry(fields)


STRUCTURE_SHAPES = [
    "moe_top8",
    "moe_top2",
    "moe_top1_generation_only",
    "many_small_items",
    "extra_short_strings",
    "extra_floats",
    "small_token_ids",
    "cjk_text",
    "ascii_text",
    "output_text_logprobs",
    "served_item_token_arrays",
    "extra_wide_dict",
]


@pytest.mark.parametrize("shape", STRUCTURE_SHAPES)
def test_cache_estimate_counts_structure_within_1_5x(shape: str) -> None:
    """An audit (2026-12-03) found the estimate 3-7x low for MoE ``routed_experts`` (a list of 8
    small ints is about 120 bytes of heap for 26 of JSON) and for many small dicts, and 3.4x high
    for token ids Python shares: a cache of MoE entries held 3.15x its ``cache_bytes``."""
    store = S3TokenStore("s3://bucket/root")
    key, data, sha = _stored_object(store, _shaped_entry(shape))
    cache = LRU(1 << 40)
    _, heap = _measured(lambda: cache.put(str(key), store._decode_object(data, sha)))
    ratio = cache.nbytes / heap
    assert 1 / 1.5 <= ratio <= 1.5, f"{shape}: estimate {cache.nbytes} vs measured {heap} (x{ratio:.2f})"


def test_nested_heap_samples_large_containers_and_stops_at_depth() -> None:
    from s3capture.cache import nested_heap

    flat = list(range(1000, 101_000))
    assert 0.9 < nested_heap(flat) / (56 + 8 * len(flat) + 28 * len(flat)) < 1.1
    deep: Any = []
    for _ in range(5000):  # nesting far past the recursion a walk may use
        deep = [deep]
    assert nested_heap(deep) < 64 * 64
    # A tree of 16-wide lists 6 deep (16.8 million leaves, all below the sample size): the walk
    # opens at most 4,096 containers, not 1.1 million.
    leaf = list(range(1000, 1016))
    tree: Any = leaf
    for _ in range(5):
        tree = [tree] * 16
    import s3capture.cache as cache_module

    walk, calls = cache_module._walk, [0]

    def counted(*args: Any) -> int:
        calls[0] += 1
        return walk(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cache_module, "_walk", counted)
        estimate = nested_heap(tree)
    assert calls[0] <= 4096 * 17 + 1  # a container and its members; unbounded: 17.9 million
    assert estimate >= 56 + 8 * 16
    # Short keys of a small dict are shared by msgspec's decoder: only the dict itself counts.
    assert nested_heap({"k": None, "t": True}) == sys.getsizeof({"k": None, "t": True})
    # A writer's private copy may keep a caller's tuples: counted as lists are.
    routing = [[[7, 9] for _ in range(48)] for _ in range(100)]
    as_tuples = tuple(tuple(tuple(pair) for pair in layer) for layer in routing)
    assert 0.7 < nested_heap(as_tuples) / nested_heap(routing) <= 1.0  # a tuple header is 40 bytes, a list 56
    # Samples spread over a list whose members alternate: neither phase alone.
    alternating = [("x" * 1000 if i % 2 else "y") for i in range(32)]
    exact = 56 + 8 * 32 + sum(sys.getsizeof(member) for member in alternating)
    assert 0.67 < nested_heap(alternating) / exact < 1.5


def test_memoized_tokens_that_do_not_fit_64_bits_are_kept_and_counted() -> None:
    from s3capture.store import _packed_tokens

    tokens = [2**64 + i for i in range(1000)]
    (kept, nbytes), heap = _measured(lambda: _packed_tokens([t + 0 for t in tokens]))
    assert list(kept) == tokens
    assert 1 / 1.5 <= nbytes / heap <= 1.5, (nbytes, heap)


def test_estimate_never_falls_below_the_json_or_the_token_arrays() -> None:
    entry = simple_entry("r", "c", prompt=list(range(1000, 1500)), text="x" * 5000)
    payload = encode_entry(entry)
    assert entry_heap_estimate(entry, payload) == entry_heap_estimate(entry, len(payload))
    assert entry_heap_estimate(entry, payload) >= len(payload)
    assert entry_heap_estimate(entry, payload) >= 36 * 502 + 32 * 2
    # Short log probabilities leave "the rest" at zero, never negative.
    tiny = simple_entry("r", "c", generation=list(range(1000, 1400)), log_probs=[0.0] * 400)
    assert entry_heap_estimate(tiny, encode_entry(tiny)) >= 36 * 402 + 32 * 400


def test_call_key_map_estimate_is_within_1_5x_of_the_measured_heap() -> None:
    keys = CallKeys(max_rows=10**9, max_bytes=1 << 40)
    sha = "0123456789abcdef" * 4

    def fill() -> None:
        for r in range(50):
            rid = f"rollout-{r:04d}@attempt-1"
            for c in range(200):
                keys.add(rid, f"call-{c:05d}", f"log/e/{sha}/call-{c:05d}/{sha}.zst")

    _, heap = _measured(fill)
    assert len(keys) == 10_000
    assert 1 / 1.5 <= keys.nbytes / heap <= 1.5, (keys.nbytes, heap)


def test_call_key_map_is_bounded_by_rows_and_by_bytes_and_forgets_rollouts() -> None:
    by_rows = CallKeys(max_rows=1_000, max_bytes=1 << 40)
    by_bytes = CallKeys(max_rows=10**9, max_bytes=64 * 1024)
    for keys in (by_rows, by_bytes):
        for r in range(100):
            for c in range(50):
                keys.add(f"r{r}", f"c{c}", f"log/e/~/c{c}/{r:064x}.zst")
        assert keys.rows <= keys.max_rows and keys.nbytes <= keys.max_bytes
        # The most recent rollout is kept whole; the oldest went first.
        assert keys.get(("r99", "c49")) == (f"log/e/~/c49/{99:064x}.zst",)
        assert keys.get(("r0", "c0")) is None
        keys.forget("r99")
        assert keys.get(("r99", "c0")) is None
    # One rollout alone over the bound keeps its newest calls.
    one = CallKeys(max_rows=10, max_bytes=1 << 40)
    for c in range(25):
        one.add("r", f"c{c}", f"k{c}")
    assert len(one) == 10 and one.get(("r", "c24")) == ("k24",) and one.get(("r", "c0")) is None
    # Several payloads of one call are all kept, once each.
    two = CallKeys()
    for rel in ("a", "b", "a"):
        two.add("r", "c", rel)
    assert two.get(("r", "c")) == ("a", "b") and len(two) == 1
    two.forget("r")
    assert two.rows == 0 and two.nbytes == 0


# --------------------------------------------------------------------------- against a server


async def test_a_cold_resolve_memoizes_packed_tokens_and_counts_them(fresh):
    # The resolve of a delta continuation from a client that never saw the chain memoizes the
    # winner's cumulative tokens (here rebuilt from the checkpoint of call K and the deltas after it).
    import array

    from helpers import put_chain

    from s3capture.store import CHECKPOINT_EVERY

    turns, entries = await put_chain(fresh(), "r-memo", CHECKPOINT_EVERY + 3)
    resolver = fresh()
    resolution = await resolver.resolve("r-memo", next_request(turns[-1]))
    assert resolution.status == ParentResolutionStatus.RESOLVED, resolution
    memos = [stored for stored in resolver._cache._data.values() if stored.cumulative is not None]
    assert {tuple(s.cumulative) for s in memos} >= {
        tuple(turns[-1].cumulative),
        tuple(turns[CHECKPOINT_EVERY].cumulative),
    }
    for stored in memos:
        assert isinstance(stored.cumulative, array.array) and stored.cumulative.itemsize == 8
        assert stored.nbytes >= sys.getsizeof(stored.cumulative)
    assert resolver._cache.nbytes == sum(s.nbytes for s in resolver._cache._data.values())


@pytest.mark.all_transports
async def test_a_cache_of_moe_entries_holds_what_it_counts(fresh):
    """End to end on the server: a reader with a small ``cache_bytes`` freezes a rollout of MoE
    and logprob-heavy entries; the heap that clearing its cache frees is within 1.5x of what the
    cache counted (3.15x, then 3.4x for output-text logprobs, before the estimate counted
    structure)."""
    writer = fresh()
    shapes = ("moe_top8", "moe_top8", "moe_top2", "many_small_items", "small_token_ids", "output_text_logprobs")
    for position, shape in enumerate(shapes):
        entry = _shaped_entry(shape)
        entry.rollout_id = "r-moe"
        entry.model_call_id = f"{entry.model_call_id}-{position}"
        await writer.put(entry)
    cache_bytes = 4 * 2**20
    reader = fresh(cache_bytes=cache_bytes)
    gc.collect()
    tracemalloc.start()
    try:
        snapshot = await reader.freeze("r-moe")
        assert len(snapshot.entries) == len(shapes)
        del snapshot
        gc.collect()
        counted, held = reader._cache.nbytes, tracemalloc.get_traced_memory()[0]
        assert counted > 0
        reader._cache._data.clear()
        reader._cache.nbytes = 0
        gc.collect()
        freed = held - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 1 / 1.5 <= counted / freed <= 1.5, (counted, freed)


async def test_freeze_forgets_the_rollouts_call_keys_and_drop_forgets_its_fence_time(fresh):
    store = fresh(fence_grace=0.0)
    for c in range(3):
        await store.put(simple_entry("r-forget", f"c{c}", text=f"t{c}"))
    await store.put(simple_entry("r-other", "c0"))
    assert store._call_keys.get(("r-forget", "c1"))
    snapshot = await store.freeze("r-forget")
    assert store._call_keys.get(("r-forget", "c1")) is None
    assert store._call_keys.get(("r-other", "c0"))  # another rollout keeps its keys
    assert "r-forget" in store._fence_seen
    assert await store.drop("r-forget", snapshot.snapshot_id, snapshot.version)
    assert "r-forget" not in store._fence_seen
    await store.retire(["r-other"])
    assert store._call_keys.get(("r-other", "c0")) is None


async def test_a_snapshot_item_made_to_contain_itself_is_read_again(fresh):
    """A caller may turn a handed-out nested item into a cycle; the next hand-out cannot encode it
    to check it, so it GETs the entry again instead of raising or handing out the cycle."""
    store = fresh()
    await store.put(simple_entry("r-cycle", "c1"))
    expected = canonical(simple_entry("r-cycle", "c1"))
    first = await store.freeze("r-cycle")
    item = first.entries[0].output_items[0]
    item["self"] = item
    rec = await RequestRecorder.attach(store)
    again = await store.freeze("r-cycle")
    assert canonical(again.entries[0]) == expected
    entry_gets = [key for key in rec.keys("GetObject") if not key.endswith("/retired")]
    assert len(entry_gets) == 1  # the entry, read again (beside the retire tombstone's GET)


async def test_snapshot_entries_share_nothing_the_clients_readers_use(fresh):
    """Freeze hands out cheap copies; mutating every part of them in place changes neither a later
    resolve (tokens, lineage) nor a later snapshot of the same client."""
    turns = build_conversation("r-lend", 2)
    store = fresh()
    await store.put(turn_entry("r-lend", turns[0]))
    await store.put(turn_entry("r-lend", turns[1]))
    expected = {e.model_call_id: canonical(e) for e in (turn_entry("r-lend", t) for t in turns)}
    first = await store.freeze("r-lend")
    for entry in first.entries:
        entry.prompt_token_ids[0] = 999_999
        entry.generation_token_ids.append(7)
        entry.generation_log_probs.clear()
        entry.output_items[0]["content"][0]["text"] = "mutated"
        entry.output_items.append({"type": "x"})
        entry.extra_fields["added"] = 1
        entry.digest = "0" * 64
    resolution = await store.resolve("r-lend", next_request(turns[-1]))
    assert resolution.status == ParentResolutionStatus.RESOLVED
    assert list(resolution.match.cumulative_token_ids) == turns[-1].cumulative
    for _ in range(2):
        again = await store.freeze("r-lend")
        assert {e.model_call_id: canonical(e) for e in again.entries} == expected
        assert (again.snapshot_id, again.version) == (first.snapshot_id, first.version)
    # The re-fetched or re-decoded copies are independent of each other too.
    third = await store.freeze("r-lend")
    third.entries[0].output_items.clear()
    assert canonical(again.entries[0]) == expected[again.entries[0].model_call_id]
    # A copy handed out to a repeat freeze (nested parts decoded from their checked encoding) shares
    # nothing with the cache either: mutating its nested items changes no later snapshot, and the
    # cache keeps serving (no GET of an entry: its nested parts were never lent out).
    third.entries[1].output_items[0]["content"][0]["text"] = "mutated again"
    third.entries[1].extra_fields["added"] = 2
    rec = await RequestRecorder.attach(store)
    fourth = await store.freeze("r-lend")
    assert {e.model_call_id: canonical(e) for e in fourth.entries} == expected
    # the fence, the LIST with the retire tombstone's GET, and the LIST after its last key that
    # confirms its end
    assert rec.counts() == {"PutObject": 1, "ListObjectsV2": 2, "GetObject": 1}, rec.counts()
    assert all(key.endswith("/retired") for key in rec.keys("GetObject")), rec.keys("GetObject")
