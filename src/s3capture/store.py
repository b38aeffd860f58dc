"""The S3 implementation of ``TokenSink``, ``TokenSource`` and ``LineageResolver``.

Contracts: ``shared/spec/protocols-reference.txt`` (NeMo Gym's token-capture protocols). The
design, every request an operation issues and every race that remains without compare-and-swap are
written down in ``docs/design.md``; the bucket layout is in ``s3capture.layout``. The pieces this
module builds on each have one home: the S3 transport and its verified listing
(``s3capture.transport``), the rollout scan, fences, retire and delete (``s3capture.rollouts``),
the cache (``s3capture.cache``) and the local spill (``s3capture.spill``).

Usage::

    store = S3TokenStore("s3://bucket/capture")       # credentials and AWS_ENDPOINT_URL from the environment
    await store.begin_call(rollout_id, call_id)       # optional custody intent, before generation
    await store.put(entry)                            # one round trip; durable and visible on return
    resolution = await store.resolve(rollout_id, request_items)
    snapshot = await store.freeze(rollout_id)
    await store.drop(rollout_id, snapshot.snapshot_id, snapshot.version)
    await store.close()

Offline, with read-only credentials (GET and LIST: ``docs/permissions.md``)::

    async for info in store.rollouts("frozen"):        # one streaming LIST of the root
        snapshot = await store.read_snapshot(info.rollout_id)   # what freeze returned, unchanged since
"""

from __future__ import annotations

import collections
import math
import os
import threading
from typing import Any

from s3capture.cache import CallKeys
from s3capture.errors import ListingError, SnapshotNotSealedError, StoreError, install_hint
from s3capture.objects import CHAIN_KEYS, CHECKPOINT_EVERY
from s3capture.objects import _Envelope  # noqa: F401 - re-exported: tools/bench_cpu.py imports it from here
from s3capture.rollouts import RolloutInfo, parse_s3_url
from s3capture.store_core import _packed_tokens  # noqa: F401 - re-exported: tests/test_memory.py imports it
from s3capture.store_lifecycle import _StoreLifecycle
from s3capture.store_lineage import _StoreLineage
from s3capture.store_snapshots import FrozenSnapshot, _StoreSnapshots
from s3capture.store_writes import _StoreWrites
from s3capture.transport import default_botocore_config

__all__ = [
    "S3TokenStore",
    "FrozenSnapshot",
    "StoreError",
    "ListingError",
    "SnapshotNotSealedError",
    "RolloutInfo",
    "parse_s3_url",
    "default_botocore_config",
    "CHAIN_KEYS",
    "CHECKPOINT_EVERY",
]


MAX_ENTRY_BYTES_ENV = "S3CAPTURE_MAX_ENTRY_BYTES"
DEFAULT_MAX_ENTRY_BYTES = 256 * 1024 * 1024


def _max_entry_bytes_from_environment() -> int | float:
    """``S3CAPTURE_MAX_ENTRY_BYTES`` (a number of bytes, ``16777216`` or ``16e6``), else 256 MiB;
    ``ValueError`` naming the variable for anything else."""
    value = os.environ.get(MAX_ENTRY_BYTES_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_ENTRY_BYTES
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{MAX_ENTRY_BYTES_ENV}={value!r} is not a number of bytes") from None
    if not 1 <= number < math.inf:
        raise ValueError(f"{MAX_ENTRY_BYTES_ENV}={value!r} must be a finite number of bytes >= 1")
    return number


class S3TokenStore(_StoreWrites, _StoreSnapshots, _StoreLifecycle, _StoreLineage):
    """NeMo Gym's ``TokenSink`` (plus ``begin_call``), ``TokenSource`` and ``LineageResolver`` on S3.

    Parameters:
        url: ``s3://bucket/prefix``; every key lives under the prefix.
        endpoint_url: S3 endpoint; defaults to ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``,
            then the AWS profile's ``endpoint_url`` (then AWS itself).
        botocore_config: a ``botocore.config.Config``; defaults to
            ``default_botocore_config(max(max_concurrency, 10))`` (a pool of that many connections).
        session: an ``aioboto3.Session``; defaults to one built from the standard credential chain.
        entry_type: ``"s3capture"`` (``s3capture.records.TokenEntry``) or ``"gym"`` (NeMo Gym's
            pydantic ``TokenEntry``) for entries handed back by ``freeze``.
        cache_bytes: bound on the estimated heap of decoded immutable objects kept in memory (bytes).
        max_concurrency: bound on requests in flight from this client (at most the pool size).
        compression_level: zstd level for stored entries (default 1: see ``docs/design.md``,
            "Encode CPU"; every level is readable by every reader).
        max_entry_bytes: largest canonical entry accepted by ``put`` or decoded by a reader
            (bytes, a finite number >= 1; ``TypeError`` / ``ValueError`` otherwise). ``None``
            (default): the environment variable ``S3CAPTURE_MAX_ENTRY_BYTES`` when set (how the
            command line's readers, export workers and Gym's YAML-built stores get one), else
            256 MiB. Decoding an entry takes up to about 9x its JSON bytes of memory (token ids
            become Python ints), and a zstd object of a few kilobytes can hold that much JSON:
            readers of a bucket others write to should set it to the largest entry their jobs
            write (``docs/design.md``, "Memory").
        transport: ``"aioboto3"`` (default), ``"obstore"`` (``pip install 's3capture[obstore]'``,
            2.3-3.9x less client CPU per capture call across the runs in ``docs/benchmarks.md``) or a
            ``s3capture.transport.Transport``;
            ``None`` reads ``S3CAPTURE_TRANSPORT``.
        spill_dir: a local directory where ``mark_incomplete`` durably spills markers it could not
            store; they are replayed after the next successful ``put`` or ``mark_incomplete`` (which
            waits at most 0.5 s for it), by ``replay_spill``, or at ``close`` (at most 10 s).
        fence_grace: seconds. A ``put`` slower than this reads the fence again after landing, and
            ``drop`` waits until ``fence_grace`` + 0.1 s have passed on this client's own monotonic
            clock (``CLOCK_BOOTTIME``) since it knew the fence existed, before its final LIST (no
            two machines' clocks are compared); together they close the stale-drop window (``docs/design.md``). Every client of
            a bucket must use the same value.
        probe_listing: for a store whose listings lag writes (``s3capture doctor``'s
            list-after-write check): ``retire``, ``delete`` and ``freeze`` first PUT an empty
            probe key under the rollout (``ledger/.probe/<32 hex>``; a freeze beside its fence)
            and list until the listing shows it, so they see every key written before the call.
            A removal deletes the probe with the rest (one more round trip); a freeze deletes it
            beside its manifest PUT (one more round trip only for a re-freeze of an unchanged
            rollout, whose manifest exists). Without it a first freeze is still fresh (its listing
            must show the fence it creates) but a re-freeze answers for the state up to the lag
            earlier. ``resolve`` has no probe (docs/reliability.md, "Listings that lag"). Needs
            DeleteObject on the probes (docs/permissions.md). Off by default.

    Every method raises ``ValueError`` (or ``TypeError``) for an id that cannot be stored, before
    any request, and ``StoreError`` when the store refuses an operation.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        botocore_config: Any = None,
        session: Any = None,
        entry_type: str = "s3capture",
        cache_bytes: int = 256 * 1024 * 1024,
        max_concurrency: int = 32,
        compression_level: int = 1,
        max_entry_bytes: int | float | None = None,
        spill_dir: str | os.PathLike | None = None,
        transport: str | Any = None,
        fence_grace: float = 1.0,
        probe_listing: bool = False,
    ) -> None:
        super().__init__(
            url,
            endpoint_url=endpoint_url,
            botocore_config=botocore_config,
            session=session,
            cache_bytes=cache_bytes,
            max_concurrency=max_concurrency,
            spill_dir=spill_dir,
            transport=transport,
        )
        if entry_type not in ("s3capture", "gym"):
            raise ValueError(f"entry_type must be 's3capture' or 'gym', got {entry_type!r}")
        if entry_type == "gym":
            try:
                import nemo_gym.token_id_capture.records  # noqa: F401 - fail early, before any request
            except ImportError as error:
                raise ImportError(
                    f"entry_type='gym' needs NeMo Gym's records ({error}): {install_hint('gym')}, then "
                    "pip install --no-deps --ignore-requires-python nemo-gym==0.7.0"
                ) from None
        self.entry_type = entry_type
        self._call_keys = CallKeys()
        """(rollout, call id) -> keys of its entries; bounded by rows and bytes, forgotten when the
        rollout is frozen, dropped, retired or deleted."""
        self._compression_level = compression_level
        self._compressors = threading.local()
        self._compressor()  # a bad level fails here, not in the first put
        if max_entry_bytes is None:
            max_entry_bytes = _max_entry_bytes_from_environment()
        if isinstance(max_entry_bytes, bool) or not isinstance(max_entry_bytes, (int, float)):
            raise TypeError(
                f"max_entry_bytes must be a number of bytes, got {type(max_entry_bytes).__name__} {max_entry_bytes!r}"
            )
        if not 1 <= max_entry_bytes < math.inf:  # below one byte every put is refused, every rollout masked
            raise ValueError(f"max_entry_bytes must be a finite number of bytes >= 1, got {max_entry_bytes!r}")
        self._max_entry_bytes = int(max_entry_bytes)  # 64e6 is a fine bound
        if isinstance(fence_grace, bool) or not isinstance(fence_grace, (int, float)):
            raise TypeError(
                f"fence_grace must be a number of seconds, got {type(fence_grace).__name__} {fence_grace!r}"
            )
        if not 0 <= fence_grace < math.inf:  # NaN would turn off drop's wait and the slow-put re-read
            raise ValueError(f"fence_grace must be a finite number of seconds >= 0, got {fence_grace!r}")
        self._fence_grace = fence_grace
        self._probe_listing = bool(probe_listing)
        self._fence_seen: collections.OrderedDict[str, tuple[float, int, str]] = collections.OrderedDict()
        """rollout id -> (``awake_clock()`` after this client's freeze's fence PUT returned, and
        that freeze's version and snapshot id); bounded. ``drop`` trusts the time only for that
        exact snapshot, so a stale record (the id deleted and reused by another client) is never
        used to shorten its wait."""
