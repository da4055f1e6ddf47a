"""Faults between a client and the real Redis: a TCP proxy that loses one reply.

A lost reply is the case where the server ran a command but the client never learns it: the Redis
client then retries by itself (3 times by default), so a non-idempotent command can run twice.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse


class ReplyDroppingProxy:
    """Relays to Redis; the first request that contains ``marker`` is forwarded, and its reply is not: the client
    connection is closed instead (later connections are relayed whole)."""

    def __init__(self, redis_url: str, marker: bytes):
        parsed = urlparse(redis_url)
        self.upstream = (parsed.hostname, parsed.port)
        self.marker = marker
        self.dropped = 0

    async def _relay(self, client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        drop_reply = asyncio.Event()

        async def requests() -> None:
            while data := await client_reader.read(1 << 16):
                if self.marker in data and not self.dropped:
                    self.dropped += 1
                    drop_reply.set()
                server_writer.write(data)
                await server_writer.drain()

        async def replies() -> None:
            while data := await server_reader.read(1 << 16):
                if drop_reply.is_set():
                    return  # the server has run the request; its answer never reaches the client
                client_writer.write(data)
                await client_writer.drain()

        forward = asyncio.ensure_future(requests())
        try:
            await replies()
        finally:
            forward.cancel()
            client_writer.close()
            server_writer.close()


@contextmanager
def reply_dropping_proxy(redis_url: str, marker: bytes) -> Iterator[tuple[str, ReplyDroppingProxy]]:
    """(URL of the proxy, the proxy), served from a thread of its own for the duration of the block."""
    proxy = ReplyDroppingProxy(redis_url, marker)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def serve() -> None:
        holder["server"] = await asyncio.start_server(proxy._relay, "127.0.0.1", 0)
        started.set()

    thread = threading.Thread(target=loop.run_forever, name="redis-proxy", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=10)
    assert started.wait(10), "the proxy did not start listening in 10 s"
    port = holder["server"].sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0", proxy
    finally:
        async def shutdown() -> None:  # every relay ends before the loop does
            holder["server"].close()
            relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for relay in relays:
                relay.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
