"""Bucket layout: id escaping, key-length limits and key classification (no S3).

Hypothesis settings: ``max_examples`` 300-500, ``deadline=None``; each property runs in about a
second.
"""

from __future__ import annotations

import re
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s3capture.layout import MAX_KEY_BYTES, MAX_SEGMENT_BYTES, Layout, escape_id, parse_log_key, unescape_id

MANY = settings(max_examples=500, deadline=None)
SOME = settings(max_examples=300, deadline=None)

SAFE_SEGMENT = re.compile(r"^[A-Za-z0-9_.~-]+$")
SHA = "0123456789abcdef" * 4
# A fingerprint as the store writes it: Gym's sha256 hex digest, or "" (no model-authored item).
FINGERPRINTS = st.sampled_from(["", SHA, "f" * 64])

# Any code point, lone surrogates included (escape_id encodes with surrogatepass).
all_code_points = st.text(
    alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=40
)
surrogate_heavy = st.text(
    alphabet=st.one_of(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.sampled_from("a/.~%")), max_size=12
)
ids_any = st.one_of(all_code_points, surrogate_heavy, st.text(alphabet=string.printable, max_size=20))


# ---------------------------------------------------------------------------------------------
# escape_id / unescape_id
# ---------------------------------------------------------------------------------------------


@MANY
@given(ids_any)
def test_escape_is_a_safe_reversible_segment(value: str) -> None:
    segment = escape_id(value)
    assert segment != ""
    assert "/" not in segment
    assert ".." not in segment
    assert SAFE_SEGMENT.fullmatch(segment), segment
    assert segment not in (".", "..")
    assert segment.isascii()
    assert unescape_id(segment) == value
    assert escape_id(unescape_id(segment)) == segment


@MANY
@given(ids_any, ids_any)
def test_escape_is_injective_and_rollout_prefixes_are_prefix_free(a: str, b: str) -> None:
    layout = Layout("root")
    if a == b:
        assert escape_id(a) == escape_id(b)
        return
    assert escape_id(a) != escape_id(b)
    pa, pb = f"rollouts/{escape_id(a)}/", f"rollouts/{escape_id(b)}/"
    assert not pb.startswith(pa) and not pa.startswith(pb)
    if _accepts(layout.rollout, a) and _accepts(layout.rollout, b):
        ra, rb = layout.rollout(a), layout.rollout(b)
        assert ra == f"root/{pa}" and rb == f"root/{pb}"
        assert not rb.startswith(ra) and not ra.startswith(rb)


def test_surrogates_escape_reversibly_and_distinctly() -> None:
    """escape_id itself is total (surrogatepass): a lone surrogate escapes reversibly, and a surrogate
    pair is not confused with the real character it would form in UTF-16."""
    lone = "\ud800"
    pair = "\ud83d\ude00"  # what "😀" would be in UTF-16, as two str code points
    emoji = "😀"
    assert escape_id(lone) == ".ED.A0.80"
    assert unescape_id(escape_id(lone)) == lone
    assert unescape_id(escape_id(pair)) == pair
    assert escape_id(emoji) == ".F0.9F.98.80"
    assert len({escape_id(lone), escape_id(pair), escape_id(emoji)}) == 3


@pytest.mark.parametrize("value", ["\ud800", "a\udfffb", "\ud83d\ude00"])
def test_layout_refuses_ids_with_lone_surrogates(value: str) -> None:
    """Such ids have no UTF-8 form: Gym's JSON records could not carry them, so the layout refuses them."""
    layout = Layout("p")
    with pytest.raises(ValueError, match="surrogate"):
        layout.rollout(value)
    prefix = layout.rollout("r")
    with pytest.raises(ValueError, match="surrogate"):
        layout.check_call_id(prefix, value)
    with pytest.raises(ValueError, match="surrogate"):
        layout.entry_rel(prefix, "", value, SHA)
    assert layout.rollout("😀") == "p/rollouts/.F0.9F.98.80/"


@pytest.mark.parametrize(
    "value, expected",
    [
        ("r1", "r1"),
        ("r10", "r10"),
        ("a/../b", "a.2F.2E.2E.2Fb"),
        ("..", ".2E.2E"),
        (".", ".2E"),
        ("%", ".25"),
        ("%2F", ".252F"),
        ("+", ".2B"),
        (" ", ".20"),
        ("a b", "a.20b"),
        ("~", ".7E"),
        ("", "~"),
        ("é", ".C3.A9"),
        ("日本", ".E6.97.A5.E6.9C.AC"),
        ("A-z_0-9", "A-z_0-9"),
        ("\x00", ".00"),
        ("//", ".2F.2F"),
    ],
)
def test_escape_known_cases(value: str, expected: str) -> None:
    assert escape_id(value) == expected
    assert unescape_id(expected) == value


# Ids made of the escape's own alphabet: '.', '%' and hex digits. Each one's segment is pinned, so
# an escape that percent-decodes, treats '.' or '%' as safe, or changes the case of its hex digits
# fails here by name (a '%2E' and a '.' mapped to one segment would merge two rollouts).
DOTTY_KNOWN = [
    (".", ".2E"),
    ("%2E", ".252E"),
    ("%2e", ".252e"),
    (".2E", ".2E2E"),
    ("2E", "2E"),
    ("E", "E"),
    ("%", ".25"),
    (".25", ".2E25"),
    ("%25", ".2525"),
    ("..2E", ".2E.2E2E"),
    ("a.b", "a.2Eb"),
    (".%", ".2E.25"),
    ("%.", ".25.2E"),
    ("%2E%2E", ".252E.252E"),
    ("-_.", "-_.2E"),
    ("~2E", ".7E2E"),
    (".7E", ".2E7E"),
    ("%7E", ".257E"),
    ("~.", ".7E.2E"),
    ("\u2024", ".E2.80.A4"),  # ONE DOT LEADER
    ("\uff0e", ".EF.BC.8E"),  # FULLWIDTH FULL STOP
    ("\uff05", ".EF.BC.85"),  # FULLWIDTH PERCENT SIGN
]


@pytest.mark.parametrize(
    "value, expected", DOTTY_KNOWN, ids=[v.encode("unicode_escape").decode() for v, _ in DOTTY_KNOWN]
)
def test_escape_known_cases_of_dots_percents_and_hex(value: str, expected: str) -> None:
    assert escape_id(value) == expected
    assert unescape_id(expected) == value
    assert parse_log_key(f"log/i/{expected}") == ("i", value, "", "")


def test_known_dotty_ids_have_distinct_segments() -> None:
    values = [v for v, _ in DOTTY_KNOWN]
    assert len(set(values)) == len(values)
    assert len({escape_id(v) for v in values}) == len(values)


# Ids built from the escape's own alphabet, plus look-alike code points: the ids most likely to
# collide under a wrong escape. Pairs are built as near-collisions: the second id is the first with
# some pieces rewritten to what a sloppy escape could confuse them with ('.' <-> '%2E', '%' <-> '.25',
# upper <-> lower hex, '~' <-> '.7E', ...).
DOTTY_ALPHABET = ".%0123456789ABCDEFabcdef~-_" + "\u2024\uff0e\uff05\u00e9\u00b7\U0001f600\x00"
DOTTY_PIECES = [
    ".",
    "%",
    "%2E",
    "%2e",
    ".2E",
    ".2e",
    "2E",
    ".25",
    "%25",
    "~",
    ".7E",
    "%7E",
    "-",
    "_",
    "..",
    "\uff0e",
    "\u2024",
    "\u00e9",
]
REWRITES = {
    ".": ["%2E", "%2e", ".2E", "\uff0e", "\u2024"],
    "%": [".25", "%25", "\uff05"],
    "%2E": [".", ".2E", "%2e"],
    "%2e": [".", "%2E"],
    ".2E": [".", "%2E", ".2e"],
    ".2e": [".2E"],
    "2E": ["2e", ".2E"],
    ".25": ["%"],
    "%25": ["%"],
    "~": [".7E", "%7E", ""],
    ".7E": ["~"],
    "%7E": ["~"],
    "-": ["_", "%2D"],
    "_": ["-", "%5F"],
    "..": [".", "%2E%2E"],
    "\uff0e": ["."],
    "\u2024": ["."],
    "\u00e9": ["e\u0301", ".C3.A9"],
}
dotty_ids = st.one_of(
    st.text(alphabet=DOTTY_ALPHABET, max_size=12),
    st.lists(st.sampled_from(DOTTY_PIECES), max_size=6).map("".join),
)


@st.composite
def near_collisions(draw: st.DrawFn) -> tuple[str, str]:
    pieces = draw(
        st.lists(st.sampled_from(DOTTY_PIECES) | st.text(alphabet=DOTTY_ALPHABET, max_size=2), min_size=1, max_size=6)
    )
    rewritten = list(pieces)
    for index in draw(st.sets(st.integers(0, len(pieces) - 1), min_size=1)):
        choices = REWRITES.get(pieces[index])
        if choices:
            rewritten[index] = draw(st.sampled_from(choices))
    return "".join(pieces), "".join(rewritten)


def _assert_escape_tells_apart(a: str, b: str) -> None:
    sa, sb = escape_id(a), escape_id(b)
    assert unescape_id(sa) == a and unescape_id(sb) == b
    if a == b:
        assert sa == sb
    else:
        assert sa != sb, (a, b, sa)
        layout = Layout("root")
        if a and b and _accepts(layout.rollout, a) and _accepts(layout.rollout, b):
            ra, rb = layout.rollout(a), layout.rollout(b)
            assert not ra.startswith(rb) and not rb.startswith(ra)


@MANY
@given(near_collisions())
def test_escape_tells_near_collisions_of_dots_and_percents_apart(pair: tuple[str, str]) -> None:
    _assert_escape_tells_apart(*pair)


@MANY
@given(dotty_ids, dotty_ids)
def test_escape_of_dotty_ids_round_trips_and_is_injective_on_pairs(a: str, b: str) -> None:
    _assert_escape_tells_apart(a, b)
    assert SAFE_SEGMENT.fullmatch(escape_id(a)) and ".." not in escape_id(a)


@SOME
@given(st.lists(dotty_ids, unique=True, max_size=25))
def test_escape_of_many_dotty_ids_is_injective(values: list[str]) -> None:
    segments = [escape_id(v) for v in values]
    assert len(set(segments)) == len(values), sorted(zip(segments, values))


def test_r1_never_sees_r10() -> None:
    layout = Layout("capture")
    r1, r10 = layout.rollout("r1"), layout.rollout("r10")
    assert r1 == "capture/rollouts/r1/" and r10 == "capture/rollouts/r10/"
    assert not r10.startswith(r1)
    assert not (r1 + "log/e/").startswith(r10) and not (r10 + "fence").startswith(r1)


@pytest.mark.parametrize(
    "segment", ["", "a/b", ".", "..", ".2", ".2e", ".ZZ", "a.", "~~", "a~", "%41", " ", "é", ".G0"]
)
def test_unescape_refuses_segments_escape_could_not_produce(segment: str) -> None:
    with pytest.raises(ValueError):
        unescape_id(segment)


def test_unescape_refuses_invalid_utf8() -> None:
    with pytest.raises(ValueError):
        unescape_id(".FF")
    with pytest.raises(ValueError):
        unescape_id(".C3")  # truncated two-byte sequence


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "root, expected",
    [("", "rollouts/x/"), ("a", "a/rollouts/x/"), ("a/b", "a/b/rollouts/x/"), ("/a/b/", "a/b/rollouts/x/")],
)
def test_rollout_prefix_under_root(root: str, expected: str) -> None:
    assert Layout(root).rollout("x") == expected


def test_root_with_empty_segment_is_refused() -> None:
    with pytest.raises(ValueError, match="//"):
        Layout("a//b")


def test_empty_rollout_id_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        Layout("p").rollout("")


@pytest.mark.parametrize("value", [None, 1, b"r1", ["r"]])
def test_non_string_rollout_id_is_refused(value: object) -> None:
    with pytest.raises(TypeError):
        Layout("p").rollout(value)  # type: ignore[arg-type]


def test_empty_model_call_id_is_refused_except_for_markers() -> None:
    layout = Layout("p")
    prefix = layout.rollout("r")
    with pytest.raises(ValueError, match="empty"):
        layout.check_call_id(prefix, "")
    with pytest.raises(ValueError, match="empty"):
        layout.entry_rel(prefix, SHA, "", SHA)
    assert layout.check_call_id(prefix, "", allow_empty=True) == "~"


@pytest.mark.parametrize("char, width", [("a", 1), ("/", 3), ("é", 6), ("😀", 12)])
def test_rollout_id_over_the_segment_limit_is_refused_naming_it(char: str, width: int) -> None:
    """An escaped id is one key segment; SeaweedFS/MinIO refuse segments over 255 bytes."""
    layout = Layout("capture/run-1")
    longest = MAX_SEGMENT_BYTES // width
    assert layout.rollout(char * longest) == f"capture/run-1/rollouts/{escape_id(char) * longest}/"
    with pytest.raises(ValueError, match=str(MAX_SEGMENT_BYTES)):
        layout.rollout(char * (longest + 1))
    with pytest.raises(ValueError, match="too long"):
        layout.rollout(char * 2000)


def test_id_whose_key_would_exceed_1024_bytes_is_refused_naming_the_limit() -> None:
    """Every segment within its limit, but a long root prefix pushes the keys over S3's 1024 bytes."""
    layout = Layout("/".join(["x" * 200] * 4))  # 803 bytes of root
    rid = "r" * 200
    with pytest.raises(ValueError, match=str(MAX_KEY_BYTES)):
        layout.rollout(rid)
    prefix = layout.rollout("r" * 50)
    with pytest.raises(ValueError, match=str(MAX_KEY_BYTES)):
        layout.check_call_id(prefix, "c" * 200)
    with pytest.raises(ValueError, match=str(MAX_KEY_BYTES)):
        layout.entry_rel(prefix, SHA, "c" * 200, SHA)
    assert layout.check_call_id(prefix, "c")  # a short call id still fits


def test_model_call_id_over_the_segment_limit_is_refused() -> None:
    layout = Layout("p")
    prefix = layout.rollout("r")
    assert layout.check_call_id(prefix, "c" * MAX_SEGMENT_BYTES) == "c" * MAX_SEGMENT_BYTES
    with pytest.raises(ValueError, match=str(MAX_SEGMENT_BYTES)):
        layout.check_call_id(prefix, "c" * (MAX_SEGMENT_BYTES + 1))
    with pytest.raises(ValueError, match=str(MAX_SEGMENT_BYTES)):
        layout.entry_rel(prefix, SHA, "c" * (MAX_SEGMENT_BYTES + 1), SHA)


def _accepts(fn, *args, **kwargs) -> bool:
    try:
        fn(*args, **kwargs)
    except ValueError:
        return False
    return True


def _store_keys(prefix: str, cid: str) -> list[str]:
    """Every key shape s3capture's store writes (see s3capture.layout and store), longest variants."""
    unique = f"{2**63:020d}-{'f' * 32}"  # mark_incomplete: <time_ns:020d>-<uuid4 hex>
    hashed = "~h" + "a" * 64  # the marker and failure-row segment of a call id too long to escape
    return [
        prefix + "fence",
        prefix + "retired",
        prefix + f"drop/{'d' * 32}",
        prefix + f"snap/{2**63:020d}-{'0' * 32}",
        prefix + f"cum/{SHA}.zst",
        prefix + f"log/x/~/{unique}",
        prefix + f"log/x/{hashed}/{unique}",
        prefix + f"ledger/fail/{hashed}/{SHA}.json",
        prefix + f"log/i/{cid}",
        prefix + f"log/x/{cid}/{unique}",
        prefix + f"ledger/intent/{cid}",
        prefix + f"ledger/row/{cid}/{SHA}.json",
        prefix + f"ledger/fail/{cid}/{SHA}.json",
    ]


def test_readers_keep_the_earlier_prefix_bound_so_rollouts_stored_under_it_stay_listed() -> None:
    """Writers need 148 bytes after a rollout prefix (876 bytes at most); before 2026-12-02 the
    bound was 926, and an entry fitted at prefixes of 877-879 bytes (call ids of 1-3 bytes). A
    review found such rollouts silently gone from listings, status, export and gc once readers used
    the writers' bound: readers keep the earlier one."""
    layout = Layout("/".join(["p" * 174] * 4))  # 699 bytes
    for length, readable, writable in ((876, True, True), (877, True, False), (926, True, False), (927, False, False)):
        rid = "R" * (length - 699 - len("/rollouts/") - 1)
        assert _accepts(layout.rollout, rid) == readable, length
        assert _accepts(layout.rollout, rid, writing=True) == writable, length
        if readable:
            assert len(layout.rollout(rid).encode()) == length
            assert len((layout.rollout(rid) + f"snap/{2**63:020d}-{'0' * 32}").encode()) <= MAX_KEY_BYTES


# Ids of every escaped length up to well past the limit: a character of escaped width 1-12 bytes
# repeated, plus arbitrary text.
long_ids = st.builds(
    lambda char, count, tail: char * count + tail,
    st.sampled_from(["a", "-", "/", "%", "é", "日", "😀", "\ud800"]),
    st.integers(0, 300),
    st.text(max_size=20),
).filter(bool)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["", "a", "capture/run-1", "/".join(["x" * 200] * 4)]), long_ids, long_ids, FINGERPRINTS)
def test_every_accepted_id_yields_keys_within_the_s3_limit(
    root: str, rollout_id: str, call_id: str, fingerprint: str
) -> None:
    layout = Layout(root)
    try:
        prefix = layout.rollout(rollout_id, writing=True)
    except ValueError as error:
        # Refused only for a real reason: a lone surrogate, an over-long segment or key.
        has_surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in rollout_id)
        too_long = len(f"{layout.root}rollouts/{escape_id(rollout_id)}/".encode()) + 148 > MAX_KEY_BYTES
        assert has_surrogate or too_long or len(escape_id(rollout_id)) > MAX_SEGMENT_BYTES, (rollout_id, error)
        return
    for key in _store_keys(prefix, "~"):
        assert len(key.encode()) <= MAX_KEY_BYTES, key
    try:
        cid = layout.check_call_id(prefix, call_id)
        rel = layout.entry_rel(prefix, fingerprint, call_id, SHA)
    except ValueError as error:
        has_surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in call_id)
        too_long = len(prefix.encode()) + 140 + len(escape_id(call_id)) > MAX_KEY_BYTES
        assert has_surrogate or too_long or len(escape_id(call_id)) > MAX_SEGMENT_BYTES, (call_id, error)
        return
    assert cid == escape_id(call_id)
    for key in [*_store_keys(prefix, cid), prefix + rel]:
        assert len(key.encode()) <= MAX_KEY_BYTES, key


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.integers(1, MAX_SEGMENT_BYTES), st.sampled_from(["", "p", "/".join(["x" * 100] * 5)]))
def test_entry_key_with_any_fingerprint_is_refused_or_fits(fingerprint: str, rid_len: int, root: str) -> None:
    """The fingerprint is not an id but lands in the key too: a long or odd one must not overflow it."""
    layout = Layout(root)
    try:
        prefix = layout.rollout("r" * rid_len)
    except ValueError:
        return
    try:
        rel = layout.entry_rel(prefix, fingerprint, "c", SHA)
    except ValueError as error:
        assert "1024" in str(error) or str(MAX_SEGMENT_BYTES) in str(error) or "surrogate" in str(error)
        return
    assert len((prefix + rel).encode()) <= MAX_KEY_BYTES
    assert parse_log_key(rel) == ("e", "c", fingerprint, SHA)


def test_entry_key_with_a_long_fingerprint_is_refused() -> None:
    layout = Layout("p")
    prefix = layout.rollout("r" * 200)
    with pytest.raises(ValueError):
        layout.entry_rel(prefix, "é" * 200, "c", SHA)  # escapes to 1200 bytes


# ---------------------------------------------------------------------------------------------
# parse_log_key
# ---------------------------------------------------------------------------------------------


storable_ids = st.text(min_size=1, max_size=40)  # no lone surrogates, escaped well under 255 bytes


@SOME
@given(storable_ids, FINGERPRINTS | st.text(max_size=8), st.text(alphabet="0123456789abcdef", min_size=64, max_size=64))
def test_parse_log_key_classifies_every_key_the_layout_writes(call_id: str, fingerprint: str, sha: str) -> None:
    layout = Layout("root")
    prefix = layout.rollout("r")
    rel = layout.entry_rel(prefix, fingerprint, call_id, sha)
    assert parse_log_key(rel) == ("e", call_id, fingerprint, sha)
    cid = layout.check_call_id(prefix, call_id)
    assert parse_log_key(f"log/i/{cid}") == ("i", call_id, "", "")
    unique = "00000000001700000000-0123456789abcdef0123456789abcdef"
    assert parse_log_key(f"log/x/{cid}/{unique}") == ("x", call_id, "", unique)
    assert parse_log_key(f"log/x/{layout.check_call_id(prefix, '', allow_empty=True)}/{unique}") == (
        "x",
        "",
        "",
        unique,
    )


@pytest.mark.parametrize(
    "rel",
    [
        "fence",
        "retired",
        "snap/00000000000000000001-" + "0" * 32,
        "log",
        "log/",
        "log/e",
        "log/e/~/c",
        f"log/e/~/c/{SHA}",  # no .zst
        f"log/e/~/c/{SHA}.json",
        f"log/e/~/c/{SHA.upper()}.zst",  # upper-case hex: not a sha256 hexdigest
        f"log/e/~/c/{SHA[:-1]}.zst",  # 63 hex digits
        f"log/e/~/c/{SHA}0.zst",  # 65
        f"log/e/~/c/{SHA}.zst/more",
        f"log/e/~/c/d/{SHA}.zst",
        f"log/e/~/a%20b/{SHA}.zst",  # not escape_id's output
        f"log/e/bad fp/c/{SHA}.zst",
        f"log/e/~//{SHA}.zst",
        "log/i/",
        "log/i/a/b",
        "log/i/.FF",  # escapes to invalid UTF-8
        "log/i/.zz",
        "log/x/c",
        "log/x/c/",
        "log/x/c/u/v",
        "log/q/c",
        "other/i/c",
        "LOG/i/c",
        "",
        "/log/i/c",
    ],
)
def test_parse_log_key_returns_none_for_foreign_shapes(rel: str) -> None:
    assert parse_log_key(rel) is None


@pytest.mark.parametrize("rel", ["log/i/.41", f"log/e/~/.61bc/{SHA}.zst", "log/x/.5F/u"])
def test_parse_log_key_refuses_non_canonical_escapes(rel: str) -> None:
    assert parse_log_key(rel) is None


@pytest.mark.parametrize("writing", [False, True])
def test_every_prefix_a_reader_accepts_leaves_room_for_a_ledger_listing_probe(writing: bool) -> None:
    """``S3CaptureLedger(probe_listing=True)`` PUTs ``ledger/.probe/<32 hex>`` under any rollout it
    reads, ids stored by releases before 2026-12-02 included: the longest prefix ``rollout``
    accepts still leaves room for that key, so no read needs a fallback without the probe."""
    probe = f"ledger/.probe/{'0' * 32}"
    longest = None
    for extra in range(0, 260):
        root = "/".join(["a" * 200, "b" * 200, "c" * 200, "d" * min(200, 1 + extra)])
        if extra >= 200:
            root += "/" + "e" * (extra - 199)
        try:
            prefix = Layout(root).rollout("r" * 60, writing=writing)
        except ValueError:
            break
        longest = prefix
    assert longest is not None, "no root was accepted"
    assert len(longest.encode()) > 850, "the search did not reach the limit"
    assert len((longest + probe).encode()) <= MAX_KEY_BYTES
