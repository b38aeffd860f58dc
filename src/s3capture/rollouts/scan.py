"""The scan of one rollout prefix: ``scan_listing`` sorts a verified LIST of ``rollouts/<rid>/`` by
kind into a ``RolloutScan`` (fence, retire tombstone, drop tombstones, log, sealed manifests,
checkpoints, folder markers, foreign keys), the one classification that ``freeze``, ``drop``,
``retire``, ``delete`` and ``rollouts`` share; ``RolloutScan.version_and_id`` derives a freeze's
``version`` and ``snapshot_id`` from it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from s3capture.layout import (
    is_checkpoint_rel,
    is_drop_tombstone_rel,
    is_folder_marker,
    is_ledger_probe_rel,
    is_manifest_rel,
    parse_log_key,
)
from s3capture.transport import ListedObject

__all__ = ["RolloutScan", "scan_listing"]


@dataclass
class RolloutScan:
    """What a verified LIST of one rollout prefix shows."""

    prefix: str
    fence: bool = False
    retired: bool = False
    """The retire tombstone (``retired``) exists."""
    drops: list[ListedObject] = field(default_factory=list)
    """Tentative tombstones of drops in progress (``drop/<token>``, exactly that shape:
    ``layout.is_drop_tombstone_rel``); a leftover one (a drop that crashed) reads as retired."""
    log: list[ListedObject] = field(default_factory=list)
    parsed: list[tuple[str, str, str, str]] = field(default_factory=list)
    """``parse_log_key`` of each key of ``log`` (same order): every key is parsed once, here."""
    snaps: list[ListedObject] = field(default_factory=list)
    """Sealed manifests (``snap/<version:020d>-<snapshot_id>``, exactly that shape:
    ``layout.is_manifest_rel``); any other key under ``snap/`` or ``drop/`` is foreign."""
    foreign: list[ListedObject] = field(default_factory=list)
    checkpoints: list[ListedObject] = field(default_factory=list)
    """Delta checkpoints (``cum/<digest>.zst``): derived from entries, so outside the version and
    the snapshot id, but removed with the rest."""
    folders: list[ListedObject] = field(default_factory=list)
    """Folder markers (``layout.is_folder_marker``): the rollout prefix itself (what a console's
    "Create folder" writes), or an empty object whose key ends in ``/`` inside it (s3fs, ``rclone
    mkdir``). They hold nothing of the rollout's, so they are outside the version and the snapshot
    id, like a checkpoint, and removed with the rest. A ledger manifest's listing probe that was
    left behind (``ledger/.probe/<uuid>``: its DELETE failed, or landed before its PUT) is kept
    here too: it holds nothing either, and alone it is no rollout."""
    seen_at: float = 0.0
    """``s3capture.clocks.awake_clock()`` when the listing returned (this client's clock)."""

    @property
    def contents(self) -> list[ListedObject]:
        """The rollout's own objects besides the fence and tombstone: log, manifests, foreign keys,
        drop tombstones and checkpoints (what ``rollouts`` counts; a folder marker alone is no
        rollout)."""
        return self.log + self.snaps + self.foreign + self.drops + self.checkpoints

    @property
    def records(self) -> list[ListedObject]:
        """Every object a retire removes: ``contents`` and a folder marker."""
        return self.contents + self.folders

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
            hasher.update(f"{item.key[len(self.prefix) :]}\n".encode())
        for item in sorted(self.foreign, key=lambda i: i.key):
            hasher.update(f"{item.key[len(self.prefix) :]}\t{item.etag}\n".encode())
        return len(self.log) + len(self.foreign), hasher.hexdigest()[:32]


def scan_listing(prefix: str, listing: Iterable[ListedObject], *, seen_at: float = 0.0) -> RolloutScan:
    """Sort the listed objects of one rollout prefix by kind: the one classification that ``freeze``,
    ``drop``, ``retire``, ``delete`` and ``rollouts`` share, so a listing and a freeze of the same
    keys always agree on the version and snapshot id. ``prefix`` ends in ``/``; every item's key
    starts with it."""
    scan = RolloutScan(prefix, seen_at=seen_at)
    plen = len(prefix)
    for item in listing:
        rel = item.key[plen:]
        if rel == "fence":
            scan.fence = True
        elif rel == "retired":
            scan.retired = True
        elif is_folder_marker(rel, item.size) or is_ledger_probe_rel(rel):
            scan.folders.append(item)
        elif rel.startswith("drop/") and is_drop_tombstone_rel(rel):
            scan.drops.append(item)
        elif rel.startswith("snap/") and is_manifest_rel(rel):
            scan.snaps.append(item)
        elif rel.startswith("log/") and (parsed := parse_log_key(rel)) is not None:
            scan.log.append(item)
            scan.parsed.append(parsed)
        elif rel.startswith("cum/") and is_checkpoint_rel(rel):
            scan.checkpoints.append(item)
        else:
            scan.foreign.append(item)
    return scan
