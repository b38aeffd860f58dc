"""The obstore transport: PUT, GET and DELETE through Rust's ``object_store``, LIST verified here.

``pip install 's3capture[obstore]'``; selected by ``transport="obstore"`` on a store or ledger, or
by ``S3CAPTURE_TRANSPORT=obstore``. Everything the stores rely on (bounds, hooks, error mapping,
re-reads of failed GET bodies, the verified listing) is ``s3capture.transport.Transport``'s, shared
with the aioboto3 transport; this module supplies only the single requests.

- **PUT and GET** go through ``obstore`` (the Python binding of ``object_store``), which spends
  about a seventh of botocore's client CPU per request. Its own retry policy (exponential backoff
  on 5xx, throttling and connection errors) retries them; ``request_counts`` counts one request per
  call (object_store's internal retries are not visible).
- **DeleteObjects and DELETE** are signed HTTP requests of this module, as the LIST is:
  ``object_store`` retries a 501 NotImplemented (a store without DeleteObjects, such as GCS's XML
  API) for its whole backoff, and its delete of one key is itself a DeleteObjects, so the fallback
  to single DELETEs that such a store needs could not work through it.
- **LIST** is one signed HTTP request per page (aiohttp, SigV4 from botocore), parsed with the
  standard library's XML parser, because ``object_store`` hides what the verified listing must see:
  it ends a listing at a page without a continuation token even when the page says it is truncated,
  and reads a body without ``IsTruncated`` as an empty page. Failed LIST requests (5xx, throttling,
  connection errors) are retried with exponential backoff and full jitter, like botocore's
  standard mode.
- **Credentials** come from botocore's standard chain (environment, profile, SSO, container and
  instance metadata), the same chain the aioboto3 transport uses; temporary credentials are
  resolved again before they expire.
- **Keys reach the server byte for byte**: ``object_store`` refuses empty and ``.``/``..`` segments
  (which ``s3capture.layout`` never builds and which roots may not contain) and sends every other
  key unchanged (``tests/test_transport.py`` checks every key shape the layout builds).
- **Where it lives**: this module holds ``ObstoreTransport`` (credentials, the client per loop,
  error mapping and the single requests, the signed ones included); the signer, the DeleteObjects
  bodies and the parsing of the answers to its own requests are in
  ``s3capture.transport_obstore_http``, whose names are importable from here too.
- **Not fork-safe**: ``object_store``'s runtime does not survive ``fork()``. A forked child that
  uses an obstore transport after its parent did gets ``StoreError`` at once (not a hang); use the
  ``spawn`` start method, or the aioboto3 transport, in forking workers.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as _dt
import hashlib
import logging
import os
import re
import threading
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from types import FrameType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from s3capture.errors import StoreError, install_hint
from s3capture.transport_errors import _cannot_connect

if TYPE_CHECKING:
    from obstore.store import S3Config

from s3capture.transport import (
    RETRY_CODES,
    RETRY_STATUS,
    T,
    configured_endpoint,
    store_retry_delay,
    _NOT_FOUND,
    _NOT_IMPLEMENTED,
    Transport,
    _BodyFailed,
    _Got,
    _TooLarge,
    warn_connect_retry,
)
from s3capture.transport_obstore_http import (
    _XML_CODE,
    _delete_body,
    _delete_result,
    _host_header,
    _list_signer_class,
    _parse_list,
    _S3HTTPError,
    _url_decoded as _url_decoded,
)

__all__ = ["ObstoreTransport"]

log = logging.getLogger("s3capture")

_RUNTIME_PID: int | None = None
"""The process in which obstore's runtime was first used (it does not survive ``fork``)."""
_RUNTIME_LOCK = threading.Lock()


def _rust_threads_in_asyncio() -> int:
    """How many threads other than this one are inside asyncio's ``call_soon_threadsafe``.

    obstore (through pyo3-async-runtimes) completes each future from one of its tokio threads
    with ``loop.call_soon_threadsafe``, whose wake-up write to the loop's self-pipe releases the
    GIL. The loop can run the completion, and the program can finish, while that thread is still
    inside the write: when it then takes the GIL back during interpreter finalization, CPython
    ends the thread with ``pthread_exit``, which cannot unwind through Rust frames, and the whole
    process aborts (SIGABRT) after everything it did succeeded.
    """
    import sys

    me = threading.get_ident()
    busy = 0
    for ident, top in sys._current_frames().items():
        if ident == me:
            continue
        frame: FrameType | None = top
        while frame is not None:
            code = frame.f_code
            if code.co_name in ("call_soon_threadsafe", "_write_to_self") and "asyncio" in code.co_filename:
                busy += 1
                break
            frame = frame.f_back
    return busy


def settle_completions(timeout: float = 2.0) -> bool:
    """Wait (up to ``timeout`` seconds) until no obstore thread is still handing a finished
    request back to an event loop (see ``_rust_threads_in_asyncio``). Called by
    ``ObstoreTransport.close`` and, once obstore has been used, at interpreter exit.

    Returns ``True`` when none is left (at once, when obstore was never used)."""
    import time

    deadline = time.monotonic() + timeout
    while _rust_threads_in_asyncio():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)  # releases the GIL: the thread takes it, returns, and lets it go
    return True


_STATUS = re.compile(r"\b(?:status|Status)[: ]+(\d{3})\b")
_ANSWER_STATUS = re.compile(r"non-2xx status code: (\d{3})\b")
"""The HTTP status in object_store's error for an answer it did not take (``Server returned
non-2xx status code: 400 Bad Request: <body>``)."""
# the operating system's words for an I/O error in object_store's debug dump ("Connection reset by peer")
_OS_MESSAGE = re.compile(r'message: "([^"\n]{1,200})"')


def _settings(botocore_config: Any) -> tuple[int, float, float]:
    """``(max_attempts, connect_timeout, read_timeout)`` from a botocore ``Config`` (or defaults),
    so one configuration means the same on both transports."""
    attempts, connect, read = 6, 5.0, 30.0  # default_botocore_config's: 5 retries
    if botocore_config is not None:
        retries = getattr(botocore_config, "retries", None) or {}
        # as botocore reads them: total_max_attempts counts the first try, max_attempts the retries
        if retries.get("total_max_attempts"):
            attempts = int(retries["total_max_attempts"])
        elif retries.get("max_attempts") is not None:
            attempts = int(retries["max_attempts"]) + 1
        connect = float(getattr(botocore_config, "connect_timeout", None) or connect)
        read = float(getattr(botocore_config, "read_timeout", None) or read)
    return max(attempts, 1), connect, read


class ObstoreTransport(Transport):
    """The object operations of one bucket over obstore (``transport="obstore"``).

    Parameters (besides ``Transport``'s):
        botocore_config: a ``botocore.config.Config`` whose retry attempts and timeouts are
            applied here too (``None``: 6 attempts, 5 s connect, 30 s read timeouts).
        session: an ``aioboto3.Session`` or ``botocore.session.Session`` whose profile and region
            are used; ``None``: the standard credential chain and ``AWS_REGION`` /
            ``AWS_DEFAULT_REGION`` (``us-east-1`` when unset).

    Raises ``ImportError`` with the install command when obstore is missing.
    """

    name = "obstore"

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
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise ImportError(f"transport='obstore' needs obstore: {install_hint('obstore')}") from None
        # As botocore does: object_store would otherwise read AWS_ENDPOINT_URL on its own while the
        # LIST requests signed here went to AWS.
        endpoint_url = configured_endpoint(endpoint_url)
        super().__init__(
            bucket,
            endpoint_url=endpoint_url,
            max_concurrency=max_concurrency,
            read_attempts=read_attempts,
            list_attempts=list_attempts,
        )
        self._attempts, self._connect_timeout, self._read_timeout = _settings(botocore_config)
        import botocore.session

        self._profile: str | None = None
        self._owns_credentials = True
        if isinstance(session, botocore.session.Session) and not type(session).__module__.startswith("aiobotocore"):
            botocore_session = session  # the caller's: its own providers refresh what can be refreshed
            self._owns_credentials = False
        else:  # an aioboto3 session (async credentials) or none: the same profile, read synchronously
            profile = getattr(session, "profile_name", None) if session is not None else None
            self._profile = profile if profile not in (None, "default") else None
            botocore_session = botocore.session.Session(profile=self._profile)
            explicit = getattr(getattr(session, "_session", None), "_credentials", None)
            if (
                explicit is not None
                and getattr(explicit, "method", None) == "explicit"
                and getattr(explicit, "access_key", None)
            ):
                # aioboto3.Session(aws_access_key_id=..., ...): the caller's keys, as on aioboto3.
                # Credentials the session resolved from its chain (env, instance role, SSO) are
                # not copied: they may be temporary, and the chain is read again here.
                import botocore.credentials

                botocore_session._credentials = botocore.credentials.Credentials(
                    explicit.access_key, explicit.secret_key, getattr(explicit, "token", None)
                )
                self._owns_credentials = False
        self._botocore = botocore_session
        region = getattr(session, "region_name", None) if session is not None else None
        self.region = (
            region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or self._botocore.get_config_variable("region")
            or "us-east-1"
        )
        self._credentials: Any = None
        self._credentials_lock = threading.Lock()
        if endpoint_url:
            self._base = endpoint_url.rstrip("/") + "/" + quote(bucket, safe="")
        else:
            self._base = f"https://s3.{self.region}.amazonaws.com/{quote(bucket, safe='')}"
        self._signer: Any = None  # (frozen credentials, _ListSigner), rebuilt when they change
        self._host = _host_header(self._base)

    # ------------------------------------------------------------------ credentials
    def _frozen(self) -> Any:
        """Frozen credentials of the standard chain (refreshed by botocore when temporary)."""
        with self._credentials_lock:
            if self._credentials is None:
                self._credentials = self._botocore.get_credentials()
                if self._credentials is None:
                    raise StoreError(
                        f"no AWS credentials found for s3://{self.bucket} (the standard credential chain is empty)"
                    )
            return self._credentials.get_frozen_credentials()

    def _provide(self) -> dict[str, Any]:
        """obstore's credential provider: the chain's current credentials, asked for again after
        a minute (botocore refreshes temporary ones before they expire; a rotation found by
        ``_refresh`` reaches every client within that minute)."""
        frozen = self._frozen()
        expires = _dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(minutes=1)
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expires,
        }

    async def _refresh(self, state: Any, generation: int) -> bool:
        """After an expired-token answer: resolve the standard credential chain again and rebuild
        this loop's client when it yields credentials other than the ones that failed. A caller's
        own botocore session is never replaced; unchanged credentials rebuild nothing (no retry
        storm on a permanent error)."""
        if not self._owns_credentials:
            return False
        import botocore.session

        async with state.lock:
            if state.generation != generation or state.client is None:
                return True  # another request rebuilt it already
            used = state.client[2]
            fresh = botocore.session.Session(profile=self._profile)
            credentials = fresh.get_credentials()
            if credentials is None:
                return False
            frozen = credentials.get_frozen_credentials()
            if (frozen.access_key, frozen.secret_key, frozen.token) == used:
                return False
            with self._credentials_lock:
                self._botocore, self._credentials = fresh, credentials
            if state.stack is not None:
                state.retired.append(state.stack)  # closed at close(): requests may still use it
            state.client, state.stack = None, None
        log.warning("s3://%s: credentials expired or invalid; client rebuilt with fresh credentials", self.bucket)
        return True

    async def close(self, timeout: float = 30.0) -> None:
        """``Transport.close``, then wait (at most 2 s) until obstore's threads have handed back
        every finished request (``settle_completions``): a program may end right after."""
        await super().close(timeout)
        for _ in range(2000):
            if not _rust_threads_in_asyncio():
                break
            await asyncio.sleep(0.001)

    # ------------------------------------------------------------------ client per loop
    def _forked(self, states: Any) -> None:
        pass  # nothing to disown: the check in _open refuses to use obstore here at all

    async def _open(self, stack: AsyncExitStack) -> Any:
        global _RUNTIME_PID
        with _RUNTIME_LOCK:
            if _RUNTIME_PID is not None and _RUNTIME_PID != os.getpid():
                raise StoreError(
                    "transport='obstore' cannot be used in a process forked after obstore ran in its parent "
                    "(object_store's runtime does not survive fork): use the 'spawn' start method, or transport='aioboto3'"
                )
            if _RUNTIME_PID is None:
                import atexit

                atexit.register(settle_completions)
            _RUNTIME_PID = os.getpid()
        import aiohttp
        from obstore.store import S3Store

        frozen = self._frozen()  # before anything is opened: missing credentials leak nothing
        config: S3Config = {"region": self.region, "virtual_hosted_style_request": False}
        if self.endpoint_url:
            config["endpoint"] = self.endpoint_url
        provider: Any = None
        if hasattr(self._credentials, "refresh_needed"):
            provider = self._provide  # temporary credentials: object_store asks again every minute
        else:
            # Static keys go in as configuration: no Python callback runs on object_store's threads
            # (one at interpreter exit can abort the process); a rotation rebuilds the client.
            config["access_key_id"], config["secret_access_key"] = frozen.access_key, frozen.secret_key
            if frozen.token:
                config["session_token"] = frozen.token  # the key S3Config names ("token" is an alias)
        store = S3Store(
            self.bucket,
            config=config,
            client_options={
                "allow_http": bool(self.endpoint_url and self.endpoint_url.startswith("http://")),
                "connect_timeout": _dt.timedelta(seconds=self._connect_timeout),
                # botocore's read timeout is per read, as object_store's read_timeout; its overall
                # timeout must not cut a large entry on a slow link.
                "read_timeout": _dt.timedelta(seconds=self._read_timeout),
                "timeout": _dt.timedelta(seconds=max(600.0, 10 * self._read_timeout)),
                "pool_max_idle_per_host": str(max(self._max_concurrency, 10)),
            },
            retry_config={
                "max_retries": self._attempts - 1,
                "retry_timeout": _dt.timedelta(seconds=max(60.0, self._read_timeout * 2)),
                # botocore's standard mode: up to 1, 2, 4, 8 s (jittered), at most 20 s, so a
                # server restart of a few seconds is ridden out on both transports alike.
                "backoff": {
                    "init_backoff": _dt.timedelta(seconds=1),
                    "max_backoff": _dt.timedelta(seconds=20),
                    "base": 2,
                },
            },
            credential_provider=provider,
        )
        http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max(self._max_concurrency, 10)),
            cookie_jar=aiohttp.DummyCookieJar(),  # S3 sets none worth keeping; skips the jar per request
            timeout=aiohttp.ClientTimeout(sock_connect=self._connect_timeout, sock_read=self._read_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        stack.push_async_callback(http.close)
        return store, http, (frozen.access_key, frozen.secret_key, frozen.token)

    def _error_text(self, error: BaseException) -> str:
        # object_store's messages end in a multi-line Rust debug dump: keep the first line (the
        # StoreError's own words, e.g. "; check the endpoint", come after it), and the operating
        # system's words for the cause when the dump names one ("Connection reset by peer").
        full = str(error)
        text = full.split("\n\nDebug source:", 1)[0].split("\n", 1)[0]
        text = text[:400] + "..." if len(text) > 400 else text
        causes = _OS_MESSAGE.findall(full)
        return f"{text} ({causes[-1]})" if causes and causes[-1] not in text else text

    def _could_not_send(self, error: BaseException) -> bool:
        # object_store's own retries of a refused connection end in "HTTP error: error sending
        # request", naming no cause (an API breaker, 2026-12-03: no "check the endpoint" hint).
        # The same words end a request whose connection was reset after it was made; the debug
        # dump tells them apart: "kind: Connect" or hyper's "ConnectError(" (a connect timeout is
        # "kind: Timeout" around one) for a connection never made.
        text = str(error)
        if "error sending request" not in text:
            return False
        return "Debug source:" not in text or "kind: Connect," in text or "ConnectError(" in text

    def _error_code(self, error: BaseException) -> str:
        response = getattr(error, "response", None)
        if response:
            return str(response.get("Error", {}).get("Code", ""))
        import obstore.exceptions as oe

        text = str(error)
        match = _XML_CODE.search(text)
        if match:
            return match.group(1)  # first: a 404 may be NoSuchBucket
        if isinstance(error, (oe.NotFoundError, FileNotFoundError)):
            return "NoSuchKey"
        if isinstance(error, oe.PermissionDeniedError):
            return "AccessDenied"
        if isinstance(error, oe.UnauthenticatedError):
            return "InvalidAccessKeyId"
        match = _STATUS.search(text)
        return match.group(1) if match else ""

    # ------------------------------------------------------------------ single requests
    async def _riding_out(self, operation: str, request: Callable[[], Awaitable[T]]) -> T:
        """``request()``, sent again on an answer of ``RETRY_CODES`` whose status object_store does
        not retry itself (it retries 5xx, 429 and lost connections): S3's ``400 RequestTimeout`` (a
        request body the store waited too long for), or a throttling code under another 4xx. Up
        to the configured attempts, with botocore's backoff; object_store's own retries of a 5xx
        inside one attempt are not counted here (``request_counts``: one per attempt)."""
        for attempt in range(self._attempts):
            if attempt:
                await asyncio.sleep(store_retry_delay(attempt))
                self.request_counts[operation] += 1  # a retry is one more HTTP request
            try:
                return await request()
            except Exception as error:
                status = _ANSWER_STATUS.search(str(error))
                retried_inside = status is None or int(status.group(1)) in RETRY_STATUS
                if attempt + 1 < self._attempts and not retried_inside and self._error_code(error) in RETRY_CODES:
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _put_once(self, client: Any, key: str, body: bytes) -> None:
        import obstore

        await self._riding_out("PutObject", lambda: obstore.put_async(client[0], key, body, use_multipart=False))

    async def _get_once(self, client: Any, key: str, limit: int | None) -> _Got | None:
        import obstore
        import obstore.exceptions as oe

        try:
            result = await self._riding_out("GetObject", lambda: obstore.get_async(client[0], key))
        except (oe.NotFoundError, FileNotFoundError) as error:  # obstore raises the built-in one for any 404
            if self._error_code(error) not in _NOT_FOUND:
                raise  # NoSuchBucket is no "absent object": a fence would read "open"
            return None
        except Exception as error:
            if self._error_code(error) in _NOT_FOUND:
                return None
            if "Content-Length Header missing" in str(error):
                raise StoreError(
                    f"GET {key!r} was answered without a Content-Length (a chunked answer, from a proxy or "
                    "gateway?), which the obstore transport cannot read; use transport='aioboto3' there",
                    operation="GET",
                    key=key,
                ) from error
            if "response body error" in str(error):
                # An answer (a 404's error document, say) whose body was cut: object_store does not
                # resume it, so read again, as a cut object body is.
                raise _BodyFailed(f"answer body failed after {type(error).__name__}: {error}") from None
            raise
        meta = result.meta
        size = meta.get("size")
        etag = str(meta.get("e_tag") or "").strip('"').lower()
        if limit is not None and size is not None and int(size) > limit:
            raise _TooLarge(int(size))
        try:
            data = bytes(await result.bytes_async())
        except Exception as error:  # noqa: BLE001 - any failure while the body streams is re-read
            # object_store has already resumed the body with range requests, with its own retries
            # and backoff (max_retries): another GET from the top would multiply them.
            raise _BodyFailed(f"body failed after {type(error).__name__}: {error}", retried=True) from None
        return _Got(data, int(size) if size is not None else None, etag)

    async def _delete_batch_once(self, client: Any, keys: list[str]) -> tuple[list[dict], set[str]] | str:
        # DeleteObjects as this module's own signed POST, like the listing: object_store retries a
        # 501 NotImplemented (GCS's XML API has no DeleteObjects) as it retries any 5xx, for up to
        # its whole backoff (about 15-30 s) before the fallback to single DELETEs could start.
        body = _delete_body(keys)
        headers = {
            "Content-MD5": base64.b64encode(hashlib.md5(body).digest()).decode(),
            "Content-Type": "application/xml",
        }
        try:
            answer, _ = await self._signed_request(
                client[1], "DeleteObjects", f"{self._base}?delete", method="POST", body=body, headers=headers
            )
        except _S3HTTPError as error:
            code = str(error.response["Error"]["Code"])
            if code in _NOT_IMPLEMENTED:
                return code
            raise
        return _delete_result(answer)

    async def _delete_one_once(self, client: Any, key: str) -> None:
        # A plain DELETE (object_store's delete of one path is a DeleteObjects of one key, which a
        # store without DeleteObjects refuses: the fallback would fail as the batch did).
        try:
            await self._signed_request(
                client[1], "DeleteObject", f"{self._base}/{quote(key, safe='/')}", method="DELETE", ok=(200, 204)
            )
        except _S3HTTPError as error:
            if error.response["Error"]["Code"] not in _NOT_FOUND:
                raise

    async def _list_once(
        self, client: Any, prefix: str, max_keys: int, token: str | None, start_after: str | None = None
    ) -> dict:
        # The parameters in SigV4's canonical order (sorted by name), values percent-encoded as
        # the canonical query string wants them, so the URL sent is the one signed.
        query = f"encoding-type=url&list-type=2&max-keys={int(max_keys)}&prefix={quote(prefix, safe='-_.~')}"
        if start_after:
            query += f"&start-after={quote(start_after, safe='-_.~')}"
        if token:
            query = f"continuation-token={quote(token, safe='-_.~')}&{query}"
        url = f"{self._base}?{query}"
        body, date = await self._signed_request(client[1], "ListObjectsV2", url)
        page = _parse_list(body, prefix)
        if date:
            page["ResponseMetadata"] = {"HTTPHeaders": {"date": date}}
        return page

    def _sign(
        self, url: str, method: str = "GET", body: bytes = b"", headers: dict[str, str] | None = None
    ) -> dict[str, str]:
        """The headers of a SigV4-signed request for ``url`` (botocore's S3 signer, kept for as
        long as the credentials do not change; see ``_ListSigner``): a body-less GET or DELETE,
        or a POST of ``body`` with ``headers``, which are signed too."""
        from botocore.awsrequest import AWSRequest

        frozen = self._frozen()
        signer = self._signer
        if signer is None or signer[0] != frozen:
            signer = self._signer = (frozen, _list_signer_class()(frozen, "s3", self.region))
        given = dict(headers or {})
        if self._host:
            given["host"] = self._host
        request = AWSRequest(method=method, url=url, headers=given or None, data=body or None)
        signer[1].add_auth(request)
        return dict(request.headers.items())

    async def _signed_request(
        self,
        http: Any,
        operation: str,
        url: str,
        *,
        method: str = "GET",
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> tuple[bytes, str]:
        """One SigV4-signed request, retried on ``RETRY_STATUS``, ``RETRY_CODES`` and connection
        errors (up to the configured attempts, exponential backoff with full jitter); other answers
        raise ``_S3HTTPError`` (a 501 NotImplemented at once). Returns the body and the answer's
        ``Date`` header (``""`` when absent: ``Transport.store_now``)."""
        import aiohttp
        import yarl

        target = yarl.URL(url, encoded=True)
        for attempt in range(self._attempts):
            if attempt:
                await asyncio.sleep(store_retry_delay(attempt))
                self.request_counts[operation] += 1  # a retry is one more HTTP request
            # signed again per attempt: X-Amz-Date is part of the signature
            signed = self._sign(url, method, body, headers)
            try:
                async with http.request(method, target, headers=signed, data=body or None) as response:
                    answer = await response.read()
                    status = response.status
                    date = response.headers.get("Date", "")
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as error:
                if attempt + 1 < self._attempts:
                    if _cannot_connect(error):  # could not connect (refused, DNS, connect timeout)
                        warn_connect_retry(self.endpoint_url, error, attempt + 1, self._attempts)
                    continue
                raise
            if status in ok:
                return answer, date
            text = answer.decode("utf-8", "replace")
            match = _XML_CODE.search(text)
            code = match.group(1) if match else str(status)
            # A 206 answers a range nobody asked for (these requests send no Range): a part of
            # the answer, read again as a cut body is (aioboto3's verified LIST does the same).
            if (status in RETRY_STATUS or status == 206 or code in RETRY_CODES) and attempt + 1 < self._attempts:
                continue
            raise _S3HTTPError(operation, status, code, text)
        raise AssertionError("unreachable")  # pragma: no cover
