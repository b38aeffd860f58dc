"""The local spill: objects that must not be lost when the store is down or the caller gives up.

``mark_incomplete`` (and ``S3CaptureLedger.record_failure``) append the object they could not store
— because the PUT failed, or because the caller's deadline cancelled them — to a local file,
fsynced, before they return or let the cancellation propagate. A later write, ``replay_spill`` or
``close`` stores them (every spilled key is unique or content-addressed, so replaying twice is a
no-op).

Identity: one spill file per ``(endpoint, bucket, root prefix)``, named by a digest of the three,
and every line repeats them; a marker for endpoint B is never replayed into endpoint A although
both have a bucket of the same name.

Concurrency, across threads and processes on one host:

- an append takes an exclusive ``flock`` on the spill file, writes one line and fsyncs it; if the
  path no longer names the file it locked (a replay claimed it meanwhile) it appends to the new one;
- a replay claims the file by renaming it to ``<file>.<uuid>.replay`` while holding that lock,
  after taking an exclusive ``flock`` on a sidecar ``<claim>.lock`` that it holds until the claim
  is stored and removed;
- a claim whose sidecar lock can be taken belongs to a replayer that died (the kernel released its
  lock): it is recovered by whoever takes the lock. Liveness is never judged by PID, which a new
  process (PID 1 in a container) may share with the dead one.
"""

from __future__ import annotations

import base64
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import uuid
from dataclasses import dataclass
from typing import IO

from s3capture.layout import MAX_KEY_BYTES

__all__ = ["Spill", "SpillClaim"]

log = logging.getLogger("s3capture")


@dataclass
class SpillClaim:
    """A claimed spill file and the lock that says its replayer is alive."""

    path: str
    lock: IO[bytes]

    def release(self) -> None:
        """Remove the claim (its objects are stored or spilled again), then drop the lock."""
        for name in (self.path, self.path + ".lock"):
            try:
                os.remove(name)
            except FileNotFoundError:
                pass
        self.lock.close()


class Spill:
    """The spill file of one ``(endpoint, bucket, root)`` in ``directory``."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        endpoint: str | None,
        bucket: str,
        root: str,
        legacy_endpoints: tuple[str | None, ...] = (),
    ) -> None:
        """``legacy_endpoints``: other names earlier versions gave this same store, whose spill
        files a replay also claims and stores (before 2026-12-02 a store whose endpoint came from
        the AWS config was named ``aws``, like AWS S3 itself)."""
        self.directory = os.fspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            # Found at construction, not in the outage the spill exists for (an API breaker,
            # 2026-12-03: a file here failed only when a marker had to be spilled).
            raise ValueError(f"spill_dir {self.directory!r} exists and is not a directory")
        try:  # and a folder that cannot be made (a file on its path, no permission) too
            os.makedirs(self.directory, exist_ok=True)
        except OSError as error:
            raise ValueError(f"spill_dir {self.directory!r} cannot be created: {error}") from None
        self.identity = {"endpoint": (endpoint or "aws").rstrip("/"), "bucket": bucket, "root": root}
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:24]
        readable = re.sub(r"[^A-Za-z0-9_.-]", "_", bucket)[:64]
        self.path = os.path.join(self.directory, f"spill-{readable}-{digest}.jsonl")
        self._legacy = [
            Spill(directory, endpoint=other, bucket=bucket, root=root)
            for other in dict.fromkeys(legacy_endpoints)
            if (other or "aws").rstrip("/") != self.identity["endpoint"]
        ]

    # ------------------------------------------------------------------ append
    def append(self, key: str, body: bytes = b"") -> None:
        """Append one object, locked and fsynced; returns once it is on disk. Raises ``OSError``."""
        os.makedirs(self.directory, exist_ok=True)
        item = dict(self.identity, key=key)
        if body:
            item["body"] = base64.b64encode(body).decode()
        line = json.dumps(item, sort_keys=True).encode() + b"\n"
        while True:
            with open(self.path, "a+b") as handle:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
                try:
                    current = os.stat(self.path).st_ino
                except FileNotFoundError:
                    current = None
                if current != os.fstat(handle.fileno()).st_ino:
                    continue  # claimed by a replay meanwhile: write to the new file
                size = os.fstat(handle.fileno()).st_size
                if size and os.pread(handle.fileno(), 1, size - 1) != b"\n":
                    # A line torn by a full disk or a killed writer: end it, or this line would be
                    # glued onto it and skipped with it at replay.
                    line = b"\n" + line
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
                return

    def pending(self) -> bool:
        """Whether anything may wait to be replayed (a spill file or a claim, also of a legacy name)."""
        if any(legacy.pending() for legacy in self._legacy):
            return True
        return os.path.exists(self.path) or bool(glob.glob(glob.escape(self.path) + ".*.replay"))

    # ------------------------------------------------------------------ claim and read
    def claim(self) -> list[SpillClaim]:
        """Take the spill file and every claim whose replayer died (of this store's legacy names
        too); the caller must ``release`` each claim once its objects are stored (or spilled
        again: under this store's own name)."""
        claims: list[SpillClaim] = [claim for legacy in self._legacy for claim in legacy.claim()]
        try:
            handle = open(self.path, "rb")
        except FileNotFoundError:
            pass
        else:
            with handle:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
                if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino:
                    name = f"{self.path}.{uuid.uuid4().hex}.replay"
                    lock = open(name + ".lock", "wb")
                    fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: never contended
                    os.replace(self.path, name)
                    claims.append(SpillClaim(name, lock))
        for leftover in glob.glob(glob.escape(self.path) + ".*.replay"):
            if any(claim.path == leftover for claim in claims):
                continue
            lock = open(leftover + ".lock", "ab")
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()  # its replayer is alive
                continue
            if not os.path.exists(leftover):  # finished by its replayer just now
                SpillClaim(leftover, lock).release()
                continue
            log.info("recovering spill claim %s left by a replayer that died", leftover)
            claims.append(SpillClaim(leftover, lock))
        return claims

    def read(self, claims: list[SpillClaim]) -> dict[str, bytes]:
        """The objects (key -> body) in ``claims`` that belong to this spill's identity.

        A line that cannot be replayed here is never dropped silently: a torn one (a writer killed
        mid-append, a full disk) is logged and skipped; one of another store, with a key outside
        this root, or with fields this version does not know (a newer writer's) is logged and
        appended to ``<spill file>.rejected`` beside the spill file, which nothing replays (where
        that file cannot be written, the lines are logged as an error instead: a full disk must
        not keep the others from being replayed)."""
        objects: dict[str, bytes] = {}
        rejected: list[bytes] = []
        for claim in claims:
            with open(claim.path, "rb") as handle:
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        item = json.loads(line)
                        body = base64.b64decode(item.get("body") or "", validate=True)
                    except (ValueError, AttributeError, TypeError):
                        log.warning("skipping torn line %d of spill file %s", number, claim.path)
                        continue
                    why = self._refusal(item)
                    if why:
                        log.warning("spill file %s line %d %s; kept in %s.rejected", claim.path, number, why, self.path)
                        rejected.append(line if line.endswith(b"\n") else line + b"\n")
                        continue
                    objects[item["key"]] = body
        if rejected:
            try:
                with open(self.path + ".rejected", "ab") as out:
                    out.write(b"".join(rejected))
                    out.flush()
                    os.fsync(out.fileno())
            except OSError as error:
                # Never in the way of the lines that can be replayed (a full disk): say what goes.
                log.error(
                    "could not keep %d unreplayable spill line(s) in %s.rejected (%s); they were: %s",
                    len(rejected),
                    self.path,
                    error,
                    b"".join(rejected).decode("utf-8", "replace")[:4000],
                )
        return objects

    def _refusal(self, item: dict) -> str:
        """Why a decoded line is not this spill's to replay (``""``: it is)."""
        identities = [self.identity, *(legacy.identity for legacy in self._legacy)]
        if not any(all(item.get(k) == v for k, v in identity.items()) for identity in identities):
            return "belongs to another store"
        key = item.get("key")
        if not isinstance(key, str) or not key.startswith(self.identity["root"] + "rollouts/"):
            return "names a key outside this store's root"
        if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
            # Spilled by a release whose key check let it through (a marker under a rollout prefix
            # longer than 876 bytes): S3 refuses it, so every replay would fail on it for ever.
            return f"names a key over S3's {MAX_KEY_BYTES}-byte limit, which no store accepts"
        unknown = sorted(set(item) - {*self.identity, "key", "body"})
        if unknown:
            return f"carries fields this version does not know ({', '.join(unknown)})"
        return ""
