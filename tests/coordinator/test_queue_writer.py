"""The coordinator's pushes onto the trajectory stream, against the real embedded Redis.

A push whose reply is lost (the server ran it, the connection broke before the answer came back) is
retried by the Redis client on its own; the retry must not add a second entry. A TCP proxy in front of
the real server breaks the connection exactly there.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlparse

import numpy as np
import redis.asyncio as aioredis

from coordinator.queue_writer import RolloutQueue
from protos.records import (Array, FinishReason, PromptCursor, Sample, TrajectoryGroup, VersionSpan, decode_cursor,
                            decode_group)
from protos.redis_keys import RedisKeys


class ReplyDroppingProxy:
    """Relays to Redis; the first request that contains ``marker`` is forwarded, and its reply is not: the client
    connection is closed instead (later connections are relayed whole)."""

    def __init__(self, redis_url: str, marker: bytes):
        parsed = urlparse(redis_url)
        self.upstream = (parsed.hostname, parsed.port)
        self.marker = marker
        self.dropped = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

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

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


def group(group_id: str) -> TrajectoryGroup:
    sample = Sample(Array.from_numpy(np.arange(3, dtype=np.int32)), Array.from_numpy(np.zeros(3, np.float32)),
                    [VersionSpan(0, 0, 3)], FinishReason.STOP, 1.0)
    return TrajectoryGroup(group_id, "p", Array.from_numpy(np.array([1, 2], np.int32)), [sample], "unit", 0, 0, 0.0)


def test_a_push_whose_reply_was_lost_is_not_added_twice(redis_url):
    keys = RedisKeys("lost-reply")

    async def scenario():
        proxy = ReplyDroppingProxy(redis_url, marker=b"lost-reply-group")
        client = aioredis.Redis.from_url(await proxy.start(), socket_timeout=5)
        queue = RolloutQueue(client, keys, timeout_s=30)
        await queue.push(group("first-group"), PromptCursor("echo", "first-group", {"seed": 0, "draws": 1}))
        cursor = PromptCursor("echo", "lost-reply-group", {"seed": 0, "draws": 2})
        await queue.push(group("lost-reply-group"), cursor)
        await queue.push(group("third-group"), PromptCursor("echo", "third-group", {"seed": 0, "draws": 3}))
        direct = aioredis.Redis.from_url(redis_url)
        entries = await direct.xrange(keys.trajectories)
        last_cursor = decode_cursor(await direct.get(keys.prompt_cursor))
        await direct.aclose()
        await client.aclose()
        await proxy.stop()
        return proxy.dropped, [decode_group(fields[b"g"]).group_id for _, fields in entries], last_cursor

    dropped, group_ids, last_cursor = asyncio.run(scenario())
    assert dropped == 1  # the reply of the second push was lost, and the push was retried
    assert group_ids == ["first-group", "lost-reply-group", "third-group"]
    assert last_cursor.group_id == "third-group" and last_cursor.position["draws"] == 3


def test_a_push_without_a_cursor_is_a_plain_append(redis_url):
    keys = RedisKeys("plain-push")

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        queue = RolloutQueue(client, keys)
        for name in ("a", "a"):  # no cursor, no idempotence: both land
            await queue.push(group(name))
        found = await client.xlen(keys.trajectories), await queue.prompt_cursor()
        await client.aclose()
        return found

    assert asyncio.run(scenario()) == (2, None)
