"""Rollout prefixes: the scan, version and snapshot-id derivation, fences, retire and delete.

``RolloutObjects`` is the base of ``S3TokenStore`` and ``S3CaptureLedger``: both keep a rollout's
objects under ``rollouts/<rid>/`` (``s3capture.layout``) and share its fence and removal rules.
It also owns the client-side pieces both need: the transport (``s3capture.transport``), the cache
(``s3capture.cache``) and the local spill (``s3capture.spill``).

Removal rules (``docs/design.md``): no *write* path ever deletes a key. Objects are deleted only
by ``retire``, ``delete`` and ``drop``, and only keys that a verified listing of the rollout's own
prefix returned.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from s3capture.cache import LRU
from s3capture.errors import StoreError
from s3capture.layout import Layout, is_checkpoint_rel, parse_log_key
from s3capture.protocols import RolloutRemovalPayload
from s3capture.spill import Spill
from s3capture.transport import ListedObject, ListPage, Transport, make_transport

__all__ = ["RolloutObjects", "RolloutScan", "parse_s3_url", "FENCE_FROZEN", "FENCE_RETIRED"]

log = logging.getLogger("s3capture")

FENCE_FROZEN = b'{"format":"s3capture.fence/1","state":"frozen"}'
FENCE_RETIRED = b'{"format":"s3capture.fence/1","state":"retired"}'


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into ``(bucket, prefix)``; raises ``ValueError`` otherwise.

    Control characters are refused: URL parsing silently drops tabs and newlines, which would
    store everything under a different prefix than the one configured."""
    bad = next((c for c in url if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(f"an s3:// URL may not contain control characters ({bad!r} in {url!r})")
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"expected an s3://bucket/prefix URL, got {url!r}")
    if parsed.query or parsed.fragment:
        raise ValueError(f"an s3:// URL takes no query or fragment: {url!r}")
    return parsed.netloc, parsed.path.strip("/")


@dataclass
class RolloutScan:
    """What a verified LIST of one rollout prefix shows."""

    prefix: str
    fence: bool = False
    retired: bool = False
    """The retire tombstone (``retired``) exists."""
    drops: list[ListedObject] = field(default_factory=list)
    """Tentative tombstones of drops in progress (``drop/<token>``); a leftover one (a drop that
    crashed) reads as retired."""
    log: list[ListedObject] = field(default_factory=list)
    parsed: list[tuple[str, str, str, str]] = field(default_factory=list)
    """``parse_log_key`` of each key of ``log`` (same order): every key is parsed once, here."""
    snaps: list[ListedObject] = field(default_factory=list)
    foreign: list[ListedObject] = field(default_factory=list)
    checkpoints: list[ListedObject] = field(default_factory=list)
    """Delta checkpoints (``cum/<digest>.zst``): derived from entries, so outside the version and
    the snapshot id, but removed with the rest."""
    seen_at: float = 0.0
    """``time.monotonic()`` when the listing returned (this client's clock)."""

    @property
    def records(self) -> list[ListedObject]:
        """Every object a retire removes: log, manifests, foreign keys, drop tombstones and checkpoints."""
        return self.log + self.snaps + self.foreign + self.drops + self.checkpoints

    @property
    def all_keys(self) -> list[str]:
        keys = [item.key for item in self.records]
        if self.fence:
            keys.append(self.prefix + "fence")
        if self.retired:
            keys.append(self.prefix + "retired")
        return keys

    def version_and_id(self) -> tuple[int, str]:
        """``version`` = number of log and foreign objects; ``snapshot_id`` = digest of their keys.

        s3capture's log keys name their content (an entry's key holds the SHA-256 of its canonical
        bytes; intents and markers are empty), so their ETags, which depend on the writer's zstd
        level and build, stay out of the id. Foreign objects contribute their ETag too.
        """
        hasher = hashlib.sha256(b"s3capture.snapshot/2\n")
        for item in sorted(self.log, key=lambda i: i.key):
            hasher.update(f"{item.key[len(self.prefix):]}\n".encode())
        for item in sorted(self.foreign, key=lambda i: i.key):
            hasher.update(f"{item.key[len(self.prefix):]}\t{item.etag}\n".encode())
        return len(self.log) + len(self.foreign), hasher.hexdigest()[:32]


class RolloutObjects:
    """Client plumbing and rollout fences shared by ``S3TokenStore`` and ``S3CaptureLedger``."""

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
        transport: str | Transport | None = None,
    ) -> None:
        self.bucket, prefix = parse_s3_url(url)
        self.url = url
        self.layout = Layout(prefix)
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self.transport = make_transport(
            transport,
            self.bucket,
            endpoint_url=self.endpoint_url,
            botocore_config=botocore_config,
            session=session,
            max_concurrency=max_concurrency,
        )
        self._cache = LRU(cache_bytes)
        self._spill_dir = os.fspath(spill_dir) if spill_dir is not None else None
        self._spill_file = (
            Spill(self._spill_dir, endpoint=self.endpoint_url, bucket=self.bucket, root=self.layout.root)
            if self._spill_dir is not None
            else None
        )

    # ------------------------------------------------------------------ transport shorthands
    @property
    def request_counts(self) -> Any:
        """HTTP requests sent by this client, by S3 operation (retries included)."""
        return self.transport.request_counts

    @property
    def _client(self) -> Any:
        """Whether an HTTP client is open (``None`` until the first request)."""
        return True if self.transport.opened else None

    async def _s3(self) -> Any:
        """The underlying client of the running loop (aiobotocore's, or obstore's store and the
        listing session); opens it. Request hooks belong on ``transport.add_hook``."""
        return await self.transport.client()

    async def _put(self, key: str, body: bytes) -> None:
        await self.transport.put(key, body)

    async def _get(self, key: str, limit: int | None = None) -> bytes | None:
        return await self.transport.get(key, limit)

    async def _list(self, prefix: str, *, require: Iterable[str] = ()) -> list[ListedObject]:
        return await self.transport.list(prefix, require=require)

    async def _list_page(self, prefix: str, max_keys: int = 1000, token: str | None = None) -> ListPage:
        return await self.transport.list_page(prefix, max_keys, token)

    async def _delete_keys(self, keys: list[str]) -> None:
        if keys:
            await self.transport.delete(keys)

    async def _delete_one(self, key: str) -> None:
        await self.transport.delete_one(key)

    async def close(self) -> None:
        """Replay spilled objects (best effort), wait for requests in flight, release the HTTP
        client. Idempotent. After it returns nothing is open and nothing more lands."""
        if self._spill_file is not None and self.transport.opened and not self.transport.closed:
            try:
                await self.replay_spill()
            except Exception:  # noqa: BLE001 - replay is best effort at close; the spill file stays
                log.warning("could not replay spilled objects at close", exc_info=True)
        await self.transport.close()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def is_process_shared(self) -> bool:
        """True: every client of the bucket sees every committed entry."""
        return True

    # ------------------------------------------------------------------ local spill
    def _spill(self, key: str, body: bytes = b"") -> None:
        """Append one object to the local spill (fsynced); see ``s3capture.spill``."""
        assert self._spill_file is not None
        self._spill_file.append(key, body)

    async def replay_spill(self) -> int:
        """Store the objects spilled by earlier failures; returns how many were replayed.

        The spill file belongs to this client's ``(endpoint, bucket, prefix)`` and is shared by
        every client of it on this host, token stores and ledgers alike. What cannot be stored is
        spilled again. Raises ``StoreError`` when the store still fails.
        """
        spill = self._spill_file
        if spill is None or not spill.pending():
            return 0
        claims = spill.claim()
        if not claims:
            return 0
        try:
            objects = spill.read(claims)
        except BaseException:
            for claim in claims:
                claim.lock.close()  # leave the claims for the next replay
            raise
        stored = False
        try:
            await asyncio.gather(*(self._put(key, body) for key, body in objects.items()))
            stored = True
        finally:
            if not stored:
                try:
                    for key, body in objects.items():  # keep them; duplicates are harmless
                        spill.append(key, body)
                except BaseException:
                    for claim in claims:
                        claim.lock.close()
                    raise
            for claim in claims:
                claim.release()
        return len(objects)

    def _spill_on_cancel(self, key: str, body: bytes, what: str) -> None:
        """A write the caller cancelled may or may not have landed: spill it (synchronously,
        fsynced) so that it lands for sure; replaying an object that did land is a no-op."""
        if self._spill_file is None:
            log.error("%s was cancelled before the store answered and no spill_dir is set: it may be lost", what)
            return
        self._spill(key, body)
        log.warning("%s was cancelled; spilled to %s for replay", what, self._spill_dir)

    async def _replay_spill_quietly(self) -> None:
        """After a successful write: the store answers again, so spilled objects must not wait."""
        if self._spill_file is not None and self._spill_file.pending():
            try:
                await self.replay_spill()
            except Exception:  # noqa: BLE001 - the spill stays for the next replay
                log.warning("spilled objects could not be replayed yet", exc_info=True)

    # ------------------------------------------------------------------ rollout fences and removal
    async def _scan(self, rollout_id: str, *, require: Iterable[str] = ()) -> RolloutScan:
        """One verified listing of the rollout, split by kind. ``require``: keys (relative to the
        rollout prefix) that this client has just written; a listing without them is retried,
        then ``ListingError``."""
        prefix = self.layout.rollout(rollout_id)
        listing = await self._list(prefix, require=[prefix + rel for rel in require])
        scan = RolloutScan(prefix, seen_at=time.monotonic())
        for item in listing:
            rel = item.key[len(prefix):]
            if rel == "fence":
                scan.fence = True
            elif rel == "retired":
                scan.retired = True
            elif rel.startswith("drop/") and rel.count("/") == 1 and len(rel) > 5:
                scan.drops.append(item)
            elif rel.startswith("snap/"):
                scan.snaps.append(item)
            elif rel.startswith("log/") and (parsed := parse_log_key(rel)) is not None:
                scan.log.append(item)
                scan.parsed.append(parsed)
            elif rel.startswith("cum/") and is_checkpoint_rel(rel):
                scan.checkpoints.append(item)
            else:
                scan.foreign.append(item)
        return scan

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

    async def _write_retired(self, prefix: str) -> None:
        # Tombstone first, then the fence: a freeze whose frozen fence lands between or after them
        # lists afterwards, sees the tombstone and restores the retired fence.
        await self._put(prefix + "retired", b"")
        await self._put(prefix + "fence", FENCE_RETIRED)

    async def _retire_scanned(self, scan: RolloutScan) -> None:
        await self._write_retired(scan.prefix)
        await self._delete_keys([i.key for i in scan.records])
        self._cache.discard_prefix(scan.prefix)

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and keep a fence, whatever their state (idempotent).

        Returns ``{"removed": [...], "absent": [...]}``: removed are ids that had records or an
        unretired fence (including refused late writes a retired rollout kept, which no reader uses);
        absent are ids with nothing to remove (never written, or retired already).
        Later writes to a retired rollout raise ``TokenCaptureRetiredError``. Contract:
        ``TokenSource.retire`` / ``CaptureLedger.retire`` in the protocol reference. Raises
        ``ValueError``/``TypeError`` for unstorable ids and ``StoreError`` when the store fails.
        """
        ids = self._check_ids(rollout_ids)
        removed: list[str] = []
        absent: list[str] = []

        async def one(rollout_id: str) -> None:
            scan = await self._scan(rollout_id)
            had = bool(scan.records) or (scan.fence and not scan.retired)
            await self._retire_scanned(scan)
            (removed if had else absent).append(rollout_id)

        await self._each(ids, one)
        return {"removed": [r for r in ids if r in set(removed)], "absent": [r for r in ids if r in set(absent)]}

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and fences, after which an id reads as unused (idempotent).

        Returns ``{"removed": [...], "absent": [...]}`` (absent: nothing was stored for the id).
        Records go first and the fence and tombstone last, so a crash mid-delete leaves a fenced
        rollout that a second ``delete`` finishes. Raises ``StoreError`` when the store fails.
        """
        ids = self._check_ids(rollout_ids)
        removed: set[str] = set()

        async def one(rollout_id: str) -> None:
            scan = await self._scan(rollout_id)
            keys = scan.all_keys
            if keys:
                fences = [scan.prefix + "fence", scan.prefix + "retired"]
                await self._delete_keys([k for k in keys if k not in fences])
                await self._delete_keys([k for k in keys if k in fences])
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


__all__ += ["StoreError"]
