"""CPU benchmark of the tcp weight bus against a raw socket copy of the same bytes, in the same run.

fleetrl path (what a trainer and a rollout server do): ``WeightPublisher.publish`` (pack into buckets,
crc32 per tensor, hold on the tcp publisher, manifest into a real valkey), then the rollout side's
``receiver.receive_into`` into a fresh /dev/shm staging map (fetch + per-bucket checksum verification
overlapped with the transfer). Raw baseline: one thread ``sendall``s the very same bucket bytes over a
loopback socket, the receiver ``recv_into``s a fresh /dev/shm map of the same size.

One publisher publishes every version (as a trainer does), with ``keep_versions=1`` so that from v3 on
it packs into the recycled buckets of a dropped version; v1 (fresh memory) is reported as
``cold_publish_s``. Ratios: ``fetch_over_raw`` = fleetrl receive time / raw copy time (1.0 = no
overhead over the socket), ``publish_plus_fetch_over_raw`` adds the publisher's packing. ``--mxfp8``
also publishes with the mxfp8 codec (CPU reference quantizer here; GPUs use the Triton kernel).
Medians of ``--repeats`` runs; the last line printed is one JSON object.

    python benchmarks/weight_bus_tcp.py --gib 1 --repeats 3 --mxfp8
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402
import torch  # noqa: E402

from launcher.redis_server import EmbeddedRedis  # noqa: E402
from protos.config import WeightBusConfig  # noqa: E402
from protos.records import decode_manifest  # noqa: E402
from protos.redis_keys import RedisKeys  # noqa: E402
from trainer_service.publisher import WeightPublisher  # noqa: E402
from weight_bus import receiver  # noqa: E402
from weight_bus.packing import total_nbytes  # noqa: E402

STAGING_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def model_tensors(gib: float, hidden: int = 2048, experts: int = 16, ffn: int = 768) -> list[tuple[str, torch.Tensor]]:
    """HF-named bf16 tensors of a MoE with as many layers as fit in ``gib`` (norms and router included)."""
    gen = torch.Generator().manual_seed(0)
    tensors = [("model.embed_tokens.weight", torch.randn(32000, hidden, generator=gen).bfloat16())]
    layer_bytes = 2 * (4 * hidden * hidden + 3 * experts * ffn * hidden)
    for layer in range(max(1, int(gib * 2**30 // layer_bytes))):
        p = f"model.layers.{layer}."
        tensors += [(p + "input_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16))]
        for n in "qkvo":
            tensors.append((p + f"self_attn.{n}_proj.weight", torch.randn(hidden, hidden, generator=gen).bfloat16()))
        tensors += [(p + "mlp.gate.weight", torch.randn(experts, hidden, generator=gen).bfloat16())]
        for e in range(experts):
            for n, shape in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)), ("down_proj", (hidden, ffn))):
                tensors.append((p + f"mlp.experts.{e}.{n}.weight", torch.randn(*shape, generator=gen).bfloat16()))
    return tensors


class _Staging:
    """A fresh /dev/shm file mapped for writing, as the rollout server stages a version."""

    def __init__(self, size: int):
        self.file = tempfile.NamedTemporaryFile(dir=STAGING_DIR, prefix="fleetrl-bench-")
        self.file.truncate(size)
        self.map = mmap.mmap(self.file.fileno(), size)
        self.view = memoryview(self.map)

    def close(self) -> None:
        self.view.release()
        self.map.close()
        self.file.close()


def _parallel(count: int, work) -> float:
    """Wall seconds for ``count`` threads each running ``work()`` (the receivers of one version)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def raw_copy_s(buckets: list, size: int, subscribers: int) -> float:
    """Seconds to send ``buckets`` through loopback sockets into a fresh staging map per subscriber."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=subscribers)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            for bucket in buckets:
                conn.sendall(memoryview(bucket).cast("B"))

    def receive() -> None:
        staging = _Staging(size)
        try:
            with socket.create_connection(listener.getsockname()) as sock:
                got = 0
                while got < size:
                    with staging.view[got:] as target:
                        count = sock.recv_into(target)
                    if count == 0:
                        raise ConnectionError(f"raw copy: peer closed after {got} of {size} bytes")
                    got += count
        finally:
            staging.close()

    senders = [threading.Thread(target=serve, daemon=True) for _ in range(subscribers)]
    for sender in senders:
        sender.start()
    try:
        return _parallel(subscribers, receive)
    finally:
        for sender in senders:
            sender.join(timeout=60)
        listener.close()


def receive_s(client, keys, version: int, subscribers: int) -> tuple[float, int]:
    """The rollout side: ``subscribers`` servers fetch + verify ``version`` at once; (seconds, bytes each)."""
    manifest = decode_manifest(client.get(keys.manifest(version)))
    size = total_nbytes(manifest)

    def receive() -> None:
        staging = _Staging(size)
        try:
            source = receiver.receive_into(manifest, staging.view, timeout_s=120)
        finally:
            staging.close()
        if source != "publisher":
            raise RuntimeError(f"v{version} came from the {source}, not the publisher")

    return _parallel(subscribers, receive), size


def measure(client, keys, codec: str, tensors, repeats: int, bucket_mib: float, subscribers: int) -> dict:
    """One publisher for all versions, as in a trainer; keep_versions=1 so buckets recycle from v3 on."""
    publisher = WeightPublisher(client, keys, WeightBusConfig(codec=codec, bucket_mib=bucket_mib, keep_versions=1))
    try:
        cold_publish_s = publisher.publish(1, tensors)  # fresh bucket memory (page faults)
        publisher.publish(2, tensors)
        runs = []
        for version in range(3, 3 + repeats):
            publish_s = publisher.publish(version, tensors)
            # torch's CPU worker threads spin a while after the quantizer's parallel ops; in a real fleet
            # the receiver is another process on another machine, so do not time it against that spin.
            time.sleep(1.0)
            fetch_s, wire = receive_s(client, keys, version, subscribers)
            raw_s = raw_copy_s(publisher.transport.buckets_of(version), wire, subscribers)
            runs.append({"publish_s": publish_s, "fetch_s": fetch_s, "raw_s": raw_s})
    finally:
        publisher.close()
    median = {k: statistics.median(r[k] for r in runs) for k in ("publish_s", "fetch_s", "raw_s")}
    return {
        "codec": codec,
        "subscribers": subscribers,
        "wire_gib": wire / 2**30,
        "cold_publish_s": cold_publish_s,
        **median,
        "fetch_gb_per_s": subscribers * wire / median["fetch_s"] / 1e9,  # delivered, all subscribers
        "raw_gb_per_s": subscribers * wire / median["raw_s"] / 1e9,
        "fetch_over_raw": median["fetch_s"] / median["raw_s"],
        "publish_plus_fetch_over_raw": (median["publish_s"] + median["fetch_s"]) / median["raw_s"],
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="model size in GiB of bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=float, default=512.0)
    parser.add_argument("--mxfp8", action="store_true", help="also publish with the mxfp8 codec")
    parser.add_argument("--subscribers", type=int, default=2, help="rollout servers fetching each version at once")
    args = parser.parse_args()
    tensors = model_tensors(args.gib)
    source_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    print(f"model: {len(tensors)} tensors, {source_bytes / 2**30:.2f} GiB bf16; staging in {STAGING_DIR}", flush=True)
    server = EmbeddedRedis(appendonly=False).start()
    results = {"source_gib": source_bytes / 2**30, "num_tensors": len(tensors), "cpus": os.cpu_count()}
    try:
        client = redis.Redis.from_url(server.url)
        for codec in ("bf16", "mxfp8") if args.mxfp8 else ("bf16",):
            result = measure(
                client, RedisKeys(f"bench-{codec}"), codec, tensors, args.repeats, args.bucket_mib, args.subscribers
            )
            results[codec] = result
            print(
                f"{codec}: wire {result['wire_gib']:.3f} GiB | publish {result['publish_s']:.2f}s "
                f"(first, cold {result['cold_publish_s']:.2f}s) | "
                f"fetch {result['fetch_s']:.2f}s ({result['fetch_gb_per_s']:.2f} GB/s) | raw socket copy "
                f"{result['raw_s']:.2f}s ({result['raw_gb_per_s']:.2f} GB/s) | "
                f"fetch/raw {result['fetch_over_raw']:.2f} | "
                f"(publish+fetch)/raw {result['publish_plus_fetch_over_raw']:.2f}",
                flush=True,
            )
    finally:
        server.stop()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
