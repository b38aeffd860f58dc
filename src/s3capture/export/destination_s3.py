"""An ``s3://`` prefix as an export destination (``_S3Destination``): its claim (``CLAIM_LEASE``,
``CLAIM_RENEW``, ``CLAIM_HOLD``: taken with a PUT and a LIST, renewed, checked before drops and by
workers before they publish), its verified scan, one PUT per shard file, and the temp files of
killed exports in the system's temp folder (``remove_dead_exports_temp_files``)."""

from __future__ import annotations

import asyncio
import collections
import datetime as _dt
import logging
import os
import re
import tempfile
import uuid
from typing import Any

import msgspec

from s3capture import leftovers
from s3capture.clocks import awake_clock
from s3capture.errors import StoreError
from s3capture.export.destination_base import (
    _LOCK,
    _classify,
    _decode_manifest,
    _Destination,
    _Existing,
    _foreign,
    _manifest_names_of,
    _settle,
)
from s3capture.export.records import ShardManifest
from s3capture.transport import gather_fail_fast

_log = logging.getLogger("s3capture")
_RUN_TAGGED = re.compile(r"^part-[0-9]{5,}-[0-9a-f]{16}\.(?:parquet|jsonl)$")
"""A data file named with an ``s3://`` export's run tag (``lock``: ``uuid4().hex[:16]``)."""

_CLAIM_NAME = re.compile(r"[0-9a-f]+")
"""The name of an export's claim in ``<prefix>/.s3capture-export.lock/``: its run tag (``lock``), 32
hex digits in releases before the tag. Any other key there (the folder's own marker, which a
console's "Create folder" or ``rclone mkdir`` writes, or a key in a folder below it) is no claim:
read as one, it refused every export for ``CLAIM_LEASE`` seconds and was then deleted as a dead
export's (an audit, 2026-12-04)."""
_S3_TEMP_PREFIX = "s3capture-export-"
_S3_TEMP = re.compile(rf"^{_S3_TEMP_PREFIX}(?P<host>.+)-(?P<pid>[0-9]{{1,10}})-part-[0-9]{{5,}}.*\.tmp$")
"""A shard an export to an ``s3://`` destination writes in the system's temp folder before its
one PUT: ``s3capture-export-<host>.ns<PID namespace>-<pid>-part-NNNNN...tmp``
(``s3capture.leftovers.host_tag``)."""
_SCAN_BATCH = 32
"""Shard manifests a destination scan reads at a time: four times the destination transport's 8
requests in flight, and a bound on the bodies held at once (a manifest of 256 rollouts is tens of
KiB; one of a larger ``shard_rollouts`` grows with it)."""
_S3_TEMP_STALE = 3600.0
"""Seconds since its last write before a temp file of a dead process is removed: a margin on top
of the host and PID namespace in its name."""


def remove_dead_exports_temp_files(folder: str | None = None, *, stale_after: float = _S3_TEMP_STALE) -> list[str]:
    """Remove the temp files that exports to ``s3://`` destinations killed on this machine left
    in ``folder`` (default: the system's temp folder). A file goes only when all of these hold:
    it is a regular file this user owns, named for this host and PID namespace (a temp folder
    shared between machines or containers keeps the others' files), its process is gone, and
    nothing wrote it for ``stale_after`` seconds (``s3capture.leftovers.remove_dead``). Never
    raises: a file it cannot judge or remove stays. Returns the removed paths. Called when an
    export to an ``s3://`` destination starts."""
    folder = folder or tempfile.gettempdir()
    removed = leftovers.remove_dead(
        folder, _S3_TEMP, host=leftovers.host_tag(), stale_after=stale_after, directories=False
    )
    if removed:
        _log.info("removed %d temp file(s) of killed exports from %s", len(removed), folder)
    return removed


CLAIM_LEASE = 600.0
"""Seconds (by the store's clock) after its last renewal at which an ``s3://`` destination's claim
is stale: the export that wrote it is taken to be dead, and the next export takes the destination."""
CLAIM_RENEW = 30.0
"""Seconds between renewals of a live export's claim."""


CLAIM_HOLD = 300.0
"""Seconds after its last successful renewal at which an export stops dropping: it may have been
taken over. Well below ``CLAIM_LEASE``, so a paused export fences itself before another can start."""


class _S3Destination(_Destination):
    def __init__(
        self, url: str, *, endpoint_url: str | None, transport: str | None, session: Any = None, owner: str = ""
    ) -> None:
        from s3capture.rollouts import parse_s3_url
        from s3capture.transport import configured_endpoint, make_transport

        self.bucket, prefix = parse_s3_url(url)
        self.prefix = f"{prefix}/" if prefix else ""
        endpoint = configured_endpoint(endpoint_url)
        self.transport = make_transport(
            transport, self.bucket, endpoint_url=endpoint, session=session, max_concurrency=8
        )
        self._claim: str | None = None  # this export's claim of the prefix (``lock``), until ``close``
        self._claim_body = b""
        self._renewed = 0.0
        self._renewal: asyncio.Task | None = None
        self._lost: str | None = None
        self.tag = ""  # the claim's id (``lock``), also in this export's shard names
        self.owner = owner  # a worker's: the claim id of the export it works for ("" unchecked)

    @property
    def requests(self) -> collections.Counter:  # type: ignore[override]  # a property over the base's attribute
        return self.transport.request_counts

    async def scan(self) -> _Existing:
        """The destination's files, and which shards are durable. Every deletion the export then
        makes (an orphan data file, a broken manifest) rests on something this listing did not
        show, so the listing's end is confirmed (one more LIST) and each such absence is checked
        with a request of its own (a GET of the data file's manifest, a LIST of the manifest's data
        file): one listing that skipped a key, or said it was whole when it was not, deleted a
        durable shard, and with ``--drop`` its rows were lost for good (a breaker, 2026-12-02)."""
        existing = _Existing()
        listed = await self.transport.list(self.prefix, confirm_end=True)
        files = [
            (item.key[len(self.prefix) :], item.size) for item in listed if "/" not in item.key[len(self.prefix) :]
        ]
        tops = dict.fromkeys(
            rel if "/" not in rel else rel.split("/", 1)[0] + "/"
            for rel in (item.key[len(self.prefix) :] for item in listed)
            if rel  # the prefix's own folder marker ("exports/", from a console's "Create folder")
        )
        existing.foreign = [name for name in tops if _foreign(name.rstrip("/"), folder=name.endswith("/"))]
        manifest_names = _classify(sorted(files), existing)
        found: list[tuple[str, ShardManifest]] = []

        async def read(name: str) -> tuple[str, ShardManifest] | None:
            raw = await self.transport.get(self.prefix + name)
            if raw is None:  # removed since the listing: not durable any more
                return None
            return name, _decode_manifest(name, raw)

        # The shard manifests are read in parallel, a bounded batch at a time (the transport also
        # bounds the requests in flight; the first error cancels the rest of the batch): one after
        # another, a resumed export of 1,000 shards waited 1,000 round trips before its first rollout.
        for start in range(0, len(manifest_names), _SCAN_BATCH):
            batch = manifest_names[start : start + _SCAN_BATCH]
            found.extend(pair for pair in await gather_fail_fast(read(name) for name in batch) if pair is not None)
        listed_names = set(manifest_names)
        for data_file in existing.data_files:
            candidates = _manifest_names_of(data_file)
            if any(name in listed_names for name in candidates):
                continue
            for name in candidates:
                raw = await self.transport.get(self.prefix + name)
                if raw is not None:
                    _log.warning("the listing of %s did not show %s, which exists: kept", self.prefix or "/", name)
                    found.append((name, _decode_manifest(name, raw)))
                    break
        for _, manifest in found:
            named = manifest.data
            if named is not None and existing.sizes.get(named) != manifest.data_bytes:
                page = await self.transport.list_page(self.prefix + named, 1)
                for item in page.objects:
                    if item.key == self.prefix + named:
                        if named not in existing.sizes:
                            existing.data_files.append(named)
                        existing.sizes[named] = item.size
        _settle(existing, found)
        return existing

    async def lock(self) -> None:
        """Take the prefix for this export with a claim, without compare-and-swap.

        The export PUTs its own claim ``<prefix>/.s3capture-export.lock/<run id>``, then LISTs the
        claims (verified, and required to show its own). Any other claim (``_CLAIM_NAME``) renewed less than
        ``CLAIM_LEASE`` seconds before its own, both by the store's clock, means another export is
        alive: this one deletes its claim and raises ``ValueError``. Of two exports that start at
        once, the later PUT's LIST always sees the earlier claim (read-after-write and
        list-after-write consistency, which s3capture requires anyway; ``s3capture doctor`` checks
        them), so at most one proceeds; both may refuse, never both proceed. A claim older than the
        lease belongs to a dead export and is deleted. The claim is renewed every ``CLAIM_RENEW``
        seconds until ``close``; ``check_held`` fails once the last renewal is ``CLAIM_HOLD`` seconds old
        or the claim was taken over, so a paused export stops dropping before another can start.

        Requests: 1 PUT, 1 LIST, a DELETE per stale claim; then a GET and a PUT per renewal.
        Raises ``ValueError`` (another export holds the prefix), ``StoreError``.
        """
        import socket

        remove_dead_exports_temp_files()
        self.tag = uuid.uuid4().hex[:16]
        claim = f"{self.prefix}{_LOCK}/{self.tag}"
        self._claim_body = msgspec.json.encode(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            }
        )
        # A PUT that fails (no s3:PutObject, no bucket, the store down) raises its own error; the
        # rare claim that landed all the same expires after CLAIM_LEASE.
        await self.transport.put(claim, self._claim_body)
        self._claim = claim
        self._renewed = awake_clock()
        try:
            folder = f"{self.prefix}{_LOCK}/"
            claims = await self.transport.list(folder, require=[claim])
            (mine,) = [c for c in claims if c.key == claim]
            others = [c for c in claims if c.key != claim and _CLAIM_NAME.fullmatch(c.key[len(folder) :])]
            live = [c for c in others if mine.modified - c.modified < CLAIM_LEASE]
            if live:
                age = max(0.0, mine.modified - max(c.modified for c in live))
                raise ValueError(
                    f"destination s3://{self.bucket}/{self.prefix} is being written by another export (its claim "
                    f"{live[0].key.rsplit('/', 1)[-1]} was renewed {age:.0f} s ago); one export at a time per "
                    f"destination (a claim not renewed for {CLAIM_LEASE:.0f} s is taken over)"
                )
            stale = [c.key for c in others]
            if stale:
                _log.warning("taking over %s: %d claim(s) of dead exports", self.prefix or "/", len(stale))
                try:
                    await self.transport.delete(stale)
                except StoreError as error:  # no s3:DeleteObject: stale claims are ignored all the same
                    _log.warning("could not delete the stale claims under %s: %s", self.prefix or "/", error)
        except BaseException:
            self._claim = None
            try:
                await self.transport.delete([claim])
            except Exception:  # noqa: BLE001 - the refusal matters more; a stale claim expires
                pass
            raise
        self._renewal = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(CLAIM_RENEW)
            claim = self._claim
            if claim is None:
                return
            try:
                if await self.transport.get(claim) is None:
                    self._lost = "its claim was deleted (taken over after a pause longer than the lease?)"
                    return
                await self.transport.put(claim, self._claim_body)
                previous, self._renewed = self._renewed, awake_clock()
                if self._renewed - previous > CLAIM_HOLD:
                    # Paused past the hold (perhaps between the GET and the PUT): another export
                    # may have taken over, and this PUT may have re-created a deleted claim.
                    self._lost = f"its renewal came {self._renewed - previous:.0f} s after the previous one"
                    self._claim = None
                    await self.transport.delete([claim])
                    return
            except Exception as error:  # noqa: BLE001 - check_held decides when it is too late
                _log.warning("could not renew the export's claim %s: %s", claim, error)

    def check_held(self) -> None:
        lost = self._lost
        if lost is None and self._claim is not None:
            overdue = awake_clock() - self._renewed
            if overdue > CLAIM_HOLD:
                lost = f"its claim was last renewed {overdue:.0f} s ago"
        if lost:
            raise StoreError(f"this export may no longer hold s3://{self.bucket}/{self.prefix}: {lost}; no more drops")

    async def remove(self, names: list[str]) -> None:
        if names:
            await self.transport.delete([self.prefix + name for name in names])

    def temp_path(self, name: str) -> str:
        # The host and process id in the name let a later export remove what a killed one left.
        fd, path = tempfile.mkstemp(
            prefix=f"{_S3_TEMP_PREFIX}{leftovers.host_tag()}-{os.getpid()}-{name}.", suffix=".tmp"
        )
        os.close(fd)
        return path

    async def publish(self, name: str, temp: str) -> int:
        # One PUT: the object appears whole or not at all.
        with open(temp, "rb") as handle:
            body = handle.read()
        await self._check_claim(name)  # a data file without its manifest is still read by dataset readers
        await self.transport.put(self.prefix + name, body)
        os.unlink(temp)
        return len(body)

    async def publish_bytes(self, name: str, body: bytes) -> None:
        """PUT a shard's manifest, which makes the shard durable. A worker first checks that the
        export it works for still holds the destination (its claim exists): an export paused past
        the lease and taken over would otherwise publish its shards beside the new export's, every
        row twice (a breaker, 2026-12-02)."""
        await self._check_claim(name)
        await self.transport.put(self.prefix + name, body)

    async def _check_claim(self, name: str) -> None:
        """A worker's check, before it publishes ``name``, that its export still holds the prefix."""
        if not self.owner:
            return
        claim = f"{self.prefix}{_LOCK}/{self.owner}"
        if await self.transport.get(claim) is None:
            raise StoreError(
                f"the export writing s3://{self.bucket}/{self.prefix} no longer holds it (its claim "
                f"{self.owner} is gone: taken over after a pause longer than the lease?): shard not published",
                operation="PUT",
                key=self.prefix + name,
            )

    def written_by_an_export(self, name: str) -> bool:
        """An ``s3://`` export names every data file with its claim's run tag
        (``part-NNNNN-<16 hex>.parquet``): such a file is an export's however its run ended, and
        whatever became of its claim; another tool's ``part-00000.parquet`` is not."""
        return _RUN_TAGGED.fullmatch(name) is not None

    async def close(self, *, failed: bool = False) -> None:
        """Stop renewing and delete this export's claim. A claim that cannot be deleted (no
        ``s3:DeleteObject`` on the destination, the store down) is logged and left to expire
        after ``CLAIM_LEASE`` seconds: the shards are durable already, and an export's own error
        must not be replaced by its clean-up's."""
        renewal, claim = self._renewal, self._claim
        self._claim = self._renewal = None
        try:
            if renewal is not None:
                renewal.cancel()
                await asyncio.gather(renewal, return_exceptions=True)
            if claim is not None:
                try:
                    await self.transport.delete([claim])
                except StoreError as error:
                    _log.warning(
                        "could not delete this export's claim %s (%s): another export into s3://%s/%s is refused "
                        "until it expires, %.0f s after its last renewal",
                        claim,
                        error,
                        self.bucket,
                        self.prefix,
                        CLAIM_LEASE,
                    )
        finally:
            await self.transport.close()
