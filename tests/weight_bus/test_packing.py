"""Weight bus on CPU: bucket packing, alignment and checksums (weight_bus.packing)."""

from __future__ import annotations

import pytest
import torch

from tests.weight_bus.bus_tensors import assert_same_tensors, joined_buckets, named_tensors
from weight_bus.packing import ALIGN_BYTES, ChecksumError, iter_tensors, pack, total_nbytes, verify

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------------------------------------
# packing


def test_pack_and_iter_tensors_round_trip_dtypes_shapes_and_buckets():
    tensors = named_tensors()
    manifest, buckets = pack(tensors, version=3, bytes_per_bucket=512, publisher_address="h:1")
    assert manifest.version == 3 and manifest.publisher_address == "h:1" and manifest.transport == "tcp"
    assert manifest.bucket_nbytes == [len(b) for b in buckets]
    assert len(buckets) > 3  # the small tensors spill over several buckets
    assert total_nbytes(manifest) == sum(len(b) for b in buckets)
    by_name = {entry.name: entry for entry in manifest.tensors}
    assert by_name["norm.weight"].dtype == "bfloat16"
    assert by_name["scalar"].shape == () and by_name["scalar"].nbytes == 4
    for entry in manifest.tensors:
        assert entry.offset % ALIGN_BYTES == 0
        assert entry.codec == "raw"
    buffer = joined_buckets(buckets)
    verify(manifest, memoryview(buffer))
    assert_same_tensors(tensors, [(n, t.clone()) for n, t in iter_tensors(manifest, memoryview(buffer))])


def test_tensor_larger_than_the_bucket_gets_a_bucket_of_its_own():
    small, big = torch.ones(4), torch.arange(1000, dtype=torch.float32)
    manifest, buckets = pack([("a", small), ("big", big), ("c", small)], version=1, bytes_per_bucket=256)
    entries = {e.name: e for e in manifest.tensors}
    assert entries["big"].bucket != entries["a"].bucket != entries["c"].bucket
    assert entries["big"].offset == 0
    assert manifest.bucket_nbytes[entries["big"].bucket] == 4032  # 4000 bytes padded to 64-byte alignment
    got = dict(iter_tensors(manifest, memoryview(joined_buckets(buckets))))
    assert torch.equal(got["big"], big)


def test_packing_copies_non_contiguous_tensors_in_logical_order():
    source = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    manifest, buckets = pack([("t", source)], version=1, bytes_per_bucket=1 << 20)
    ((_, got),) = list(iter_tensors(manifest, memoryview(joined_buckets(buckets))))
    assert torch.equal(got, source)


def test_checksums_pass_on_intact_buckets():
    manifest, buckets = pack(named_tensors(), version=1, bytes_per_bucket=512)
    verify(manifest, memoryview(joined_buckets(buckets)))  # no raise


def test_corrupted_bucket_is_refused_with_tensor_name():
    manifest, buckets = pack(named_tensors(), version=4, bytes_per_bucket=512)
    buffer = joined_buckets(buckets)
    entry = next(e for e in manifest.tensors if e.name == "position_ids")
    start = sum(manifest.bucket_nbytes[: entry.bucket]) + entry.offset
    buffer[start + 5] ^= 0x01
    with pytest.raises(ChecksumError, match=r"v4: tensor position_ids .*checksum"):
        verify(manifest, memoryview(buffer))


def test_zero_element_tensor_round_trips():
    tensors = [("empty", torch.zeros(0, 4)), ("w", torch.ones(3))]
    manifest, buckets = pack(tensors, 1, bytes_per_bucket=1024)
    assert_same_tensors(tensors, list(iter_tensors(manifest, memoryview(joined_buckets(buckets)))))


def test_every_tensor_is_aligned_in_the_end_to_end_buffer():
    tensors = [("a", torch.arange(3, dtype=torch.int8)), ("b", torch.arange(5, dtype=torch.float32))]
    manifest, _ = pack(tensors, 1, bytes_per_bucket=16)
    starts = [sum(manifest.bucket_nbytes[: e.bucket]) + e.offset for e in manifest.tensors]
    assert all(start % ALIGN_BYTES == 0 for start in starts), (manifest.bucket_nbytes, starts)
