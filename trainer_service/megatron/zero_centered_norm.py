"""Zero-centred norms ((1 + weight) scale) for megatron-core's local layer spec.

Nemotron's LayerNorm1p and Qwen3-Next's RMSNorm keep their weight centred on zero and scale by ``1 + weight``;
megatron-bridge asks for that with ``layernorm_zero_centered_gamma``. Only Transformer Engine's norms implement it:
the local spec's ``WrappedTorchNorm`` (the one fleetrl builds without TE) refuses it with an assertion. ``install``
makes ``WrappedTorchNorm`` build the norms below for such configs and leaves every other config to the stock code.
The stored weight is the checkpoint's own (zero-centred) tensor, so the bridge's mappings stay identities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """``LayerNorm`` scaled by ``1 + weight`` (transformers' ``NemotronLayerNorm1P``)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """``RMSNorm`` scaled by ``1 + weight`` (transformers' ``Qwen3NextRMSNorm``)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


ZERO_CENTERED_NORMS = {"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}


def build_zero_centered_norm(config, hidden_size: int, eps: float = 1e-5) -> torch.nn.Module:
    """The norm ``WrappedTorchNorm`` would build for ``config``, scaled by ``1 + weight``."""
    if config.normalization not in ZERO_CENTERED_NORMS:
        raise ValueError(
            f"normalization: zero-centred gamma is implemented for {sorted(ZERO_CENTERED_NORMS)} without"
            f" Transformer Engine, not {config.normalization!r}"
        )
    if config.persist_layer_norm or config.sequence_parallel or config.memory_efficient_layer_norm:
        # What WrappedTorchNorm refuses for every config: keep its refusals.
        raise ValueError(
            "persist_layer_norm, sequence_parallel, memory_efficient_layer_norm: the torch norms take none of them"
        )
    return ZERO_CENTERED_NORMS[config.normalization](hidden_size, eps=eps)


def install() -> None:
    """Make megatron-core's ``WrappedTorchNorm`` build a zero-centred norm when the config asks for one (once)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    stock = WrappedTorchNorm.__dict__["__new__"].__func__
    if getattr(stock, "zero_centered", False):
        return

    def new(cls, config, hidden_size: int, eps: float = 1e-5, *args, **kwargs):
        if config.layernorm_zero_centered_gamma:
            return build_zero_centered_norm(config, hidden_size, eps)
        return stock(cls, config, hidden_size, eps, *args, **kwargs)

    new.zero_centered = True
    WrappedTorchNorm.__new__ = staticmethod(new)
