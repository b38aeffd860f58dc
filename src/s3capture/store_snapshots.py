"""``S3TokenStore``'s snapshot path (``TokenSource``): ``freeze`` and ``read_snapshot``.

Holds ``FrozenSnapshot`` (re-exported by ``s3capture.store``), the one snapshot builder both
methods share (``_snapshot_of``: loads and judges a scanned rollout's log), the sealed manifest's
reader, and the hand-out of cached entries as copies no caller can mutate (``_hand_out`` and its
module-level helpers). ``_StoreSnapshots`` is a private mixin of ``s3capture.store.S3TokenStore``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from s3capture.cache import Stored as _Stored
from s3capture.clocks import awake_clock
from s3capture.errors import ListingError, SnapshotNotSealedError, StoreError
from s3capture.objects import (
    _MANIFEST_BASE_BYTES,
    _MANIFEST_BYTES_PER_OBJECT,
    _MANIFEST_FORMAT,
    _MANIFEST_REMEDY,
    _Manifest,
    _manifest_key,
)
from s3capture.protocols import TokenCaptureRetiredError, TokenCaptureSnapshot
from s3capture.records import RecordError, TokenEntry, to_gym
from s3capture.rollouts import FENCE_FROZEN, FENCE_RETIRED, RolloutScan, scan_listing
from s3capture.store_core import _StoreCore
from s3capture.transport import ListedObject, beside_confirmation, cancel_unfinished, gather_fail_fast, gather_settled

log = logging.getLogger("s3capture")

_FENCE_SEEN_LIMIT = 10_000
"""Rollouts whose freeze time ``drop`` remembers (~300 bytes each, measured: under 3 MiB). A
forgotten one only makes its drop wait ``fence_grace`` from the drop's own LIST instead."""


@dataclass(frozen=True)
class FrozenSnapshot(TokenCaptureSnapshot):
    """A ``TokenCaptureSnapshot`` that also says why it is incomplete.

    Fields: ``rollout_id``; ``entries``, a tuple of entries (``S3TokenStore.entry_type``: s3capture's
    ``TokenEntry`` or Gym's), one per call id, in call-id order; ``incomplete`` (True exactly when
    ``reasons`` is not empty); ``snapshot_id``, a hex digest of the listed keys and ETags;
    ``version``, the number of log objects (entries, intents, markers); ``reasons``.

    ``reasons`` is a sorted tuple of strings ``"<code>:<argument>"`` such as
    ``"conflicting_payloads:<cid>"``, ``"dangling_intent:<cid>"``, ``"marked_incomplete:<cid>"``,
    ``"missing_parent:<cid>"``, ``"broken_chain:<cid>"``, ``"unreadable:<key>:<why>"``,
    ``"vanished:<key>"``, ``"misfiled:<key>"`` and ``"foreign_object:<key>"`` (``<key>`` relative to
    the rollout's prefix); empty when complete. Every code and its meaning: ``docs/reasons.md``.
    """

    reasons: tuple[str, ...] = ()


def _shallow_copy(entry: TokenEntry) -> TokenEntry:
    """A copy of a cached entry whose scalar fields, token-id and log-probability lists and
    top-level containers are its own; nested items are shared (see ``S3TokenStore._hand_out``)."""
    out = entry.__copy__()  # type: ignore[attr-defined]  # msgspec.Struct defines it; its stubs do not
    out.prompt_token_ids = list(entry.prompt_token_ids)
    out.generation_token_ids = list(entry.generation_token_ids)
    out.generation_log_probs = list(entry.generation_log_probs)
    out.output_items = list(entry.output_items)
    extra = entry.__dict__.get("_extra")
    if extra:
        out.__dict__["_extra"] = dict(extra)
    return out


def _nested_encoding(entry: TokenEntry) -> bytes | None:
    """JSON of the parts of a cached entry that ``_shallow_copy`` shares (``routed_experts``, the
    items of ``output_items``, the extra fields); None when a caller made them unencodable."""
    try:
        return _nested_encoder.encode((entry.routed_experts, entry.output_items, entry.__dict__.get("_extra")))
    except (TypeError, ValueError, OverflowError, UnicodeError, RecursionError):  # e.g. an item made to contain itself
        return None


def _nested_digest(nested: bytes) -> bytes:
    return hashlib.blake2b(nested, digest_size=16).digest()


def _detached_copy(entry: TokenEntry, nested: bytes) -> TokenEntry:
    """A copy of a cached entry sharing nothing mutable with it: ``_shallow_copy`` with its nested
    parts decoded from ``nested`` (``_nested_encoding`` of ``entry``)."""
    out = _shallow_copy(entry)
    routed, items, extra = _nested_decoder.decode(nested)
    out.routed_experts, out.output_items = routed, items
    if extra:
        out.__dict__["_extra"] = extra
    return out


_nested_encoder = msgspec.json.Encoder()
_nested_decoder = msgspec.json.Decoder()


class _StoreSnapshots(_StoreCore):
    """``freeze``, ``read_snapshot`` and the snapshot builder of ``S3TokenStore`` (private mixin)."""

    def _saw_fence(self, rollout_id: str, when: float, version: int, snapshot_id: str) -> None:
        """Remember when this client's freeze knew its fence existed, for that snapshot."""
        self._fence_seen[rollout_id] = (when, version, snapshot_id)
        self._fence_seen.move_to_end(rollout_id)
        while len(self._fence_seen) > _FENCE_SEEN_LIMIT:
            self._fence_seen.popitem(last=False)

    def _snapshot_fields(self, scan: RolloutScan) -> dict[str, Any]:
        """``rollouts``: the version and snapshot id a freeze of the listed state would give, and
        whether its sealed manifest is listed."""
        version, snapshot_id = scan.version_and_id()
        manifest_key = _manifest_key(scan.prefix, version, snapshot_id)
        return {
            "version": version,
            "snapshot_id": snapshot_id,
            "sealed": any(item.key == manifest_key for item in scan.snaps),
        }

    # ------------------------------------------------------------------ TokenSource
    async def freeze(self, rollout_id: str) -> FrozenSnapshot:
        """Freeze a rollout and return one atomic snapshot (idempotent across clients).

        Requests: PUT the fence, then one LIST page per 1,000 keys, then one GET of the retire
        tombstone, one GET per entry not yet cached and one LIST after the listing's last key that
        confirms its end (in parallel), and one PUT of the sealed manifest unless it already exists.
        With ``probe_listing``, also a probe PUT beside the fence's (the listing must show it too)
        and its DELETE beside the manifest's PUT: no more round trips where the manifest is new,
        one more where it exists already.
        ``version`` is the number of log and foreign objects and ``snapshot_id`` a digest of their
        sorted keys (and of the foreign objects' ETags: s3capture's own keys name their content),
        so two clients freezing the same state agree. The snapshot is ``incomplete`` when
        any call id has conflicting payloads, an intent has no entry, a marker exists, or any object
        is unreadable or foreign.

        Every entry whose ``parent_call_id`` is not in the snapshot masks it (``missing_parent``):
        a listing that hid one key cannot make a chain with a hole trainable. A lost *last* call
        leaves no such trace; ``begin_call`` intents close that gap (``docs/design.md``).

        The snapshot is built from the listing exactly as ``read_snapshot`` builds it (one private
        method), so a read-only reader of an unchanged frozen rollout gets the same one.

        Returns a ``FrozenSnapshot``: the entries in ``entry_type``, ``version``, ``snapshot_id``,
        ``incomplete`` and its ``reasons`` (``docs/reasons.md``).

        Raises:
            TokenCaptureRetiredError: the rollout is retired (delete it to reuse the id).
            ValueError: an id that cannot be stored (before any request).
            StoreError: the store failed a request; ``ListingError`` (a ``StoreError``) for a
                listing that does not show the fence this freeze wrote, after retries.
        """
        prefix = self.layout.rollout(rollout_id)
        if not self._probe_listing:
            await self._put(prefix + "fence", FENCE_FROZEN)
            return await self._freeze_fenced(rollout_id, prefix, [])
        # probe_listing: a listing probe PUT beside the fence. A listing that lags the creation of
        # keys shows a re-freeze's fence (it exists already) at once; the probe is a new key, so a
        # listing that shows it holds every key created before the call (docs/reliability.md,
        # "Listings that lag"). Deleted beside the manifest PUT; ``scan_listing`` files a leftover
        # one with the folder markers (no reader counts it).
        probes = [f"{prefix}ledger/.probe/{uuid.uuid4().hex}"]
        try:
            # Settled, not fail-fast, and not cancelled midway by the caller either (a write never is:
            # settle_each): a probe PUT cancelled on its way landed after the probe's DELETE and was
            # left behind (a breaker, 2026-12-04). A cancelled freeze waits for the two PUTs.
            puts = asyncio.ensure_future(
                gather_settled([self._put(prefix + "fence", FENCE_FROZEN), self._put(probes[0], b"")])
            )
            try:
                await asyncio.shield(puts)
            except asyncio.CancelledError:
                await asyncio.wait([puts])
                if not puts.cancelled():
                    puts.exception()  # retrieved: the cancellation is what the caller gets
                raise
            return await self._freeze_fenced(rollout_id, prefix, probes)
        except BaseException:
            for probe in probes:  # a failed or cancelled freeze leaves no probe it knows of
                await self._remove_probe(probe)
            raise

    async def _freeze_listing(self, prefix: str, probes: list[str]) -> list[ListedObject]:
        """The listing a freeze builds on: it must show the fence just written and, with
        ``probe_listing``, the probe (``probes[-1]``; a listing that shows the retire tombstone
        instead is fresh enough to refuse the rollout). A ``delete`` racing the freeze deletes the
        probe with the rest, so no listing shows it: then, once, a new probe (appended to
        ``probes``) and a listing that must show it, so the freeze answers as a plain one does for
        what the delete left (a breaker, 2026-12-04: it raised ``ListingError``)."""
        if not probes:
            return await self._list(prefix, require=[prefix + "fence"])
        for attempt in range(2):
            try:
                return await self._list(prefix, require=[prefix + "fence", probes[-1]], unless=[prefix + "retired"])
            except ListingError:
                if attempt or await self._present(probes[-1]):
                    raise
            probes.append(f"{prefix}ledger/.probe/{uuid.uuid4().hex}")
            await self._put(probes[-1], b"")
        raise AssertionError("unreachable")  # pragma: no cover

    async def _freeze_fenced(self, rollout_id: str, prefix: str, probes: list[str]) -> FrozenSnapshot:
        """``freeze`` after its fence PUT (and its listing probe's, ``probes``: empty without
        ``probe_listing``)."""
        fenced_at = awake_clock()
        # A listing that does not show the fence just written is stale or incomplete: never build a
        # snapshot on it (retried, then ListingError).
        listing = await self._freeze_listing(prefix, probes)
        # The retire tombstone is also read by a GET, sent once the listing is in (beside the LIST
        # that confirms its end and the entries' GETs: a round trip more only where it overflows
        # ``max_concurrency``): where the fence existed already (a retired
        # rollout has one), its showing proves nothing about how far a listing lags, and a listing
        # that lagged a drop's tombstone made this freeze hand out an empty snapshot and leave a
        # retired rollout's fence "frozen" (the model, with listings that lag, 2026-12-04). Sent
        # beside the first LIST instead, it missed a retire that wrote its tombstone and deleted the
        # entries while the listing was retried (waiting for a probe or a fence): an empty,
        # complete snapshot (a breaker, 2026-12-04). A GET sent after the listing was answered
        # sees every tombstone written before any deletion that listing shows.
        tombstone = asyncio.ensure_future(self._present(prefix + "retired"))

        # Its end is confirmed by one more LIST, sent beside the entries' GETs rather than before
        # them (Transport.confirm_listing_end): a listing cut short would hide the rollout's last
        # keys, its intents, markers and retire tombstone.
        # A drop's own tombstone (``drop/<token>``) without the retire tombstone means that drop had
        # not decided to succeed (it writes ``retired`` before deleting anything): nothing is gone.
        # It is still deciding, or it crashed and left the rollout fenced; this freeze's fence
        # re-opens nothing but lets the rollout be consumed again. If that drop then succeeds, the
        # entries this freeze loads vanish (masked) and its drop fails (retired).
        async def snapshot_of(listed: list[ListedObject]) -> tuple[RolloutScan, FrozenSnapshot | None]:
            scan = scan_listing(prefix, listed, seen_at=awake_clock())
            return scan, None if scan.retired else await self._snapshot_of(rollout_id, scan)

        try:
            try:
                scan, snapshot = await beside_confirmation(
                    self.transport.confirm_listing_end(prefix, listing), listing, snapshot_of
                )
            except StoreError:
                # A retired rollout whose listing lagged its tombstone: the entries' GETs now go
                # beside the tombstone's, and one that failed (the retire deleting them, or a store
                # fault) raised StoreError and left the fence "frozen" where the GET says retired
                # (a breaker, 2026-12-04: tests/test_break_tombstone_get.py).
                try:
                    retired = await tombstone
                except StoreError:
                    retired = False
                if not retired:
                    raise
                snapshot = None
            if snapshot is not None:
                try:
                    if await tombstone:
                        snapshot = None
                except StoreError as error:
                    # The listing decides alone, as before the GET was added: a retired rollout whose
                    # tombstone GET failed was left fenced "frozen" after a drop had consumed it (a
                    # breaker on the change, 2026-12-04).
                    log.warning(
                        "freeze of %r: GET of the retire tombstone failed (%s); the listing decides", rollout_id, error
                    )
        finally:
            await cancel_unfinished(tombstone)
        if snapshot is None:
            await self._put(prefix + "fence", FENCE_RETIRED)  # undo our overwrite of the retired fence
            raise TokenCaptureRetiredError(f"rollout {rollout_id!r} is retired; delete it before reusing the id")
        version, snapshot_id, reasons = snapshot.version, snapshot.snapshot_id, snapshot.reasons
        self._saw_fence(rollout_id, fenced_at, version, snapshot_id)
        # A frozen rollout takes no more writes: its call-key map is not needed again.
        self._call_keys.forget(rollout_id)
        manifest_key = _manifest_key(prefix, version, snapshot_id)
        if all(item.key != manifest_key for item in scan.snaps):
            # Awaited, not written in the background: a background PUT could land after another
            # client's retire or delete of the rollout and leave a stray object there (docs/design.md).
            plen = len(prefix)
            manifest = {
                "format": _MANIFEST_FORMAT,
                "rollout_id": rollout_id,
                "version": version,
                "snapshot_id": snapshot_id,
                "incomplete": snapshot.incomplete,
                "reasons": list(reasons),
                "objects": [
                    {"key": i.key[plen:], "etag": i.etag, "size": i.size}
                    for i in sorted(scan.log + scan.foreign, key=lambda i: i.key)
                ],
            }
            sealing = self._put(manifest_key, msgspec.json.encode(manifest))
            await gather_fail_fast([sealing, *(self._remove_probe(probe) for probe in probes)])
        else:
            for probe in probes:
                await self._remove_probe(probe)  # a failed DELETE only logs: the snapshot stands
        probes.clear()  # removed: freeze's clean-up on an error has nothing left to delete
        if snapshot.incomplete:
            log.info("rollout %r froze incomplete: %s", rollout_id, "; ".join(reasons[:5]))
        return snapshot

    async def read_snapshot(
        self, rollout_id: str, *, sealed: bool = True, listing: Sequence[ListedObject] | None = None
    ) -> FrozenSnapshot:
        """The snapshot ``freeze`` would return for the rollout's listed state, without writing.

        Read-only (GET and LIST permission only: ``docs/permissions.md``): nothing is written, no
        fence is set, and this client's freeze bookkeeping is left alone. The snapshot is built
        from the listing by the same private method ``freeze`` uses, so its ``entries`` (in
        ``entry_type``), ``version``, ``snapshot_id``, ``incomplete`` and ``reasons`` are exactly
        what a ``freeze`` of that state gives; a consumer can then ``drop`` it conditionally as usual
        (with write permission).

        ``sealed=True`` (the exporter's default): the rollout must be frozen and unchanged since
        its freeze, i.e. the sealed manifest ``snap/<version:020d>-<snapshot_id>`` of exactly the
        listed state exists. That manifest is read and checked against the listing (its format,
        ``rollout_id``, ``version``, ``snapshot_id`` and the keys of its objects); a manifest that
        does not match is damage or a foreign object, never trusted. ``sealed=False``: the snapshot
        of the listed state whatever it is (an open rollout, or one written to after its freeze);
        an open rollout can still change, so such a snapshot is a moment's view.

        ``listing``: the rollout's objects as a listing already showed them (every key under its
        prefix, as ``rollouts_listed`` yields them); the snapshot is then that listed state's,
        judged and checked against its sealed manifest exactly as above, without a LIST of its
        own. An exporter that listed the root reads each rollout this way; the listed state may be
        older than a fresh listing (a rollout dropped since shows its objects ``vanished``).

        Requests: one LIST page per 1,000 keys of the rollout (none with ``listing``), then in
        parallel one GET per entry not cached, (``sealed=True``) one GET of the manifest and
        (without ``listing``) one LIST after the listing's last key that confirms its end.

        Raises:
            TokenCaptureRetiredError: the rollout is retired (its records are gone or going).
            SnapshotNotSealedError: ``sealed=True`` and the rollout is open (``state="open"``) or
                changed since its freeze, or its freeze did not finish (``state="changed"``).
            StoreError: the store failed (e.g. ``AccessDenied``), the listed manifest vanished, or
                it is corrupt or does not match the listing (the message names its key).
            ValueError: an id that cannot be stored, or a ``listing`` key outside the rollout's prefix.
        """
        prefix = self.layout.rollout(rollout_id)
        if listing is None:
            # The listing's end is confirmed by one more LIST, beside the snapshot's GETs (as in
            # freeze); where it shows more keys, the snapshot is read again with them.
            listed = await self._list(prefix)
            return await beside_confirmation(
                self.transport.confirm_listing_end(prefix, listed),
                listed,
                lambda whole: self.read_snapshot(rollout_id, sealed=sealed, listing=whole),
            )
        else:
            outside = next((item.key for item in listing if not item.key.startswith(prefix)), None)
            if outside is not None:
                raise ValueError(f"listing of rollout {rollout_id!r} holds {outside!r}, outside its prefix {prefix!r}")
            scan = scan_listing(prefix, listing, seen_at=awake_clock())
        if scan.retired:
            raise TokenCaptureRetiredError(f"rollout {rollout_id!r} is retired; it has no snapshot to read")
        version, snapshot_id = scan.version_and_id()
        manifest_key = _manifest_key(prefix, version, snapshot_id)
        if not sealed:
            return await self._snapshot_of(rollout_id, scan)
        if not scan.fence:
            if not (scan.contents or scan.retired):  # folder markers alone: nothing written
                raise SnapshotNotSealedError(
                    f"rollout {rollout_id!r} has no objects under {prefix!r}: never written, or deleted "
                    "(a mistyped id or root reads like this too)",
                    state="open",
                    key=manifest_key,
                )
            raise SnapshotNotSealedError(
                f"rollout {rollout_id!r} is open (never frozen): it has no sealed snapshot; freeze it first, "
                "or read its current state with sealed=False",
                state="open",
                key=manifest_key,
            )
        if all(item.key != manifest_key for item in scan.snaps):
            sealed_versions = sorted(item.key[len(prefix) + len("snap/") :] for item in scan.snaps)
            newest = (
                f"; the newest sealed manifest is snap/{sealed_versions[-1]}"
                if sealed_versions
                else "; no sealed manifest exists (its freeze did not finish)"
            )
            raise SnapshotNotSealedError(
                f"rollout {rollout_id!r} changed since its freeze: its listed state (version {version}, snapshot "
                f"{snapshot_id}) has no sealed manifest{newest}; freeze it again, or read it with sealed=False",
                state="changed",
                key=manifest_key,
            )
        objects = sorted(item.key[len(prefix) :] for item in scan.log + scan.foreign)
        limit = _MANIFEST_BASE_BYTES + _MANIFEST_BYTES_PER_OBJECT * len(objects)
        # Both always finish (a failure of one never leaves the other running unobserved); the
        # manifest's error is the one raised when both fail.
        manifest, snapshot = await asyncio.gather(
            self._read_manifest(manifest_key, limit), self._snapshot_of(rollout_id, scan), return_exceptions=True
        )
        for outcome in (manifest, snapshot):
            if isinstance(outcome, BaseException):
                raise outcome
        assert isinstance(manifest, _Manifest) and isinstance(snapshot, FrozenSnapshot)
        problem = ""
        if manifest.format != _MANIFEST_FORMAT:
            problem = f"its format is {manifest.format!r}, not {_MANIFEST_FORMAT!r}"
        elif manifest.rollout_id != rollout_id:
            problem = f"it names rollout {manifest.rollout_id!r}"
        elif (manifest.version, manifest.snapshot_id) != (version, snapshot_id):
            problem = f"it names version {manifest.version} and snapshot {manifest.snapshot_id!r}"
        elif [item.key for item in manifest.objects] != objects:
            problem = f"its {len(manifest.objects)} object keys are not the {len(objects)} listed ones"
        if problem:
            raise StoreError(
                f"sealed manifest {manifest_key} does not match the listing of rollout {rollout_id!r} "
                f"(version {version}, snapshot {snapshot_id}): {problem}; it is damaged or not s3capture's "
                f"({_MANIFEST_REMEDY})",
                operation="GET",
                key=manifest_key,
            )
        return snapshot

    async def _read_manifest(self, key: str, limit: int) -> _Manifest:
        """The sealed manifest at ``key``; ``StoreError`` naming the key when it vanished, is larger
        than ``limit`` bytes, or is not a manifest."""
        try:
            data = await self._get(key, limit)
        except RecordError as error:
            raise StoreError(
                f"sealed manifest {key} is unreadable: {error} ({_MANIFEST_REMEDY})", operation="GET", key=key
            ) from None
        if data is None:
            raise StoreError(
                f"sealed manifest {key} was listed but vanished (the rollout is being dropped, retired or deleted)",
                operation="GET",
                key=key,
            )
        try:
            return msgspec.json.decode(data, type=_Manifest)
        except (msgspec.DecodeError, RecursionError) as error:  # RecursionError: nested past the stack
            raise StoreError(
                f"sealed manifest {key} is not an s3capture manifest: {error} ({_MANIFEST_REMEDY})",
                operation="GET",
                key=key,
            ) from None

    async def _snapshot_of(self, rollout_id: str, scan: RolloutScan) -> FrozenSnapshot:
        """The snapshot of a scanned rollout: the one builder ``freeze`` and ``read_snapshot`` share.

        Loads every listed entry (cache, else one GET each, in parallel), judges the log (conflicting
        payloads, dangling intents, markers, foreign, unreadable, vanished and misfiled objects,
        missing parents and broken delta chains), derives ``version`` and ``snapshot_id`` from the
        listing and hands the chosen entries out in ``entry_type``. Reads only; touches no freeze
        bookkeeping. Raises ``StoreError`` when the store fails.
        """
        prefix = scan.prefix
        reasons: list[str] = []
        plen = len(prefix)
        # call id -> SHA-256 -> every listed key holding those bytes, with its fingerprint (a copy
        # under another fingerprint's key has the same SHA-256 and must be read and judged too).
        # Each key was parsed once, by the scan.
        by_call: dict[str, dict[str, list[tuple[ListedObject, str]]]] = {}
        intents: set[str] = set()
        for item, (kind, cid, fp, sha) in zip(scan.log, scan.parsed):
            if kind == "e":
                by_call.setdefault(cid, {}).setdefault(sha, []).append((item, fp))
            elif kind == "i":
                intents.add(cid)
            else:
                reasons.append(f"marked_incomplete:{cid}")
        for item in scan.foreign:
            reasons.append(f"foreign_object:{item.key[plen:]}")

        wanted = [
            (item, cid, fp, sha)
            for cid, variants in by_call.items()
            for sha, items in variants.items()
            for item, fp in items
        ]
        # Cached entries are taken without a task each (a warm freeze is one LIST and no GET); only
        # the misses are fetched, in parallel.
        loaded: list[tuple[_Stored | None, str]] = [(None, "")] * len(wanted)
        misses: list[int] = []
        cache = self._cache
        for index, (item, _, _, _) in enumerate(wanted):
            stored = cache.get(item.key)
            if stored is None:
                misses.append(index)
            else:
                loaded[index] = (stored, "")

        async def load(item: ListedObject, sha: str) -> tuple[_Stored | None, str]:
            try:
                stored = await self._load(item.key, sha, item.size)
            except RecordError as error:
                return None, f"unreadable:{item.key[plen:]}:{error}"
            if stored is None:
                return None, f"vanished:{item.key[plen:]}"
            return stored, ""

        if misses:
            # A store error of one GET cancels the others and is raised at once (gather_fail_fast).
            fetched = await gather_fail_fast(load(wanted[i][0], wanted[i][3]) for i in misses)
            for index, result in zip(misses, fetched):
                loaded[index] = result
        payloads: dict[str, dict[str, tuple[str, _Stored]]] = {}
        for (item, cid, fp, sha), (stored, problem) in zip(wanted, loaded):
            if problem:
                reasons.append(problem)
                continue
            assert stored is not None
            entry = stored.entry
            if entry.rollout_id != rollout_id or entry.model_call_id != cid or entry.continuation_fingerprint != fp:
                reasons.append(f"misfiled:{item.key[plen:]}")
                continue
            payloads.setdefault(cid, {})[sha] = (item.key, stored)
        chosen: list[tuple[str, str, _Stored]] = []
        for cid in sorted(by_call):
            if len(by_call[cid]) > 1:
                reasons.append(f"conflicting_payloads:{cid}")
                continue
            if cid in payloads and len(payloads[cid]) == 1:
                ((sha, (key, stored)),) = payloads[cid].items()
                chosen.append((key, sha, stored))
        for cid in sorted(intents - by_call.keys()):
            reasons.append(f"dangling_intent:{cid}")
        present = {stored.entry.model_call_id for _, _, stored in chosen}
        for _, _, stored in chosen:
            entry = stored.entry
            if entry.parent_call_id is not None and entry.parent_call_id not in present:
                # A continuation whose parent is not in the snapshot: the chain has a hole (a lost
                # entry, or a listing that skipped a key), whatever the prompt's storage.
                reasons.append(f"missing_parent:{entry.model_call_id}")
                if entry.prompt_is_delta:
                    # Its prompt is only a suffix: it cannot even be rebuilt.
                    reasons.append(f"broken_chain:{entry.model_call_id}")
        version, snapshot_id = scan.version_and_id()
        reasons.sort()
        if self.entry_type == "gym":
            out: tuple[Any, ...] = tuple(to_gym(stored.entry) for _, _, stored in chosen)
        else:
            out = tuple(await self._hand_out(chosen))
        return FrozenSnapshot(rollout_id, out, bool(reasons), snapshot_id, version, tuple(reasons))

    async def _hand_out(self, chosen: list[tuple[str, str, _Stored]]) -> list[TokenEntry]:
        """The entries a snapshot returns, none of which shares a mutable part with what internal
        readers use.

        Internal readers (``resolve``, delta chains, ``freeze``'s checks) use only an entry's
        scalar fields and its token-id lists. So the first hand-out of a cached entry is a shallow
        copy with its own token-id and log-probability lists (microseconds, not a validated
        re-decode); its nested ``output_items``, ``routed_experts`` and extra fields are shared with
        the cache, which marks the entry ``lent`` with a digest of their encoding (usually a few
        hundred bytes: no token lists). A later hand-out of a lent entry encodes those nested parts
        again: unchanged, it hands out a shallow copy whose nested parts are an independent decode
        of that encoding; changed or unencodable (a caller mutated a nested part in place), it
        drops the cached object and GETs the entry again. No caller ever sees another caller's
        mutations.
        """
        out: list[TokenEntry] = []
        refetch: list[tuple[int, str, str]] = []
        for key, sha, stored in chosen:
            nested = _nested_encoding(stored.entry)
            if nested is not None:
                if not stored.lent:
                    stored.lent = _nested_digest(nested)
                    out.append(_shallow_copy(stored.entry))
                    continue
                if _nested_digest(nested) == stored.lent:
                    out.append(_detached_copy(stored.entry, nested))
                    continue
            self._cache.discard(key)
            refetch.append((len(out), key, sha))
            out.append(stored.entry)  # placeholder, replaced below
        if refetch:
            # In parallel (the transport bounds the requests in flight): one GET after another
            # cost a round trip per entry a caller had changed (an audit, 2026-12-04: 42 round
            # trips for a repeat freeze of 40 such entries).
            limit = self._read_limit()

            async def again(key: str, sha: str) -> TokenEntry:
                try:
                    # Read as _load reads: bytes that fail their digest are read again first.
                    stored = await self._get_checked(key, limit, lambda data: self._decode_object(data, sha))
                except RecordError as error:
                    # The snapshot's id and reasons are decided already: this is the store failing.
                    raise StoreError(
                        f"{key} no longer reads as the entry its snapshot holds: {error}", operation="GET", key=key
                    ) from None
                if stored is None:
                    raise StoreError(f"{key} vanished while its snapshot was handed out", operation="GET", key=key)
                return stored.entry

            entries = await gather_fail_fast(again(key, sha) for _, key, sha in refetch)
            for (position, _, _), entry in zip(refetch, entries):
                out[position] = entry
        return out
