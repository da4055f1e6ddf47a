"""The CPU-testable part of the NCCL weight bus: broadcast plans, chunk packing, membership and rebuild decisions,
the watch rule (the group records in Redis: tests/channels/test_nccl_board.py). The GPU layer (nccl_comm, the broadcasts) needs
one GPU per rank and is not run here."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from protos.records import NcclMember
from weight_bus import nccl_group as ng
from weight_bus.nccl_device import ChunkPacker, FlatHost
from weight_bus.packing import WireCodec, encoded_metas, pack, plan_layout

pytestmark = pytest.mark.unit

NOW = 1_000.0


def _beat(member: str, generation: int = 1, age_s: float = 0.0, progress_age_s: float | None = None) -> NcclMember:
    progress_age_s = age_s if progress_age_s is None else progress_age_s
    return NcclMember(member, generation, 3, NOW - age_s, NOW - progress_age_s)


def test_plan_chunks_splits_buckets_larger_than_a_device_buffer():
    chunks = ng.plan_chunks([100, 250, 0, 64], buffer_nbytes=100)
    assert [(c.bucket, c.start, c.nbytes, c.offset) for c in chunks] == [
        (0, 0, 100, 0),
        (1, 0, 100, 100),
        (1, 100, 100, 200),
        (1, 200, 50, 300),
        (3, 0, 64, 350),
    ]
    assert sum(c.nbytes for c in chunks) == 414
    with pytest.raises(ValueError, match="buffer_nbytes"):
        ng.plan_chunks([1], 0)


@pytest.mark.parametrize("codec", [WireCodec(), WireCodec("mxfp8")])
def test_chunk_packing_reproduces_the_tcp_buckets_byte_for_byte(codec):
    gen = torch.Generator().manual_seed(0)
    tensors = [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(64, generator=gen)),
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(512, 64, generator=gen)),  # > one buffer
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 32)),
    ]
    bucket, buffer_nbytes = 4096, 1000  # buffers smaller than buckets: tensors straddle chunks
    manifest, buckets = pack(tensors, 1, bucket, codec=codec)
    entries, sizes = plan_layout(encoded_metas(tensors, codec), bucket)
    host = [torch.zeros(size, dtype=torch.uint8) for size in sizes]
    packer, flat = ChunkPacker(tensors, codec, entries, torch.device("cpu")), FlatHost(host)
    device_buffer = torch.full((buffer_nbytes,), 0xAB, dtype=torch.uint8)  # stale bytes must not leak
    for chunk in ng.plan_chunks(sizes, buffer_nbytes):
        packer.pack(chunk, device_buffer)
        flat.slice(chunk).copy_(device_buffer[: chunk.nbytes])
    assert [bytes(h.numpy()) for h in host] == [bytes(b) for b in buckets]
    assert [flat.crc32(e) for e in entries] == [e.checksum for e in manifest.tensors]


def test_alive_members_need_both_the_process_and_the_receive_loop():
    beats = {
        "b": _beat("b"),
        "a": _beat("a", age_s=1.0),
        "dead": _beat("dead", age_s=30.0),
        "stuck": _beat("stuck", age_s=0.5, progress_age_s=30.0),  # lives, but its loop does not poll
    }
    assert ng.alive_members(beats, NOW, timeout_s=10.0) == ["a", "b"]


def test_group_changes_only_when_membership_changes():
    group = ng.next_group(None, ["a", "b"], b"u" * 128, NOW)
    assert (group.generation, group.world_size, group.rank_of("a"), group.rank_of("b")) == (1, 3, 1, 2)
    assert group.rank_of("zz") is None
    assert ng.needs_new_group(None, ["a"])
    assert not ng.needs_new_group(group, ["b", "a"])
    assert ng.needs_new_group(group, ["a"])  # one died
    assert ng.needs_new_group(group, ["a", "b", "c"])  # one joined
    assert ng.next_group(group, ["a"], b"v" * 128, NOW).generation == 2


def test_after_a_failed_broadcast_the_stale_member_is_dropped_and_survivors_kept():
    group = ng.next_group(None, ["a", "b", "c"], b"u" * 128, NOW)
    beats = {"a": _beat("a"), "b": _beat("b", age_s=20.0), "c": _beat("c", progress_age_s=15.0)}
    keep, drop = ng.members_to_keep(group, beats, NOW, timeout_s=10.0)
    assert (keep, drop) == (["a"], ["b", "c"])
    keep, drop = ng.members_to_keep(group, {"a": _beat("a"), "b": _beat("b")}, NOW, 10.0)
    assert (keep, drop) == (["a", "b"], ["c"])  # no heartbeat at all counts as stale


@pytest.mark.parametrize(
    "done, error, now, generation, current, expected",
    [
        (True, ng.NCCL_SUCCESS, 0.0, 1, 1, ng.Outcome.DONE),
        (True, ng.NCCL_IN_PROGRESS, 0.0, 1, 1, ng.Outcome.DONE),
        (False, ng.NCCL_IN_PROGRESS, 0.0, 1, 1, ng.Outcome.WAIT),
        (False, ng.NCCL_SUCCESS, 0.0, 1, 1, ng.Outcome.WAIT),
        (False, 6, 0.0, 1, 1, ng.Outcome.FAILED),  # ncclRemoteError: a peer died
        (True, 3, 0.0, 1, 1, ng.Outcome.FAILED),
        (False, ng.NCCL_SUCCESS, 5.0, 1, 1, ng.Outcome.TIMED_OUT),
        (False, ng.NCCL_SUCCESS, 0.0, 1, 2, ng.Outcome.SUPERSEDED),  # the publisher rebuilt the group
    ],
)
def test_watch_outcome(done, error, now, generation, current, expected):
    assert ng.watch_outcome(done, error, now, 5.0, generation, current) is expected


def test_wait_for_times_out_naming_what_it_waited_for():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"waited 0\.2s for round v3 of generation 2"):
        ng.wait_for(lambda: None, lambda value: True, 0.2, "round v3 of generation 2")
    assert time.monotonic() - started < 1.5
    assert ng.wait_for(lambda: 7, lambda value: value == 7, 1.0, "seven") == 7


def test_nccl_modules_import_without_cupy():
    code = "import sys, weight_bus.nccl, weight_bus.nccl_comm; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
