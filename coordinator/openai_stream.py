"""``stream: true`` answers of the OpenAI door: a generated turn sent as server-sent events of
``chat.completion.chunk`` objects, as OpenAI's clients read them.

The turn is generated and recorded first (the same path as a plain answer: the tokens trained are the engine's),
then sent as a role chunk, one content chunk, a finish chunk (with the ``fleetrl`` field), the usage chunk when
``stream_options.include_usage`` asks for it, and ``data: [DONE]``. Frameworks that stream by default work
unchanged; the text does not arrive token by token.
"""

from __future__ import annotations

import json

from aiohttp import web


def _event(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


async def stream_answer(request: web.Request, answer: dict, include_usage: bool) -> web.StreamResponse:
    """Send ``answer`` (the door's ``chat.completion`` object) as server-sent events."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    response.headers["X-Fleetrl-Session"] = answer["fleetrl"]["session_id"]  # set before the headers go out
    await response.prepare(request)
    base = {key: answer[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice = answer["choices"][0]

    def chunk(delta: dict, finish_reason=None, **extra) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **extra}]}

    await response.write(_event(chunk({"role": "assistant", "content": ""})))
    content = chunk({"content": choice["message"]["content"]}, logprobs=choice["logprobs"])
    await response.write(_event(content))
    await response.write(_event(chunk({}, choice["finish_reason"]) | {"fleetrl": answer["fleetrl"]}))
    if include_usage:
        await response.write(_event({**base, "choices": [], "usage": answer["usage"]}))
    await response.write(_event("[DONE]"))
    await response.write_eof()
    return response
