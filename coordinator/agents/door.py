"""The OpenAI-compatible door: ``POST /v1/chat/completions`` and ``POST /v1/responses`` onto SessionBook
sessions (docs/agents.md).

An adapter like ``api.py``, over HTTP: an agent that speaks the OpenAI chat or Responses API trains by
changing its base URL. Each request's messages are rendered with the model's chat template; the first request of
a session opens it with that rendering as its prompt (``n`` > 1 opens n sessions of one group, one per choice), a
later one (header ``X-Fleetrl-Session``) must render to the session's record followed by new tokens, which are
appended (mask 0) before the model's turn. Token truth is the core's: what is trained is the record, never the
agent's text. Reading the request and rendering it are in ``door_requests.py`` (a Responses request is read
into the same chat request, ``door_responses.py``): rendering runs in a worker thread, bounded by the context
before any tokenizing. ``stream: true`` sends the tokens as the engine generates them (``door_stream.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math

from aiohttp import web

from coordinator.agents.door_answers import chat_answer
from coordinator.agents.door_errors import ERROR_TYPE, refusal_of
from coordinator.agents.door_requests import ChatRenderer, ChatRequest, DoorRefused, parse_chat
from coordinator.agents.door_responses import RESPONSES_FIELDS, parse_responses, response_answer
from coordinator.agents.door_responses_events import ResponseEvents
from coordinator.agents.door_stream import ChatEvents, stream_turns
from coordinator.agents.groups import GroupState
from coordinator.agents.sessions import Session, SessionBook

__all__ = ["DoorRefused", "build_app", "start_openai_door"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20  # a long agent history in JSON; larger bodies are refused 413 while being read
SESSION_ID = web.RequestKey("fleetrl_session_id", str)  # answered as X-Fleetrl-Session, refusals included
PARAM_NAMES = web.RequestKey("fleetrl_param_names", dict)  # a route's names of the chat route's fields
INTERNAL = "internal error in the fleetrl door (logged by the coordinator)"


def _refusal(status: int, error: dict, retry_after_ms: int = 0) -> web.Response:
    headers = {}
    if retry_after_ms:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_ms / 1000))), "retry-after-ms": str(retry_after_ms)}
    return web.json_response({"error": error}, status=status, headers=headers)


@web.middleware
async def refusals(request: web.Request, handler) -> web.StreamResponse:
    """Every refusal is an OpenAI-style error body; an unexpected failure is logged here, never sent."""
    try:
        response = await handler(request)
    except web.HTTPException as error:  # unknown route, wrong method, body too large
        error_type = ERROR_TYPE.get(error.status, "server_error")
        response = _refusal(error.status, {"message": error.reason, "type": error_type, "param": None})
    except Exception as error:
        refusal = refusal_of(error, request.get(PARAM_NAMES))
        if refusal is None:
            logger.exception("openai door: %s %s failed", request.method, request.path)
            refusal = (500, {"message": INTERNAL, "type": "server_error", "param": None}, 0)
        response = _refusal(*refusal)
    if SESSION_ID in request:
        response.headers["X-Fleetrl-Session"] = request[SESSION_ID]
    return response


class OpenAIDoor:
    """Handlers of the door; every decision about sessions stays in ``SessionBook``."""

    def __init__(self, book: SessionBook, tokenizer, authorize, model_id: str = ""):
        self.book, self.tokenizer, self.authorize = book, tokenizer, authorize
        self.renderer = ChatRenderer(tokenizer, book.max_model_len)
        self.model_id = model_id or getattr(tokenizer, "name_or_path", "") or "fleetrl"

    async def grant(self, request: web.Request, scope: str) -> str:
        header = request.headers.get("Authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else None
        name = self.authorize(token or None, scope)
        return await name if inspect.isawaitable(name) else name

    # 1) completions and responses: one model turn per session -----------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        owner = await self.grant(request, "generate")
        chat = parse_chat(await _json_body(request), self.tokenizer, self.book.max_model_len)
        sessions, rendered = await self.sessions_of(request, owner, chat)
        if chat.stream:
            events = ChatEvents(self.tokenizer, chat)
            return await stream_turns(request, self.turn_of(owner, chat, rendered), sessions, events)
        turns = await self.turns(owner, sessions, chat, rendered)
        return web.json_response(chat_answer(self.tokenizer, turns, chat))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``: the Responses API's request as a chat request (``door_responses.py``)."""
        owner = await self.grant(request, "generate")
        request[PARAM_NAMES] = RESPONSES_FIELDS  # refusals name the fields as this route spells them
        chat, echo = parse_responses(await _json_body(request), self.tokenizer, self.book.max_model_len)
        sessions, rendered = await self.sessions_of(request, owner, chat)
        if chat.stream:
            events = ResponseEvents(self.tokenizer, chat, echo)
            return await stream_turns(request, self.turn_of(owner, chat, rendered), sessions, events)
        [(session, index)] = await self.turns(owner, sessions, chat, rendered)
        return web.json_response(response_answer(self.tokenizer, session, index, chat, echo))

    async def sessions_of(self, request: web.Request, owner: str, chat: ChatRequest):
        """``(sessions, rendered)``: the request's sessions (opened now, or the one it continues) and its
        rendering (in a worker thread: the loop serves other requests meanwhile)."""
        rendered = await self.renderer.render(chat)
        session_id = request.headers.get("X-Fleetrl-Session", "")
        if session_id:
            if chat.n > 1:
                raise DoorRefused(
                    400,
                    f"n: {chat.n} on session {session_id}: samples of one turn are opened together (a request "
                    "without X-Fleetrl-Session); continue each choice's session with n = 1",
                    "n",
                )
            sessions = [self.book.get(owner, session_id)]
        else:
            sessions = await self.open(request, owner, rendered, chat)
        request[SESSION_ID] = ",".join(s.session_id for s in sessions)
        return sessions, rendered

    async def turns(self, owner: str, sessions: list[Session], chat: ChatRequest, rendered: list[int]):
        """``[(session, turn index)]``: each sample's turn, generated side by side (every session of a group may
        be on another server); on a failure the others are waited for, so no turn is left running unanswered."""
        indexes = await asyncio.gather(*(self.turn(owner, s, chat, rendered) for s in sessions), return_exceptions=True)
        failed = next((i for i in indexes if isinstance(i, BaseException)), None)
        if failed is not None:
            raise failed
        return list(zip(sessions, indexes, strict=True))

    def turn_of(self, owner: str, chat: ChatRequest, rendered: list[int]):
        """``turn`` for a stream: ``(session, on_chunk) -> turn index``, tokens handed to ``on_chunk`` as they come."""

        async def turn(session: Session, on_chunk) -> int:
            return await self.turn(owner, session, chat, rendered, on_chunk)

        return turn

    async def turn(self, owner: str, session: Session, chat: ChatRequest, rendered: list[int], on_chunk=None) -> int:
        """The index of the model's turn after ``rendered``: appended and generated now, or recorded already."""
        if chat.temperature is not None and chat.temperature != session.group.temperature:
            raise DoorRefused(
                400, f"temperature: session {session.session_id} samples at {session.group.temperature}", "temperature"
            )
        record = session.tokens()
        last = session.turns[-1] if session.turns else None
        if last is not None and last.generated and rendered == record[: len(record) - len(last.token_ids)]:
            return len(session.turns) - 1  # a retry whose answer was lost: the recorded turn again
        _check_prefix(session.session_id, record, rendered)
        if len(rendered) > len(record):
            await self.book.append(owner, session.session_id, rendered[len(record) :], len(record))
        return await self.generate(owner, session, chat, len(rendered), on_chunk)

    async def open(self, request: web.Request, owner: str, prompt: list[int], chat: ChatRequest) -> list[Session]:
        """``chat.n`` sessions of one group (the first may admit it); all abandoned again if one cannot open."""
        key = request.headers.get("X-Fleetrl-Group-Key", "")
        if not key:
            raise DoorRefused(
                400, "X-Fleetrl-Group-Key: required to open a session (or send X-Fleetrl-Session to continue one)"
            )
        size = request.headers.get("X-Fleetrl-Group-Size", "0")
        if not size.isdigit():
            raise DoorRefused(400, f"X-Fleetrl-Group-Size: {size!r} is not a non-negative integer")
        self._check_samples(owner, key, int(size), chat.n)
        open_id = request.headers.get("X-Fleetrl-Open-Id", "")
        sessions: list[Session] = []
        try:
            for i in range(chat.n):
                sample_open_id = f"{open_id}/{i}" if open_id and chat.n > 1 else open_id
                metadata = {"door": "openai"} | ({"sample": str(i)} if chat.n > 1 else {})
                sessions.append(
                    await self.book.open(owner, prompt, key, int(size), chat.temperature, metadata, sample_open_id)
                )
        except BaseException:
            for session in sessions:  # frees the group's slot when they were its only sessions
                await self.book.close(owner, session.session_id, abandon=True)
            raise
        return sessions

    def _check_samples(self, owner: str, key: str, size: int, n: int) -> None:
        """``n`` must fit the group: its size (the run's when 0), the sessions it holds, and ``agent.max_sessions``."""
        if n == 1:
            return
        group = self.book.groups.get((owner, key))
        size = group.size if group is not None else size or self.book.scheduler.config.group_size
        if n > size:
            raise DoorRefused(400, f"n: {n} samples, but group {key!r} has {size} members (one session each)", "n")
        taken = len(group.sessions) + group.opening if group is not None else 0
        if n > size - taken:
            raise DoorRefused(
                400, f"n: {n} samples, but group {key!r} has room for {size - taken} more sessions of {size}", "n"
            )
        if n > self.book.config.max_sessions:
            raise DoorRefused(400, f"n: {n} samples, above agent.max_sessions {self.book.config.max_sessions}", "n")

    async def generate(self, owner: str, session: Session, chat: ChatRequest, length: int, on_chunk=None) -> int:
        """The model's turn; the iterator is drained so that the core's ``finally`` frees the session now. With
        ``on_chunk`` (a stream) every token comes as the engine sends it; the finished chunk is the record's."""
        index = None
        interval = 1 if on_chunk is not None else 0  # 0: the core's default chunking
        turns = self.book.generate(
            owner, session.session_id, chat.max_tokens, chat.stop_token_ids, length, interval, chat.top_logprobs
        )
        async for chunk in turns:
            if chunk.finished:
                index = chunk.turn_index
            elif on_chunk is not None:
                on_chunk(chunk)
        if index is None:
            raise AssertionError("SessionBook.generate ended without its finished chunk")
        return index

    # 2) submission ---------------------------------------------------------------------------------
    async def submit(self, request: web.Request) -> web.Response:
        owner = await self.grant(request, "submit")
        body = await _json_body(request)
        session_id = request[SESSION_ID] = request.match_info["session_id"]
        submission_id, reward = body.get("submission_id", ""), body.get("reward")
        if not isinstance(submission_id, str):
            raise DoorRefused(400, "submission_id: must be a string", "submission_id")
        reward = _reward(reward, required=False)
        result = await self.book.submit(owner, session_id, submission_id, reward, [])
        if (
            result.state == GroupState.WAITING
            and reward is not None
            and self.book.get(owner, session_id).reward is None
        ):
            # the same submit again, now with the reward it was submitted without: set it
            await self.book.set_reward(owner, session_id, reward)
            result = await self.book.submit(owner, session_id, submission_id, reward, [])
        return web.json_response(
            {
                "session_id": session_id,
                "state": result.state.name.lower(),  # waiting | accepted | queued | skipped
                "sessions_submitted": result.sessions_submitted,
                "group_size": result.group_size,
                "group_id": result.group_id,
            }
        )

    async def reward(self, request: web.Request) -> web.Response:
        """A reward set after the submit (submitted with ``reward: null``); the group is queued with its last."""
        owner = await self.grant(request, "submit")
        body = await _json_body(request)
        session_id = request[SESSION_ID] = request.match_info["session_id"]
        reward = _reward(body.get("reward"), required=True)
        state = await self.book.set_reward(owner, session_id, reward)
        return web.json_response({"session_id": session_id, "state": state.name.lower()})

    async def models(self, request: web.Request) -> web.Response:
        """The one model this run trains (frameworks list the models before they chat)."""
        await self.grant(request, "generate")
        model = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "fleetrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def abandon(self, request: web.Request) -> web.Response:
        owner = await self.grant(request, "generate")
        session_id = request[SESSION_ID] = request.match_info["session_id"]
        await self.book.close(owner, session_id, abandon=True)
        return web.json_response({"session_id": session_id, "abandoned": True})


async def _json_body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DoorRefused(400, f"the body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise DoorRefused(400, "the body must be a JSON object")
    return body


def _reward(reward, required: bool) -> float | None:
    if reward is None and not required:
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or reward != reward:
        later = "" if required else " (or null to set it later)"
        raise DoorRefused(400, f"reward: {reward!r} is not a number{later}", "reward")
    return float(reward)


def _check_prefix(session_id: str, record: list[int], rendered: list[int]) -> None:
    """The rendering must start with every token the session holds; else name the first differing position."""
    if rendered[: len(record)] == record:
        return
    position = next((i for i, (a, b) in enumerate(zip(record, rendered, strict=False)) if a != b), len(rendered))
    held = record[position]
    sent = rendered[position] if position < len(rendered) else "nothing (the rendering is shorter)"
    raise DoorRefused(
        400,
        f"messages: the rendered conversation differs from session {session_id}'s record at token position "
        f"{position} (recorded {held}, rendered {sent}): its history was altered; send the messages and answers "
        "as they were, or open a new session",
        "messages",
    )


def build_app(book: SessionBook, tokenizer, authorize, max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:
    door = OpenAIDoor(book, tokenizer, authorize)
    app = web.Application(middlewares=[refusals], client_max_size=max_body_bytes)
    app.router.add_get("/v1/models", door.models)
    app.router.add_post("/v1/chat/completions", door.completions)
    app.router.add_post("/v1/responses", door.responses)
    app.router.add_post("/v1/fleetrl/sessions/{session_id}/reward", door.reward)
    app.router.add_post("/v1/fleetrl/sessions/{session_id}/submit", door.submit)
    app.router.add_post("/v1/fleetrl/sessions/{session_id}/abandon", door.abandon)
    return app


async def start_openai_door(
    book: SessionBook, tokenizer, authorize, host: str, port: int, max_body_bytes: int = MAX_BODY_BYTES
) -> tuple[web.AppRunner, int]:
    """Serve the door on ``host:port`` (0 picks a free port); returns the runner and the bound port.

    ``authorize(token, scope) -> grant name`` (or an awaitable of it) raises ``DoorRefused``. Stop the door with
    ``await runner.cleanup()``.
    """
    runner = web.AppRunner(build_app(book, tokenizer, authorize, max_body_bytes), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as error:
        await runner.cleanup()
        raise OSError(error.errno, f"openai door port {port} on {host}: {error.strerror}") from error
    bound_port = runner.addresses[0][1]
    logger.info("openai door on http://%s:%d/v1", host, bound_port)
    return runner, bound_port
