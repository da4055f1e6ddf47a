"""The NCCL board against the real embedded Redis: group and round records round-trip, heartbeats are read back
by member and age out of the alive set, a member that leaves is gone."""

from __future__ import annotations

import time

import pytest

from channels.nccl_board import NcclBoard
from protos.records import NcclMember, NcclRound
from protos.redis_keys import RedisKeys
from weight_bus import nccl_group as ng

pytestmark = pytest.mark.integration


def test_group_and_round_records_round_trip_and_heartbeats_age_out(client):
    board = NcclBoard(client, RedisKeys("nccl"))
    assert board.read_group() is None and board.read_round() is None
    group = ng.next_group(None, ["rollout-0", "rollout-1"], bytes(range(128)), time.time())
    board.write_group(group)
    assert board.read_group() == group
    assert client.exists("fleetrl:nccl:weights:nccl:group")
    record = NcclRound(group.generation, 5, [4096, 64], 1 << 20, time.time())
    board.write_round(record)
    assert board.read_round() == record
    board.heartbeat(NcclMember("rollout-0", 1, 4, time.time(), time.time()))
    board.heartbeat(NcclMember("rollout-1", 1, 4, time.time() - 60, time.time() - 60))
    beats = board.read_heartbeats()
    assert sorted(beats) == ["rollout-0", "rollout-1"] and beats["rollout-0"].version == 4
    assert ng.alive_members(beats, time.time(), 10.0) == ["rollout-0"]
    board.leave("rollout-0")
    assert list(board.read_heartbeats()) == ["rollout-1"]
