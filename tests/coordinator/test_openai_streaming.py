"""Token-by-token streaming at the OpenAI door: ``stream: true`` chat completions send each token's text as the
engine generates it; refusals before the first token are plain HTTP errors. The official ``openai`` client against
the real door, a real rollout server (vLLM CPU, tiny model) and real Redis.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.openai_stream import TextDeltas
from tests.coordinator import test_openai_door
from tests.coordinator.test_openai_door import USER, DoorHarness
from tests.coordinator.test_openai_responses import door_with_client

pytestmark = pytest.mark.integration

shared_tokenizer = test_openai_door.tokenizer  # the fixture "tokenizer" of that module, here too


def test_a_streamed_chat_sends_one_content_delta_per_token_and_the_recorded_turn_at_its_end(
    rollout_server, redis_url, shared_tokenizer
):
    async def scenario():
        async with door_with_client(rollout_server, redis_url, shared_tokenizer) as (h, client):
            stream = await client.chat.completions.create(
                model="m",
                messages=[USER],
                max_tokens=12,
                stream=True,
                logprobs=True,
                stream_options={"include_usage": True},
                extra_headers={"X-Fleetrl-Group-Key": "tokens"},
            )
            chunks = [chunk async for chunk in stream]
            [session] = h.book.sessions.values()
            turn = session.turns[0]
            plain = await client.chat.completions.create(
                model="m", messages=[USER], max_tokens=12, extra_headers={"X-Fleetrl-Session": session.session_id}
            )  # the same request again: the recorded turn, answered plainly
            deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
            assert "".join(deltas) == plain.choices[0].message.content
            content_ids = [t for t in turn.token_ids if t not in shared_tokenizer.all_special_ids]
            assert len(deltas) == len(content_ids)  # the tiny vocabulary's tokens are one character each
            logprobs = [
                e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
            ]
            assert logprobs == turn.logprobs  # every token's, the end of turn included
            [finish] = [c for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finish.model_extra["fleetrl"]["token_ids"] == turn.token_ids
            assert chunks[-1].usage.completion_tokens == len(turn.token_ids)

    asyncio.run(scenario())


def test_a_refusal_before_the_first_token_is_a_plain_http_error_not_a_stream(
    rollout_server, redis_url, shared_tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, shared_tokenizer) as h:
            status, reply, headers = await h.chat([USER])
            assert status == 200, reply
            sid = headers["X-Fleetrl-Session"]
            messages = [USER, reply["choices"][0]["message"], USER]
            status, error, _ = await h.chat(messages, session=sid, temperature=0.5, stream=True)
            assert status == 400 and error["error"]["param"] == "temperature", error
            status, error, _ = await h.post(
                "/responses", {"input": "1", "stream": True}, **{"X-Fleetrl-Session": "nope"}
            )
            assert status == 404 and error["error"]["param"] == "session_id", error

    asyncio.run(scenario())


def test_text_is_held_back_at_a_final_special_token_and_at_whitespace_a_tool_call_would_strip(shared_tokenizer):
    def ids(text: str) -> list[int]:
        return shared_tokenizer.encode(text, add_special_tokens=False)

    deltas = TextDeltas(shared_tokenizer, hold_tool_calls=True)
    assert deltas.push(ids("31")) == "31"
    assert deltas.push([shared_tokenizer.eos_token_id]) == ""  # maybe the end of turn
    assert deltas.push(ids(" ")) == "<eos>"  # not the end after all; the space is held (stripped before a call)
    assert deltas.push(ids("3")) == " 3"
    assert deltas.finish("31<eos> 3") == ""
    leading = TextDeltas(shared_tokenizer, hold_tool_calls=True)
    assert leading.push(ids(" 3")) == ""  # a turn that starts with whitespace: stripped only if it holds a call
    assert leading.finish(" 3") == " 3"
    plain = TextDeltas(shared_tokenizer, hold_tool_calls=False)
    assert (
        plain.push(ids(" 3")) == " 3" and plain.push([shared_tokenizer.eos_token_id]) == "" and plain.finish(" 3") == ""
    )
