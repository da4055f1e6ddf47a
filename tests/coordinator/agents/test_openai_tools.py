"""Tool calls read out of a generated turn (the Hermes convention) and earlier calls shaped for the chat template;
the door's answer with them, as the official ``openai`` package parses it. No server: the tiny model's tokenizer
with the tool-call markers added (the tiny model never writes a call itself)."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from coordinator.agents.door_answers import chat_answer
from coordinator.agents.door_requests import ChatRequest, DoorRefused, parse_chat
from coordinator.agents.door_stream import _choice_chunks
from coordinator.agents.door_tools import parse_tool_calls, template_message
from coordinator.agents.groups import Session, Turn
from modeling.tiny_model import build_tokenizer
from protos.records import FinishReason

pytestmark = pytest.mark.unit

CALL = '<tool_call>{"name": "add", "arguments": {"x": 12, "y": 3}}</tool_call>'


def test_hermes_blocks_become_tool_calls_with_json_string_arguments_and_the_rest_is_content():
    content, calls = parse_tool_calls(f"let me add.\n{CALL}\n{CALL.replace('add', 'mul')}", "t0")
    assert content == "let me add."
    assert [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert [c["id"] for c in calls] == ["call_t0_0", "call_t0_1"]  # the same turn answers the same ids
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 12, "y": 3}
    assert calls[0]["type"] == "function"
    assert parse_tool_calls(CALL, "t0")[0] is None  # nothing but calls: null content, as OpenAI sends


def test_text_without_a_well_formed_call_is_all_content():
    for text in ["no tools here", "<tool_call>{not json}</tool_call>", '<tool_call>{"x": 1}</tool_call>', CALL[:-3]]:
        assert parse_tool_calls(text, "t") == (text, [])
    content, calls = parse_tool_calls(f"<tool_call>[1]</tool_call> {CALL}", "t")
    assert content == "<tool_call>[1]</tool_call>" and len(calls) == 1  # the malformed block stays as written


def test_tool_call_arguments_sent_back_as_json_strings_reach_the_template_as_objects():
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"x": 1}'}}
    message = template_message(1, {"role": "assistant", "content": None, "tool_calls": [call]})
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": {"x": 1}}
    assert message["tool_calls"][0]["id"] == "c"
    assert template_message(0, {"role": "user", "content": "hi"}) == {"role": "user", "content": "hi"}
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"):
        template_message(1, {"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "{"}}]})
    with pytest.raises(ValueError, match=r"messages\[2\]\.tool_calls\[0\]\.function: an object with a name"):
        template_message(2, {"role": "assistant", "tool_calls": [{"function": "add"}]})


def test_tools_must_be_a_list_and_tool_choice_none_turns_parsing_off():
    tokenizer = build_tokenizer()
    body = {"messages": [{"role": "user", "content": "1"}], "tools": [{"type": "function"}]}
    assert parse_chat(body, tokenizer, 64).parse_tools
    assert not parse_chat(body | {"tool_choice": "none"}, tokenizer, 64).parse_tools
    assert not parse_chat({"messages": body["messages"]}, tokenizer, 64).parse_tools
    with pytest.raises(DoorRefused) as refused:
        parse_chat(body | {"tools": {"add": {}}}, tokenizer, 64)
    assert refused.value.param == "tools"
    with pytest.raises(DoorRefused) as refused:
        parse_chat(body | {"tool_choice": "required"}, tokenizer, 64)
    assert refused.value.param == "tool_choice"


def _session_with_turn(tokenizer, text: str) -> Session:
    token_ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    turn = Turn(True, token_ids, [-0.5] * len(token_ids), FinishReason.STOP, [(3, 0, len(token_ids))])
    return Session("s" * 32, "team", None, [1, 5], None, 3, {}, [turn])


def test_an_answer_with_a_tool_call_parses_in_the_official_client_and_keeps_the_engine_tokens():
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "{", "}", '"'])
    session = _session_with_turn(tokenizer, f"ok {CALL}")
    chat = ChatRequest([], 8, None, [], "tiny", False, {}, parse_tools=True)
    answer = chat_answer(tokenizer, [(session, 0)], chat)
    completion = ChatCompletion.model_validate(answer)
    [choice] = completion.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "ok"
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"x": 12, "y": 3}
    assert answer["fleetrl"]["token_ids"] == session.turns[0].token_ids  # what is trained: the engine's tokens

    chunks = [
        ChatCompletionChunk.model_validate(c)
        for c in _choice_chunks(
            {"id": "x", "created": 0, "model": "m", "object": "chat.completion.chunk"}, answer["choices"][0]
        )
    ]
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in streamed] == [(0, "add")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    plain = chat_answer(tokenizer, [(session, 0)], ChatRequest([], 8, None, [], "tiny", False, {}))
    assert plain["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in plain["choices"][0]["message"]
    assert plain["fleetrl"]["token_ids"] == answer["fleetrl"]["token_ids"]
