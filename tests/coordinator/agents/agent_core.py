"""The agent API's core in a test process: a SessionBook over a real scheduler, fleet and trajectory stream writer,
against a real rollout server; the gRPC adapter's and the OpenAI door's tests add their server on top."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from channels.agent_sessions import AgentSessionStore
from channels.trajectory_stream import TrajectoryStreamWriter
from coordinator.agents.restore import restore_book
from coordinator.agents.sessions import SessionBook
from coordinator.fleet import Fleet
from coordinator.rollout_client import RolloutClient
from coordinator.scheduler import Scheduler
from coordinator.tasks import EchoTask
from protos.config import load_run_config
from protos.records import decode_group
from protos.redis_keys import RedisKeys

# groups of 2, one group per step, one step of staleness: small enough that admission refusals are reachable
BASE_OVERRIDES = ("coordinator.group_size=2", "groups_per_step=1", "max_staleness=1")


class BookHarness:
    """``async with`` it: ``book``, ``scheduler``, ``fleet``; ``queued()`` reads what reached the stream."""

    def __init__(self, address: str, redis_url: str, keys: RedisKeys, overrides=(), pushed_before: int = 0):
        self.config = load_run_config(overrides=[*BASE_OVERRIDES, *overrides])
        self.address, self.redis_url, self.keys = address, redis_url, keys
        self.pushed_before = pushed_before  # a restarted coordinator's: groups pushed before it, none trained

    async def __aenter__(self):
        self.redis = aioredis.Redis.from_url(self.redis_url)
        client = RolloutClient(self.address)
        info = await client.info()
        self.fleet = Fleet([client])
        queue = TrajectoryStreamWriter(self.redis, self.keys)
        before = self.pushed_before
        self.scheduler = Scheduler(
            self.config, self.fleet, queue, EchoTask(), 8, queued_at_start=before, pushed_before=before
        )
        self.store = AgentSessionStore(self.redis, self.keys)
        self.book = SessionBook(
            self.config.agent, self.scheduler, self.fleet, lambda: 1.0, info.max_model_len, info.vocab_size, self.store
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.fleet.close()
        await self.redis.aclose()

    async def restore(self) -> None:
        """What a restarted coordinator does before it serves: the sessions an earlier one left in Redis."""
        cursor = await self.scheduler.queue.prompt_cursor()
        await restore_book(self.book, cursor.group_id if cursor is not None else None)

    def queued(self) -> list:
        entries = redis.Redis.from_url(self.redis_url).xrange(self.keys.trajectories)
        return [decode_group(fields[b"g"]) for _, fields in entries]
