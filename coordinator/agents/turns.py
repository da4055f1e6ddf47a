"""One model turn of an agent session: streamed from the session's rollout server, recorded when it finished.

The turn runs on the session's server (its prefix stays in that server's cache) or, after that server failed,
on another one at or above the group's version floor, with the session's whole history. A turn the server loses
mid-way is not recorded at all (UNAVAILABLE: the agent generates it again); a finished turn is written to the
session's record in Redis before its last chunk is sent, so a reply the agent receives is a turn that survives a
coordinator restart.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import numpy as np

from coordinator.agents.errors import Unavailable
from coordinator.agents.groups import Session, Turn
from coordinator.agents.store import BookRecords
from coordinator.fleet import Fleet, NoServerAvailable
from coordinator.rollout_client import RolloutFailed
from coordinator.scheduler import Scheduler
from protos.records import FinishReason

logger = logging.getLogger(__name__)

DEFAULT_STREAM_INTERVAL = 16  # tokens per chunk when the agent asks 0 (agent.proto GenerateRequest.stream_interval)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs, and rollout.proto's on sampling.logprobs


@dataclass
class TurnChunk:
    token_ids: list[int]
    logprobs: list[float]
    turn_index: int
    session_length: int
    finished: bool = False
    turn: Turn | None = None  # the recorded turn, on the finished chunk
    top_token_ids: list[list[int]] | None = None  # per token, its k most likely tokens (when the turn asked k > 0)
    top_logprobs: list[list[float]] | None = None


def top_rows(values, tokens: int, k: int) -> list[list]:
    """A chunk's row-major [tokens, k] top-logprob field as one row per token (GenerateResponse fields 9, 10)."""
    if len(values) != tokens * k:
        raise RolloutFailed(f"the server sent {len(values)} top logprob entries for {tokens} tokens x {k}")
    return [list(values[i * k : (i + 1) * k]) for i in range(tokens)]


class TurnRunner:
    """Runs the turns of the book's sessions on the fleet's servers and records them (``sessions.SessionBook``)."""

    def __init__(self, scheduler: Scheduler, fleet: Fleet, records: BookRecords):
        self.scheduler = scheduler  # the slots' version floors, the request timeout, the token and lost-turn counts
        self.fleet = fleet
        self.records = records

    async def stream(
        self, session: Session, max_tokens: int, stop_token_ids: list[int], stream_interval: int, top_logprobs: int = 0
    ):
        """The chunks of one turn of ``session`` (checked and marked busy by ``SessionBook.generate``); with
        ``top_logprobs`` k > 0 each chunk and the recorded turn carry the engine's k most likely tokens per token."""
        await self._ensure_server(session)
        index, start = len(session.turns), session.length
        turn = Turn(True, [], [], server_id=session.server.server_id or session.server.address)
        request_id = f"agent-{session.session_id[:12]}-t{index}-{uuid.uuid4().hex[:6]}"
        final = None
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        try:
            stream = session.server.stream_one(
                session.tokens(),
                max_tokens,
                session.group.temperature,
                stop_token_ids,
                self.scheduler.config.request_timeout_s,
                request_id,
                stream_interval or DEFAULT_STREAM_INTERVAL,
                top_logprobs,
            )
            async for chunk in stream:
                turn.token_ids += chunk.token_ids
                turn.logprobs += chunk.logprobs
                chunk_ids, chunk_lps = tops = _tops(chunk, top_logprobs)
                if chunk_ids is not None:
                    top_ids += chunk_ids
                    top_lps += chunk_lps
                if chunk.finished:
                    final, final_tops = chunk, tops
                    break
                yield TurnChunk(
                    list(chunk.token_ids),
                    list(chunk.logprobs),
                    index,
                    start + len(turn.token_ids),
                    top_token_ids=chunk_ids,
                    top_logprobs=chunk_lps,
                )
            if final is None:
                raise RolloutFailed(f"{session.server.address}: the stream ended before the turn finished")
        except RolloutFailed as error:
            self.scheduler.stats.agent_turns_lost += 1
            session.server = None  # the next turn goes to another server, with the whole history
            raise Unavailable(f"turn {index} lost ({error}); nothing was recorded: generate it again") from error
        turn.finish_reason = FinishReason(final.finish_reason)
        turn.version_spans = [(s.version, s.start, s.end) for s in final.version_spans]
        turn.routes = _routes(final)
        if top_logprobs > 0:
            turn.top_token_ids = np.asarray(top_ids, dtype=np.int32).reshape(len(top_ids), top_logprobs)
            turn.top_logprobs = np.asarray(top_lps, dtype=np.float32).reshape(len(top_lps), top_logprobs)
        await self.records.write_turn(session, index, turn)  # UNAVAILABLE when it cannot be: nothing recorded
        previous = session.last_generated()
        if previous is not None:
            previous.routes = None  # superseded: the trainer replays the last generated turn's only
        session.turns.append(turn)
        self.scheduler.stats.tokens_generated += len(turn.token_ids)  # the coordinator's rollout tok/s counts agents
        yield TurnChunk(list(final.token_ids), list(final.logprobs), index, session.length, True, turn, *final_tops)

    async def _ensure_server(self, session: Session) -> None:
        if session.server is not None and session.server.healthy and session.server in self.fleet.clients:
            return
        floor = self.scheduler.version_floor(session.group.slot)
        try:
            session.server = await self.fleet.pick(
                lambda c: c.policy_version >= floor, set(), 10.0, f"at v >= {floor} for session {session.session_id}"
            )
        except NoServerAvailable as error:
            raise Unavailable(f"no rollout server for session {session.session_id}: {error}") from error
        logger.info("agent session %s moved to %s", session.session_id, session.server.address)


def _tops(chunk, k: int) -> tuple[list | None, list | None]:
    if k <= 0:
        return None, None
    tokens = len(chunk.token_ids)
    return top_rows(chunk.top_token_ids, tokens, k), top_rows(chunk.top_logprobs, tokens, k)


def _routes(chunk) -> np.ndarray | None:
    if not chunk.HasField("routed_experts"):
        return None
    tensor = chunk.routed_experts
    return np.frombuffer(tensor.data, dtype=tensor.dtype).reshape(tensor.shape)
