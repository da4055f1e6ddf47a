"""The OpenAI-compatible door over real HTTP against a real rollout server (vLLM CPU, tiny model) and real Redis.

One rollout server process is shared by the module; each test gets its own SessionBook, scheduler and door in
this process, writing trajectory groups to the test's Redis (flushed per test).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from coordinator.agents.door import MAX_BODY_BYTES, DoorRefused, start_openai_door
from coordinator.agents.door_answers import content_token_ids
from coordinator.tasks import load_tokenizer
from protos.redis_keys import RedisKeys
from tests.coordinator.agents.agent_core import BookHarness

pytestmark = pytest.mark.integration

KEYS = RedisKeys("openai-door")
GRANTS = {"secret-a": ("team-a", {"generate", "submit"}), "secret-gen": ("gen-only", {"generate"})}
# As real chat templates do, an assistant message ends with the end-of-turn token the model stops on.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)
USER = {"role": "user", "content": "314"}


def authorize(token: str | None, scope: str) -> str:
    if token is None:
        raise DoorRefused(401, "Authorization: a bearer token is required")
    if token not in GRANTS:
        raise DoorRefused(401, "Authorization: unknown token")
    name, scopes = GRANTS[token]
    if scope not in scopes:
        raise DoorRefused(403, f"token {name!r} lacks the {scope!r} scope")
    return name


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    # The char tokenizer names 52 of the model's 64 ids; the other 12 get characters so that every sampled token
    # reads back as itself, as a real model's tokenizer covers its vocabulary.
    tokenizer.add_tokens(list("ABCDEFGHIJKL"))
    assert len(tokenizer) == 64
    tokenizer.chat_template = TEMPLATE
    return tokenizer


class DoorHarness(BookHarness):
    """The agent core + the door in this process, against the module's rollout server."""

    def __init__(self, address: str, redis_url: str, tokenizer, max_body_bytes: int = MAX_BODY_BYTES, overrides=()):
        super().__init__(address, redis_url, KEYS, overrides)
        self.tokenizer, self.max_body_bytes = tokenizer, max_body_bytes

    async def __aenter__(self) -> DoorHarness:
        await super().__aenter__()
        self.runner, port = await start_openai_door(
            self.book, self.tokenizer, authorize, "127.0.0.1", 0, self.max_body_bytes
        )
        self.port = port
        self.base = f"http://127.0.0.1:{port}/v1"
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()
        await self.runner.cleanup()
        await super().__aexit__(*exc)

    async def post(self, path: str, body, token: str | None = "secret-a", **headers) -> tuple[int, dict, dict]:
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = body if isinstance(body, bytes) else None
        payload = None if isinstance(body, bytes) else body
        async with self.http.post(self.base + path, json=payload, data=data, headers=headers) as reply:
            return reply.status, await reply.json(), dict(reply.headers)

    async def open_group(self, key: str, size: int) -> list[str]:
        """The session ids of ``size`` chats opened as the members of group ``key`` (each answered 200)."""
        sids = []
        for _ in range(size):
            status, reply, headers = await self.chat([USER], key=key, size=str(size))
            assert status == 200, reply
            sids.append(headers["X-Fleetrl-Session"])
        return sids

    async def chat(self, messages, session="", key="task-1", size="", **fields) -> tuple[int, dict, dict]:
        headers = {"X-Fleetrl-Session": session} if session else {"X-Fleetrl-Group-Key": key}
        if size:
            headers["X-Fleetrl-Group-Size"] = size
        body = {"model": "tiny", "messages": messages, "max_tokens": 6, **fields}
        return await self.post("/chat/completions", body, **headers)

    def render(self, messages) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_two_chat_turns_continue_one_session_whose_record_is_prompt_generated_appended_generated(
    rollout_server, redis_url, tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            status, first, headers = await h.chat([USER], logprobs=True)
            assert status == 200, first
            sid = headers["X-Fleetrl-Session"]
            assert first["object"] == "chat.completion" and first["fleetrl"]["session_id"] == sid
            gen1 = first["fleetrl"]["token_ids"]
            assert 1 <= len(gen1) <= 6 and len(first["fleetrl"]["logprobs"]) == len(gen1)
            assert first["choices"][0]["message"]["role"] == "assistant"
            assert first["choices"][0]["finish_reason"] in ("stop", "length")
            assert len(first["choices"][0]["logprobs"]["content"]) == len(gen1)
            answer = first["choices"][0]["message"]
            messages = [USER, {"role": "assistant", "content": answer["content"]}, {"role": "tool", "content": "27"}]
            status, second, headers = await h.chat(messages, session=sid)
            assert status == 200, second
            assert headers["X-Fleetrl-Session"] == sid and second["fleetrl"]["turn_index"] == 2
            gen2 = second["fleetrl"]["token_ids"]
            prompt, rendered = h.render([USER]), h.render(messages)
            assert rendered[: len(prompt) + len(gen1)] == prompt + gen1  # the record is a prefix of the rendering
            session = h.book.sessions[sid]
            assert session.tokens() == rendered + gen2
            appended = rendered[len(prompt) + len(gen1) :]
            turns = [(t.generated, t.token_ids) for t in session.turns]
            assert turns == [(True, gen1), (False, appended), (True, gen2)]
            assert session.turns[2].logprobs == second["fleetrl"]["logprobs"]
            assert second["usage"]["prompt_tokens"] == len(rendered)

            # The same request again (its answer lost): the recorded turn comes back, nothing is generated.
            status, again, _ = await h.chat(messages, session=sid)
            assert status == 200 and again["fleetrl"] == second["fleetrl"] and len(session.turns) == 3

            altered = dict(messages[1], content=("x" if answer["content"][:1] != "x" else "y") + answer["content"][1:])
            status, error, _ = await h.chat([USER, altered, messages[2]], session=sid)
            assert status == 400 and error["error"]["param"] == "messages"
            assert f"position {len(prompt)}" in error["error"]["message"], error
            assert session.tokens() == rendered + gen2  # nothing recorded by the refused call

    asyncio.run(scenario())


def test_two_sessions_of_a_group_submitted_through_the_door_queue_one_trajectory_group(
    rollout_server, redis_url, tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            sids = await h.open_group("g1", 2)
            for k, sid in enumerate(sids):
                status, reply, _ = await h.post(
                    f"/fleetrl/sessions/{sid}/submit", {"submission_id": f"s{k}", "reward": float(k)}
                )
                assert status == 200 and reply["sessions_submitted"] == k + 1, reply
            assert reply["state"] == "queued"
            [group] = h.queued()
            assert group.group_id == reply["group_id"] and list(group.prompt_token_ids.to_numpy()) == h.render([USER])
            assert [s.reward for s in group.samples] == [0.0, 1.0]
            status, error, _ = await h.post(f"/fleetrl/sessions/{sids[0]}/abandon", {})
            assert status == 409 and "submitted" in error["error"]["message"]

    asyncio.run(scenario())


def test_a_missing_token_is_401_a_generate_only_token_cannot_submit_and_nothing_is_written(
    rollout_server, redis_url, tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            body = {"messages": [USER], "max_tokens": 4}
            status, error, _ = await h.post("/chat/completions", body, token=None, **{"X-Fleetrl-Group-Key": "k"})
            assert status == 401 and error["error"]["type"] == "authentication_error"
            status, error, _ = await h.post("/chat/completions", body, token="nope", **{"X-Fleetrl-Group-Key": "k"})
            assert status == 401
            status, reply, headers = await h.post(
                "/chat/completions", body, token="secret-gen", **{"X-Fleetrl-Group-Key": "k"}
            )
            assert status == 200, reply
            sid = headers["X-Fleetrl-Session"]
            submit = {"submission_id": "s", "reward": 1.0}
            status, error, _ = await h.post(f"/fleetrl/sessions/{sid}/submit", submit, token="secret-gen")
            assert status == 403 and "submit" in error["error"]["message"]
            status, error, _ = await h.post(f"/fleetrl/sessions/{sid}/submit", submit)  # another grant's session
            assert status == 403 and error["error"]["type"] == "permission_error"
            assert h.queued() == [] and h.scheduler.stats.slots_admitted == 1

    asyncio.run(scenario())


def test_malformed_json_and_sampling_changes_are_400_naming_the_field_and_the_door_keeps_answering(
    rollout_server, redis_url, tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            status, error, _ = await h.post("/chat/completions", b"{not json", **{"X-Fleetrl-Group-Key": "k"})
            assert status == 400 and "JSON" in error["error"]["message"]
            for field, value in [("top_p", 0.9), ("n", 3), ("logit_bias", {"5": 3}), ("stream", "yes")]:
                status, error, _ = await h.chat([USER], **{field: value})
                assert status == 400 and error["error"]["param"] == field, (field, error)
            status, error, _ = await h.chat([USER], stop=["12"])
            assert status == 400 and error["error"]["param"] == "stop"
            status, error, _ = await h.post("/chat/completions", {"messages": [USER]})
            assert status == 400 and "X-Fleetrl-Group-Key" in error["error"]["message"]
            status, error, _ = await h.post("/fleetrl/sessions/nope/submit", {"submission_id": "s", "reward": 1})
            assert status == 404 and error["error"]["param"] == "session_id"
            assert h.scheduler.stats.slots_admitted == 0  # no refused call opened anything

            status, reply, headers = await h.chat([USER], stop=["7"], user="ignored", seed=3)
            assert status == 200, reply
            sid = headers["X-Fleetrl-Session"]
            messages = [USER, reply["choices"][0]["message"], {"role": "user", "content": "1"}]
            status, error, _ = await h.chat(messages, session=sid, temperature=0.5)
            assert status == 400 and error["error"]["param"] == "temperature"
            status, reply, _ = await h.chat(messages, session=sid, temperature=1.0)
            assert status == 200 and reply["fleetrl"]["turn_index"] == 2, reply

    asyncio.run(scenario())


def test_an_8_mb_request_is_refused_off_the_event_loop_while_small_requests_answer_within_100_ms(
    rollout_server, redis_url, tokenizer
):
    big = json.dumps({"messages": [{"role": "user", "content": "3" * 8 * 2**20}], "max_tokens": 4}).encode()

    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            headers = {"Authorization": "Bearer secret-a", "X-Fleetrl-Group-Key": "big"}

            async def small() -> float:
                start = time.monotonic()
                async with h.http.get(h.base + "/models", headers=headers) as reply:
                    assert reply.status == 200
                return time.monotonic() - start

            await small()  # the connection pool warm, as in a running door
            sending = asyncio.create_task(h.post("/chat/completions", big, **{"X-Fleetrl-Group-Key": "big"}))
            latencies = []
            while not sending.done():
                latencies.append(await small())
            status, error, _ = await sending
            assert status == 400 and error["error"]["param"] == "messages", error
            assert "max_model_len" in error["error"]["message"] and h.scheduler.stats.slots_admitted == 0
            assert len(latencies) >= 2 and max(latencies) < 0.1, latencies

    asyncio.run(scenario())


def test_a_body_over_the_limit_is_413_and_a_wrong_method_405_both_typed_invalid_request_error(
    rollout_server, redis_url, tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer, max_body_bytes=4096) as h:
            status, error, _ = await h.post("/chat/completions", b"{" + b" " * 8192 + b"}")
            assert status == 413 and error["error"]["type"] == "invalid_request_error", error
            async with h.http.get(h.base + "/chat/completions") as reply:
                error = await reply.json()
                assert reply.status == 405 and error["error"]["type"] == "invalid_request_error", error

    asyncio.run(scenario())


def test_content_parts_train_as_their_text_and_other_parts_are_refused_naming_them(
    rollout_server, redis_url, tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            parts = {"role": "user", "content": [{"type": "text", "text": "31"}, {"type": "text", "text": "4"}]}
            status, reply, headers = await h.chat([parts])
            assert status == 200, reply
            session = h.book.sessions[headers["X-Fleetrl-Session"]]
            assert session.prompt == h.render([{"role": "user", "content": "31\n4"}])
            image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
            status, error, _ = await h.chat([image], key="img")
            assert (
                status == 400 and "content[0]" in error["error"]["message"] and "image_url" in error["error"]["message"]
            )

    asyncio.run(scenario())


def test_a_joining_session_at_another_temperature_is_refused_naming_temperature(rollout_server, redis_url, tokenizer):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            status, reply, _ = await h.chat([USER], key="t", size="2")
            assert status == 200, reply
            status, error, _ = await h.chat([USER], key="t", size="2", temperature=0.5)
            assert status == 400 and error["error"]["param"] == "temperature", error
            assert error["error"]["message"].startswith("temperature:")
            status, error, _ = await h.chat([USER], key="u", temperature=-1)
            assert status == 400 and error["error"]["param"] == "temperature", error

    asyncio.run(scenario())


def test_rewards_set_later_through_the_reward_route_or_a_second_submit_queue_the_group(
    rollout_server, redis_url, tokenizer
):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            sids = await h.open_group("later", 2)
            for k, sid in enumerate(sids):
                status, reply, _ = await h.post(f"/fleetrl/sessions/{sid}/submit", {"submission_id": f"s{k}"})
                assert status == 200 and reply["state"] == "waiting", reply
            status, reply, _ = await h.post(f"/fleetrl/sessions/{sids[0]}/reward", {"reward": 0.25})
            assert status == 200 and reply["state"] == "waiting", reply
            status, error, _ = await h.post(f"/fleetrl/sessions/{sids[1]}/reward", {"reward": None})
            assert status == 400 and error["error"]["param"] == "reward"
            submit = {"submission_id": "s1", "reward": 0.75}  # the same submit again, now with its reward
            status, reply, _ = await h.post(f"/fleetrl/sessions/{sids[1]}/submit", submit)
            assert status == 200 and reply["state"] == "queued", reply
            [group] = h.queued()
            assert sorted(s.reward for s in group.samples) == [0.25, 0.75]
            assert h.scheduler.in_flight == set()

    asyncio.run(scenario())


def test_the_official_openai_client_lists_the_model_and_chats_through_the_door(rollout_server, redis_url, tokenizer):
    async def scenario():
        async with DoorHarness(rollout_server.address, redis_url, tokenizer) as h:
            client = openai.AsyncOpenAI(base_url=h.base, api_key="secret-a", max_retries=0)
            try:
                models = await client.models.list()
                assert [m.id for m in models.data] == [tokenizer.name_or_path]
                parts = [{"type": "text", "text": "314"}]
                reply = await client.chat.completions.with_raw_response.create(
                    model=models.data[0].id,
                    messages=[{"role": "user", "content": parts}],
                    max_tokens=4,
                    extra_headers={"X-Fleetrl-Group-Key": "sdk"},
                )
                completion = reply.parse()
                session = h.book.sessions[reply.headers["X-Fleetrl-Session"]]
                assert session.prompt == h.render([USER]) and completion.choices[0].message.role == "assistant"
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="m",
                        messages=[USER],
                        temperature=0.5,
                        extra_headers={"X-Fleetrl-Session": session.session_id},
                    )
                assert refused.value.body["param"] == "temperature"
                stream = await client.chat.completions.create(
                    model="m",
                    messages=[USER, completion.choices[0].message.model_dump(exclude_none=True), USER],
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_headers={"X-Fleetrl-Session": session.session_id},
                )
                chunks = [chunk async for chunk in stream]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                turn = session.turns[-1]  # the engine's tokens, recorded before the stream was sent
                assert len(session.turns) == 3 and turn.generated and finish in (["stop"], ["length"])
                tokens = content_token_ids(tokenizer, turn)
                assert text == tokenizer.decode(tokens, skip_special_tokens=False)
                assert chunks[-1].usage.completion_tokens == len(turn.token_ids)
            finally:
                await client.close()

    asyncio.run(scenario())
