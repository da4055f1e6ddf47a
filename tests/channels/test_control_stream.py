"""The control stream against the real embedded Redis: typed commands in, a decoded batch out, the reader's cursor,
undecodable entries and an outage."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from channels.control_stream import ControlStreamReader, ControlStreamWriter
from protos.records import ControlKind, decode_control
from protos.redis_keys import RedisKeys

pytestmark = pytest.mark.integration

KEYS = RedisKeys("control-stream")


def _write(redis_url: str, *calls) -> list[str]:
    async def run() -> list[str]:
        client = aioredis.Redis.from_url(redis_url)
        writer = ControlStreamWriter(client, KEYS)
        try:
            return [await call(writer) for call in calls]
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_a_reader_sees_the_commands_written_after_it_started_in_order_decoded(redis_url, client):
    _write(redis_url, lambda w: w.request_sync())  # before the reader: meant for an earlier process
    reader = ControlStreamReader(client, KEYS)
    assert reader.read().sync is False
    ids = _write(
        redis_url,
        lambda w: w.announce_setting("max_staleness", 3),
        lambda w: w.announce_setting("coordinator.sampling.top_p", 0.9),
        lambda w: w.request_sync(),
    )
    batch = reader.read()
    assert batch.sync is True
    assert batch.settings == [("max_staleness", "3"), ("coordinator.sampling.top_p", "0.9")]
    assert reader.read().settings == [] and reader.read().sync is False  # the cursor moved past them
    stored = client.xrange(KEYS.control)
    assert [entry_id.decode() for entry_id, _ in stored][-3:] == ids
    assert decode_control(stored[-1][1][b"c"]).kind is ControlKind.SYNC


def test_an_undecodable_entry_is_skipped_and_the_commands_after_it_are_read(redis_url, client):
    reader = ControlStreamReader(client, KEYS)
    client.xadd(KEYS.control, {"c": b"not a record"})
    _write(redis_url, lambda w: w.announce_setting("temperature", 0.7))
    assert reader.read().settings == [("temperature", "0.7")]


def test_a_read_while_redis_is_unreachable_returns_nothing_and_the_commands_come_later(private_server):
    import redis

    server = private_server()
    client = redis.Redis.from_url(server.url, socket_timeout=2)
    reader = ControlStreamReader(client, KEYS)
    _write(server.url, lambda w: w.request_sync())
    port = server.port
    server.stop()
    empty = reader.read()
    assert empty.sync is False and empty.settings == []
    private_server(port=port)  # the same append-only file: the command survived the restart
    assert reader.read().sync is True
    client.close()
