"""The session's own record of its tokens (prompt + every turn) and the rules that keep it equal to the
server's: the ``expected_length`` each Generate/Append carries, the assembly of a streamed turn, and the resync
check after a lost reply.

Transport-free: the async and the sync session share it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetrl.agent.errors import AgentError, SessionLost
from fleetrl.agent.types import FinishReason, GeneratedTurn, TurnChunk, VersionSpan, tensor_to_numpy, top_arrays
from protos import agent_pb2

_SESSION_STATE_NAMES = {value: name for name, value in agent_pb2.SessionState.items()}


@dataclass(frozen=True)
class HistoryTurn:
    generated: bool  # True: model tokens (trained); False: appended (tool results, user turns)
    token_ids: tuple[int, ...]


class SessionHistory:
    """Prompt and turns as this client knows them; ``length`` is the next call's ``expected_length``."""

    def __init__(self, prompt_token_ids: list[int]):
        self.prompt_token_ids = list(prompt_token_ids)
        self.turns: list[HistoryTurn] = []
        self.length = len(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Every token of the session in order (what Submit's ``expected_token_ids`` cross-checks)."""
        tokens = list(self.prompt_token_ids)
        for turn in self.turns:
            tokens.extend(turn.token_ids)
        return tokens

    def add(self, generated: bool, token_ids: list[int], session_length: int) -> None:
        """Record a turn the server confirmed; its ``session_length`` (0 = not sent) must agree."""
        length = self.length + len(token_ids)
        if session_length and session_length != length:
            raise SessionLost(
                f"the server holds {session_length} tokens after turn {len(self.turns)}, the client {length}"
            )
        self.turns.append(HistoryTurn(generated, tuple(token_ids)))
        self.length = length

    def extra_turn(self, info: agent_pb2.SessionInfo) -> agent_pb2.Turn | None:
        """The server's record compared with this history: None when they are equal, the one turn the record
        holds beyond it; SessionLost for anything else (the session closed, or a record that diverges)."""
        if info.state not in (agent_pb2.SESSION_STATE_OPEN, agent_pb2.SESSION_STATE_CLOSED):
            state = _SESSION_STATE_NAMES.get(info.state, str(info.state))
            raise SessionLost(f"session {info.session_id} is {state} on the server")
        if list(info.prompt_token_ids) != self.prompt_token_ids:
            raise SessionLost(f"session {info.session_id}: the server's prompt differs from the client's")
        num_turns = len(self.turns)
        if len(info.turns) not in (num_turns, num_turns + 1):
            raise SessionLost(
                f"session {info.session_id}: the server holds {len(info.turns)} turns, the client {num_turns} "
                "(another client drives this session?)"
            )
        for index, (mine, theirs) in enumerate(zip(self.turns, info.turns, strict=False)):
            if mine.generated != theirs.generated or list(mine.token_ids) != list(theirs.token_ids):
                raise SessionLost(f"session {info.session_id}: turn {index} differs between server and client")
        return info.turns[num_turns] if len(info.turns) > num_turns else None


def recovered_turn(turn: agent_pb2.Turn, turn_index: int, session_length: int) -> GeneratedTurn:
    """A generated turn read back from GetSession, with its version spans and routed experts (the record keeps
    them for the session's last generated turn, which a recovered turn is) and its top logprobs when it asked for
    them (k is the record's entries per token)."""
    tokens = len(turn.token_ids)
    k = len(turn.top_token_ids) // tokens if tokens else 0
    top_ids, top_lps = top_arrays(turn.top_token_ids, turn.top_logprobs, tokens, k)
    return GeneratedTurn(
        token_ids=list(turn.token_ids),
        logprobs=list(turn.logprobs),
        finish_reason=FinishReason(turn.finish_reason),
        version_spans=[VersionSpan(s.version, s.start, s.end) for s in turn.version_spans],
        routed_experts=tensor_to_numpy(turn.routed_experts) if turn.HasField("routed_experts") else None,
        turn_index=turn_index,
        session_length=session_length,
        recovered=True,
        top_token_ids=top_ids,
        top_logprobs=top_lps,
    )


class TurnAssembler:
    """Collects one Generate stream's chunks into a ``GeneratedTurn``."""

    def __init__(self, start_length: int, top_logprobs: int = 0):
        self.start_length = start_length
        self.top_k = top_logprobs  # what the request asked: the chunks' top_* hold k entries per token
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_token_ids: list[int] = []  # row-major [tokens, k], as the chunks send them
        self.top_logprobs: list[float] = []
        self.turn: GeneratedTurn | None = None

    def add(self, chunk: agent_pb2.GenerateChunk) -> TurnChunk:
        if self.turn is not None:
            raise AgentError("Generate: the server sent a chunk after the finished one")
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.top_token_ids.extend(chunk.top_token_ids)
        self.top_logprobs.extend(chunk.top_logprobs)
        session_length = chunk.session_length or self.start_length + len(self.token_ids)
        if chunk.finished:
            top_ids, top_lps = top_arrays(self.top_token_ids, self.top_logprobs, len(self.token_ids), self.top_k)
            self.turn = GeneratedTurn(
                token_ids=list(self.token_ids),
                logprobs=list(self.logprobs),
                finish_reason=FinishReason(chunk.finish_reason),
                version_spans=[VersionSpan(s.version, s.start, s.end) for s in chunk.version_spans],
                routed_experts=tensor_to_numpy(chunk.routed_experts) if chunk.HasField("routed_experts") else None,
                turn_index=chunk.turn_index,
                session_length=session_length,
                top_token_ids=top_ids,
                top_logprobs=top_lps,
            )
        chunk_ids, chunk_lps = top_arrays(chunk.top_token_ids, chunk.top_logprobs, len(chunk.token_ids), self.top_k)
        return TurnChunk(
            token_ids=list(chunk.token_ids),
            logprobs=list(chunk.logprobs),
            turn_index=chunk.turn_index,
            session_length=session_length,
            finished=chunk.finished,
            turn=self.turn,
            top_token_ids=chunk_ids,
            top_logprobs=chunk_lps,
        )

    def remainder(self, turn: GeneratedTurn) -> TurnChunk:
        """The last chunk of a streamed turn recovered with GetSession: the tokens not yet handed out."""
        if turn.token_ids[: len(self.token_ids)] != self.token_ids:
            raise SessionLost("the recorded turn does not start with the tokens already streamed")
        done = len(self.token_ids)
        return TurnChunk(
            token_ids=turn.token_ids[done:],
            logprobs=turn.logprobs[done:],
            turn_index=turn.turn_index,
            session_length=turn.session_length,
            finished=True,
            turn=turn,
            top_token_ids=None if turn.top_token_ids is None else turn.top_token_ids[done:],
            top_logprobs=None if turn.top_logprobs is None else turn.top_logprobs[done:],
        )
