"""``stream: true`` answers of the OpenAI door: the turn's text sent as server-sent events while the engine
generates it (one engine chunk per token), as ``chat.completion.chunk`` objects or as Responses API events.

Each session's turn runs as its own task (the same turn as a plain answer: recorded by the core before its
finished chunk, the tokens trained are the engine's). The headers go out once every turn has sent its first
token, so a refusal before that (busy session, no server, staleness budget) is a plain HTTP error; a failure
after it is an error event. A client that goes away does not stop a turn: it is recorded, and the same request
sent again answers it. Text is held back where it may still change: a special token at the end (the end of turn
is left out of the content), an incomplete UTF-8 character, and, when tool calls are parsed, anything from a
possible ``<tool_call>`` on (sent as parsed when the turn ends).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web

from coordinator.agents.door_answers import answer_choice, chat_answer, token_logprobs, turn_tops
from coordinator.agents.door_errors import refusal_of
from coordinator.agents.sessions import TurnChunk

__all__ = ["ChatEvents", "TextDeltas", "error_event", "sse", "stream_turns"]

logger = logging.getLogger(__name__)
MARKER = "<tool_call>"


def sse(data: dict | str, event: str = "") -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


async def stream_turns(request: web.Request, turn, sessions: list, events) -> web.StreamResponse:
    """Generate ``turn(session, on_chunk)`` for each session and send what ``events`` makes of it."""
    queue: asyncio.Queue = asyncio.Queue()

    async def run(i: int, session) -> None:
        try:
            queue.put_nowait((i, await turn(session, lambda chunk: queue.put_nowait((i, chunk)))))
        except Exception as error:  # sent as a refusal (or an error event) below
            queue.put_nowait((i, error))

    tasks = [asyncio.create_task(run(i, s)) for i, s in enumerate(sessions)]
    pending, started = [], set()
    while len(started) < len(sessions):  # 1) every turn's first token (or its end), else a plain refusal
        i, item = await queue.get()
        if isinstance(item, Exception):
            await asyncio.gather(*tasks)  # the others finish (and are recorded) before the refusal
            raise item
        started.add(i)
        pending.append((i, item))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    response.headers["X-Fleetrl-Session"] = ",".join(s.session_id for s in sessions)
    await response.prepare(request)
    done = 0
    try:
        while done < len(sessions):  # 2) tokens as they come, each choice's end as it is recorded
            i, item = pending.pop(0) if pending else await queue.get()
            if isinstance(item, Exception):  # 3) a failure after the headers: an error event ends the stream
                await response.write(events.error(item))
                break
            if isinstance(item, TurnChunk):
                await response.write(events.tokens(i, sessions[i], item))
            else:
                done += 1
                await response.write(events.done(i, sessions[i], item))
        else:
            await response.write(events.end())
        await response.write_eof()
    except ConnectionError:  # the client went away; the turns still finish and are recorded
        logger.info("openai door: a stream's client went away (sessions %s)", response.headers["X-Fleetrl-Session"])
    return response


def error_event(error: Exception, renames: dict | None = None) -> dict:
    """The ``error`` object of a failure after a stream's headers (an unexpected one is logged, never sent)."""
    refusal = refusal_of(error, renames)
    if refusal is None:
        logger.error("openai door: a streamed turn failed", exc_info=error)
        return {"message": "internal error in the fleetrl door (logged by the coordinator)", "type": "server_error"}
    return refusal[1]


class TextDeltas:
    """One choice's text, sent as it becomes final; ``finish(content)`` is what is left of the answer's.

    Decoded incrementally, as vLLM's detokenizer does: each push decodes only a window from the last settled
    offset (``prefix``) to the end, and the new text is what the window adds to its settled part (``prefix`` to
    ``read``). Re-decoding the whole turn per token made a long stream quadratic. The window starts before any
    incomplete character or merge (the offsets move only once the window's text ends in a whole character), so
    the pieces concatenate to the whole turn's decoding.
    """

    def __init__(self, tokenizer, hold_tool_calls: bool):
        self.tokenizer, self.hold_tool_calls = tokenizer, hold_tool_calls
        self.special = set(tokenizer.all_special_ids)
        self.num_tokens = 0  # every token pushed, held ones included
        self.ids: list[int] = []  # the tokens decoded so far (a trailing special token waits in held_ids)
        self.held_ids: list[int] = []  # maybe the end of turn, which the content leaves out
        self.prefix = self.read = 0
        self.sent_pieces: list[str] = []
        self.unsent = ""  # decoded, held back: whitespace or a partial marker before a possible tool call
        self.holding = False  # from a tool call on (or a leading space) nothing more is sent until the end

    @property
    def sent(self) -> str:
        return "".join(self.sent_pieces)

    def push(self, token_ids: list[int]) -> str:
        self.num_tokens += len(token_ids)
        if self.holding:
            return ""
        for token in token_ids:
            if token in self.special:
                self.held_ids.append(token)
            else:
                self.ids += [*self.held_ids, token]
                self.held_ids.clear()
        delta = self._release(self._decode_new())
        if delta:
            self.sent_pieces.append(delta)
        return delta

    def _decode_new(self) -> str:
        """The text the tokens since the last call add, "" while it ends in an incomplete character."""
        if self.read == len(self.ids):
            return ""
        window = self.ids[self.prefix :]
        new_text = self._decode(window)
        settled = self._decode(window[: self.read - self.prefix])
        if len(new_text) <= len(settled) or new_text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character (or a merge that shortens the text): wait for more tokens
        self.prefix, self.read = self.read, len(self.ids)
        return new_text[len(settled) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _release(self, piece: str) -> str:
        """What of ``piece`` (and the text held before it) can be sent now."""
        text = self.unsent + piece
        if not self.hold_tool_calls:
            return text
        if not self.sent_pieces and text[:1].isspace():  # stripped only when the turn holds calls: unknown till its end
            self.holding = True
            return ""
        end = text.find(MARKER)
        if end >= 0:  # the text before a call goes out (stripped), the rest as parsed when the turn ends
            self.holding = True
        else:
            partial = [k for k in range(1, len(MARKER)) if text.endswith(MARKER[:k])]
            end = len(text) - max(partial, default=0)
        while end > 0 and text[end - 1].isspace():  # whitespace before a call is stripped
            end -= 1
        self.unsent = text[end:]
        return text[:end]

    def finish(self, content: str | None) -> str:
        if not content:
            return ""
        sent = self.sent
        if not content.startswith(sent):
            logger.warning("openai door: streamed text %r is not a prefix of the answer %r", sent, content)
            return ""
        return content[len(sent) :]


class ChatEvents:
    """``chat.completion.chunk`` events: per choice a role chunk, content deltas, then the rest as parsed."""

    def __init__(self, tokenizer, chat):
        self.tokenizer, self.chat = tokenizer, chat
        self.deltas: dict[int, TextDeltas] = {}
        self.turns: dict[int, tuple] = {}
        self.base = {"object": "chat.completion.chunk", "created": 0, "model": chat.model}

    def _chunk(self, i: int, delta: dict, **extra) -> dict:
        return {**self.base, "choices": [{"index": i, "delta": delta, "finish_reason": None, **extra}]}

    def _start(self, i: int, session, index: int) -> bytes:
        if i in self.deltas:
            return b""
        self.deltas[i] = TextDeltas(self.tokenizer, self.chat.parse_tools)
        if "id" not in self.base:  # the answer's id, from the first choice that starts
            self.base |= {"id": f"chatcmpl-{session.session_id[:16]}-{index}", "created": int(time.time())}
        return sse(self._chunk(i, {"role": "assistant", "content": ""}))

    def tokens(self, i: int, session, chunk: TurnChunk) -> bytes:
        head = self._start(i, session, chunk.turn_index)
        delta = self.deltas[i].push(chunk.token_ids)
        if not delta and not self.chat.logprobs:
            return head
        tops = None if chunk.top_token_ids is None else (chunk.top_token_ids, chunk.top_logprobs)
        logprobs = self._logprobs(chunk.token_ids, chunk.logprobs, tops)
        return head + sse(self._chunk(i, {"content": delta}, logprobs=logprobs))

    def done(self, i: int, session, index: int) -> bytes:
        head = self._start(i, session, index)
        self.turns[i] = (session, index)
        choice = answer_choice(self.tokenizer, session, index, self.chat, i)
        deltas, turn = self.deltas[i], session.turns[index]
        rest = deltas.finish(choice["message"]["content"])
        left = deltas.num_tokens
        tops = turn_tops(turn, self.chat.top_logprobs, left)
        logprobs = self._logprobs(turn.token_ids[left:], turn.logprobs[left:], tops)
        body = b"".join(sse(c) for c in _choice_chunks(self.base, choice, content=rest, role=False, logprobs=logprobs))
        return head + body

    def _logprobs(self, token_ids: list[int], logprobs: list[float], tops=None) -> dict | None:
        if not self.chat.logprobs:
            return None
        return {"content": token_logprobs(self.tokenizer, token_ids, logprobs, tops)}

    def end(self) -> bytes:
        usage = b""
        if self.chat.include_usage:
            turns = [self.turns[i] for i in sorted(self.turns)]
            usage = sse({**self.base, "choices": [], "usage": chat_answer(self.tokenizer, turns, self.chat)["usage"]})
        return usage + sse("[DONE]")

    def error(self, error: Exception) -> bytes:
        return sse({"error": error_event(error)})


def _choice_chunks(base: dict, choice: dict, content=..., role: bool = True, logprobs=...) -> list[dict]:
    """The chunks of a choice: a role chunk, its content (``content``: the part not sent yet), its tool calls,
    and a finish chunk that carries the choice's ``fleetrl`` field."""
    index, message = choice["index"], choice["message"]
    content = message["content"] if content is ... else content
    logprobs = choice["logprobs"] if logprobs is ... else logprobs

    def chunk(delta: dict, finish_reason=None, **extra) -> dict:
        return {**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, **extra}]}

    chunks = [chunk({"role": "assistant", "content": ""})] if role else []
    if content is not None and (content or role or logprobs):
        chunks.append(chunk({"content": content}, logprobs=logprobs))
    if message.get("tool_calls"):
        calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        chunks.append(chunk({"tool_calls": calls}))
    chunks.append(chunk({}, choice["finish_reason"]) | {"fleetrl": choice["fleetrl"]})
    return chunks
