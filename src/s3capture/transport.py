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

# The parts of the seam live beside this module, which re-exports their names:
# s3capture.transport_config (endpoint checks, default_botocore_config), s3capture.transport_errors
# (error codes, connect warnings, retry delays), s3capture.transport_listing (ListedObject, ListPage, page
# verification, the confirmation of a listing's end: Transport's listing methods),
# s3capture.transport_delete (Transport's delete with fallback) and s3capture.transport_clients
# (the client per event loop and process, and how close closes them).

from __future__ import annotations

import asyncio
import collections
import email.utils
import hashlib
import inspect
import logging
import os
import re
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from s3capture.clocks import awake_clock
from s3capture.errors import StoreError
from s3capture.transport_listing import (
    ListedObject as ListedObject,
    ListingMixin,
    ListPage as ListPage,
    _new_token as _new_token,
    _Unverified as _Unverified,
    _verify_page as _verify_page,
    beside_confirmation as beside_confirmation,
    cancel_unfinished as cancel_unfinished,
    gather_fail_fast as gather_fail_fast,
    gather_settled as gather_settled,
    settle_each as settle_each,
    warn_start_after_ignored as warn_start_after_ignored,
)
from s3capture.records import RecordError
from s3capture.transport_clients import _ABANDONED as _ABANDONED, LoopClientsMixin, _LoopState as _LoopState
from s3capture.transport_config import (
    check_endpoint_url as check_endpoint_url,
    checked_endpoint as checked_endpoint,
    configured_endpoint as configured_endpoint,
    default_botocore_config as default_botocore_config,
)
from s3capture.transport_delete import (
    _BULK_UNSUPPORTED as _BULK_UNSUPPORTED,
    BULK_DENIED_SECONDS as BULK_DENIED_SECONDS,
    DeleteMixin,
)
from s3capture.transport_errors import (
    _CREDENTIAL_ERRORS,
    _NOT_FOUND as _NOT_FOUND,
    _NOT_IMPLEMENTED as _NOT_IMPLEMENTED,
    RETRY_CODES as RETRY_CODES,
    RETRY_STATUS as RETRY_STATUS,
    _backoff as _backoff,
    _cannot_connect,
    _lost_after_connecting,
    _code as _code,
    _payload_errors as _payload_errors,
    connect_log as connect_log,
    store_retry_delay as store_retry_delay,
    warn_connect_retry as warn_connect_retry,
)

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

_MD5_ETAG = re.compile(r"[0-9a-f]{32}")
"""A single-part object's ETag: the MD5 of its bytes (unless encrypted with KMS or a customer key)."""


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


class Transport(DeleteMixin, ListingMixin, LoopClientsMixin):
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
    async def client(self) -> Any:
        """The underlying client of the running event loop (opened on first use)."""
        return (await self._client(self._state()))[0]

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
        """The text of a client library's error, as a ``StoreError`` message quotes it (for a
        connection lost after it was made, the cause, not botocore's "Could not connect")."""
        from botocore.exceptions import ConnectionError as BotocoreConnectionError

        lost = _lost_after_connecting(error) if isinstance(error, BotocoreConnectionError) else None
        return f"{type(lost).__name__}: {lost}" if lost is not None else str(error)

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
            check = "check the endpoint (--endpoint, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL) and the network"
            if "WRONG_VERSION_NUMBER" in str(error) and (self.endpoint_url or "").startswith("https://"):
                check = "the server answers plain HTTP: use http:// in the endpoint (--endpoint, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)"
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
