"""Test helper for R3: change a router so natural routing differs while recorded routes stay reproducible.

Imported by test_routing_replay.py and test_megatron_backend.py (tests/ has no packages, so by module name).
"""

from __future__ import annotations

import torch


def perturb_unused_experts(router_weights: list[torch.Tensor], routes_BTLK: torch.Tensor) -> None:
    """Copy, per layer, a used expert's router row (plus noise) onto every expert no token chose.

    Natural routing then changes (the copies compete with the originals) while the router logits of every
    recorded expert stay as they were, so replay must give back the recorded output.
    """
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer, weight in enumerate(router_weights):
            used = set(routes_BTLK[:, :, layer].flatten().tolist())
            unused = [e for e in range(weight.shape[0]) if e not in used]
            assert unused, "the test input must leave an expert unused in every layer"
            popular = int(routes_BTLK[:, :, layer, 0].flatten().mode().values)
            for expert in unused:
                noise = torch.randn(weight.shape[1], generator=generator) * weight[popular].norm() * 0.05
                weight[expert] = weight[popular] + noise
