"""The S3 transport seam: the few object operations s3capture uses, verified, and the
``Transport`` base that its two transports share (``S3Transport`` over aioboto3 in
``s3capture.transport_aioboto3``, ``ObstoreTransport`` in ``s3capture.transport_obstore``).

Every request s3capture sends goes through one ``Transport``. It owns:

- **one client per event loop and per process**: a store used from two event loops (a sync wrapper
  calling ``asyncio.run`` per operation) or in a child after ``fork`` gets a fresh HTTP client
  there instead of failing later with errors that read like an outage, and a loop that ends
  through ``asyncio.run`` (its ``shutdown_asyncgens``) closes its client as it ends;
- **request counting** (``request_counts``, by S3 operation, retries included) and a bound on
  requests in flight (``max_concurrency``);
- **the verified listing** (``list`` and ``list_page``): the one place where a LIST answer is
  checked before anybody builds on it (see ``_verify_page``);
- **reads that retry a failed body**: a GET whose body is cut mid-stream or silently short is
  retried a bounded number of times, then raised as ``StoreError``;
- **credential refresh**: an ``ExpiredToken``-class answer rebuilds the client (credentials are
  resolved again) and retries the request once;
- **error mapping**: every failure leaves as ``StoreError`` naming the operation and the key;
- **delete with fallback**: DeleteObjects in batches of 1,000 with Content-MD5, or one DELETE per
  key where a store does not implement it;
- ``close``: after it returns nothing is open and no request of this transport is in flight.

Retries of *requests* (5xx, throttling, connection errors) are botocore's standard retry mode;
this module only adds what botocore cannot see: a 200 whose body is wrong.

Fault injection for tests wraps the wire (``tests/faultproxy.py``), never this module.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import email.utils
import functools
import hashlib
import inspect
import logging
import os
import urllib.parse
import random
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar


from s3capture.clocks import awake_clock
from botocore.retries.standard import ExponentialBackoff, RetryContext

from s3capture.errors import ListingError, StoreError
from s3capture.records import RecordError

__all__ = [
    "Transport",
    "ListedObject",
    "ListPage",
    "RequestHook",
    "check_endpoint_url",
    "checked_endpoint",
    "default_botocore_config",
    "make_transport",
]

log = logging.getLogger("s3capture")

T = TypeVar("T")

_CONNECT_WARNED: dict[str, float] = {}
connect_log = logging.getLogger("s3capture.connect")
"""The logger of ``warn_connect_retry`` (a start-up probe that reports its own error quiets it)."""
_CONNECT_WARN_EVERY = 5.0
"""Seconds between two ``warn_connect_retry`` warnings for one endpoint: a retry sequence of a
wrong endpoint takes 8-14 s, so the user sees it go on (a warning a minute left that silent), and
many requests failing together still make one line per 5 s."""
_CANCELLED_REQUESTS_WAIT = 10.0
"""Seconds ``close`` waits for requests it cancelled (after its timeout) to leave, before closing
their client under them."""


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
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{source} {endpoint!r} is not {shape} (the scheme is required)")
    try:
        port = parsed.port
    except ValueError:
        raise ValueError(f"{source} {endpoint!r} has a bad port") from None
    if not parsed.hostname or port == 0:
        raise ValueError(f"{source} {endpoint!r} is not {shape}")
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


def _cannot_connect(error: BaseException) -> bool:
    """Whether ``error`` is a failure to connect at all (refused, unresolvable, connect timeout):
    botocore's ``ConnectionError`` family, or aiohttp's ``ClientConnectorError`` (the obstore
    transport's LIST)."""
    from botocore.exceptions import ConnectionError as BotocoreConnectionError

    if isinstance(error, BotocoreConnectionError):
        return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiobotocore requires it
        return False
    return isinstance(error, aiohttp.ClientConnectorError)


def configured_endpoint(endpoint_url: str | None = None) -> str | None:
    """The S3 endpoint a client of this process uses: ``endpoint_url``, else ``AWS_ENDPOINT_URL_S3``,
    else ``AWS_ENDPOINT_URL`` (botocore's order for S3); ``None`` for AWS S3 itself (or what an AWS
    profile's ``endpoint_url`` configures: ``Transport.effective_endpoint`` resolves that)."""
    return endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def warn_connect_retry(
    endpoint: str | None, error: BaseException, attempt: int, attempts: int, *, no_answer: bool = False
) -> None:
    """Log (at most once every 5 s per endpoint) that a request could not connect and is retried.

    Retries of connection errors are right for a store that blips, but with a wrong endpoint they
    take up to a quarter of a minute before the error; this warning says at once what is
    happening, and again while it goes on. ``attempt`` is the attempt that failed (1-based) of ``attempts``. ``no_answer``: the
    request was sent on a connection but no answer came within the read timeout (an endpoint that
    accepts connections and never answers took minutes of silence).
    """
    where = endpoint or "the AWS S3 endpoint"
    now = time.monotonic()
    if now - _CONNECT_WARNED.get(where, -_CONNECT_WARN_EVERY) < _CONNECT_WARN_EVERY:
        return
    _CONNECT_WARNED[where] = now
    reason = str(error).strip() or type(error).__name__
    # The longest the remaining retries' backoff can take (store_retry_delay's bound per retry):
    # a user waiting on a wrong endpoint learns how long the silence after this line may last.
    wait = sum(min(20, 2 ** (retry - 1)) for retry in range(attempt, attempts))
    what = (
        "no answer from %s within the read timeout (%s); retrying, attempt %d of %d, backing off up to %d s "
        "(an endpoint that accepts connections but does not answer, or an overloaded store)"
        if no_answer
        else "cannot connect to %s (%s); retrying, attempt %d of %d, backing off up to %d s (check the endpoint: "
        "--endpoint or AWS_ENDPOINT_URL)"
    )
    connect_log.warning(what, where, reason, attempt + 1, attempts, wait)


_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses every transport retries (up to its attempts, with backoff): throttling (429 is
what GCS's XML API answers for a rate limit, 503 SlowDown S3's) and server errors."""
RETRY_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",  # S3's 400 for a request body it waited too long for
        "InternalError",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
    }
)
"""S3 error codes every transport retries, whatever the status. Not ``RequestTimeTooSkewed``:
every retry is signed by the same clock."""
_NOT_IMPLEMENTED = frozenset(
    {
        "NotImplemented",
        "MethodNotAllowed",
        "501",
        "405",
        "MalformedXML",
        "MissingContentMD5",
        "InvalidDigest",
        "BadDigest",
        "400",  # a 400 without an error code (Ceph's answer to a key XML 1.0 cannot carry)
        # The Ceph gateway checks s3:DeleteObject of a DeleteObjects request against the bucket's
        # ARN, so a role granted it on its keys only (docs/permissions.md) is refused the batch
        # but not the single DELETEs (a Ceph breaker, 2026-12-03).
        "AccessDenied",
    }
)
BULK_DENIED_SECONDS = 600.0
"""Seconds a transport sends single DELETEs after a DeleteObjects refused with AccessDenied whose
single DELETEs were allowed, before it tries DeleteObjects again."""
_BULK_UNSUPPORTED = frozenset({"NotImplemented", "MethodNotAllowed", "501", "405"})
"""Answers to DeleteObjects that mean the store has none: remembered (``Transport.delete``). The
rest of ``_NOT_IMPLEMENTED`` (a digest or body the store refuses, a bare 400) sends that batch as
single DELETEs and tries DeleteObjects again next time; ``AccessDenied`` for
``BULK_DENIED_SECONDS`` once the single DELETEs of its batch succeeded."""
_CREDENTIAL_ERRORS = frozenset(
    {
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidToken",
        "TokenRefreshRequired",
        "RequestExpired",
        "InvalidAccessKeyId",
    }
)
"""Answers after which the credentials are resolved again and the request retried once."""

_MD5_ETAG = re.compile(r"[0-9a-f]{32}")
"""A single-part object's ETag: the MD5 of its bytes (unless encrypted with KMS or a customer key)."""


@functools.cache
def _payload_errors() -> tuple[type[BaseException], ...]:
    """Exceptions of an answer whose body was cut while it was read (not a failed connection,
    which botocore's own retries have already been through). Found on first use: importing
    aiohttp costs a quarter second that the obstore transport never needs."""
    from botocore.exceptions import IncompleteReadError, ResponseStreamingError

    errors: list[type[BaseException]] = [IncompleteReadError, ResponseStreamingError]
    try:
        import aiohttp

        errors.append(aiohttp.ClientPayloadError)
    except ImportError:  # pragma: no cover - aiobotocore always brings aiohttp
        pass
    return tuple(errors)


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


@dataclass(frozen=True)
class ListedObject:
    """One object of a verified listing."""

    key: str
    etag: str
    size: int
    modified: float = 0.0
    """LastModified, seconds since the epoch by the *store's* clock. Informational only: s3capture
    never subtracts it from another machine's clock."""


@dataclass(frozen=True)
class ListPage:
    """One verified ListObjectsV2 page: objects under the prefix, and the continuation token."""

    objects: list[ListedObject]
    next_token: str | None


def _new_token(prefix: str, token: str, tokens: set[str]) -> None:
    """Add a listing's continuation ``token`` to ``tokens``; a token seen before is a paging cycle."""
    if token in tokens:
        raise _Unverified(
            f"LIST {prefix!r} returned continuation token {token[:40]!r} twice (a paging cycle)",
            operation="LIST",
            key=prefix,
        )
    tokens.add(token)


async def cancel_unfinished(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` unless it is done, and wait until it is (its result or error is dropped):
    a request sent beside others is never left running unobserved when they fail. A task that is
    done already is not awaited: this runs in the ``finally`` of async generators too, where a
    needless suspension let a second ``aclose()`` (the loop's at shutdown) find the generator still
    running."""
    if task.done():
        if not task.cancelled():
            task.exception()  # retrieved: never "exception was never retrieved"
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def beside_confirmation(
    confirm: Awaitable[list[ListedObject]],
    listing: list[ListedObject],
    work: Callable[[list[ListedObject]], Awaitable[T]],
) -> T:
    """``work(listing)`` while ``confirm`` (a LIST that confirms the listing's end, e.g.
    ``Transport.confirm_listing_end``; it returns the keys after the listing's last one) runs
    beside it, so the confirmation costs no round trip of its own. Where it shows more keys, the
    answer is ``work(listing + more)``. An error of the first ``work`` is raised only once the
    confirmation found nothing more (it may come from the keys the listing lacked), or failed too;
    an error of ``confirm`` alone is raised as it is. The other request is never left running."""
    confirming = asyncio.ensure_future(confirm)
    try:
        try:
            result = await work(listing)
        except Exception as error:  # noqa: BLE001 - held until the confirmation answers, then raised
            failed: Exception | None = error
        else:
            failed = None
        try:
            more = await confirming
        except Exception as confirm_error:
            if failed is not None:
                raise failed from confirm_error  # the work's own error first
            raise
    finally:
        await cancel_unfinished(confirming)
    if more:
        return await work(listing + more)
    if failed is not None:
        raise failed
    return result


_IGNORES_START_AFTER = False
"""Whether a store answered a LIST with ``StartAfter`` with keys it had listed already (warned
about once): it ignores ``StartAfter``, and cannot confirm where a listing ends."""


def warn_start_after_ignored(prefix: str, key: str) -> None:
    """Log, once per process, that a LIST after a key showed ``key`` again."""
    global _IGNORES_START_AFTER
    if not _IGNORES_START_AFTER:
        _IGNORES_START_AFTER = True
        log.warning(
            "LIST %r after its last key returned %r, which it had listed already: this store ignores "
            "StartAfter, so the end of a listing cannot be confirmed",
            prefix,
            key,
        )


class _Unverified(ListingError):
    """One LIST attempt that cannot be trusted; retried by the ``Transport`` before it escapes."""


def _code(error: BaseException) -> str:
    response = getattr(error, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _verify_page(page: dict, prefix: str, seen: set[str]) -> ListPage:
    """Check one parsed ListObjectsV2 answer; the only place a listing is trusted.

    - a 200 without ``IsTruncated`` (an empty or unparseable body) is not "no objects": it raises;
    - a truncated page without a continuation token raises;
    - a key repeated across the pages of one listing (``seen``) raises;
    - a key that does not start with ``prefix`` (a server that answers ``Prefix=r1/`` with keys of
      ``r1000/``) is dropped and logged: it is never counted, masked or deleted.
    """
    if "IsTruncated" not in page:
        raise _Unverified(
            f"LIST {prefix!r} answered 200 with an empty or unparseable body", operation="LIST", key=prefix
        )
    objects: list[ListedObject] = []
    for item in page.get("Contents", ()) or ():
        key = item.get("Key")
        if not isinstance(key, str):
            raise _Unverified(f"LIST {prefix!r} returned an object without a key", operation="LIST", key=prefix)
        if not key.startswith(prefix):
            log.warning("LIST %r returned key %r outside the requested prefix; ignored", prefix, key)
            continue
        if key in seen:
            raise _Unverified(f"LIST {prefix!r} returned key {key!r} twice", operation="LIST", key=prefix)
        seen.add(key)
        modified = item.get("LastModified")
        objects.append(
            ListedObject(
                key,
                str(item.get("ETag", "")).strip('"'),
                int(item.get("Size", 0) or 0),
                modified.timestamp() if modified is not None else 0.0,
            )
        )
    token = None
    if page.get("IsTruncated"):
        token = page.get("NextContinuationToken")
        if not token:
            raise _Unverified(
                f"LIST {prefix!r} was truncated without a continuation token", operation="LIST", key=prefix
            )
    return ListPage(objects, token)


@dataclass
class _LoopState:
    """The HTTP client and its bounds for one event loop."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    client: Any = None
    stack: AsyncExitStack | None = None
    generation: int = 0
    sem: asyncio.Semaphore | None = None
    inflight: set[asyncio.Task] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    retired: list[AsyncExitStack] = field(default_factory=list)
    loop_end: Any = None
    """``Transport._loop_end`` of this state, first iterated on its loop (``None`` once closed)."""


_ABANDONED: list[Any] = []
"""The ``_loop_end`` generators of a parent's states in a forked child, kept so that they are
never finalized there: a finalizer would schedule their clean-up on the parent's loop object and
close the parent's clients (whose sockets the child shares) from the child."""
_LOOP_END_WAIT = 1.0
"""Seconds a loop's end waits for its requests in flight (``asyncio.run`` has cancelled them)."""


@dataclass(frozen=True)
class _Got:
    """One GET answer: the body read whole, and what the headers said about it."""

    data: bytes
    length: int | None
    etag: str


class _BodyFailed(Exception):
    """A GET body that failed while streaming (cut, reset, timed out); the GET is asked again,
    unless ``retried``: the client library already resumed it with its own retries and backoff
    (obstore re-requests the rest of a cut body), so asking again would only multiply them."""

    def __init__(self, message: str, *, retried: bool = False) -> None:
        super().__init__(message)
        self.retried = retried


class _TooLarge(Exception):
    """A GET whose Content-Length is over the caller's limit (the body is not read), or whose
    body without one passed it (read no further)."""

    def __init__(self, length: int, *, at_least: bool = False) -> None:
        super().__init__(length)
        self.length = length
        self.at_least = at_least  # a body of unknown length, read until it passed the limit


RequestHook = Callable[[str, str, "str | None"], Any]
"""``hook(operation, key, continuation)``: called before a request is sent (``before``) or after
it is answered or failed (``after``); ``operation`` is the S3 API name (``PutObject``,
``GetObject``, ``ListObjectsV2``, ``DeleteObjects``, ``DeleteObject``), ``key`` the object key (the
first key of a DeleteObjects batch, the prefix of a LIST), ``continuation`` a LIST page's
continuation token (else ``None``). A ``before`` hook may return an awaitable, which the request
waits for (tests use this to hold a request)."""


class Transport:
    """The object operations of one bucket: the seam between the stores and an S3 client.

    Subclasses implement five single requests (``_put_once``, ``_get_once``, ``_list_once``,
    ``_delete_batch_once``, ``_delete_one_once``) and how to open a client; everything the stores
    rely on lives here, once, for every transport: the client per event loop and per process, the
    bound on requests in flight, request hooks, error mapping to ``StoreError``, bounded re-reads
    of a failed GET body (with the MD5-ETag check), and the verified listing (``_verify_page``).

    Parameters:
        bucket: the bucket name.
        endpoint_url: S3 endpoint (``None``: AWS itself).
        max_concurrency: requests in flight from this transport, per event loop (>= 1).
        read_attempts: GETs of one object whose body fails before ``StoreError`` (>= 1).
        list_attempts: listings of one prefix that fail verification before ``ListingError``.
    """

    name = "base"
    """The name ``transport=`` selects this implementation by."""

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        max_concurrency: int = 32,
        read_attempts: int = 4,
        list_attempts: int = 5,
    ) -> None:
        for name, value in (
            ("max_concurrency", max_concurrency),
            ("read_attempts", read_attempts),
            ("list_attempts", list_attempts),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if read_attempts < 1 or list_attempts < 1:
            raise ValueError("read_attempts and list_attempts must be >= 1")
        checked_endpoint(endpoint_url, bucket)
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self._max_concurrency = max_concurrency
        self._read_attempts = read_attempts
        self._list_attempts = list_attempts
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()
        self._pid = os.getpid()
        self._closed = False
        self._closing: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task] = weakref.WeakKeyDictionary()
        self._before: list[RequestHook] = []
        self._after: list[RequestHook] = []
        self.request_counts: collections.Counter[str] = collections.Counter()
        """HTTP requests sent, by S3 operation (see each transport for whether retries count)."""
        self._server_time: tuple[float, float] | None = None  # (Date of the last LIST answer, awake_clock then)
        self._warned_more_keys = False  # _rest_of_listing warned once: later ones at INFO
        self._bulk_delete = True  # False once the store answered DeleteObjects "not implemented"
        self._bulk_denied_until = 0.0  # awake_clock() until which a batch refused as AccessDenied is not sent
        self._bulk_denied_said = False

    def store_now(self) -> float | None:
        """The store's clock now, in seconds since the epoch: the ``Date`` header of the newest
        verified LIST answer plus the time elapsed since on this machine's ``awake_clock``; ``None``
        before any LIST answered with a ``Date``. One second of resolution (HTTP dates), immune to
        this machine's wall-clock skew: what ages against the store's ``LastModified`` use."""
        if self._server_time is None:
            return None
        date, seen = self._server_time
        return date + (awake_clock() - seen)

    def _note_date(self, page: dict) -> None:
        headers = (page.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
        value = headers.get("date")
        if value:
            try:
                self._server_time = (email.utils.parsedate_to_datetime(value).timestamp(), awake_clock())
            except (TypeError, ValueError):
                pass  # a malformed Date: keep the previous one

    async def effective_endpoint(self) -> str:
        """The endpoint URL this transport's requests go to, ``""`` for AWS S3 itself (whatever
        its region). The configured ``endpoint_url`` here; the aioboto3 transport also resolves
        what botocore takes from the AWS config (a profile's ``endpoint_url``). Opens no
        connection."""
        return self.endpoint_url or ""

    def configured_endpoint_url(self) -> str:
        """``effective_endpoint`` without awaiting anything: read from the arguments, the
        environment and (aioboto3) the AWS config files only, never the network. What the local
        spill names its store by (``s3capture.spill``), which must be known before any request."""
        return self.endpoint_url or ""

    # ------------------------------------------------------------------ hooks
    def add_hook(self, before: RequestHook | None = None, after: RequestHook | None = None) -> None:
        """Call ``before(operation, key, continuation)`` before every request and ``after(...)``
        after every answer (or failure) of this transport, on every event loop (``RequestHook``).
        For tests and tools (request recorders, timelines); hooks must be cheap and must not raise."""
        if before is not None:
            self._before.append(before)
        if after is not None:
            self._after.append(after)

    async def _send(
        self, operation: str, key: str, request: Callable[[], Awaitable[T]], continuation: str | None = None
    ) -> T:
        """One HTTP request (or one request of the underlying client, with its own retries)."""
        for hook in self._before:
            waited = hook(operation, key, continuation)
            if inspect.isawaitable(waited):
                await waited
        self._counted(operation)
        try:
            return await request()
        finally:
            for hook in self._after:
                hook(operation, key, continuation)

    def _counted(self, operation: str) -> None:
        """Count one request (transports that see every HTTP attempt count there instead)."""
        self.request_counts[operation] += 1

    # ------------------------------------------------------------------ client per loop and process
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def opened(self) -> bool:
        """Whether an HTTP client is open in any event loop of this process."""
        return os.getpid() == self._pid and any(s.client is not None for s in self._states.values())

    def _state(self) -> _LoopState:
        if os.getpid() != self._pid:
            self._forked(self._states)
            _ABANDONED.extend(s.loop_end for s in list(self._states.values()) if s.loop_end is not None)
            self._states = weakref.WeakKeyDictionary()
            self._pid = os.getpid()
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None:
            for other in [lp for lp in self._states if lp.is_closed()]:
                # A finished loop's client cannot be closed any more; forget it.
                del self._states[other]
            state = self._states[loop] = _LoopState()
            state.idle.set()
        return state

    def _forked(self, states: Any) -> None:
        """In a forked child, before the parent's clients are forgotten (never closed from here)."""

    async def client(self) -> Any:
        """The underlying client of the running event loop (opened on first use)."""
        return (await self._client(self._state()))[0]

    async def _client(self, state: _LoopState) -> tuple[Any, int]:
        if state.client is not None and not self._closed:
            return state.client, state.generation
        async with state.lock:
            if self._closed:
                raise StoreError(f"this s3capture client for s3://{self.bucket} is closed")
            if state.client is None:
                stack = AsyncExitStack()
                client = await self._open(stack)
                state.sem = asyncio.Semaphore(self._max_concurrency)
                state.stack, state.client = stack, client
                state.generation += 1
                if state.loop_end is None:
                    state.loop_end = self._loop_end(state)
                    await state.loop_end.__anext__()  # registers it with this loop's shutdown_asyncgens
            return state.client, state.generation

    async def _loop_end(self, state: _LoopState) -> Any:
        """An async generator first iterated on the state's loop: ``asyncio.run`` (any loop's
        ``shutdown_asyncgens``) closes it as the loop ends, and it closes that loop's client then.
        A store used through ``asyncio.run`` per operation, or from a thread's own loop, otherwise
        left each loop's client to the garbage collector, which logged an asyncio ERROR
        "Unclosed client session" per loop (an API breaker, 2026-12-03); a closed loop cannot
        close it any more. ``_close_state`` closes it first when the store is closed."""
        try:
            yield
        finally:
            if state.loop_end is not None:  # the loop is ending (or the transport was dropped)
                state.loop_end = None
                await self._close_state(state, _LOOP_END_WAIT)

    async def _open(self, stack: AsyncExitStack) -> Any:
        """Open this loop's client; register its clean-up on ``stack``."""
        raise NotImplementedError

    async def _refresh(self, state: _LoopState, generation: int) -> bool:
        """After a credential error: whether a rebuilt client is worth one more attempt."""
        return False

    def _error_code(self, error: BaseException) -> str:
        """The S3 error code of a failed request (``""`` when there is none)."""
        return _code(error)

    async def _call(self, operation: str, key: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``fn(client)`` under the bounds, mapping every failure to ``StoreError``."""
        if self._closed:
            raise StoreError(f"this s3capture client for s3://{self.bucket} is closed", operation=operation, key=key)
        state = self._state()
        for attempt in (0, 1):
            client, generation = await self._client(state)
            task = asyncio.current_task()
            assert task is not None  # a coroutine always runs in a task
            state.inflight.add(task)
            state.idle.clear()
            try:
                if self._closed:
                    raise StoreError(
                        f"this s3capture client for s3://{self.bucket} is closed", operation=operation, key=key
                    )
                async with state.sem:  # type: ignore[union-attr]
                    return await fn(client)
            except (StoreError, RecordError, asyncio.CancelledError):
                raise
            except Exception as error:
                if (
                    attempt == 0
                    and self._error_code(error) in _CREDENTIAL_ERRORS
                    and await self._refresh(state, generation)
                ):
                    continue
                raise self._wrap(error, operation, key) from error
            finally:
                state.inflight.discard(task)
                if not state.inflight:
                    state.idle.set()
        raise AssertionError("unreachable")  # pragma: no cover

    def _error_text(self, error: BaseException) -> str:
        """The text of a client library's error, as a ``StoreError`` message quotes it."""
        return str(error)

    def _could_not_send(self, error: BaseException) -> bool:
        """Whether this transport's client failed to send the request at all (after its own
        retries), beyond ``_cannot_connect``: the error then says to check the endpoint."""
        return False

    def _wrap(self, error: BaseException, operation: str, key: str) -> StoreError:
        code = self._error_code(error)
        where = f"{operation} s3://{self.bucket}/{key}"
        if code == "NoSuchBucket":
            return StoreError(f"bucket {self.bucket!r} does not exist ({where})", operation=operation, key=key)
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", *_CREDENTIAL_ERRORS):
            return StoreError(f"access to s3://{self.bucket} refused: {code} ({where})", operation=operation, key=key)
        if type(error).__name__ == "NoCredentialsError":  # botocore's; obstore raises its own errors
            return StoreError(
                f"no AWS credentials found ({where}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "AWS_PROFILE, or configure them in ~/.aws/credentials",
                operation=operation,
                key=key,
            )
        if _cannot_connect(error) or self._could_not_send(error):
            check = "check the endpoint (--endpoint or AWS_ENDPOINT_URL) and the network"
            if "WRONG_VERSION_NUMBER" in str(error) and (self.endpoint_url or "").startswith("https://"):
                check = "the server answers plain HTTP: use http:// in the endpoint (--endpoint or AWS_ENDPOINT_URL)"
            return StoreError(
                f"cannot connect to {self.endpoint_url or 'the AWS S3 endpoint'} ({where}): {type(error).__name__}: "
                f"{self._error_text(error)}; {check}",
                operation=operation,
                key=key,
            )
        return StoreError(
            f"{where} failed: {type(error).__name__}: {self._error_text(error)}", operation=operation, key=key
        )

    async def close(self, timeout: float = 30.0) -> None:
        """Wait for requests in flight (up to ``timeout`` seconds, then cancel them), then close
        the clients. Idempotent; a second ``close`` waits for the first.

        After it returns, no request of this transport is in flight and none starts (later calls
        raise ``StoreError``): the clients of event loops still running in other threads are
        closed on their own loops. Clients of loops that no longer run cannot be closed any more
        and are dropped. A loop of another thread that does not run for ``timeout`` + 15 s
        (blocked in synchronous code) closes its client when it runs again: ``close`` returns
        then, with a warning.
        """
        self._closed = True
        if os.getpid() != self._pid:
            self._forked(self._states)
            _ABANDONED.extend(s.loop_end for s in list(self._states.values()) if s.loop_end is not None)
            self._states = weakref.WeakKeyDictionary()
            return
        loop = asyncio.get_running_loop()
        job = self._closing.get(loop)
        if job is None:
            job = self._closing[loop] = loop.create_task(self._close_all(loop, timeout))
        await asyncio.shield(job)

    async def _close_all(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        states = list(self._states.items())
        self._states = weakref.WeakKeyDictionary()
        jobs: list[Awaitable[None]] = []
        for other, state in states:
            if other is loop:
                jobs.append(self._close_state(state, timeout))
            elif other.is_running() and not other.is_closed():
                future = asyncio.run_coroutine_threadsafe(self._close_state(state, timeout), other)
                jobs.append(self._await_other_loop(asyncio.wrap_future(future), timeout))
        for result in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("close(): %r", result)

    @staticmethod
    async def _await_other_loop(closed: Awaitable[None], timeout: float) -> None:
        """Wait for another thread's loop to close its client, at most as long as that close may
        take (``timeout`` plus the wait for cancelled requests) and 5 s for the loop to get to it.
        A loop blocked in synchronous code held ``close`` for as long as it stayed blocked, for
        ever when it waited on the closing thread (an API breaker, 2026-12-03); its close stays
        scheduled there and runs when the loop does."""
        limit = timeout + _CANCELLED_REQUESTS_WAIT + 5.0
        try:
            await asyncio.wait_for(asyncio.shield(closed), limit)
        except asyncio.TimeoutError:
            log.warning(
                "close(): the event loop of another thread did not run for %.0f s (blocked?); its client is "
                "closed when it runs again, and it sends no new request",
                limit,
            )

    async def _close_state(self, state: _LoopState, timeout: float) -> None:
        """Close one loop's client, on that loop, after its requests in flight.

        The wait holds no lock: a request in flight may need ``state.lock`` to finish (a credential
        refresh after ``ExpiredToken``), and holding it here stalled ``close`` for ``timeout`` and
        turned that request's ``StoreError`` into a ``CancelledError``. After ``timeout`` the tasks
        still inside a request are cancelled, and ``close`` waits until they have left their request
        (``state.idle``, set by ``_call`` as the cancellation passes it), not until the tasks end: a
        cancelled task may go on to await this same ``close`` (``async with store:``, or a
        ``finally: await store.close()``), and waiting for it to end deadlocked both for ever
        (a breaker, 2026-12-02)."""
        try:
            await asyncio.wait_for(state.idle.wait(), timeout)
        except asyncio.TimeoutError:
            stuck = [t for t in state.inflight if t is not asyncio.current_task()]
            log.warning("close(): cancelling %d requests still in flight after %.0f s", len(stuck), timeout)
            for task in stuck:
                task.cancel()
            try:
                await asyncio.wait_for(state.idle.wait(), _CANCELLED_REQUESTS_WAIT)
            except asyncio.TimeoutError:
                log.warning(
                    "close(): %d requests did not stop within %.0f s of being cancelled; closing their client anyway",
                    len(state.inflight),
                    _CANCELLED_REQUESTS_WAIT,
                )
        async with state.lock:  # waits for a client being opened or rebuilt right now
            stacks = [*state.retired, *([state.stack] if state.stack is not None else [])]
            state.client, state.stack, state.retired = None, None, []
        for stack in stacks:
            await stack.aclose()
        loop_end, state.loop_end = state.loop_end, None
        if loop_end is not None:  # not called from its own clean-up: it has nothing left to do
            await loop_end.aclose()

    # ------------------------------------------------------------------ single requests (per transport)
    async def _put_once(self, client: Any, key: str, body: bytes) -> None:
        raise NotImplementedError

    async def _get_once(self, client: Any, key: str, limit: int | None) -> _Got | None:
        """GET ``key``: ``None`` when absent; raises ``_TooLarge`` (Content-Length over ``limit``,
        body unread) or ``_BodyFailed`` (the body failed while streaming)."""
        raise NotImplementedError

    async def _list_once(
        self, client: Any, prefix: str, max_keys: int, token: str | None, start_after: str | None = None
    ) -> dict:
        """One ListObjectsV2 request (after ``start_after`` when given), parsed to botocore's shape (``IsTruncated``, ``Contents``
        of ``Key``/``ETag``/``Size``/``LastModified``, ``NextContinuationToken``); raises
        ``_Unverified`` for a body that cannot be parsed."""
        raise NotImplementedError

    async def _delete_batch_once(self, client: Any, keys: list[str]) -> tuple[list[dict], set[str]] | str:
        """One DeleteObjects request (not quiet): the per-key errors (``Key``, ``Code``,
        ``Message``) and the keys the answer confirms deleted; or the store's error code (one of
        ``_NOT_IMPLEMENTED``) when it refuses DeleteObjects itself."""
        raise NotImplementedError

    async def _delete_one_once(self, client: Any, key: str) -> None:
        """One DELETE; a missing key is not an error."""
        raise NotImplementedError

    # ------------------------------------------------------------------ object operations
    async def put(self, key: str, body: bytes) -> None:
        """PUT ``body`` at ``key`` (the client retries 5xx and lost responses: every PUT here is
        idempotent). Raises ``StoreError``."""

        async def run(client: Any) -> None:
            await self._send("PutObject", key, lambda: self._put_once(client, key, body))

        await self._call("PUT", key, run)

    async def get(self, key: str, limit: int | None = None) -> bytes | None:
        """GET an object's bytes, or ``None`` when it does not exist.

        A body that fails while streaming, ends short of its ``Content-Length``, or does not match
        its MD5 ETag, is fetched again (``read_attempts`` in all; a body the client library already
        resumed with its own retries, as obstore does, is not fetched again). With ``limit``, raises
        ``RecordError`` instead of reading an object larger than ``limit`` bytes. Raises
        ``StoreError``.
        """

        async def run(client: Any) -> bytes | None:
            problem = ""
            mismatched = b""
            for attempt in range(self._read_attempts):
                if attempt:
                    await asyncio.sleep(_backoff(attempt))
                try:
                    got = await self._send("GetObject", key, lambda: self._get_once(client, key, limit))
                except _TooLarge as error:
                    size = f"over {limit} bytes (no Content-Length)" if error.at_least else f"{error.length} bytes"
                    raise RecordError(f"object is {size}, over the read limit {limit}") from None
                except _BodyFailed as error:
                    problem = str(error)
                    if error.retried:
                        break
                    continue
                if got is None:
                    return None
                data, expected, etag = got.data, got.length, got.etag
                if expected is not None and len(data) != int(expected):
                    problem = f"body is {len(data)} bytes, its Content-Length says {expected}"
                    continue
                if _MD5_ETAG.fullmatch(etag) and hashlib.md5(data, usedforsecurity=False).hexdigest() != etag:
                    # A body shortened with a matching Content-Length (a proxy or server bug) is
                    # well-formed: only its ETag, the MD5 of a single-part object, tells. Where the
                    # store's ETags are not MD5s (SSE-KMS, SSE-C), two reads of the same bytes are
                    # taken as the object's bytes.
                    digest = hashlib.sha256(data).digest()
                    if digest == mismatched:
                        return data
                    mismatched = digest
                    problem = f"body of {len(data)} bytes does not match its ETag {etag}"
                    continue
                return data
            raise StoreError(
                f"GET s3://{self.bucket}/{key} failed ({attempt + 1} of {self._read_attempts} reads): {problem}",
                operation="GET",
                key=key,
            )

        return await self._call("GET", key, run)

    async def list_page(
        self, prefix: str, max_keys: int = 1000, token: str | None = None, start_after: str | None = None
    ) -> ListPage:
        """One verified ListObjectsV2 page of ``prefix`` (``_verify_page``), after the key
        ``start_after`` when given (ignored with a ``token``); a page that fails verification is
        asked again (``list_attempts`` in all), then raises ``ListingError``."""
        last: ListingError | None = None
        for attempt in range(self._list_attempts):
            if attempt:
                await asyncio.sleep(_backoff(attempt))
            try:
                return await self._list_page_once(prefix, max_keys, token, set(), None if token else start_after)
            except _Unverified as error:
                last = error
        raise ListingError(f"{last} ({self._list_attempts} attempts)", operation="LIST", key=prefix)

    async def _list_page_once(
        self, prefix: str, max_keys: int, token: str | None, seen: set[str], start_after: str | None = None
    ) -> ListPage:
        async def run(client: Any) -> dict:
            return await self._send(
                "ListObjectsV2",
                prefix,
                lambda: self._list_once(client, prefix, max_keys, token, start_after),
                token,
            )

        answer = await self._call("LIST", prefix, run)
        page = _verify_page(answer, prefix, seen)
        self._note_date(answer)
        return page

    async def _rest_of_listing(self, prefix: str, out: builtins.list[ListedObject], seen: set[str]) -> None:
        """Confirm that the listing ``out`` of ``prefix`` reached its end: LIST again after its
        last key (``StartAfter``), and append what that shows, until it shows nothing.

        A page that says "not truncated" ends a listing, and nothing else on the wire tells a
        listing cut short there from a whole one. The keys a cut would hide are the last ones,
        and under a rollout prefix those are its evidence: intents (``log/i/``) and markers
        (``log/x/``) sort after every entry (``log/e/``), and a lost last call leaves no other
        trace. One more request, usually an empty page, closes that (a breaker, 2026-12-02: an
        export wrote a marked rollout as trainable from a freeze whose LIST said it was complete
        before its marker). Keys written while the listing ran show up here too and are kept.
        After ``list_attempts`` rounds that each found more, raises ``_Unverified``."""
        for _ in range(self._list_attempts):
            start = out[-1].key if out else None
            more: builtins.list[ListedObject] = []
            token: str | None = None
            tokens: set[str] = set()
            again: set[str] = set()  # this LIST's own keys: a key twice within it is refused
            while True:
                page = await self._list_page_once(prefix, 1000, token, again, None if token else start)
                fresh = [item for item in page.objects if item.key not in seen]
                if len(fresh) < len(page.objects):
                    # Keys it had listed already: the store ignores StartAfter (compared by the
                    # store's own listing order, which SeaweedFS's is, not by bytes here).
                    warn_start_after_ignored(prefix, page.objects[0].key)
                    out.extend(more)
                    seen.update(item.key for item in more)
                    return
                more.extend(fresh)
                token = page.next_token
                if token is None:
                    break
                _new_token(prefix, token, tokens)
            if not more:
                return
            # Writes racing a freeze or an export of a live rollout do this every day; a store that
            # cuts listings short does it too, and nothing tells them apart: warn once per client.
            level = logging.INFO if self._warned_more_keys else logging.WARNING
            self._warned_more_keys = True
            log.log(
                level,
                "LIST %r ended at %r, but %d more key(s) follow it (%r...): a listing cut short, or "
                "writes racing it; listing on%s",
                prefix,
                start,
                len(more),
                more[0].key,
                "" if level == logging.INFO else " (later ones on this client are logged at INFO)",
            )
            out.extend(more)
            seen.update(item.key for item in more)
        raise _Unverified(
            f"LIST {prefix!r} kept showing more keys after its end ({self._list_attempts} rounds)",
            operation="LIST",
            key=prefix,
        )

    async def list(
        self,
        prefix: str,
        *,
        require: Iterable[str] = (),
        unless: Iterable[str] = (),
        confirm_end: bool = False,
    ) -> list[ListedObject]:
        """Every object under ``prefix`` (one request per 1,000 keys), verified.

        ``require`` names keys this client has just written under ``prefix``: a listing that lacks
        one of them is stale or incomplete. ``unless`` names keys whose presence settles the
        caller's question without the required ones (a drop whose tombstone a concurrent drop
        deleted after writing the retire tombstone): a listing that shows one of them is returned
        as it is. A listing that fails verification or lacks a required key is taken again from
        the start, with backoff (``list_attempts`` in all), then raises ``ListingError``. Keys
        outside ``prefix`` are never returned. ``confirm_end``: one more
        LIST after the last key must show nothing (``confirm_listing_end``), so a page that says it
        is the last when it is not cannot cut the listing short.
        """
        required = set(require)
        settling = set(unless)
        last: ListingError | None = None
        for attempt in range(self._list_attempts):
            if attempt:
                await asyncio.sleep(_backoff(attempt))
            try:
                out: list[ListedObject] = []
                seen: set[str] = set()
                tokens: set[str] = set()
                token: str | None = None
                while True:
                    page = await self._list_page_once(prefix, 1000, token, seen)
                    out.extend(page.objects)
                    token = page.next_token
                    if token is None:
                        break
                    _new_token(prefix, token, tokens)
                if confirm_end:
                    await self._rest_of_listing(prefix, out, seen)
                missing = required - seen
                if missing and not settling & seen:
                    raise _Unverified(
                        f"LIST {prefix!r} lacks {sorted(missing)[0]!r}, which this client has just written "
                        "(a stale or incomplete listing)",
                        operation="LIST",
                        key=prefix,
                    )
                return out
            except _Unverified as error:
                last = error
                log.warning("%s; listing again", error)
        raise ListingError(f"{last} ({self._list_attempts} attempts)", operation="LIST", key=prefix)

    async def confirm_listing_end(
        self, prefix: str, listing: builtins.list[ListedObject]
    ) -> builtins.list[ListedObject]:
        """The keys of ``prefix`` after the last one of ``listing`` (a whole, verified listing of
        it): empty when ``listing`` reached the end. One LIST with ``StartAfter`` (usually one
        empty page); where it shows more, the listing goes on from there until a LIST shows
        nothing. Retried like ``list``; raises ``ListingError``. For a caller that overlaps the
        confirmation with other requests (``freeze`` with its GETs); ``list(confirm_end=True)``
        does the same in line."""
        last: ListingError | None = None
        for attempt in range(self._list_attempts):
            if attempt:
                await asyncio.sleep(_backoff(attempt))
            out = builtins.list(listing)
            try:
                await self._rest_of_listing(prefix, out, {item.key for item in listing})
                return out[len(listing) :]
            except _Unverified as error:
                last = error
                log.warning("%s; listing again", error)
        raise ListingError(f"{last} ({self._list_attempts} attempts)", operation="LIST", key=prefix)

    async def delete(self, keys: builtins.list[str]) -> None:  # `list` here is the method above
        """Delete ``keys`` with DeleteObjects in batches of 1,000, or one DELETE each where the store
        does not implement it (remembered: after a NotImplemented or MethodNotAllowed answer this
        transport sends single DELETEs only; a batch the store refuses otherwise, e.g. 400
        MalformedXML, goes out as single DELETEs this once). A batch refused with AccessDenied goes
        out as single DELETEs, one key first: refused too, that key's ``StoreError`` is raised and
        no other key is sent; allowed (the Ceph gateway authorizes DeleteObjects against the
        bucket's ARN, single DELETEs against each key's), the rest follow and this transport sends
        single DELETEs for ``BULK_DENIED_SECONDS`` before it tries DeleteObjects again (credentials
        or a policy may change). A key the answer neither confirms
        deleted nor reports failed (an answer that is not a DeleteObjects result, such as an empty
        or HTML 200 body from a proxy) is deleted again with a single DELETE, whose answer is
        unambiguous, as is a key the answer reports failed with a code of ``RETRY_CODES``
        (the client retries that DELETE). Missing keys are not an error. Raises ``StoreError``."""
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            if not self._bulk_delete or awake_clock() < self._bulk_denied_until:
                await asyncio.gather(*(self.delete_one(k) for k in batch))
                continue

            async def run(client: Any, batch: list[str] = batch) -> builtins.list[str] | str:
                answer = await self._send("DeleteObjects", batch[0], lambda: self._delete_batch_once(client, batch))
                if isinstance(answer, str):
                    return answer  # the store's code: fall back to single DELETEs
                reported, confirmed = answer
                # A per-key error the store may not repeat (InternalError, SlowDown, ...) is left
                # to a single DELETE of that key, which the client retries; others fail at once.
                reported = [e for e in reported if e.get("Code") not in RETRY_CODES]
                errors = [e for e in reported if e.get("Code") not in _NOT_FOUND]
                if errors:
                    raise StoreError(
                        f"DeleteObjects failed for {len(errors)} keys, first: {errors[0]}",
                        operation="DeleteObjects",
                        key=errors[0].get("Key", ""),
                    )
                # Absent (NoSuchKey) counts as done; a key the answer does not name at all does not.
                confirmed.update(e.get("Key", "") for e in reported)
                return [k for k in batch if k not in confirmed]

            outcome = await self._call("DeleteObjects", batch[0], run)
            if isinstance(outcome, str):
                if outcome in _BULK_UNSUPPORTED:
                    if self._bulk_delete:
                        log.warning(
                            "s3://%s: the store does not implement DeleteObjects (%s); this client sends one "
                            "DELETE per key from now on",
                            self.bucket,
                            outcome,
                        )
                    self._bulk_delete = False
                if outcome == "AccessDenied":
                    # One key first: refused too, its StoreError, and no other key is sent (a role
                    # without any delete right would otherwise send a DELETE per key to fail).
                    await self.delete_one(batch[0])
                    await asyncio.gather(*(self.delete_one(k) for k in batch[1:]))
                    if not self._bulk_denied_said:
                        self._bulk_denied_said = True
                        log.warning(
                            "s3://%s: DeleteObjects was refused (AccessDenied) but the DELETE of each key was "
                            "allowed (the Ceph gateway checks a DeleteObjects request against the bucket's ARN: "
                            "docs/permissions.md); this client sends one DELETE per key, and tries DeleteObjects "
                            "again every %.0f minutes",
                            self.bucket,
                            BULK_DENIED_SECONDS / 60,
                        )
                    self._bulk_denied_until = awake_clock() + BULK_DENIED_SECONDS
                    continue
                outcome = batch
            elif outcome:
                log.warning(
                    "s3://%s: a DeleteObjects answer confirmed %d of %d keys; deleting the other %d one by one",
                    self.bucket,
                    len(batch) - len(outcome),
                    len(batch),
                    len(outcome),
                )
            await asyncio.gather(*(self.delete_one(k) for k in outcome))

    async def delete_one(self, key: str) -> None:
        """DELETE one key (missing is not an error). Raises ``StoreError``."""

        async def run(client: Any) -> None:
            await self._send("DeleteObject", key, lambda: self._delete_one_once(client, key))

        await self._call("DELETE", key, run)


_STANDARD_BACKOFF = ExponentialBackoff()


def store_retry_delay(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (1 for the first retry) of a request the store
    answered with ``RETRY_STATUS`` or ``RETRY_CODES``: botocore's standard-mode backoff
    (``botocore.retries.standard.ExponentialBackoff``: full jitter over 2**(attempt-1) s, at most
    20 s), so requests s3capture retries itself wait as botocore's own retries do, on either
    transport."""
    return float(_STANDARD_BACKOFF.delay_amount(RetryContext(attempt_number=attempt)))


def _backoff(attempt: int) -> float:
    """Seconds before retry ``attempt`` (1, 2, ...): exponential from 50 ms with full jitter."""
    return random.uniform(0.5, 1.0) * 0.05 * (2 ** (attempt - 1))


TRANSPORT_ENV = "S3CAPTURE_TRANSPORT"
"""Environment variable naming the default transport (``aioboto3`` or ``obstore``)."""
TRANSPORTS = ("aioboto3", "obstore")


def make_transport(
    transport: str | Transport | None,
    bucket: str,
    *,
    endpoint_url: str | None = None,
    botocore_config: Any = None,
    session: Any = None,
    max_concurrency: int = 32,
) -> Transport:
    """The transport a store asked for: a ``Transport`` instance as given, else by name
    (``"aioboto3"`` or ``"obstore"``); ``None`` reads ``S3CAPTURE_TRANSPORT`` (default
    ``"aioboto3"``, chosen by measurement in ``docs/design.md``).

    Raises ``ValueError`` for an unknown name and ``ImportError`` (with the install command) when
    the obstore extra is missing.
    """
    if isinstance(transport, Transport):
        return transport
    if transport is not None and not isinstance(transport, str):
        raise TypeError(
            f"transport must be a name ({', '.join(TRANSPORTS)}) or a Transport, got {type(transport).__name__}"
        )
    name = (transport or os.environ.get(TRANSPORT_ENV) or "aioboto3").strip().lower()
    # Checked here, not at the first request: a dict for ``botocore_config`` or a string for
    # ``session`` failed deep inside botocore on aioboto3 and was silently ignored on obstore (an
    # API breaker, 2026-12-03).
    if botocore_config is not None:
        from botocore.config import Config

        if not isinstance(botocore_config, Config):
            raise TypeError(
                f"botocore_config must be a botocore.config.Config (or None), got {type(botocore_config).__name__}"
                " (wrap a dict: botocore.config.Config(**settings))"
            )
    if session is not None and not (
        callable(getattr(session, "client", None)) or callable(getattr(session, "create_client", None))
    ):
        raise TypeError(
            f"session must be an aioboto3.Session or a botocore Session (or None), got {type(session).__name__}"
        )
    kwargs = dict(
        endpoint_url=endpoint_url, botocore_config=botocore_config, session=session, max_concurrency=max_concurrency
    )
    if name == "aioboto3":
        from s3capture.transport_aioboto3 import S3Transport

        return S3Transport(bucket, **kwargs)
    if name == "obstore":
        from s3capture.transport_obstore import ObstoreTransport

        return ObstoreTransport(bucket, **kwargs)
    source = "transport" if transport else TRANSPORT_ENV
    raise ValueError(f"{source} must be one of {', '.join(TRANSPORTS)} (or a Transport), got {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "S3Transport"])


def __getattr__(name: str) -> Any:
    """``s3capture.transport.S3Transport``, where it was defined before it moved to
    ``s3capture.transport_aioboto3`` (imported on first use, as that module imports this one)."""
    if name == "S3Transport":
        from s3capture.transport_aioboto3 import S3Transport

        return S3Transport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
