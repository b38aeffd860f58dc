"""A tiny fault-injecting HTTP proxy on 127.0.0.1 for adversarial tests (plus its self-test).

The proxy sits between an ``S3TokenStore`` and the real local S3 server (moto or SeaweedFS), so
faults are produced on the wire, not by mocking botocore: the client signs and sends real
requests, the server really executes (or never sees) them.

    proxy = FaultProxy(upstream_port)
    await proxy.start()
    store = S3TokenStore(url, endpoint_url=proxy.endpoint, ...)
    proxy.rule = my_rule      # async (Request) -> Action | None

Every client connection carries one request (the proxy answers ``Connection: close``). Actions:

* ``None`` - forward unchanged;
* ``Respond(status, body)`` - answer without forwarding (e.g. 501 to ``POST ?delete``);
* ``DropResponse()`` - forward, let the server execute, then close the client connection without
  an answer (a lost response);
* ``Truncate(fraction)`` - forward the headers and only part of the body, then close both sides
  (a writer killed mid-PUT);
* an ``await`` inside the rule delays the request (hold it until an event is set).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes

    @property
    def path(self) -> str:
        return unquote(urlsplit(self.target).path)

    @property
    def query(self) -> str:
        return urlsplit(self.target).query


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
class Truncate:
    fraction: float = 0.5


@dataclass
class FaultProxy:
    upstream_port: int
    rule: Callable[[Request], Awaitable[Any]] | None = None
    seen: list[tuple[str, str, str]] = field(default_factory=list)
    _server: Any = None
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[bytes, Request] | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        body = b""
        if headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # botocore waits for it before the body
            await writer.drain()
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
        return head, Request(method, target, headers, body)

    @staticmethod
    def _rewrite_head(head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        kept = [l for l in lines if l and not l.lower().startswith(("connection:", "expect:"))]
        return ("\r\n".join(kept) + "\r\nConnection: close\r\n\r\n").encode("latin-1")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            got = await self._read_request(reader, writer)
            if got is None:
                return
            head, request = got
            self.seen.append((request.method, request.path, request.query))
            action = await self.rule(request) if self.rule is not None else None
            if isinstance(action, Respond):
                body = action.body
                writer.write(
                    (
                        f"HTTP/1.1 {action.status} {action.reason}\r\nContent-Type: {action.content_type}\r\n"
                        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                    ).encode()
                    + body
                )
                await writer.drain()
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            try:
                if isinstance(action, Truncate):
                    up_writer.write(self._rewrite_head(head) + request.body[: int(len(request.body) * action.fraction)])
                    await up_writer.drain()
                    await asyncio.sleep(0.2)
                    return  # both sides are closed below: the writer "died" mid-body
                up_writer.write(self._rewrite_head(head) + request.body)
                await up_writer.drain()
                response = await up_reader.read()
                while True:
                    more = await up_reader.read(1 << 16)
                    if not more:
                        break
                    response += more
            finally:
                up_writer.close()
            if isinstance(action, DropResponse):
                return  # the server executed the request; the client never hears back
            cut = response.find(b"\r\n\r\n")
            if cut >= 0:
                response = self._rewrite_head(response[: cut + 4]) + response[cut + 4 :]
            writer.write(response)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def not_implemented_xml(code: str = "NotImplemented", message: str = "not implemented") -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
        f"<RequestId>proxy</RequestId></Error>"
    ).encode()


# --------------------------------------------------------------------------- self-test


async def test_fault_proxy_forwards_faithfully(s3_server, fresh, bucket_url):
    """The proxy itself is transparent when no rule fires (so findings are not proxy artefacts)."""
    from helpers import simple_entry

    proxy = await FaultProxy(s3_server.port).start()
    try:
        store = fresh(endpoint_url=proxy.endpoint)
        await store.put(simple_entry("r-proxy", "c1"))
        snapshot = await store.freeze("r-proxy")
        assert not snapshot.incomplete and len(snapshot.entries) == 1
        assert await fresh(endpoint_url=proxy.endpoint, fence_grace=0.0).drop(
            "r-proxy", snapshot.snapshot_id, snapshot.version
        ) in (True, False)
        assert any(m == "PUT" for m, _, _ in proxy.seen)
    finally:
        await proxy.stop()
