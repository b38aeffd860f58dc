"""Bucket layout: id escaping and the key shapes s3capture writes.

Every key lives under a configured root ``s3://BUCKET/PREFIX/``; per rollout::

    rollouts/<rid>/fence                          fence: {"state": "frozen" | "retired"}, overwritten in place
    rollouts/<rid>/retired                        retire tombstone (immutable, empty)
    rollouts/<rid>/drop/<token>                   a drop's own tentative tombstone (empty, unique)
    rollouts/<rid>/log/e/<fp>/<cid>/<sha256>.zst  entry: zstd(envelope JSON); sha256 of the canonical entry bytes
    rollouts/<rid>/log/i/<cid>                    begin_call intent (empty)
    rollouts/<rid>/log/x/<cid>/<uuid>             mark_incomplete marker (empty)
    rollouts/<rid>/cum/<digest>.zst               delta checkpoint: zstd(cumulative token ids of an entry whose
                                                  Gym ``digest`` names the key); derived data, not in the version
    rollouts/<rid>/snap/<version>-<snapshot_id>   sealed manifest written by freeze
    rollouts/<rid>/ledger/row/<cid>/<sha256>.json capture-ledger row (CaptureLedger.record); sha256 of its bytes
    rollouts/<rid>/ledger-index/<fp>/<cid>/<sha256> ledger fingerprint index of that row (empty)
    rollouts/<rid>/ledger/fail/<cid>/<sha256>.json ledger failure row (CaptureLedger.record_failure)
    rollouts/<rid>/ledger/intent/<cid>            ledger begin_call intent (empty)
    rollouts/<rid>/ledger/.probe/<uuid>           a listing probe (empty; ``probe_listing``: a ledger's
                                                  manifest, has_rows, retire, delete; a token store's
                                                  retire, delete), deleted by the call that wrote it;
                                                  a leftover one holds nothing of the rollout's
                                                  (``.probe`` sorts before the ledger's other keys);
                                                  alone at a prefix, ``gc`` removes it

``<fp>`` is the entry's continuation fingerprint (``~`` when empty). Ids are escaped with
``escape_id``: ``A-Z a-z 0-9 _ -`` stay as they are, every other UTF-8 byte becomes ``.HH``
(upper-case hex), and the empty string becomes ``~``. The escape is reversible, never produces
``/``, ``..``, an empty segment or ``//``, and every LIST prefix ends in ``/``, so rollout ``r1``
never sees the objects of ``r10``. A root may not contain a ``rollouts`` segment, so two roots in
one bucket can never nest inside each other's rollouts. A marker for a call id too long to escape
uses ``~h<sha256 of the id>`` (``~`` never starts an escaped id).
"""

from __future__ import annotations

import hashlib
import re

MAX_KEY_BYTES = 1024
"""S3's limit on the UTF-8 length of a key."""
MAX_SEGMENT_BYTES = 255
"""Longest escaped id segment: SeaweedFS and MinIO refuse a key segment over 255 bytes."""

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_ESCAPED = re.compile(r"^(?:[A-Za-z0-9_-]|\.[0-9A-F]{2})+$")
_HASHED = re.compile(r"^~h[0-9a-f]{64}$")
_PROBE = re.compile(r"[0-9a-f]{32}")
"""A listing probe's name (``fullmatch``: ``$`` also matches before a final newline, and ``gc``
deleted a foreign key ``ledger/.probe/<32 hex>\\n`` as a leftover probe; a breaker, 2026-12-04)."""
_CHECKPOINT = re.compile(r"cum/[0-9a-f]{64}\.zst")
_MANIFEST = re.compile(r"snap/[0-9]{20}-[0-9a-f]{32}")
_DROP_TOMBSTONE = re.compile(r"drop/[0-9a-f]{32}")

# Longest suffix s3capture appends to a rollout prefix with a call id it checks (an entry: the
# call id's own length comes on top), and without one. A call id too long to escape is named by its
# hashed stand-in ``~h<sha256>`` in a marker (``log/x/<segment>/<time_ns:020d>-<uuid hex>``, 126
# bytes) and in a ledger failure row (``ledger/fail/<segment>/<sha256>.json``, 148 bytes), which
# must land whenever ``put`` or ``record`` could not: the longest of these bounds the prefix of a
# rollout written to (``Layout.rollout(..., writing=True)``). Readers keep the earlier bound (a
# manifest key and an empty call id's marker), so that rollouts stored under it stay readable.
_ENTRY_SUFFIX = len("log/e/") + 64 + 1 + 1 + 64 + len(".zst")
_HASHED_SEGMENT = len("~h") + 64
_WRITE_SUFFIX = max(
    len("snap/") + 20 + 1 + 32,
    len("log/x/") + _HASHED_SEGMENT + 1 + 20 + 1 + 32,
    len("ledger/fail/") + _HASHED_SEGMENT + 1 + 64 + len(".json"),
)
_READ_SUFFIX = len("snap/") + 20 + 1 + 32 + len("log/x/~/") + 32


# Byte -> text of its escape: safe bytes stay, every other byte becomes ``.HH``. Applied with
# ``str.translate`` to the UTF-8 bytes read as Latin-1 (one character per byte), so escaping is one
# C-speed pass instead of a Python loop over bytes.
_ESCAPE_TABLE = {byte: (chr(byte) if byte in _SAFE else f".{byte:02X}") for byte in range(256)}
_ALL_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_HEX_ESCAPE = re.compile(r"\.([0-9A-F]{2})")


def _unhex(match: re.Match[str]) -> str:
    return chr(int(match.group(1), 16))


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED_CONTROL = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def escape_controls(text: str) -> str:
    """``text`` with each control character (C0, DEL, C1, U+2028/U+2029) written as a backslash
    escape (``\\t``, ``\\n``, ``\\r``, ``\\xHH``, ``\\uHHHH``): a line of human-readable output that
    shows an id as it is without breaking the line, the columns or the terminal."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(lambda m: _NAMED_CONTROL.get(m.group(), _hex_escape(m.group())), text)


def _hex_escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}"


def printable_id(rollout_id: str) -> str:
    """A rollout or call id as one cell of a table or of tab-separated output.

    Unchanged when it holds no control character (nearly always); otherwise in bash's ANSI-C
    quoting, ``$'...'`` with ``\\\\``, ``\\'`` and the escapes of ``escape_controls``, which a shell
    reads back as the id itself. (An id with a tab or a newline is valid, and printed as it is it
    would split a row.) ``--json`` output carries ids unchanged.
    """
    if not _CONTROL.search(rollout_id):
        return rollout_id
    quoted = rollout_id.replace("\\", "\\\\").replace("'", "\\'")
    return "$'" + escape_controls(quoted) + "'"


def escape_id(value: str) -> str:
    """Escape any string into one safe, reversible, non-empty key segment."""
    if value == "":
        return "~"
    if value.isascii() and _ALL_SAFE.fullmatch(value):
        return value  # the common case: nothing to escape
    return value.encode("utf-8", errors="surrogatepass").decode("latin-1").translate(_ESCAPE_TABLE)


def unescape_id(segment: str) -> str:
    """Invert ``escape_id``; raises ``ValueError`` for a segment it could not have produced."""
    if segment == "~":
        return ""
    if segment.isascii() and _ALL_SAFE.fullmatch(segment):
        return segment  # no escapes: the segment is its own (canonical) escape
    if not _ESCAPED.fullmatch(segment):
        raise ValueError(f"not an escaped id: {segment!r}")
    try:
        value = _HEX_ESCAPE.sub(_unhex, segment).encode("latin-1").decode("utf-8", errors="surrogatepass")
    except UnicodeDecodeError:
        raise ValueError(f"not an escaped id (invalid UTF-8): {segment!r}") from None
    if escape_id(value) != segment:
        raise ValueError(f"not a canonical escape: {segment!r}")
    return value


def check_url_characters(url: str) -> None:
    """Raise ``ValueError`` for an ``s3://`` URL (or prefix) holding a character no root can keep:
    a control character (URL parsing silently drops tabs and newlines, which would store everything
    under another prefix than the one configured), U+FFFE or U+FFFF (S3 listings are XML 1.0,
    which cannot carry them, and the Ceph gateway writes a listing's ``<Prefix>`` unencoded: every
    LIST under such a root answered a body no client can parse; a Ceph breaker, 2026-12-03), or
    a lone surrogate (no key can hold one; a command-line argument that is not UTF-8 arrives as
    U+DC80-U+DCFF)."""
    bad = next((c for c in url if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(f"an s3:// URL may not contain control characters ({bad!r} in {url!r})")
    bad = next((c for c in url if "\ud800" <= c <= "\udfff"), None)
    if bad is not None:
        raise ValueError(
            f"an s3:// URL must be valid Unicode text: {url!r} holds a lone surrogate (U+{ord(bad):04X}; "
            "a command-line argument that is not UTF-8 arrives so)"
        )
    bad = next((c for c in url if c in "\ufffe\uffff"), None)
    if bad is not None:
        raise ValueError(
            f"an s3:// URL may not contain U+{ord(bad):04X}: S3 listings are XML 1.0, which cannot carry it "
            f"(in {url!r})"
        )


def _check_id(kind: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{kind} must be a str, got {type(value).__name__}")
    if type(value) is not str:
        # A str subclass (a ``(str, Enum)`` member, say) is stored as its text, the value every
        # JSON encoder writes in the payload: formatting it (``f"{value}"``) can give another
        # string ("E.A"), which put an entry under a key its own payload and every reader disowned
        # (an API breaker, 2026-12-03).
        value = str.__str__(value)
    if value == "":
        raise ValueError(f"{kind} must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{kind} {value!r} is not valid Unicode text (it contains a lone surrogate)") from None
    escaped = escape_id(value)
    if len(escaped) > MAX_SEGMENT_BYTES:
        raise ValueError(
            f"{kind} is too long to store: escaped it takes {len(escaped)} bytes of a key segment, "
            f"over the {MAX_SEGMENT_BYTES}-byte segment limit of S3-compatible stores"
        )
    return escaped


def check_prefix_segments(root: str) -> None:
    """Refuse a prefix (``"a/b"``, stripped of outer slashes) whose keys servers would not keep as
    written: an empty segment (``//``), a ``.`` or ``..`` segment, or a backslash. ``ValueError``.
    Every prefix s3capture writes under passes here: a root (``Layout``) and an export's ``s3://``
    destination."""
    if "//" in root:
        raise ValueError(f"prefix {root!r} contains an empty path segment ('//')")
    if any(segment in (".", "..") for segment in root.split("/")):
        # S3 keeps such keys verbatim, but servers that resolve paths (SeaweedFS, proxies)
        # rewrite or refuse them, so the keys written would not be the keys listed.
        raise ValueError(f"prefix {root!r} contains a '.' or '..' path segment")
    if "\\" in root:
        # SeaweedFS stores "a\\b" as another key than the one written (tests/test_transport.py).
        raise ValueError(f"prefix {root!r} contains a backslash, which S3-compatible servers rewrite")


class Layout:
    """Key builder for one root prefix (``""`` or ``"a/b"``, without trailing slash)."""

    def __init__(self, root: str) -> None:
        root = root.strip("/")
        check_prefix_segments(root)
        if "rollouts" in root.split("/"):
            raise ValueError(
                f"prefix {root!r} contains a 'rollouts' segment; it could nest inside another s3capture root's "
                "rollouts, whose retire or delete would then remove its objects"
            )
        self.root = f"{root}/" if root else ""

    def rollout(self, rollout_id: str, *, writing: bool = False) -> str:
        """The rollout's prefix (ends in ``/``). Raises ``ValueError`` for an unstorable id.

        ``writing=True`` (what ``put``, ``begin_call``, ``mark_incomplete`` and the ledger's
        writes ask): also for a prefix that leaves no room for the longest key s3capture may
        write under it, a marker or ledger failure row of a call id too long to escape (148 bytes
        after the prefix, so at most 876 bytes of prefix). Readers, freeze, drop, retire and
        delete accept up to 926 bytes, the bound of releases before 2026-12-02, so that rollouts
        they stored stay readable and removable."""
        prefix = f"{self.root}rollouts/{_check_id('rollout_id', rollout_id)}/"
        if len(prefix.encode()) + (_WRITE_SUFFIX if writing else _READ_SUFFIX) > MAX_KEY_BYTES:
            raise ValueError(
                f"rollout_id is too long to store: its keys would exceed S3's {MAX_KEY_BYTES}-byte limit "
                f"(escaped length {len(prefix.encode())})"
            )
        return prefix

    def entry_rel(self, rollout_prefix: str, fingerprint: str, model_call_id: str, sha: str) -> str:
        """Entry key relative to the rollout prefix. Raises ``ValueError`` for an unstorable id."""
        cid = _check_id("model_call_id", model_call_id)
        if len(rollout_prefix.encode()) + _ENTRY_SUFFIX + len(cid) > MAX_KEY_BYTES:
            raise ValueError(
                f"model_call_id is too long to store with this rollout_id: the entry key would exceed "
                f"S3's {MAX_KEY_BYTES}-byte limit"
            )
        fp = _check_id("continuation_fingerprint", fingerprint) if fingerprint else "~"
        rel = f"log/e/{fp}/{cid}/{sha}.zst"
        if len(rollout_prefix.encode()) + len(rel) > MAX_KEY_BYTES:
            raise ValueError(
                f"the entry key would exceed S3's {MAX_KEY_BYTES}-byte limit (long continuation_fingerprint?)"
            )
        return rel

    def marker_call_segment(self, rollout_prefix: str, model_call_id: str) -> str:
        """Key segment naming a call in a ``mark_incomplete`` marker; never refuses a str.

        A marker must land whenever ``put`` could not, so a call id that cannot be stored gets a
        hashed stand-in ``~h<sha256>`` instead of an error.
        """
        try:
            return self.check_call_id(rollout_prefix, model_call_id, allow_empty=True)
        except ValueError:
            digest = hashlib.sha256(model_call_id.encode("utf-8", errors="surrogatepass")).hexdigest()
            return "~h" + digest

    def check_call_id(self, rollout_prefix: str, model_call_id: str, *, allow_empty: bool = False) -> str:
        """Escaped call id after checking the key fits; raises ``ValueError``/``TypeError``."""
        if allow_empty and model_call_id == "":
            return "~"
        cid = _check_id("model_call_id", model_call_id)
        if len(rollout_prefix.encode()) + _ENTRY_SUFFIX + len(cid) > MAX_KEY_BYTES:
            raise ValueError(f"model_call_id is too long to store: keys would exceed S3's {MAX_KEY_BYTES}-byte limit")
        return cid


_ENTRY_KEY = re.compile(r"log/e/([^/]+)/([^/]+)/([0-9a-f]{64})\.zst")
_INTENT_KEY = re.compile(r"log/i/([^/]+)")
_MARKER_KEY = re.compile(r"log/x/([^/]+)/([^/]+)")
_SHA = re.compile(r"[0-9a-f]{64}")


def checkpoint_rel(digest: str) -> str:
    """Key (relative to the rollout prefix) of the delta checkpoint holding the cumulative tokens
    whose Gym ``digest`` is ``digest``; raises ``ValueError`` unless it is 64 lower-case hex digits."""
    rel = f"cum/{digest}.zst"
    if not _CHECKPOINT.fullmatch(rel):
        raise ValueError(f"not a token digest: {digest!r}")
    return rel


def is_folder_marker(rel: str, size: int) -> bool:
    """Whether a key relative to a rollout prefix is a folder marker: the prefix itself (``rel``
    empty, what a console's "Create folder" writes), or an empty object whose key ends in ``/`` at
    any depth (what s3fs, ``rclone mkdir`` and consoles write for each folder level, e.g. ``log/``
    or ``ledger/``). s3capture writes no key that ends in ``/``, so a marker holds nothing of the
    rollout's: it is outside the version and the snapshot id, and removed with the rest."""
    return not rel or (size == 0 and rel.endswith("/"))


def is_manifest_rel(rel: str) -> bool:
    """Whether a key relative to a rollout prefix has the exact shape of a sealed manifest,
    ``snap/<version:020d>-<snapshot_id>``. Any other key under ``snap/`` is foreign: read as a
    manifest, it stayed outside the version and the snapshot id, so it left a snapshot complete
    that any other foreign object masks (an audit, 2026-12-04)."""
    return _MANIFEST.fullmatch(rel) is not None


def is_drop_tombstone_rel(rel: str) -> bool:
    """Whether a key relative to a rollout prefix has the exact shape of a drop's own tombstone,
    ``drop/<uuid4 hex>``. Any other key under ``drop/`` is foreign (it was read as a tombstone, as
    a manifest was: outside the snapshot, and ``status`` counted the rollout as being dropped)."""
    return _DROP_TOMBSTONE.fullmatch(rel) is not None


def is_checkpoint_rel(rel: str) -> bool:
    """Whether a key relative to a rollout prefix has the exact shape of a delta checkpoint."""
    return _CHECKPOINT.fullmatch(rel) is not None


def parse_log_key(rel: str) -> tuple[str, str, str, str] | None:
    """Classify a key relative to a rollout prefix.

    Returns ``(kind, model_call_id, fingerprint, sha_or_unique)`` with kind ``"e"``, ``"i"`` or
    ``"x"``, or ``None`` for a key s3capture does not write (a foreign object). One regular
    expression match per key (a freeze parses every listed key once).
    """
    try:
        match = _ENTRY_KEY.fullmatch(rel)
        if match is not None:
            fp, cid, sha = match.groups()
            return "e", unescape_id(cid), "" if fp == "~" else unescape_id(fp), sha
        match = _INTENT_KEY.fullmatch(rel)
        if match is not None:
            return "i", unescape_id(match.group(1)), "", ""
        match = _MARKER_KEY.fullmatch(rel)
        if match is not None:
            cid, unique = match.groups()
            return "x", cid if _HASHED.fullmatch(cid) else unescape_id(cid), "", unique
    except ValueError:
        return None
    return None


def _is_sha(value: str) -> bool:
    return _SHA.fullmatch(value) is not None


def parse_ledger_key(rel: str) -> tuple[str, str, str, str] | None:
    """Classify a capture-ledger key relative to a rollout prefix.

    Returns ``(kind, model_call_id, fingerprint, sha)`` with kind ``"row"``, ``"fail"``,
    ``"intent"`` or ``"probe"`` (under ``ledger/``; a probe names no call, and its uuid is the
    fourth field) or ``"fp"`` (under ``ledger-index/``), or ``None`` for a key
    s3capture does not write there. The index lives beside ``ledger/``, not in it, so the LIST a
    manifest needs carries no index keys. A failure row of a call id too long to store names the
    call ``~h<sha256>`` (its body carries the real id); for it the third field is ``"~h"``. A key
    whose call id is not a non-empty, UTF-8-encodable string is not s3capture's (``None``).
    """
    parts = rel.split("/")
    try:
        if len(parts) == 4 and parts[:2] == ["ledger", "row"] and parts[3].endswith(".json"):
            sha = parts[3][: -len(".json")]
            return ("row", _call_id(parts[2]), "", sha) if _is_sha(sha) else None
        if len(parts) == 4 and parts[0] == "ledger-index" and _is_sha(parts[3]):
            return "fp", _call_id(parts[2]), unescape_id(parts[1]), parts[3]
        if len(parts) == 4 and parts[:2] == ["ledger", "fail"] and parts[3].endswith(".json"):
            sha = parts[3][: -len(".json")]
            if not _is_sha(sha):
                return None
            if _HASHED.fullmatch(parts[2]):
                return "fail", parts[2], "~h", sha
            return "fail", _call_id(parts[2]), "", sha
        if len(parts) == 3 and parts[:2] == ["ledger", "intent"]:
            return "intent", _call_id(parts[2]), "", ""
        if is_ledger_probe_rel(rel):
            return "probe", "", "", parts[2]
    except (ValueError, UnicodeEncodeError):
        return None
    return None


def is_ledger_probe_rel(rel: str) -> bool:
    """Whether ``rel`` (relative to a rollout prefix) is a ledger manifest's listing probe,
    ``ledger/.probe/<32 hex>`` (``S3CaptureLedger(probe_listing=True)``)."""
    parts = rel.split("/")
    return len(parts) == 3 and parts[0] == "ledger" and parts[1] == ".probe" and bool(_PROBE.fullmatch(parts[2]))


def _call_id(segment: str) -> str:
    """The call id an escaped segment names; ``ValueError`` unless it is a storable id."""
    cid = unescape_id(segment)
    if not cid:
        raise ValueError("empty call id")
    cid.encode("utf-8")  # UnicodeEncodeError for a lone surrogate
    return cid
