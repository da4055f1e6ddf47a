"""A stream that fails after its first token ends with an error event (chat: an error chunk; Responses: ``error``
then ``response.failed``), never a silently cut stream, and the session keeps every turn it recorded before.

The failures really happen: the rollout server is a stand-in (``rollout_service/standin_fleet.py``: the real
gRPC server over the synthetic engine, 20 tokens/s and no EOS, so a turn is still generating when it fails) that
the test kills with SIGKILL mid-turn, or whose Generate call runs past the coordinator's ``request_timeout_s``.
The door, the agent core and Redis are the real ones, and the client is the official ``openai`` package.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import numpy as np
import openai
import pytest

from rollout_service import standin_fleet
from tests.coordinator.agents import test_openai_door
from tests.coordinator.agents.test_openai_agent_surface import sdk
from tests.coordinator.agents.test_openai_door import USER, DoorHarness

pytestmark = pytest.mark.integration

shared_tokenizer = test_openai_door.tokenizer  # the fixture "tokenizer" of that module, here too


@contextlib.contextmanager
def spawned_standin(log_path: Path, *overrides: str):
    """One stand-in rollout server process, serving (killed after if it still runs)."""
    spawned = standin_fleet.spawn(1, log_path, "--grace-s", "0", *overrides)
    try:
        spawned.wait_serving(timeout_s=120)
        yield spawned
    finally:
        if spawned.process.poll() is None:
            spawned.process.kill()
        spawned.process.wait()


@pytest.fixture
def standin(tmp_path):
    with spawned_standin(tmp_path / "standin.log", "rollout.synthetic.tokens_per_s=20") as spawned:
        yield spawned


async def _stored_turns(h: DoorHarness, session_id: str) -> list[tuple[bool, list[int]]]:
    """``(generated, token ids)`` of each turn of ``session_id`` as Redis holds it."""
    stored = await h.store.load()
    [session] = [s for s in stored.sessions if s.record.session_id == session_id]
    return [(t.generated, np.frombuffer(t.token_ids.data, t.token_ids.dtype).tolist()) for t in session.turns]


def test_a_chat_stream_whose_server_is_killed_mid_turn_ends_with_an_error_chunk_and_keeps_the_recorded_turns(
    standin, redis_url, shared_tokenizer
):
    async def scenario():
        async with DoorHarness(standin.addresses[0], redis_url, shared_tokenizer) as h:
            client = sdk(h)
            first = await client.chat.completions.with_raw_response.create(
                model="m", messages=[USER], max_tokens=3, extra_headers={"X-Fleetrl-Group-Key": "killed"}
            )
            sid = first.headers["X-Fleetrl-Session"]
            session = h.book.sessions[sid]
            answer = {"role": "assistant", "content": first.parse().choices[0].message.content}
            messages = [USER, answer, {"role": "user", "content": "1"}]
            stream = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=200, stream=True, extra_headers={"X-Fleetrl-Session": sid}
            )
            received, killed = [], False
            with pytest.raises(openai.APIError) as failed:
                async for chunk in stream:  # the stream must end with an error, not just stop
                    received.append(chunk)
                    if chunk.choices and chunk.choices[0].delta.content and not killed:
                        standin.process.kill()  # SIGKILL after the turn's first token
                        killed = True
            await client.close()
            assert killed, "the turn failed before its first token"
            assert "turn 2 lost" in failed.value.message and "generate it again" in failed.value.message
            assert failed.value.body["type"] == "service_unavailable"
            assert all(not c.choices or c.choices[0].finish_reason is None for c in received)
            # the lost turn is not recorded; the turns recorded before it are, in the book and in Redis
            recorded = [(t.generated, t.token_ids) for t in session.turns]
            assert [generated for generated, _ in recorded] == [True, False] and not session.busy
            assert recorded[0][1] == first.parse().model_extra["fleetrl"]["token_ids"]
            assert await _stored_turns(h, sid) == recorded

    asyncio.run(scenario())


def test_a_responses_stream_past_its_deadline_ends_with_error_and_response_failed_events(
    standin, redis_url, shared_tokenizer
):
    async def scenario():
        timeout = ("coordinator.request_timeout_s=2.0",)  # 20 tokens/s: 200 tokens take 10 s
        async with DoorHarness(standin.addresses[0], redis_url, shared_tokenizer, overrides=timeout) as h:
            client = sdk(h)
            stream = await client.responses.create(
                model="m", input="314", max_output_tokens=200, stream=True, extra_headers={"X-Fleetrl-Group-Key": "d"}
            )
            events = [event async for event in stream]
            await client.close()
            kinds = [e.type for e in events]
            assert kinds[:2] == ["response.created", "response.in_progress"], kinds
            assert "response.output_text.delta" in kinds, kinds  # it failed after its first token
            assert kinds[-2:] == ["error", "response.failed"], kinds
            assert [e.sequence_number for e in events] == list(range(len(events)))
            error, failed = events[-2], events[-1].response
            assert "DEADLINE_EXCEEDED" in error.message and "generate it again" in error.message
            assert failed.status == "failed" and failed.id == events[0].response.id
            assert failed.error.code == "server_error" and failed.error.message == error.message
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert failed.output_text == deltas  # what was streamed, as an incomplete message
            [session] = h.book.sessions.values()
            assert session.turns == [] and not session.busy and await _stored_turns(h, session.session_id) == []

    asyncio.run(scenario())
