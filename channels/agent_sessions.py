"""External agents' sessions in Redis: what a restarted coordinator needs to serve them again.

The coordinator's agent API (coordinator/agents/sessions.py) writes every change of a session or group here before
the reply that depends on it, and reads everything back when it starts (``load``).

Layout (``RedisKeys.agent_session`` / ``agent_group``):

- one hash per session: ``h`` its AgentSessionRecord, ``t<i>`` its turn i (AgentTurn), ``r<i>`` the routed experts
  (Array) of turn i when i is its last generated turn (a newer generated turn deletes the older field in the same
  transaction: the trainer replays only the last turn's);
- one string per group: its AgentGroupRecord.

Every write sets given values (HSET/SET/HDEL/PEXPIREAT; a write of a group and a session is one MULTI/EXEC), so it
is idempotent, and goes through the one retry policy (channels/retry.py): ``timeout_s`` of retries while Redis is
unreachable, then the error propagates (the caller answers UNAVAILABLE and applies nothing). A turn is one HSET:
the hot path of an agent costs one round trip per turn. Every key expires at the deadline of its group (its
timeout plus how long a finished session is remembered), set when the key is written with its group record, so
nothing of a crashed run stays.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis

from channels.retry import retry_async
from protos.agent_records import AgentGroupRecord, AgentSessionRecord, AgentTurn
from protos.records import Array, encode
from protos.redis_keys import RedisKeys, as_text

logger = logging.getLogger(__name__)

_session_decoder = msgspec.msgpack.Decoder(AgentSessionRecord)
_turn_decoder = msgspec.msgpack.Decoder(AgentTurn)
_group_decoder = msgspec.msgpack.Decoder(AgentGroupRecord)
_array_decoder = msgspec.msgpack.Decoder(Array)
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
SCAN_BATCH = 200


@dataclass
class StoredSession:
    record: AgentSessionRecord
    turns: list[AgentTurn]  # in order; a gap (a turn never written) ends them
    routes: tuple[int, Array] | None  # (turn index, routed experts) of its last generated turn


@dataclass
class StoredAgents:
    """Everything ``load`` found: groups by uid, sessions (each names its group)."""

    groups: dict[str, AgentGroupRecord]
    sessions: list[StoredSession]
    num_undecodable: int = 0  # records skipped (logged): written by an incompatible version


class AgentSessionStore:
    """Writes and reads the agent sessions of one run."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, timeout_s: float = 30.0):
        self.client = client
        self.keys = keys
        self.timeout_s = timeout_s

    async def write(
        self,
        *,
        group: AgentGroupRecord | None = None,
        expire_at_s: float | None = None,
        session: AgentSessionRecord | None = None,
        turn: tuple[int, AgentTurn] | None = None,
        routes: tuple[int, Array] | None = None,
        superseded_routes: int | None = None,
    ) -> None:
        """Write the given records (idempotent: a repeat writes the same values).

        With ``group``: one transaction, and every key written expires at ``expire_at_s`` (wall time); a session's
        key gets its expiry when it is first written with its group (OpenSession) and keeps it. Without: the
        session's fields in one round trip of one command (HSET), two when routes are superseded (HDEL). ``turn``,
        ``routes`` and ``superseded_routes`` (the turn whose routes field to delete) need ``session``.
        """
        if session is None and (turn or routes or superseded_routes is not None):
            raise ValueError("AgentSessionStore.write: turns and routes belong to a session: pass session")
        if group is not None and expire_at_s is None:
            raise ValueError("AgentSessionStore.write: a group record needs expire_at_s (its keys' deadline)")
        fields = {}
        if session is not None:
            fields["h"] = encode(session)
            if turn is not None:
                fields[f"t{turn[0]}"] = encode(turn[1])
            if routes is not None:
                fields[f"r{routes[0]}"] = encode(routes[1])
        session_key = self.keys.agent_session(session.session_id) if session is not None else ""

        async def once() -> None:
            if group is None and superseded_routes is None:  # the hot path: a turn, a state change
                await self.client.hset(session_key, mapping=fields)
                return
            async with self.client.pipeline(transaction=group is not None) as pipe:
                expire_at_ms = int(expire_at_s * 1000) if group is not None else 0
                if group is not None:
                    pipe.set(self.keys.agent_group(group.group_uid), encode(group), pxat=expire_at_ms)
                if session is not None:
                    pipe.hset(session_key, mapping=fields)
                    if superseded_routes is not None:
                        pipe.hdel(session_key, f"r{superseded_routes}")
                    if group is not None:
                        pipe.pexpireat(session_key, expire_at_ms)
                await pipe.execute()

        what = (
            f"recording agent session {session.session_id}" if session else f"recording agent group {group.group_uid}"
        )
        await retry_async(once, what, self.timeout_s)

    async def forget(self, session_ids: list[str] = (), group_uids: list[str] = ()) -> None:
        """Delete sessions and groups that are done and no longer remembered."""
        keys = [self.keys.agent_session(s) for s in session_ids] + [self.keys.agent_group(g) for g in group_uids]
        if keys:
            await retry_async(
                lambda: self.client.delete(*keys), f"forgetting {len(keys)} agent records", self.timeout_s
            )

    async def load(self) -> StoredAgents:
        """Every group and session of the run (a restarted coordinator's start)."""
        return await retry_async(self._load_once, "reading the agent sessions", self.timeout_s)

    async def _load_once(self) -> StoredAgents:
        found = StoredAgents({}, [])
        group_keys = await self._scan(self.keys.agent_group("*"))
        for key, data in zip(group_keys, await self._values(group_keys, "get"), strict=True):
            try:
                if data is not None:
                    record = _group_decoder.decode(data)
                    found.groups[record.group_uid] = record
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                _skip(found, key, error)
        session_keys = await self._scan(self.keys.agent_session("*"))
        for key, fields in zip(session_keys, await self._values(session_keys, "hgetall"), strict=True):
            try:
                if fields:
                    found.sessions.append(_stored_session({as_text(k): v for k, v in fields.items()}))
            except (msgspec.DecodeError, msgspec.ValidationError, KeyError) as error:
                _skip(found, key, error)
        return found

    async def _scan(self, pattern_key: str) -> list[str]:
        prefix = pattern_key[:-1]  # the key names end in the '*' passed as the id
        pattern = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "*"
        return sorted({as_text(key) async for key in self.client.scan_iter(match=pattern, count=SCAN_BATCH)})

    async def _values(self, keys: list[str], command: str) -> list:
        values = []
        for start in range(0, len(keys), SCAN_BATCH):
            async with self.client.pipeline(transaction=False) as pipe:
                for key in keys[start : start + SCAN_BATCH]:
                    getattr(pipe, command)(key)
                values += await pipe.execute()
        return values


def _stored_session(fields: dict[str, bytes]) -> StoredSession:
    record = _session_decoder.decode(fields["h"])
    turns = []
    while f"t{len(turns)}" in fields:
        turns.append(_turn_decoder.decode(fields[f"t{len(turns)}"]))
    routes = None
    for name in fields:
        index = name[1:]
        if name.startswith("r") and index.isdigit() and int(index) < len(turns):
            if routes is None or int(index) > routes[0]:
                routes = (int(index), _array_decoder.decode(fields[name]))
    return StoredSession(record, turns, routes)


def _skip(found: StoredAgents, key: str, error: Exception) -> None:
    found.num_undecodable += 1
    logger.error("skipping agent record %s: it does not decode (%s)", key, error)
