"""``stream: true`` answers of ``POST /v1/responses``: the Responses API's server-sent events for one turn.

``response.created`` and ``response.in_progress`` when the turn's first token is there; the message item
(``response.output_item.added``, ``response.content_part.added``) before its first ``response.output_text.delta``;
at the end of the turn the text's ``done`` events, one ``function_call`` item per parsed tool call, and
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the turn) with the whole response.
"""

from __future__ import annotations

from coordinator.agent_sessions import TurnChunk
from coordinator.openai_answers import answer_choice
from coordinator.openai_requests import ChatRequest
from coordinator.openai_responses import RESPONSES_FIELDS, response_answer, response_head
from coordinator.openai_stream import TextDeltas, error_event, sse

__all__ = ["ResponseEvents"]


class ResponseEvents:
    """The events of one session's turn (the Responses API has no ``n``)."""

    def __init__(self, tokenizer, chat: ChatRequest, echo: dict):
        self.tokenizer, self.chat, self.echo = tokenizer, chat, echo
        self.deltas = TextDeltas(tokenizer, chat.parse_tools)
        self.sequence = 0
        self.prefix = ""
        self.message_open = False

    def _event(self, kind: str, **fields) -> bytes:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, kind)

    def _start(self, session, index: int) -> bytes:
        if self.prefix:
            return b""
        self.prefix = f"{session.session_id[:16]}_{index}"
        skeleton = response_head(session, index, self.chat, self.echo)
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

    def tokens(self, i: int, session, chunk: TurnChunk) -> bytes:
        head = self._start(session, chunk.turn_index)
        delta = self.deltas.push(chunk.token_ids)
        if not delta:
            return head
        return head + self._open_message() + self._text_event("response.output_text.delta", delta=delta, logprobs=[])

    def done(self, i: int, session, index: int) -> bytes:
        events = [self._start(session, index)]
        answer = response_answer(self.tokenizer, session, index, self.chat, self.echo)
        choice = answer_choice(self.tokenizer, session, index, self.chat, 0)
        rest = self.deltas.finish(choice["message"]["content"])
        for k, item in enumerate(answer["output"]):
            if item["type"] == "message":
                events.append(self._open_message())
                if rest:
                    events.append(self._text_event("response.output_text.delta", delta=rest, logprobs=[]))
                [part] = item["content"]
                events.append(self._text_event("response.output_text.done", text=part["text"], logprobs=[]))
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
        body = error_event(error, RESPONSES_FIELDS)
        return self._event("error", code=body["type"], message=body["message"], param=body.get("param"))
