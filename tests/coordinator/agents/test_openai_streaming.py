"""Token-by-token streaming at the OpenAI door: ``stream: true`` chat completions send each token's text as the
engine generates it; refusals before the first token are plain HTTP errors. The official ``openai`` client against
the real door, a real rollout server (vLLM CPU, tiny model) and real Redis.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from coordinator.agents.door_answers import content_token_ids
from coordinator.agents.door_stream import TextDeltas
from tests.coordinator.agents import test_openai_door
from tests.coordinator.agents.test_openai_agent_surface import sdk
from tests.coordinator.agents.test_openai_door import TEMPLATE, USER, DoorHarness
from tests.coordinator.agents.test_openai_responses import door_with_client
from tests.coordinator.agents.test_openai_stream_failures import spawned_standin

pytestmark = pytest.mark.integration

shared_tokenizer = test_openai_door.tokenizer  # the fixture "tokenizer" of that module, here too
MULTILINGUAL = [
    "naïve café — crème brûlée",
    "日本語のテキストを少し",
    "Ελληνικά και русский текст",
    "emoji 🙂🚀👩‍💻 and ünïcödé",
    "plain ascii words 12345",
]


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE tokenizer (the kind of GPT-2's and Qwen's) trained here on multilingual text, small enough
    that many multi-byte characters are split across tokens while merges span characters elsewhere."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<bos>", "<eos>"], initial_alphabet=alphabet, show_progress=False
    )
    core.train_from_iterator(MULTILINGUAL * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


class DecodeCounter:
    """The tokenizer, counting the tokens it is asked to decode (the detokenizer's work)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.all_special_ids, self.num_decoded = tokenizer, tokenizer.all_special_ids, 0

    def decode(self, token_ids, **options) -> str:
        self.num_decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, **options)


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
            special = set(shared_tokenizer.all_special_ids)
            content_ids = content_token_ids(shared_tokenizer, turn)
            # One delta per token (this vocabulary's tokens decode alone), but a special token waits (it may be the
            # end of turn) and goes out with the next token's text, or with the answer's rest at the end.
            ordinary = sum(1 for t in content_ids if t not in special)
            held_at_end = bool(content_ids) and content_ids[-1] in special
            assert len(deltas) == ordinary + held_at_end, (turn.token_ids, deltas)
            entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            assert [e.logprob for e in entries] == turn.logprobs  # every token's, the end of turn included
            assert [e.token for e in entries] == shared_tokenizer.convert_ids_to_tokens(turn.token_ids)
            assert all(e.bytes == list(e.token.encode()) and e.top_logprobs == [] for e in entries)  # OpenAI's shape
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


def test_the_deltas_of_a_long_multibyte_output_concatenate_to_its_decoding_with_linear_decoding_work(byte_tokenizer):
    rng = random.Random(0)
    text = " ".join(rng.choice(MULTILINGUAL) for _ in range(300))
    token_ids = byte_tokenizer.encode(text, add_special_tokens=False)
    assert len(token_ids) > 5000 and byte_tokenizer.decode(token_ids) == text
    assert any("\ufffd" in byte_tokenizer.decode([t]) for t in token_ids)  # characters split across tokens
    eos = byte_tokenizer.eos_token_id
    for hold_tool_calls, sizes in ((False, [1]), (True, [1, 2, 3, 5, 8])):
        counter = DecodeCounter(byte_tokenizer)
        deltas = TextDeltas(counter, hold_tool_calls)
        ids, pieces = [*token_ids, eos], []  # the end of turn last, which the content leaves out
        while ids:
            size = rng.choice(sizes)
            pieces.append(deltas.push(ids[:size]))
            ids = ids[size:]
        assert "".join(pieces) == text and deltas.finish(text) == ""  # all of it streamed, nothing left to send
        assert not any("\ufffd" in piece for piece in pieces)  # no character sent in halves
        # a window per push: decoding the whole text per token would be ~n^2 / 2 tokens
        assert counter.num_decoded < 8 * len(token_ids), counter.num_decoded


def test_a_long_streamed_turn_of_multibyte_text_is_the_plain_answer_of_that_turn(tmp_path, redis_url, byte_tokenizer):
    """The engine's tokens (a stand-in's, drawn from the byte-level vocabulary) streamed one by one through the door,
    against the recorded turn answered plainly."""
    overrides = ("rollout.synthetic.tokens_per_s=0", f"rollout.synthetic.vocab_size={len(byte_tokenizer)}")

    async def scenario(address: str):
        async with DoorHarness(address, redis_url, byte_tokenizer) as h:
            client = sdk(h)
            stream = await client.chat.completions.create(
                model="m", messages=[USER], max_tokens=240, stream=True, extra_headers={"X-Fleetrl-Group-Key": "long"}
            )
            deltas = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
            [session] = h.book.sessions.values()
            plain = await client.chat.completions.create(
                model="m", messages=[USER], max_tokens=240, extra_headers={"X-Fleetrl-Session": session.session_id}
            )
            await client.close()
            content = plain.choices[0].message.content
            assert len(session.turns[0].token_ids) == 240 and len(deltas) > 100
            assert "".join(deltas) == content
            assert any(ord(c) > 127 and c != "\ufffd" for c in content)  # multi-byte characters among them

    with spawned_standin(tmp_path / "standin.log", *overrides) as standin:
        asyncio.run(scenario(standin.addresses[0]))


def test_top_logprobs_answer_the_engines_most_likely_tokens_plainly_streamed_and_from_the_record(
    rollout_server, redis_url, shared_tokenizer
):
    async def scenario():
        async with door_with_client(rollout_server, redis_url, shared_tokenizer) as (h, client):
            reply = await client.chat.completions.with_raw_response.create(
                model="m",
                messages=[USER],
                max_tokens=8,
                logprobs=True,
                top_logprobs=3,
                extra_headers={"X-Fleetrl-Group-Key": "top"},
            )
            session_id = reply.headers["X-Fleetrl-Session"]
            turn = h.book.sessions[session_id].turns[0]
            assert turn.top_token_ids.shape == turn.top_logprobs.shape == (len(turn.token_ids), 3)
            entries = reply.parse().choices[0].logprobs.content
            for entry, ids, lps, sampled in zip(
                entries, turn.top_token_ids.tolist(), turn.top_logprobs.tolist(), turn.token_ids, strict=True
            ):
                assert [t.token for t in entry.top_logprobs] == shared_tokenizer.convert_ids_to_tokens(ids)
                values = [t.logprob for t in entry.top_logprobs]
                assert values == lps and values == sorted(values, reverse=True)  # vLLM's rank order
                assert sum(math.exp(v) for v in values) <= 1 + 1e-4
                assert entry.logprob <= values[0] + 1e-5  # the sampled token is never likelier than the likeliest
                if sampled in ids:  # then it is the same number, from the same distribution
                    assert entry.logprob == pytest.approx(values[ids.index(sampled)], abs=1e-5)

            stored = {s.record.session_id: s for s in (await h.book.records.store.load()).sessions}
            record = stored[session_id].turns[0]  # what a restarted coordinator answers a repeated request from
            assert record.top_token_ids.to_numpy().tolist() == turn.top_token_ids.tolist()
            assert record.top_logprobs.to_numpy().tolist() == turn.top_logprobs.tolist()

            stream = await client.chat.completions.create(
                model="m",
                messages=[USER],
                max_tokens=8,
                stream=True,
                logprobs=True,
                top_logprobs=2,
                extra_headers={"X-Fleetrl-Group-Key": "top"},  # its group's second member
            )
            chunks = [chunk async for chunk in stream]
            [other] = [s for s in h.book.sessions.values() if s.session_id != session_id]
            streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            assert [[t.logprob for t in e.top_logprobs] for e in streamed] == other.turns[0].top_logprobs.tolist()

            for body, named in (
                ({"logprobs": False, "top_logprobs": 2}, "needs logprobs"),
                ({"logprobs": True, "top_logprobs": 21}, "[0, 20]"),
                ({"logprobs": True, "top_logprobs": "2"}, "[0, 20]"),
            ):
                request = {"model": "m", "messages": [USER], "max_tokens": 4, **body}
                status, error, _ = await h.post("/chat/completions", request, **{"X-Fleetrl-Group-Key": "bad"})
                assert status == 400 and error["error"]["param"] == "top_logprobs", error
                assert named in error["error"]["message"], error

    asyncio.run(scenario())
