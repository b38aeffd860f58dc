"""The aioboto3 transport (``transport="aioboto3"``, the default): ``S3Transport``, the object
operations of ``s3capture.transport.Transport`` over aioboto3 and botocore.

Retries of requests (5xx, throttling, connection errors) are botocore's standard retry mode, with
a ``needs-retry`` hook in front of it for the answers botocore does not retry by itself
(``RETRY_CODES``, a 429 with an unknown code); see docs/design.md, "What is retried".
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import logging
import re
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import urlsplit

from botocore import handlers as botocore_handlers
from botocore.exceptions import ClientError
from botocore.parsers import ResponseParserError

from s3capture.errors import StoreError
from s3capture.transport_errors import _cannot_connect
from s3capture.transport import (
    _NOT_FOUND,
    _NOT_IMPLEMENTED,
    RETRY_CODES,
    RETRY_STATUS,
    Transport,
    _BodyFailed,
    _Got,
    _LoopState,
    _payload_errors,
    _TooLarge,
    _Unverified,
    _code,
    check_endpoint_url,
    default_botocore_config,
    store_retry_delay,
    warn_connect_retry,
)

__all__ = ["S3Transport"]

log = logging.getLogger("s3capture")


def _not_aws(url: str) -> str:
    """``url``, or ``""`` when it is an AWS S3 endpoint (any region)."""
    host = (urlsplit(url).hostname or "").lower()
    return "" if host == "amazonaws.com" or host.endswith(".amazonaws.com") else url


@functools.cache
def _body_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a response body can raise while it streams: ``_payload_errors`` and a cut or
    reset connection."""
    errors: list[type[BaseException]] = [
        *_payload_errors(),
        asyncio.IncompleteReadError,
        asyncio.TimeoutError,
        ConnectionError,
        OSError,
    ]
    try:
        import aiohttp

        errors.append(aiohttp.ClientError)
    except ImportError:  # pragma: no cover - aiobotocore always brings aiohttp
        pass
    return tuple(errors)


def _add_content_md5(request: Any, **_: Any) -> None:
    """Send Content-MD5 with DeleteObjects: botocore >= 1.36 sends only a CRC32, which stores
    that still require Content-MD5 (older MinIO, Ceph) refuse."""
    body = request.body if isinstance(request.body, bytes) else (request.body or b"")
    if isinstance(body, str):
        body = body.encode()
    if "Content-MD5" not in request.headers and isinstance(body, bytes):
        request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()


class S3Transport(Transport):
    """The object operations of one bucket over aioboto3 (``transport="aioboto3"``, the default).

    Parameters (besides ``Transport``'s):
        botocore_config: a ``botocore.config.Config``; ``None`` for ``default_botocore_config()``
            (path-style addressing when an endpoint is set).
        session: an ``aioboto3.Session``; ``None`` builds one from the standard credential chain
            (and builds it again when credentials expire).

    Retries of requests (5xx, throttling, connection errors) are botocore's standard retry mode;
    ``request_counts`` counts every HTTP attempt, retries included. An ``ExpiredToken``-class
    answer resolves the credential chain again and rebuilds the client when the credentials
    changed (a caller's own session is never touched).
    """

    name = "aioboto3"

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        botocore_config: Any = None,
        session: Any = None,
        max_concurrency: int = 32,
        read_attempts: int = 4,
        list_attempts: int = 5,
    ) -> None:
        super().__init__(
            bucket,
            endpoint_url=endpoint_url,
            max_concurrency=max_concurrency,
            read_attempts=read_attempts,
            list_attempts=list_attempts,
        )
        if botocore_config is None:
            extra = {"s3": {"addressing_style": "path"}} if endpoint_url else {}
            botocore_config = default_botocore_config(max(max_concurrency, 10), **extra)
        self._config = botocore_config
        self._session = session
        self._owns_session = session is None

    def _counted(self, operation: str) -> None:
        pass  # counted per HTTP attempt by the before-send event (_count_request)

    async def effective_endpoint(self) -> str:
        if self.endpoint_url:
            return self.endpoint_url
        return _not_aws(str((await self.client()).meta.endpoint_url or ""))

    def configured_endpoint_url(self) -> str:
        if self.endpoint_url:
            return self.endpoint_url
        # botocore's own resolution of an endpoint from the AWS config (a profile's or its
        # ``services`` section's ``endpoint_url``), as its client creation does: files only.
        try:
            from botocore.configprovider import ConfiguredEndpointProvider
            from botocore.session import Session

            session = getattr(self._session, "_session", None) or Session()
            if session.get_config_variable("ignore_configured_endpoint_urls"):
                return ""
            provider = ConfiguredEndpointProvider(
                full_config=session.full_config, scoped_config=session.get_scoped_config(), client_name="s3"
            )
            return _not_aws(str(provider.provide() or ""))
        except Exception as error:  # noqa: BLE001 - a broken AWS config fails the first request with its own error
            log.debug("no endpoint from the AWS config (%s)", error)
            return ""

    def _forked(self, states: Any) -> None:
        # A forked child must not share the parent's sockets: start afresh, never close the
        # parent's clients from here.
        _disown(states)

    async def _open(self, stack: AsyncExitStack) -> Any:
        if self._session is None:
            import aioboto3

            self._session = aioboto3.Session()
        client = await stack.enter_async_context(
            self._session.client("s3", endpoint_url=self.endpoint_url, config=self._config)
        )
        if not self.endpoint_url:
            # An endpoint from the AWS config (a profile's endpoint_url) is checked as the argument
            # and the environment's are at construction (a review, 2026-12-03: one ending in the
            # bucket stored every key under "BUCKET/"): here, before the first request is sent.
            try:
                check_endpoint_url(
                    str(client.meta.endpoint_url), bucket=self.bucket, source="endpoint_url of the AWS config"
                )
            except ValueError:
                await stack.aclose()
                raise
        client.meta.events.register("before-send.s3", self._count_request)
        client.meta.events.register("needs-retry.s3", self._note_retry)
        # Before botocore's own handler: the first delay any handler returns is the one used.
        client.meta.events.register_first("needs-retry.s3", self._retry_throttled)
        client.meta.events.register("before-sign.s3.DeleteObjects", _add_content_md5)
        # botocore asks for "Expect: 100-continue" on every PUT with a body, which costs a
        # whole extra round trip before the body is sent; objects are small and every PUT
        # is idempotent, so send the body at once.
        client.meta.events.unregister("before-call.s3", botocore_handlers.add_expect_header)
        return client

    def _count_request(self, event_name: str = "", **_: Any) -> None:
        self.request_counts[event_name.rsplit(".", 1)[-1]] += 1

    def _attempt_limit(self) -> int:
        retries = getattr(self._config, "retries", None) or {}
        # botocore's max_attempts counts retries; total_max_attempts counts the first try too
        return int(retries.get("total_max_attempts") or (int(retries.get("max_attempts") or 2) + 1))

    def _retry_throttled(self, response: Any = None, attempts: int = 0, **_: Any) -> float | None:
        """botocore's standard mode retries 5xx and the throttling codes it knows, but not a 429
        with another code (GCS's XML API, some gateways: ``TooManyRequests``) nor every code of
        ``RETRY_CODES``: for those, the delay of its own backoff (full jitter over 2**(attempt-1)
        seconds, at most 20 s) while attempts remain; ``None`` leaves the decision to botocore."""
        if response is None or attempts >= self._attempt_limit():
            return None
        http, parsed = response
        status = getattr(http, "status_code", 0)
        if status in RETRY_STATUS and status != 429:
            return None  # botocore retries it (and keeps its retry quota)
        code = str((parsed or {}).get("Error", {}).get("Code", ""))
        if status == 429 or code in _RETRIED_HERE:
            return store_retry_delay(attempts)
        return None

    def _note_retry(self, attempts: int = 0, caught_exception: Any = None, **_: Any) -> None:
        """Observes botocore's retry decision (returns nothing, so decides nothing): warns when
        a request could not connect, or got no answer in time, and attempts remain."""
        from botocore.exceptions import ReadTimeoutError

        if isinstance(caught_exception, ReadTimeoutError) or (
            caught_exception is not None and _cannot_connect(caught_exception)
        ):
            limit = self._attempt_limit()
            if attempts < limit:
                no_answer = isinstance(caught_exception, ReadTimeoutError)
                warn_connect_retry(self.endpoint_url, caught_exception, attempts, limit, no_answer=no_answer)

    async def _refresh(self, state: _LoopState, generation: int) -> bool:
        """After an expired-token answer: resolve the standard credential chain again and rebuild
        the client when it yields other credentials. Returns whether the request is worth retrying.

        A caller's session is never touched (its own providers refresh what can be refreshed), and
        credentials that did not change rebuild nothing, so a permanent error is no retry storm.
        """
        if not self._owns_session:
            return False
        import aioboto3

        async with state.lock:
            if state.generation != generation or state.client is None:
                return True  # another request rebuilt it already
            fresh = aioboto3.Session()
            old, new = await _frozen_credentials(self._session), await _frozen_credentials(fresh)
            if new is None or new == old:
                return False
            if state.stack is not None:
                state.retired.append(state.stack)  # closed at close(): requests may still use it
            state.client, state.stack = None, None
            self._session = fresh
        log.warning("s3://%s: credentials expired or invalid; client rebuilt with fresh credentials", self.bucket)
        return True

    async def _put_once(self, client: Any, key: str, body: bytes) -> None:
        response = await client.put_object(Bucket=self.bucket, Key=key, Body=body)
        if not response.get("ETag"):
            # Every S3 store answers a stored PUT with the object's ETag; a 200 without one came
            # from something in between that did not store it (a ledger breaker, 2026-12-04: such
            # an answer made record and retire return, and the row or tombstone was never there).
            # object_store refuses it too, so both transports fail the PUT alike: not acknowledged.
            raise StoreError(
                f"PutObject {key!r} was answered {response.get('ResponseMetadata', {}).get('HTTPStatusCode', '?')} "
                "without an ETag: not known to be stored",
                operation="PutObject",
                key=key,
            )

    async def _get_once(self, client: Any, key: str, limit: int | None) -> _Got | None:
        try:
            response = await client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as error:
            if _code(error) in _NOT_FOUND:
                return None
            raise
        except _payload_errors() as error:
            # An answer (a 404's error document, say) whose body was cut while botocore read it:
            # read again, as a cut object body is (botocore does not retry this one).
            raise _BodyFailed(f"answer body failed after {type(error).__name__}: {error}") from None
        expected = response.get("ContentLength")
        etag = str(response.get("ETag") or "").strip('"').lower()
        if response.get("ContentRange") and not _whole_range(str(response["ContentRange"])):
            # A part (206) answered to a GET of the whole object: read again, never take it whole.
            response["Body"].close()
            raise _BodyFailed(f"answered only a part ({response['ContentRange']}) to a GET of the whole object")
        if limit is not None and expected is not None and int(expected) > limit:
            response["Body"].close()
            raise _TooLarge(int(expected))
        try:
            if limit is None or expected is not None:
                async with response["Body"] as stream:
                    data = await stream.read()
            else:  # no Content-Length (a chunked answer): read no more than the limit allows
                try:
                    data = await _read_at_most(response["Body"], limit)
                finally:
                    response["Body"].close()
        except _body_errors() as error:
            raise _BodyFailed(f"body failed after {type(error).__name__}: {error}") from None
        return _Got(data, int(expected) if expected is not None else None, etag)

    async def _list_once(
        self, client: Any, prefix: str, max_keys: int, token: str | None, start_after: str | None = None
    ) -> dict:
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": max_keys}
        if token:
            params["ContinuationToken"] = token
        if start_after:
            params["StartAfter"] = start_after
        try:
            return await client.list_objects_v2(**params)
        except ResponseParserError as error:
            raise _Unverified(
                f"LIST {prefix!r} answered with an unparseable body: {error}", operation="LIST", key=prefix
            ) from None

    async def _delete_batch_once(self, client: Any, keys: list[str]) -> tuple[list[dict], set[str]] | str:
        # Not quiet: the answer names every deleted key, so an answer that is not a DeleteObjects
        # result (botocore parses an empty or HTML 200 body to nothing) confirms nothing.
        try:
            response = await client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": False}
            )
        except ClientError as error:
            code = _code(error)
            if code in _NOT_IMPLEMENTED:
                return code
            raise
        except ResponseParserError:
            # A garbled answer (a proxy's part of it, a 206 nobody asked for) confirms nothing:
            # every key goes out again as a single DELETE, as for an empty or HTML 200 body.
            return [], set()
        return list(response.get("Errors", ())), {d.get("Key", "") for d in response.get("Deleted", ())}

    async def _delete_one_once(self, client: Any, key: str) -> None:
        try:
            await client.delete_object(Bucket=self.bucket, Key=key)
        except ClientError as error:
            if _code(error) not in _NOT_FOUND:
                raise


def _disown(states: Any) -> None:
    """In a forked child: make the parent's HTTP clients inert before they are dropped.

    Dropping them lets aiohttp's connector finalizer close its pooled connections, and closing a
    transport of the parent's event loop unregisters its socket from the epoll instance that the
    child shares with the parent: the parent's next request on that connection then waits for a
    read timeout (30 s). Marking each connector closed makes its finalizer a no-op; the child's
    copies of the sockets are released with the process.
    """
    for state in list(states.values()):
        http = getattr(getattr(state.client, "_endpoint", None), "http_session", None)
        for session in list((getattr(http, "_sessions", None) or {}).values()):
            connector = getattr(session, "connector", None)
            if connector is not None and hasattr(connector, "_closed"):
                connector._closed = True


async def _frozen_credentials(session: Any) -> tuple[str, str, str | None] | None:
    """``(access key, secret, token)`` a session resolves now, or ``None``."""
    try:
        credentials = await session._session.get_credentials()
        if credentials is None:
            return None
        frozen = await credentials.get_frozen_credentials()
        return frozen.access_key, frozen.secret_key, frozen.token
    except Exception:  # noqa: BLE001 - an unresolvable chain is "no new credentials"
        return None


_RETRIED_HERE = RETRY_CODES - {
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
}
"""``RETRY_CODES`` that botocore's standard mode does not retry by itself (it retries these by
code, and every 500, 502, 503 and 504 by status)."""


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def _whole_range(content_range: str) -> bool:
    """Whether a ``Content-Range`` (``bytes FIRST-LAST/TOTAL``) covers the whole object (some
    gateways send one with every 200)."""
    match = _CONTENT_RANGE.fullmatch(content_range.strip())
    return match is not None and int(match.group(1)) == 0 and int(match.group(2)) + 1 == int(match.group(3))


async def _read_at_most(stream: Any, limit: int) -> bytes:
    """A body of unknown length, read in pieces; raises ``_TooLarge`` once it is over ``limit``."""
    parts: list[bytes] = []
    total = 0
    while True:
        piece = await stream.read(min(1 << 20, limit + 1 - total))
        if not piece:
            return b"".join(parts)
        parts.append(piece)
        total += len(piece)
        if total > limit:
            raise _TooLarge(total, at_least=True)
