"""The agent SDK (fleetrl.agent) against a real grpc.aio server in this process (scripted_agent_server): the
token on every call, exactly-once retries after lost replies, admission waits, abandon on leaving a session."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from scripted_agent_server import NUM_LAYERS, TOKEN, TOP_K, Exhausted, Fault, ScriptedAgentService, ServerThread

from fleetrl.agent import (
    AdmissionTimeout,
    AgentClient,
    AsyncAgentClient,
    FailedPrecondition,
    FinishReason,
    GroupState,
    InvalidArgument,
    RetryPolicy,
    Unauthenticated,
    Unavailable,
    VersionSpan,
)
from protos import agent_pb2

pytestmark = pytest.mark.integration

PROMPT = [1, 4, 5, 6]
FAST = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.05, admission_timeout_s=5.0)


@pytest.fixture
def server():
    thread = ServerThread(ScriptedAgentService()).start()
    try:
        yield thread
    finally:
        thread.stop()


def run(coro):
    return asyncio.run(coro)


async def _client(server, token=TOKEN, retry=FAST) -> AsyncAgentClient:
    return AsyncAgentClient(server.address, token, timeout_s=10.0, retry=retry)


def test_every_call_carries_the_bearer_token_and_results_are_typed(server):
    async def scenario():
        async with await _client(server) as client:
            async with client.session(PROMPT, group_key="task-1", group_size=2, metadata={"task": "1"}) as s:
                first = await s.generate(3)
                appended = await s.append([40, 5, 6])
                second = await s.generate(4)
                submitted = await s.submit(reward=0.5, expected_token_ids=s.token_ids)
                return s, first, appended, second, submitted

    s, first, appended, second, submitted = run(scenario())
    servicer = server.servicer
    assert {call.metadata["authorization"] for call in servicer.calls} == {f"Bearer {TOKEN}"}
    assert [c.method for c in servicer.calls] == ["OpenSession", "Generate", "Append", "Generate", "Submit"]
    assert first.token_ids == [10, 11, 12] and first.finish_reason is FinishReason.LENGTH and not first.recovered
    assert first.turn_index == 0 and first.session_length == 7
    assert first.version_spans == [VersionSpan(7, 0, 3)]
    assert first.routed_experts.shape == (6, NUM_LAYERS, TOP_K) and first.routed_experts.dtype == np.int32
    assert (appended.turn_index, appended.session_length) == (1, 10)
    assert second.turn_index == 2 and second.session_length == 14
    assert [c.request.expected_length for c in servicer.calls_of("Generate")] == [4, 10]
    assert s.token_ids == servicer.sessions[s.session_id].token_ids()
    assert submitted.group_state is GroupState.WAITING and submitted.sessions_submitted == 1
    assert not servicer.calls_of("CloseSession")  # submitted: nothing to abandon


def test_unknown_token_raises_unauthenticated_with_code_and_message(server):
    async def scenario():
        async with await _client(server, token="wrong") as client:
            await client.open_session(PROMPT, group_key="k", group_size=1)

    with pytest.raises(Unauthenticated) as info:
        run(scenario())
    assert info.value.code is grpc.StatusCode.UNAUTHENTICATED and "unknown bearer token" in info.value.details


def test_generate_retried_after_a_lost_reply_yields_exactly_one_turn(server):
    server.servicer.inject("Generate", Fault.LOST_REPLY)

    async def scenario():
        async with await _client(server) as client:
            async with client.session(PROMPT, group_key="k", group_size=1) as s:
                turn = await s.generate(6)
                after = await s.generate(2)
                await s.submit(reward=1.0)
                return s, turn, after

    s, turn, after = run(scenario())
    record = server.servicer.sessions[s.session_id]
    assert len(record.turns) == 2  # the lost turn once, then the next one
    assert turn.recovered and turn.token_ids == list(record.turns[0].token_ids) and turn.turn_index == 0
    assert turn.finish_reason is FinishReason.LENGTH
    # the record's version spans and routed experts, as the lost reply's last chunk would have carried them
    assert turn.version_spans == [VersionSpan(7, 0, len(turn.token_ids))]
    assert turn.routed_experts.shape == (turn.session_length - 1, 2, 2) and turn.routed_experts[-1, -1, -1] > 0
    assert after.turn_index == 1 and s.token_ids == record.token_ids()
    generates = server.servicer.calls_of("Generate")
    assert [c.request.expected_length for c in generates] == [4, 4, 10]  # the retry repeated expected_length


def test_generate_retried_after_unavailable_succeeds_on_the_second_attempt(server):
    server.servicer.inject("Generate", Fault.UNAVAILABLE)

    async def scenario():
        async with await _client(server) as client:
            async with client.session(PROMPT, group_key="k", group_size=1) as s:
                return s, await s.generate(3)

    s, turn = run(scenario())
    assert not turn.recovered and len(server.servicer.sessions[s.session_id].turns) == 1
    assert len(server.servicer.calls_of("Generate")) == 2


def test_unavailable_past_max_attempts_raises_unavailable(server):
    server.servicer.inject("OpenSession", *[Fault.UNAVAILABLE] * 3)
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01)

    async def scenario():
        async with await _client(server, retry=retry) as client:
            await client.open_session(PROMPT, group_key="k", group_size=1)

    with pytest.raises(Unavailable, match="after 3 attempts"):
        run(scenario())
    assert len(server.servicer.calls_of("OpenSession")) == 3


def test_open_retried_after_a_lost_reply_returns_the_same_session(server):
    server.servicer.inject("OpenSession", Fault.LOST_REPLY)

    async def scenario():
        async with await _client(server) as client:
            s = await client.open_session(PROMPT, group_key="k", group_size=1)
            await s.abandon()
            return s

    s = run(scenario())
    opens = server.servicer.calls_of("OpenSession")
    assert len(opens) == 2 and opens[0].request.open_id == opens[1].request.open_id
    assert list(server.servicer.sessions) == [s.session_id]


def test_append_retried_after_a_lost_reply_is_recorded_once(server):
    server.servicer.inject("Append", Fault.LOST_REPLY)

    async def scenario():
        async with await _client(server) as client:
            async with client.session(PROMPT, group_key="k", group_size=1) as s:
                result = await s.append([40, 5])
                return s, result, await s.generate(2)

    s, result, turn = run(scenario())
    record = server.servicer.sessions[s.session_id]
    assert [list(t.token_ids) for t in record.turns][0] == [40, 5] and len(record.turns) == 2
    assert (result.turn_index, result.session_length) == (0, 6) and turn.turn_index == 1


def test_submit_retried_after_a_lost_reply_reuses_the_submission_id(server):
    server.servicer.inject("Submit", Fault.LOST_REPLY)

    async def scenario():
        async with await _client(server) as client:
            async with client.session(PROMPT, group_key="k", group_size=1) as s:
                await s.generate(2)
                return await s.submit(reward=1.0)

    result = run(scenario())
    submits = server.servicer.calls_of("Submit")
    assert len(submits) == 2 and submits[0].request.submission_id == submits[1].request.submission_id
    assert result.sessions_submitted == 1 and not server.servicer.calls_of("CloseSession")


def test_admission_wait_honours_retry_after_ms(server):
    server.servicer.inject("OpenSession", Exhausted(80), Exhausted(80))

    async def scenario():
        async with await _client(server) as client:
            s = await client.open_session(PROMPT, group_key="k", group_size=1)
            await s.abandon()

    run(scenario())
    at_s = [call.at_s for call in server.servicer.calls_of("OpenSession")]
    assert len(at_s) == 3 and all(later - earlier >= 0.08 for earlier, later in zip(at_s, at_s[1:], strict=False))
    assert len(server.servicer.sessions) == 1


def test_admission_wait_times_out_with_admission_timeout(server):
    server.servicer.inject("OpenSession", *[Exhausted(50)] * 100)
    retry = RetryPolicy(admission_timeout_s=0.3)

    async def scenario():
        async with await _client(server, retry=retry) as client:
            await client.open_session(PROMPT, group_key="k", group_size=1)

    start = time.monotonic()
    with pytest.raises(AdmissionTimeout) as info:
        run(scenario())
    assert time.monotonic() - start < 2.0 and info.value.retry_after_s == 0.05
    assert 2 <= len(server.servicer.calls_of("OpenSession")) <= 7 and not server.servicer.sessions


def test_rate_limited_generate_waits_retry_after_ms_then_generates(server):
    server.servicer.inject("Generate", Exhausted(30))

    async def scenario():
        async with await _client(server) as client:
            async with client.session(PROMPT, group_key="k", group_size=1) as s:
                return await s.generate(2)

    assert run(scenario()).token_ids == [10, 11]
    first, second = server.servicer.calls_of("Generate")
    assert second.at_s - first.at_s >= 0.03


def test_leaving_the_block_without_submit_abandons_the_session(server):
    async def scenario():
        async with await _client(server) as client:
            async with client.session(PROMPT, group_key="k", group_size=1) as quiet:
                await quiet.generate(2)
            with pytest.raises(ValueError, match="agent bug"):
                async with client.session(PROMPT, group_key="k", group_size=1) as failing:
                    raise ValueError("agent bug")
            return quiet, failing

    quiet, failing = run(scenario())
    closes = server.servicer.calls_of("CloseSession")
    assert [(c.request.session_id, c.request.abandon) for c in closes] == [
        (quiet.session_id, True),
        (failing.session_id, True),
    ]
    assert {s.state for s in server.servicer.sessions.values()} == {agent_pb2.SESSION_STATE_ABANDONED}


def test_failed_precondition_on_a_first_attempt_is_raised_not_resynced(server):
    async def scenario():
        async with await _client(server) as client:
            async with client.session(PROMPT, group_key="k", group_size=1) as s:
                record = server.servicer.sessions[s.session_id]
                record.turns.append(agent_pb2.Turn(generated=False, token_ids=[9]))  # another writer
                await s.generate(2)

    with pytest.raises(FailedPrecondition) as info:
        run(scenario())
    assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION and "expected_length 4" in info.value.details
    assert not server.servicer.calls_of("GetSession")


def test_invalid_argument_names_the_field(server):
    async def scenario():
        async with await _client(server) as client:
            async with client.session(PROMPT, group_key="k", group_size=1) as s:
                await s.generate(0)

    with pytest.raises(InvalidArgument) as info:
        run(scenario())
    assert info.value.field == "max_tokens"


def test_stream_recovers_the_rest_of_a_turn_recorded_before_the_stream_broke(server):
    server.servicer.inject("Generate", Fault.LOST_REPLY)

    async def scenario():
        async with await _client(server) as client:
            async with client.session(PROMPT, group_key="k", group_size=1) as s:
                chunks = [chunk async for chunk in s.stream(6)]
                return s, chunks

    s, chunks = run(scenario())
    assert [c.token_ids for c in chunks] == [[10, 11], [12, 6, 14, 15]] and chunks[-1].finished
    assert chunks[-1].turn.token_ids == [10, 11, 12, 6, 14, 15] and s.length == 10
    assert len(server.servicer.calls_of("Generate")) == 1  # recovered from the record, not generated again


def test_sync_client_waits_admission_recovers_lost_replies_and_abandons_on_exit(server):
    server.servicer.inject("Generate", Fault.LOST_REPLY)
    server.servicer.inject("OpenSession", Exhausted(30), Fault.LOST_REPLY)
    with AgentClient(server.address, TOKEN, timeout_s=10.0, retry=FAST) as client:
        with client.session(PROMPT, group_key="k", group_size=1) as s:
            turn = s.generate(6)
            s.append([40])
            after = s.generate(2)
    record = server.servicer.sessions[s.session_id]
    assert len(server.servicer.sessions) == 1 and len(record.turns) == 3
    assert turn.recovered and turn.token_ids == [10, 11, 12, 6, 14, 15] and after.turn_index == 2
    assert s.token_ids == record.token_ids() and record.state == agent_pb2.SESSION_STATE_ABANDONED
    assert {call.metadata["authorization"] for call in server.servicer.calls} == {f"Bearer {TOKEN}"}
    opens = server.servicer.calls_of("OpenSession")
    assert len(opens) == 3 and len({c.request.open_id for c in opens}) == 1 and opens[1].at_s - opens[0].at_s >= 0.03
