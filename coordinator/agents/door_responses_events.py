"""``stream: true`` answers of ``POST /v1/responses``: the Responses API's server-sent events for one turn.

``response.created`` and ``response.in_progress`` when the turn's first token is there; the message item
(``response.output_item.added``, ``response.content_part.added``) before its first ``response.output_text.delta``;
at the end of the turn the text's ``done`` events, one ``function_call`` item per parsed tool call, and
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the turn) with the whole response.
A turn that fails after its first token ends with an ``error`` event and ``response.failed``.
"""

from __future__ import annotations

from coordinator.agents.door_answers import answer_choice, token_logprobs
from coordinator.agents.door_requests import ChatRequest
from coordinator.agents.door_responses import RESPONSES_FIELDS, response_answer, response_head
from coordinator.agents.door_stream import TextDeltas, error_event, sse
from coordinator.agents.sessions import TurnChunk

__all__ = ["ResponseEvents"]


class ResponseEvents:
    """The events of one session's turn (the Responses API has no ``n``)."""

    def __init__(self, tokenizer, chat: ChatRequest, echo: dict):
        self.tokenizer, self.chat, self.echo = tokenizer, chat, echo
        self.deltas = TextDeltas(tokenizer, chat.parse_tools)
        self.sequence = 0
        self.prefix = ""
        self.message_open = False
        self.skeleton: dict = {}
        self.logprobs: list[dict] = []  # of tokens whose text is not sent yet (``include`` asked for them)

    def _event(self, kind: str, **fields) -> bytes:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, kind)

    def _start(self, session, index: int) -> bytes:
        if self.prefix:
            return b""
        self.prefix = f"{session.session_id[:16]}_{index}"
        skeleton = self.skeleton = response_head(session, index, self.chat, self.echo)
        return self._event("response.created", response=skeleton) + self._event(
            "response.in_progress", response=skeleton
        )

    def _text_event(self, kind: str, **fields) -> bytes:
        return self._event(kind, item_id=f"msg_{self.prefix}", output_index=0, content_index=0, **fields)

    def _open_message(self) -> bytes:
        if self.message_open:
            return b""
        self.message_open = True
        item = {"type": "message", "id": f"msg_{self.prefix}", "status": "in_progress", "role": "assistant"}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._event("response.output_item.added", output_index=0, item=item | {"content": []})
        return added + self._text_event("response.content_part.added", part=part)

    def _hold_logprobs(self, token_ids: list[int], logprobs: list[float]) -> None:
        if self.chat.logprobs:
            self.logprobs += token_logprobs(self.tokenizer, token_ids, logprobs)

    def _delta(self, delta: str) -> bytes:
        """A text delta with the logprobs of the tokens since the last one (each token's once)."""
        logprobs, self.logprobs = self.logprobs, []
        return self._text_event("response.output_text.delta", delta=delta, logprobs=logprobs)

    def tokens(self, i: int, session, chunk: TurnChunk) -> bytes:
        head = self._start(session, chunk.turn_index)
        delta = self.deltas.push(chunk.token_ids)
        self._hold_logprobs(chunk.token_ids, chunk.logprobs)
        if not delta:
            return head
        return head + self._open_message() + self._delta(delta)

    def done(self, i: int, session, index: int) -> bytes:
        events = [self._start(session, index)]
        answer = response_answer(self.tokenizer, session, index, self.chat, self.echo)
        choice = answer_choice(self.tokenizer, session, index, self.chat, 0)
        rest = self.deltas.finish(choice["message"]["content"])
        turn = session.turns[index]
        self._hold_logprobs(turn.token_ids[self.deltas.num_tokens :], turn.logprobs[self.deltas.num_tokens :])
        for k, item in enumerate(answer["output"]):
            if item["type"] == "message":
                events.append(self._open_message())
                if rest or self.logprobs:
                    events.append(self._delta(rest))
                [part] = item["content"]
                events.append(
                    self._text_event("response.output_text.done", text=part["text"], logprobs=part["logprobs"])
                )
                events.append(self._text_event("response.content_part.done", part=part))
            else:
                events.append(self._event("response.output_item.added", output_index=k, item=item | {"arguments": ""}))
                call = {"item_id": item["id"], "output_index": k}
                events.append(self._event("response.function_call_arguments.delta", delta=item["arguments"], **call))
                events.append(self._event("response.function_call_arguments.done", arguments=item["arguments"], **call))
            events.append(self._event("response.output_item.done", output_index=k, item=item))
        kind = "response.completed" if answer["status"] == "completed" else "response.incomplete"
        events.append(self._event(kind, response=answer))
        return b"".join(events)

    def end(self) -> bytes:
        return b""

    def error(self, error: Exception) -> bytes:
        """An ``error`` event, then ``response.failed`` (as OpenAI ends a stream that fails mid-way): the response
        with its error and the text streamed so far as an incomplete message."""
        body = error_event(error, RESPONSES_FIELDS)
        event = self._event("error", code=body["type"], message=body["message"], param=body.get("param"))
        if not self.prefix:  # no response was announced: the error alone
            return event
        code = "rate_limit_exceeded" if body["type"] == "rate_limit_error" else "server_error"  # ResponseError's codes
        output = []
        if self.message_open:
            part = {"type": "output_text", "text": self.deltas.sent, "annotations": [], "logprobs": []}
            item = {"type": "message", "id": f"msg_{self.prefix}", "status": "incomplete", "role": "assistant"}
            output.append(item | {"content": [part]})
        failed = self.skeleton | {"status": "failed", "error": {"code": code, "message": body["message"]}}
        return event + self._event("response.failed", response=failed | {"output": output})
