"""Schema evolution of the msgspec records (protos.records): append-only, so old and new readers and writers
interoperate. Old and future versions of a record are declared here as their writers would send them.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from protos.records import (
    Array,
    FinishReason,
    ReportStatus,
    VersionReport,
    VersionSpan,
    decode_group,
    decode_report,
    encode,
)

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------------------------------------------
# schema evolution (append-only records)


class _VersionReportV5(msgspec.Struct, array_like=True, frozen=True):
    """VersionReport as a future writer would send it: one more trailing field with a default."""

    server_id: str
    address: str
    policy_version: int
    status: ReportStatus
    message: str
    time_s: float
    update_s: float = 0.0
    paused_s: float = 0.0
    running: int = 0
    waiting: int = 0
    capacity: int = 0
    tokens_per_s: float = 0.0
    queue_len: int = 0  # added in v5


def test_old_reader_ignores_a_trailing_field_from_a_new_writer():
    data = encode(
        _VersionReportV5(
            "rollout-3", "10.0.0.1:9", 8, ReportStatus.OK, "", 12.5, 2.0, capacity=4, tokens_per_s=9.5, queue_len=42
        )
    )
    assert decode_report(data) == VersionReport(
        "rollout-3", "10.0.0.1:9", 8, ReportStatus.OK, "", 12.5, 2.0, capacity=4, tokens_per_s=9.5
    )


class _SampleV1(msgspec.Struct, array_like=True, frozen=True):
    """Sample as a writer before server_id / routed_experts / error existed sent it."""

    response_token_ids: Array
    rollout_logprobs: Array
    version_spans: list[VersionSpan]
    finish_reason: FinishReason
    reward: float


class _TrajectoryGroupV1(msgspec.Struct, array_like=True, frozen=True):
    group_id: str
    prompt_id: str
    prompt_token_ids: Array
    samples: list[_SampleV1]
    data_source: str
    admission_index: int
    admitted_at_version: int
    created_s: float


def test_new_reader_fills_defaults_for_fields_an_old_writer_did_not_send():
    old = _TrajectoryGroupV1(
        "g-old",
        "p-old",
        Array.from_numpy(np.array([1], np.int32)),
        [
            _SampleV1(
                Array.from_numpy(np.array([4], np.int32)),
                Array.from_numpy(np.array([-0.1], np.float32)),
                [VersionSpan(2, 0, 1)],
                FinishReason.STOP,
                0.5,
            )
        ],
        "echo",
        0,
        2,
        3.0,
    )
    group = decode_group(encode(old))
    (sample,) = group.samples
    assert sample.server_id == "" and sample.routed_experts is None and sample.error == ""
    assert sample.reward == 0.5 and sample.version_spans == [VersionSpan(2, 0, 1)]
    assert group.group_id == "g-old" and group.admitted_at_version == 2


def test_a_record_missing_a_required_field_is_refused():
    truncated = msgspec.msgpack.encode(["rollout-0", "127.0.0.1:1", 1, 0, ""])  # no time_s
    with pytest.raises(msgspec.ValidationError):
        decode_report(truncated)
