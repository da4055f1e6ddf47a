"""``POST /v1/responses`` at the OpenAI door: a Responses API request read into the chat request the chat route
serves (same sessions, rendering and turns), and its answer, the ``response`` object, built from the chat
route's choice of the recorded turn.

Input items map onto chat messages: ``instructions`` is a first system message; a ``message`` item is a message
(its content parts joined as text); an assistant ``message`` item and the ``function_call`` items after it are
one assistant message with ``tool_calls`` (as the door answered them: a turn's text, then its calls); a
``function_call_output`` item is a ``tool`` message.
"""

from __future__ import annotations

import time

from coordinator.agents.door_answers import answer_choice, context_tokens
from coordinator.agents.door_requests import NEUTRAL, ChatRequest, DoorRefused, flat_content, parse_chat
from coordinator.agents.groups import Session

__all__ = ["RESPONSES_FIELDS", "parse_responses", "response_answer", "response_head", "response_output"]

# The chat route's names of fields, as this route's requests spell them (refusals name the latter).
RESPONSES_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}
# Fields that need state or tools the door does not have: refused unless absent, null or the value here.
REFUSED = {"previous_response_id": None, "conversation": None, "background": False, "truncation": "disabled"}
LOGPROBS = "message.output_text.logprobs"  # the ``include`` value that asks for the text's logprobs
ECHOED = ("instructions", "tools", "tool_choice", "temperature", "max_output_tokens", "metadata")


def parse_responses(body: dict, tokenizer, max_model_len: int) -> tuple[ChatRequest, dict]:
    """``(chat request, echoed fields)`` of a Responses request, or a 400 naming the first wrong field."""
    for name, allowed in REFUSED.items():
        if body.get(name) is not None and body[name] != allowed:
            raise DoorRefused(
                400,
                f"{name}: {body[name]!r} unsupported (send the whole input each turn, X-Fleetrl-Session to continue)",
                name,
            )
    text = body.get("text")
    if text is not None and (not isinstance(text, dict) or text.get("format", {"type": "text"}) != {"type": "text"}):
        raise DoorRefused(400, f"text: {text!r} unsupported (structured output would constrain sampling)", "text")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise DoorRefused(400, "instructions: must be a string", "instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += input_messages(body.get("input"))
    chat_body = {key: body[key] for key in NEUTRAL if key in body}
    chat_body |= {"messages": messages, "model": body.get("model"), "stream": body.get("stream")}
    chat_body |= {"temperature": body.get("temperature"), "max_completion_tokens": body.get("max_output_tokens")}
    chat_body["logprobs"] = LOGPROBS in _include(body.get("include"))
    if body.get("top_logprobs") is not None:  # the Responses API asks for alternatives without the include as well
        chat_body["top_logprobs"] = body["top_logprobs"]
        chat_body["logprobs"] = chat_body["logprobs"] or bool(body["top_logprobs"])
    if body.get("tools") is not None:
        chat_body["tools"] = _chat_tools(body["tools"])
    chat = parse_chat(chat_body, tokenizer, max_model_len)
    return chat, {key: body.get(key) for key in ECHOED}


def _include(include) -> list[str]:
    """``include``: a list of strings. Only ``message.output_text.logprobs`` adds anything: the other values
    name output the door never makes (search results, images, reasoning), so they are accepted and add nothing."""
    if include is None:
        return []
    if not isinstance(include, list) or not all(isinstance(value, str) for value in include):
        raise DoorRefused(400, f"include: {include!r} is not a list of strings", "include")
    return include


def input_messages(items) -> list[dict]:
    """The chat messages of ``input`` (a string: one user message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise DoorRefused(400, "input: a string or a non-empty list of input items is required", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise DoorRefused(400, f"{where}: an input item object is required", "input")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise DoorRefused(400, f"{where}.role: {item.get('role')!r} is not a message role", "input")
            messages.append({"role": item["role"], "content": flat_content(where, item.get("content"), "input")})
        elif kind == "function_call":
            call = _call(where, item)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last["tool_calls"] = [*last.get("tool_calls", []), call]  # the turn's text, then its calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise DoorRefused(400, f"{where}.call_id: a string is required", "input")
            output = item.get("output")
            output = flat_content(where, output, "input") if isinstance(output, list) else output
            if not isinstance(output, str):
                raise DoorRefused(400, f"{where}.output: a string or a list of text parts is required", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise DoorRefused(
                400, f"{where}.type: {kind!r} unsupported (message, function_call, function_call_output)", "input"
            )
    return messages


def _call(where: str, item: dict) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise DoorRefused(400, f"{where}.{key}: a string is required", "input")
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def _chat_tools(tools) -> list[dict]:
    """Function tools in the chat API's shape, which chat templates read; other tool types are refused."""
    if not isinstance(tools, list):
        raise DoorRefused(400, "tools: must be a list of tool objects", "tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise DoorRefused(400, f"tools[{i}].type: {kind!r} unsupported (function tools only)", "tools")
        if not isinstance(tool.get("name"), str):
            raise DoorRefused(400, f"tools[{i}].name: a string is required", "tools")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def response_output(choice: dict, item_prefix: str) -> list[dict]:
    """The output items of a chat choice: a ``message`` item (its text) unless the content is None, then one
    ``function_call`` item per tool call."""
    message, output = choice["message"], []
    if message["content"] is not None:
        logprobs = choice["logprobs"]["content"] if choice["logprobs"] else []  # the chat route's entries
        part = {"type": "output_text", "text": message["content"], "annotations": [], "logprobs": logprobs}
        item = {"type": "message", "id": f"msg_{item_prefix}", "status": "completed", "role": "assistant"}
        output.append(item | {"content": [part]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(
            {
                "type": "function_call",
                "id": "fc_" + call["id"].removeprefix("call_"),
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    return output


def response_head(session: Session, index: int, chat: ChatRequest, echo: dict) -> dict:
    """A ``response`` object without its output yet: a stream's ``response.created``."""
    return {
        "id": f"resp_{session.session_id[:16]}_{index}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": chat.model,
        "output": [],
        "parallel_tool_calls": True,
        "top_p": 1.0,
        **{key: value for key, value in echo.items() if key != "tools"},
        "tools": echo.get("tools") or [],
        "tool_choice": echo.get("tool_choice") or "auto",
    }


def response_answer(tokenizer, session: Session, index: int, chat: ChatRequest, echo: dict) -> dict:
    """The ``response`` object of turn ``index`` of ``session``."""
    choice = answer_choice(tokenizer, session, index, chat, 0)
    context, generated = context_tokens(session, index), len(session.turns[index].token_ids)
    incomplete = choice["finish_reason"] == "length"
    return response_head(session, index, chat, echo) | {
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": response_output(choice, f"{session.session_id[:16]}_{index}"),
        "usage": {
            "input_tokens": context,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": context + generated,
        },
        "fleetrl": choice["fleetrl"],
    }
