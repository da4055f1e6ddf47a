"""The trajectory stream (``RedisKeys.trajectories``): encoded ``TrajectoryGroup`` records, field ``g``.

``TrajectoryStreamWriter`` is the coordinator's end (async XADD); ``TrajectoryStreamReader`` is the trainer's (sync
consumer-group read, pending-list recovery, ack, trim).

Exactly once, writer side: each push also sets the run's prompt cursor in the same server-side step (a Lua script),
so a restarted coordinator resumes the prompt stream exactly after the groups that reached the queue, and a retried
push is not added twice. A push that fails because Redis is down or restarting is retried until ``timeout_s``: a
finished group is never dropped silently.

Exactly once, reader side: an entry is acknowledged only after the step that used it has been committed; entries
left pending by a crashed trainer are reclaimed on start (XAUTOCLAIM), and entries a broken read delivered without
its reply reaching us are taken from our pending list (XPENDING). Undecodable payloads go to a dead-letter list
instead of stopping the trainer.
"""

from __future__ import annotations

import logging
import time

import msgspec
import redis
import redis.asyncio as aioredis

from channels.retry import UNREACHABLE, retry_async, retry_sync
from protos.records import PromptCursor, TrajectoryGroup, decode_cursor, decode_group, encode
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


# The trainer's ack in one server-side step: XACK of ARGV[3..] (in chunks: Lua's unpack has a stack limit), then, with
# ARGV[2] == '1', the trim: the group's last delivered id and its oldest pending id, XTRIM MINID below the older of the
# two. XACK and XTRIM are idempotent, so a lost reply is retried whole. As four round trips (XACK, XINFO GROUPS,
# XPENDING, XTRIM) they cost a fast step more than the reads (benchmarks/queue_throughput.py). Lua sees XINFO as flat
# field/value arrays (RESP2). Returns {acknowledged, trimmed}.
_ACK_AND_TRIM = """
local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function older(a, b)
  local a_ms, a_seq = id_parts(a)
  local b_ms, b_seq = id_parts(b)
  return a_ms < b_ms or (a_ms == b_ms and a_seq < b_seq)
end
local acked = 0
for first = 3, #ARGV, 1000 do
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
if ARGV[2] ~= '1' then return {acked, 0} end
local keep_from = nil
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local fields = {}
  for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
  if fields['name'] == ARGV[1] then keep_from = fields['last-delivered-id'] end
end
if keep_from == nil or keep_from == '0-0' then return {acked, 0} end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1])
if tonumber(pending[1]) > 0 and older(pending[2], keep_from) then keep_from = pending[2] end
return {acked, redis.call('XTRIM', KEYS[1], 'MINID', keep_from)}
"""


class TrajectoryStreamWriter:
    """The coordinator's end of the stream: pushes whole groups, each with the prompt cursor after it."""

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


class TrajectoryStreamReader:
    """The trainer's end of the stream: reads whole groups for one consumer of the trainers' consumer group."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, consumer: str = "trainer-0", trim: bool = True):
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.trim = trim
        self.num_dead_letters = 0
        self._reclaimed: list[tuple[str, bytes]] = []
        self._in_hand: set[str] = set()  # read by this consumer, not yet acknowledged
        self._orphans_possible = False  # a read broke: entries may be pending here that never reached us
        self._last_depth = 0
        self._ack_and_trim = client.register_script(_ACK_AND_TRIM)  # EVALSHA, re-loaded if Redis lost it
        try:
            client.xgroup_create(keys.trajectories, keys.trainer_group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    def reclaim_pending(self, min_idle_ms: int = 0) -> int:
        """Take over entries delivered but never acknowledged (a crashed trainer's); returns the count."""
        start = "0-0"
        self._reclaimed.clear()
        while True:
            start, entries, *_ = self.client.xautoclaim(
                self.keys.trajectories, self.keys.trainer_group, self.consumer, min_idle_ms, start, count=100
            )
            self._reclaimed.extend(
                (as_text(entry_id), fields.get(b"g", b"")) for entry_id, fields in entries if fields is not None
            )
            if as_text(start) == "0-0":
                return len(self._reclaimed)

    def read(self, num_groups: int, timeout_s: float) -> list[tuple[str, TrajectoryGroup]]:
        """Return up to ``num_groups`` (entry id, group) pairs, waiting at most ``timeout_s`` in total.

        A read whose connection breaks is retried until the timeout (by hand, not ``retry_sync``: a broken XREADGROUP
        is not idempotent, see below). Entries it delivered without the reply reaching us stay in this consumer's
        pending list; the next attempt (this call's or a later one's) takes them from there (``_take_orphans``).
        """
        batch: list[tuple[str, TrajectoryGroup]] = []
        while self._reclaimed and len(batch) < num_groups:
            self._decode_into(batch, *self._reclaimed.pop(0))
        deadline = time.monotonic() + timeout_s
        while len(batch) < num_groups:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                break
            try:
                if self._orphans_possible:
                    self._take_orphans(batch, num_groups)
                    self._orphans_possible = False
                    continue
                reply = self.client.xreadgroup(
                    self.keys.trainer_group,
                    self.consumer,
                    {self.keys.trajectories: ">"},
                    count=num_groups - len(batch),
                    block=min(remaining_ms, 1000),
                )
            except UNREACHABLE as error:
                logger.warning(
                    "reading %s failed, retrying for %.1fs more: %s", self.keys.trajectories, remaining_ms / 1000, error
                )
                self._orphans_possible = True  # the broken read may have delivered entries
                time.sleep(min(1.0, remaining_ms / 1000))  # one warning a second while Redis is away
                continue
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    self._decode_into(batch, as_text(entry_id), fields.get(b"g", b""))
        return batch

    def _take_orphans(self, batch: list, num_groups: int) -> None:
        """Entries delivered to this consumer whose reply never arrived (a read that broke after the server ran it):
        they sit in our pending list but not in hand, and no ``>`` read returns them again; take them now.

        The pending list gives ids only: the payloads of the entries in hand (a whole step's) are not read again.
        """
        known = self._in_hand | {entry_id for entry_id, _ in self._reclaimed}
        pending = self.client.xpending_range(
            self.keys.trajectories,
            self.keys.trainer_group,
            min="-",
            max="+",
            count=len(known) + 1000,
            consumername=self.consumer,
        )
        for entry in pending:
            entry_id = as_text(entry["message_id"])
            if len(batch) >= num_groups or entry_id in known:
                continue
            for found_id, fields in self.client.xrange(self.keys.trajectories, entry_id, entry_id, count=1):
                logger.warning("taking entry %s delivered to %s earlier but never received", entry_id, self.consumer)
                self._decode_into(batch, as_text(found_id), fields.get(b"g", b""))

    def _decode_into(self, batch: list, entry_id: str, payload: bytes) -> None:
        try:
            batch.append((entry_id, decode_group(payload)))
            self._in_hand.add(entry_id)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            logger.error("dead-lettering undecodable trajectory entry %s: %s", entry_id, error)
            self.client.rpush(self.keys.dead_letters, payload)
            self.client.xack(self.keys.trajectories, self.keys.trainer_group, entry_id)
            self.num_dead_letters += 1

    def ack(self, entry_ids: list[str], timeout_s: float = 60.0) -> None:
        """Acknowledge entries whose step is committed and (``trim``) drop what no consumer can need any more, in one
        round trip.

        Both are idempotent, so a broken connection is retried for ``timeout_s`` (a trainer that exits instead
        reloads its model to get back here); then the error propagates.
        """
        if not entry_ids:
            return
        stream, group = self.keys.trajectories, self.keys.trainer_group
        if self.trim:
            call = lambda: self._ack_and_trim(keys=[stream], args=[group, "1", *entry_ids])  # noqa: E731
        else:
            call = lambda: self.client.xack(stream, group, *entry_ids)  # noqa: E731
        retry_sync(call, f"acknowledging {len(entry_ids)} entries", timeout_s)
        self._in_hand.difference_update(entry_ids)

    def trim_acknowledged(self) -> int:
        """Delete stream entries older than both the oldest pending entry and the group's last delivery.

        Those are acknowledged: keeping them only grows Redis by one group per entry for the whole run. Entries
        not yet delivered are never trimmed, so the group's lag (the queue depth) stays exact. ``ack`` does it in the
        same step; returns the entries deleted.
        """
        _, trimmed = self._ack_and_trim(keys=[self.keys.trajectories], args=[self.keys.trainer_group, "1"])
        return int(trimmed)

    def depth(self) -> int:
        """Entries on the stream not yet delivered to the trainers' group (the queue's backlog); the last value read
        while Redis is unreachable (a figure for reports, not worth stopping for)."""
        try:
            group = self.keys.trainer_group_info(self.client.xinfo_groups(self.keys.trajectories))
        except UNREACHABLE as error:
            logger.warning("queue depth not read, Redis unreachable: %s", error)
            return self._last_depth
        self._last_depth = int(group.get("lag") or 0) if group else 0
        return self._last_depth
