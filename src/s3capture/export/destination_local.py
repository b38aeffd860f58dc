"""A local folder as an export destination (``_LocalDestination``): an ``flock`` on its lock file
held for the export, workers that check the lock's token before they publish, and atomic
publication (temp file, ``fsync``, rename)."""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import os
import uuid
from typing import Any

from s3capture.errors import StoreError
from s3capture.export.destination_base import (
    _LOCK,
    _PART,
    _classify,
    _decode_manifest,
    _Destination,
    _Existing,
    _foreign,
    _settle,
)

_log = logging.getLogger("s3capture")


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
        self._lock_was_here = False  # whether the lock file was there before ``lock`` (an export ran here)
        self._scanned: set[str] | None = None  # the file names ``scan`` found (None: no scan yet)

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
        self._lock_was_here = not self._made_lock
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
            if failed and self._made_lock and not self._published_files():
                # A refused or failed run leaves a folder it did not create as it found it. (Not
                # one that published a data file: the lock file tells the re-run that it is an
                # export's unfinished shard, to be removed, not a foreign file.)
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.folder, _LOCK))
            handle.close()  # releases the flock

    def written_by_an_export(self, name: str) -> bool:
        """A local data file is named ``part-NNNNN.parquet``, as other tools name theirs: it is an
        export's when the folder held an export's lock file before this run took it (an export
        killed, or failed after publishing a data file, keeps it; ``close``)."""
        return self._lock_was_here

    def _published_files(self) -> bool:
        """Whether shard files appeared here since this run's ``scan`` (its workers published them)."""
        found = self._scanned
        if found is None:
            return False  # no scan: nothing was published
        try:
            return any(_PART.fullmatch(name) and name not in found for name in os.listdir(self.folder))
        except OSError:
            return True  # unknown: keep the lock file

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
                if _foreign(name, folder=True):
                    existing.foreign.append(name + "/")
                continue
            if _foreign(name):
                existing.foreign.append(name)
            try:
                files.append((name, os.path.getsize(path)))
            except FileNotFoundError:
                continue
        self._scanned = {name for name, _ in files}
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
