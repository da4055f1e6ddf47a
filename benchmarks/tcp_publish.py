"""The trainer's side of ``transport=tcp`` (issue 25): the old and the new way measured side by side in one run.

On an H200 the tcp publisher moved ~0.3 GB/s: it allocated fresh (pinned) host buckets for every version and
checksummed every byte on one thread. Parts, each old vs new over the same bytes:

- ``crc``: the per-entry crc32 of a version's buckets, ``zlib.crc32`` entry after entry on one thread (packing,
  the host mirror and receivers' ``verify`` did this) vs ``weight_bus.checksums`` on its thread pool (they do now);
  the values are asserted equal.
- ``buckets``: packing a version (``packing.iter_buckets``: copy + crc) into fresh host buckets every time vs the
  buckets the tcp publisher recycles (``keep_versions=1``: from the third version on, a dropped version's buffers).
- ``publish``: both changes together: fresh buckets and sequential crc (old) vs recycled buckets and the pool (new).

On a GPU the tensors lie on the device and the host buckets are pinned (``host_array``), as in a trainer; on a CPU
machine, or with ``FLEETRL_GPU_CHECKS_DRY=1`` (a small CPU smoke of the same code), CPU tensors and pageable buckets.
Medians over ``--repeats`` (crc) and over the versions after the first two (buckets, publish). The last line
printed is one JSON object.

    python benchmarks/tcp_publish.py                  # CPU: 512 MiB of weights, under a minute on 2 cores
    python benchmarks/tcp_publish.py --mib 4096       # GPU
    FLEETRL_GPU_CHECKS_DRY=1 python benchmarks/tcp_publish.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from weight_bus import checksums, packing  # noqa: E402
from weight_bus.host_staging import host_array  # noqa: E402
from weight_bus.tcp import TcpWeightPublisher  # noqa: E402

DRY = os.environ.get("FLEETRL_GPU_CHECKS_DRY", "") == "1"
BUCKET_BYTES = 256 << 20  # the default weight_bus.bucket_mib


def model_like(total_bytes: int, device: str) -> list[tuple[str, torch.Tensor]]:
    """bf16 tensors shaped like a transformer's: an embedding, then layers of attention, MLP and a small norm."""
    hidden, gen = 2048, torch.Generator(device=device).manual_seed(0)

    def weight(rows: int) -> torch.Tensor:
        return torch.randn(rows, hidden, generator=gen, device=device).to(torch.bfloat16)

    named, used, layer = [("embed_tokens.weight", weight(total_bytes // 8 // (2 * hidden)))], total_bytes // 8, 0
    while used < total_bytes:
        named += [
            (f"layers.{layer}.attn.qkv.weight", weight(3 * hidden)),
            (f"layers.{layer}.mlp.up_proj.weight", weight(4 * hidden)),
            (f"layers.{layer}.norm.weight", weight(1)[0]),
        ]
        used, layer = used + 7 * hidden * hidden * 2 + 2 * hidden, layer + 1
    return named


def crc_seconds(buffers: list, repeats: int) -> dict:
    """One version's per-entry crcs: sequential zlib vs the pool, alternating so both see the same machine."""
    sequential, pooled = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        expected = [zlib.crc32(buffer) for buffer in buffers]
        sequential.append(time.perf_counter() - started)
        started = time.perf_counter()
        got = checksums.crc32_many(buffers)
        pooled.append(time.perf_counter() - started)
        assert got == expected, "the pool's crcs differ from zlib's"
    return {"sequential_s": statistics.median(sequential), "pool_s": statistics.median(pooled)}


def pack_seconds(named, num_versions: int, recycle: bool, pinned: bool) -> float:
    """Median seconds to pack a version (from the third on) through a tcp publisher holding one version."""
    tcp = TcpWeightPublisher(keep_versions=1, recycle=recycle, new_buffer=functools.partial(host_array, pinned=pinned))
    seconds = []
    try:
        for version in range(1, num_versions + 1):
            started = time.perf_counter()
            buckets = list(packing.iter_buckets(named, BUCKET_BYTES, alloc=tcp.allocate))
            seconds.append(time.perf_counter() - started)
            tcp.hold(version, [bucket.data for bucket in buckets])
            del buckets
    finally:
        tcp.close()
    return statistics.median(seconds[2:])


def entry_views(named) -> list:
    """Every entry's bytes in its bucket, as the host mirror and receivers checksum them."""
    views = []
    for bucket in packing.iter_buckets(named, BUCKET_BYTES):
        views += [bucket.data[e.offset : e.offset + e.nbytes] for e in bucket.entries]
    return views


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64 if DRY else 512, help="bytes of weights per version (MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--versions", type=int, default=5, help="versions packed per mode (the first two unreported)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not DRY
    named = model_like(args.mib << 20, "cuda" if cuda else "cpu")
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    threads = checksums.shared_pool().num_threads
    crc = crc_seconds(entry_views(named), args.repeats)
    fresh = pack_seconds(named, args.versions, recycle=False, pinned=cuda)
    recycled = pack_seconds(named, args.versions, recycle=True, pinned=cuda)
    checksums.configure(1)  # the old publish: one thread checksums every byte
    old_publish = pack_seconds(named, args.versions, recycle=False, pinned=cuda)
    checksums.configure(threads)
    new_publish = recycled
    gbps = lambda seconds: round(nbytes / seconds / 1e9, 3)  # noqa: E731
    out = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dry": DRY,
        "cpu_cores": os.cpu_count(),
        "crc_threads": threads,
        "gb": round(nbytes / 1e9, 3),
        "num_tensors": len(named),
        "crc": {**crc, "speedup": crc["sequential_s"] / crc["pool_s"], "pool_GBps": gbps(crc["pool_s"])},
        "buckets": {"fresh_s": fresh, "recycled_s": recycled, "speedup": fresh / recycled},
        "publish": {
            "old_s": old_publish,
            "new_s": new_publish,
            "speedup": old_publish / new_publish,
            "old_GBps": gbps(old_publish),
            "new_GBps": gbps(new_publish),
        },
    }
    for part in ("crc", "buckets", "publish"):
        print(f"{part:8s} " + "  ".join(f"{k} {v:.3f}" for k, v in out[part].items()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
