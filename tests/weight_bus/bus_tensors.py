"""Tensors and checks shared by the weight-bus tests of packing and the TCP transport."""

from __future__ import annotations

import torch


def joined_buckets(buckets: list[bytearray]) -> bytearray:
    """The buckets end to end, as a receiver's buffer holds them."""
    return bytearray(b"".join(bytes(b) for b in buckets))


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    """Dtypes, shapes and sizes that exercise the packing (a 512-byte bucket in the tests)."""
    gen = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(8, 4, generator=gen)),  # fp32
        ("norm.weight", torch.randn(16, generator=gen).to(torch.bfloat16)),  # bf16
        ("position_ids", torch.arange(10, dtype=torch.int64).reshape(2, 5)),  # int64
        ("big.weight", torch.randn(64, 8, generator=gen)),  # 2048 bytes > the 512-byte bucket
        ("scalar", torch.tensor(3.5)),  # 0-d
        *[(f"layer.{i}.bias", torch.full((3,), float(i))) for i in range(20)],  # many small tensors
    ]


def assert_same_tensors(expected: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]]) -> None:
    """Same names in order, and each tensor equal in dtype, shape and value."""
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, want), (_, have) in zip(expected, got, strict=False):
        assert have.dtype == want.dtype, name
        assert have.shape == want.shape, name
        assert torch.equal(have, want), name
