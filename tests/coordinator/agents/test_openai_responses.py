"""``POST /v1/responses`` at the OpenAI door: the official ``openai`` client's ``responses.create`` against the real
door, a real rollout server (vLLM CPU, tiny model) and real Redis; the same sessions as the chat route.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.coordinator.agents import test_openai_agent_surface
from tests.coordinator.agents.test_openai_agent_surface import TOOLS, sdk
from tests.coordinator.agents.test_openai_door import USER, DoorHarness

pytestmark = pytest.mark.integration

shared_tokenizer = test_openai_agent_surface.tokenizer  # the fixture "tokenizer" of that module, here too


@contextlib.asynccontextmanager
async def door_with_client(server, redis_url: str, tokenizer):
    """A ``DoorHarness`` and the official client on it (closed after)."""
    async with DoorHarness(server.address, redis_url, tokenizer) as h:
        client = sdk(h)
        try:
            yield h, client
        finally:
            await client.close()


RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # the Responses API's flat function tool


def test_a_string_input_opens_a_session_and_its_output_items_sent_back_continue_it(
    rollout_server, redis_url, shared_tokenizer
):
    async def scenario():
        async with door_with_client(rollout_server, redis_url, shared_tokenizer) as (h, client):
            reply = await client.responses.with_raw_response.create(
                model="m", input="314", max_output_tokens=4, extra_headers={"X-Fleetrl-Group-Key": "r1"}
            )
            first = reply.parse()
            session = h.book.sessions[reply.headers["X-Fleetrl-Session"]]
            assert first.object == "response" and first.status in ("completed", "incomplete")
            assert session.prompt == h.render([USER]) and len(session.turns) == 1
            turn = session.turns[0]
            assert first.model_extra["fleetrl"]["token_ids"] == turn.token_ids
            assert first.usage.input_tokens == len(session.prompt)
            assert first.usage.output_tokens == len(turn.token_ids)
            [item] = first.output
            assert item.type == "message" and item.content[0].type == "output_text"
            assert first.output_text == shared_tokenizer.decode(turn.token_ids, skip_special_tokens=False).removesuffix(
                shared_tokenizer.eos_token
            )

            # as agent frameworks do: the earlier input, the output items as they came, the new input
            items = [{"role": "user", "content": "314"}, *[o.model_dump() for o in first.output]]
            items.append({"role": "user", "content": [{"type": "input_text", "text": "1"}]})
            second = await client.responses.create(
                model="m", input=items, max_output_tokens=4, extra_headers={"X-Fleetrl-Session": session.session_id}
            )
            assert second.model_extra["fleetrl"]["turn_index"] == 2
            assert [t.generated for t in session.turns] == [True, False, True]
            again = await client.responses.create(
                model="m", input=items, max_output_tokens=4, extra_headers={"X-Fleetrl-Session": session.session_id}
            )
            assert again.id == second.id and len(session.turns) == 3  # a lost answer asked again

    asyncio.run(scenario())


def test_instructions_tools_function_calls_and_their_outputs_render_through_the_chat_template(
    rollout_server, redis_url, shared_tokenizer
):
    async def scenario():
        async with door_with_client(rollout_server, redis_url, shared_tokenizer) as (h, client):
            items = [
                {"role": "user", "content": "314"},
                {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"x": 12}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "27"},
            ]
            reply = await client.responses.with_raw_response.create(
                model="m",
                instructions="5",
                input=items,
                tools=RESPONSES_TOOLS,
                max_output_tokens=4,
                extra_headers={"X-Fleetrl-Group-Key": "r2"},
            )
            response = reply.parse()
            session = h.book.sessions[reply.headers["X-Fleetrl-Session"]]
            prompt = shared_tokenizer.decode(session.prompt, skip_special_tokens=False)
            assert prompt == "<bos>tools:add,5314call:add(12)<eos>result:27."
            assert [t.name for t in response.tools] == ["add"] and response.instructions == "5"

    asyncio.run(scenario())


def test_malformed_responses_requests_are_400_naming_the_field_and_open_nothing(
    rollout_server, redis_url, shared_tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, shared_tokenizer) as h:
            call = {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{x"}
            cases = [
                ({}, "input", "input"),
                ({"input": []}, "input", "input"),
                ({"input": [{"type": "reasoning", "summary": []}]}, "input", "input[0].type"),
                ({"input": [{"type": "function_call", "name": "add"}]}, "input", "input[0].call_id"),
                ({"input": ["314"]}, "input", "input[0]"),
                ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "input[0].content[0]"),
                ({"input": [{"role": "user", "content": "1"}, call]}, "input", "arguments"),
                ({"input": "1", "tools": [{"type": "web_search"}]}, "tools", "tools[0].type"),
                ({"input": "1", "previous_response_id": "resp_1"}, "previous_response_id", "X-Fleetrl-Session"),
                ({"input": "1", "text": {"format": {"type": "json_object"}}}, "text", "text"),
                ({"input": "1", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
                ({"input": "1", "temperature": "hot"}, "temperature", "temperature"),
                ({"input": "1", "tool_choice": "required"}, "tool_choice", "tool_choice"),
                ({"input": "1", "stream": "yes"}, "stream", "stream"),
                ({"input": "1", "include": "message.output_text.logprobs"}, "include", "include"),
                ({"input": "1", "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
            ]
            for body, param, named in cases:
                status, error, _ = await h.post("/responses", body, **{"X-Fleetrl-Group-Key": "bad"})
                assert status == 400, (body, error)
                assert error["error"]["param"] == param and named in error["error"]["message"], (body, error)
            status, error, _ = await h.post("/responses", b"[1", **{"X-Fleetrl-Group-Key": "bad"})
            assert status == 400 and "JSON" in error["error"]["message"]
            status, error, _ = await h.post("/responses", {"input": "1"}, token=None, **{"X-Fleetrl-Group-Key": "k"})
            assert status == 401
            assert h.scheduler.stats.slots_admitted == 0 and h.book.sessions == {}

            status, reply, headers = await h.post("/responses", {"input": "314"}, **{"X-Fleetrl-Group-Key": "ok"})
            assert status == 200, reply
            altered = [{"role": "user", "content": "9"}, {"role": "user", "content": "1"}]
            status, error, _ = await h.post(
                "/responses", {"input": altered}, **{"X-Fleetrl-Session": headers["X-Fleetrl-Session"]}
            )
            assert status == 400 and error["error"]["param"] == "input", error
            assert error["error"]["message"].startswith("input: the rendered conversation differs"), error

    asyncio.run(scenario())


def test_a_streamed_response_sends_created_text_deltas_and_completed_with_the_recorded_turn(
    rollout_server, redis_url, shared_tokenizer
):
    async def scenario():
        async with door_with_client(rollout_server, redis_url, shared_tokenizer) as (h, client):
            stream = await client.responses.create(
                model="m", input="314", max_output_tokens=6, stream=True, extra_headers={"X-Fleetrl-Group-Key": "s"}
            )
            events = [event async for event in stream]
            kinds = [e.type for e in events]
            assert kinds[:2] == ["response.created", "response.in_progress"], kinds
            assert kinds[-1] in ("response.completed", "response.incomplete")
            assert [e.sequence_number for e in events] == list(range(len(events)))
            final = events[-1].response
            [session] = h.book.sessions.values()
            assert final.model_extra["fleetrl"]["token_ids"] == session.turns[0].token_ids
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            assert "".join(deltas) == final.output_text
            [done] = [e for e in events if e.type == "response.output_text.done"]
            assert done.text == final.output_text and events[0].response.id == final.id

    asyncio.run(scenario())


def test_include_output_text_logprobs_answers_each_generated_tokens_logprob_plain_and_streamed(
    rollout_server, redis_url, shared_tokenizer
):
    async def scenario():
        async with door_with_client(rollout_server, redis_url, shared_tokenizer) as (h, client):
            include = ["message.output_text.logprobs", "reasoning.encrypted_content"]  # the second adds nothing
            reply = await client.responses.with_raw_response.create(
                model="m", input="314", max_output_tokens=6, include=include, extra_headers={"X-Fleetrl-Group-Key": "l"}
            )
            turn = h.book.sessions[reply.headers["X-Fleetrl-Session"]].turns[0]
            [part] = reply.parse().output[0].content
            assert [e.logprob for e in part.logprobs] == turn.logprobs  # every token's, the end of turn included
            assert [e.token for e in part.logprobs] == shared_tokenizer.convert_ids_to_tokens(turn.token_ids)
            assert all(e.bytes == list(e.token.encode()) and e.top_logprobs == [] for e in part.logprobs)

            stream = await client.responses.create(
                model="m",
                input="314",
                max_output_tokens=6,
                include=include,
                stream=True,
                extra_headers={"X-Fleetrl-Group-Key": "l"},  # its group's second member
            )
            events = [event async for event in stream]
            [session] = [s for s in h.book.sessions.values() if s.session_id != reply.headers["X-Fleetrl-Session"]]
            streamed = [
                e.logprob for event in events if event.type == "response.output_text.delta" for e in event.logprobs
            ]
            assert streamed == session.turns[0].logprobs  # each token's once, with the delta that sent its text
            [done] = [event for event in events if event.type == "response.output_text.done"]
            assert [e.logprob for e in done.logprobs] == session.turns[0].logprobs

    asyncio.run(scenario())
