"""A small fault-injecting HTTP proxy for S3 tests (an asyncio server on 127.0.0.1).

The proxy sits between an s3capture client and the real local S3 server, so faults happen on the
wire: the client signs and sends real requests, the server really executes (or never sees) them.

    proxy = await FaultProxy(s3_server.port, credentials=(s3_server.access_key, s3_server.secret_key)).start()
    store = S3TokenStore(url, endpoint_url=proxy.endpoint)
    proxy.rule = my_rule      # async (Request) -> action | None; it may await (hold the request)
    ...
    await proxy.stop()

One request per client connection (every answer says ``Connection: close``). A rule returns:

* ``None`` - forward unchanged;
* ``Respond(status, body)`` / ``s3_error(...)`` / ``slow_down()`` / ``internal_error()`` - answer
  without forwarding: the request fails before the server applies it;
* ``DropResponse()`` - forward, let the server apply it, close without an answer (a lost ack);
* ``ApplyLate(delay)`` - close the client's connection at once (so it retries), forward the held
  request ``delay`` seconds later: it is applied after the client's retry;
* ``Twice()`` - deliver the request twice; the client gets the second answer;
* ``CutBody(fraction)`` - answer the headers and part of the body, then close: a GET body cut
  mid-stream (the client sees fewer bytes than ``Content-Length`` and a closed connection);
* ``ShortBody(fraction)`` - answer part of the body with a ``Content-Length`` that matches it: a
  silently short body (a well-formed response; only the ETag can tell);
* ``Chunked()`` - forward, and send the answer with ``Transfer-Encoding: chunked`` instead of a
  ``Content-Length`` (a gateway or compressing proxy that streams its answers);
* ``Partial(length)`` - forward, and answer ``206 Partial Content`` with the first ``length`` bytes
  and their ``Content-Range`` (an answer to a range nobody asked for); ``Partial(None)``: a 200
  with the whole body and a ``Content-Range`` that covers it (what some gateways send);
* ``Truncate(fraction)`` - forward the headers and only part of the request body, then close both
  sides (a writer killed mid-PUT);
* ``ListEmpty()`` - answer a LIST with a 200 and an empty body;
* ``ListSiblings()`` - forward a LIST with the prefix's trailing ``/`` removed, so keys of sibling
  prefixes come back too (``r1/`` answered with ``r1000/``);
* ``ListSkip(index=-1, match=None)`` - drop one ``<Contents>`` of the page (default: the last, as
  at a page boundary; with ``match``, those whose key contains it);
* ``ListNoToken(max_keys=None)`` - a truncated page whose continuation token was removed;
* ``ListIgnoreStartAfter()`` - forward a LIST without its ``start-after`` parameter (a store that
  ignores ``StartAfter``);
* ``ListInclusiveStartAfter()`` - answer a LIST with ``start-after`` with that key itself first,
  then what follows it (an off-by-one ``StartAfter``);
* ``ListCutShort(max_keys)`` - ask the server for pages of ``max_keys`` and answer the first as the
  last (``IsTruncated`` false, no continuation token): a listing cut short that says it is whole;
* ``ListPaged(max_keys, repeat=False)`` - ask the server for pages of ``max_keys``; with ``repeat``,
  each later page repeats the previous page's last key;
* ``ListHideYoung(ms)`` - drop the keys this proxy saw PUT less than ``ms`` ago.

Proxy-wide settings: ``date_skew`` (seconds added to every answer's ``Date``), ``expired_keys``
(access key ids answered ``403 ExpiredToken``), ``credentials`` (the server's key pair: a request
the proxy modifies, or one signed with a key the server does not know, is signed again with it).
``requests`` records every request with its arrival and forwarding times.
"""

from __future__ import annotations

import asyncio
import email.utils
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

__all__ = [
    "FaultProxy",
    "Request",
    "Respond",
    "DropResponse",
    "ApplyLate",
    "Twice",
    "CutBody",
    "ShortBody",
    "Chunked",
    "Partial",
    "Truncate",
    "ListEmpty",
    "ListSiblings",
    "ListSkip",
    "ListNoToken",
    "ListCutShort",
    "ListIgnoreStartAfter",
    "ListInclusiveStartAfter",
    "ListPaged",
    "ListHideYoung",
    "s3_error",
    "slow_down",
    "internal_error",
    "not_implemented_xml",
    "once",
]


# --------------------------------------------------------------------------- requests and actions
@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    arrived: float = 0.0
    """``time.monotonic()`` when the proxy had read the request."""
    forwarded: float | None = None
    """``time.monotonic()`` when it was sent to the server (``None``: never)."""
    client_key: str = ""
    """The access key id the client signed with (``access_key`` changes when the proxy signs again)."""

    @property
    def path(self) -> str:
        return unquote(urlsplit(self.target).path)

    @property
    def query(self) -> str:
        return urlsplit(self.target).query

    @property
    def params(self) -> dict[str, str]:
        return dict(parse_qsl(self.query, keep_blank_values=True))

    @property
    def key(self) -> str:
        """The object key (path-style addressing: ``/bucket/key``)."""
        return self.path.lstrip("/").partition("/")[2]

    @property
    def is_list(self) -> bool:
        return self.method == "GET" and self.params.get("list-type") == "2"

    @property
    def access_key(self) -> str:
        found = re.search(r"Credential=([^/]+)/", self.headers.get("authorization", ""))
        return found.group(1) if found else ""


@dataclass
class Respond:
    status: int
    body: bytes = b""
    reason: str = "Injected"
    content_type: str = "application/xml"


@dataclass
class DropResponse:
    pass


@dataclass
class ApplyLate:
    delay: float = 1.0


@dataclass
class Twice:
    pass


@dataclass
class CutBody:
    fraction: float = 0.5


@dataclass
class ShortBody:
    fraction: float = 0.5


@dataclass
class Chunked:
    pass


@dataclass
class Partial:
    length: int | None = 5


@dataclass
class Truncate:
    fraction: float = 0.5


@dataclass
class ListEmpty:
    pass


@dataclass
class ListSiblings:
    pass


@dataclass
class ListSkip:
    index: int = -1
    match: str | None = None
    """Drop the ``<Contents>`` whose key contains this instead (every one that does)."""


@dataclass
class ListNoToken:
    max_keys: int | None = None
    """Also ask the server for pages of this many keys (so that the page is truncated)."""


@dataclass
class ListIgnoreStartAfter:
    pass


@dataclass
class ListInclusiveStartAfter:
    pass


_EMPTY_OBJECT = (
    b"<Contents><Key></Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
    b'<ETag>"d41d8cd98f00b204e9800998ecf8427e"</ETag><Size>0</Size><StorageClass>STANDARD</StorageClass></Contents>'
)


@dataclass
class ListCutShort:
    max_keys: int
    """Ask the server for pages of this many keys; the first is then answered as the last."""


@dataclass
class ListPaged:
    max_keys: int
    repeat: bool = False


@dataclass
class ListHideYoung:
    ms: float


def not_implemented_xml(code: str = "NotImplemented", message: str = "not implemented") -> bytes:
    """An S3 XML error body."""
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
        f"<RequestId>proxy</RequestId></Error>"
    ).encode()


def s3_error(status: int, code: str, message: str = "injected", reason: str = "Injected") -> Respond:
    return Respond(status, not_implemented_xml(code, message), reason)


def slow_down() -> Respond:
    return s3_error(503, "SlowDown", "Please reduce your request rate.", "Slow Down")


def internal_error() -> Respond:
    return s3_error(500, "InternalError", "We encountered an internal error.", "Internal Server Error")


class Outage:
    """A rule: every request is answered 503 ServiceUnavailable while ``down`` is true (the store
    goes down and comes back at the same endpoint)."""

    def __init__(self, down: bool = True) -> None:
        self.down = down

    async def __call__(self, request: Request) -> Any:
        return s3_error(503, "ServiceUnavailable", "down", "Service Unavailable") if self.down else None


def once(predicate: Callable[[Request], bool], action: Any, times: int = 1) -> Callable[[Request], Awaitable[Any]]:
    """A rule answering ``action`` for the first ``times`` requests matching ``predicate``."""
    left = [times]

    async def rule(request: Request) -> Any:
        if left[0] > 0 and predicate(request):
            left[0] -= 1
            return action
        return None

    rule.left = left  # type: ignore[attr-defined]
    return rule


# --------------------------------------------------------------------------- HTTP plumbing
_OK = re.compile(rb"HTTP/1\.\d 200 ")
_CONTENTS = re.compile(rb"<Contents>.*?</Contents>", re.S)


def _parse_response(raw: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = [(n.strip(), v.strip()) for n, _, v in (line.partition(":") for line in lines[1:] if ":" in line)]
    if any(n.lower() == "transfer-encoding" and "chunked" in v.lower() for n, v in headers):
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
        headers = [(n, v) for n, v in headers if n.lower() != "transfer-encoding"]
        headers.append(("Content-Length", str(len(body))))
    return lines[0], headers, body


def _set_header(headers: list[tuple[str, str]], name: str, value: str) -> list[tuple[str, str]]:
    return [(n, v) for n, v in headers if n.lower() != name.lower()] + [(name, value)]


def _build(status_line: str, headers: list[tuple[str, str]], body: bytes, length: int | None = None) -> bytes:
    headers = [(n, v) for n, v in headers if n.lower() not in ("connection", "content-length")]
    if length is not None or body or not status_line.startswith("HTTP/1.1 204"):
        headers.append(("Content-Length", str(len(body) if length is None else length)))
    headers.append(("Connection", "close"))
    return ("\r\n".join([status_line, *(f"{n}: {v}" for n, v in headers)]) + "\r\n\r\n").encode("latin-1") + body


# --------------------------------------------------------------------------- the proxy
@dataclass
class FaultProxy:
    upstream_port: int
    rule: Callable[[Request], Awaitable[Any]] | None = None
    credentials: tuple[str, str] | None = None
    """The server's (access key id, secret): used to sign modified or foreign-key requests again."""
    date_skew: float = 0.0
    expired_keys: set[str] = field(default_factory=set)
    seen: list[tuple[str, str, str]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    put_times: dict[str, float] = field(default_factory=dict)
    """key -> ``time.monotonic()`` when the server answered its latest PUT (for ``ListHideYoung``)."""
    forward_count: int = 0
    """Requests sent to the server (a ``Twice`` counts two)."""
    port: int = 0
    _server: Any = None
    _tasks: set[Any] = field(default_factory=set)
    _pending: dict[int, list[Any]] = field(default_factory=dict)
    _last_of_page: dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def for_server(cls, server: Any, **kwargs: Any) -> FaultProxy:
        """A proxy in front of a ``LocalS3Server`` that knows its credentials."""
        return cls(server.port, credentials=(server.access_key, server.secret_key), **kwargs)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def _hold(self, request: Request) -> None:
        entry = self._pending.setdefault(id(request), [request, 0])
        entry[1] += 1

    def _release(self, request: Request) -> None:
        entry = self._pending.get(id(request))
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._pending[id(request)]

    def in_flight(self, fragment: str = "") -> list[Request]:
        """Requests this proxy has read and not yet finished with (forwarding, waiting for the
        server's answer, or held to be applied late) whose path or body names ``fragment``: what
        may still land at the server, also after its client gave up on it."""
        return [r for r, _ in self._pending.values() if fragment in r.path or (r.body and fragment.encode() in r.body)]

    def seen_ops(self, method: str, fragment: str = "") -> list[Request]:
        """Requests of ``method`` whose path contains ``fragment``, in arrival order."""
        return [r for r in self.requests if r.method == method and fragment in r.path]

    # ------------------------------------------------------------------ wire
    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        if headers.pop("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # botocore may wait for it before the body
            await writer.drain()
        body = b""
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                data = await reader.readexactly(size + 2)
                chunks.append(size_line + data)
                if size == 0:
                    break
            body = b"".join(chunks)
        request = Request(method, target, headers, body, arrived=time.monotonic())
        request.client_key = request.access_key
        return request

    def _sign(self, request: Request) -> None:
        """Sign ``request`` again (SigV4) with the server's credentials, in place."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        assert self.credentials is not None, "modifying a request needs FaultProxy(credentials=...)"
        scope = re.search(r"Credential=[^/]+/\d+/([^/]+)/", request.headers.get("authorization", ""))
        region = scope.group(1) if scope else "us-east-1"
        drop = {"authorization", "x-amz-date", "x-amz-security-token", "x-amz-content-sha256", "connection"}
        headers = {k: v for k, v in request.headers.items() if k not in drop}
        aws = AWSRequest(
            method=request.method, url=f"http://{headers['host']}{request.target}", headers=headers, data=request.body
        )
        S3SigV4Auth(Credentials(*self.credentials), "s3", region).add_auth(aws)
        request.headers = {k.lower(): v for k, v in aws.headers.items()}

    @staticmethod
    def _head(request: Request) -> bytes:
        lines = [f"{request.method} {request.target} HTTP/1.1"]
        lines += [f"{k}: {v}" for k, v in request.headers.items() if k != "connection"]
        return ("\r\n".join(lines) + "\r\nConnection: close\r\n\r\n").encode("latin-1")

    async def _exchange(self, request: Request, body_fraction: float | None = None) -> bytes:
        """Send ``request`` to the server; its whole raw answer (b"" for a truncated request)."""
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            request.forwarded = time.monotonic()
            self.forward_count += 1
            if body_fraction is not None:
                up_writer.write(self._head(request) + request.body[: int(len(request.body) * body_fraction)])
                await up_writer.drain()
                await asyncio.sleep(0.2)
                return b""  # the writer "died" mid-body
            up_writer.write(self._head(request) + request.body)
            await up_writer.drain()
            chunks = []
            while True:
                more = await up_reader.read(1 << 16)
                if not more:
                    break
                chunks.append(more)
            return b"".join(chunks)
        finally:
            up_writer.close()

    def _rewrite_list_request(self, request: Request, action: Any) -> None:
        params = parse_qsl(request.query, keep_blank_values=True)
        if isinstance(action, ListSiblings):
            params = [(k, v[:-1] if k == "prefix" and v.endswith("/") else v) for k, v in params]
        elif isinstance(action, ListIgnoreStartAfter):
            params = [(k, v) for k, v in params if k != "start-after"]
        else:
            params = [(k, v) for k, v in params if k != "max-keys"] + [("max-keys", str(action.max_keys))]
        request.target = urlsplit(request.target).path + "?" + urlencode(sorted(params), quote_via=quote, safe="-_.~")
        self._sign(request)

    def _rewrite_list_body(self, request: Request, action: Any, body: bytes) -> bytes:
        items = _CONTENTS.findall(body)
        keep = list(items)

        def key_of(item: bytes) -> str:
            found = re.search(rb"<Key>(.*?)</Key>", item, re.S)
            name = found.group(1).decode() if found else ""
            # Ceph encodes "/" as %2F under encoding-type=url (botocore asks for it and decodes).
            return unquote(name) if request.params.get("encoding-type") == "url" else name

        if isinstance(action, ListSkip) and action.match is not None:
            keep = [i for i in items if action.match not in key_of(i)]
        elif isinstance(action, ListSkip) and items:
            del keep[action.index]
        elif isinstance(action, ListHideYoung):
            now = time.monotonic()

            def young(item: bytes) -> bool:
                when = self.put_times.get(key_of(item))
                return when is not None and now - when < action.ms / 1000

            keep = [i for i in items if not young(i)]
        elif isinstance(action, ListInclusiveStartAfter) and "start-after" in request.params:
            named = request.params["start-after"]
            if request.params.get("encoding-type") == "url":
                named = quote(named, safe="/")
            template = items[0] if items else _EMPTY_OBJECT
            first = re.sub(rb"<Key>.*?</Key>", b"<Key>" + named.encode() + b"</Key>", template, flags=re.S)
            if not items:  # the key it names, alone
                body = body.replace(b"</ListBucketResult>", first + b"</ListBucketResult>")
                return re.sub(rb"<KeyCount>\d+</KeyCount>", b"<KeyCount>1</KeyCount>", body)
            keep = [first, *items]
        elif isinstance(action, ListNoToken):
            return re.sub(rb"<NextContinuationToken>.*?</NextContinuationToken>", b"", body, flags=re.S)
        elif isinstance(action, ListCutShort):
            body = body.replace(b"<IsTruncated>true</IsTruncated>", b"<IsTruncated>false</IsTruncated>")
            return re.sub(rb"<NextContinuationToken>.*?</NextContinuationToken>", b"", body, flags=re.S)
        elif isinstance(action, ListPaged) and action.repeat:
            prefix = request.params.get("prefix", "")
            previous = self._last_of_page.get(prefix) if "continuation-token" in request.params else None
            if items:
                self._last_of_page[prefix] = items[-1]
            if previous is not None:
                keep = [previous, *items]
        if keep == items:
            return body
        start = body.find(items[0]) if items else -1
        if start < 0:
            return body
        end = body.rfind(items[-1]) + len(items[-1])
        out = body[:start] + b"".join(keep) + body[end:]
        return re.sub(rb"<KeyCount>\d+</KeyCount>", f"<KeyCount>{len(keep)}</KeyCount>".encode(), out)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # asyncio drops its reference to this task when the client's connection is lost (3.11's
        # StreamReaderProtocol.connection_lost), and the server connection's reader is only weakly
        # referenced: a request whose client gave up (a cancelled caller) was garbage-collected
        # mid-exchange, and the server applied it seconds later, unseen (chaos seed 103). Held here
        # until it ends, it is forwarded and answered like any other, and ``in_flight`` sees it.
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        request = None
        try:
            request = await self._read_request(reader, writer)
            if request is None:
                return
            self._hold(request)
            self.seen.append((request.method, request.path, request.query))
            self.requests.append(request)
            if request.client_key and request.client_key in self.expired_keys:
                action: Any = s3_error(403, "ExpiredToken", "The provided token has expired.", "Forbidden")
            else:
                action = await self.rule(request) if self.rule is not None else None
            if isinstance(action, Respond):
                writer.write(
                    _build(
                        f"HTTP/1.1 {action.status} {action.reason}",
                        [("Content-Type", action.content_type)],
                        action.body,
                    )
                )
                await writer.drain()
                return
            if isinstance(action, ListEmpty):
                writer.write(_build("HTTP/1.1 200 OK", [("Content-Type", "application/xml")], b""))
                await writer.drain()
                return
            if self.credentials is not None and request.access_key and request.access_key != self.credentials[0]:
                self._sign(request)  # the client holds a key the server does not know
            if isinstance(action, (ListSiblings, ListPaged, ListCutShort, ListIgnoreStartAfter)) or (
                isinstance(action, ListNoToken) and action.max_keys
            ):
                self._rewrite_list_request(request, action)
            if isinstance(action, ApplyLate):
                self._hold(request)  # released by _late, once applied
                task = asyncio.ensure_future(self._late(request, action.delay))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return  # the client's connection is closed now; the server sees the request later
            if isinstance(action, Truncate):
                await self._exchange(request, action.fraction)
                return
            raw = await self._exchange(request)
            if isinstance(action, Twice):
                raw = await self._exchange(request)
            if request.method == "PUT" and _OK.match(raw):
                self.put_times[request.key] = time.monotonic()
            if isinstance(action, DropResponse) or not raw:
                return  # the server applied the request; the client never hears back
            status, headers, body = _parse_response(raw)
            if self.date_skew:
                for name, value in headers:
                    if name.lower() == "date":
                        skewed = email.utils.parsedate_to_datetime(value).timestamp() + self.date_skew
                        headers = _set_header(headers, name, email.utils.formatdate(skewed, usegmt=True))
            if request.method == "HEAD":
                writer.write(
                    _build(
                        status,
                        headers,
                        b"",
                        length=int(dict((n.lower(), v) for n, v in headers).get("content-length", 0)),
                    )
                )
            elif isinstance(action, CutBody):
                writer.write(_build(status, headers, body[: int(len(body) * action.fraction)], length=len(body)))
            elif isinstance(action, ShortBody):
                writer.write(_build(status, headers, body[: int(len(body) * action.fraction)]))
            elif isinstance(action, Chunked) and status.split(" ")[1] == "200":
                kept = [(n, v) for n, v in headers if n.lower() not in ("connection", "content-length")]
                kept += [("Transfer-Encoding", "chunked"), ("Connection", "close")]
                writer.write(("\r\n".join([status, *(f"{n}: {v}" for n, v in kept)]) + "\r\n\r\n").encode("latin-1"))
                for start in range(0, len(body), 65536):
                    piece = body[start : start + 65536]
                    writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                writer.write(b"0\r\n\r\n")
            elif isinstance(action, Partial) and status.split(" ")[1] == "200":
                part = body if action.length is None else body[: action.length]
                headers = _set_header(headers, "Content-Range", f"bytes 0-{len(part) - 1}/{len(body)}")
                writer.write(_build(status if action.length is None else "HTTP/1.1 206 Partial Content", headers, part))
            elif isinstance(
                action, (ListSkip, ListHideYoung, ListNoToken, ListPaged, ListCutShort, ListInclusiveStartAfter)
            ):
                writer.write(_build(status, headers, self._rewrite_list_body(request, action, body)))
            else:
                writer.write(_build(status, headers, body))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if request is not None:
                self._release(request)
            writer.close()
            self._tasks.discard(task)

    async def _late(self, request: Request, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
            raw = await self._exchange(request)
            if request.method == "PUT" and _OK.match(raw):
                self.put_times[request.key] = time.monotonic()
        finally:
            self._release(request)
