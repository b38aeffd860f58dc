"""``s3capture doctor``: probe an S3-compatible store for the properties s3capture relies on.

``diagnose(url)`` writes a few dozen small throwaway objects under
``<prefix>/_s3capture-doctor-<uuid>/``, measures how the store behaves, deletes everything it wrote
(in ``finally``, checked by a last listing) and returns a ``DoctorReport``: one ``Probe`` per
property with a verdict

- ``"ok"``: the store behaves as s3capture wants;
- ``"note"``: it differs from AWS S3, and s3capture copes (the detail says how);
- ``"fail"``: a property s3capture relies on is missing (the advice says what to change).

What is graded as a failure follows docs/design.md: strong read-after-write (also of an
overwrite: the fence is rewritten in place), list-after-write and list-after-delete consistency,
listings whose rollout prefixes come in an order ``S3TokenStore.rollouts`` accepts (S3's byte
order, or SeaweedFS's directory order), string-prefix semantics of ``Prefix`` (``rollouts(prefix=)``
lists a prefix that is not a whole segment), working pagination, and nothing left behind.
A key the chosen transport does not carry to the server byte for byte (``transport-keys``: obstore's
``Path`` refuses empty and dot segments and could encode characters) fails too.
Everything else (``//`` and dot-segment handling, checksum and Content-MD5 verification,
DeleteObjects, conditional writes, clock skew, latency) is reported as ``ok`` or ``note``:
the layout never builds ``//`` or dot segments, s3capture checks bodies itself (SHA-256 in keys,
MD5 ETags on GET), falls back to one DELETE per key, never uses conditional writes and never
compares two machines' clocks (except ``s3capture export --min-age``, which the skew probe notes).

Requests go through the transport capture runs on (``transport=``: ``"aioboto3"`` or
``"obstore"``; ``None`` reads ``S3CAPTURE_TRANSPORT``, default ``"aioboto3"``) for the timed
PUT/GET/LIST/DELETE, and through an aioboto3 transport's aiobotocore client directly (the same
transport when it is the one probed) where a probe needs what the transport deliberately hides:
the raw listing (keys outside the prefix, the order, the keys as the server stored them), headers
(``Date``, ``ETag``), wrong ``Content-MD5`` or checksum headers, ``If-None-Match: *`` and raw
``//`` keys. The clean-up deletes through that client too, so a key the probed transport changed
in transit is still deleted as the server stored it.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import hashlib
import os
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from s3capture.errors import StoreError, install_hint
from s3capture.layout import Layout
from s3capture.rollouts import _segment_after, parse_s3_url
from s3capture.transport import TRANSPORT_ENV, TRANSPORTS, Transport, make_transport

__all__ = [
    "PROBES",
    "VERDICTS",
    "DoctorReport",
    "Probe",
    "diagnose",
    "format_report",
    "grade_order",
    "layout_keys",
]

VERDICTS = ("ok", "note", "fail")

PROBES = (
    "read-after-write",
    "list-after-write",
    "listing-order",
    "prefix",
    "pagination",
    "double-slash",
    "dot-segments",
    "transport-keys",
    "content-md5",
    "checksum-headers",
    "default-checksums",
    "etag-md5",
    "delete-objects",
    "conditional-write",
    "clock-skew",
    "latency",
    "cleanup",
)
"""The probes of a report, in report order."""

LIST_LAG_LIMIT = 5.0
"""Seconds a written key is waited for in a listing before the store is said never to show it."""

SKEW_NOTE = 2.0
"""Seconds of clock skew (server ``Date`` against this machine) above which the skew is noted."""


KEY_ROOTS = ("", "plain", "a b/c+d", "x%y/\u00fc/z*!()@$", "t~/a=b&c/semi;colon", "quote\"s'/<a>/{b}|^`[c]")
KEY_IDS = ("r/with/slashes", "caf\u00e9 \u2603 ..", "~a%2Fb")
"""Roots and rollout ids (``tests/test_transport.py``'s ``ROOTS`` and ``IDS``) whose layout keys the
``transport-keys`` probe writes: characters a client could encode or refuse in the roots, escapes
(``.HH``, ``~``) in the ids."""


def layout_keys() -> list[str]:
    """Keys shaped as ``Layout`` builds them under every root of ``KEY_ROOTS``, one per id of
    ``KEY_IDS``: a fence, an entry (escaped fingerprint and call id) and a marker."""
    keys = []
    for root in KEY_ROOTS:
        layout = Layout(root)
        for rid, shape in zip(KEY_IDS, ("fence", "entry", "marker")):
            prefix = layout.rollout(rid)
            digest = hashlib.sha256(prefix.encode()).hexdigest()
            if shape == "fence":
                rel = "fence"
            elif shape == "entry":
                rel = layout.entry_rel(prefix, "fp \u2603", "c/1", digest)
            else:
                call = layout.marker_call_segment(prefix, "c:2 \u00e9")
                rel = f"log/x/{call}/{digest[:32]}"
            keys.append(prefix + rel)
    return keys


class Probe(msgspec.Struct, frozen=True):
    """One property probed: ``name`` (one of ``PROBES``), ``verdict`` (``"ok"``, ``"note"`` or
    ``"fail"``), ``detail`` (what was measured, one line), ``advice`` (what to change, or why
    nothing needs to; ``""`` when the verdict is ``ok``) and ``data`` (the measured values, JSON)."""

    name: str
    verdict: str
    detail: str
    advice: str = ""
    data: dict[str, Any] = {}


class DoctorReport(msgspec.Struct):
    """The result of ``diagnose``: the store probed and one ``Probe`` per property.

    ``transport`` is the transport the timed requests and ``transport-keys`` went through
    (``"aioboto3"`` or ``"obstore"``); ``probe_prefix`` the key prefix the throwaway objects were
    written under; ``left_behind`` the keys still listed under it after the clean-up (empty unless
    the ``cleanup`` probe failed).
    """

    url: str
    endpoint: str | None
    transport: str
    probe_prefix: str
    probes: list[Probe]
    left_behind: list[str] = []

    @property
    def ok(self) -> bool:
        """No probe failed."""
        return all(p.verdict != "fail" for p in self.probes)

    def probe(self, name: str) -> Probe:
        """The probe called ``name``; ``KeyError`` when the report has none."""
        for p in self.probes:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready builtins, with ``ok`` and verdict counts added."""
        data = msgspec.to_builtins(self)
        data["ok"] = self.ok
        data["counts"] = {v: sum(p.verdict == v for p in self.probes) for v in VERDICTS}
        return data


def _code(error: BaseException) -> str:
    response = getattr(error, "response", None) or {}
    return str(
        response.get("Error", {}).get("Code", "") or response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    )


def _status(error: BaseException) -> int:
    response = getattr(error, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 1))))
    return ordered[rank - 1]


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


class _Doctor:
    def __init__(
        self, transport: Transport, raw: Transport, root: str, samples: int, extra_client: Callable[[], Any]
    ) -> None:
        self.t = transport
        self.raw_t = raw
        """An aioboto3 transport (``transport`` itself when it is one): its client for raw requests."""
        self.bucket = transport.bucket
        self.root = root
        self.samples = samples
        self.extra_client = extra_client
        self.client: Any = None
        self.dates: list[tuple[float, float, float]] = []
        """(local time before, local time after, server Date) of raw answers."""
        self.latency: dict[str, list[float]] = {"PUT": [], "GET": [], "LIST": []}

    # ------------------------------------------------------------------ plumbing
    def _record_date(self, t0: float, t1: float, meta: dict) -> None:
        date = (meta.get("HTTPHeaders") or {}).get("date")
        if not date:
            return
        try:
            when = email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            return
        self.dates.append((t0, t1, when))

    async def raw(self, operation: str, **params: Any) -> dict:
        """One aiobotocore request (``operation`` is the client method name), Date recorded."""
        from botocore.exceptions import ClientError

        t0 = time.time()
        try:
            response = await getattr(self.client, operation)(Bucket=self.bucket, **params)
        except ClientError as error:
            self._record_date(t0, time.time(), (error.response or {}).get("ResponseMetadata", {}))
            raise
        self._record_date(t0, time.time(), response.get("ResponseMetadata", {}))
        return response

    async def raw_list(self, prefix: str, max_keys: int = 1000) -> list[str]:
        """Every key the store lists for ``prefix`` (all pages, unverified, in listing order)."""
        keys: list[str] = []
        token: str | None = None
        for _ in range(1000):
            params: dict[str, Any] = {"Prefix": prefix, "MaxKeys": max_keys}
            if token:
                params["ContinuationToken"] = token
            page = await self.raw("list_objects_v2", **params)
            keys.extend(item["Key"] for item in page.get("Contents", ()) or ())
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return keys
        raise StoreError(f"LIST {prefix!r} did not end after 1,000 pages", operation="LIST", key=prefix)

    async def timed(self, what: str, job: Awaitable[Any]) -> Any:
        start = time.perf_counter()
        result = await job
        self.latency[what].append(time.perf_counter() - start)
        return result

    def k(self, rel: str) -> str:
        return self.root + rel

    # ------------------------------------------------------------------ probes
    async def read_after_write(self) -> Probe:
        base = "rw/"
        stale = 0
        for i in range(self.samples):
            key = self.k(f"{base}{i:04d}")
            body = os.urandom(64) + str(i).encode()
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
            f"{self.samples - stale} of {self.samples} GETs right after their PUT returned the bytes; "
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
                "fence is rewritten in place): use a store or gateway that offers it (AWS S3, GCS, MinIO, "
                "Ceph RGW, SeaweedFS)",
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
                "s3capture needs strong list-after-write (and list-after-delete) consistency: a freeze "
                "would miss another client's young entry and a deleted rollout would still list; use a "
                "store that offers it, or disable the listing cache of the gateway in front of it",
                data,
            )
        return Probe("list-after-write", "ok", detail, "", data)

    async def listing_order(self) -> tuple[Probe, list[str]]:
        base = self.k("order/")
        await asyncio.gather(*(self.t.put(base + rel, b"o") for rel in ORDER_KEYS))
        listed = [k[len(base) :] for k in await self.raw_list(base)]
        return grade_order(listed), listed

    async def prefix(self) -> Probe:
        base = self.k("pfx")
        rels = ("/r1/a", "/r10/a", "/r1-x/a", "/r2/a", "0/a")
        await asyncio.gather(*(self.t.put(base + rel, b"p") for rel in rels))
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
        data = {"pages": pages, "max_keys": 2, "largest_page": biggest, "keys": len(keys)}
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
            "each once, in the order of a single listing",
            "",
            data,
        )

    async def _odd_keys(self, name: str, base: str, rels: tuple[str, ...], what: str) -> Probe:
        outcome: dict[str, str] = {}
        for rel in rels:
            try:
                await self.raw("put_object", Key=base + rel, Body=b"k")
            except Exception as error:  # noqa: BLE001 - refused keys are an outcome
                outcome[rel] = f"refused ({_code(error) or type(error).__name__})"
        listed = [k[len(base) :] for k in await self.raw_list(base)]
        for rel in rels:
            outcome.setdefault(rel, "kept verbatim" if rel in listed else "rewritten")
        data = {"put": list(rels), "listed": listed, "outcome": outcome}
        shown = "; ".join(f"{rel!r}: {how}" for rel, how in outcome.items())
        if listed and all(how.startswith("rewritten") for how in outcome.values()):
            shown += f" (listed as {', '.join(repr(k) for k in listed)})"
        if all(how == "kept verbatim" for how in outcome.values()):
            return Probe(name, "ok", f"keys with {what} are kept verbatim ({shown})", "", data)
        return Probe(
            name,
            "note",
            f"keys with {what} are not kept verbatim: {shown}",
            f"nothing to change: s3capture's layout never builds {what} (ids are escaped) and refuses a "
            "prefix that contains them",
            data,
        )

    async def double_slash(self) -> Probe:
        return await self._odd_keys("double-slash", self.k("dd/"), ("a//x",), "'//'")

    async def dot_segments(self) -> Probe:
        return await self._odd_keys("dot-segments", self.k("dot/"), ("s/./x", "s/t/../y"), "'.' or '..' segments")

    async def transport_keys(self) -> Probe:
        base = self.k("keys/")
        keys = layout_keys()
        bodies = {rel: rel.encode() + os.urandom(8) for rel in keys}
        refused: dict[str, str] = {}

        async def put(rel: str) -> None:
            try:
                await self.t.put(base + rel, bodies[rel])
            except Exception as error:  # noqa: BLE001 - a refused key is an outcome
                refused[rel] = str(error).split("\n", 1)[0][:200]

        await asyncio.gather(*(put(rel) for rel in keys))
        unread = []
        for rel in keys:
            if rel not in refused:
                try:
                    got = await self.t.get(base + rel)
                except StoreError:
                    got = None
                if got != bodies[rel]:
                    unread.append(rel)
        listed = [k[len(base) :] for k in await self.raw_list(base)]
        changed = [rel for rel in keys if rel not in refused and rel not in listed]
        instead = [rel for rel in listed if rel not in bodies]
        name = self.t.name
        data = {
            "transport": name,
            "keys": len(keys),
            "refused": refused,
            "changed": changed,
            "unread": unread,
            "listed_instead": instead,
        }
        if not (refused or changed or unread):
            return Probe(
                "transport-keys",
                "ok",
                f"{len(keys)} keys shaped like the layout's ({len(KEY_ROOTS)} roots with spaces, '%', '+', "
                f"non-ASCII and punctuation; escaped ids) written through the {name} transport reached the "
                "server byte for byte and read back through it",
                "",
                data,
            )
        problems = []
        if refused:
            rel = next(iter(refused))
            problems.append(f"{len(refused)} refused (first: {rel!r}: {refused[rel]})")
        if changed:
            problems.append(f"{len(changed)} stored under another key (first: {changed[0]!r})")
        if instead:
            problems.append(f"listed instead: {', '.join(repr(k) for k in instead[:3])}")
        if unread:
            problems.append(f"{len(unread)} not read back with the bytes written (first: {unread[0]!r})")
        if name == "aioboto3":
            advice = (
                "s3capture writes keys of these shapes and finds them again by listing: use a store (or a "
                "proxy in front of it) that keeps keys byte for byte"
            )
        else:
            advice = (
                f"the {name} transport does not carry s3capture's keys to this store unchanged: use the "
                "aioboto3 transport (S3CAPTURE_TRANSPORT=aioboto3, or transport='aioboto3'; check it with "
                "s3capture doctor --transport aioboto3)"
            )
        return Probe(
            "transport-keys",
            "fail",
            f"of {len(keys)} keys shaped like the layout's written through the {name} transport: "
            + "; ".join(problems),
            advice,
            data,
        )

    async def content_md5(self) -> Probe:
        key = self.k("md5/wrong")
        body = b"content-md5 probe"
        wrong = base64.b64encode(hashlib.md5(b"other bytes", usedforsecurity=False).digest()).decode()
        try:
            await self.raw("put_object", Key=key, Body=body, ContentMD5=wrong)
        except Exception as error:  # noqa: BLE001
            code = _code(error)
            if code in ("BadDigest", "InvalidDigest", "400"):
                return Probe(
                    "content-md5",
                    "ok",
                    f"a PUT with a wrong Content-MD5 is refused ({code})",
                    "",
                    {"verified": True, "code": code},
                )
            return Probe(
                "content-md5",
                "note",
                f"a PUT with a wrong Content-MD5 failed with {code or type(error).__name__}",
                "nothing to change: s3capture sends Content-MD5 only with DeleteObjects",
                {"verified": None, "code": code},
            )
        return Probe(
            "content-md5",
            "note",
            "a PUT with a wrong Content-MD5 is accepted (not verified)",
            "nothing to change: s3capture does not rely on it; readers check every entry's SHA-256 (in its "
            "key) and GET bodies against MD5 ETags",
            {"verified": False},
        )

    async def checksum_headers(self) -> Probe:
        key = self.k("crc/wrong")
        body = b"checksum probe"
        right = zlib.crc32(body)
        wrong = base64.b64encode(((right ^ 0xFFFFFFFF) & 0xFFFFFFFF).to_bytes(4, "big")).decode()
        try:
            await self.raw("put_object", Key=key, Body=body, ChecksumCRC32=wrong)
        except Exception as error:  # noqa: BLE001
            code = _code(error)
            if code in ("BadDigest", "InvalidDigest", "InvalidRequest", "XAmzContentChecksumMismatch", "400"):
                return Probe(
                    "checksum-headers",
                    "ok",
                    f"a PUT with a wrong x-amz-checksum-crc32 is refused ({code})",
                    "",
                    {"verified": True, "code": code},
                )
            return Probe(
                "checksum-headers",
                "note",
                f"a PUT with a wrong x-amz-checksum-crc32 failed with {code or type(error).__name__}",
                "nothing to change: s3capture sends no x-amz-checksum-* headers",
                {"verified": None, "code": code},
            )
        return Probe(
            "checksum-headers",
            "note",
            "a PUT with a wrong x-amz-checksum-crc32 is accepted (header ignored)",
            "nothing to change: s3capture sends no x-amz-checksum-* headers (request_checksum_calculation="
            "'when_required') and checks bodies itself",
            {"verified": False},
        )

    async def default_checksums(self) -> Probe:
        key = self.k("crc/default")
        body = b"default checksum probe" * 10
        try:
            async with self.extra_client() as client:
                await client.put_object(Bucket=self.bucket, Key=key, Body=body)
                got = await client.get_object(Bucket=self.bucket, Key=key)
                async with got["Body"] as stream:
                    data = await stream.read()
        except Exception as error:  # noqa: BLE001
            code = _code(error) or type(error).__name__
            return Probe(
                "default-checksums",
                "note",
                f"a PUT or GET with botocore's default flexible checksums (request_checksum_calculation='when_supported') fails: {code}",
                "keep request_checksum_calculation='when_required' and response_checksum_validation="
                "'when_required' (s3capture's default_botocore_config); a botocore_config of your own must "
                "set them too",
                {"accepted": False, "code": code},
            )
        if data != body:
            return Probe(
                "default-checksums",
                "note",
                "an object PUT with botocore's default flexible checksums reads back with other bytes "
                "(e.g. the aws-chunked framing was stored)",
                "keep request_checksum_calculation='when_required' (s3capture's default_botocore_config); "
                "a botocore_config of your own must set it too",
                {"accepted": True, "intact": False},
            )
        return Probe(
            "default-checksums",
            "ok",
            "botocore's default flexible checksums (request_checksum_calculation='when_supported': a CRC32 with each PUT, checked on GET) are accepted",
            "",
            {"accepted": True, "intact": True},
        )

    async def etag_md5(self) -> Probe:
        key = self.k("etag/x")
        body = b"etag probe " * 7
        response = await self.raw("put_object", Key=key, Body=body)
        etag = str(response.get("ETag", "")).strip('"').lower()
        md5 = hashlib.md5(body, usedforsecurity=False).hexdigest()
        head = await self.raw("head_object", Key=key)
        etag_head = str(head.get("ETag", "")).strip('"').lower()
        data = {"etag": etag, "md5": md5, "head_etag": etag_head}
        if etag == md5 and etag_head == md5:
            return Probe("etag-md5", "ok", "a single-part object's ETag is the MD5 of its bytes", "", data)
        if len(etag_head) == 32 and all(c in "0123456789abcdef" for c in etag_head):
            return Probe(
                "etag-md5",
                "note",
                f"ETag {etag_head} looks like an MD5 but is not the MD5 of the bytes",
                "every GET is read twice before its bytes are trusted (the transport re-reads a body that "
                "does not match an MD5-shaped ETag); disable SSE-KMS/SSE-C or any ETag rewriting if you can",
                data,
            )
        return Probe(
            "etag-md5",
            "note",
            f"ETag {etag_head!r} is not an MD5",
            "nothing to change: GET bodies are then checked by length only (entries still by SHA-256)",
            data,
        )

    async def delete_objects(self) -> Probe:
        from botocore.exceptions import ClientError

        base = self.k("del/")
        keys = [f"{base}{i}" for i in range(3)]
        await asyncio.gather(*(self.t.put(k, b"d") for k in keys))
        data: dict[str, Any] = {}
        try:
            response = await self.raw(
                "delete_objects",
                Delete={"Objects": [{"Key": k} for k in keys] + [{"Key": base + "never"}], "Quiet": True},
            )
        except ClientError as error:
            code = _code(error)
            data = {"supported": False, "code": code}
            await self.t.delete(keys)  # the transport's own fallback
            fallback = "s3capture falls back to one DELETE per key (retire, delete and drop send more requests)"
            advice = (
                f"{fallback}; to keep the batches, grant s3:DeleteObject on the bucket's ARN too "
                "(arn:aws:s3:::BUCKET: the Ceph gateway checks DeleteObjects against it; docs/permissions.md)"
                if code == "AccessDenied"
                else f"nothing to change: {fallback}"
            )
            return Probe("delete-objects", "note", f"DeleteObjects is refused ({code})", advice, data)
        errors = list(response.get("Errors", ()) or ())
        left = await self.raw_list(base)
        gone = []
        for k in keys:
            try:
                await self.raw("head_object", Key=k)
            except ClientError as error:
                if _status(error) == 404 or _code(error) in ("404", "NoSuchKey", "NotFound"):
                    gone.append(k)
                else:
                    raise
        data = {"supported": True, "errors": [dict(e) for e in errors], "listed_after": len(left), "gone": len(gone)}
        if errors or left or len(gone) != len(keys):
            return Probe(
                "delete-objects",
                "fail",
                f"DeleteObjects answered {len(errors)} errors; {len(left)} keys still listed and "
                f"{len(keys) - len(gone)} still readable after it",
                "s3capture's delete and retire must leave nothing under a rollout: use a store whose "
                "DeleteObjects deletes (a missing key is not an error)",
                data,
            )
        return Probe(
            "delete-objects",
            "ok",
            "DeleteObjects (with Content-MD5) deletes every key at once; a missing key is no error; the "
            "keys are gone from the next LIST and GET",
            "",
            data,
        )

    async def conditional_write(self) -> Probe:
        key = self.k("cond/x")
        try:
            await self.raw("put_object", Key=key, Body=b"first", IfNoneMatch="*")
        except Exception as error:  # noqa: BLE001
            code = _code(error) or type(error).__name__
            return Probe(
                "conditional-write",
                "note",
                f"a PUT with If-None-Match: * on a new key is refused ({code})",
                "nothing to change: s3capture never uses conditional writes",
                {"supported": False, "code": code},
            )
        try:
            await self.raw("put_object", Key=key, Body=b"second", IfNoneMatch="*")
        except Exception as error:  # noqa: BLE001
            code = _code(error) or type(error).__name__
            if _status(error) == 412 or code == "PreconditionFailed":
                return Probe(
                    "conditional-write",
                    "ok",
                    "If-None-Match: * on PUT is honoured (412 on an existing key); s3capture does not use it",
                    "",
                    {"supported": True, "code": code},
                )
            return Probe(
                "conditional-write",
                "note",
                f"a second PUT with If-None-Match: * failed with {code}, not 412",
                "nothing to change: s3capture never uses conditional writes",
                {"supported": None, "code": code},
            )
        return Probe(
            "conditional-write",
            "note",
            "If-None-Match: * on PUT is ignored (a second PUT overwrote the object)",
            "nothing to change: s3capture never uses conditional writes (no compare-and-swap is assumed)",
            {"supported": False},
        )

    def clock_skew(self) -> Probe:
        if not self.dates:
            return Probe(
                "clock-skew",
                "note",
                "the store sent no Date header",
                "nothing to change for capture; s3capture export --min-age compares object LastModified "
                "with this machine's clock",
                {"samples": 0},
            )
        # The server's time at its answer is in [Date, Date + 1) (1 s resolution), ours in [t0, t1].
        low = max(date - t1 for t0, t1, date in self.dates)
        high = min(date + 1.0 - t0 for t0, t1, date in self.dates)
        if low > high:  # inconsistent samples (a server rounding its Date): the median, to the second
            mids = sorted(date + 0.5 - (t0 + t1) / 2 for t0, t1, date in self.dates)
            low, high = mids[len(mids) // 2] - 0.5, mids[len(mids) // 2] + 0.5
        skew = (low + high) / 2
        bound = (high - low) / 2
        data = {"skew_seconds": round(skew, 3), "uncertainty_seconds": round(bound, 3), "samples": len(self.dates)}
        detail = f"server Date {skew:+.1f} s (±{bound:.1f} s) from this machine's clock, over {len(self.dates)} answers"
        if abs(skew) - bound > SKEW_NOTE:
            return Probe(
                "clock-skew",
                "note",
                detail,
                "capture never compares two clocks; s3capture export --min-age compares object LastModified "
                "(server clock) with this machine's clock: sync the clocks (NTP) or raise --min-age well "
                "above the skew. SigV4 refuses requests beyond 15 minutes of skew",
                data,
            )
        return Probe("clock-skew", "ok", detail, "", data)

    def latency_probe(self) -> Probe:
        data: dict[str, Any] = {}
        parts = []
        for what, values in self.latency.items():
            p = {f"p{q}": round(_percentile(values, q / 100) * 1000, 2) for q in (50, 90, 99)}
            data[what] = {**p, "samples": len(values)}
            parts.append(f"{what} p50 {p['p50']:.1f} / p90 {p['p90']:.1f} / p99 {p['p99']:.1f} ms")
        data["transport"] = self.t.name
        detail = "; ".join(parts) + f" (n={self.samples}, sequential, small objects, {self.t.name} transport)"
        return Probe("latency", "ok", detail, "", data)


async def diagnose(
    url: str,
    *,
    endpoint_url: str | None = None,
    session: Any = None,
    samples: int = 20,
    transport: str | None = None,
) -> DoctorReport:
    """Probe the store of ``url`` (``s3://bucket[/prefix]``) and return a ``DoctorReport``.

    Writes small throwaway objects under ``<prefix>/_s3capture-doctor-<uuid>/`` only, and deletes
    them all before returning (the ``cleanup`` probe fails, and ``left_behind`` names them, when a
    final listing still shows some). ``samples`` (1 to 1,000) is the number of PUT/GET/LIST
    requests timed for the latency percentiles (the whole run sends about 4 x ``samples`` + 120
    requests). ``endpoint_url``: the S3 endpoint (``None``: AWS S3, or ``AWS_ENDPOINT_URL``);
    ``session``: an ``aioboto3.Session`` (``None``: the standard credential chain).
    ``transport``: the transport probed, ``"aioboto3"`` or ``"obstore"`` (``None``:
    ``S3CAPTURE_TRANSPORT``, else ``"aioboto3"``): the timed PUT/GET/LIST/DELETE and the
    ``transport-keys`` probe go through it, raw requests through an aioboto3 transport's client.

    Raises ``ValueError`` for a bad URL (one inside a root's ``rollouts/`` included), sample count
    or transport name, ``ImportError`` (with the
    install command) for ``"obstore"`` without obstore, and ``StoreError`` (one line) when the store
    cannot be used at all: a missing bucket, refused credentials, an unreachable endpoint, or a
    refused PUT (no write permission).
    """
    bucket, prefix = parse_s3_url(url)
    if "rollouts" in prefix.split("/"):
        # Its probe objects would be foreign objects of a live rollout (masking a freeze that
        # lists them, failing a drop) or of a root nested in another's rollouts.
        raise ValueError(
            f"{url} lies inside a root's rollouts (a 'rollouts' path segment): probe the root itself, "
            "or a prefix beside it"
        )
    Layout(prefix)  # ValueError for a prefix no store accepts ('//', '.' or '..' segments, ...), as every command
    if not isinstance(samples, int) or not 1 <= samples <= 1000:
        raise ValueError(f"samples must be an integer from 1 to 1000, got {samples!r}")
    root = f"{prefix}/" if prefix else ""
    probe_root = f"{root}_s3capture-doctor-{uuid.uuid4().hex[:12]}/"
    if session is None:
        import aioboto3

        session = aioboto3.Session()
    probed = make_transport(transport, bucket, endpoint_url=endpoint_url, session=session, max_concurrency=16)
    if probed.name == "aioboto3":
        raw = probed
    else:
        raw = make_transport("aioboto3", bucket, endpoint_url=endpoint_url, session=session, max_concurrency=16)

    def extra_client(attempts: int = 2, connect_timeout: float = 5) -> Any:
        """A separate aiobotocore client with botocore's default (flexible) checksums."""
        from botocore.config import Config

        settings: dict[str, Any] = {
            "retries": {"mode": "standard", "max_attempts": attempts},
            "connect_timeout": connect_timeout,
            "read_timeout": 30,
            "request_checksum_calculation": "when_supported",  # botocore's own default, not s3capture's
            "response_checksum_validation": "when_supported",
        }
        if endpoint_url:
            settings["s3"] = {"addressing_style": "path"}
        return session.client("s3", endpoint_url=endpoint_url, config=Config(**settings))

    doctor = _Doctor(probed, raw, probe_root, samples, extra_client)
    probes: list[Probe] = []
    left: list[str] = []
    reached = False
    try:
        await _preflight(raw, extra_client, probe_root)  # a missing bucket, refused credentials: StoreError
        reached = True
        doctor.client = await raw.client()
        await probed.put(probe_root + "hello", b"s3capture doctor")  # no write permission: StoreError

        async def run(name: str, job: Callable[[], Awaitable[Probe]]) -> Probe:
            try:
                probe = await job()
            except StoreError as error:
                if "refused" in str(error) or "does not exist" in str(error):
                    raise
                probe = Probe(
                    name,
                    "fail",
                    f"the probe failed: {error}",
                    "see the error; the store may be unreachable or overloaded",
                )
            except Exception as error:  # noqa: BLE001 - one broken probe must not hide the others
                probe = Probe(
                    name,
                    "fail",
                    f"the probe failed: {type(error).__name__}: {error}",
                    "see the error; the store answered something unexpected",
                )
            probes.append(probe)
            return probe

        await run("read-after-write", doctor.read_after_write)
        await run("list-after-write", doctor.list_after_write)
        listed: list[str] = []

        async def order() -> Probe:
            probe, got = await doctor.listing_order()
            listed.extend(got)
            return probe

        await run("listing-order", order)
        await run("prefix", doctor.prefix)
        await run("pagination", lambda: doctor.pagination(listed or list(ORDER_KEYS)))
        await run("double-slash", doctor.double_slash)
        await run("dot-segments", doctor.dot_segments)
        await run("transport-keys", doctor.transport_keys)
        await run("content-md5", doctor.content_md5)
        await run("checksum-headers", doctor.checksum_headers)
        await run("default-checksums", doctor.default_checksums)
        await run("etag-md5", doctor.etag_md5)
        await run("delete-objects", doctor.delete_objects)
        await run("conditional-write", doctor.conditional_write)
        probes.append(doctor.clock_skew())
        probes.append(doctor.latency_probe())
    finally:
        try:
            if reached:  # nothing was written before the store answered
                left = await _clean(doctor, probe_root)
        finally:
            try:
                await probed.close()
            finally:
                if raw is not probed:
                    await raw.close()
    if probes:
        if left:
            probes.append(
                Probe(
                    "cleanup",
                    "fail",
                    f"{len(left)} objects left under {probe_root} after deleting everything listed there "
                    f"(first: {left[0]!r})",
                    "delete them by hand; the store's DELETE or listing does not behave",
                    {"left": left[:100]},
                )
            )
        else:
            probes.append(
                Probe(
                    "cleanup",
                    "ok",
                    f"every object under {probe_root} deleted; a final LIST shows none",
                    "",
                    {"left": []},
                )
            )
    return DoctorReport(
        url=url,
        endpoint=endpoint_url,
        transport=probed.name,
        probe_prefix=probe_root,
        probes=probes,
        left_behind=left,
    )


async def _preflight(transport: Transport, extra_client: Callable[..., Any], probe_root: str) -> None:
    """One LIST of the probe prefix with at most two attempts and short timeouts, so a missing
    bucket, refused credentials or an unreachable endpoint is one line within seconds (the
    transport's own retries would take half a minute for an endpoint nobody listens on).
    Raises ``StoreError``."""
    from botocore.exceptions import BotoCoreError, ClientError

    async with extra_client(attempts=2, connect_timeout=3) as client:
        try:
            await client.list_objects_v2(Bucket=transport.bucket, Prefix=probe_root, MaxKeys=1)
        except ClientError as error:
            raise transport._wrap(error, "LIST", probe_root) from None
        except BotoCoreError as error:
            if type(error).__name__ == "NoCredentialsError":  # the same line as every other command's
                raise transport._wrap(error, "LIST", probe_root) from None
            where = transport.endpoint_url or "AWS S3"
            raise StoreError(f"cannot reach {where}: {error}", operation="LIST", key=probe_root) from None


async def _clean(doctor: _Doctor, probe_root: str) -> list[str]:
    """Delete everything under ``probe_root`` (through the raw transport: a key the probed
    transport changed in transit is deleted as listed); return what a final listing still shows."""
    if doctor.client is None:
        try:
            doctor.client = await doctor.raw_t.client()
        except Exception:  # noqa: BLE001 - nothing was written without a client
            return []
    left: list[str] = []
    for attempt in range(4):
        try:
            keys = await doctor.raw_list(probe_root)
        except Exception:  # noqa: BLE001 - a bucket that does not exist holds nothing of ours
            return left
        if not keys:
            return []
        left = keys
        if attempt == 3:
            break
        try:
            await doctor.raw_t.delete(keys)
        except StoreError:
            for key in keys:
                try:
                    await doctor.raw_t.delete_one(key)
                except StoreError:
                    pass
        await asyncio.sleep(0.05 * attempt)
    return left


def format_report(report: DoctorReport) -> str:
    """The report as a table (probe, verdict, detail), then the advice of every note and failure
    and a last line: ``verdict: OK`` or ``verdict: FAIL (<n> failed)``."""
    lines = [
        f"s3capture doctor: {report.url} on {report.endpoint or 'AWS S3'} "
        f"(transport: {report.transport}; probe prefix {report.probe_prefix})",
        "",
    ]
    width = max((len(p.name) for p in report.probes), default=10)
    lines.append(f"{'probe':<{width}}  verdict  detail")
    for p in report.probes:
        lines.append(f"{p.name:<{width}}  {p.verdict.upper():<7}  {p.detail}")
    advised = [p for p in report.probes if p.verdict != "ok" and p.advice]
    if advised:
        lines.append("")
        lines.append("advice:")
        for p in advised:
            lines.append(f"  {p.name} ({p.verdict}): {p.advice}")
    counts = {v: sum(p.verdict == v for p in report.probes) for v in VERDICTS}
    lines.append("")
    if report.ok:
        lines.append(f"verdict: OK ({counts['ok']} ok, {counts['note']} notes): s3capture can use this store")
    else:
        failed = ", ".join(p.name for p in report.probes if p.verdict == "fail")
        lines.append(f"verdict: FAIL ({counts['fail']} failed: {failed})")
    return "\n".join(lines)


def register(sub: Any) -> Any:
    """Add the ``doctor`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    from s3capture.cli import _argument, _int_in, check_endpoint, check_s3_url

    doctor = sub.add_parser(
        "doctor",
        help="probe a store for the properties s3capture relies on (consistency, listing order, paging, ...)",
        description="Write small throwaway objects under URL/_s3capture-doctor-<uuid>/, probe read-after-write, "
        "list-after-write, listing order, prefix semantics, pagination, '//' and dot-segment keys, Content-MD5 and "
        "checksum verification, whether the transport (--transport) carries s3capture's keys unchanged, ETags, "
        "DeleteObjects, conditional writes, clock skew and latency, delete everything again and print a verdict "
        "per property (ok, note, fail) with what to change. Exit status 0 when nothing s3capture relies on is "
        "missing, 1 when something is, 2 for a usage error or a store that cannot be used at all (missing bucket, "
        "refused credentials, unreachable endpoint, --transport obstore without obstore). See docs/doctor.md.",
    )
    doctor.add_argument("url", type=_argument(check_s3_url), help="s3://bucket[/prefix] to probe under")
    doctor.add_argument(
        "--endpoint",
        type=_argument(check_endpoint),
        help="S3 endpoint URL (default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS S3)",
    )
    doctor.add_argument(
        "--samples",
        type=_int_in(1, 1000),
        default=20,
        help="PUT/GET/LIST requests timed for the latency percentiles, 1 to 1000 (default 20)",
    )
    doctor.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="the transport to probe, the one capture runs on (default: S3CAPTURE_TRANSPORT, else aioboto3)",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as one JSON object")
    doctor.set_defaults(func=_command)
    return doctor


async def _until_signal(work: Any) -> Any:
    """Run ``work``; SIGTERM cancels it as Ctrl-C does, so its clean-up (``finally``) still
    deletes every probe object (``timeout``, a cancelled CI job or a stopped pod send SIGTERM)."""
    import signal

    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        return await task
    try:
        return await task
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None  # the command line's exit status 130, as after Ctrl-C
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _command(args: Any) -> int:
    import sys

    endpoint = args.endpoint
    if endpoint is None:
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if os.environ.get(name):
                endpoint = os.environ[name]
                break
    transport = (args.transport or os.environ.get(TRANSPORT_ENV) or "aioboto3").strip().lower()
    source = "--transport" if args.transport else TRANSPORT_ENV
    if transport not in TRANSPORTS:
        raise ValueError(f"{source} must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport == "obstore":
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise ValueError(
                f"{source}=obstore needs obstore: {install_hint('obstore')} (or probe --transport aioboto3)"
            ) from None
    work = diagnose(args.url, endpoint_url=endpoint, samples=args.samples, transport=transport)
    report = asyncio.run(_until_signal(work))
    if args.json:
        print(msgspec.json.encode(report.to_json()).decode())
    else:
        print(format_report(report))
    sys.stdout.flush()
    return 0 if report.ok else 1
