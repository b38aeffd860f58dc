"""The consistency and listing probes of ``s3capture doctor``: read-after-write, list-after-write,
listing order (``grade_order``, ``ORDER_KEYS``), string-prefix semantics and pagination."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from s3capture.doctor.framework import Probe, _DoctorBase
from s3capture.rollouts import _segment_after
from s3capture.transport import gather_settled

LIST_LAG_LIMIT = 5.0
"""Seconds a written key is waited for in a listing before the store is said never to show it."""


def _byte_order(keys: list[str]) -> list[str]:
    return sorted(keys, key=lambda k: k.encode())


def _tree_order(keys: list[str]) -> list[str]:
    return sorted(keys, key=lambda k: [s.encode() for s in k.split("/")])


def _segments_accepted(keys: list[str]) -> bool:
    """Whether ``S3TokenStore.rollouts`` accepts this listing order: the keys of each first
    segment are consecutive and the segments come in an order ``_segment_after`` allows."""
    previous: str | None = None
    done: set[str] = set()
    for key in keys:
        segment = key.split("/", 1)[0]
        if segment == previous:
            continue
        if segment in done or (previous is not None and not _segment_after(previous, segment)):
            return False
        if previous is not None:
            done.add(previous)
        previous = segment
    return True


ORDER_KEYS = ("a/x", "a/y", "a-b/x", "a.b/x", "a0/x", "B/x", "b/x", "_/x", "~/x", "\uff61/x", "\U0001f600/x")
"""Keys (under ``order/``) whose listing order tells S3's byte order of whole keys from a directory
walk ('a/x' vs 'a-b/x' and 'a.b/x'), from case-insensitive order ('B' vs 'a') and from UTF-16 order
(U+FF61 vs U+1F600). Every first segment stands for a rollout prefix."""


def grade_order(listed: list[str], written: tuple[str, ...] = ORDER_KEYS) -> Probe:
    """The ``listing-order`` probe for ``listed``, the order a store listed ``written`` in.

    ``ok`` for S3's byte order of whole keys; ``note`` for directory order (SeaweedFS), or another
    order in which the ASCII keys' first segments are still consecutive and ascending as
    ``S3TokenStore.rollouts`` requires (escaped ids are ASCII); ``fail`` otherwise, or when the
    listing lacks a key.
    """
    byte, tree = _byte_order(list(written)), _tree_order(list(written))
    data: dict[str, Any] = {"listed": listed}
    if sorted(listed) != sorted(written):
        data["order"] = "incomplete"
        return Probe(
            "listing-order",
            "fail",
            f"a listing of {len(written)} keys just written returned {len(listed)} of them",
            "the store's listing is incomplete; s3capture cannot work on it",
            data,
        )
    if listed == byte:
        data["order"] = "byte"
        return Probe("listing-order", "ok", "keys listed in S3's order (UTF-8 bytes of whole keys)", "", data)
    if listed == tree:
        data["order"] = "directory"
        return Probe(
            "listing-order",
            "note",
            "keys listed in directory order (segment by segment, as SeaweedFS walks its tree), not in "
            "S3's byte order of whole keys (e.g. 'a/x' before 'a-b/x')",
            "nothing to change: S3TokenStore.rollouts and s3capture export accept either order (they "
            "differ only where one rollout segment is another followed by '-' or '.'); every rollout "
            "is sorted after its listing",
            data,
        )
    data["order"] = "other"
    shown = " ".join(repr(k) for k in listed)
    if _segments_accepted([k for k in listed if k.isascii()]):
        return Probe(
            "listing-order",
            "note",
            f"keys listed in neither byte nor directory order ({shown}), but the ASCII rollout segments "
            "s3capture writes (ids are escaped to ASCII) come in an order it accepts",
            "nothing to change for s3capture; other tools that expect S3's byte order may not work",
            data,
        )
    return Probe(
        "listing-order",
        "fail",
        f"keys listed out of order: {shown}",
        "S3TokenStore.rollouts and s3capture export stream a listing rollout by rollout and refuse one "
        "whose rollout prefixes are not consecutive and ascending (ListingError): use a store that lists "
        "in S3's byte order (AWS S3, MinIO, Ceph RGW) or in directory order (SeaweedFS)",
        data,
    )


class _ConsistencyProbes(_DoctorBase):
    """The probes of what a listing or a GET shows right after a write, and how a listing is
    ordered and paged."""

    # ------------------------------------------------------------------ probes
    async def read_after_write(self) -> Probe:
        base = "rw/"
        stale = 0
        for i in range(self.samples):
            key = self.k(f"{base}{i:04d}")
            body = os.urandom(64) + str(i).encode()
            # Read once before its first PUT, as every put's GET of a fence that is not there yet: a
            # store that caches that 404 (AWS S3 before 2020) serves it after the PUT too, and a
            # late put is acknowledged after a freeze (a doctor breaker, 2026-12-03).
            await self.t.get(key)
            await self.timed("PUT", self.t.put(key, body))
            got = await self.timed("GET", self.t.get(key))
            if got != body:
                stale += 1
        fence = self.k(f"{base}fence")
        overwritten = True
        for i in range(3):  # the fence is rewritten in place: frozen, retired, frozen again
            body = b'{"state":"%d"}' % i
            await self.t.put(fence, body)
            if await self.t.get(fence) != body:
                overwritten = False
        absent = await self.t.get(self.k(f"{base}never-written"))
        for _ in range(self.samples):
            await self.timed("LIST", self.t.list_page(self.k(base), 1000))
        detail = (
            f"{self.samples - stale} of {self.samples} GETs right after their PUT returned the bytes (each "
            "key read once before its PUT, as a put reads a fence); "
            f"an overwritten object read back {'at once' if overwritten else 'STALE'}; "
            f"a key never written reads as {'absent' if absent is None else 'PRESENT'}"
        )
        data = {"stale_reads": stale, "overwrite_read_back": overwritten, "missing_key_absent": absent is None}
        if stale or not overwritten or absent is not None:
            return Probe(
                "read-after-write",
                "fail",
                detail,
                "s3capture needs strong read-after-write consistency, also after an overwrite (a rollout's "
                "fence is rewritten in place) and for a key read while it did not exist (no cached 404): use "
                "a store or gateway that offers it (AWS S3, GCS, MinIO, Ceph RGW, SeaweedFS)",
                data,
            )
        return Probe("read-after-write", "ok", detail, "", data)

    async def list_after_write(self) -> Probe:
        base = self.k("law/")
        rounds = min(self.samples, 10)
        lags: list[float] = []
        never = 0
        written: list[str] = []
        for i in range(rounds):
            key = f"{base}{i:04d}"
            await self.t.put(key, b"x")
            written.append(key)
            start = time.perf_counter()
            first = True
            while True:
                listed = set(await self.raw_list(base))
                if all(k in listed for k in written):
                    lags.append(0.0 if first else time.perf_counter() - start)
                    break
                first = False
                if time.perf_counter() - start > LIST_LAG_LIMIT:
                    never += 1
                    break
                await asyncio.sleep(0.02)
            if never:
                rounds = i + 1  # one key never listed is enough; do not wait for the others
                break
        # list-after-delete: the deleted keys must be gone from the next listing
        await self.t.delete(written)
        remaining = [k for k in await self.raw_list(base) if k in set(written)]
        late = [lag for lag in lags if lag > 0.0]
        data = {
            "rounds": rounds,
            "late": len(late),
            "max_lag_seconds": max(lags, default=0.0),
            "never_listed": never,
            "listed_after_delete": len(remaining),
        }
        first_missing = sum(1 for lag in lags if lag > 0.0)
        detail = (
            f"{rounds - first_missing - never} of {rounds} keys listed by the first LIST after their PUT"
            + (f"; {first_missing} appeared after up to {max(late) * 1000:.0f} ms" if late else "")
            + (f"; {never} never listed within {LIST_LAG_LIMIT:.0f} s" if never else "")
            + f"; {len(remaining)} of {len(written)} deleted keys still listed right after DeleteObjects"
        )
        if first_missing or never or remaining:
            return Probe(
                "list-after-write",
                "fail",
                detail,
                "by default s3capture relies on strong list-after-write (and list-after-delete) "
                "consistency: here a re-freeze, a ledger manifest or has_rows could miss another client's "
                "young write, a retire or delete could leave one behind, resolve could answer UNRESOLVED "
                "for a young parent, and a deleted rollout would still list; use a store that offers it, "
                "or disable the listing cache of the gateway in front of it. Where listings show new keys "
                "late but in the order they were written, build every client that freezes, reads "
                "manifests or removes with probe_listing=True (S3TokenStore(..., probe_listing=True), "
                "S3CaptureLedger(..., probe_listing=True), s3capture export --freeze --probe-listing): "
                "those calls then prove their listing fresh with a probe key",
                data,
            )
        return Probe("list-after-write", "ok", detail, "", data)

    async def listing_order(self) -> tuple[Probe, list[str]]:
        base = self.k("order/")
        await gather_settled(self.t.put(base + rel, b"o") for rel in ORDER_KEYS)
        listed = [k[len(base) :] for k in await self.raw_list(base)]
        return grade_order(listed), listed

    async def prefix(self) -> Probe:
        base = self.k("pfx")
        rels = ("/r1/a", "/r10/a", "/r1-x/a", "/r2/a", "0/a")
        await gather_settled(self.t.put(base + rel, b"p") for rel in rels)
        cases = {
            "/r1/": {"/r1/a"},
            "/r1": {"/r1/a", "/r10/a", "/r1-x/a"},
            "/": {"/r1/a", "/r10/a", "/r1-x/a", "/r2/a"},
        }
        missing: dict[str, list[str]] = {}
        extra: dict[str, list[str]] = {}
        for asked, wanted in cases.items():
            got = {k[len(base) :] for k in await self.raw_list(base + asked)}
            if wanted - got:
                missing[asked] = sorted(wanted - got)
            if got - wanted:
                extra[asked] = sorted(got - wanted)
        data = {"missing": missing, "outside_prefix": extra}
        if missing:
            asked = next(iter(missing))
            return Probe(
                "prefix",
                "fail",
                f"LIST Prefix='pfx{asked}' lacks {', '.join('pfx' + k for k in missing[asked])}",
                "s3capture needs string-prefix semantics of Prefix (rollouts(prefix=...) and export --prefix "
                "list a prefix that ends inside a segment): use a store whose Prefix is a string prefix",
                data,
            )
        if extra:
            asked = next(iter(extra))
            return Probe(
                "prefix",
                "note",
                f"LIST Prefix='pfx{asked}' also returned {', '.join('pfx' + k for k in extra[asked])}, outside the prefix",
                "nothing to change: the verified listing ignores and logs keys outside the prefix "
                "(they are never counted, masked or deleted), but every LIST carries them",
                data,
            )
        return Probe(
            "prefix",
            "ok",
            "LIST returns exactly the keys under the prefix, also for a prefix ending inside a segment "
            "('r1' lists r1/, r10/, r1-x/; 'r1/' only r1/)",
            "",
            data,
        )

    async def pagination(self, single: list[str]) -> Probe:
        base = self.k("order/")
        keys: list[str] = []
        pages = 0
        problems: list[str] = []
        token: str | None = None
        tokens: set[str] = set()
        biggest = 0
        while True:
            params: dict[str, Any] = {"Prefix": base, "MaxKeys": 2}
            if token:
                params["ContinuationToken"] = token
            page = await self.raw("list_objects_v2", **params)
            pages += 1
            contents = [item["Key"][len(base) :] for item in page.get("Contents", ()) or ()]
            biggest = max(biggest, len(contents))
            keys.extend(contents)
            if "IsTruncated" not in page:
                problems.append("a page without IsTruncated")
                break
            if not page["IsTruncated"]:
                break
            token = page.get("NextContinuationToken")
            if not token:
                problems.append("a truncated page without NextContinuationToken")
                break
            if token in tokens or pages > 100:
                problems.append("a repeated continuation token (a paging cycle)")
                break
            tokens.add(token)
        if len(keys) != len(set(keys)):
            problems.append("a key on two pages")
        if sorted(set(keys)) != sorted(single):
            problems.append(f"{len(set(single) - set(keys))} keys missing from the pages")
        if not problems and keys != single:
            problems.append("pages in another order than a single listing")
        # s3capture confirms where every listing ends with one more LIST after its last key
        # (StartAfter): a store that ignores StartAfter repeats the listing, and a listing it cuts
        # short can then hide a rollout's last keys, its markers and intents (a doctor breaker,
        # 2026-12-03, froze a marked rollout as complete on such a store that this probe passed).
        repeated: list[str] = []
        if single:
            after = await self.raw("list_objects_v2", Prefix=base, StartAfter=base + single[-1])
            listed = set(single)
            repeated = [k for item in after.get("Contents", ()) or () if (k := item["Key"][len(base) :]) in listed]
        data = {
            "pages": pages,
            "max_keys": 2,
            "largest_page": biggest,
            "keys": len(keys),
            "start_after_repeated": len(repeated),
        }
        if repeated:
            return Probe(
                "pagination",
                "fail",
                f"a LIST after the last key (StartAfter={single[-1]!r}) returned {len(repeated)} keys "
                "listed already: StartAfter is ignored",
                "s3capture confirms the end of every listing with a LIST after its last key; without "
                "StartAfter a listing cut short cannot be told from a whole one, and a rollout's last keys "
                "(markers, intents) could go unseen: use a store that honours StartAfter (AWS S3, GCS, "
                "MinIO, Ceph RGW, SeaweedFS)",
                data,
            )
        if problems:
            return Probe(
                "pagination",
                "fail",
                f"{len(single)} keys listed with MaxKeys=2 in {pages} pages: {'; '.join(problems)}",
                "s3capture pages every listing of more than 1,000 keys with continuation tokens: use a "
                "store whose ListObjectsV2 pagination works",
                data,
            )
        if biggest > 2:
            return Probe(
                "pagination",
                "note",
                f"MaxKeys=2 ignored (a page of {biggest} keys); continuation tokens work",
                "nothing to change: s3capture asks for 1,000 keys per page and reads what it gets",
                data,
            )
        return Probe(
            "pagination",
            "ok",
            f"{len(single)} keys in {pages} pages of at most 2 with continuation tokens, "
            "each once, in the order of a single listing; a LIST after the last key shows none again",
            "",
            data,
        )
