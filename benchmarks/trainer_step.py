"""One MegatronBackend training step of a small random MoE, with and without R3 (rollout routing replay).

Builds a Qwen3-MoE HF config (default: 8 layers, hidden 2048, 64 experts top-8, expert FFN 1024, GQA 16/4,
vocab 32768), random-initialises it through megatron-bridge (``MegatronBackend(random_init=True)``), and times
``train_step`` on random tokens: plain, then replaying routes recorded from a forward of the same batch.

Model FLOPs per step (3x forward, recompute not counted):
    forward = 2 * tokens * (attention projections + router + top_k experts + LM head, per-token parameters)
            + 2 * 2 * batch * seq^2 * heads * head_dim * layers / 2   (QK^T and AV, causal half)

Prints one line per mode and, last, one JSON object. On a CUDA machine:
    PYTHONPATH=. python3 -u benchmarks/trainer_step.py
CPU smoke run (tiny sizes, fp32):
    .venv/bin/python benchmarks/trainer_step.py --tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

SIZES = {
    "full": dict(
        layers=8,
        hidden=2048,
        experts=64,
        top_k=8,
        expert_ffn=1024,
        heads=16,
        kv_heads=4,
        head_dim=128,
        vocab=32768,
        seq=4096,
        batch=2,
    ),
    "tiny": dict(
        layers=2,
        hidden=64,
        experts=8,
        top_k=2,
        expert_ffn=64,
        heads=2,
        kv_heads=1,
        head_dim=32,
        vocab=256,
        seq=64,
        batch=2,
    ),
}


def write_config(path: str, size: dict) -> None:
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=4 * size["hidden"],
        moe_intermediate_size=size["expert_ffn"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        head_dim=size["head_dim"],
        num_experts=size["experts"],
        num_experts_per_tok=size["top_k"],
        norm_topk_prob=True,
        max_position_embeddings=size["seq"],
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],  # AutoBridge picks its model bridge by architecture
    ).save_pretrained(path)


def model_flops(size: dict) -> float:
    hidden, head_dim = size["hidden"], size["head_dim"]
    attention = hidden * head_dim * (2 * size["heads"] + 2 * size["kv_heads"])
    experts = size["top_k"] * 3 * hidden * size["expert_ffn"]
    per_token = size["layers"] * (attention + hidden * size["experts"] + experts) + hidden * size["vocab"]
    tokens = size["batch"] * size["seq"]
    attention_scores = 2 * size["batch"] * size["seq"] ** 2 * size["heads"] * head_dim * size["layers"]
    return 3 * (2 * tokens * per_token + attention_scores)


def make_batch(size: dict):
    from trainer_service.batch import TrainBatch

    batch, seq = size["batch"], size["seq"]
    ids = torch.randint(3, size["vocab"], (batch, seq), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros(batch, seq - 1)
    loss_mask[:, seq // 2 :] = 1.0
    return TrainBatch(
        input_ids_BT=ids,
        attention_mask_BT=torch.ones_like(ids),
        loss_mask_BT=loss_mask,
        rollout_logprobs_BT=torch.full((batch, seq - 1), -10.0) * loss_mask,
        advantages_B=torch.linspace(-1.0, 1.0, batch),
        rewards_B=torch.zeros(batch),
        min_versions_B=torch.zeros(batch, dtype=torch.long),
        num_response_tokens=int(loss_mask.sum()),
    )


def time_steps(backend, batch, routes, warmup: int, steps: int, sync) -> list[float]:
    times = []
    for i in range(warmup + steps):
        sync()
        started = time.perf_counter()
        metrics = backend.train_step(batch, routed_experts=routes)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - started)
        assert metrics["skipped"] == 0.0, metrics
    return times


def main() -> None:
    from protos.config import MegatronConfig, TrainerConfig
    from trainer_service.megatron.backend import MegatronBackend
    from trainer_service.megatron.routing_replay import megatron_record_routes

    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU smoke sizes, fp32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternate plain/r3 this often (order effects)")
    args = parser.parse_args()
    size = SIZES["tiny" if args.tiny else "full"]
    cuda = torch.cuda.is_available() and not args.tiny
    megatron = MegatronConfig(
        params_dtype="bfloat16" if cuda else "float32", moe_token_dispatcher="alltoall" if cuda else "allgather"
    )
    config = TrainerConfig(backend="megatron", lr=1e-6, geo_mask=None, megatron=megatron)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as model_dir:
        write_config(model_dir, size)
        started = time.perf_counter()
        backend = MegatronBackend(model_dir, config, device="cuda" if cuda else "cpu", random_init=True)
        build_s = time.perf_counter() - started
    batch = make_batch(size)
    with megatron_record_routes(backend.model) as recorder:
        backend.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    routes = recorder.routes(size["batch"], size["seq"])
    flops = model_flops(size)
    result = {
        "sizes": size,
        "dtype": megatron.params_dtype,
        "build_s": round(build_s, 1),
        "model_tflop_per_step": round(flops / 1e12, 3),
        "params_b": round(sum(p.numel() for p in backend.model[0].parameters()) / 1e9, 3),
    }
    times: dict[str, list[float]] = {"plain": [], "r3": []}
    for round_index in range(args.rounds):
        for mode, mode_routes in (("plain", None), ("r3", routes)):
            round_times = time_steps(backend, batch, mode_routes, args.warmup, args.steps, sync)
            times[mode] += round_times
            print(f"round {round_index} {mode}: median {statistics.median(round_times):.4f} s/step", flush=True)
    for mode, mode_times in times.items():
        step_s = statistics.median(mode_times)
        result[mode] = {
            "step_s": round(step_s, 4),
            "tflops_per_gpu": round(flops / step_s / 1e12, 1),
            "steps_s": [round(t, 4) for t in mode_times],
        }
        print(f"{mode}: {step_s:.4f} s/step, {flops / step_s / 1e12:.1f} TFLOP/s/GPU", flush=True)
    result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None
    result["r3_overhead_pct"] = round(100 * (result["r3"]["step_s"] / result["plain"]["step_s"] - 1), 1)
    if cuda:
        result["device"] = torch.cuda.get_device_name()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
