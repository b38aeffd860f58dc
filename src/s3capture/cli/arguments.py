"""What every ``s3capture`` subcommand shares: the parser class and argument checks.

``_Parser`` (one-line usage errors, no abbreviations), the argparse ``type`` builders ``_int_in``
and ``_argument``, the URL checks ``check_s3_url`` and ``check_endpoint`` (also used by ``ls``,
``status``, ``gc``, ``doctor`` and ``serve``, whose parsers live in their own modules) and
``stdout_to_devnull`` for a reader that went away. Everything here is importable from
``s3capture.cli`` too.
"""

from __future__ import annotations

import argparse
import codecs
import os
import re
import sys
from typing import Any, Callable, TypeVar
from urllib.parse import urlparse

# Bucket names S3-compatible stores accept between them (AWS, GCS, MinIO, R2, Ceph): letters, digits,
# dots, hyphens and underscores, 3 to 222 characters, starting and ending with a letter or digit.
_BUCKET = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{1,220})[A-Za-z0-9]")


class _Parser(argparse.ArgumentParser):
    """``argparse`` with one-line errors: ``s3capture demo: error: <what> (see 's3capture demo --help')``."""

    commands: dict[str, argparse.ArgumentParser]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: ``ls --stat frozen`` ran as ``--state``, so a typo passed unnoticed.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> Any:
        if message.startswith("the following arguments are required"):
            # argparse reports a missing required option before an unknown one: a typo'd
            # ``--ouf`` would read as a forgotten ``--out``. Name the unknown options first.
            known = tuple(self._option_string_actions)
            words = [word.split("=", 1)[0] for word in getattr(self, "_given", []) if word.startswith("--")]
            unknown = [word for word in words if word not in known]
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}; {message}"
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        # An unknown option is the subcommand's error ("s3capture demo: error: ..."), not the top level's.
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(self, "commands", {}).get(getattr(parsed, "command", None), self)
            command.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    return parse


def check_s3_url(url: str) -> str:
    """``url`` when it is ``s3://bucket[/prefix]`` with a valid bucket name and characters a root
    can keep (``s3capture.layout.check_url_characters``); ``ValueError`` otherwise."""
    from s3capture.layout import check_url_characters

    check_url_characters(url)
    parsed = urlparse(url)
    if parsed.scheme != "s3":
        raise ValueError(f"expected s3://bucket[/prefix], got {url!r}")
    if not parsed.netloc:
        raise ValueError(f"no bucket in {url!r}; expected s3://bucket[/prefix]")
    if parsed.query or parsed.fragment:
        raise ValueError(f"an s3:// URL takes no query or fragment: {url!r}")
    if not _BUCKET.fullmatch(parsed.netloc):
        hint = "; the endpoint goes in --endpoint" if ":" in parsed.netloc else ""
        raise ValueError(
            f"{parsed.netloc!r} in {url!r} is not a bucket name (3 to 222 letters, digits, '.', '-' or '_', "
            f"starting and ending with a letter or digit){hint}"
        )
    return url


def check_endpoint(url: str) -> str:
    """``url`` when it is ``http(s)://host[:port]`` (a trailing ``/`` allowed); ``ValueError``
    otherwise, in the stores' own words (``s3capture.transport.check_endpoint_url``)."""
    from s3capture.transport_config import check_endpoint_url

    return check_endpoint_url(url, source="the endpoint")


_T = TypeVar("_T")


def _argument(check: Callable[[str], _T]) -> Callable[[str], _T]:
    """An argparse ``type`` from a ``ValueError``-raising check."""

    def parse(text: str) -> _T:
        try:
            return check(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _escape_unencodable(error: UnicodeError) -> tuple[str, int]:
    """Codec error handler ``s3capture.escape``: what the output's encoding cannot write, as
    ``\\uXXXX`` escapes (a surrogate pair beyond the BMP), valid inside a JSON string too."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    out = []
    for char in error.object[error.start : error.end]:
        code = ord(char)
        if code > 0xFFFF:
            code -= 0x10000
            out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
        else:
            out.append(f"\\u{code:04x}")
    return "".join(out), error.end


codecs.register_error("s3capture.escape", _escape_unencodable)


def escape_unencodable_output() -> None:
    """Make stdout and stderr write what their encoding cannot (an id like ``c-ü`` under
    ``PYTHONIOENCODING=ascii`` or an ISO-8859 locale) as ``\\uXXXX`` instead of raising
    ``UnicodeEncodeError`` part-way through a listing or a ``gc --yes`` run."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is None:
            continue  # closed (None) or not a text stream of io's: left as it is
        try:
            reconfigure(errors="s3capture.escape")
        except (ValueError, OSError, TypeError):
            pass  # a stream that cannot take it (detached, or a test's replacement)


def stdout_to_devnull() -> None:
    """Point stdout at /dev/null, after its reader went away (``BrokenPipeError``): later output,
    and the interpreter's final flush, then cannot fail."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a file descriptor (an embedding, a test's capture)
