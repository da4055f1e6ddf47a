"""RolloutQueue: the coordinator's side of the trajectory stream (XADD of encoded groups).

Each push also sets the run's prompt cursor in the same server-side step (a Lua script), so a restarted
coordinator resumes the prompt stream exactly after the groups that reached the queue, and a retried push
is not added twice.

A push that fails because Redis is down or restarting is retried until ``timeout_s``: a finished
group is never dropped silently.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from channels.retry import UNREACHABLE, retry_async
from protos.records import PromptCursor, TrajectoryGroup, decode_cursor, encode
from protos.redis_keys import RedisKeys, as_text

logger = logging.getLogger(__name__)


# One server-side step: a cursor equal to the one being set means this very push ran already (cursors name their
# group, and group ids are unique in a run), so a retried push adds no second stream entry.
_PUSH_ONCE = """
if redis.call('GET', KEYS[2]) == ARGV[2] then return '' end
local entry_id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
return entry_id
"""


class RolloutQueue:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys, timeout_s: float = 120.0):
        self.client = client
        self.keys = keys
        self.timeout_s = timeout_s
        self._push_once = client.register_script(_PUSH_ONCE)  # EVALSHA, re-loaded if Redis lost it

    async def push(self, group: TrajectoryGroup, cursor: PromptCursor | None = None) -> str:
        """Append one group and set the prompt cursor, atomically; returns the stream entry id ("" when this push
        had landed already).

        With a cursor the push is idempotent: a retry (ours, or the Redis client's own after a lost reply) finds the
        cursor it set and adds no second entry. Without one it is a plain XADD.
        """
        payload = encode(group)

        async def push_once() -> str:
            if cursor is None:
                return as_text(await self.client.xadd(self.keys.trajectories, {"g": payload}))
            keys = [self.keys.trajectories, self.keys.prompt_cursor]
            entry_id = as_text(await self._push_once(keys=keys, args=[payload, encode(cursor)]))
            if not entry_id:
                logger.warning("group %s had been pushed before its reply was lost; not pushed again", group.group_id)
            return entry_id

        try:
            return await retry_async(push_once, f"pushing group {group.group_id}", self.timeout_s)
        except UNREACHABLE as error:
            raise TimeoutError(
                f"pushing group {group.group_id} to {self.keys.trajectories}: Redis unreachable "
                f"for {self.timeout_s}s ({error})"
            ) from error

    async def prompt_cursor(self) -> PromptCursor | None:
        """The cursor the last push set (None: no coordinator pushed on this run yet)."""
        data = await self.client.get(self.keys.prompt_cursor)
        return None if data is None else decode_cursor(data)

    async def pushed_total(self) -> int:
        """Groups ever pushed onto the run's stream, by any coordinator (the stream's entries-added counter)."""
        try:
            info = await self.client.xinfo_stream(self.keys.trajectories)
        except aioredis.ResponseError:  # no stream yet: a fresh run
            return 0
        return int(info.get("entries-added", info.get("length", 0)))

    async def depth(self) -> int:
        """Entries not yet delivered to the trainers (lag of their consumer group)."""
        try:
            groups = await self.client.xinfo_groups(self.keys.trajectories)
        except aioredis.ResponseError:
            return 0
        group = self.keys.trainer_group_info(groups)
        if group is not None:
            return int(group.get("lag") or 0)
        return await self.client.xlen(self.keys.trajectories)  # no trainer yet: nothing was delivered
