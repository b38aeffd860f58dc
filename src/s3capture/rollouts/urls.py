"""``s3://bucket/prefix`` URLs: ``parse_s3_url``, which every client, the CLI, ``s3capture doctor``
and the export destinations use to split a root's URL."""

from __future__ import annotations

from urllib.parse import urlparse

from s3capture.layout import check_url_characters

__all__ = ["parse_s3_url"]


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into ``(bucket, prefix)``; raises ``ValueError`` otherwise.

    Refuses control characters, U+FFFE, U+FFFF and lone surrogates first
    (``s3capture.layout.check_url_characters`` says why)."""
    check_url_characters(url)
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"expected an s3://bucket/prefix URL, got {url!r}")
    if parsed.query or parsed.fragment:
        raise ValueError(f"an s3:// URL takes no query or fragment: {url!r}")
    return parsed.netloc, parsed.path.strip("/")
