"""Where shards go: a local folder (``flock``) or an ``s3://`` prefix (a renewed claim), and how a
destination's durable shards are found (``read_manifests``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as _dt
import io
import logging
import os
import re
import tempfile
import uuid
from collections.abc import Iterable
from typing import Any

import msgspec

from s3capture import leftovers
from s3capture.clocks import awake_clock
from s3capture.errors import StoreError
from s3capture.export.records import MANIFEST_FORMAT, ExportJob, ShardManifest

_log = logging.getLogger("s3capture")

_PART = re.compile(
    r"^(?:part-(\d{5,})(?:-[0-9a-f]{8,32})?\.(?:parquet|jsonl)|_?part-(\d{5,})(?:-[0-9a-f]{8,32})?\.manifest\.json)$"
)
"""Data files ``part-NNNNN[-<run tag>].parquet|jsonl`` and manifests ``_part-NNNNN[-<run tag>].manifest.json``
(``ExportJob.run_tag`` on ``s3://`` destinations; the leading
``_`` makes pyarrow, pandas, Spark and Ray Data skip them when they read the folder as a dataset).
Manifests named ``part-NNNNN.manifest.json`` (exports before the ``_``) are read too: otherwise their
data files would look unfinished and be removed."""
_TEMP = re.compile(r"^\._?part-\d{5,}.*\.tmp$")
_LOCK = ".s3capture-export.lock"
_S3_TEMP_PREFIX = "s3capture-export-"
_S3_TEMP = re.compile(rf"^{_S3_TEMP_PREFIX}(?P<host>.+)-(?P<pid>\d{{1,10}})-part-\d{{5,}}.*\.tmp$")
"""A shard an export to an ``s3://`` destination writes in the system's temp folder before its
one PUT: ``s3capture-export-<host>.ns<PID namespace>-<pid>-part-NNNNN...tmp``
(``s3capture.leftovers.host_tag``)."""
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


"""A local destination's lock file (``_LocalDestination.lock``); hidden, so dataset readers skip it.
On an ``s3://`` destination, the folder of the exports' claims (``_S3Destination.lock``)."""
CLAIM_LEASE = 600.0
"""Seconds (by the store's clock) after its last renewal at which an ``s3://`` destination's claim
is stale: the export that wrote it is taken to be dead, and the next export takes the destination."""
CLAIM_RENEW = 30.0
"""Seconds between renewals of a live export's claim."""


CLAIM_HOLD = 300.0
"""Seconds after its last successful renewal at which an export stops dropping: it may have been
taken over. Well below ``CLAIM_LEASE``, so a paused export fences itself before another can start."""


def _is_s3(dest: str) -> bool:
    return dest.startswith("s3://")


class _Existing(msgspec.Struct, kw_only=True):
    manifests: list[ShardManifest] = []
    """The durable shards, in shard order (``_settle``)."""
    data_files: list[str] = []
    temp_files: list[str] = []
    broken: list[str] = []
    """Manifests whose data file is missing or not the size they record: not durable (``_settle``)."""
    sizes: dict[str, int] = {}
    """Size in bytes of every data file found."""
    highest: int = -1
    foreign: list[str] = []
    """Files (and folders, with a trailing ``/``) no export writes, which a dataset reader of the
    destination would read too (names starting with ``.`` or ``_`` are skipped by those readers)."""


def _foreign(name: str) -> bool:
    """A top-level name in a destination that no export writes and that dataset readers (pyarrow,
    pandas, Spark, Ray Data: they skip names starting with ``.`` or ``_``) would read."""
    return not name.startswith((".", "_")) and not _PART.match(name)


class _Destination:
    """Where shards go: a local folder or an ``s3://`` prefix. ``publish`` is atomic."""

    requests: collections.Counter

    async def scan(self) -> _Existing:
        raise NotImplementedError

    async def remove(self, names: list[str]) -> None:
        raise NotImplementedError

    async def lock(self) -> None:
        """Take the destination for one export, until ``close``; ``ValueError`` when another holds it."""
        raise NotImplementedError

    def check_held(self) -> None:
        """Raise ``StoreError`` when this export may no longer hold the destination (before a drop)."""

    def temp_path(self, name: str) -> str:
        raise NotImplementedError

    async def publish(self, name: str, temp: str) -> int:
        """Make the finished temp file ``temp`` appear as ``name``; its size in bytes."""
        raise NotImplementedError

    async def publish_bytes(self, name: str, body: bytes) -> None:
        raise NotImplementedError

    async def close(self, *, failed: bool = False) -> None:
        """Release the destination; ``failed``: the export ends with an error."""


def _classify(files: Iterable[tuple[str, int]], existing: _Existing) -> list[str]:
    """Sort destination files ``(name, size)`` into data files, temp files and manifest names."""
    manifests: list[str] = []
    for name, size in files:
        match = _PART.match(name)
        if match:
            existing.highest = max(existing.highest, int(match.group(1) or match.group(2)))
            if match.group(2):
                manifests.append(name)
            else:
                existing.data_files.append(name)
                existing.sizes[name] = size
        elif _TEMP.match(name):
            existing.temp_files.append(name)
    return manifests


def _settle(existing: _Existing, found: list[tuple[str, ShardManifest]]) -> None:
    """Keep the manifests whose shard is durable, in shard order (a later shard's record of a
    rollout supersedes an earlier one's; ``part-100000`` sorts before ``part-99999`` by name). A
    manifest whose data file is missing or not the size it records (removed, truncated, replaced)
    is not durable: it goes to ``broken``, and its data file becomes an orphan, so its rollouts are
    exported again and never dropped on its word."""
    for name, manifest in sorted(found, key=lambda pair: (pair[1].shard, pair[0])):
        if manifest.data is not None and existing.sizes.get(manifest.data) != manifest.data_bytes:
            existing.broken.append(name)
        else:
            existing.manifests.append(manifest)


def _manifest_names_of(data: str) -> tuple[str, ...]:
    """The names a data file's manifest can have: ``_part-N[-tag].manifest.json``, and
    ``part-N.manifest.json`` of exports before the ``_``."""
    stem = data.rsplit(".", 1)[0]
    return (f"_{stem}.manifest.json", f"{stem}.manifest.json")


def _decode_manifest(name: str, raw: bytes) -> ShardManifest:
    try:
        manifest = msgspec.json.decode(raw, type=ShardManifest)
    except (msgspec.DecodeError, RecursionError) as error:  # RecursionError: nested past the stack
        raise ValueError(f"shard manifest {name} is not a valid export manifest: {error}") from None
    if manifest.format != MANIFEST_FORMAT:
        raise ValueError(f"shard manifest {name} has format {manifest.format!r}, expected {MANIFEST_FORMAT!r}")
    return manifest


_LOCK_ATTEMPTS = 5


def _same_file(handle: Any, path: str) -> bool:
    """Whether the open ``handle`` is the file now at ``path`` (an ``flock`` taken on a file that
    was unlinked since locks nothing another process can see)."""
    try:
        held, there = os.fstat(handle.fileno()), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


class _LocalDestination(_Destination):
    def __init__(self, folder: str, owner: str = "") -> None:
        self.folder = os.path.abspath(folder)
        self.owner = owner  # a worker's: the lock token of the export it works for ("" unchecked)
        self.token = ""  # the exporting process's: written into the lock file by ``lock``
        self.requests = collections.Counter()
        self._created: list[str] = []  # the folders this export made, innermost first
        self._made_lock = False  # whether ``lock`` created the lock file (a refused run removes it)

    def _make(self) -> None:
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise ValueError(f"destination {self.folder} exists and is not a folder")
        if not os.path.isdir(self.folder):
            missing, path = [], self.folder
            while not os.path.exists(path) and os.path.dirname(path) != path:
                missing.append(path)
                path = os.path.dirname(path)
            try:
                os.makedirs(self.folder, exist_ok=True)
            except OSError as error:  # a file in the way, no permission, a read-only file system
                for folder in missing:  # the parents it did make, innermost first
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)
                raise ValueError(
                    f"destination {self.folder} cannot be created: {error.strerror} ({error.filename})"
                ) from None
            self._created = missing

    async def lock(self) -> None:
        """Take the folder for this export: an exclusive ``flock`` on ``.s3capture-export.lock``
        in it, held until ``close`` (the kernel releases it when the process dies, SIGKILL too).
        Two exports into one folder would number their shards alike and replace each other's
        files, and a ``--drop`` would then consume rollouts whose rows were replaced. Raises
        ``ValueError`` when another export holds the folder or it is not writable."""
        path = os.path.join(self.folder, _LOCK)
        for _ in range(_LOCK_ATTEMPTS):
            self._make()
            self._made_lock = not os.path.exists(path)
            try:
                handle = open(path, "a+b")
            except OSError as error:
                raise ValueError(f"destination {self.folder} is not writable: {error}") from None
            try:
                import fcntl
            except ImportError:  # pragma: no cover - not POSIX: one export at a time is the operator's duty
                self._lock: io.BufferedRandom | None = handle
                return
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                raise ValueError(
                    f"destination {self.folder} is being written by another export (it holds {_LOCK}); "
                    "one export at a time per destination"
                ) from None
            except OSError as error:  # a file system without locks (some FUSE mounts): the operator's duty
                _log.warning("cannot lock %s (%s): make sure no other export writes there", path, error)
                break
            if _same_file(handle, path):
                break
            # A failed export removed the lock file (``close``) between our open and our flock:
            # we hold a lock on a file nobody else will open. Take the one at the path.
            handle.close()
        else:
            raise ValueError(f"destination {self.folder}: its lock file kept being replaced; try again")
        self.token = uuid.uuid4().hex
        handle.seek(0)
        handle.truncate()
        handle.write(self.token.encode())
        handle.flush()
        self._lock = handle

    def check_owner(self) -> None:
        """Raise ``StoreError`` unless the export this worker works for still holds the folder:
        its lock file holds ``owner`` and an exclusive ``flock`` is on it. Checked just before a
        shard's file is published (a worker that outlived its export could otherwise replace the
        files of a re-run that started since). No check without ``owner`` or ``fcntl``; on a file
        system without locks only the token is compared."""
        if not self.owner:
            return
        path = os.path.join(self.folder, _LOCK)
        try:
            with open(path, "rb") as handle:
                held = handle.read(64).decode("ascii", "replace")
                try:
                    import fcntl

                    fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass  # the exclusive lock of a live export: whose, the token says
                except (ImportError, OSError):  # no locks here: the token alone decides
                    pass
                else:
                    held = ""  # nobody holds the folder: the export that wrote the token is gone
        except OSError:
            held = ""
        if held != self.owner:
            raise StoreError(
                f"the export writing {self.folder} ended (or another took the folder over): shard not published",
                operation="PUT",
                key=path,
            )

    async def close(self, *, failed: bool = False) -> None:
        """Release the folder. When the export failed, a folder it created that holds nothing
        but its lock file (it failed before its first shard) is removed: a failed run leaves no
        empty dataset behind; and a lock file it created is removed (a refused run leaves a folder
        as it found it). A run that succeeds keeps its folder, empty or not."""
        handle, self._lock = getattr(self, "_lock", None), None
        if handle is not None:
            with contextlib.suppress(OSError):  # the token goes first: no late worker publishes now
                handle.truncate(0)
                handle.flush()
            if failed and self._created:
                self._remove_if_unused()  # still under the flock: no other export is writing here
            if failed and self._made_lock:
                # A refused or failed run leaves a folder it did not create as it found it.
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.folder, _LOCK))
            handle.close()  # releases the flock

    def _remove_if_unused(self) -> None:
        try:
            if os.listdir(self.folder) != [_LOCK]:
                return
            os.unlink(os.path.join(self.folder, _LOCK))
            for folder in self._created:
                os.rmdir(folder)  # fails (and stops) at one that holds anything else
        except OSError:
            pass

    async def scan(self) -> _Existing:
        existing = _Existing()
        self._make()
        files = []
        for name in sorted(os.listdir(self.folder)):
            path = os.path.join(self.folder, name)
            if os.path.isdir(path):
                if _foreign(name):
                    existing.foreign.append(name + "/")
                continue
            if _foreign(name):
                existing.foreign.append(name)
            try:
                files.append((name, os.path.getsize(path)))
            except FileNotFoundError:
                continue
        found = []
        for name in _classify(files, existing):
            with open(os.path.join(self.folder, name), "rb") as handle:
                found.append((name, _decode_manifest(name, handle.read())))
        _settle(existing, found)
        return existing

    async def remove(self, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(os.path.join(self.folder, name))
            except FileNotFoundError:
                pass

    def temp_path(self, name: str) -> str:
        # Hidden (a leading '.'): Parquet dataset readers skip it while it is being written.
        return os.path.join(self.folder, f".{name}.{uuid.uuid4().hex[:12]}.tmp")

    def _fsync_folder(self) -> None:
        try:
            fd = os.open(self.folder, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    async def publish(self, name: str, temp: str) -> int:
        with open(temp, "rb+") as handle:
            os.fsync(handle.fileno())
        size = os.path.getsize(temp)
        try:
            self.check_owner()
        except StoreError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        os.replace(temp, os.path.join(self.folder, name))
        self._fsync_folder()
        return size

    async def publish_bytes(self, name: str, body: bytes) -> None:
        temp = self.temp_path(name)
        try:
            with open(temp, "wb") as handle:
                handle.write(body)
                handle.flush()
                os.fsync(handle.fileno())
            self.check_owner()
            os.replace(temp, os.path.join(self.folder, name))
        except BaseException:
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass
            raise
        self._fsync_folder()


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
        existing.foreign = [name for name in tops if _foreign(name.rstrip("/"))]
        manifest_names = _classify(sorted(files), existing)
        found = []
        for name in manifest_names:
            raw = await self.transport.get(self.prefix + name)
            if raw is None:  # removed since the listing: not durable any more
                continue
            found.append((name, _decode_manifest(name, raw)))
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
        claims (verified, and required to show its own). Any other claim renewed less than
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
            claims = await self.transport.list(f"{self.prefix}{_LOCK}/", require=[claim])
            (mine,) = [c for c in claims if c.key == claim]
            others = [c for c in claims if c.key != claim]
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


def _open_destination(job: ExportJob, session: Any = None) -> _Destination:
    if _is_s3(job.dest):
        return _S3Destination(
            job.dest, endpoint_url=job.endpoint_url, transport=job.transport, session=session, owner=job.run_tag
        )
    return _LocalDestination(job.dest, owner=job.lock_token)


async def read_manifests(
    dest: str, *, endpoint_url: str | None = None, transport: str | None = None
) -> list[ShardManifest]:
    """The durable shards of an export destination (a local folder or an ``s3://`` prefix), in
    shard order. Data files without a manifest are not durable and are not returned.

    Raises ``ValueError`` for a manifest that is not an export manifest, ``StoreError`` when S3 fails.
    """
    target = _open_destination(ExportJob(url="", dest=dest, endpoint_url=endpoint_url, transport=transport))
    try:
        if isinstance(target, _LocalDestination) and not os.path.isdir(target.folder):
            return []
        existing = await target.scan()
    finally:
        await target.close()
    return sorted(existing.manifests, key=lambda m: m.shard)


async def current_snapshots(
    dest: str, *, endpoint_url: str | None = None, transport: str | None = None
) -> dict[str, str]:
    """``{rollout_id: snapshot_id}`` of the latest export of each rollout in a destination: the
    record of the highest-numbered durable shard that holds the rollout (a re-run numbers its
    shards after every earlier one, so a later record supersedes an earlier one).

    A destination can hold rows of two snapshots of one rollout (``changed_since_export``: an open
    rollout written to after an unsealed export, or an id deleted and captured again). Train on
    the rows whose ``(rollout_id, snapshot_id)`` is in this map and that are not ``masked``: the
    latest state, which is left out altogether when it was masked and skipped. The highest
    ``version`` is not that rule: an id captured again starts counting from zero, so its
    earlier, longer generation would win.

    Raises what ``read_manifests`` raises.
    """
    latest: dict[str, str] = {}
    for manifest in await read_manifests(dest, endpoint_url=endpoint_url, transport=transport):
        for record in manifest.rollouts:
            latest[record.rollout_id] = record.snapshot_id
    return latest
