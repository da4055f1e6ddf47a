"""The OpenAI door's ``chat.completion`` answer, built from recorded turns: one choice per sampled session.

Everything here reads the record (``Session.turns``); nothing is generated or written. The content is the
detokenized turn, tool calls are parsed out of it when the request gave tools (``door_tools.py``), and the
``fleetrl`` field carries the engine's token ids and logprobs, which are what is trained.
"""

from __future__ import annotations

import math
import time

from coordinator.agents.door_requests import ChatRequest
from coordinator.agents.door_tools import parse_tool_calls
from coordinator.agents.groups import Turn
from coordinator.agents.sessions import Session
from protos.records import FinishReason

__all__ = ["answer_choice", "chat_answer", "content_token_ids", "context_tokens", "token_logprobs", "turn_tops"]


def chat_answer(tokenizer, turns: list[tuple[Session, int]], chat: ChatRequest) -> dict:
    """The answer to ``chat``: choice ``i`` is turn ``turns[i] = (session, turn index)``. The top-level ``fleetrl``
    field is choice 0's (each choice carries its own); ``usage`` counts the context once and every choice's turn."""
    choices = [answer_choice(tokenizer, session, index, chat, i) for i, (session, index) in enumerate(turns)]
    first_session, first_index = turns[0]
    context = context_tokens(first_session, first_index)
    completion_tokens = sum(len(session.turns[index].token_ids) for session, index in turns)
    return {
        "id": f"chatcmpl-{first_session.session_id[:16]}-{first_index}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": context,
            "completion_tokens": completion_tokens,
            "total_tokens": context + completion_tokens,
        },
        "fleetrl": choices[0]["fleetrl"],
    }


def context_tokens(session: Session, index: int) -> int:
    """The tokens of the context turn ``index`` was generated after (the prompt and every earlier turn)."""
    return len(session.prompt) + sum(len(t.token_ids) for t in session.turns[:index])


def token_logprobs(tokenizer, token_ids: list[int], logprobs: list[float], tops=None) -> list[dict]:
    """OpenAI's logprob entries of tokens (chat ``logprobs.content``, a Responses ``output_text``'s ``logprobs``):
    each token's vocabulary piece, its logprob, the piece's UTF-8 ``bytes`` and its ``top_logprobs``: the engine's
    most likely tokens at that position when ``tops`` = (ids per token, logprobs per token) is given (else [])."""
    pieces = tokenizer.convert_ids_to_tokens(list(token_ids))
    entries = [_entry(p, lp) | {"top_logprobs": []} for p, lp in zip(pieces, logprobs, strict=True)]
    if tops is not None:
        for entry, ids, lps in zip(entries, *tops, strict=True):
            known = [(int(i), lp) for i, lp in zip(ids, lps, strict=True) if i >= 0]  # -1: past a small vocabulary
            names = tokenizer.convert_ids_to_tokens([i for i, _ in known])
            entry["top_logprobs"] = [_entry(p, lp) for p, (_, lp) in zip(names, known, strict=True)]
    return entries


def _entry(piece: str, logprob: float) -> dict:
    # JSON has no -inf: OpenAI reports -9999.0 for a token too unlikely to have a finite logprob.
    value = float(logprob) if math.isfinite(logprob) else -9999.0
    return {"token": piece, "logprob": value, "bytes": list(piece.encode())}


def turn_tops(turn: Turn, k: int, start: int = 0):
    """The first ``k`` top tokens per token of ``turn`` from token ``start`` on, as ``token_logprobs`` takes them;
    None when the request asked for none or the turn was generated without them."""
    if k <= 0 or turn.top_token_ids is None:
        return None
    return turn.top_token_ids[start:, :k].tolist(), turn.top_logprobs[start:, :k].tolist()


def content_token_ids(tokenizer, turn: Turn) -> list[int]:
    """The tokens of ``turn`` its answer's content shows: all but an ending special token of a stopped turn (the end
    of turn is the template's to render; OpenAI leaves it out)."""
    tokens = turn.token_ids
    if turn.finish_reason == FinishReason.STOP and tokens and tokens[-1] in tokenizer.all_special_ids:
        return tokens[:-1]
    return tokens


def answer_choice(tokenizer, session: Session, index: int, chat: ChatRequest, choice_index: int) -> dict:
    """Choice ``choice_index`` of an answer: turn ``index`` of ``session`` as a ``chat.completion`` choice."""
    turn = session.turns[index]
    tokens = content_token_ids(tokenizer, turn)
    # A ``stop`` token that is not special stays in the content (unlike OpenAI): the record holds it, so the
    # next request's rendering must too.
    content = tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    message = {"role": "assistant", "content": content}
    finish_reason = "length" if turn.finish_reason == FinishReason.LENGTH else "stop"
    if chat.parse_tools:
        content, tool_calls = parse_tool_calls(content, f"{session.session_id[:16]}{index}")
        if tool_calls:
            message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    choice = {"index": choice_index, "message": message, "finish_reason": finish_reason, "logprobs": None}
    if chat.logprobs:
        tops = turn_tops(turn, chat.top_logprobs)
        choice["logprobs"] = {"content": token_logprobs(tokenizer, turn.token_ids, turn.logprobs, tops)}
    versions = [v for v, _, _ in turn.version_spans]
    choice["fleetrl"] = {
        "session_id": session.session_id,
        "turn_index": index,
        "token_ids": list(turn.token_ids),
        "logprobs": list(turn.logprobs),
        "policy_version": max(versions) if versions else session.policy_version,
    }
    return choice
