"""ControlChannel: operator commands for the other roles, on the run's Redis control stream.

Stream ``fleetrl:<run>:control`` (``RedisKeys.control``); one entry per command, field ``c`` holding an
encoded ``ControlCommand`` (protos/records.py):

* ``SYNC``: publish the current weights now (the trainer acts on it between steps);
* ``SET key value_json``: a run-time setting changed (e.g. ``max_staleness`` = ``2``); roles apply
  the keys they use and ignore the others.

The coordinator only writes; each reader keeps its own cursor (plain XREAD, no consumer group).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis

from channels.version_board import AsyncVersionBoard
from protos.records import ControlCommand, ControlKind, encode
from protos.redis_keys import RedisKeys, as_text

MAX_CONTROL_ENTRIES = 1000


@dataclass
class SyncResult:
    control_entry_id: str
    published: bool
    policy_version: int


class ControlChannel:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys):
        self.client = client
        self.keys = keys
        self.board = AsyncVersionBoard(client, keys)

    async def send(self, kind: ControlKind, key: str = "", value_json: str = "") -> str:
        """Append one command; returns its stream entry id."""
        command = ControlCommand(kind, uuid.uuid4().hex[:12], key, value_json)
        entry_id = await self.client.xadd(
            self.keys.control, {"c": encode(command)}, maxlen=MAX_CONTROL_ENTRIES, approximate=True
        )
        return as_text(entry_id)

    async def announce_setting(self, key: str, value) -> str:
        return await self.send(ControlKind.SET, key, json.dumps(value))

    async def request_sync(self, wait_s: float) -> SyncResult:
        """Ask for a weight publish; with ``wait_s`` > 0, wait that long for a version announcement."""
        cursor = await self.board.last_announcement_id()
        entry_id = await self.send(ControlKind.SYNC)
        deadline = time.monotonic() + wait_s
        while (remaining := deadline - time.monotonic()) > 0:
            # short blocks: the client's socket timeout must not fire under a long XREAD
            _, announced = await self.board.wait_for_announcement(cursor, timeout_s=min(remaining, 1.0))
            if announced is not None:
                return SyncResult(entry_id, True, announced)
        return SyncResult(entry_id, False, -1)
