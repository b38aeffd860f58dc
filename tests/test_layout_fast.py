"""The fast ``escape_id`` / ``unescape_id`` / ``parse_log_key`` against the reference implementation
they replaced (character loops, kept here verbatim): identical results, identical refusals.

No S3. Hypothesis settings as in ``test_layout.py``.
"""

from __future__ import annotations

import re
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s3capture.layout import escape_id, is_ledger_probe_rel, parse_ledger_key, parse_log_key, unescape_id

MANY = settings(max_examples=1000, deadline=None)

# ------------------------------------------------------------------ reference (s3capture before the fast path)
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_HEX = "0123456789ABCDEF"
_ESCAPED = re.compile(r"^(?:[A-Za-z0-9_-]|\.[0-9A-F]{2})+$")
_HASHED = re.compile(r"^~h[0-9a-f]{64}$")


def ref_escape_id(value: str) -> str:
    if value == "":
        return "~"
    out: list[str] = []
    for byte in value.encode("utf-8", errors="surrogatepass"):
        if byte in _SAFE:
            out.append(chr(byte))
        else:
            out.append("." + _HEX[byte >> 4] + _HEX[byte & 15])
    return "".join(out)


def ref_unescape_id(segment: str) -> str:
    if segment == "~":
        return ""
    if not _ESCAPED.match(segment):
        raise ValueError(f"not an escaped id: {segment!r}")
    data = bytearray()
    position = 0
    while position < len(segment):
        char = segment[position]
        if char == ".":
            data.append(int(segment[position + 1 : position + 3], 16))
            position += 3
        else:
            data.append(ord(char))
            position += 1
    value = data.decode("utf-8", errors="surrogatepass")
    if ref_escape_id(value) != segment:
        raise ValueError(f"not a canonical escape: {segment!r}")
    return value


def ref_parse_log_key(rel: str) -> tuple[str, str, str, str] | None:
    parts = rel.split("/")
    try:
        if len(parts) == 5 and parts[0] == "log" and parts[1] == "e" and parts[4].endswith(".zst"):
            sha = parts[4][: -len(".zst")]
            if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
                return None
            fp = "" if parts[2] == "~" else ref_unescape_id(parts[2])
            return "e", ref_unescape_id(parts[3]), fp, sha
        if len(parts) == 3 and parts[0] == "log" and parts[1] == "i":
            return "i", ref_unescape_id(parts[2]), "", ""
        if len(parts) == 4 and parts[0] == "log" and parts[1] == "x" and parts[3]:
            # fullmatch since 2026-12-04 in both: '$' also matched before a final newline, so a
            # foreign "~h<sha>\n" read as a hashed call id (a breaker, reliability.md finding 38)
            cid = parts[2] if _HASHED.fullmatch(parts[2]) else ref_unescape_id(parts[2])
            return "x", cid, "", parts[3]
    except ValueError:
        return None
    return None


def outcome(fn, *args):
    """(result, None) or (None, exception class family): refusals must agree, not their wording."""
    try:
        return fn(*args), None
    except ValueError:
        return None, ValueError


# ------------------------------------------------------------------ strategies
any_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=40)
surrogates = st.text(
    alphabet=st.one_of(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.sampled_from("a/.~%\n")),
    max_size=12,
)
ids = st.one_of(
    any_text, surrogates, st.text(alphabet=string.printable, max_size=20), st.text(alphabet="Aa0_-", max_size=20)
)
# Segments near escape_id's output: safe characters, dots, hex digits of both cases, '~', newline.
segment_chars = st.sampled_from(
    list("AaZz09_-.~/\n%") + list("0123456789ABCDEFabcdef") + [".41", ".C3", ".A9", ".FF", ".ED", ".A0", ".80", ".2F"]
)
segments = st.one_of(st.lists(segment_chars, max_size=16).map("".join), ids.map(ref_escape_id), any_text)
SHA = "0123456789abcdef" * 4
shas = st.one_of(st.just(SHA), st.text(alphabet="0123456789abcdefA", min_size=63, max_size=65))
rels = st.one_of(
    st.builds(
        lambda fp, cid, sha, ext: f"log/e/{fp}/{cid}/{sha}{ext}",
        segments | st.just("~"),
        segments,
        shas,
        st.sampled_from([".zst", ".json", "", ".zst\n"]),
    ),
    st.builds(lambda cid: f"log/i/{cid}", segments),
    st.builds(lambda cid, u: f"log/x/{cid}/{u}", segments | st.just("~h" + SHA) | st.just("~h" + SHA + "\n"), segments),
    st.lists(
        st.sampled_from(["log", "e", "i", "x", "~", SHA + ".zst", "c", "", ".41", "ledger", "row"]), max_size=6
    ).map("/".join),
    any_text,
)


@MANY
@given(ids)
def test_escape_id_equals_the_reference(value: str) -> None:
    assert escape_id(value) == ref_escape_id(value)


@MANY
@given(segments)
def test_unescape_id_equals_the_reference(segment: str) -> None:
    assert outcome(unescape_id, segment) == outcome(ref_unescape_id, segment)


@MANY
@given(ids)
def test_unescape_inverts_escape_like_the_reference(value: str) -> None:
    segment = ref_escape_id(value)
    assert outcome(unescape_id, segment) == outcome(ref_unescape_id, segment)


@MANY
@given(rels)
def test_parse_log_key_equals_the_reference(rel: str) -> None:
    assert parse_log_key(rel) == ref_parse_log_key(rel)


def test_known_edge_cases_agree() -> None:
    cases = [
        "",
        "~",
        ".",
        "..",
        ".41",
        "A",
        "a\n",
        "\n",
        ".C3.A9",
        ".c3.a9",
        ".C3",
        ".ED.A0.80",
        "é",
        "\ud800",
        "a.2Fb",
    ]
    for value in cases:
        assert escape_id(value) == ref_escape_id(value)
        assert outcome(unescape_id, value) == outcome(ref_unescape_id, value)
    for rel in [
        "log/i/~",
        "log/i/",
        "log/e/~/c/" + SHA + ".zst",
        "log/e//c/" + SHA + ".zst",
        "log/x/~h" + SHA + "\n/u",
        "log/i/a\n",
    ]:
        assert parse_log_key(rel) == ref_parse_log_key(rel)


def test_a_final_newline_makes_a_key_foreign() -> None:
    # A regular expression's '$' matches before a final newline: every name check is a fullmatch.
    assert parse_log_key("log/x/~h" + SHA + "\n/u") is None
    assert parse_log_key("log/x/~h" + SHA + "/u") == ("x", "~h" + SHA, "", "u")
    assert parse_ledger_key("ledger/fail/~h" + SHA + "\n/" + SHA + ".json") is None
    assert parse_ledger_key("ledger/fail/~h" + SHA + "/" + SHA + ".json") == ("fail", "~h" + SHA, "~h", SHA)
    assert not is_ledger_probe_rel("ledger/.probe/" + "a" * 32 + "\n")
    assert is_ledger_probe_rel("ledger/.probe/" + "a" * 32)
    with pytest.raises(ValueError):
        unescape_id("a.2Fb\n")


@MANY
@given(rels.map(lambda r: r.replace("log/", "ledger/", 1)))
def test_parse_ledger_key_still_refuses_or_classifies(rel: str) -> None:
    # _is_sha moved to a regular expression: a ledger key parses exactly when its sha is 64 lower-case hex.
    parsed = parse_ledger_key(rel)
    if parsed is not None and parsed[0] in ("row", "fail"):
        assert re.fullmatch(r"[0-9a-f]{64}", parsed[3])
