"""The control stream: operator commands from the coordinator's admin API to the other roles.

Stream ``fleetrl:<run>:control`` (``RedisKeys.control``); one entry per command, field ``c`` holding an encoded
``ControlCommand`` (protos/records.py):

* ``SYNC``: publish the current weights now (the trainer acts on it between steps);
* ``SET key value_json``: a run-time setting changed (e.g. ``max_staleness`` = ``2``); roles apply the keys they
  use and ignore the others.

The coordinator alone writes (``ControlStreamWriter``, asyncio); each reader keeps its own cursor (plain XREAD, no
consumer group) and starts after what is already in the stream: older commands were meant for an earlier process
(``ControlStreamReader``, sync: the trainer's rank 0).

Outages: a write is not retried (an XADD repeated after a lost reply would append the command twice); the
``UNREACHABLE`` error reaches the admin API, which answers UNAVAILABLE and the operator repeats. A read is polled
about once a second, so the next poll is its retry: the commands stay in the stream meanwhile.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field

import msgspec
import redis
import redis.asyncio as aioredis

from channels.retry import UNREACHABLE
from protos.records import ControlCommand, ControlKind, decode_control, encode
from protos.redis_keys import RedisKeys, as_text

logger = logging.getLogger(__name__)

MAX_CONTROL_ENTRIES = 1000
FIELD = "c"


@dataclass
class ControlBatch:
    """The commands read in one poll: whether any asked for a ``SYNC``, and the ``SET`` (key, JSON value) pairs in
    stream order."""

    sync: bool = False
    settings: list[tuple[str, str]] = field(default_factory=list)


class ControlStreamWriter:
    """The coordinator's side: appends typed commands."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys):
        self.client = client
        self.keys = keys

    async def send(self, kind: ControlKind, key: str = "", value_json: str = "") -> str:
        """Append one command; returns its stream entry id."""
        command = ControlCommand(kind, uuid.uuid4().hex[:12], key, value_json)
        entry_id = await self.client.xadd(
            self.keys.control, {FIELD: encode(command)}, maxlen=MAX_CONTROL_ENTRIES, approximate=True
        )
        return as_text(entry_id)

    async def announce_setting(self, key: str, value) -> str:
        """A ``SET`` of ``key`` to ``value`` (JSON-encoded on the wire)."""
        return await self.send(ControlKind.SET, key, json.dumps(value))

    async def request_sync(self) -> str:
        """A ``SYNC``: the trainer re-publishes its current weights."""
        return await self.send(ControlKind.SYNC)


class ControlStreamReader:
    """A role's side (sync client): the commands written since its last read, decoded."""

    def __init__(self, client: redis.Redis, keys: RedisKeys):
        self.client = client
        self.keys = keys
        self.last_id: bytes | str = "0-0"
        last = client.xrevrange(keys.control, count=1)
        if last:  # start after what is already there: old commands were meant for an earlier process
            self.last_id = last[0][0]

    def read(self) -> ControlBatch:
        """The commands written since the last read; none while Redis is unreachable (they come with a later read).

        An undecodable entry is logged and skipped: it is not this reader's to stop on.
        """
        try:
            entries = self.client.xread({self.keys.control: self.last_id}, count=100) or []
        except UNREACHABLE as error:  # polled about once a second: the next poll is the retry
            logger.warning("control commands not read from %s, Redis unreachable: %s", self.keys.control, error)
            return ControlBatch()
        batch = ControlBatch()
        for _stream, items in entries:
            for entry_id, fields in items:
                self.last_id = entry_id
                try:
                    command = decode_control(fields.get(FIELD.encode(), b""))
                except (msgspec.DecodeError, msgspec.ValidationError) as error:
                    logger.error("control: skipping undecodable entry %s: %s", as_text(entry_id), error)
                    continue
                if command.kind is ControlKind.SYNC:
                    batch.sync = True
                elif command.kind is ControlKind.SET:
                    batch.settings.append((command.key, command.value_json))
        return batch
