"""Function calling at the OpenAI door: tool calls read out of a generated turn, and the tool calls of earlier
assistant messages put in the shape chat templates render.

A turn's text is parsed in the Hermes convention that most open chat templates (Qwen, Hermes, many fine-tunes)
teach their models: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, once per call. Parsing only
shapes the answer (``message.tool_calls``); the recorded tokens stay the engine's, and the next request must
render the calls back to those tokens (the template's job, see docs/agents.md).
"""

from __future__ import annotations

import json
import re

__all__ = ["parse_tool_calls", "template_message"]

TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, id_prefix: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a generated text: the Hermes blocks that hold a JSON call become OpenAI tool
    calls (ids ``call_<id_prefix>_<k>``, the same for the same turn so that a retried request answers the same);
    the text around them is the content (None when nothing is left, as OpenAI sends). A block whose JSON is not
    a call stays in the content, as the model wrote it."""
    calls, kept, end = [], [], 0
    for match in TOOL_CALL_BLOCK.finditer(text):
        call = _call(match.group(1), f"call_{id_prefix}_{len(calls)}")
        if call is None:
            continue
        calls.append(call)
        kept.append(text[end : match.start()])
        end = match.end()
    if not calls:
        return text, []
    content = "".join([*kept, text[end:]]).strip()
    return content or None, calls


def _call(block: str, call_id: str) -> dict | None:
    try:
        parsed = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):  # OpenAI's clients read the arguments as a JSON string
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": parsed["name"], "arguments": arguments}}


def template_message(index: int, message: dict) -> dict:
    """An assistant message whose ``tool_calls`` carry their arguments as a JSON string (as OpenAI's clients send
    them back) gets them as objects: templates render the arguments with ``tojson``, which would quote the string
    again (vLLM does the same). Other messages are returned as they are. Raises ``ValueError`` naming the part of
    the message that is wrong (the door answers it as a 400 on ``messages``)."""
    tool_calls = message.get("tool_calls")
    if not tool_calls:
        return message
    if not isinstance(tool_calls, list):
        raise ValueError(f"messages[{index}].tool_calls: must be a list of tool calls")
    return {**message, "tool_calls": [_template_call(index, j, call) for j, call in enumerate(tool_calls)]}


def _template_call(index: int, j: int, call) -> dict:
    where = f"messages[{index}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function: an object with a name is required")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}.function.arguments: not valid JSON ({error}); send them as answered") from error
    return {**call, "function": {**function, "arguments": arguments}}
