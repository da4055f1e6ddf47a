"""The agent API over real gRPC against a real rollout server (vLLM CPU, tiny model) and a real Redis queue.

One rollout server process is shared by the module; each test gets its own SessionBook, scheduler and agent
server in this process, writing trajectory groups to the test's Redis (flushed per test).
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from coordinator.agents.api import agent_authenticator, start_agent_server
from modeling.tiny_model import BOS_ID, DIGIT_IDS
from protos import agent_pb2 as pb
from protos import agent_pb2_grpc as pb_grpc
from protos.redis_keys import RedisKeys
from tests.coordinator.agents.agent_core import BookHarness

pytestmark = pytest.mark.integration

KEYS = RedisKeys("agent-api")
TOKENS = {"team-a": ("secret-a", ["generate", "submit"]), "team-b": ("secret-b", ["generate", "submit"])}
GENERATE_ONLY = ("secret-gen", ["generate"])
PROMPT = [BOS_ID, DIGIT_IDS[3], DIGIT_IDS[1], DIGIT_IDS[4]]


@pytest.fixture
def tokens_file(tmp_path) -> Path:
    grants = [
        {"name": name, "token_sha256": hashlib.sha256(token.encode()).hexdigest(), "scopes": scopes, "rate_per_s": 500}
        for name, (token, scopes) in {**TOKENS, "gen-only": GENERATE_ONLY}.items()
    ]
    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": grants}))
    return path


class AgentHarness(BookHarness):
    """The agent core + its gRPC server in this process, against the module's rollout server."""

    def __init__(self, address: str, redis_url: str, tokens_file: Path, overrides: tuple[str, ...]):
        super().__init__(
            address, redis_url, KEYS, ("agent.enabled=true", f"agent.tokens_file={tokens_file}", *overrides)
        )

    async def __aenter__(self) -> AgentHarness:
        await super().__aenter__()
        auth = agent_authenticator(self.config.agent)
        self.server, self.server_port = await start_agent_server(self.book, auth, self.config.agent)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.server_port}")
        self.stub = pb_grpc.AgentServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(grace=0)
        await super().__aexit__(*exc)


def auth(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


A, B = auth(TOKENS["team-a"][0]), auth(TOKENS["team-b"][0])


def harness(rollout_server, redis_url, tokens_file, *overrides) -> AgentHarness:
    return AgentHarness(rollout_server.address, redis_url, tokens_file, overrides)


async def open_session(stub, key: str = "task-1", metadata=A, prompt=PROMPT) -> pb.OpenSessionResponse:
    request = pb.OpenSessionRequest(prompt_token_ids=prompt, group_key=key, group_size=2)
    return await stub.OpenSession(request, metadata=metadata)


async def turn(stub, session_id: str, max_tokens: int = 6, metadata=A, expected_length: int = 0) -> list:
    request = pb.GenerateRequest(session_id=session_id, max_tokens=max_tokens, expected_length=expected_length)
    return [chunk async for chunk in stub.Generate(request, metadata=metadata)]


async def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return error.value.code(), error.value.details()


def test_two_sessions_with_a_tool_turn_become_one_group_with_the_recorded_tokens_and_mask(
    rollout_server, redis_url, tokens_file
):
    async def scenario():
        async with harness(rollout_server, redis_url, tokens_file) as h:
            held = []
            for k in range(2):
                session = await open_session(h.stub)
                first = await turn(h.stub, session.session_id)
                tool = [DIGIT_IDS[k], DIGIT_IDS[k + 1]]
                length = first[-1].session_length
                appended = await h.stub.Append(
                    pb.AppendRequest(session_id=session.session_id, token_ids=tool, expected_length=length), metadata=A
                )
                second = await turn(h.stub, session.session_id, expected_length=appended.session_length)
                held.append((session, first, tool, second))
                reply = await h.stub.Submit(
                    pb.SubmitRequest(session_id=session.session_id, submission_id=f"s{k}", reward=float(k)),
                    metadata=A,
                )
                assert reply.sessions_submitted == k + 1
            assert reply.group_state == pb.GROUP_STATE_QUEUED
            [group] = h.queued()
            assert group.group_id == reply.group_id and list(group.prompt_token_ids.to_numpy()) == PROMPT
            for sample, (_, first, tool, second) in zip(group.samples, held, strict=True):
                gen1 = [t for c in first for t in c.token_ids]
                gen2 = [t for c in second for t in c.token_ids]
                assert list(sample.response_token_ids.to_numpy()) == gen1 + tool + gen2
                assert list(sample.loss_mask.to_numpy()) == [1] * len(gen1) + [0, 0] + [1] * len(gen2)
                logprobs = sample.rollout_logprobs.to_numpy()
                assert np.allclose(logprobs[: len(gen1)], [lp for c in first for lp in c.logprobs])
                assert np.all(logprobs[len(gen1) : len(gen1) + 2] == 0)
                spans = [(s.version, s.start, s.end) for s in sample.version_spans]
                assert spans == [(0, 0, len(gen1)), (0, len(gen1) + 2, len(gen1) + 2 + len(gen2))]
            assert [s.reward for s in group.samples] == [0.0, 1.0]

    asyncio.run(scenario())


def test_a_replayed_submission_is_queued_once_and_a_forged_one_is_refused(rollout_server, redis_url, tokens_file):
    async def scenario():
        async with harness(rollout_server, redis_url, tokens_file) as h:
            sessions = [await open_session(h.stub) for _ in range(2)]
            for session in sessions:
                await turn(h.stub, session.session_id)
            info = await h.stub.GetSession(pb.GetSessionRequest(session_id=sessions[0].session_id), metadata=A)
            held = list(info.prompt_token_ids) + [t for turn_ in info.turns for t in turn_.token_ids]
            forged = held[:-1] + [(held[-1] + 1) % 10 + DIGIT_IDS[0]]
            code, details = await code_of(
                h.stub.Submit(
                    pb.SubmitRequest(
                        session_id=sessions[0].session_id, submission_id="x", reward=1.0, expected_token_ids=forged
                    ),
                    metadata=A,
                )
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "expected_token_ids" in details
            for session in sessions:
                request = pb.SubmitRequest(session_id=session.session_id, submission_id="once", reward=0.5)
                first = await h.stub.Submit(request, metadata=A)
                again = await h.stub.Submit(request, metadata=A)  # a retry after a lost reply
                assert again == first
            assert len(h.queued()) == 1

    asyncio.run(scenario())


def test_wrong_missing_and_under_scoped_tokens_are_refused_and_write_nothing(rollout_server, redis_url, tokens_file):
    async def scenario():
        async with harness(rollout_server, redis_url, tokens_file) as h:
            request = pb.OpenSessionRequest(prompt_token_ids=PROMPT, group_key="k", group_size=2)
            code, _ = await code_of(h.stub.OpenSession(request, metadata=auth("not-a-token")))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            code, _ = await code_of(h.stub.OpenSession(request))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            session = await open_session(h.stub, metadata=auth(GENERATE_ONLY[0]))
            await turn(h.stub, session.session_id, metadata=auth(GENERATE_ONLY[0]))
            submit = pb.SubmitRequest(session_id=session.session_id, submission_id="s", reward=1.0)
            code, details = await code_of(h.stub.Submit(submit, metadata=auth(GENERATE_ONLY[0])))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "submit" in details
            code, _ = await code_of(turn(h.stub, session.session_id, metadata=B))  # another team's session
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert h.queued() == [] and h.scheduler.stats.slots_admitted == 1

    asyncio.run(scenario())


def test_admission_refuses_a_group_beyond_the_staleness_budget_with_a_retry_delay(
    rollout_server, redis_url, tokens_file
):
    async def scenario():
        async with harness(rollout_server, redis_url, tokens_file, "max_staleness=0") as h:
            await open_session(h.stub, key="first")  # on-policy, 1 group per step: one slot at v0
            await open_session(h.stub, key="first")  # the same group: no new slot
            call = h.stub.OpenSession(
                pb.OpenSessionRequest(prompt_token_ids=PROMPT, group_key="second", group_size=2), metadata=A
            )
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(error.value.trailing_metadata())["retry-after-ms"] == "500"
            assert h.scheduler.stats.slots_admitted == 1

    asyncio.run(scenario())


def test_bad_requests_name_their_field_and_the_server_keeps_serving(rollout_server, redis_url, tokens_file):
    async def scenario():
        async with harness(rollout_server, redis_url, tokens_file) as h:
            session = await open_session(h.stub)
            cases = [
                (h.stub.OpenSession(pb.OpenSessionRequest(group_key="k", group_size=2), metadata=A), "prompt_token_ids"),
                (h.stub.OpenSession(pb.OpenSessionRequest(prompt_token_ids=[10**6], group_key="k"), metadata=A), "token id"),
                (h.stub.OpenSession(pb.OpenSessionRequest(prompt_token_ids=PROMPT, group_key="k", group_size=3), metadata=A), "group_size"),
                (h.stub.Append(pb.AppendRequest(session_id=session.session_id, token_ids=[]), metadata=A), "token_ids"),
                (h.stub.Append(pb.AppendRequest(session_id=session.session_id, token_ids=[DIGIT_IDS[0]] * 10**4), metadata=A), "max_model_len"),
                (h.stub.Submit(pb.SubmitRequest(session_id="nope", submission_id="s", reward=1.0), metadata=A), "session_id"),
                (turn(h.stub, session.session_id, max_tokens=0), "max_tokens"),
                (turn(h.stub, session.session_id, expected_length=99), "expected_length"),
            ]  # fmt: skip
            for call, field in cases:
                code, details = await code_of(call)
                assert code in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ), (field, code)
                assert field in details, (field, details)
            assert len(await turn(h.stub, session.session_id)) >= 1  # still serving, the session intact

    asyncio.run(scenario())


def test_an_abandoned_group_frees_its_slot_for_the_next_group_and_nothing_reaches_the_queue(
    rollout_server, redis_url, tokens_file
):
    async def scenario():
        async with harness(rollout_server, redis_url, tokens_file, "max_staleness=0") as h:
            session = await open_session(h.stub, key="dies")
            await turn(h.stub, session.session_id)
            await h.stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id, abandon=True), metadata=A)
            await open_session(h.stub, key="next")  # admitted into the released slot
            assert h.scheduler.stats.slots_admitted == 1 and h.scheduler.stats.agent_groups_dropped == 1
            assert h.queued() == []

    asyncio.run(scenario())


def test_get_session_gives_each_generated_turn_its_version_spans_and_the_last_one_its_routes(
    rollout_server, redis_url, tokens_file
):
    from coordinator.agents.api import _turn_message
    from coordinator.agents.groups import Turn
    from protos.records import FinishReason

    async def scenario():
        async with harness(rollout_server, redis_url, tokens_file) as h:
            session = await open_session(h.stub)
            first = await turn(h.stub, session.session_id)
            request = pb.AppendRequest(session_id=session.session_id, token_ids=[DIGIT_IDS[1]])
            await h.stub.Append(request, metadata=A)
            second = await turn(h.stub, session.session_id)
            info = await h.stub.GetSession(pb.GetSessionRequest(session_id=session.session_id), metadata=A)
            spans = [list(t.version_spans) for t in info.turns]
            assert spans == [list(first[-1].version_spans), [], list(second[-1].version_spans)] and spans[0]

    asyncio.run(scenario())
    routes = np.arange(24, dtype=np.int32).reshape(6, 2, 2)  # vLLM on CPU returns none: the message from a record
    message = _turn_message(Turn(True, [5, 6], [-0.5, -0.25], FinishReason.STOP, [(3, 0, 2)], routes, "r0"))
    assert [(s.version, s.start, s.end) for s in message.version_spans] == [(3, 0, 2)]
    assert list(message.routed_experts.shape) == [6, 2, 2] and message.routed_experts.data == routes.tobytes()
    assert not _turn_message(Turn(False, [7], [0.0])).HasField("routed_experts")


def test_the_sdk_opens_a_task_session_by_id_and_the_run_scores_it(rollout_server, redis_url, tokens_file):
    from coordinator.tasks import EchoTask
    from fleetrl.agent import AsyncAgentClient, GroupState
    from fleetrl.agent import InvalidArgument as SdkInvalidArgument

    async def scenario():
        async with harness(rollout_server, redis_url, tokens_file) as h:
            address = f"127.0.0.1:{h.server_port}"
            async with AsyncAgentClient(address, TOKENS["team-a"][0]) as client:
                sessions = [await client.open_session(task_id="echo-9", group_size=2) for _ in range(2)]
                task_prompt = EchoTask().prompt_by_id("echo-9")
                assert all(s.prompt_token_ids == task_prompt.prompt_token_ids for s in sessions)
                assert sessions[0].group_key == "echo-9"
                turns = [await s.generate(8) for s in sessions]
                await sessions[0].submit()  # no reward: the run's echo reward of its last turn
                assert (await sessions[1].submit(reward=0.5)).group_state is GroupState.QUEUED
                with pytest.raises(SdkInvalidArgument) as refused:
                    await client.open_session(task_id="echo-x", group_size=2)
                assert refused.value.field == "task_id"
            [group] = h.queued()
            assert [s.reward for s in group.samples] == [EchoTask().reward(task_prompt, turns[0].token_ids), 0.5]

    asyncio.run(scenario())


def test_generate_with_top_logprobs_streams_and_records_the_engines_top_k_per_token(
    rollout_server, redis_url, tokens_file
):
    from fleetrl.agent import AsyncAgentClient
    from fleetrl.agent import InvalidArgument as SdkInvalidArgument

    k = 3

    async def scenario():
        async with harness(rollout_server, redis_url, tokens_file) as h:
            session = await open_session(h.stub)
            request = pb.GenerateRequest(session_id=session.session_id, max_tokens=8, stream_interval=1, top_logprobs=k)
            chunks = [chunk async for chunk in h.stub.Generate(request, metadata=A)]
            assert all(len(c.top_token_ids) == len(c.top_logprobs) == k * len(c.token_ids) for c in chunks)
            tokens = [t for c in chunks for t in c.token_ids]
            sampled = [lp for c in chunks for lp in c.logprobs]
            top_ids = np.array([i for c in chunks for i in c.top_token_ids]).reshape(-1, k)
            top_lps = np.array([lp for c in chunks for lp in c.top_logprobs], dtype=np.float32).reshape(-1, k)
            for token, logprob, ids, lps in zip(tokens, sampled, top_ids.tolist(), top_lps.tolist(), strict=True):
                assert lps == sorted(lps, reverse=True) and logprob <= lps[0] + 1e-5  # vLLM's rank order
                if token in ids:  # the same number, from the same distribution
                    assert logprob == pytest.approx(lps[ids.index(token)], abs=1e-5)

            turn = h.book.sessions[session.session_id].turns[0]  # recorded as the door records it
            assert turn.top_token_ids.tolist() == top_ids.tolist() and turn.top_logprobs.tolist() == top_lps.tolist()
            stored = {s.record.session_id: s for s in (await h.book.records.store.load()).sessions}
            record = stored[session.session_id].turns[0]
            assert record.top_token_ids.to_numpy().tolist() == top_ids.tolist()
            info = await h.stub.GetSession(pb.GetSessionRequest(session_id=session.session_id), metadata=A)
            assert list(info.turns[0].top_token_ids) == top_ids.ravel().tolist()
            assert np.array(info.turns[0].top_logprobs, dtype=np.float32).tolist() == top_lps.ravel().tolist()

            plain = await turn_chunks_of(h.stub, session.session_id, top_logprobs=0)
            assert all(not c.top_token_ids and not c.top_logprobs for c in plain)  # k = 0 sends nothing extra
            length = plain[-1].session_length
            code, details = await code_of(turn_chunks_of(h.stub, session.session_id, top_logprobs=21))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in details, details
            info = await h.stub.GetSession(pb.GetSessionRequest(session_id=session.session_id), metadata=A)
            assert info.session_length == length  # the refused call generated nothing

            async with AsyncAgentClient(f"127.0.0.1:{h.server_port}", TOKENS["team-a"][0]) as client:
                sdk_session = await client.open_session(PROMPT, group_key="task-1", group_size=2)
                generated = await sdk_session.generate(8, top_logprobs=k)
                recorded = h.book.sessions[sdk_session.session_id].turns[0]
                assert generated.top_token_ids.shape == (len(generated.token_ids), k)
                assert generated.top_token_ids.tolist() == recorded.top_token_ids.tolist()
                assert generated.top_logprobs.tolist() == recorded.top_logprobs.tolist()
                streamed = [c async for c in sdk_session.stream(4, top_logprobs=k)]
                assert np.concatenate([c.top_token_ids for c in streamed]).tolist() == (
                    streamed[-1].turn.top_token_ids.tolist()
                )
                with pytest.raises(SdkInvalidArgument) as refused:
                    await sdk_session.generate(4, top_logprobs=21)
                assert refused.value.field == "top_logprobs"

    asyncio.run(scenario())


async def turn_chunks_of(stub, session_id: str, top_logprobs: int) -> list:
    request = pb.GenerateRequest(session_id=session_id, max_tokens=4, top_logprobs=top_logprobs)
    return [chunk async for chunk in stub.Generate(request, metadata=A)]
