"""The coordinator's operator commands to the other roles (``fleetrl set`` / ``fleetrl sync``), on the run's control
stream (channels/control_stream.py: the typed ``ControlCommand`` records and the stream's rules).

A ``sync`` request also watches the version board's announcements for the publish it asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from channels.control_stream import ControlStreamWriter
from channels.version_board import AsyncVersionBoard
from protos.records import ControlKind
from protos.redis_keys import RedisKeys


@dataclass
class SyncResult:
    control_entry_id: str
    published: bool
    policy_version: int


class ControlChannel:
    """The admin API's writer of operator commands."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys):
        self.stream = ControlStreamWriter(client, keys)
        self.board = AsyncVersionBoard(client, keys)

    async def send(self, kind: ControlKind, key: str = "", value_json: str = "") -> str:
        """Append one command; returns its stream entry id."""
        return await self.stream.send(kind, key, value_json)

    async def announce_setting(self, key: str, value) -> str:
        return await self.stream.announce_setting(key, value)

    async def request_sync(self, wait_s: float) -> SyncResult:
        """Ask for a weight publish; with ``wait_s`` > 0, wait that long for a version announcement."""
        cursor = await self.board.last_announcement_id()
        entry_id = await self.stream.request_sync()
        deadline = time.monotonic() + wait_s
        while (remaining := deadline - time.monotonic()) > 0:
            # short blocks: the client's socket timeout must not fire under a long XREAD
            _, announced = await self.board.wait_for_announcement(cursor, timeout_s=min(remaining, 1.0))
            if announced is not None:
                return SyncResult(entry_id, True, announced)
        return SyncResult(entry_id, False, -1)
