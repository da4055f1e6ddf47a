"""Parallel crc32 of the weight bus (weight_bus.checksums): every value equals zlib.crc32 of the entry's whole bytes,
whatever the chunking, so the manifest's checksums are the same on the wire as before; receivers still refuse a
corrupted byte, naming the tensor."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from weight_bus import checksums, packing
from weight_bus.checksums import CHUNK_BYTES, ChecksumPool, crc32_combine

pytestmark = pytest.mark.unit

CHUNK = 64  # a small chunk, so that sizes around its boundaries stay small


def _bytes(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("len1, len2", [(0, 0), (0, 5), (5, 0), (1, 1), (63, 65), (1000, 4097), (3, 1 << 20)])
def test_crc32_combine_equals_zlib_of_the_concatenation(len1, len2):
    a, b = _bytes(len1, 1), _bytes(len2, 2)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len2) == zlib.crc32(np.concatenate([a, b]))


@pytest.mark.parametrize("num_threads", [1, 4])
def test_pool_crcs_equal_zlib_for_sizes_around_chunk_boundaries(num_threads):
    sizes = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1, 7 * CHUNK + 3, 0]
    buffers = [_bytes(size, seed) for seed, size in enumerate(sizes)]
    pool = ChecksumPool(num_threads, chunk_bytes=CHUNK)
    try:
        got = pool.crc32_many(buffers + [memoryview(buffers[4].tobytes())])  # memoryviews as receivers pass them
    finally:
        pool.close()
    assert got == [zlib.crc32(buffer) for buffer in buffers] + [zlib.crc32(buffers[4])]
    assert ChecksumPool(1).crc32_many([]) == []


def test_packed_entries_carry_zlib_crc32_of_their_bytes_across_chunk_boundaries():
    sizes = [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 2 * CHUNK_BYTES + 3]
    tensors = [(f"t{size}", torch.from_numpy(_bytes(size, size % 97))) for size in sizes]
    manifest, buckets = packing.pack(tensors, version=1, bytes_per_bucket=4 << 20)
    for (name, tensor), entry in zip(tensors, manifest.tensors, strict=True):
        assert entry.name == name and entry.checksum == zlib.crc32(tensor.numpy())
    assert len(buckets) == len(sizes) - 1  # 0 and 1 byte share the first bucket, each large one has its own


def test_verify_refuses_a_corrupted_byte_in_a_later_chunk_naming_the_tensor():
    tensors = [("small", torch.ones(4)), ("layers.0.big", torch.from_numpy(_bytes(2 * CHUNK_BYTES + 5)))]
    manifest, buckets = packing.pack(tensors, 7, 1 << 20)
    big = manifest.tensors[1]
    buckets[big.bucket][big.offset + CHUNK_BYTES + 17] ^= 0x01  # one bit, in the entry's second chunk
    joined = memoryview(np.concatenate(buckets))
    packing.verify(manifest, joined, bucket=0)  # the other bucket is intact
    with pytest.raises(packing.ChecksumError, match=r"v7: tensor layers\.0\.big \(bucket 1\) failed its checksum"):
        packing.verify(manifest, joined)


def test_the_shared_pool_is_made_once():
    assert checksums.shared_pool() is checksums.shared_pool()
    assert checksums.crc32_many([b"fleetrl"]) == [zlib.crc32(b"fleetrl")]


def test_configure_replaces_the_shared_pool_with_one_of_the_given_threads():
    threads = checksums.shared_pool().num_threads
    try:
        checksums.configure(1)
        assert checksums.shared_pool().num_threads == 1
        buffer = _bytes(3 * CHUNK_BYTES + 1)
        assert checksums.crc32_many([buffer, b""]) == [zlib.crc32(buffer), 0]
    finally:
        checksums.configure(threads)
