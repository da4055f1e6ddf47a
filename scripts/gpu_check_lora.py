"""GPU check section ``lora_adapter_sync`` (scripts/gpu_checks.py): adapter-only LoRA sync against merged weights.

The CPU engine serves LoRA only on dense models (rollout_service/lora_slot.py says why), so the expert adapters are
checked here, on the GPU engine (vLLM's Triton MoE LoRA kernels). For the tiny Qwen3-MoE (fused expert tensors in
HF, 8 experts top-2) and the tiny Beam (per-expert modules, 16 experts top-4, output gate in q_proj):

1. the torch trainer on the GPU with LoRA rank 8 / alpha 16 on every target and normalize_moe_lora (expert rank
   8 / top_k), random adapters (as if trained far);
2. engines of the same base: one with a LoRA slot (``rollout.lora``) taking the adapters over the weight bus
   (pinned host staging, tcp), one taking the same policy's merged weights as full weights, both in bf16 (vLLM's
   Triton LoRA kernels take fp16 / bf16 only), and a third taking the merged weights in fp32: the exact policy;
3. the same prompts, greedy, on all three: against the fp32 policy, the LoRA slot's |dlogp| must stay within twice
   the merged bf16 engine's (bf16 rounding is the floor both share) or 2e-4, over each pair's tokens up to the
   first greedy divergence; spans on the new version; and the bytes each publish sent.

``FLEETRL_GPU_CHECKS_DRY=1`` runs the same code on a CPU with the dense tiny models (no expert adapters), to catch
mistakes before a GPU lease; there the engines are fp32, the merged engine is the reference, and the tolerance is
2e-4 (the one the CPU test holds for dense and attention adapters). ``FLEETRL_LORA_CHECK_DTYPE`` sets the dtype of
the slot and merged engines (e.g. ``bfloat16`` in a dry run: the dense adapters' bf16 deviation against an fp32
reference on a CPU).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from gpu_check_helpers import DRY, Result, echo_prompts, generate_groups

RANK, ALPHA = 8, 16.0
LOGPROB_TOLERANCE = 2e-4
# The slot and merged engines' dtype: vLLM's GPU LoRA kernels take fp16 / bf16 only.
DTYPE = os.environ.get("FLEETRL_LORA_CHECK_DTYPE", "float32" if DRY else "bfloat16")


def lora_check_models() -> dict[str, str]:
    """name -> checkpoint directory: the MoE tiny models on a GPU, their dense stand-ins in a dry run."""
    from modeling.beam.tiny import init_tiny_beam
    from modeling.tiny_model import init_tiny, init_tiny_dense

    cache = Path(os.environ.get("FLEETRL_CACHE", "/tmp/fleetrl-cache"))
    if DRY:
        return {
            "qwen3_dense": str(init_tiny_dense(cache / "lora-check-qwen3-dense")),
            "beam_dense": str(init_tiny_beam(cache / "lora-check-beam-dense", first_k_dense_replace=6)),
        }
    return {
        "qwen3_moe": str(init_tiny(cache / "lora-check-qwen3-moe")),
        "beam": str(init_tiny_beam(cache / "lora-check-beam")),
    }


async def section_lora_adapter_sync(result: Result) -> None:
    from gpu_check_sections import register_beam_plugin

    from launcher.redis_server import EmbeddedRedis

    register_beam_plugin()
    redis_server = EmbeddedRedis().start()
    try:
        for name, model in lora_check_models().items():
            result[name] = await adapters_against_merged(name, model, redis_server.url)
    finally:
        redis_server.stop()
    result["all_equal"] = all(result[name].get("equal") for name in result if isinstance(result[name], dict))


def lora_trainer(model_dir: str):
    import torch

    from protos.config import LoraConfig, TrainerConfig
    from trainer_service.torch_backend import TorchBackend

    lora = LoraConfig(rank=RANK, alpha=ALPHA, normalize_moe_lora=not DRY, sync="adapters")
    backend = TorchBackend(model_dir, TrainerConfig(geo_mask=None, lora=lora), device="cpu" if DRY else "cuda")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in backend.model.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.4)
    return backend


def lora_engine_config(lora_slot: bool, expert_rank: int, dtype: str = DTYPE):
    from protos.config import RolloutConfig, RolloutLoraConfig

    slot = RolloutLoraConfig(enabled=lora_slot, max_rank=RANK, max_expert_rank=expert_rank)
    return RolloutConfig(
        dtype=dtype,
        max_model_len=256,
        gpu_memory_utilization=0.15,
        kv_cache_gib=1,
        enforce_eager=True,
        return_routed_experts="off",
        lora=slot,
    )


async def adapters_against_merged(name: str, model_dir: str, redis_url: str) -> dict:
    from rollout_service.engine import RolloutEngine

    backend = lora_trainer(model_dir)
    record = backend.adapter_record()
    configs = {"lora": lora_engine_config(True, record.expert_rank), "merged": lora_engine_config(False, 0)}
    if DTYPE != "float32":
        configs["reference"] = lora_engine_config(False, 0, "float32")
    figures: dict = {"expert_rank": record.expert_rank, "target_modules": record.target_modules, "dtype": DTYPE}
    async with contextlib.AsyncExitStack() as engines_open:
        engines = {}
        for role, config in configs.items():
            engines[role] = RolloutEngine(model_dir, config, server_id=f"{role}-{name}")
            await engines[role].start()
            engines_open.callback(engines[role].shutdown)
        probe = echo_prompts(8, seed=7)
        base = await generate_groups(engines["lora"], probe, 1, 16, temperature=0.0)
        for role, engine in engines.items():
            figures[role] = await publish_and_follow(engine, backend, role == "lora", f"{role}-{name}", redis_url)
        greedy = {
            role: await generate_groups(engine, probe, 1, 16, temperature=0.0) for role, engine in engines.items()
        }
    reference = greedy.get("reference", greedy["merged"])
    figures["lora_vs_reference"] = compare_greedy(greedy["lora"], reference)
    floor = compare_greedy(greedy["merged"], reference)["max_abs_logprob_diff"] if "reference" in greedy else 0.0
    figures["merged_vs_reference_max_abs_logprob_diff"] = floor
    figures["tolerance"] = max(LOGPROB_TOLERANCE, 2 * floor)
    figures["equal"] = figures["lora_vs_reference"]["max_abs_logprob_diff"] <= figures["tolerance"]
    figures["moved_from_base"] = sum(_tokens(a) != _tokens(b) for a, b in zip(greedy["lora"], base, strict=True))
    figures["adapter_over_merged_bytes"] = round(figures["lora"]["bytes"] / figures["merged"]["bytes"], 5)
    return figures


async def publish_and_follow(engine, backend, adapters: bool, run: str, redis_url: str) -> dict:
    """Publish the trainer's policy as v1 (adapters, or merged layers) and have ``engine`` follow it."""
    import redis
    import redis.asyncio as aioredis

    from protos.config import WeightBusConfig
    from protos.redis_keys import RedisKeys
    from rollout_service.weight_sync import WeightFollower
    from trainer_service.publisher import WeightPublisher

    keys, bus = RedisKeys(run), WeightBusConfig(bucket_mib=64)
    publisher = WeightPublisher(redis.Redis.from_url(redis_url), keys, bus)
    follower = WeightFollower(engine, aioredis.Redis.from_url(redis_url), keys, bus, "gpu-check")
    try:
        if adapters:
            publish_s = publisher.publish(1, backend.export_adapter_weights(), backend.adapter_record())
        else:
            publish_s = publisher.publish(1, backend.export_hf_weights())
        started = time.monotonic()
        await follower.update_to(1)
        load_s = time.monotonic() - started
    finally:
        publisher.close()
    buffer = publisher.staging.buffer
    return {
        "version": engine.policy_version,
        "bytes": publisher.last_stats.num_bytes,
        "tensors": publisher.last_stats.num_tensors,
        "publish_s": round(publish_s, 3),
        "load_s": round(load_s, 3),
        "paused_s": round(follower.last_paused_s, 3),
        "pinned_staging": None if buffer is None else bool(buffer.is_pinned()),
    }


def _tokens(group) -> list[int]:
    return group.samples[0].response_token_ids.to_numpy().tolist()


def compare_greedy(lora_groups, merged_groups) -> dict:
    """Tokens and log-probs of the same greedy prompts through two engines (the first's version spans), the
    log-probs over each prompt's tokens up to the first greedy divergence."""
    equal_prompts, max_diff, spans = 0, 0.0, set()
    for lora, merged in zip(lora_groups, merged_groups, strict=True):
        a, b = lora.samples[0], merged.samples[0]
        same = _tokens(lora) == _tokens(merged)
        equal_prompts += same
        pairs = zip(_tokens(lora), _tokens(merged), strict=True)  # same max_tokens, ignore_eos: same lengths
        length = next((i for i, (x, y) in enumerate(pairs) if x != y), len(_tokens(lora)))
        diffs = abs(a.rollout_logprobs.to_numpy()[:length] - b.rollout_logprobs.to_numpy()[:length])
        max_diff = max(max_diff, float(diffs.max()) if length else 0.0)
        spans.add(tuple((s.version, s.start, s.end) for s in a.version_spans))
    return {
        "prompts": len(lora_groups),
        "tokens_equal_prompts": equal_prompts,
        "max_abs_logprob_diff": max_diff,
        "spans": sorted(spans),
    }
