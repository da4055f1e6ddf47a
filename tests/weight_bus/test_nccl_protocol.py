"""The NCCL weight bus's protocol on CPU: NcclWeightPublisher and NcclWeightSubscribers (threads, CPU
device) over a real Redis, with NCCL itself replaced by an in-process loopback that keeps NCCL's contract
(a group forms once every rank joined; a broadcast completes once every rank took part; abort ends it).
Real NCCL needs one GPU per rank; the single-GPU parts run in benchmarks/weight_bus_nccl_smoke.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import redis
import torch

from protos.redis_keys import RedisKeys
from tests.waiting import wait_until
from weight_bus import nccl_group as ng
from weight_bus.codecs.mxfp8 import dequantize, quantize
from weight_bus.nccl import MAX_ATTEMPTS, NcclWeightPublisher, NcclWeightSubscriber
from weight_bus.packing import iter_tensors

pytestmark = pytest.mark.integration

CPU = torch.device("cpu")


class _LoopbackGroup:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.joined: set[int] = set()
        self.messages: list[bytes] = []
        self.taken: dict[int, int] = {}
        self.aborted = False


class LoopbackNccl:
    """Stand-in for NCCL at the process edge: communicators of one unique id broadcast through memory."""

    def __init__(self):
        self.cond = threading.Condition()
        self.groups: dict[bytes, _LoopbackGroup] = {}
        self.stalled: set[int] = set()  # ids of communicators that stop taking part (a stalled rank)
        self.num_ids = 0

    def unique_id(self) -> bytes:
        self.num_ids += 1
        return self.num_ids.to_bytes(128, "little")

    def comm(self, unique_id: bytes, world_size: int, rank: int) -> _LoopbackComm:
        with self.cond:
            group = self.groups.setdefault(unique_id, _LoopbackGroup(world_size))
            group.joined.add(rank)
            group.taken.setdefault(rank, 0)
            self.cond.notify_all()
        return _LoopbackComm(self, group, rank)


class _LoopbackComm:
    def __init__(self, hub: LoopbackNccl, group: _LoopbackGroup, rank: int):
        self.hub, self.group, self.rank, self.alive = hub, group, rank, True

    def async_error(self) -> int:
        return 6 if self.group.aborted else ng.NCCL_SUCCESS  # ncclRemoteError once someone aborted

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        with self.hub.cond:
            if not self.hub.cond.wait_for(lambda: ready() or self.group.aborted, timeout=timeout_s):
                self.abort()
                raise TimeoutError(f"loopback nccl: {what} timed out")
            if self.group.aborted:
                raise RuntimeError(f"loopback nccl: {what}: group aborted")

    def wait_ready(self, timeout_s: float, what: str) -> None:
        self._wait(lambda: len(self.group.joined) == self.group.world_size, timeout_s, what)

    def broadcast(self, buffer, nbytes: int, root: int, stream, timeout_s: float) -> None:
        if id(self) in self.hub.stalled:
            self._wait(lambda: False, 3600, "stalled rank")  # never takes part; ends only on abort
        group = self.group
        if self.rank == root:
            with self.hub.cond:
                group.messages.append(bytes(buffer[:nbytes].numpy()))
                index = len(group.messages)
                self.hub.cond.notify_all()
            others = [r for r in range(group.world_size) if r != root]
            self._wait(lambda: all(group.taken.get(r, 0) >= index for r in others), timeout_s, "broadcast")
            return
        index = group.taken[self.rank]
        self._wait(lambda: len(group.messages) > index, timeout_s, "receive")
        buffer[:nbytes].copy_(torch.frombuffer(bytearray(group.messages[index]), dtype=torch.uint8))
        with self.hub.cond:
            group.taken[self.rank] = index + 1
            self.hub.cond.notify_all()

    def abort(self) -> None:
        with self.hub.cond:
            self.group.aborted = True
            self.alive = False
            self.hub.cond.notify_all()


def _config(**overrides) -> SimpleNamespace:
    values = dict(
        host="127.0.0.1",
        port=0,
        bucket_mib=0.01,
        keep_versions=2,
        send_timeout_s=2.0,
        snapshot_dir="",
        keep_snapshots=2,
        codec="mxfp8",
        mxfp8_rule="rceil",
        quantize_embeddings=False,
        quantize_lm_head=False,
        # 1.5 s: a live member's heartbeat can lag a second on a loaded 2-core CI machine (one clean-clone run
        # dropped the healthy subscriber too at 1.0 s); a member stalled before a 2 s broadcast is still stale.
        group_timeout_s=5.0,
        heartbeat_timeout_s=1.5,
    )
    return SimpleNamespace(**{**values, **overrides})


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(128, 64, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(64, generator=gen)),
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(256, 64, generator=gen)),  # spans buffers
    ]


@pytest.fixture
def bus(redis_url, monkeypatch):
    monkeypatch.setattr(ng, "HEARTBEAT_S", 0.1)
    hub, keys, made = LoopbackNccl(), RedisKeys("nccl-proto"), []

    def subscriber(member: str) -> NcclWeightSubscriber:
        sub = NcclWeightSubscriber(redis.Redis.from_url(redis_url), keys, _config(), member, CPU, hub.comm)
        made.append(sub)
        return sub

    publisher = NcclWeightPublisher(redis.Redis.from_url(redis_url), keys, _config(), CPU, hub.comm, hub.unique_id)
    yield SimpleNamespace(hub=hub, publisher=publisher, subscriber=subscriber, keys=keys)
    publisher.close()
    for sub in made:
        sub.close()


def _wait_beating(bus, num_members: int) -> None:
    """Until ``num_members`` subscribers heartbeat into the members hash (the publisher forms its group from it)."""
    beats = bus.publisher.nccl_board.read_heartbeats
    wait_until(lambda: len(beats()) == num_members, f"{num_members} subscribers beating", 10, poll_s=0.01)


def _receive_in_thread(sub: NcclWeightSubscriber, min_version: int, timeout_s: float) -> dict:
    result: dict = {}

    def run() -> None:
        into = bytearray(1 << 20)
        try:
            result["manifest"] = sub.receive(min_version, memoryview(into), timeout_s)
            result["tensors"] = dict(iter_tensors(result["manifest"], memoryview(into), dequantize_to=torch.float32))
        except BaseException as error:  # noqa: BLE001 - asserted by the test
            result["error"] = error

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def test_subscribers_receive_every_version_through_one_group(bus):
    subs = [bus.subscriber("rollout-0"), bus.subscriber("rollout-1")]
    for version in (1, 2):
        waiting = [_receive_in_thread(sub, version - 1, 20) for sub in subs]
        _wait_beating(bus, 2)
        bus.publisher.publish(version, _weights(version))
        for result in waiting:
            result["thread"].join(20)
            assert "error" not in result, result.get("error")
            assert result["manifest"].version == version and result["manifest"].transport == "nccl"
            norm = result["tensors"]["model.layers.0.input_layernorm.weight"]
            assert torch.equal(norm, _weights(version)[1][1])  # fp32 norm bit-identical
    assert bus.publisher.group.generation == 1 and bus.publisher.group.members == ["rollout-0", "rollout-1"]


def test_stalled_subscriber_is_dropped_and_the_survivor_commits_the_version(bus):
    healthy, stalled = bus.subscriber("rollout-0"), bus.subscriber("rollout-1")
    waiting_healthy = _receive_in_thread(healthy, 0, 30)
    waiting_stalled = _receive_in_thread(stalled, 0, 6)
    _wait_beating(bus, 2)
    bus.publisher._ensure_group()  # both join generation 1
    assert bus.publisher.group.members == ["rollout-0", "rollout-1"]
    # their join returns just after the root's
    wait_until(lambda: healthy.comm and stalled.comm, "both subscribers joined", 10, poll_s=0.01)
    # rollout-1 stalls mid-broadcast: its process stops beating, its rank never takes part again.
    stalled._stop.set()
    bus.hub.stalled.add(id(stalled.comm))
    started = time.monotonic()
    bus.publisher.publish(1, _weights(1))
    publish_s = time.monotonic() - started
    # Bounded, not forever: at most MAX_ATTEMPTS broadcast deadlines (2 s) and group formations (5 s). Usually
    # generation 2 carries the version; on a starved 2-core CI machine the survivor once missed generation 2's
    # deadline too, and the publisher's next attempt (generation 3, same members) carried it: by design.
    assert publish_s < MAX_ATTEMPTS * (2.0 + 5.0), publish_s
    group = bus.publisher.group
    assert group.generation >= 2 and group.members == ["rollout-0"]
    waiting_healthy["thread"].join(20)
    assert "error" not in waiting_healthy, waiting_healthy.get("error")
    assert waiting_healthy["manifest"].version == 1
    assert healthy.generation == group.generation
    weight = waiting_healthy["tensors"]["model.layers.0.mlp.experts.0.up_proj.weight"]
    assert torch.equal(weight, dequantize(*quantize(_weights(1)[2][1]), torch.float32))
    waiting_stalled["thread"].join(20)
    assert isinstance(waiting_stalled.get("error"), TimeoutError)  # it never got the version, and says so


def test_publish_without_subscribers_still_serves_late_receivers_over_tcp(bus, redis_url):
    from protos.records import decode_manifest
    from weight_bus.packing import total_nbytes
    from weight_bus.receiver import receive_into

    bus.publisher.publish(3, _weights(3))
    assert bus.publisher.group.members == [] and bus.publisher.comm is None
    manifest = decode_manifest(redis.Redis.from_url(redis_url).get(bus.keys.manifest(3)))
    buffer = bytearray(total_nbytes(manifest))
    assert receive_into(manifest, memoryview(buffer), timeout_s=5) == "publisher"
