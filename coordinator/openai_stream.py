"""``stream: true`` answers of the OpenAI door: a generated turn sent as server-sent events of
``chat.completion.chunk`` objects, as OpenAI's clients read them.

The turns are generated and recorded first (the same path as a plain answer: the tokens trained are the
engine's), then each choice is sent as a role chunk, a content chunk, a tool-calls chunk when tool calls were
parsed, and a finish chunk (with that choice's ``fleetrl`` field); then the usage chunk when
``stream_options.include_usage`` asks for it, and ``data: [DONE]``. Frameworks that stream by default work
unchanged; the text does not arrive token by token.
"""

from __future__ import annotations

import json

from aiohttp import web


def _event(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


async def stream_answer(
    request: web.Request, answer: dict, include_usage: bool, session_header: str
) -> web.StreamResponse:
    """Send ``answer`` (the door's ``chat.completion`` object) as server-sent events."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    response.headers["X-Fleetrl-Session"] = session_header  # set before the headers go out
    await response.prepare(request)
    base = {key: answer[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for choice in answer["choices"]:
        for event in _choice_chunks(base, choice):
            await response.write(_event(event))
    if include_usage:
        await response.write(_event({**base, "choices": [], "usage": answer["usage"]}))
    await response.write(_event("[DONE]"))
    await response.write_eof()
    return response


def _choice_chunks(base: dict, choice: dict) -> list[dict]:
    index, message = choice["index"], choice["message"]

    def chunk(delta: dict, finish_reason=None, **extra) -> dict:
        return {**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, **extra}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message["content"] is not None:
        chunks.append(chunk({"content": message["content"]}, logprobs=choice["logprobs"]))
    if message.get("tool_calls"):
        calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        chunks.append(chunk({"tool_calls": calls}))
    chunks.append(chunk({}, choice["finish_reason"]) | {"fleetrl": choice["fleetrl"]})
    return chunks
