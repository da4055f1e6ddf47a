"""Wire format of the coordination records (protos.records): the weight bus's NCCL group records, the trainer's
rank-0 orders, the prompt cursor, control commands and the end-of-run marker.

The golden hex strings were computed once from the current encoder and pasted in as literals: any change of the
wire format fails these tests on purpose.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from protos.records import (
    Array,
    FinishReason,
    Sample,
    TrajectoryGroup,
    VersionSpan,
    encode,
)

pytestmark = pytest.mark.unit


# The NCCL group records of the weight bus (weight_bus/nccl_group.py reads and writes them in Redis).
NCCL_GROUP_HEX = "9403c408000102030405060792a9726f6c6c6f75742d30a9726f6c6c6f75742d31cb41d954fc40200000"
NCCL_ROUND_HEX = "95030792cd100040ce00100000cb41d954fc40500000"
NCCL_MEMBER_HEX = "95a9726f6c6c6f75742d300307cb41d954fc40800000cb41d954fc40a00000"


def test_nccl_records_encode_to_golden_bytes_and_back():
    from protos.records import (
        NcclGroup,
        NcclMember,
        NcclRound,
        decode_nccl_group,
        decode_nccl_member,
        decode_nccl_round,
    )

    group = NcclGroup(3, bytes(range(8)), ["rollout-0", "rollout-1"], 1700000000.5)
    round_ = NcclRound(3, 7, [4096, 64], 1 << 20, 1700000001.25)
    member = NcclMember("rollout-0", 3, 7, 1700000002.0, 1700000002.5)
    assert (encode(group).hex(), encode(round_).hex(), encode(member).hex()) == (
        NCCL_GROUP_HEX,
        NCCL_ROUND_HEX,
        NCCL_MEMBER_HEX,
    )
    assert decode_nccl_group(bytes.fromhex(NCCL_GROUP_HEX)) == group
    assert decode_nccl_round(bytes.fromhex(NCCL_ROUND_HEX)) == round_
    assert decode_nccl_member(bytes.fromhex(NCCL_MEMBER_HEX)) == member
    assert group.world_size == 3 and group.rank_of("rollout-1") == 2 and group.rank_of("x") is None


def test_trainer_group_info_finds_the_trainers_entry_by_str_or_bytes_name():
    from protos.redis_keys import RedisKeys

    keys = RedisKeys("run")
    reply = [{"name": b"others", "lag": 9}, {"name": b"trainers", "lag": 3}]
    assert keys.trainer_group_info(reply)["lag"] == 3
    assert keys.trainer_group_info([{"name": "trainers", "lag": 1}])["lag"] == 1
    assert keys.trainer_group_info([{"name": "others", "lag": 1}]) is None


# The trainer's rank-0 -> other ranks order (trainer_service/ranks.py broadcasts it).
ORDER_TRAIN_HEX = (  # its sample carries Sample v2's loss_mask (None)
    "95009199a26731a2703193c4080100000002000000a5696e7433329102919993c40403000000a5696e743332910193c404000000bfa766"
    "6c6f617433329101919302000101cb3ff0000000000000a0c0a0c0a46563686f0402cb41d954fc40200000cbbff0000000000000c290a0"
)
ORDER_CONTROL_HEX = "950190c39192b9636f6f7264696e61746f722e6d61785f7374616c656e657373a132a0"
ORDER_ERROR_HEX = "950390c290b754696d656f75744572726f723a206e6f2067726f757073"


def test_step_orders_encode_to_golden_bytes_and_back():
    from protos.records import OrderKind, StepOrder, decode_order

    group = TrajectoryGroup(
        "g1",
        "p1",
        Array.from_numpy(np.array([1, 2], np.int32)),
        [
            Sample(
                Array.from_numpy(np.array([3], np.int32)),
                Array.from_numpy(np.array([-0.5], np.float32)),
                [VersionSpan(2, 0, 1)],
                FinishReason.STOP,
                1.0,
            )
        ],
        "echo",
        4,
        2,
        1700000000.5,
    )
    orders = {
        ORDER_TRAIN_HEX: StepOrder(OrderKind.TRAIN, groups=[group]),
        ORDER_CONTROL_HEX: StepOrder(OrderKind.CONTROL, sync=True, settings=[("coordinator.max_staleness", "2")]),
        ORDER_ERROR_HEX: StepOrder(OrderKind.ERROR, message="TimeoutError: no groups"),
    }
    for golden, order in orders.items():
        assert encode(order).hex() == golden
        assert decode_order(bytes.fromhex(golden)) == order


CURSOR_HEX = (
    "93a461696d65a870332d65312d313284a47365656407a565706f636801a8706f736974696f6e03ac6e756d5f70726f626c656d731e"
)


def test_prompt_cursor_encodes_to_golden_bytes_and_back():
    from protos.records import PromptCursor, decode_cursor

    cursor = PromptCursor("aime", "p3-e1-12", {"seed": 7, "epoch": 1, "position": 3, "num_problems": 30})
    assert encode(cursor).hex() == CURSOR_HEX
    assert decode_cursor(bytes.fromhex(CURSOR_HEX)) == cursor


def test_one_finish_reason_enum_serves_the_proto_and_the_records():
    """rollout.proto's FinishReason and the records' are one mapping; an engine error is recorded as ERROR."""
    from protos import rollout_pb2 as pb

    for reason in FinishReason:
        assert pb.FinishReason.Value(f"FINISH_REASON_{reason.name}") == reason.value
    assert len(pb.FinishReason.keys()) == len(FinishReason)
    assert [FinishReason.from_engine(n) for n in ("stop", "length", "abort", "error")] == [
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.ABORT,
        FinishReason.ERROR,
    ]
    assert FinishReason.from_engine(None) is FinishReason.from_engine("weird") is FinishReason.UNSPECIFIED


def test_control_commands_encode_to_golden_bytes_and_back():
    from protos.records import ControlCommand, ControlKind, decode_control

    setting = ControlCommand(ControlKind.SET, "r1", "coordinator.max_staleness", "2")
    sync = ControlCommand(ControlKind.SYNC, "r2")
    assert encode(setting).hex() == "9402a27231b9636f6f7264696e61746f722e6d61785f7374616c656e657373a132"
    assert encode(sync).hex() == "9401a27232a0a0"
    assert decode_control(encode(setting)) == setting and decode_control(encode(sync)) == sync
    with pytest.raises(msgspec.ValidationError):
        decode_control(encode(ControlCommand(ControlKind.SYNC, "r3")).replace(b"\x01", b"\x09", 1))  # no such kind


def test_the_end_of_run_marker_is_its_own_record_with_golden_bytes():
    from protos.records import RoleDone, decode_done

    done = RoleDone("trainer", 24, 24, 1700000000.5)
    assert encode(done).hex() == "94a7747261696e65721818cb41d954fc40200000"
    assert decode_done(encode(done)) == done  # readers tell it from a MetricsReport by its field (d, not m)
