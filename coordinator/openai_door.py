"""The OpenAI-compatible door: ``POST /v1/chat/completions`` onto SessionBook sessions (docs/agents.md).

An adapter like ``agent_api.py``, over HTTP: an agent that speaks the OpenAI chat API trains by changing its base
URL. Each request's messages are rendered with the model's chat template; the first request of a session opens
it with that rendering as its prompt (``n`` > 1 opens n sessions of one group, one per choice), a later one (header ``X-Fleetrl-Session``) must render to the session's
record followed by new tokens, which are appended (mask 0) before the model's turn. Token truth is the core's:
what is trained is the record, never the agent's text. Reading the request and rendering it are in
``openai_requests.py``: rendering runs in a worker thread, bounded by the context before any tokenizing.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math

from aiohttp import web

from coordinator.agent_errors import AgentRefused
from coordinator.agent_groups import GroupState
from coordinator.agent_sessions import Session, SessionBook
from coordinator.openai_answers import chat_answer
from coordinator.openai_requests import ChatRenderer, ChatRequest, DoorRefused, parse_chat
from coordinator.openai_stream import stream_answer

__all__ = ["DoorRefused", "build_app", "start_openai_door"]

logger = logging.getLogger(__name__)

STATUS = {"invalid": 400, "not_found": 404, "precondition": 409, "denied": 403, "exhausted": 429, "unavailable": 503}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",  # as OpenAI's API answers a wrong method
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
# The core's names of fields that the door's clients send under OpenAI's names.
DOOR_FIELDS = {"sampling.temperature": "temperature", "prompt_token_ids": "messages", "token_ids": "messages"}
MAX_BODY_BYTES = 16 * 2**20  # a long agent history in JSON; larger bodies are refused 413 while being read
SESSION_ID = web.RequestKey("fleetrl_session_id", str)  # answered as X-Fleetrl-Session, refusals included


def _refusal(status: int, message: str, param: str | None = None, retry_after_ms: int = 0) -> web.Response:
    headers = {}
    if retry_after_ms:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_ms / 1000))), "retry-after-ms": str(retry_after_ms)}
    body = {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param}}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def refusals(request: web.Request, handler) -> web.StreamResponse:
    """Every refusal is an OpenAI-style error body; an unexpected failure is logged here, never sent."""
    try:
        response = await handler(request)
    except DoorRefused as error:
        response = _refusal(error.status, str(error), error.param, error.retry_after_ms)
    except AgentRefused as error:
        field, _, rest = str(error).partition(":")
        param = field if rest and field.replace("_", "").replace(".", "").isalnum() else None
        message = str(error)
        if param in DOOR_FIELDS:  # the door's clients sent it under OpenAI's name
            param, message = DOOR_FIELDS[param], DOOR_FIELDS[param] + ":" + rest
        response = _refusal(STATUS[error.kind], message, param, error.retry_after_ms)
    except web.HTTPException as error:  # unknown route, wrong method, body too large
        response = _refusal(error.status, error.reason)
    except Exception:
        logger.exception("openai door: %s %s failed", request.method, request.path)
        response = _refusal(500, "internal error in the fleetrl door (logged by the coordinator)")
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

    # 1) completions ------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        owner = await self.grant(request, "generate")
        chat = parse_chat(await _json_body(request), self.tokenizer, self.book.max_model_len)
        rendered = await self.renderer.render(chat)  # in a worker thread: the loop serves other requests meanwhile
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
        # each sample's turn, generated side by side (every session of a group may be on another server)
        indexes = await asyncio.gather(*(self.turn(owner, s, chat, rendered) for s in sessions), return_exceptions=True)
        failed = next((i for i in indexes if isinstance(i, BaseException)), None)
        if failed is not None:  # the others were waited for: no turn is left running unanswered
            raise failed
        answer = chat_answer(self.tokenizer, list(zip(sessions, indexes, strict=True)), chat)
        if chat.stream:
            return await stream_answer(request, answer, chat.include_usage, request[SESSION_ID])
        return web.json_response(answer)

    async def turn(self, owner: str, session: Session, chat: ChatRequest, rendered: list[int]) -> int:
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
        return await self.generate(owner, session, chat, len(rendered))

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

    async def generate(self, owner: str, session: Session, chat: ChatRequest, length: int) -> int:
        """The model's turn; the iterator is drained so that the core's ``finally`` frees the session now."""
        index = None
        turns = self.book.generate(owner, session.session_id, chat.max_tokens, chat.stop_token_ids, length)
        async for chunk in turns:
            if chunk.finished:
                index = chunk.turn_index
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
