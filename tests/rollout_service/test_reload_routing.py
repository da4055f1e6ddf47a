"""gpt-oss weight updates on vLLM's CPU engine (integration tier): vLLM's gpt-oss loader copies the experts and the
attention sinks past the weight loaders its layerwise reload counts, so rollout_service/reload_routing.py routes them
through. A committed update must move those parameters, and committing the checkpoint's own weights back must leave
every served parameter exactly as the engine's fresh load of that checkpoint left it. One engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from modeling.families import init_family
from protos.config import RolloutConfig
from protos.records import encode
from weight_bus import packing

pytestmark = pytest.mark.integration


def _stage(named: dict[str, torch.Tensor], directory: Path, version: int) -> tuple[str, bytes]:
    """``named`` packed as the weight bus packs them, in a staging file: (path, manifest bytes)."""
    manifest, buckets = packing.pack(iter(sorted(named.items())), version, 64 * 2**20)
    path = directory / f"staged-v{version}"
    path.write_bytes(b"".join(np.asarray(bucket).tobytes() for bucket in buckets))
    return str(path), encode(manifest)


async def _served_sums(engine) -> dict[str, float]:
    return (await engine.llm.collective_rpc("fleetrl_param_sums"))[0]


def test_gpt_oss_reload_serves_the_experts_and_sinks_of_a_fresh_load(tmp_path):
    from rollout_service.engine import RolloutEngine

    served = init_family("gpt_oss", tmp_path / "gpt_oss")
    checkpoint = load_file(served / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    # Every tensor moved (the checkpoint's expert biases are all zeros).
    moved = {name: t + 0.02 * torch.randn(t.shape, generator=generator) for name, t in checkpoint.items()}

    async def run() -> tuple[dict, dict, dict]:
        engine = RolloutEngine(str(served), RolloutConfig(max_model_len=256))
        try:
            await engine.start()
            fresh = await _served_sums(engine)
            await engine.commit_weights(1, *_stage(moved, tmp_path, 1))
            updated = await _served_sums(engine)
            await engine.commit_weights(2, *_stage(checkpoint, tmp_path, 2))
            return fresh, updated, await _served_sums(engine)
        finally:
            engine.shutdown()

    fresh, updated, restored = asyncio.run(run())
    bypassed = [name for name in fresh if name.endswith(("sinks", "w13_weight", "w2_weight", "w13_bias", "w2_bias"))]
    assert len(bypassed) == 2 * 5, bypassed  # 2 layers: sinks and the four fused expert tensors each
    assert all(updated[name] != fresh[name] for name in bypassed), {n: (fresh[n], updated[n]) for n in bypassed}
    assert restored == fresh
