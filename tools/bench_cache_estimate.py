#!/usr/bin/env python3
"""The cache's heap estimate against the heap it stands for, per entry shape.

For each shape (real example rollouts, synthetic entries of several sizes, and shapes whose
structure rather than their text holds the heap: MoE ``routed_experts``, many small output items,
long CJK / emoji / ASCII text, 20,000 floats in an extra field, small token ids), every entry is
encoded and stored as a reader gets it (zstd object), then decoded into an ``LRU`` through the
reader's path (``S3TokenStore._decode_object``) under tracemalloc. Printed: the cache's own count
(``entry_heap_estimate``), the heap tracemalloc measured, their ratio (target: within 1.5x both
ways, which ``tests/test_memory.py`` asserts for the same kinds of shape), and the estimate's CPU
per entry beside the decode's. No S3 server is needed.

Usage::

    python tools/bench_cache_estimate.py          # about 10 s
    python tools/bench_cache_estimate.py --quick  # the small shapes only (smoke test)
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import time
import tracemalloc
from typing import Any

import _benchcommon
from s3capture.cache import LRU, entry_heap_estimate
from s3capture.records import TokenEntry, coerce_entry, decode_canonical_entry, encode_entry
from s3capture.store import S3TokenStore


def _measured(build: Any) -> int:
    gc.freeze()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        build()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.unfreeze()


def _shapes(quick: bool) -> dict[str, list[TokenEntry]]:
    rng = random.Random(1)

    def entry(cid: str, prompt: int = 1000, **fields: Any) -> TokenEntry:
        base: dict[str, Any] = dict(
            rollout_id="r",
            model_call_id=cid,
            prompt_token_ids=[rng.randrange(150_000) for _ in range(prompt)],
            generation_token_ids=[rng.randrange(150_000) for _ in range(200)],
            generation_log_probs=[-rng.random() for _ in range(200)],
        )
        return coerce_entry({**base, **fields})

    def text_item(text: str) -> list[dict]:
        return [{"type": "message", "content": [{"type": "output_text", "text": text}]}]

    shapes = {
        "MoE routing 1,200 tok x 48 layers x top-8": [
            entry(
                "re", routed_experts=[[[rng.randrange(128) for _ in range(8)] for _ in range(48)] for _ in range(1200)]
            )
        ],
        "MoE routing 1,200 tok x 4 layers x top-2": [
            entry(
                "re2", routed_experts=[[[rng.randrange(64) for _ in range(2)] for _ in range(4)] for _ in range(1200)]
            )
        ],
        "5,000 small output items": [entry("od", output_items=[{"type": "x", "i": i} for i in range(5000)])],
        "500 message items": [
            entry(
                "od2",
                output_items=[
                    {
                        "type": "message",
                        "role": "assistant",
                        "id": f"msg_{i}",
                        "content": [{"type": "output_text", "text": "hello there " * 5, "annotations": []}],
                    }
                    for i in range(500)
                ],
            )
        ],
        "CJK text, 48,000 chars": [entry("cjk", output_items=text_item("\u65e5\u672c\u8a9e" * 16_000))],
        "emoji text, 20,000 chars": [entry("emo", output_items=text_item("\U0001f600" * 20_000))],
        "ASCII text, 200 KB": [entry("asc", output_items=text_item("abc def\n" * 25_000))],
        "ASCII text of commas and brackets, 200 KB": [entry("csv", output_items=text_item("1,2,[3],{4}," * 16_000))],
        "20,000 floats in an extra field": [entry("fl", scores=[rng.random() for _ in range(20_000)])],
        "1-token prompt": [entry("tiny", prompt=1)],
        "5,000 token ids under 256": [entry("small", prompt_token_ids=[rng.randrange(256) for _ in range(5000)])],
    }
    for i, (n, g) in enumerate([(16, 8), (64, 32), (200, 100), (1100, 512), (8000, 1024), (30000, 2048)]):
        shapes[f"synthetic {n:,} + {g:,} tokens"] = [
            _benchcommon.synthetic_entry(n, generation_tokens=g, seed=i, call_id=f"c{i}")
        ]
    if quick:
        del shapes["MoE routing 1,200 tok x 48 layers x top-8"]
    for name in (
        ("competitive_coding", "hermes_math") if quick else ("competitive_coding", "anyterminal_hermes", "hermes_math")
    ):
        entries = _benchcommon.replay_entries(name)
        shapes[f"{name} (real, {len(entries)} entries in one cache)"] = entries
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small shapes only (smoke test)")
    args = parser.parse_args()
    started, load = time.perf_counter(), _benchcommon.load_average()
    print("# bench_cache_estimate\n")
    print(_benchcommon.machine_summary())
    print(f"load average at start: {load}\n")
    store = S3TokenStore("s3://bucket/root")  # decoding only: no request is sent
    rows = []
    worst = 1.0
    for name, entries in _shapes(args.quick).items():
        objects = []
        for e in entries:
            payload = encode_entry(e)
            sha = hashlib.sha256(payload).hexdigest()
            prefix = store.layout.rollout(e.rollout_id)
            key = prefix + store.layout.entry_rel(prefix, e.continuation_fingerprint, e.model_call_id, sha)
            objects.append((key, store._encode_object(payload, ()), sha, payload))
        cache = LRU(1 << 40)

        def fill(cache: LRU = cache, objects: list = objects) -> None:
            for key, data, sha, _ in objects:
                cache.put(str(key), store._decode_object(data, sha))

        heap = _measured(fill)
        ratio = cache.nbytes / heap
        worst = max(worst, ratio, 1 / ratio)
        decoded = [(decode_canonical_entry(p), p) for _, _, _, p in objects]
        repeat = max(1, 2000 // len(decoded))
        t0 = time.process_time()
        for _ in range(repeat):
            for d, p in decoded:
                entry_heap_estimate(d, p)
        estimate_us = (time.process_time() - t0) / repeat / len(decoded) * 1e6
        t0 = time.process_time()
        for _, p in decoded:
            decode_canonical_entry(p)
        decode_us = (time.process_time() - t0) / len(decoded) * 1e6
        verdict = "yes" if 1 / 1.5 <= ratio <= 1.5 else "NO"
        rows.append(
            [name, f"{cache.nbytes:,}", f"{heap:,}", f"{ratio:.2f}", verdict, f"{estimate_us:.1f}", f"{decode_us:.1f}"]
        )
    header = [
        "entries",
        "estimate B",
        "heap B",
        "estimate ÷ heap",
        "within 1.5x",
        "estimate µs/entry",
        "decode µs/entry",
    ]
    print(_benchcommon.table(header, rows))
    print(f"\nworst ratio (either way): {worst:.2f}x; target: at most 1.5x")
    print(_benchcommon.total_line(started, load))


if __name__ == "__main__":
    main()
