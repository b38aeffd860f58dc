"""The S3 implementation of ``TokenSink``, ``TokenSource`` and ``LineageResolver``.

Contracts: ``shared/spec/protocols-reference.txt`` (NeMo Gym's token-capture protocols). The
design, every request an operation issues and every race that remains without compare-and-swap are
written down in ``docs/design.md``; the bucket layout is in ``s3capture.layout``.

Usage::

    store = S3TokenStore("s3://bucket/capture")       # credentials and AWS_ENDPOINT_URL from the environment
    await store.begin_call(rollout_id, call_id)       # optional custody intent, before generation
    await store.put(entry)                            # one round trip; durable and visible on return
    resolution = await store.resolve(rollout_id, request_items)
    snapshot = await store.freeze(rollout_id)
    await store.drop(rollout_id, snapshot.snapshot_id, snapshot.version)
    await store.close()
"""

from __future__ import annotations

import asyncio
import base64
import collections
import email.utils
import fcntl
import glob
import hashlib
import io
import json
import logging
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import msgspec
import zstandard
from botocore import handlers as botocore_handlers
from botocore.exceptions import BotoCoreError, ClientError

from s3capture import fingerprint as _fp
from s3capture.layout import Layout, escape_id, parse_log_key
from s3capture.protocols import (
    LineageMatch,
    LineageResolution,
    RolloutRemovalPayload,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenCaptureSnapshot,
)
from s3capture.records import (
    ParentResolutionStatus,
    RecordError,
    TokenEntry,
    coerce_entry,
    compute_digest,
    decode_entry,
    encode_entry,
    to_gym,
)

__all__ = ["S3TokenStore", "FrozenSnapshot", "StoreError", "parse_s3_url", "default_botocore_config"]

log = logging.getLogger("s3capture")

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ENVELOPE_FORMAT = "s3capture.entry/1"
_MANIFEST_FORMAT = "s3capture.manifest/1"
_FENCE_FROZEN = b'{"format":"s3capture.fence/1","state":"frozen"}'
_FENCE_RETIRED = b'{"format":"s3capture.fence/1","state":"retired"}'
def _heap_estimate(entry: TokenEntry, json_bytes: int) -> int:
    """Estimated Python heap of a decoded entry: ~36 bytes per token id (int object and list slot),
    ~32 per float, and ~3 per byte of the rest of its JSON (measured). The cache counts this, so
    ``cache_bytes`` bounds heap rather than JSON bytes."""
    ids = len(entry.prompt_token_ids) + len(entry.generation_token_ids)
    return 36 * ids + 32 * len(entry.generation_log_probs) + 3 * json_bytes
CHAIN_KEYS = 16
"""How many nearest ancestor keys a delta entry's envelope carries (bounded, so storage is O(1) per
entry; a chain deeper than this is rebuilt in one more round trip per ``CHAIN_KEYS`` ancestors)."""
_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
_NOT_IMPLEMENTED = frozenset(
    {"NotImplemented", "MethodNotAllowed", "501", "405", "MalformedXML", "MissingContentMD5", "InvalidDigest", "BadDigest"}
)


_BOTO_ERRORS = (BotoCoreError, ClientError)


class StoreError(RuntimeError):
    """The object store refused or failed an operation (missing bucket, access denied, ...)."""


@dataclass(frozen=True)
class FrozenSnapshot(TokenCaptureSnapshot):
    """A ``TokenCaptureSnapshot`` that also says why it is incomplete.

    ``reasons`` is a sorted tuple of strings such as ``"conflicting_payloads:<cid>"``,
    ``"dangling_intent:<cid>"``, ``"marked_incomplete:<cid>"``, ``"unreadable:<key>:<why>"``,
    ``"vanished:<key>"``, ``"misfiled:<key>"`` and ``"foreign_object:<key>"``; empty when complete.
    """

    reasons: tuple[str, ...] = ()


class _Envelope(msgspec.Struct, kw_only=True):
    """The stored object: canonical entry bytes plus the keys of its delta ancestors."""

    format: str
    entry: msgspec.Raw
    chain: list[str] = []


@dataclass
class _Stored:
    """A decoded entry object, immutable and therefore cacheable by key forever."""

    entry: TokenEntry
    chain: tuple[str, ...]
    nbytes: int
    cumulative: tuple[int, ...] | None = None
    """Memo of the entry's cumulative tokens once rebuilt (counted in ``nbytes``)."""


class _LRU:
    """A byte-bounded LRU of immutable decoded objects (key -> ``_Stored``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._data: collections.OrderedDict[str, _Stored] = collections.OrderedDict()

    def get(self, key: str) -> _Stored | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: str, value: _Stored) -> None:
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

    def grow(self, key: str, value: _Stored, extra: int) -> None:
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


@dataclass(frozen=True)
class _Listed:
    key: str
    etag: str
    size: int
    modified: float = 0.0
    """LastModified, seconds since the epoch (server clock, 1 s granularity on most stores)."""


@dataclass
class _RolloutScan:
    """What a LIST of one rollout prefix shows."""

    prefix: str
    server_time: float = 0.0
    """The store's clock (HTTP ``Date`` of the last LIST page), seconds since the epoch."""
    fence_modified: float = 0.0
    fence: bool = False
    retired: bool = False
    log: list[_Listed] = field(default_factory=list)
    snaps: list[_Listed] = field(default_factory=list)
    foreign: list[_Listed] = field(default_factory=list)

    @property
    def all_keys(self) -> list[str]:
        keys = [item.key for item in self.log + self.snaps + self.foreign]
        if self.fence:
            keys.append(self.prefix + "fence")
        if self.retired:
            keys.append(self.prefix + "retired")
        return keys

    def version_and_id(self) -> tuple[int, str]:
        """``version`` = number of log objects; ``snapshot_id`` = digest of sorted (key, ETag)."""
        hasher = hashlib.sha256(b"s3capture.snapshot/2\n")
        # s3capture's log keys name their content (an entry's key holds the SHA-256 of its
        # canonical bytes; intents and markers are empty), so their ETags, which depend on the
        # writer's zstd level and build, must not enter the id. Foreign objects keep theirs.
        for item in sorted(self.log, key=lambda i: i.key):
            hasher.update(f"{item.key[len(self.prefix):]}\n".encode())
        for item in sorted(self.foreign, key=lambda i: i.key):
            hasher.update(f"{item.key[len(self.prefix):]}\t{item.etag}\n".encode())
        return len(self.log) + len(self.foreign), hasher.hexdigest()[:32]


def _claimant_alive(claim: str) -> bool:
    """Whether the process named in a spill claim (``<file>.<pid>-<uuid>.replay``) still runs."""
    try:
        pid = int(claim.rsplit(".", 2)[-2].split("-", 1)[0])
        os.kill(pid, 0)
    except (ValueError, IndexError):
        return False
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _add_content_md5(request: Any, **_: Any) -> None:
    """Send Content-MD5 with DeleteObjects: botocore >= 1.36 sends only a CRC32, which stores
    that still require Content-MD5 (older MinIO, Ceph) refuse."""
    body = request.body if isinstance(request.body, bytes) else (request.body or b"")
    if isinstance(body, str):
        body = body.encode()
    if "Content-MD5" not in request.headers and isinstance(body, bytes):
        request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into ``(bucket, prefix)``; raises ``ValueError`` otherwise."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"expected an s3://bucket/prefix URL, got {url!r}")
    if parsed.query or parsed.fragment:
        raise ValueError(f"an s3:// URL takes no query or fragment: {url!r}")
    return parsed.netloc, parsed.path.strip("/")


def default_botocore_config(max_pool_connections: int = 64, **overrides: Any) -> Any:
    """The botocore ``Config`` s3capture uses unless given one.

    Standard retry mode (5 attempts, exponential backoff with jitter), connect/read timeouts of 5/30 s,
    a pool of ``max_pool_connections``, and checksums only where an operation requires them
    (``when_required``), which S3-compatible stores such as GCS, R2, Ceph and older MinIO accept.
    Path-style addressing is chosen when an endpoint is configured.
    """
    from botocore.config import Config

    settings: dict[str, Any] = dict(
        retries={"mode": "standard", "max_attempts": 5},
        connect_timeout=5,
        read_timeout=30,
        max_pool_connections=max_pool_connections,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    settings.update(overrides)
    return Config(**settings)


class _S3Objects:
    """Client plumbing shared by ``S3TokenStore`` and ``S3CaptureLedger``.

    One lazily opened aioboto3 client per instance, a bound on requests in flight, request
    counting, error wrapping, paged LIST, batched delete, and the rollout fence and removal
    operations (``retire``, ``delete``), which both families share because they share a layout.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        botocore_config: Any = None,
        session: Any = None,
        cache_bytes: int = 256 * 1024 * 1024,
        max_concurrency: int = 32,
        spill_dir: str | os.PathLike | None = None,
    ) -> None:
        self.bucket, prefix = parse_s3_url(url)
        self.url = url
        self.layout = Layout(prefix)
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if botocore_config is None:
            extra = {"s3": {"addressing_style": "path"}} if self.endpoint_url else {}
            botocore_config = default_botocore_config(max(max_concurrency, 10), **extra)
        self._config = botocore_config
        self._session = session
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self._max_concurrency = max_concurrency
        self._cache = _LRU(cache_bytes)
        self._spill_dir = os.fspath(spill_dir) if spill_dir is not None else None
        self._client: Any = None
        self._stack: AsyncExitStack | None = None
        self._client_lock: asyncio.Lock | None = None
        self._sem: asyncio.Semaphore | None = None
        self._closed = False
        self.request_counts: collections.Counter[str] = collections.Counter()
        """HTTP requests sent by this client, by S3 operation (retries included)."""

    # ------------------------------------------------------------------ client plumbing
    async def _s3(self) -> Any:
        if self._client is not None:
            return self._client
        if self._closed:
            raise StoreError("this S3TokenStore is closed")
        if self._client_lock is None:
            self._client_lock = asyncio.Lock()
        async with self._client_lock:
            if self._client is None:
                if self._session is None:
                    import aioboto3

                    self._session = aioboto3.Session()
                stack = AsyncExitStack()
                client = await stack.enter_async_context(
                    self._session.client("s3", endpoint_url=self.endpoint_url, config=self._config)
                )
                client.meta.events.register("before-send.s3", self._count_request)
                client.meta.events.register("before-sign.s3.DeleteObjects", _add_content_md5)
                # botocore asks for "Expect: 100-continue" on every PUT with a body, which costs a
                # whole extra round trip before the body is sent; entries are small and every PUT is
                # idempotent, so send the body at once.
                client.meta.events.unregister("before-call.s3", botocore_handlers.add_expect_header)
                self._sem = asyncio.Semaphore(self._max_concurrency)
                self._stack, self._client = stack, client
        return self._client

    def _count_request(self, event_name: str = "", **_: Any) -> None:
        self.request_counts[event_name.rsplit(".", 1)[-1]] += 1

    @staticmethod
    def _code(error: Exception) -> str:
        response = getattr(error, "response", None) or {}
        return str(response.get("Error", {}).get("Code", ""))

    def _wrap(self, error: Exception, what: str) -> Exception:
        code = self._code(error)
        if code == "NoSuchBucket":
            return StoreError(f"bucket {self.bucket!r} does not exist ({what})")
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StoreError(f"access to s3://{self.bucket} refused: {code} ({what})")
        return StoreError(f"{what} failed: {error}")

    async def _put(self, key: str, body: bytes) -> None:
        client = await self._s3()
        async with self._sem:  # type: ignore[union-attr]
            try:
                await client.put_object(Bucket=self.bucket, Key=key, Body=body)
            except Exception as error:
                if isinstance(error, _BOTO_ERRORS):
                    raise self._wrap(error, f"PUT {key}") from error
                raise

    async def _get(self, key: str, limit: int | None = None) -> bytes | None:
        """GET an object's bytes, or ``None`` when it does not exist.

        With ``limit``, raises ``RecordError`` instead of reading an object larger than ``limit`` bytes.
        """
        client = await self._s3()
        async with self._sem:  # type: ignore[union-attr]
            try:
                response = await client.get_object(Bucket=self.bucket, Key=key)
                async with response["Body"] as stream:
                    if limit is not None and int(response.get("ContentLength") or 0) > limit:
                        raise RecordError(f"object is {response['ContentLength']} bytes, over the read limit {limit}")
                    return await stream.read()
            except Exception as error:
                if self._code(error) in _NOT_FOUND:
                    return None
                if isinstance(error, _BOTO_ERRORS):
                    raise self._wrap(error, f"GET {key}") from error
                raise

    async def _list(self, prefix: str) -> list[_Listed]:
        """LIST every key under ``prefix`` (one request per 1,000 keys)."""
        return (await self._list_timed(prefix))[0]

    async def _list_page(self, prefix: str, max_keys: int = 1000, token: str | None = None) -> dict:
        """One ListObjectsV2 page of ``prefix`` (at most ``max_keys`` keys); raises ``StoreError``."""
        client = await self._s3()
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": max_keys}
        if token:
            params["ContinuationToken"] = token
        async with self._sem:  # type: ignore[union-attr]
            try:
                return await client.list_objects_v2(**params)
            except Exception as error:
                if isinstance(error, _BOTO_ERRORS):
                    raise self._wrap(error, f"LIST {prefix}") from error
                raise

    async def _list_timed(self, prefix: str) -> tuple[list[_Listed], float]:
        """LIST every key under ``prefix``; also return the store's clock from the last page."""
        out: list[_Listed] = []
        token: str | None = None
        server_time: float | None = None
        while True:
            page = await self._list_page(prefix, 1000, token)
            for item in page.get("Contents", ()):
                modified = item.get("LastModified")
                out.append(
                    _Listed(
                        item["Key"],
                        str(item.get("ETag", "")).strip('"'),
                        int(item.get("Size", 0)),
                        modified.timestamp() if modified is not None else 0.0,
                    )
                )
            if server_time is None:
                # The store's clock when the FIRST page was produced: no page of this LIST was
                # computed earlier than that.
                date = page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
                try:
                    server_time = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
                except (TypeError, ValueError):
                    server_time = time.time()
            if not page.get("IsTruncated"):
                return out, server_time
            token = page.get("NextContinuationToken")
            if not token:
                raise StoreError(f"LIST {prefix} was truncated without a continuation token")

    async def _delete_keys(self, keys: list[str]) -> None:
        """Delete keys with DeleteObjects in batches of 1,000, or one DELETE each where unsupported."""
        if not keys:
            return
        client = await self._s3()
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            try:
                async with self._sem:  # type: ignore[union-attr]
                    response = await client.delete_objects(
                        Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                    )
                errors = [e for e in response.get("Errors", ()) if e.get("Code") not in _NOT_FOUND]
                if errors:
                    raise StoreError(f"DeleteObjects failed for {len(errors)} keys, first: {errors[0]}")
            except StoreError:
                raise
            except _BOTO_ERRORS as error:
                if self._code(error) not in _NOT_IMPLEMENTED:
                    raise self._wrap(error, "DeleteObjects") from error
                await asyncio.gather(*(self._delete_one(k) for k in batch))

    async def _delete_one(self, key: str) -> None:
        client = await self._s3()
        async with self._sem:  # type: ignore[union-attr]
            try:
                await client.delete_object(Bucket=self.bucket, Key=key)
            except _BOTO_ERRORS as error:
                if self._code(error) not in _NOT_FOUND:
                    raise self._wrap(error, f"DELETE {key}") from error

    async def _fence_state(self, prefix: str) -> str:
        """``"open"``, ``"frozen"`` or ``"retired"`` from one GET of the rollout's fence."""
        body = await self._get(prefix + "fence")
        if body is None:
            return "open"
        try:
            state = json.loads(body).get("state")
        except (ValueError, AttributeError):
            state = None
        # An unreadable fence still fences: fail closed.
        return "retired" if state == "retired" else "frozen"

    async def close(self) -> None:
        """Release the HTTP client (after replaying spilled objects, best effort). Idempotent."""
        if self._spill_dir and self._client is not None and not self._closed:
            try:
                await self.replay_spill()
            except Exception:  # noqa: BLE001 - replay is best effort at close; the spill file stays
                log.warning("could not replay spilled objects at close", exc_info=True)
        self._closed = True
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def is_process_shared(self) -> bool:
        """True: every client of the bucket sees every committed entry."""
        return True

    # ------------------------------------------------------------------ local spill
    def _spill_path(self) -> str:
        assert self._spill_dir is not None
        return os.path.join(self._spill_dir, f"markers-{self.bucket}.jsonl")

    def _spill(self, key: str, body: bytes = b"") -> None:
        """Append one object (a marker, or a ledger failure row) to the spill file, locked and fsynced.

        A replay renames the file aside under the same lock; an appender that finds the path no
        longer names the file it locked reopens it, so no line lands in a claimed file.
        """
        os.makedirs(self._spill_dir, exist_ok=True)  # type: ignore[arg-type]
        path = self._spill_path()
        item = {"bucket": self.bucket, "key": key}
        if body:
            item["body"] = base64.b64encode(body).decode()
        line = json.dumps(item).encode() + b"\n"
        while True:
            with open(path, "ab") as handle:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
                try:
                    current = os.stat(path).st_ino
                except FileNotFoundError:
                    current = None
                if current != os.fstat(handle.fileno()).st_ino:
                    continue  # claimed by a replay meanwhile: write to the new file
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
                return

    def _claim_spill(self) -> list[str]:
        """Atomically take the spill file and any leftover claims; return the claimed paths."""
        path = self._spill_path()
        claimed: list[str] = []
        try:
            with open(path, "rb") as handle:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
                if os.path.exists(path) and os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                    name = f"{path}.{os.getpid()}-{uuid.uuid4().hex}.replay"
                    os.replace(path, name)
                    claimed.append(name)
        except FileNotFoundError:
            pass
        # Claims left by a replay whose process died: re-claim each by renaming it, so two
        # replayers never work on the same file. A live process's claim is its own business.
        for leftover in glob.glob(glob.escape(path) + ".*.replay"):
            if leftover in claimed or _claimant_alive(leftover):
                continue
            name = f"{path}.{os.getpid()}-{uuid.uuid4().hex}.replay"
            try:
                os.replace(leftover, name)
            except FileNotFoundError:
                continue
            claimed.append(name)
        return claimed

    async def replay_spill(self) -> int:
        """Store the objects spilled by earlier failures; returns how many were replayed.

        The spill file (``<spill_dir>/markers-<bucket>.jsonl``) is shared by every client of the
        bucket on this host, token stores and ledgers alike.
        """
        if not self._spill_dir:
            return 0
        if not os.path.exists(self._spill_path()) and not glob.glob(glob.escape(self._spill_path()) + ".*.replay"):
            return 0
        pending = self._claim_spill()
        objects: dict[str, bytes] = {}
        for name in pending:
            with open(name, "rb") as handle:
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        item = json.loads(line)
                        if item.get("bucket") == self.bucket and isinstance(item.get("key"), str):
                            objects[item["key"]] = base64.b64decode(item.get("body") or "")
                    except (ValueError, AttributeError, TypeError):
                        log.warning("skipping torn line %d of spill file %s", number, name)
        try:
            await asyncio.gather(*(self._put(key, body) for key, body in objects.items()))
        except BaseException:
            for key, body in objects.items():  # keep them for the next replay; duplicates are harmless
                self._spill(key, body)
            for name in pending:
                os.remove(name)
            raise
        for name in pending:
            os.remove(name)
        return len(objects)


    # ------------------------------------------------------------------ rollout fences and removal
    async def _scan(self, rollout_id: str) -> _RolloutScan:
        prefix = self.layout.rollout(rollout_id)
        listing, server_time = await self._list_timed(prefix)
        scan = _RolloutScan(prefix, server_time)
        for item in listing:
            rel = item.key[len(prefix):]
            if rel == "fence":
                scan.fence = True
                scan.fence_modified = item.modified
            elif rel == "retired":
                scan.retired = True
            elif rel.startswith("snap/"):
                scan.snaps.append(item)
            elif rel.startswith("log/") and parse_log_key(rel) is not None:
                scan.log.append(item)
            else:
                scan.foreign.append(item)
        return scan

    async def _write_retired(self, prefix: str) -> None:
        # Tombstone first, then the fence: a freeze whose frozen fence lands between or after them
        # lists afterwards, sees the tombstone and restores the retired fence.
        await self._put(prefix + "retired", b"")
        await self._put(prefix + "fence", _FENCE_RETIRED)

    async def _retire_scanned(self, scan: _RolloutScan) -> None:
        await self._write_retired(scan.prefix)
        await self._delete_keys([i.key for i in scan.log + scan.snaps + scan.foreign])
        self._cache.discard_prefix(scan.prefix)

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and keep a fence, whatever their state (idempotent).

        Returns ``{"removed": [...], "absent": [...]}``: removed are ids that had records or an
        unretired fence; absent are ids with nothing to remove (never written, or retired already).
        Later writes to a retired rollout raise ``TokenCaptureRetiredError``.
        """
        ids = self._check_ids(rollout_ids)
        removed: list[str] = []
        absent: list[str] = []

        async def one(rollout_id: str) -> None:
            scan = await self._scan(rollout_id)
            had = bool(scan.log or scan.snaps or scan.foreign) or (scan.fence and not scan.retired)
            await self._retire_scanned(scan)
            (removed if had else absent).append(rollout_id)

        await self._each(ids, one)
        return {"removed": [r for r in ids if r in set(removed)], "absent": [r for r in ids if r in set(absent)]}

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and fences, after which an id reads as unused (idempotent).

        Returns ``{"removed": [...], "absent": [...]}`` (absent: nothing was stored for the id).
        """
        ids = self._check_ids(rollout_ids)
        removed: set[str] = set()

        async def one(rollout_id: str) -> None:
            scan = await self._scan(rollout_id)
            keys = scan.all_keys
            if keys:
                fences = [scan.prefix + "fence", scan.prefix + "retired"]
                await self._delete_keys([k for k in keys if k not in fences])
                await self._delete_keys(fences)
                removed.add(rollout_id)
            self._cache.discard_prefix(scan.prefix)
            self._forget_rollout(rollout_id)

        await self._each(ids, one)
        return {"removed": [r for r in ids if r in removed], "absent": [r for r in ids if r not in removed]}

    def _forget_rollout(self, rollout_id: str) -> None:
        """Drop per-rollout client state after a delete (subclasses keep some)."""

    def _check_ids(self, rollout_ids: Sequence[str]) -> list[str]:
        if isinstance(rollout_ids, str):
            raise TypeError("rollout_ids must be a sequence of ids, not a single str")
        ids = list(dict.fromkeys(rollout_ids))
        for rollout_id in ids:
            self.layout.rollout(rollout_id)
        return ids

    async def _each(self, ids: Iterable[str], fn: Any) -> None:
        limit = asyncio.Semaphore(8)

        async def run(rollout_id: str) -> None:
            async with limit:
                await fn(rollout_id)

        await asyncio.gather(*(run(r) for r in ids))


class S3TokenStore(_S3Objects):
    """NeMo Gym's ``TokenSink`` (plus ``begin_call``), ``TokenSource`` and ``LineageResolver`` on S3.

    Parameters:
        url: ``s3://bucket/prefix``; every key lives under the prefix.
        endpoint_url: S3 endpoint; defaults to ``AWS_ENDPOINT_URL`` (then AWS itself).
        botocore_config: a ``botocore.config.Config``; defaults to ``default_botocore_config()``.
        session: an ``aioboto3.Session``; defaults to one built from the standard credential chain.
        entry_type: ``"s3capture"`` (``s3capture.records.TokenEntry``) or ``"gym"`` (NeMo Gym's
            pydantic ``TokenEntry``) for entries handed back by ``freeze``.
        cache_bytes: bound on the estimated heap of decoded immutable objects kept in memory (bytes).
        max_concurrency: bound on requests in flight from this client (at most the pool size).
        compression_level: zstd level for stored entries.
        max_entry_bytes: largest canonical entry accepted by ``put`` or decoded by a reader.
        spill_dir: a local directory where ``mark_incomplete`` durably spills markers it could not
            store; they are replayed by the next ``mark_incomplete``, ``replay_spill`` or ``close``.
        fence_grace: seconds. A ``put`` slower than this reads the fence again after landing, and
            ``drop`` waits until the fence is this old (by the store's clock) before its final
            LIST; together they close the stale-drop window (``docs/design.md``). Every client of
            a bucket must use the same value.

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
        compression_level: int = 3,
        max_entry_bytes: int = 256 * 1024 * 1024,
        spill_dir: str | os.PathLike | None = None,
        fence_grace: float = 1.0,
    ) -> None:
        super().__init__(
            url,
            endpoint_url=endpoint_url,
            botocore_config=botocore_config,
            session=session,
            cache_bytes=cache_bytes,
            max_concurrency=max_concurrency,
            spill_dir=spill_dir,
        )
        if entry_type not in ("s3capture", "gym"):
            raise ValueError(f"entry_type must be 's3capture' or 'gym', got {entry_type!r}")
        if entry_type == "gym":
            import nemo_gym.token_id_capture.records  # noqa: F401 - fail early with ImportError
        self.entry_type = entry_type
        self._call_keys: collections.OrderedDict[tuple[str, str], set[str]] = collections.OrderedDict()
        self._call_keys_limit = 200_000
        self._compressor = zstandard.ZstdCompressor(level=compression_level)
        self._max_entry_bytes = max_entry_bytes
        if fence_grace < 0:
            raise ValueError("fence_grace must be >= 0 seconds")
        self._fence_grace = fence_grace

    def _forget_rollout(self, rollout_id: str) -> None:
        for key in [k for k in self._call_keys if k[0] == rollout_id]:
            del self._call_keys[key]

    # ------------------------------------------------------------------ encoding
    def _encode_object(self, payload: bytes, chain: Sequence[str]) -> bytes:
        envelope = b'{"chain":' + msgspec.json.encode(list(chain)) + b',"entry":' + payload
        envelope += b',"format":"' + _ENVELOPE_FORMAT.encode() + b'"}'
        return self._compressor.compress(envelope)

    def _decompress(self, data: bytes) -> bytes:
        # The envelope adds its format tag and up to CHAIN_KEYS ancestor keys to the entry bytes.
        limit = self._max_entry_bytes + 64 * 1024
        if not data.startswith(_ZSTD_MAGIC):
            if len(data) > limit:
                raise RecordError(f"object is larger than max_entry_bytes={self._max_entry_bytes}")
            return data
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
        out = io.BytesIO()
        while True:
            chunk = reader.read(1 << 20)
            if not chunk:
                break
            out.write(chunk)
            if out.tell() > limit:
                raise RecordError(f"object decompresses beyond max_entry_bytes={self._max_entry_bytes}")
        return out.getvalue()

    def _decode_object(self, data: bytes, sha: str | None) -> _Stored:
        """Decode a stored entry object; raises ``RecordError`` for anything unreadable."""
        try:
            raw = self._decompress(data)
        except zstandard.ZstdError as error:
            raise RecordError(f"object is not valid zstd: {error}") from None
        chain: tuple[str, ...] = ()
        payload = raw
        if raw.startswith(b'{"chain":'):
            try:
                envelope = msgspec.json.decode(raw, type=_Envelope)
            except msgspec.DecodeError as error:
                raise RecordError(f"object is not an s3capture entry envelope: {error}") from None
            if envelope.format != _ENVELOPE_FORMAT:
                raise RecordError(f"unknown envelope format {envelope.format!r}")
            payload = bytes(envelope.entry)
            chain = tuple(envelope.chain)
        if len(payload) > self._max_entry_bytes:
            raise RecordError(f"entry is {len(payload)} bytes, over max_entry_bytes={self._max_entry_bytes}")
        if sha is not None and hashlib.sha256(payload).hexdigest() != sha:
            raise RecordError("stored entry bytes do not match the SHA-256 in their key")
        entry = decode_entry(payload)
        return _Stored(entry, chain, _heap_estimate(entry, len(payload)))

    def _remember(self, rollout_id: str, model_call_id: str, rel: str) -> None:
        key = (rollout_id, model_call_id)
        keys = self._call_keys.get(key)
        if keys is None:
            keys = self._call_keys[key] = set()
            while len(self._call_keys) > self._call_keys_limit:
                self._call_keys.popitem(last=False)
        else:
            self._call_keys.move_to_end(key)
        keys.add(rel)

    def _read_limit(self) -> int:
        # A zstd frame of incompressible data is at most a little larger than the data itself.
        return self._max_entry_bytes + self._max_entry_bytes // 64 + 128 * 1024

    async def _load(self, key: str, sha: str | None, size: int | None = None) -> _Stored | None:
        """The decoded object at ``key`` from the cache or one GET; ``None`` when absent.

        ``size`` (from a LIST) lets an oversize object be refused without reading it. Raises
        ``RecordError`` when the object is unreadable or oversize.
        """
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        limit = self._read_limit()
        if size is not None and size > limit:
            raise RecordError(f"object is {size} bytes, over what max_entry_bytes={self._max_entry_bytes} allows")
        data = await self._get(key, limit)
        if data is None:
            return None
        stored = self._decode_object(data, sha)
        self._cache.put(key, stored)
        return stored

    # ------------------------------------------------------------------ TokenSink
    async def put(self, entry: Any) -> None:
        """Durably store one ``TokenEntry`` (s3capture's, NeMo Gym's pydantic one, or a dict).

        One round trip: the content-addressed PUT and a GET of the rollout's fence in parallel.
        When it returns, the entry is durable and visible to every client's ``resolve`` and
        ``freeze``. A byte-identical retry rewrites the same key (a no-op); a different payload
        for the same call id lands beside it and readers see the conflict.

        Raises:
            RecordError: the entry violates the record contract or has non-finite log probabilities.
            ValueError: an id that cannot be stored, or an entry over ``max_entry_bytes``.
            TokenCaptureFrozenError: the rollout was frozen; the entry landed and bumped the version.
            TokenCaptureRetiredError: the rollout was retired; the entry is removed again.
            StoreError: the store failed the request.
        """
        # A validated copy: what we store is what every reader can decode, and a caller mutating
        # its entry after put cannot change our cached view of an immutable object.
        record = coerce_entry(entry)
        prefix = self.layout.rollout(record.rollout_id)
        payload = encode_entry(record)
        if len(payload) > self._max_entry_bytes:
            raise ValueError(
                f"entry {record.model_call_id!r} is {len(payload)} bytes, over max_entry_bytes={self._max_entry_bytes}"
            )
        sha = hashlib.sha256(payload).hexdigest()
        rel = self.layout.entry_rel(prefix, record.continuation_fingerprint, record.model_call_id, sha)
        chain: tuple[str, ...] = ()
        if record.prompt_is_delta:
            chain = await self._delta_chain(record, prefix)
        body = self._encode_object(payload, chain)
        key = prefix + rel
        started = time.monotonic()
        _, state = await asyncio.gather(self._put(key, body), self._fence_state(prefix))
        if state == "open" and time.monotonic() - started > self._fence_grace:
            # A slow put (retries, stalls) may have landed after a freeze's LIST although its fence
            # read came before the fence: read the fence again now that the entry has landed.
            state = await self._fence_state(prefix)
        self._cache.put(key, _Stored(record, chain, _heap_estimate(record, len(payload))))
        self._remember(record.rollout_id, record.model_call_id, rel)
        if self._spill_dir and os.path.exists(self._spill_path()):
            # The store answers again: markers spilled during an outage must not wait for close.
            try:
                await self.replay_spill()
            except Exception:  # noqa: BLE001 - the spill stays for the next replay
                log.warning("spilled markers could not be replayed yet", exc_info=True)
        if state == "retired":
            await self._delete_one(key)
            raise TokenCaptureRetiredError(
                f"rollout {record.rollout_id!r} is retired; the late entry {record.model_call_id!r} was discarded"
            )
        if state == "frozen":
            raise TokenCaptureFrozenError(
                f"rollout {record.rollout_id!r} is frozen; the late entry {record.model_call_id!r} landed and changed "
                "the version, so the consumed snapshot's conditional drop will fail and keep the evidence"
            )

    async def _delta_chain(self, record: TokenEntry, prefix: str) -> tuple[str, ...]:
        """Keys (relative to the rollout prefix) of a delta entry's ancestors, anchor first."""
        parent_id = record.parent_call_id or ""
        keys = self._call_keys.get((record.rollout_id, parent_id))
        if not keys:
            for item in await self._list(prefix + "log/e/"):
                parsed = parse_log_key(item.key[len(prefix):])
                if parsed is not None:
                    self._remember(record.rollout_id, parsed[1], item.key[len(prefix):])
            keys = self._call_keys.get((record.rollout_id, parent_id))
        if not keys or len(keys) != 1:
            raise RecordError(
                f"delta entry {record.model_call_id!r}: parent {parent_id!r} has "
                f"{'no' if not keys else 'conflicting'} stored entries, so its prompt cannot be reconstructed"
            )
        (parent_rel,) = keys
        parent = await self._load(prefix + parent_rel, parent_rel.rsplit("/", 1)[-1][:-4])
        if parent is None:
            raise RecordError(f"delta entry {record.model_call_id!r}: parent {parent_id!r} disappeared")
        if not parent.entry.prompt_is_delta:
            return (parent_rel,)
        return (*parent.chain, parent_rel)[-CHAIN_KEYS:]

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record a pre-dispatch intent for a model call (the custody extension).

        The intent is PUT first and the fence read after it lands, so a ``begin_call`` that returns
        is always seen by a later freeze's LIST: an intent with no entry at freeze masks the rollout.
        Raises ``TokenCaptureFrozenError`` / ``TokenCaptureRetiredError`` when the rollout is fenced
        (fail the model call before generation), ``ValueError`` for unstorable ids.
        """
        prefix = self.layout.rollout(rollout_id)
        key = prefix + "log/i/" + self.layout.check_call_id(prefix, model_call_id)
        await self._put(key, b"")
        state = await self._fence_state(prefix)
        if state == "retired":
            await self._delete_one(key)
            raise TokenCaptureRetiredError(f"rollout {rollout_id!r} is retired; do not dispatch {model_call_id!r}")
        if state == "frozen":
            raise TokenCaptureFrozenError(f"rollout {rollout_id!r} is frozen; do not dispatch {model_call_id!r}")

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Durably record that a call of this rollout failed to capture; the rollout is masked.

        One round trip: a PUT of a unique marker (so it always changes the version, also after
        freeze) and a GET of the fence. When the PUT fails and ``spill_dir`` is set, the marker is
        appended (fsynced) to a local spill file and replayed after the next successful marker or
        at ``close``, so ``put`` and ``mark_incomplete`` do not fail together.

        Raises:
            TokenCaptureRetiredError: the rollout is retired (the marker is removed again; there is
                no snapshot left to mask).
            StoreError: the store failed and no ``spill_dir`` is configured.
            ValueError: an id that cannot be stored.
        """
        prefix = self.layout.rollout(rollout_id)
        cid = self.layout.marker_call_segment(prefix, model_call_id)
        key = f"{prefix}log/x/{cid}/{time.time_ns():020d}-{uuid.uuid4().hex}"
        started = time.monotonic()
        stored, state = await asyncio.gather(self._put(key, b""), self._fence_state(prefix), return_exceptions=True)
        if not isinstance(stored, BaseException) and (state != "open" or time.monotonic() - started > self._fence_grace):
            # After a freeze a drop may be racing: only a fence read after landing tells whether the
            # marker could still invalidate the consumed snapshot.
            try:
                state = await self._fence_state(prefix)
            except Exception:  # noqa: BLE001 - the marker landed; a failed re-read must not fail it
                pass
        if isinstance(stored, BaseException):
            if not self._spill_dir or not isinstance(stored, Exception):
                raise stored
            self._spill(key)
            log.warning("mark_incomplete for %r spilled to %s: %s", rollout_id, self._spill_dir, stored)
            return
        if state == "retired":
            await self._delete_one(key)
            raise TokenCaptureRetiredError(f"rollout {rollout_id!r} is retired; its capture can no longer be marked")
        if self._spill_dir:
            try:
                await self.replay_spill()
            except Exception:  # noqa: BLE001 - the spill stays for the next replay
                log.warning("spilled markers could not be replayed yet", exc_info=True)

    # ------------------------------------------------------------------ TokenSource
    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze a rollout and return one atomic snapshot (idempotent across clients).

        Requests: PUT the fence, then one LIST page per 1,000 keys, one GET per entry not yet
        cached (in parallel), and one PUT of the sealed manifest unless it already exists.
        ``version`` is the number of log objects and ``snapshot_id`` a digest of their sorted keys
        and ETags, so two clients freezing the same state agree. The snapshot is ``incomplete`` when
        any call id has conflicting payloads, an intent has no entry, a marker exists, or any object
        is unreadable or foreign.

        Raises ``TokenCaptureRetiredError`` for a retired rollout (delete it to reuse the id).
        """
        prefix = self.layout.rollout(rollout_id)
        await self._put(prefix + "fence", _FENCE_FROZEN)
        scan = await self._scan(rollout_id)
        if scan.retired:
            await self._put(prefix + "fence", _FENCE_RETIRED)  # undo our overwrite of the retired fence
            raise TokenCaptureRetiredError(f"rollout {rollout_id!r} is retired; delete it before reusing the id")
        reasons: list[str] = []
        by_call: dict[str, dict[str, _Listed]] = collections.defaultdict(dict)
        intents: set[str] = set()
        for item in scan.log:
            kind, cid, fp, sha = parse_log_key(item.key[len(prefix):])  # type: ignore[misc]
            if kind == "e":
                by_call[cid][sha] = item
            elif kind == "i":
                intents.add(cid)
            else:
                reasons.append(f"marked_incomplete:{cid}")
        for item in scan.foreign:
            reasons.append(f"foreign_object:{item.key[len(prefix):]}")

        async def load(item: _Listed) -> tuple[_Listed, _Stored | None, str]:
            rel = item.key[len(prefix):]
            try:
                stored = await self._load(item.key, rel.rsplit("/", 1)[-1][:-4], item.size)
            except RecordError as error:
                return item, None, f"unreadable:{rel}:{error}"
            if stored is None:
                return item, None, f"vanished:{rel}"
            return item, stored, ""

        wanted = [item for variants in by_call.values() for item in variants.values()]
        loaded = await asyncio.gather(*(load(item) for item in wanted))
        payloads: dict[str, dict[str, _Stored]] = collections.defaultdict(dict)
        for item, stored, problem in loaded:
            rel = item.key[len(prefix):]
            _, cid, fp, sha = parse_log_key(rel)  # type: ignore[misc]
            if problem:
                reasons.append(problem)
                continue
            assert stored is not None
            if stored.entry.rollout_id != rollout_id or stored.entry.model_call_id != cid or (
                stored.entry.continuation_fingerprint != fp
            ):
                reasons.append(f"misfiled:{rel}")
                continue
            self._remember(rollout_id, cid, rel)
            payloads[cid][sha] = stored
        entries: list[TokenEntry] = []
        for cid in sorted(by_call):
            if len(by_call[cid]) > 1:
                reasons.append(f"conflicting_payloads:{cid}")
                continue
            if cid in payloads and len(payloads[cid]) == 1:
                entries.append(next(iter(payloads[cid].values())).entry)
        for cid in sorted(intents - set(by_call)):
            reasons.append(f"dangling_intent:{cid}")
        present = {entry.model_call_id for entry in entries}
        for entry in entries:
            if entry.prompt_is_delta and entry.parent_call_id not in present:
                # Its prompt is only a suffix: without the parent the chain has a hole.
                reasons.append(f"broken_chain:{entry.model_call_id}")
        version, snapshot_id = scan.version_and_id()
        reasons.sort()
        incomplete = bool(reasons)
        manifest_key = f"{prefix}snap/{version:020d}-{snapshot_id}"
        if all(item.key != manifest_key for item in scan.snaps):
            manifest = {
                "format": _MANIFEST_FORMAT,
                "rollout_id": rollout_id,
                "version": version,
                "snapshot_id": snapshot_id,
                "incomplete": incomplete,
                "reasons": reasons,
                "objects": [
                    {"key": i.key[len(prefix):], "etag": i.etag, "size": i.size}
                    for i in sorted(scan.log + scan.foreign, key=lambda i: i.key)
                ],
            }
            await self._put(manifest_key, msgspec.json.encode(manifest))
        if incomplete:
            log.info("rollout %r froze incomplete: %s", rollout_id, "; ".join(reasons[:5]))
        # Hand back copies: the cached objects stay immutable whatever the caller does with these.
        if self.entry_type == "gym":
            out: tuple[Any, ...] = tuple(to_gym(e) for e in entries)
        else:
            out = tuple(coerce_entry(e) for e in entries)
        return FrozenSnapshot(rollout_id, out, incomplete, snapshot_id, version, tuple(reasons))

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire the exact frozen snapshot that was consumed; False if anything changed since.

        Re-lists the rollout and retires it (fence kept, records deleted) only when the rollout is
        frozen and its current ``version`` and ``snapshot_id`` equal the arguments. When the fence
        is younger than ``fence_grace`` (+2 s for clock granularity and page production) it waits and lists again, so
        every acknowledged put is either in the snapshot or visible to that final LIST.
        """
        scan = await self._scan(rollout_id)
        while True:
            if not scan.fence or scan.retired:
                return False
            if scan.version_and_id() != (version, snapshot_id):
                return False
            # Both clocks are the store's and truncated to whole seconds (one second of slack), and
            # the first page's Date may trail the moment its listing was taken (one more second).
            wait = self._fence_grace + 2.0 - (scan.server_time - scan.fence_modified)
            if wait <= 0:
                break
            await asyncio.sleep(wait)
            scan = await self._scan(rollout_id)
        prefix = scan.prefix
        await self._write_retired(prefix)
        # A marker may land after our LIST and read the fence before it said retired (it must
        # succeed after freeze). Listing again after the retired fence catches every such marker.
        after = await self._scan(rollout_id)
        if after.version_and_id() != (version, snapshot_id):
            await self._put(prefix + "fence", _FENCE_FROZEN)
            await self._delete_one(prefix + "retired")
            return False
        await self._delete_keys([i.key for i in after.log + after.snaps + after.foreign])
        self._cache.discard_prefix(prefix)
        return True

    # ------------------------------------------------------------------ LineageResolver
    async def resolve(self, rollout_id: str, request_items: list[dict]) -> LineageResolution:
        """Return ROOT, RESOLVED (exactly one proven parent) or UNRESOLVED with a reason.

        Requests: one LIST of the request fingerprint's prefix and GETs of the candidates not yet
        cached (two round trips), plus GETs of the uncached ancestors of a delta winner. A call id
        with more than one payload under the fingerprint counts as zero candidates; candidates
        must match the recorded request context (``conversation_digest`` of the leading items);
        several candidates count as one only when their cumulative tokens are identical. Raises
        ``ValueError`` for an unstorable ``rollout_id``; malformed request items give UNRESOLVED.
        """
        prefix = self.layout.rollout(rollout_id)
        try:
            fingerprint = _fp.assistant_fingerprint(request_items)
        except Exception as error:  # noqa: BLE001 - any malformed request is UNRESOLVED, never a crash
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=f"malformed_request: {error}")
        if not fingerprint:
            return LineageResolution(ParentResolutionStatus.ROOT)
        listing = await self._list(f"{prefix}log/e/{escape_id(fingerprint)}/")
        by_call: dict[str, list[str]] = collections.defaultdict(list)
        sizes: dict[str, int] = {}
        for item in listing:
            parsed = parse_log_key(item.key[len(prefix):])
            if parsed is not None and parsed[0] == "e" and parsed[2] == fingerprint:
                by_call[parsed[1]].append(item.key)
                sizes[item.key] = item.size
        if not by_call:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="no_match")
        conflicted = sorted(cid for cid, keys in by_call.items() if len(keys) > 1)
        if conflicted:
            # A call id with several payloads is zero candidates, and it must not let another call
            # with the same model output win by elimination either: that would be a guess.
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="conflicting_payloads")
        singles = [keys[0] for cid, keys in by_call.items() if len(keys) == 1]

        async def load(key: str) -> _Stored | None:
            try:
                return await self._load(key, key.rsplit("/", 1)[-1][:-4], sizes.get(key))
            except RecordError:
                return None

        loaded = await asyncio.gather(*(load(k) for k in singles))
        if any(stored is None for stored in loaded):
            # An unreadable or vanished candidate might be the parent: never win by elimination.
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="unreadable_candidate")
        candidates: list[tuple[str, _Stored]] = []
        for key, stored in zip(singles, loaded):
            assert stored is not None
            entry = stored.entry
            if entry.rollout_id != rollout_id or entry.continuation_fingerprint != fingerprint:
                continue
            if entry.fingerprint_version is not None and entry.fingerprint_version != _fp.FINGERPRINT_VERSION:
                continue
            if not entry.continuation_context_digest or len(request_items) < entry.continuation_context_len:
                continue
            try:
                context = _fp.conversation_digest(request_items[: entry.continuation_context_len])
            except Exception as error:  # noqa: BLE001 - malformed request items: UNRESOLVED
                return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=f"malformed_request: {error}")
            if context != entry.continuation_context_digest:
                continue
            self._remember(rollout_id, entry.model_call_id, key[len(prefix):])
            candidates.append((key, stored))
        if len(candidates) > 1:
            shapes = {(s.entry.digest, s.entry.cum_len) for _, s in candidates}
            if len(shapes) == 1 and candidates[0][1].entry.digest:
                candidates = [min(candidates, key=lambda c: c[1].entry.model_call_id)]
        if len(candidates) != 1:
            reason = "ambiguous" if candidates else "no_match"
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=reason)
        key, stored = candidates[0]
        try:
            tokens = await self._cumulative(prefix, key, stored)
            digest = compute_digest(tokens)
        except (RecordError, ValueError) as error:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=f"unreadable_parent: {error}")
        entry = stored.entry
        if entry.digest and digest != entry.digest:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="digest_mismatch")
        return LineageResolution(
            ParentResolutionStatus.RESOLVED,
            match=LineageMatch(model_call_id=entry.model_call_id, cumulative_token_ids=tuple(tokens), digest=digest, prev_len=len(tokens)),
        )

    async def _cumulative(self, prefix: str, key: str, stored: _Stored) -> list[int]:
        """Cumulative tokens of an entry, rebuilding a delta prompt through its ancestors.

        A delta entry's envelope names its nearest ``CHAIN_KEYS`` ancestors (farthest first). Each
        round trip fetches one such window in parallel; the walk stops at the nearest ancestor whose
        cumulative tokens are memoized or at a full-prompt anchor. Every parent link is checked, a
        key seen twice (a forged cycle) or a chain over 100,000 calls is refused, and the rebuilt
        tokens must match the entry's digest. Raises ``RecordError`` for a missing or broken chain.
        """
        if stored.cumulative is not None:
            return list(stored.cumulative)
        if not stored.entry.prompt_is_delta:
            return [*stored.entry.prompt_token_ids, *stored.entry.generation_token_ids]
        # path: (key, stored) from the entry back towards the base, nearest first.
        path: list[tuple[str, _Stored]] = [(key, stored)]
        seen = {key}
        base: list[int] | None = None
        current = stored
        while base is None:
            if not current.chain:
                raise RecordError(f"delta entry {current.entry.model_call_id!r} carries no ancestor keys")
            keys = [prefix + rel for rel in current.chain]
            if seen.intersection(keys) or len(path) > 100_000:
                raise RecordError(f"delta chain of {stored.entry.model_call_id!r} is cyclic or too deep")
            ancestors = await asyncio.gather(*(self._load(k, k.rsplit("/", 1)[-1][:-4]) for k in keys))
            window: list[tuple[str, _Stored]] = []
            for ancestor_key, ancestor in zip(keys, ancestors):
                if ancestor is None:
                    raise RecordError(f"ancestor {ancestor_key} of {stored.entry.model_call_id!r} is missing")
                window.append((ancestor_key, ancestor))
            for nearer, farther in zip([current, *(a for _, a in reversed(window))], [a for _, a in reversed(window)]):
                if nearer.entry.parent_call_id != farther.entry.model_call_id:
                    raise RecordError(f"ancestor chain of {stored.entry.model_call_id!r} is broken at {farther.entry.model_call_id!r}")
            seen.update(keys)
            for ancestor_key, ancestor in reversed(window):
                if ancestor.cumulative is not None:
                    base = list(ancestor.cumulative)
                    break
                if not ancestor.entry.prompt_is_delta:
                    base = [*ancestor.entry.prompt_token_ids, *ancestor.entry.generation_token_ids]
                    break
                path.append((ancestor_key, ancestor))
            else:
                current = window[0][1]
        tokens = base
        for _, link in reversed(path):
            tokens.extend(link.entry.prompt_token_ids)
            tokens.extend(link.entry.generation_token_ids)
        if stored.entry.digest and compute_digest(tokens) != stored.entry.digest:
            raise RecordError(f"rebuilt tokens of {stored.entry.model_call_id!r} fail their digest")
        if stored.cumulative is None:
            stored.cumulative = tuple(tokens)
            self._cache.grow(key, stored, 8 * len(tokens))
        return tokens
