"""Shared pieces of the GPU checks (scripts/gpu_checks.py): the check model and engine settings, generating
groups through RolloutEngine, comparing the engine's weights with the trainer's, timing weight updates."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK_MODEL = "qwen3-moe-1b"  # the GPU demo's 0.94 B Qwen3-MoE (12 layers, 48 experts top-4), warmed up once

# FLEETRL_GPU_CHECKS_DRY=1: the engine and mxfp8 sections' code on a CPU machine (tiny fp32 model, no routes, no
# device copies, MXFP8 only on the wire) to catch mistakes before a GPU lease; no figure of it means anything.
DRY = os.environ.get("FLEETRL_GPU_CHECKS_DRY", "") == "1"

# (substring of a parameter name, group): vLLM fuses q/k/v and the experts' gate/up, so sums are compared per
# (layer, group) on both sides; the first match wins.
_GROUPS = (
    ("q_norm", "qk_norm"),
    ("k_norm", "qk_norm"),
    ("q_proj", "attn_in"),
    ("k_proj", "attn_in"),
    ("v_proj", "attn_in"),
    ("qkv_proj", "attn_in"),
    ("o_proj", "attn_out"),
    ("w13", "experts_in"),
    ("gate_up", "experts_in"),
    ("experts", None),
    ("mlp.gate.", "router"),
    ("input_layernorm", "norm_in"),
    ("post_attention_layernorm", "norm_post"),
    ("embed_tokens", "embed"),
    ("lm_head", "lm_head"),
    ("model.norm", "norm"),
)


def check_model() -> str:
    os.environ.setdefault("FLEETRL_CACHE", "/tmp/fleetrl-cache")
    from launcher.tiny_models import tiny_model_dir

    return str(tiny_model_dir("qwen3-moe" if DRY else CHECK_MODEL))


def engine_config(**overrides):
    from protos.config import RolloutConfig

    values = dict(
        dtype="bfloat16",
        max_model_len=256,
        gpu_memory_utilization=0.3,
        kv_cache_gib=8,
        stream_interval=16,
        return_routed_experts="on",
        max_num_seqs=256,
    )
    if DRY:
        values.update(dtype="float32", max_model_len=256, kv_cache_gib=1, return_routed_experts="off")
        overrides.pop("quantization", None)
    return RolloutConfig(**{**values, **overrides})


def echo_prompts(count: int, seed: int = 0) -> list[list[int]]:
    import random

    from modeling.tiny_model import BOS_ID, DIGIT_IDS

    rng = random.Random(seed)
    return [[BOS_ID] + [rng.choice(DIGIT_IDS) for _ in range(3)] for _ in range(count)]


async def generate_groups(engine, prompts: list[list[int]], n: int, max_tokens: int, temperature: float = 1.0):
    """Generate through RolloutEngine and build the trainer's TrajectoryGroups (as the coordinator does)."""
    import asyncio

    import numpy as np

    from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan
    from rollout_service.engine import SamplingRequest

    async def one(index: int, prompt: list[int]):
        request = SamplingRequest(
            prompt,
            n,
            max_tokens,
            temperature,
            1.0,
            -1,
            0.0,
            [],
            index,
            0,
            True,
            request_id=f"check-{time.monotonic_ns()}-{index}",
            stream_interval=16,
        )
        samples = {}
        async for chunk in engine.generate(request):
            sample = samples.setdefault(chunk.sample_index, {"ids": [], "lps": [], "final": None})
            sample["ids"] += chunk.token_ids
            sample["lps"] += chunk.logprobs
            sample["final"] = chunk if chunk.finished else sample["final"]
        records = []
        for k in range(n):
            s = samples[k]
            routes = s["final"].routed_experts
            records.append(
                Sample(
                    Array.from_numpy(np.asarray(s["ids"], np.int32)),
                    Array.from_numpy(np.asarray(s["lps"], np.float32)),
                    [VersionSpan(*span) for span in s["final"].version_spans],
                    FinishReason.LENGTH,
                    float(k % 2),  # any non-uniform rewards: advantages that move the weights
                    routed_experts=None if routes is None else Array.from_numpy(np.asarray(routes)),
                )
            )
        return TrajectoryGroup(
            f"check-{index}-{time.monotonic_ns()}",
            f"p{index}",
            Array.from_numpy(np.asarray(prompt, np.int32)),
            records,
            "check",
            index,
            engine.policy_version,
            time.time(),
            sampling_temperature=temperature,
        )

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def decode_tok_s(engine, num_requests: int = 256, max_tokens: int = 128) -> float:
    """Tokens/s of one round of ``num_requests`` x ``max_tokens`` (ignore_eos), after a warm-up round."""
    rate = 0.0
    for _ in range(2):
        started = time.perf_counter()
        groups = await generate_groups(engine, echo_prompts(num_requests, seed=1), 1, max_tokens)
        rate = sum(len(g.samples[0].response_token_ids.to_numpy()) for g in groups) / (time.perf_counter() - started)
    return rate


def route_agreement(model_dir: str, groups) -> dict:
    """Per layer, the share of top-k experts vLLM and the HF reference (bf16, same tokens) agree on; also with
    vLLM's layers shifted by one, which a wrong layer order would look like."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer_service.routing_replay import record_routes

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    same, shifted = [], []
    for group in groups[:8]:
        sample = group.samples[0]
        ids = torch.tensor([list(group.prompt_token_ids.to_numpy()) + list(sample.response_token_ids.to_numpy())])
        with torch.no_grad(), record_routes(model) as recorder:
            model(input_ids=ids.cuda())
        hf = recorder.routes(*ids.shape)[0]  # [T, L, K]
        vllm = torch.from_numpy(sample.routed_experts.to_numpy().astype("int64"))  # [T - 1, L, K]
        hf = hf[: len(vllm)]
        overlap = lambda a, b: (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).float().mean(dim=(0, 2))  # noqa: E731
        same.append(overlap(vllm, hf))
        shifted.append(overlap(vllm[:, 1:], hf[:, :-1]))
    del model
    torch.cuda.empty_cache()
    same_L, shifted_L = torch.stack(same).mean(0), torch.stack(shifted).mean(0)
    return {
        "per_layer": [round(float(x), 4) for x in same_L],
        "min": float(same_L.min()),
        "shifted_mean": float(shifted_L.mean()),
    }


def megatron_trainer(model_dir: str):
    from protos.config import MegatronConfig, TrainerConfig
    from trainer_service.megatron.backend import MegatronBackend
    from trainer_service.trainer import Trainer

    config = TrainerConfig(
        backend="megatron",
        lr=3e-4,
        geo_mask=None,
        token_tis_cap=2.0,
        megatron=MegatronConfig(params_dtype="float32" if DRY else "bfloat16", routing_replay=True),
    )
    backend = MegatronBackend(model_dir, config, temperature=1.0, device="cpu" if DRY else "cuda")
    return backend, Trainer(backend, max_staleness=1, measure_replay_mismatch=True)


def weight_group(name: str) -> str:
    import re

    layer = re.search(r"layers\.(\d+)\.", name)
    group = next((g for key, g in _GROUPS if key in name), "other")
    if group is None:  # per-expert HF names: gate_proj / up_proj in, down_proj out; vLLM's w2 is out
        group = "experts_in" if ("gate_proj" in name or "up_proj" in name) else "experts_out"
    return f"{layer.group(1) if layer else '-'}:{group}"


def grouped_sums(sums: dict[str, float]) -> dict[str, float]:
    grouped: dict[str, float] = {}
    for name, value in sums.items():
        key = weight_group(name)
        grouped[key] = grouped.get(key, 0.0) + value
    return grouped


def expected_sums(named_tensors, codec) -> dict[str, float]:
    """Per-group fp64 sums of what the engine should hold: the tensors as sent, MXFP8 ones decoded as the worker."""
    from weight_bus.codecs import mxfp8

    sums = {}
    for name, tensor in named_tensors:
        if codec.quantizes(name, tensor):
            tensor = mxfp8.dequantize(*mxfp8.quantize(tensor), tensor.dtype)
        sums[name] = float(tensor.double().sum())
    return grouped_sums(sums)


async def served_equals(engine, expected: dict[str, float]) -> dict:
    """Compare the engine's parameters with the expected sums, group by group."""
    served = grouped_sums((await engine.llm.collective_rpc("fleetrl_param_sums"))[0])
    unequal = {
        key: [served.get(key), value]
        for key, value in expected.items()
        if abs(served.get(key, float("nan")) - value) > 1e-6 * max(1.0, abs(value))
    }
    return {"groups": len(expected), "unequal": dict(list(unequal.items())[:8]), "equal": not unequal}


def device_copy_s(nbytes: int) -> float:
    """Seconds of one device-to-device copy of ``nbytes`` (median of 5): the ceiling a weight update compares to."""
    import statistics

    import torch

    if DRY:
        return 1.0
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


async def update_engine(engine, backend, version: int, bus, keys, redis_url: str, result: Result, label: str):
    """Publish the trainer's weights as ``version`` over ``bus`` and update the engine; records time and equality."""
    import redis
    import redis.asyncio as aioredis

    from rollout_service.weight_sync import WeightFollower
    from trainer_service.publisher import WeightPublisher
    from weight_bus import packing

    publisher = WeightPublisher(redis.Redis.from_url(redis_url), keys, bus)
    follower = WeightFollower(engine, aioredis.Redis.from_url(redis_url), keys, bus, "gpu-check")
    try:
        publish_s = publisher.publish(version, backend.export_hf_weights())
        started = time.monotonic()
        await follower.update_to(version)
        load_s = time.monotonic() - started
        nbytes = publisher.last_stats.num_bytes
    finally:
        publisher.close()
    comparison = await served_equals(
        engine, expected_sums(backend.export_hf_weights(), packing.WireCodec.from_config(bus))
    )
    copy_s = device_copy_s(nbytes)
    result[label] = {
        "version": engine.policy_version,
        "source": follower.last_source,
        "bytes": nbytes,
        "publish_s": round(publish_s, 3),
        "load_s": round(load_s, 3),
        "paused_s": round(follower.last_paused_s, 3),
        "GBps": round(nbytes / (publish_s + load_s) / 1e9, 2),
        "device_copy_s": round(copy_s, 5),
        "device_copy_GBps": round(nbytes / copy_s / 1e9, 1),
        "ratio_to_device_copy": round(copy_s / (publish_s + load_s), 4),
        "weights_equal_trainer": comparison,
    }


class Result(dict):
    """A section's figures, written to its file after every change (a section that dies keeps what it had)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = Path(path)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.path.write_text(json.dumps(self, default=float))
