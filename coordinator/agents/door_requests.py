"""What the OpenAI door reads from a chat request: the body's fields, checked once, and the messages rendered to
token ids with the model's chat template, off the event loop and within the model's context.

Rendering is bounded before any tokenizing: the template's text is measured first, and text that cannot fit in
``max_model_len`` tokens (no token of the vocabulary is longer than ``max_token_chars`` characters) is refused
without being tokenized, which is where an oversized request spends its time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from coordinator.agents.door_tools import template_message
from coordinator.agents.turns import MAX_TOP_LOGPROBS

# Fields that would change the sampling distribution: accepted only at their neutral values (the trainer needs
# the logprobs of full-vocabulary sampling at the group's temperature). Other unknown fields are ignored.
NEUTRAL = {
    "best_of": (1,),
    "top_p": (1,),
    "top_k": (0, -1),
    "min_p": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "tool_choice": ("auto", "none"),
    "response_format": ({"type": "text"},),
}


class DoorRefused(Exception):
    """An HTTP refusal: ``authorize`` raises it (401 missing/unknown token, 403 scope, 429 rate), so does the door."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_ms: int = 0):
        super().__init__(message)
        self.status, self.param, self.retry_after_ms = status, param, retry_after_ms


@dataclass
class ChatRequest:
    messages: list
    max_tokens: int
    temperature: float | None
    stop_token_ids: list[int]
    model: str
    logprobs: bool
    template_kwargs: dict
    stream: bool = False  # answered as server-sent events (door_stream.py)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    n: int = 1  # samples of this turn: one session each, members of one group (opening requests only)
    parse_tools: bool = False  # tools were given and tool_choice is not "none": read tool calls out of turns
    top_logprobs: int = 0  # the engine's k most likely tokens per token, in the logprobs entries (needs logprobs)


def parse_chat(body: dict, tokenizer, max_model_len: int) -> ChatRequest:
    """The request's fields, or a 400 naming the first one that is wrong."""
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise DoorRefused(400, f"{name}: {body[name]!r} unsupported (fleetrl trains on its own sampling)", name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise DoorRefused(400, "messages: a non-empty list of message objects is required", "messages")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = max_model_len  # OpenAI's default: up to the context; the core clips to the room
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise DoorRefused(400, f"max_tokens: {max_tokens!r}, must be an integer > 0", "max_tokens")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, int | float)):
        raise DoorRefused(400, f"temperature: {temperature!r} is not a number", "temperature")
    if temperature is not None and not temperature >= 0:
        raise DoorRefused(400, f"temperature: {temperature}, must be >= 0", "temperature")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise DoorRefused(400, "chat_template_kwargs: must be an object", "chat_template_kwargs")
    kwargs = dict(kwargs)
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise DoorRefused(400, "tools: must be a list of tool objects", "tools")
    if tools:
        kwargs["tools"] = tools
    n = body.get("n")
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise DoorRefused(400, f"n: {n!r}, must be an integer >= 1", "n")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise DoorRefused(400, f"stream: {stream!r} is not a boolean", "stream")
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    model = body.get("model") if isinstance(body.get("model"), str) else "fleetrl"
    stop = stop_tokens(tokenizer, body.get("stop"))
    logprobs = bool(body.get("logprobs"))
    top_logprobs = _top_logprobs(body.get("top_logprobs"), logprobs)
    return ChatRequest(
        [_template_message(i, _flat_message(i, m)) for i, m in enumerate(messages)],
        max_tokens,
        temperature,
        stop,
        model,
        logprobs,
        kwargs,
        stream,
        include_usage,
        n,
        bool(tools) and body.get("tool_choice") != "none",
        top_logprobs,
    )


def _top_logprobs(value, logprobs: bool) -> int:
    """OpenAI's ``top_logprobs``: an integer in [0, 20], and only with ``logprobs: true``."""
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise DoorRefused(
            400, f"top_logprobs: {value!r}, must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs"
        )
    if value and not logprobs:
        raise DoorRefused(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    return value


def _template_message(index: int, message: dict) -> dict:
    try:
        return template_message(index, message)
    except ValueError as error:
        raise DoorRefused(400, str(error), "messages") from error


def _flat_message(index: int, message: dict) -> dict:
    content = flat_content(f"messages[{index}]", message.get("content"), "messages")
    return message if content is message.get("content") else {**message, "content": content}


def flat_content(where: str, content, param: str):
    """A content given as a list of parts becomes its text (text parts joined by newlines, as vLLM's string content
    format does): a template would otherwise render the list's Python repr. A string or None is returned as it is;
    anything else is a 400 naming ``<where>.content``."""
    if not isinstance(content, list):
        if content is not None and not isinstance(content, str):
            raise DoorRefused(400, f"{where}.content: a string or a list of parts", param)
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
            raise DoorRefused(
                400,
                f"{where}.content[{j}]: type {kind!r} unsupported (this door trains a text model: send text parts only)",
                param,
            )
        texts.append(part["text"])
    return "\n".join(texts)


def stop_tokens(tokenizer, stop) -> list[int]:
    """OpenAI stop strings, each of which must be one token (the core stops on token ids only)."""
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list):
        raise DoorRefused(400, f"stop: {stop!r} is not a string or a list of strings", "stop")
    ids = []
    for text in stops:
        encoded = tokenizer.encode(text, add_special_tokens=False) if isinstance(text, str) else []
        if len(encoded) != 1:
            raise DoorRefused(400, f"stop: {text!r} is not a single token of this model's vocabulary", "stop")
        ids += encoded
    return ids


class ChatRenderer:
    """``apply_chat_template`` then the tokenizer, in a worker thread, refusing what cannot fit the context."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # The longest token's text bounds how many characters one token can cover (a byte-level vocabulary's
        # strings have one character per byte, so they over-count, which only makes the bound looser).
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1

    async def render(self, chat: ChatRequest) -> list[int]:
        return await asyncio.to_thread(self.render_now, chat)

    def render_now(self, chat: ChatRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                chat.messages, add_generation_prompt=True, tokenize=False, **chat.template_kwargs
            )
        except Exception as error:  # a template's own refusal (a role it does not know, a missing key)
            raise DoorRefused(400, f"messages: the chat template cannot render them: {error}", "messages") from error
        at_least = -(-len(text) // self.max_token_chars)
        if at_least >= self.max_model_len:
            raise DoorRefused(
                400,
                f"messages: {len(text)} characters rendered, at least {at_least} tokens; max_model_len is "
                f"{self.max_model_len}",
                "messages",
            )
        # As apply_chat_template(tokenize=True) does: the template writes the special tokens itself.
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(token_ids) >= self.max_model_len:
            raise DoorRefused(
                400, f"messages: {len(token_ids)} tokens, max_model_len is {self.max_model_len}", "messages"
            )
        return list(token_ids)
