"""The agent session store (channels/agent_sessions.py) against a real valkey: what the coordinator writes about
external agents' sessions is what a restarted coordinator reads back, writes are idempotent under lost replies
and retried through an outage, and everything expires with its group."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import numpy as np
import pytest
import redis.asyncio as aioredis

from channels.agent_sessions import AgentSessionStore
from channels.retry import UNREACHABLE
from protos.agent_records import (
    AgentGroupRecord,
    AgentGroupState,
    AgentSessionRecord,
    AgentSessionState,
    AgentTurn,
)
from protos.records import (
    Array,
    FinishReason,
    VersionSpan,
)
from protos.redis_keys import RedisKeys
from tests.redis_faults import redis_proxy, reply_dropping_proxy

pytestmark = pytest.mark.integration

KEYS = RedisKeys("agents")


def _group(uid: str = "g1", state: AgentGroupState = AgentGroupState.OPEN) -> AgentGroupRecord:
    prompt = Array.from_numpy(np.array([1, 4, 5], np.int32))
    return AgentGroupRecord(uid, "task-7", prompt, 1.0, "", 0, time.time(), state)


def _session(session_id: str = "s1", **changes) -> AgentSessionRecord:
    record = AgentSessionRecord(
        session_id, "team-a", "g1", "127.0.0.1:1", 0, {}, AgentSessionState.OPEN, None, "", "o1"
    )
    return msgspec.structs.replace(record, **changes)


def _turn(tokens: list[int], generated: bool = True) -> AgentTurn:
    logprobs = [-0.5] * len(tokens) if generated else [0.0] * len(tokens)
    spans = [VersionSpan(0, 0, len(tokens))] if generated else []
    return AgentTurn(
        generated,
        Array.from_numpy(np.array(tokens, np.int32)),
        Array.from_numpy(np.array(logprobs, np.float32)),
        FinishReason.STOP if generated else FinishReason.UNSPECIFIED,
        spans,
        "r0" if generated else "",
    )


def _routes(rows: int) -> Array:
    return Array.from_numpy(np.arange(rows * 4, dtype=np.int32).reshape(rows, 2, 2))


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_session_written_turn_by_turn_loads_back_with_its_group_and_only_its_last_routes(redis_url, client):
    async def scenario():
        store = AgentSessionStore(aioredis.Redis.from_url(redis_url), KEYS)
        expire_at = time.time() + 600
        await store.write(expire_at_s=expire_at, group=_group(), session=_session())
        await store.write(session=_session(), turn=(0, _turn([5, 6])), routes=(0, _routes(4)))
        await store.write(session=_session(), turn=(1, _turn([7], generated=False)))
        submitted = _session(state=AgentSessionState.SUBMITTED, reward=0.5, submission_id="sub")
        await store.write(session=submitted, turn=(2, _turn([8])), routes=(2, _routes(7)), superseded_routes=0)
        return await store.load(), expire_at

    found, expire_at = run(scenario())
    assert list(found.groups) == ["g1"] and found.groups["g1"].state is AgentGroupState.OPEN
    [stored] = found.sessions
    assert stored.record.state is AgentSessionState.SUBMITTED and stored.record.reward == 0.5
    assert [t.token_ids.to_numpy().tolist() for t in stored.turns] == [[5, 6], [7], [8]]
    assert [t.generated for t in stored.turns] == [True, False, True]
    index, routes = stored.routes
    assert index == 2 and routes.to_numpy().shape == (7, 2, 2)
    assert set(client.hkeys(KEYS.agent_session("s1"))) == {b"h", b"t0", b"t1", b"t2", b"r2"}  # r0 superseded
    for key in (KEYS.agent_session("s1"), KEYS.agent_group("g1")):  # both expire with the group
        assert abs(client.pexpiretime(key) / 1000 - expire_at) < 1


def test_a_write_whose_reply_is_lost_is_retried_and_lands_once(redis_url):
    async def scenario(proxy_url: str):
        store = AgentSessionStore(aioredis.Redis.from_url(proxy_url), KEYS)
        await store.write(expire_at_s=time.time() + 600, group=_group(), session=_session("lost-reply"))
        await store.write(session=_session("lost-reply"), turn=(0, _turn([5, 6])))
        return await AgentSessionStore(aioredis.Redis.from_url(redis_url), KEYS).load()

    with reply_dropping_proxy(redis_url, b"lost-reply") as (proxy_url, proxy):
        found = run(scenario(proxy_url))
    assert proxy.dropped == 1
    [stored] = found.sessions
    assert stored.record.session_id == "lost-reply" and len(stored.turns) == 1 and list(found.groups) == ["g1"]


def test_an_outage_is_waited_out_within_the_timeout_and_raises_after_it(redis_url):
    async def scenario(proxy_url: str, proxy) -> float:
        store = AgentSessionStore(aioredis.Redis.from_url(proxy_url), KEYS, timeout_s=20.0)
        proxy.cut()
        threading.Timer(1.0, proxy.restore).start()
        started = time.monotonic()
        await store.write(expire_at_s=time.time() + 600, group=_group(), session=_session())  # waits for the restore
        waited = time.monotonic() - started
        proxy.cut()
        short = AgentSessionStore(aioredis.Redis.from_url(proxy_url), KEYS, timeout_s=0.5)
        with pytest.raises(UNREACHABLE):
            await short.write(session=_session("never"))
        return waited

    with redis_proxy(redis_url) as (proxy_url, proxy):
        waited = run(scenario(proxy_url, proxy))
    assert waited >= 0.9
    found = run(AgentSessionStore(aioredis.Redis.from_url(redis_url), KEYS).load())
    assert [s.record.session_id for s in found.sessions] == ["s1"]


def test_forget_deletes_and_load_sees_only_its_run_and_skips_what_does_not_decode(redis_url, client):
    async def scenario():
        store = AgentSessionStore(aioredis.Redis.from_url(redis_url), KEYS)
        other = AgentSessionStore(aioredis.Redis.from_url(redis_url), RedisKeys("agents*"))  # a glob in a run id
        await store.write(expire_at_s=time.time() + 600, group=_group("g1"), session=_session("s1"))
        await store.write(expire_at_s=time.time() + 600, group=_group("g2"), session=_session("s2"))
        await other.write(expire_at_s=time.time() + 600, group=_group("g9"), session=_session("s9"))
        client.set(KEYS.agent_group("broken"), b"\x01\x02")
        await store.forget(["s2"], ["g2"])
        return await store.load(), await other.load()

    found, other = run(scenario())
    assert sorted(found.groups) == ["g1"] and [s.record.session_id for s in found.sessions] == ["s1"]
    assert found.num_undecodable == 1
    assert sorted(other.groups) == ["g9"] and [s.record.session_id for s in other.sessions] == ["s9"]


def test_turns_and_routes_without_a_session_are_refused_before_anything_is_written(redis_url, client):
    store = AgentSessionStore(aioredis.Redis.from_url(redis_url), KEYS)
    with pytest.raises(ValueError, match="pass session"):
        run(store.write(expire_at_s=time.time() + 600, group=_group(), turn=(0, _turn([5]))))
    assert client.keys("*") == []
