"""What agent frameworks send the OpenAI door beyond one plain chat: ``n`` samples as one group's sessions, tools
and tool messages through the chat template, and the door's port kept for the run across restarts. The official
``openai`` client against the real door, a real rollout server (vLLM CPU, tiny model) and real Redis.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import openai
import pytest

from coordinator.agents.door_answers import content_token_ids
from coordinator.kept_port import start_openai_door_of_run
from coordinator.tasks import load_tokenizer
from tests.coordinator.agents.test_openai_door import USER, DoorHarness, authorize

pytestmark = pytest.mark.integration

# The tiny tokenizer's characters only: tools, tool calls (their arguments read as an object) and tool results
# are rendered, each assistant message ends with the end-of-turn token.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %}{{ t['function']['name'] }},{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}result:{{ m['content'] }}.{% else %}{{ m['content'] or '' }}"
    "{% endif %}{% for c in m.get('tool_calls') or [] %}call:{{ c['function']['name'] }}"
    "({{ c['function']['arguments']['x'] }}){% endfor %}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    tokenizer.add_tokens(list("ABCDEFGHIJKL"))  # every sampled id reads back as itself (test_openai_door.py)
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def sdk(h: DoorHarness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.base, api_key="secret-a", max_retries=0)


def test_n_samples_open_one_session_each_in_one_group_and_each_choice_continues_its_own(
    rollout_server, redis_url, tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            client = sdk(h)
            try:
                reply = await client.chat.completions.with_raw_response.create(
                    model="m", messages=[USER], n=2, max_tokens=4, extra_headers={"X-Fleetrl-Group-Key": "grp"}
                )
                completion = reply.parse()
                sids = reply.headers["X-Fleetrl-Session"].split(",")
                assert [c.index for c in completion.choices] == [0, 1] and len(set(sids)) == 2
                sessions = [h.book.sessions[sid] for sid in sids]
                assert sessions[0].group is sessions[1].group and h.scheduler.stats.slots_admitted == 1
                for choice, session in zip(completion.choices, sessions, strict=True):
                    assert choice.model_extra["fleetrl"]["session_id"] == session.session_id
                    assert choice.model_extra["fleetrl"]["token_ids"] == session.turns[0].token_ids
                    assert session.prompt == h.render([USER]) and len(session.turns) == 1
                assert completion.model_extra["fleetrl"] == completion.choices[0].model_extra["fleetrl"]
                turns = sum(len(s.turns[0].token_ids) for s in sessions)
                assert completion.usage.completion_tokens == turns
                assert completion.usage.prompt_tokens == len(h.render([USER]))

                for choice, session in zip(completion.choices, sessions, strict=True):
                    messages = [USER, choice.message.model_dump(exclude_none=True), USER]
                    later = await client.chat.completions.create(
                        model="m",
                        messages=messages,
                        max_tokens=4,
                        extra_headers={"X-Fleetrl-Session": session.session_id},
                    )
                    assert later.model_extra["fleetrl"]["session_id"] == session.session_id
                    assert [t.generated for t in session.turns] == [True, False, True]
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="m", messages=messages, n=2, extra_headers={"X-Fleetrl-Session": sids[1]}
                    )
                assert refused.value.body["param"] == "n" and len(sessions[1].turns) == 3
            finally:
                await client.close()
            for k, sid in enumerate(sids):
                status, result, _ = await h.post(f"/fleetrl/sessions/{sid}/submit", {"submission_id": "s", "reward": k})
                assert status == 200, result
            assert result["state"] == "queued"
            [group] = h.queued()  # one GRPO group of the two samples, each trained on its whole session
            trained = sorted(len(sample.response_token_ids.to_numpy()) for sample in group.samples)
            assert trained == sorted(s.length - len(s.prompt) for s in sessions)

    asyncio.run(scenario())


def test_n_above_the_group_size_or_its_room_is_400_naming_n_and_opens_nothing(rollout_server, redis_url, tokenizer):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            client = sdk(h)
            try:
                for n, size in [(3, ""), (3, "2"), (0, "")]:
                    headers = {"X-Fleetrl-Group-Key": "big"} | ({"X-Fleetrl-Group-Size": size} if size else {})
                    with pytest.raises(openai.BadRequestError) as refused:
                        await client.chat.completions.create(model="m", messages=[USER], n=n, extra_headers=headers)
                    assert refused.value.body["param"] == "n", refused.value.body
                assert h.scheduler.stats.slots_admitted == 0 and h.book.sessions == {}
                await client.chat.completions.create(
                    model="m", messages=[USER], max_tokens=2, extra_headers={"X-Fleetrl-Group-Key": "half"}
                )
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="m", messages=[USER], n=2, extra_headers={"X-Fleetrl-Group-Key": "half"}
                    )
                assert refused.value.body["param"] == "n" and "room for 1" in refused.value.body["message"]
                assert len(h.book.sessions) == 1
            finally:
                await client.close()

    asyncio.run(scenario())


def test_n_samples_stream_as_one_choice_index_each_with_its_session(rollout_server, redis_url, tokenizer):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            client = sdk(h)
            try:
                stream = await client.chat.completions.create(
                    model="m",
                    messages=[USER],
                    n=2,
                    max_tokens=4,
                    stream=True,
                    extra_headers={"X-Fleetrl-Group-Key": "streamed"},
                )
                chunks = [chunk async for chunk in stream]
            finally:
                await client.close()
            texts, finished = {0: "", 1: ""}, {}
            for chunk in chunks:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
                    if choice.finish_reason:
                        finished[choice.index] = chunk.model_extra["fleetrl"]["session_id"]
            assert sorted(finished) == [0, 1] and set(finished.values()) == set(h.book.sessions)
            for index, sid in finished.items():
                turn = h.book.sessions[sid].turns[0]
                tokens = content_token_ids(tokenizer, turn)
                assert texts[index] == tokenizer.decode(tokens, skip_special_tokens=False)

    asyncio.run(scenario())


def test_tools_reach_the_template_and_tool_calls_and_tool_results_render_in_later_turns(
    rollout_server, redis_url, tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            client = sdk(h)
            try:
                call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"x": 12}'}}
                history = [
                    USER,
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "27"},
                ]
                reply = await client.chat.completions.with_raw_response.create(
                    model="m", messages=history, tools=TOOLS, max_tokens=4, extra_headers={"X-Fleetrl-Group-Key": "t1"}
                )
                session = h.book.sessions[reply.headers["X-Fleetrl-Session"]]
                prompt = tokenizer.decode(session.prompt, skip_special_tokens=False)
                assert prompt == "<bos>tools:add,314call:add(12)<eos>result:27."  # arguments rendered as an object

                first = await client.chat.completions.create(
                    model="m",
                    messages=[USER],
                    tools=TOOLS,
                    tool_choice="auto",
                    max_tokens=4,
                    extra_headers={"X-Fleetrl-Group-Key": "t2"},
                )
                sid = first.model_extra["fleetrl"]["session_id"]
                answer = first.choices[0].message.model_dump(exclude_none=True)
                result = {"role": "tool", "tool_call_id": "call_1", "content": "27"}
                second = await client.chat.completions.create(
                    model="m",
                    messages=[USER, answer, result],
                    tools=TOOLS,
                    max_tokens=4,
                    extra_headers={"X-Fleetrl-Session": sid},
                )
                turns = h.book.sessions[sid].turns
                assert second.model_extra["fleetrl"]["turn_index"] == 2 and [t.generated for t in turns] == [
                    True,
                    False,
                    True,
                ]
                assert tokenizer.decode(turns[1].token_ids, skip_special_tokens=False).endswith("result:27.")
                bad = dict(call, function={"name": "add", "arguments": "{x"})
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="m",
                        messages=[USER, {"role": "assistant", "tool_calls": [bad]}],
                        extra_headers={"X-Fleetrl-Group-Key": "t3"},
                    )
                assert refused.value.body["param"] == "messages"
                assert "messages[1].tool_calls[0].function.arguments" in refused.value.body["message"]
            finally:
                await client.close()

    asyncio.run(scenario())


def test_a_picked_door_port_is_kept_for_the_run_and_taken_again_after_a_restart(
    rollout_server, redis_url, tokenizer, caplog
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            start = (h.book, tokenizer, authorize, "127.0.0.1", 0, h.redis, h.keys)
            runner, port = await start_openai_door_of_run(*start)
            await runner.cleanup()  # the coordinator stops
            runner, again = await start_openai_door_of_run(*start)  # and its successor starts
            try:
                assert again == port and int(await h.redis.get(h.keys.openai_door_port)) == port
                client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret-a", max_retries=0)
                assert [m.object for m in (await client.models.list()).data] == ["model"]
                await client.close()
            finally:
                await runner.cleanup()

            with socket.socket() as squatter:  # another process took the port meanwhile
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the closed door's TIME_WAIT
                squatter.bind(("127.0.0.1", port))
                squatter.listen()
                with caplog.at_level(logging.WARNING, logger="coordinator.kept_port"):
                    runner, moved = await start_openai_door_of_run(*start)
                await runner.cleanup()
            assert moved != port and int(await h.redis.get(h.keys.openai_door_port)) == moved
            assert f"port {port} on 127.0.0.1 is taken" in caplog.text

            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                configured = probe.getsockname()[1]
            runner, bound = await start_openai_door_of_run(*start[:4], configured, *start[5:])
            await runner.cleanup()
            assert bound == configured and int(await h.redis.get(h.keys.openai_door_port)) == moved  # not kept

    asyncio.run(scenario())
