#!/usr/bin/env python3
"""A TCP proxy on 127.0.0.1 that delays every byte by a fixed one-way latency (benchmarks only).

    python tools/_delayproxy.py TARGET_PORT ONE_WAY_MS

Prints the port it listens on (one line) once ready, then forwards every connection to
``127.0.0.1:TARGET_PORT``, holding each chunk for ``ONE_WAY_MS`` in each direction (order kept, no
bandwidth limit). A request/response exchange therefore gains one round trip time of
``2 * ONE_WAY_MS``, which is how ``bench_put.py --rtt-ms`` emulates a store that is not on
loopback. Stops on SIGTERM or when its parent closes stdin.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver() -> None:
        while True:
            item = await queue.get()
            if item is None:
                break
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        try:
            writer.write_eof()
        except (OSError, RuntimeError):
            pass

    task = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            queue.put_nowait((time.monotonic() + delay, data))
    except (ConnectionError, OSError):
        pass
    finally:
        queue.put_nowait(None)
        try:
            await task
        except (ConnectionError, OSError):
            pass


async def main(target_port: int, one_way: float) -> None:
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_writer.close()
            return
        for w in (client_writer, server_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pump(client_reader, server_writer, one_way), pump(server_reader, client_writer, one_way))
        for w in (client_writer, server_writer):
            w.close()

    tasks: set[asyncio.Task] = set()

    async def tracked(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        tasks.add(task)  # type: ignore[arg-type]  # strong reference: idle connections stay quiet
        try:
            await handle(client_reader, client_writer)
        finally:
            tasks.discard(task)  # type: ignore[arg-type]

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    stdin_closed = loop.create_future()
    loop.add_reader(
        sys.stdin.fileno(),
        lambda: stdin_closed.done() or (not sys.stdin.buffer.read1(1) and stdin_closed.set_result(None)),
    )
    async with server:
        await stdin_closed
    sys.stdout.flush()
    os._exit(0)  # leave at once: open connections die with the process, nothing to report


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(main(int(sys.argv[1]), float(sys.argv[2]) / 1000.0))
