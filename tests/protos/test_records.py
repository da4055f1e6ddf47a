"""Wire format of the msgspec records (protos.records).

The golden hex strings below were computed once from the current encoder and pasted in as literals:
any change of the wire format (field order, types, array_like layout) fails these tests on purpose.
Records are append-only: new fields go last with a default (see the module docstring); old <-> new round trips
are test_record_evolution.py, the coordination records (NCCL group, trainer orders, cursor, control) are
test_coordination_records.py.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from protos.records import (
    Array,
    FinishReason,
    LoraAdapter,
    MetricsReport,
    ReportStatus,
    Sample,
    TensorEntry,
    TrajectoryGroup,
    VersionReport,
    VersionSpan,
    WeightManifest,
    decode_group,
    decode_manifest,
    decode_metrics,
    decode_report,
    encode,
)

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------------------------------------------
# fixed records


def _group() -> TrajectoryGroup:
    full = Sample(
        response_token_ids=Array.from_numpy(np.array([5, 6, 7], dtype=np.int32)),
        rollout_logprobs=Array.from_numpy(np.array([-0.5, -0.25, -1.0], dtype=np.float32)),
        version_spans=[VersionSpan(3, 0, 2), VersionSpan(4, 2, 3)],
        finish_reason=FinishReason.STOP,
        reward=1.0,
        server_id="rollout-1",
        routed_experts=Array.from_numpy(np.array([[[0, 1]], [[1, 0]]], dtype=np.uint8)),
        error="",
    )
    defaults = Sample(
        response_token_ids=Array.from_numpy(np.array([9], dtype=np.int32)),
        rollout_logprobs=Array.from_numpy(np.array([-2.0], dtype=np.float32)),
        version_spans=[VersionSpan(4, 0, 1)],
        finish_reason=FinishReason.LENGTH,
        reward=0.0,
    )
    return TrajectoryGroup(
        group_id="g-1",
        prompt_id="p-7",
        prompt_token_ids=Array.from_numpy(np.array([1, 2], dtype=np.int32)),
        samples=[full, defaults],
        data_source="echo",
        admission_index=12,
        admitted_at_version=3,
        created_s=1700000000.5,
        sampling_temperature=0.7,
    )


def _manifest() -> WeightManifest:
    return WeightManifest(
        version=2,
        tensors=[
            TensorEntry("model.embed.weight", "float32", (4, 2), "raw", 0, 0, 32, 3735928559),
            TensorEntry("lm_head.weight", "bfloat16", (2,), "raw", 1, 64, 4, 1),
        ],
        bucket_nbytes=[32, 68],
        publisher_address="127.0.0.1:5555",
        transport="tcp",
        created_s=1700000001.25,
    )


def _report() -> VersionReport:
    return VersionReport(
        "rollout-0",
        "127.0.0.1:7000",
        5,
        ReportStatus.STALE,
        "fetch timed out",
        1700000002.0,
        update_s=1.5,
        paused_s=0.25,
        running=3,
        waiting=1,
        capacity=256,
        tokens_per_s=1536.5,
    )


def _metrics() -> MetricsReport:
    return MetricsReport("rollout", 10, 5, 1700000003.5, {"loss": 0.5, "reward_mean": 0.75}, source="rollout-0")


# Written before ``sampling_temperature`` was appended: still decodes, with the field's default.
GROUP_BEFORE_TEMPERATURE_HEX = (
    "98a3672d31a3702d3793c4080100000002000000a5696e7433329102929893c40c050000000600000007000000a5696e74"
    "3332910393c40c000000bf000080be000080bfa7666c6f61743332910392930300029304020301cb3ff0000000000000a9"
    "726f6c6c6f75742d3193c40400010100a575696e743893020102a09893c40409000000a5696e743332910193c404000000"
    "c0a7666c6f617433329101919304000102cb0000000000000000a0c0a0a46563686f0c03cb41d954fc40200000"
)
# Written before ``Sample.loss_mask`` was appended (Sample v1): still decodes, with loss_mask None.
GROUP_BEFORE_LOSS_MASK_HEX = GROUP_BEFORE_TEMPERATURE_HEX.replace("98a3672d31", "99a3672d31", 1) + "cb3fe6666666666666"
GROUP_HEX = (
    "99a3672d31a3702d3793c4080100000002000000a5696e7433329102929993c40c050000000600000007000000a5696e7433"
    "32910393c40c000000bf000080be000080bfa7666c6f61743332910392930300029304020301cb3ff0000000000000a9726f"
    "6c6c6f75742d3193c40400010100a575696e743893020102a0c09993c40409000000a5696e743332910193c404000000c0a7"
    "666c6f617433329101919304000102cb0000000000000000a0c0a0c0a46563686f0c03cb41d954fc40200000cb3fe6666666"
    "666666"
)
# Written before ``adapter`` was appended (v1): still decodes, with adapter None.
MANIFEST_V1_HEX = (
    "96029298b26d6f64656c2e656d6265642e776569676874a7666c6f61743332920402a3726177000020cedeadbeef98ae6c"
    "6d5f686561642e776569676874a862666c6f617431369102a372617701400401922044ae3132372e302e302e313a353535"
    "35a3746370cb41d954fc40500000"
)
MANIFEST_V2_HEX = MANIFEST_V1_HEX.replace("9602", "9702", 1) + "c0"
MANIFEST_HEX = MANIFEST_V1_HEX.replace("9602", "9802", 1) + "c0c3"  # v3: checksummed (True)
# A LoRA adapter version: LoraAdapter(rank 64, alpha 64.0, [q_proj, down_proj], expert_rank 8) as the last field.
ADAPTER_HEX = "9440cb405000000000000092a6715f70726f6aa9646f776e5f70726f6a08"
ADAPTER_MANIFEST_HEX = MANIFEST_V1_HEX.replace("9602", "9802", 1) + ADAPTER_HEX + "c3"
# Written before ``update_s`` and ``paused_s`` were appended (v1): still decodes, with their defaults.
REPORT_V1_HEX = (
    "96a9726f6c6c6f75742d30ae3132372e302e302e313a373030300501af66657463682074696d6564206f7574cb41d954fc40800000"
)
# Written before the heartbeat's ``running``, ``waiting`` and ``capacity`` were appended (v2): still decodes.
REPORT_V2_HEX = REPORT_V1_HEX.replace("96a9", "98a9", 1) + "cb3ff8000000000000cb3fd0000000000000"
# Written before the rate ``tokens_per_s`` was appended (v3): still decodes, with rate 0.
REPORT_V3_HEX = REPORT_V2_HEX.replace("98a9", "9ba9", 1) + "0301cd0100"
REPORT_HEX = REPORT_V3_HEX.replace("9ba9", "9ca9", 1) + "cb4098020000000000"
# Written before ``source`` was appended (v1, by the trainer): still decodes, with source "".
METRICS_V1_HEX = (
    "95a7747261696e65720a05cb41d954fc40e0000082a46c6f7373cb3fe0000000000000ab7265776172645f6d65616ecb3fe8000000000000"
)
METRICS_HEX = (
    "96a7726f6c6c6f75740a05cb41d954fc40e0000082a46c6f7373cb3fe0000000000000ab7265776172645f6d65616ecb3fe8000000000000"
    "a9726f6c6c6f75742d30"
)


# ---------------------------------------------------------------------------------------------------
# golden bytes


def test_trajectory_group_encodes_to_golden_bytes():
    assert encode(_group()).hex() == GROUP_HEX


def test_weight_manifest_encodes_to_golden_bytes():
    assert encode(_manifest()).hex() == MANIFEST_HEX


def test_an_adapter_manifest_encodes_to_golden_bytes_and_back():
    adapter = LoraAdapter(64, 64.0, ["q_proj", "down_proj"], expert_rank=8)
    manifest = msgspec.structs.replace(_manifest(), adapter=adapter)
    assert encode(adapter).hex() == ADAPTER_HEX
    assert encode(manifest).hex() == ADAPTER_MANIFEST_HEX
    assert decode_manifest(bytes.fromhex(ADAPTER_MANIFEST_HEX)) == manifest
    assert decode_manifest(bytes.fromhex(MANIFEST_V1_HEX)).adapter is None  # a v1 manifest carries weights


def test_version_report_encodes_to_golden_bytes():
    assert encode(_report()).hex() == REPORT_HEX


def test_metrics_report_encodes_to_golden_bytes():
    assert encode(_metrics()).hex() == METRICS_HEX


def test_golden_bytes_decode_to_the_same_records():
    assert decode_group(bytes.fromhex(GROUP_HEX)) == _group()
    assert decode_group(bytes.fromhex(GROUP_BEFORE_LOSS_MASK_HEX)) == _group()  # loss_mask defaults to None
    older = decode_group(bytes.fromhex(GROUP_BEFORE_TEMPERATURE_HEX))
    assert older == msgspec.structs.replace(_group(), sampling_temperature=-1.0)
    assert decode_manifest(bytes.fromhex(MANIFEST_HEX)) == _manifest()
    assert decode_manifest(bytes.fromhex(MANIFEST_V2_HEX)) == _manifest()  # before v3: checksummed by default
    assert decode_report(bytes.fromhex(REPORT_HEX)) == _report()
    before_rate = msgspec.structs.replace(_report(), tokens_per_s=0.0)
    assert decode_report(bytes.fromhex(REPORT_V3_HEX)) == before_rate
    before_heartbeat = msgspec.structs.replace(before_rate, running=0, waiting=0, capacity=0)
    assert decode_report(bytes.fromhex(REPORT_V2_HEX)) == before_heartbeat
    older = decode_report(bytes.fromhex(REPORT_V1_HEX))
    assert older == msgspec.structs.replace(before_heartbeat, update_s=0.0, paused_s=0.0)
    assert decode_metrics(bytes.fromhex(METRICS_HEX)) == _metrics()
    older = decode_metrics(bytes.fromhex(METRICS_V1_HEX))
    assert older == msgspec.structs.replace(_metrics(), role="trainer", source="")


# ---------------------------------------------------------------------------------------------------
# round trips


def test_trajectory_group_round_trips_with_arrays_enums_and_defaults():
    group = _group()
    decoded = decode_group(encode(group))
    assert decoded == group
    full, defaults = decoded.samples
    assert full.finish_reason is FinishReason.STOP
    assert full.min_version == 3
    np.testing.assert_array_equal(full.response_token_ids.to_numpy(), [5, 6, 7])
    np.testing.assert_array_equal(full.rollout_logprobs.to_numpy(), np.float32([-0.5, -0.25, -1.0]))
    assert full.routed_experts.to_numpy().shape == (2, 1, 2)
    assert defaults.server_id == "" and defaults.routed_experts is None and defaults.error == ""
    assert defaults.finish_reason is FinishReason.LENGTH


def test_manifest_report_and_metrics_round_trip():
    assert decode_manifest(encode(_manifest())) == _manifest()
    report = decode_report(encode(_report()))
    assert report == _report() and report.status is ReportStatus.STALE
    assert decode_metrics(encode(_metrics())) == _metrics()


def test_sample_without_version_spans_has_min_version_minus_one():
    sample = Sample(
        Array.from_numpy(np.zeros(0, np.int32)), Array.from_numpy(np.zeros(0, np.float32)), [], FinishReason.ABORT, 0.0
    )
    assert sample.min_version == -1


def test_decoding_a_group_as_a_manifest_is_a_validation_error():
    with pytest.raises(msgspec.ValidationError):
        decode_manifest(encode(_group()))


# ---------------------------------------------------------------------------------------------------
# Array


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.uint8])
def test_array_round_trips_a_3d_numpy_array(dtype):
    source = (np.arange(2 * 3 * 4) * 7 % 251).astype(dtype).reshape(2, 3, 4)
    array = Array.from_numpy(source)
    assert array.dtype == np.dtype(dtype).name
    assert array.shape == (2, 3, 4)
    assert len(array.data) == source.nbytes
    back = msgspec.msgpack.decode(encode(array), type=Array).to_numpy()
    assert back.dtype == source.dtype and back.shape == source.shape
    np.testing.assert_array_equal(back, source)


def test_array_from_non_contiguous_numpy_keeps_logical_order():
    source = np.arange(24, dtype=np.int32).reshape(2, 3, 4).transpose(2, 0, 1)
    np.testing.assert_array_equal(Array.from_numpy(source).to_numpy(), source)


def test_array_to_numpy_rejects_wrong_byte_count_naming_sizes():
    array = Array(data=b"\x00" * 10, dtype="int32", shape=(2, 2))
    with pytest.raises(ValueError, match=r"10 bytes.*int32.*\(2, 2\).*needs 16"):
        array.to_numpy()


def test_array_from_big_endian_numpy_decodes_to_the_same_values():
    source = np.arange(4, dtype=">i4")
    np.testing.assert_array_equal(Array.from_numpy(source).to_numpy(), source)
