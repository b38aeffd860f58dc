#!/usr/bin/env python3
"""Client CPU of the put-side encode against NeMo Gym's canonical path, and bytes per token per zstd level.

One run, no S3, everything interleaved on the same entries:

* **Encode CPU per entry** (``time.process_time``; each cell is the median of ``--repeats`` repeats of
  at least ``--target`` CPU seconds, the paths rotated between repeats). s3capture's whole put-side
  encode is what ``S3TokenStore.put`` does before its requests: validate the entry and take a
  private copy, canonical bytes, SHA-256 of them (the object's key), envelope and zstd
  (``records.prepare_entry`` + ``hashlib.sha256`` + ``S3TokenStore._encode_object``), for an
  s3capture ``TokenEntry``, a Gym pydantic ``TokenEntry`` (what Gym's capture path hands a sink) and
  a dict. The peer is Gym's canonical path on Gym's own entry: ``model_dump(mode="json")`` +
  ``orjson.dumps(OPT_SORT_KEYS)`` + SHA-256 (what Gym's file store does before its write). "before"
  is the encode of the previous release (general coerce + ``encode_entry`` + SHA-256 + zstd 3).
* **Bytes per token per zstd level**: the size of the object ``put`` stores (envelope + zstd) at
  levels 1 and 3, zstd's fast levels -1 and -5, and with a 64 KiB dictionary trained on other
  entries (the anyterminal_hermes and hermes_math examples and synthetic entries of other seeds),
  with the CPU of that compression.

* **Read-side decode CPU per entry**: what every reader (freeze, resolve, export) does with a
  stored entry object: ``records.decode_canonical_entry`` (decode, proven canonical) against its
  reference (``decode_entry`` + ``encode_entry(entry) == bytes``) and against Gym's pydantic
  ``model_validate_json`` of the same bytes (peer: how Gym's own store reads an entry); the whole
  object (decompress + SHA-256 + decode, ``S3TokenStore._decode_object``); and Gym's token digest
  of the entry's tokens packed with ``struct.pack`` (before) and ``array`` (``compute_digest``).

Workloads: the real ``competitive_coding`` entries (real token ids and log probabilities), and
synthetic 8k- and 32k-token entries (Zipf-like ids, float32-shaped log probabilities, text items).

Usage::

    python tools/bench_encode.py            # about 2 minutes on 2 cores
    python tools/bench_encode.py --quick    # a few seconds (smoke test)
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson
import zstandard
from _benchcommon import (
    load_average,
    machine_summary,
    n_tokens,
    replay_entries,
    result_line,
    synthetic_entry,
    table,
    rotated_medians,
    time_path,
    total_line,
)
from nemo_gym.token_id_capture.records import TokenEntry as GymTokenEntry

from s3capture.records import (
    _DIGEST_DOMAIN,
    _coerce_general,
    compute_digest,
    decode_canonical_entry,
    decode_entry,
    encode_entry,
    prepare_entry,
)
from s3capture.store import S3TokenStore

GYM_PATH = "Gym canonical path: model_dump(json) + orjson + SHA-256 (peer)"


def gym_canonical(entry: Any) -> str:
    return hashlib.sha256(orjson.dumps(entry.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)).hexdigest()


def each(fn: Callable[[Any], Any], items: list[Any]) -> Callable[[], None]:
    """A path that runs ``fn`` once on every item."""

    def run() -> None:
        for item in items:
            fn(item)

    return run


def make_paths(
    entries: list[Any], stores: dict[str, S3TokenStore], dictionary: zstandard.ZstdCompressionDict
) -> dict[str, Callable[[], None]]:
    """Path name -> a function running that path once over every entry."""
    canon = [encode_entry(e) for e in entries]
    dicts = [orjson.loads(b) for b in canon]
    gyms = [GymTokenEntry.model_validate(d) for d in dicts]
    for source in (entries, gyms, dicts):  # the paths must produce Gym's bytes, or the timing means nothing
        assert [prepare_entry(x)[1] for x in source] == canon
    assert [orjson.dumps(g.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS) for g in gyms] == canon
    default, level3 = stores["default"], stores["level 3"]
    with_dict = dict_compressor(dictionary, 1)

    def put_encode(source: list[Any], store: S3TokenStore) -> Callable[[], None]:
        def run() -> None:
            for entry in source:
                _, payload = prepare_entry(entry)
                hashlib.sha256(payload).hexdigest()
                store._encode_object(payload, ())

        return run

    def before() -> None:  # the previous release: coerce (general path) + encode_entry + SHA-256 + zstd 3
        for entry in entries:
            payload = encode_entry(_coerce_general(entry))
            hashlib.sha256(payload).hexdigest()
            level3._encode_object(payload, ())

    return {
        GYM_PATH: each(gym_canonical, gyms),
        "s3capture put encode, s3capture TokenEntry (zstd 1, default)": put_encode(entries, default),
        "s3capture put encode, Gym pydantic TokenEntry (zstd 1)": put_encode(gyms, default),
        "s3capture put encode, dict (zstd 1)": put_encode(dicts, default),
        "s3capture put encode, s3capture TokenEntry (zstd 3)": put_encode(entries, level3),
        "before: general coerce + encode_entry + SHA-256 + zstd 3": before,
        "  step: prepare_entry (validate + copy + canonical bytes)": each(prepare_entry, entries),
        "  step: SHA-256 of the canonical bytes": each(lambda b: hashlib.sha256(b).hexdigest(), canon),
        "  step: envelope + zstd 1": each(lambda b: default._encode_object(b, ()), canon),
        "  step: envelope + zstd 3": each(lambda b: level3._encode_object(b, ()), canon),
        "  step: zstd 1 with a trained 64 KiB dictionary": each(with_dict.compress, canon),
    }


def bench_cpu(
    workloads: dict[str, list[Any]], stores: dict[str, S3TokenStore], dictionary: Any, repeats: int, target: float
) -> tuple[list[list[Any]], dict[str, float]]:
    rows: list[list[Any]] = []
    headline: dict[str, float] = {}
    for name, entries in workloads.items():
        paths = make_paths(entries, stores, dictionary)
        medians, timed = rotated_medians(paths, repeats, target, per=len(entries))
        peer = medians[GYM_PATH]
        tokens = sum(map(n_tokens, entries)) / len(entries)
        for path in paths:
            ratio = "1.00x (peer)" if path == GYM_PATH else f"{medians[path] / peer:.2f}x"
            rows.append([name, path, timed[path], medians[path] * 1e6, medians[path] * 1e9 / tokens, ratio])
        headline[name] = medians["s3capture put encode, s3capture TokenEntry (zstd 1, default)"] / peer
    return rows, headline


READ_PEER = "Gym: TokenEntry.model_validate_json of the canonical bytes (peer)"


def _reference_read(data: bytes) -> Any:
    entry = decode_entry(data)
    if encode_entry(entry) != data:
        raise AssertionError("not canonical")
    return entry


def _struct_digest(ids: list[int]) -> str:
    import struct

    return hashlib.sha256(_DIGEST_DOMAIN + struct.pack(f">BQ{len(ids)}Q", 1, len(ids), *ids)).hexdigest()


def read_paths(entries: list[Any], store: S3TokenStore) -> dict[str, Callable[[], None]]:
    """Path name -> a function running that read path once over every entry."""
    canon = [encode_entry(e) for e in entries]
    objects = [(store._encode_object(b, ()), hashlib.sha256(b).hexdigest()) for b in canon]
    tokens = [[*e.prompt_token_ids, *e.generation_token_ids] for e in entries]
    assert [decode_canonical_entry(b).model_dump() for b in canon] == [_reference_read(b).model_dump() for b in canon]
    assert [compute_digest(t) for t in tokens] == [_struct_digest(t) for t in tokens]

    return {
        READ_PEER: each(GymTokenEntry.model_validate_json, canon),
        "decode_canonical_entry (the read path)": each(decode_canonical_entry, canon),
        "before: decode_entry + encode_entry == bytes (the reference)": each(_reference_read, canon),
        "whole object: decompress + SHA-256 + decode_canonical_entry": each(
            lambda o: store._decode_object(*o), objects
        ),
        "digest of prompt + generation, array (compute_digest)": each(compute_digest, tokens),
        "digest of prompt + generation, struct.pack (before)": each(_struct_digest, tokens),
    }


def bench_read(
    workloads: dict[str, list[Any]], store: S3TokenStore, repeats: int, target: float
) -> tuple[list[list[Any]], dict[str, float]]:
    rows: list[list[Any]] = []
    headline: dict[str, float] = {}
    for name, entries in workloads.items():
        paths = read_paths(entries, store)
        medians, _ = rotated_medians(paths, repeats, target, per=len(entries))
        peer = medians[READ_PEER]
        reference = medians["before: decode_entry + encode_entry == bytes (the reference)"]
        for path in paths:
            ratio = "1.00x (peer)" if path == READ_PEER else f"{medians[path] / peer:.2f}x"
            rows.append([name, path, medians[path] * 1e6, ratio, f"{medians[path] / reference:.2f}x"])
        headline[name] = medians["decode_canonical_entry (the read path)"] / reference
    return rows, headline


READ_HEADERS = ["entries", "path", "µs/entry", "÷ Gym read (peer)", "÷ reference check"]


CPU_HEADERS = ["entries", "path", "entries timed", "µs/entry", "ns/token", "÷ Gym canonical"]


def bench_bytes(
    workloads: dict[str, list[Any]], dictionary: Any, target: float, summary: dict[str, Any] | None = None
) -> list[list[Any]]:
    rows = []
    for name, entries in workloads.items():
        canon = [encode_entry(e) for e in entries]
        envelopes = [S3TokenStore("s3://bench/x")._encode_object(b, ()) for b in canon]
        raw = [zstandard.ZstdDecompressor().decompress(e) for e in envelopes]  # the uncompressed envelope
        tokens = sum(map(n_tokens, entries))
        compressors = {
            "zstd 1 (default)": zstandard.ZstdCompressor(level=1),
            "zstd 3 (before)": zstandard.ZstdCompressor(level=3),
            "zstd 1 + trained dictionary": dict_compressor(dictionary, 1),
            "zstd 3 + trained dictionary": dict_compressor(dictionary, 3),
            # zstd's fast levels: cheaper than level 1, but each gives up the bytes target
            # (<= 1.1x zstd 3) on entries with log probabilities (docs/benchmarks.md).
            "zstd -1 (fast)": zstandard.ZstdCompressor(level=-1),
            "zstd -5 (fast)": zstandard.ZstdCompressor(level=-5),
        }
        sizes = {label: sum(len(c.compress(r)) for r in raw) for label, c in compressors.items()}
        base = sizes["zstd 3 (before)"]
        if summary is not None:
            summary[name] = {
                "default_bytes_per_token": sizes["zstd 1 (default)"] / tokens,
                "before_bytes_per_token": base / tokens,
                "ratio": sizes["zstd 1 (default)"] / base,
            }
        for label, compressor in compressors.items():

            def run(c: Any = compressor) -> None:
                for r in raw:
                    c.compress(r)

            run()
            cpu = statistics.median(time_path(run, target)[0] for _ in range(3)) / len(raw)
            rows.append([name, label, sizes[label] / tokens, f"{sizes[label] / base:.3f}x", cpu * 1e6])
        rows.append(
            [name, "uncompressed envelope", sum(map(len, raw)) / tokens, f"{sum(map(len, raw)) / base:.3f}x", 0.0]
        )
    return rows


BYTES_HEADERS = ["entries", "compression", "stored B/token", "÷ zstd 3 (before)", "compress µs/entry"]


def train_dictionary(quick: bool) -> zstandard.ZstdCompressionDict:
    """A 64 KiB dictionary from entries that are not measured (other example files, other seeds)."""
    samples = [
        encode_entry(e)
        for name in ("anyterminal_hermes", "hermes_math")
        for e in replay_entries(name, limit=40 if quick else None)
    ]
    samples += [
        encode_entry(synthetic_entry(n, seed=100 + s, call_id=f"train-{s}"))
        for s in range(4 if quick else 16)
        for n in (2048, 8192)
    ]
    return zstandard.train_dictionary(64 * 1024, samples)


def dict_compressor(dictionary: zstandard.ZstdCompressionDict, level: int) -> zstandard.ZstdCompressor:
    """A compressor with ``dictionary`` precomputed for ``level`` (a precomputed dictionary fixes its level)."""
    own = zstandard.ZstdCompressionDict(dictionary.as_bytes())
    own.precompute_compress(level=level)
    return zstandard.ZstdCompressor(dict_data=own)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short timings (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per CPU cell (default 7)")
    parser.add_argument("--target", type=float, default=None, help="CPU seconds per repeat of a cell (default 0.2)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 7)
    args.target = args.target or (0.01 if args.quick else 0.2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_at_start = load_average()
    print(f"# bench_encode\n\nmachine: {machine_summary()}\nload average at start: {load_at_start}\n", flush=True)
    real = replay_entries("competitive_coding")
    workloads = {
        f"competitive_coding (real, {len(real)} entries, ~{sum(map(n_tokens, real)) // len(real):,} tok)": real,
        "synthetic 8k tok (4 entries)": [synthetic_entry(8192, seed=s, call_id=f"s8k-{s}") for s in range(4)],
        "synthetic 32k tok (2 entries)": [
            synthetic_entry(32768, generation_tokens=2048, seed=s, call_id=f"s32k-{s}") for s in range(2)
        ],
    }
    stores = {
        "default": S3TokenStore("s3://bench/encode"),
        "level 3": S3TokenStore("s3://bench/encode", compression_level=3),
    }
    dictionary = train_dictionary(args.quick)
    rows, headline = bench_cpu(workloads, stores, dictionary, args.repeats, args.target)
    print(
        "### put-side encode CPU per entry (process_time, no S3)\n\n" + table(CPU_HEADERS, rows, digits=1) + "\n",
        flush=True,
    )
    read_rows, read_headline = bench_read(workloads, stores["default"], args.repeats, args.target)
    print(
        "### read-side decode CPU per entry (process_time, no S3)\n\n"
        + table(READ_HEADERS, read_rows, digits=1)
        + "\n",
        flush=True,
    )
    bytes_summary: dict[str, Any] = {}
    rows = bench_bytes(workloads, dictionary, args.target / 4, bytes_summary)
    print(
        "### stored bytes per token and compression CPU per zstd level\n\n"
        + table(BYTES_HEADERS, rows, digits=2)
        + "\n",
        flush=True,
    )
    print(
        "put encode of an s3capture TokenEntry ÷ Gym's canonical path: "
        + ", ".join(f"{k.split(' (')[0]} {v:.2f}x" for k, v in headline.items())
    )
    print(
        "read path (decode_canonical_entry) ÷ the reference check: "
        + ", ".join(f"{k.split(' (')[0]} {v:.2f}x" for k, v in read_headline.items())
    )
    print(result_line("bench_encode", {"encode_ratio": headline, "read_ratio": read_headline, "bytes": bytes_summary}))
    print(total_line(started, load_at_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
