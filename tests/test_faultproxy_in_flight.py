"""The fault proxy itself: a request whose client gave up is still forwarded and answered, and
``FaultProxy.in_flight`` shows it until then (docs/reliability.md, finding 33).

On Python 3.11 asyncio keeps no strong reference to a stream handler whose client disconnected,
and the server connection's reader is only weakly referenced: the proxy's handler was
garbage-collected mid-exchange, so a cancelled caller's PUT reached the server unseen, seconds
later, and the model machines could not wait for it. The upstream here is a tiny asyncio server
that answers after ``HOLD`` seconds, as SeaweedFS did for the first PUT into a new bucket; no S3
server is needed for what is the harness's own behaviour."""

from __future__ import annotations

import asyncio
import gc
import time

from faultproxy import FaultProxy

HOLD = 0.3


async def test_a_request_whose_client_left_is_forwarded_answered_and_counted_until_then() -> None:
    answered: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(HOLD)  # the server holds the request, then applies and answers it
        answered.append(head.split(b" ")[1])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    proxy = await FaultProxy(server.sockets[0].getsockname()[1]).start()
    try:
        _, client = await asyncio.open_connection("127.0.0.1", proxy.port)
        client.write(b"PUT /bucket/rollouts/r0/ledger/row/c1/x.json HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        await client.drain()
        deadline = time.monotonic() + 5
        while not proxy.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        client.close()  # the caller gives up, as a cancelled obstore request closes its connection
        assert [r.key for r in proxy.in_flight("rollouts/r0/")] == ["rollouts/r0/ledger/row/c1/x.json"]
        assert proxy.in_flight("rollouts/r1/") == []
        while proxy.in_flight() and time.monotonic() < deadline:
            gc.collect()  # what destroyed the unreferenced handler before the fix
            await asyncio.sleep(0.02)
        assert answered == [b"/bucket/rollouts/r0/ledger/row/c1/x.json"]
        # The handler read the server's answer to its end: the PUT was seen to land.
        assert "rollouts/r0/ledger/row/c1/x.json" in proxy.put_times
        assert proxy.in_flight() == []
    finally:
        await proxy.stop()
        server.close()
        await server.wait_closed()
