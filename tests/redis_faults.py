"""Faults between a client and the real Redis: a TCP proxy that loses one reply, or cuts every connection.

A lost reply is the case where the server ran a command but the client never learns it: the client (or
its caller) retries, so a non-idempotent command can run twice. An outage (``cut`` .. ``restore``) closes
every connection and refuses new ones, as a Redis restart or a network partition does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse


class RedisProxy:
    """Relays to Redis. With a ``marker``, the first request that contains it is forwarded and its reply is not: the
    client connection is closed instead (later connections are relayed whole)."""

    def __init__(self, redis_url: str, marker: bytes | None = None):
        parsed = urlparse(redis_url)
        self.upstream = (parsed.hostname, parsed.port)
        self.marker = marker
        self.dropped = 0
        self.refused = 0
        self._down = False
        self._writers: set[asyncio.StreamWriter] = set()
        self.upstream_addrs: set[str] = set()  # "host:port" of each open relay as Redis sees it (CLIENT LIST addr)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None  # the one running ``loop``

    def cut(self) -> None:
        """Close every relayed connection and refuse new ones until ``restore`` (callable from any thread; returns
        once the cut is in effect on the proxy's loop)."""
        self._on_loop(self._cut)

    def restore(self) -> None:
        """Relay new connections again (returns once in effect)."""
        self._on_loop(setattr, self, "_down", False)

    def _on_loop(self, function, *args) -> None:
        """Run ``function(*args)`` on the proxy's loop and wait for it (at once when already on that loop)."""
        if threading.current_thread() is self.thread:
            function(*args)
            return
        done = threading.Event()

        def run() -> None:
            try:
                function(*args)
            finally:
                done.set()

        self.loop.call_soon_threadsafe(run)
        assert done.wait(timeout=10), "the Redis proxy's loop did not run the change within 10 s"

    def _cut(self) -> None:
        self._down = True
        for writer in list(self._writers):
            writer.close()

    async def _relay(self, client_reader, client_writer) -> None:
        if self._down:
            self.refused += 1
            client_writer.close()
            return
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:  # Redis itself is down (restarting): the client sees a refused connection, as without us
            self.refused += 1
            client_writer.close()
            return
        if self._down:  # cut while this relay was connecting: the cut did not see it, so it is refused here
            self.refused += 1
            client_writer.close()
            server_writer.close()
            return
        host, port = server_writer.get_extra_info("sockname")[:2]
        upstream_addr = f"{host}:{port}"
        self.upstream_addrs.add(upstream_addr)
        self._writers |= {client_writer, server_writer}
        drop_reply = asyncio.Event()

        async def requests() -> None:
            while data := await client_reader.read(1 << 16):
                if self.marker is not None and self.marker in data and not self.dropped:
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
        except (ConnectionError, OSError):
            pass  # cut
        finally:
            forward.cancel()
            client_writer.close()
            server_writer.close()
            self._writers -= {client_writer, server_writer}
            self.upstream_addrs.discard(upstream_addr)


@contextmanager
def redis_proxy(redis_url: str, marker: bytes | None = None) -> Iterator[tuple[str, RedisProxy]]:
    """(URL of the proxy, the proxy), served from a thread of its own for the duration of the block."""
    proxy = RedisProxy(redis_url, marker)
    loop = asyncio.new_event_loop()
    proxy.loop = loop
    holder: dict = {}

    async def serve() -> None:
        holder["server"] = await asyncio.start_server(proxy._relay, "127.0.0.1", 0)

    thread = threading.Thread(target=loop.run_forever, name="redis-proxy", daemon=True)
    proxy.thread = thread
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=10)
    port = holder["server"].sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0", proxy
    finally:

        async def shutdown() -> None:  # every relay ends before the loop does
            holder["server"].close()
            proxy._cut()  # closed connections end their relays; one still stuck is cancelled
            relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if relays:
                _, stuck = await asyncio.wait(relays, timeout=5)
                for relay in stuck:
                    relay.cancel()
                await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def reply_dropping_proxy(redis_url: str, marker: bytes):
    """``redis_proxy`` that loses the reply of the first request containing ``marker``."""
    return redis_proxy(redis_url, marker)
