"""Wire format of the agent session records (protos.records): what a coordinator writes to Redis about external
agents' sessions and a restarted one reads back (channels/agent_sessions.py).

The golden hex strings were computed once from the current encoder and pasted in as literals: any change of the
wire format fails these tests on purpose.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from protos import agent_pb2
from protos.agent_records import (
    AgentGroupRecord,
    AgentGroupState,
    AgentSessionRecord,
    AgentSessionState,
    AgentTurn,
)
from protos.records import (
    Array,
    FinishReason,
    VersionSpan,
    encode,
)

pytestmark = pytest.mark.unit

GENERATED_TURN_HEX = (
    "98c393c4080500000006000000a5696e743332910293c408000000bf000080bfa7666c6f617433329102019193030002a2723093c41005"
    "000000090000000600000001000000a5696e74333292020293c410000000bf000000c0000080bf0000c0bfa7666c6f61743332920202"
)
APPENDED_TURN_HEX = "98c293c40407000000a5696e743332910193c40400000000a7666c6f6174333291010090a0c0c0"
# v1 (before the top logprobs): six fields; still decoded, with no top logprobs
GENERATED_TURN_V1_HEX = (
    "96c393c4080500000006000000a5696e743332910293c408000000bf000080bfa7666c6f617433329102019193030002a27230"
)
SUBMITTED_SESSION_HEX = (
    "9aa27331a67465616d2d61a26731ae3132372e302e302e313a353030300381a47461736ba13703cb3fe0000000000000a57375622d31"
    "a66f70656e2d31"
)
OPEN_SESSION_HEX = "9aa27332a67465616d2d61a26731a0038001c0a0a0"
GROUP_HEX = (
    "98a26731a67461736b2d3793c40c010000000400000005000000a5696e7433329103cb3ff0000000000000a66563686f2d3702cb41d9"
    "54fc4020000002"
)


def _records():
    generated = AgentTurn(
        True,
        Array.from_numpy(np.array([5, 6], np.int32)),
        Array.from_numpy(np.array([-0.5, -1.0], np.float32)),
        FinishReason.STOP,
        [VersionSpan(3, 0, 2)],
        "r0",
        Array.from_numpy(np.array([[5, 9], [6, 1]], np.int32)),
        Array.from_numpy(np.array([[-0.5, -2.0], [-1.0, -1.5]], np.float32)),
    )
    appended = AgentTurn(
        False,
        Array.from_numpy(np.array([7], np.int32)),
        Array.from_numpy(np.array([0.0], np.float32)),
        FinishReason.UNSPECIFIED,
        [],
        "",
    )
    submitted = AgentSessionRecord(
        "s1", "team-a", "g1", "127.0.0.1:5000", 3, {"task": "7"}, AgentSessionState.SUBMITTED, 0.5, "sub-1", "open-1"
    )
    opened = AgentSessionRecord("s2", "team-a", "g1", "", 3, {}, AgentSessionState.OPEN, None, "", "")
    prompt = Array.from_numpy(np.array([1, 4, 5], np.int32))
    group = AgentGroupRecord("g1", "task-7", prompt, 1.0, "echo-7", 2, 1700000000.5, AgentGroupState.COMPLETE)
    return {
        GENERATED_TURN_HEX: generated,
        APPENDED_TURN_HEX: appended,
        SUBMITTED_SESSION_HEX: submitted,
        OPEN_SESSION_HEX: opened,
        GROUP_HEX: group,
    }


def test_agent_records_encode_to_golden_bytes_and_back():
    for golden, record in _records().items():
        assert encode(record).hex() == golden, type(record).__name__
        assert msgspec.msgpack.decode(bytes.fromhex(golden), type=type(record)) == record


def test_a_turn_written_before_top_logprobs_reads_back_without_them():
    older = msgspec.msgpack.decode(bytes.fromhex(GENERATED_TURN_V1_HEX), type=AgentTurn)
    generated = _records()[GENERATED_TURN_HEX]
    assert older == msgspec.structs.replace(generated, top_token_ids=None, top_logprobs=None)


def test_a_session_without_a_reward_keeps_none_apart_from_zero():
    opened = msgspec.msgpack.decode(bytes.fromhex(OPEN_SESSION_HEX), type=AgentSessionRecord)
    assert opened.reward is None and opened.state is AgentSessionState.OPEN
    zero = msgspec.structs.replace(opened, reward=0.0)
    assert msgspec.msgpack.decode(encode(zero), type=AgentSessionRecord).reward == 0.0


def test_session_states_are_agent_proto_values_and_unknown_group_states_are_refused():
    for state in AgentSessionState:
        assert agent_pb2.SessionState.Value(f"SESSION_STATE_{state.name}") == state.value
    assert len(agent_pb2.SessionState.keys()) == len(AgentSessionState) + 1  # + UNSPECIFIED
    data = bytearray(bytes.fromhex(GROUP_HEX))
    data[-1] = 9  # no such group state
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(bytes(data), type=AgentGroupRecord)
