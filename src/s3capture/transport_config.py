"""Where a transport's requests go, and the botocore settings it uses unless given others.

Part of the transport seam (``s3capture.transport``, which re-exports every name here): the check
of an endpoint URL (``check_endpoint_url``, ``checked_endpoint``), the endpoint a client of this
process uses (``configured_endpoint``), and ``default_botocore_config``.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any


def check_endpoint_url(endpoint: str, *, bucket: str | None = None, source: str = "endpoint_url") -> str:
    """``endpoint`` when it is ``http(s)://host[:port]`` (a trailing ``/`` allowed); ``ValueError``
    naming ``source`` (the argument or environment variable it came from) otherwise.

    Refused: no scheme (``127.0.0.1:9000``: botocore failed at the first request, obstore with a
    Rust panic), a user name or password, a query or fragment, and any path. With path-style
    addressing a path is prepended to every key's path: an endpoint ending in the bucket
    (``https://ACCOUNT.r2.cloudflarestorage.com/BUCKET``, as consoles show it) stored every object
    under ``BUCKET/<prefix>/...`` while only LISTs failed, so a writer was acknowledged and every
    reader saw nothing (an API breaker, 2026-12-03); SigV4 signs the path, so an S3 server behind a
    path-rewriting proxy refuses it anyway.
    """
    if not isinstance(endpoint, str):
        raise TypeError(f"{source} must be a str URL, got {type(endpoint).__name__}")
    parsed = urllib.parse.urlsplit(endpoint)
    shape = "http://HOST[:PORT] or https://HOST[:PORT]"
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"{source} {endpoint!r} is not {shape} (the scheme is required)")
    if not parsed.hostname:
        raise ValueError(f"{source} {endpoint!r} is not {shape} (it names no host)")
    try:
        port = parsed.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"{source} {endpoint!r} has a bad port")
    if parsed.username is not None or parsed.password is not None:
        raise ValueError(f"{source} {endpoint!r} takes no user name or password (credentials come from the AWS chain)")
    if parsed.query or parsed.fragment:
        raise ValueError(f"{source} {endpoint!r} takes no query or fragment")
    if parsed.path not in ("", "/"):
        names_bucket = bucket is not None and parsed.path.strip("/").split("/")[-1] == bucket
        raise ValueError(
            f"{source} {endpoint!r} has a path ({parsed.path!r}): give the server's address only, "
            f"{parsed.scheme}://{parsed.netloc}"
            + (
                f"; the bucket {bucket!r} comes from the s3:// URL (with it in the endpoint too, every key "
                f"would be stored under '{bucket}/')"
                if names_bucket
                else ""
            )
        )
    return endpoint


def checked_endpoint(endpoint_url: str | None, bucket: str | None = None) -> str | None:
    """``configured_endpoint(endpoint_url)`` after ``check_endpoint_url`` of it, whose error names
    where it came from (``endpoint_url``, ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``)."""
    if endpoint_url:
        return check_endpoint_url(endpoint_url, bucket=bucket)
    for variable in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(variable):
            return check_endpoint_url(os.environ[variable], bucket=bucket, source=variable)
    return None


def configured_endpoint(endpoint_url: str | None = None) -> str | None:
    """The S3 endpoint a client of this process uses: ``endpoint_url``, else ``AWS_ENDPOINT_URL_S3``,
    else ``AWS_ENDPOINT_URL`` (botocore's order for S3); ``None`` for AWS S3 itself (or what an AWS
    profile's ``endpoint_url`` configures: ``Transport.effective_endpoint`` resolves that)."""
    return endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def default_botocore_config(max_pool_connections: int = 64, **overrides: Any) -> Any:
    """The botocore ``Config`` s3capture uses unless given one.

    Standard retry mode (5 retries, so 6 attempts; exponential backoff with jitter; botocore's retry
    quota applies: ``docs/design.md``, "What is retried"), connect/read timeouts of 5/30 s (per
    read, not per operation),
    a pool of ``max_pool_connections``, and checksums only where an operation requires them
    (``when_required``), which S3-compatible stores such as GCS, R2, Ceph and older MinIO accept.
    Path-style addressing is chosen when an endpoint is configured.
    """
    from botocore.config import Config

    settings: dict[str, Any] = dict(
        retries={"mode": "standard", "max_attempts": 5},
        connect_timeout=5,
        read_timeout=30,
        max_pool_connections=max_pool_connections,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    settings.update(overrides)
    return Config(**settings)
