"""Full fine-tuning vs LoRA: one MegatronBackend training step of a scaled-down random Beam, side by side.

Builds a Beam ``config.json`` (default: 12 layers with 2 dense, hidden 2048, 64 experts top-8 in 8 groups
(keep 4), expert FFN 768, GQA 16/4 x 128 with the elementwise output gate, window 512 with a NoPE/SSMax layer
every 6, soft-cap 30, vocab 32768), random-initialises it through megatron-bridge
(``MegatronBackend(random_init=True)``) once per mode:

    full              full fine-tuning, grouped experts (trainer.megatron.moe_grouped_experts)
    lora              LoRA on every attention and expert linear, grouped experts with one batched adapter per
                      expert projection (trainer.megatron.moe_grouped_lora)
    lora_per_expert   the same LoRA on SequentialMLP experts, one adapter module per expert (megatron-bridge's)
    full_offload      full fine-tuning as seed 000 runs it where the model does not fit otherwise: full activation
                      recompute and the optimizer state in host memory (trainer.megatron.recompute=full,
                      optimizer_cpu_offload); CUDA only, in the default modes on a GPU

Expert adapters get rank / top_k with ``--normalize-moe-lora`` (the default, as SkyRL's Beam LoRA recipe).
Times ``train_step`` alternately on the same random batch and reports, per mode: step time, the memory the
backend holds after it is built (weights, gradient buffers, optimizer state), the step's peak on top of that,
the trainable parameter count and the bytes a weight publish sends: ``publish_gib`` with
``trainer.lora.sync='merged'`` (the adapted layers merged), ``adapter_publish_gib`` with ``'adapters'`` (the
adapters in PEFT names, as vLLM's LoRA slot takes them). A mode that fails is reported in the JSON with its error;
the others run.

Prints one line per round and mode, then one JSON object with the ratios to full. On a CUDA machine:
    PYTHONPATH=. python3 -u benchmarks/lora_step.py
CPU smoke run (tiny sizes, fp32):
    .venv/bin/python benchmarks/lora_step.py --tiny
The full Beam's publish bytes (501B, bf16, rank 64 / expert rank 8), counted from the exports' shapes on the meta
device (no training, no weights; about a minute on a CPU):
    .venv/bin/python benchmarks/lora_step.py --beam-501b-bytes --lora-rank 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from trainer_step import make_batch, profile_step  # benchmarks/ is on sys.path when a benchmark runs as a script

SIZES = {
    "full": dict(
        layers=12,
        dense=2,
        hidden=2048,
        experts=64,
        top_k=8,
        groups=8,
        group_topk=4,
        expert_ffn=768,
        dense_ffn=6144,
        heads=16,
        kv_heads=4,
        head_dim=128,
        vocab=32768,
        seq=4096,
        batch=2,
    ),
    "tiny": dict(
        layers=6,
        dense=1,
        hidden=64,
        experts=16,
        top_k=4,
        groups=4,
        group_topk=2,
        expert_ffn=64,
        dense_ffn=128,
        heads=4,
        kv_heads=2,
        head_dim=32,
        vocab=256,
        seq=64,
        batch=2,
    ),
}


def write_config(path: str, size: dict) -> None:
    from modeling.beam import BeamConfig

    BeamConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        num_hidden_layers=size["layers"],
        first_k_dense_replace=size["dense"],
        intermediate_size=size["dense_ffn"],
        moe_intermediate_size=size["expert_ffn"],
        n_routed_experts=size["experts"],
        num_experts_per_tok=size["top_k"],
        n_group=size["groups"],
        topk_group=size["group_topk"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        head_dim=size["head_dim"],
        sliding_window=min(512, size["seq"] // 4),
        max_position_embeddings=size["seq"],
        architectures=["BeamForCausalLM"],
    ).save_pretrained(path)


def build(model_dir: str, config, cuda: bool) -> tuple[object, dict]:
    from trainer_service.megatron.backend import MegatronBackend

    if cuda:
        torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() if cuda else 0
    started = time.perf_counter()
    backend = MegatronBackend(model_dir, config, device="cuda" if cuda else "cpu", random_init=True)
    parameters = list(backend.model[0].parameters())
    published = sum(t.numel() * t.element_size() for _, t in backend.export_hf_weights())
    adapters = (
        sum(t.numel() * t.element_size() for _, t in backend.export_adapter_weights()) if config.lora.enabled else 0
    )
    facts = {
        "build_s": round(time.perf_counter() - started, 1),
        "params_b": round(sum(p.numel() for p in parameters) / 1e9, 3),
        "trainable_m": round(sum(p.numel() for p in parameters if p.requires_grad) / 1e6, 2),
        "publish_gib": round(published / 2**30, 3),
        "adapter_publish_gib": round(adapters / 2**30, 6) if adapters else None,
        "adapter_over_merged": round(adapters / published, 5) if adapters else None,
        "held_gib": round((torch.cuda.memory_allocated() - allocated) / 2**30, 2) if cuda else None,
    }
    return backend, facts


def time_steps(backend, batch, warmup: int, steps: int, cuda: bool) -> tuple[list[float], float | None]:
    times = []
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = backend.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - started)
        assert metrics["skipped"] == 0.0, metrics
    step_peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    return times, step_peak


MODES = ["full", "lora", "lora_per_expert", "full_offload"]


def configs(args, cuda: bool) -> dict:
    from protos.config import LoraConfig, MegatronConfig, TrainerConfig

    def megatron(grouped_lora: bool, **switches) -> MegatronConfig:
        return MegatronConfig(
            params_dtype="bfloat16" if cuda else "float32",
            moe_token_dispatcher="alltoall" if cuda else "allgather",
            moe_grouped_lora=grouped_lora,
            **switches,
        )

    lora = LoraConfig(rank=args.lora_rank, alpha=2 * args.lora_rank, normalize_moe_lora=args.normalize_moe_lora)
    every = {
        "full": TrainerConfig(backend="megatron", lr=1e-6, geo_mask=None, megatron=megatron(True)),
        "lora": TrainerConfig(backend="megatron", lr=1e-5, geo_mask=None, megatron=megatron(True), lora=lora),
        "lora_per_expert": TrainerConfig(
            backend="megatron", lr=1e-5, geo_mask=None, megatron=megatron(False), lora=lora
        ),
    }
    if "full_offload" in args.modes:  # validated only when asked for: offload needs bf16 params (CUDA)
        offload = megatron(True, recompute="full", optimizer_cpu_offload=True)
        every["full_offload"] = TrainerConfig(backend="megatron", lr=1e-6, geo_mask=None, megatron=offload)
    return {mode: every[mode] for mode in args.modes}


def timed_rounds(backends: dict, result: dict, batch, args, cuda: bool) -> None:
    """Alternate the modes round by round; a mode that fails keeps its error and drops out."""
    for round_index in range(args.rounds):
        for mode, backend in list(backends.items()):
            try:
                round_times, step_peak = time_steps(backend, batch, args.warmup, args.steps, cuda)
            except Exception as error:  # a benchmark reports a failed mode in its JSON and goes on
                print(f"{mode}: failed: {error!r}", flush=True)
                result[mode]["error"] = repr(error)[:500]
                del backends[mode]
                continue
            result[mode].setdefault("steps_s", []).extend(round(t, 4) for t in round_times)
            if step_peak is not None:
                result[mode]["step_peak_gib"] = round(step_peak, 2)
            print(f"round {round_index} {mode}: median {statistics.median(round_times):.4f} s/step", flush=True)


def beam_501b_publish_bytes(rank: int, alpha: float) -> dict:
    """What one publish sends for the full Beam (``BeamConfig`` defaults, bf16) under LoRA rank ``rank`` on every
    target with normalize_moe_lora: the torch backend's own exports on the meta device (shapes only), merged
    adapted layers vs adapters; plus the size of vLLM's MoE LoRA slots at the dense rank against the expert rank."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from modeling.beam import BeamConfig
    from protos.config import LoraConfig
    from trainer_service import lora

    config = BeamConfig()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    lora_config = LoraConfig(rank=rank, alpha=alpha, normalize_moe_lora=True, sync="adapters")
    lora.apply_lora(model, lora_config)
    adapters = sum(t.numel() * t.element_size() for _, t in lora.adapter_weights(model, lora_config))
    state = revert_weight_conversion(model, lora.merged_state(model))
    merged = sum(t.numel() * t.element_size() for _, t in lora.published(iter(state.items()), lora_config))
    expert_rank = lora.expert_adapter_rank(model, lora_config)
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    # vLLM's FusedMoEWithLoRA slot per layer: w1 / w3 A [E, r, H], B [E, I, r]; w2 A [E, r, I], B [E, H, r].
    hidden, width, experts = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
    slot_elements = experts * (2 * (hidden + width) + width + hidden) * moe_layers
    return {
        "rank": rank,
        "expert_rank": expert_rank,
        "full_gib": round(full / 2**30, 2),
        "merged_publish_gib": round(merged / 2**30, 2),
        "adapter_publish_gib": round(adapters / 2**30, 3),
        "adapter_over_merged": round(adapters / merged, 5),
        "moe_lora_slot_gib_at_rank": round(slot_elements * rank * 2 / 2**30, 2),
        "moe_lora_slot_gib_at_expert_rank": round(slot_elements * expert_rank * 2 / 2**30, 2),
    }


def ratios_to_full(result: dict, cuda: bool) -> dict:
    """Each other mode's figures over full's; ``adapter_publish_gib`` over full's ``publish_gib`` (what a full
    fine-tuning publish sends); with ``full_offload`` measured, each LoRA mode's step time over its too."""
    keys = ["step_s", "trainable_m", "publish_gib"] + (["held_gib", "step_peak_gib"] if cuda else [])
    full = result.get("full", {})
    ratios = {}
    for mode in result["modes"]:
        if mode == "full" or "error" in result[mode] or "error" in full:
            continue
        ratios[f"{mode}_over_full"] = {key: round(result[mode][key] / full[key], 4) for key in keys if full.get(key)}
        if result[mode].get("adapter_publish_gib") and full.get("publish_gib"):
            ratio = result[mode]["adapter_publish_gib"] / full["publish_gib"]
            ratios[f"{mode}_over_full"]["adapter_publish_gib"] = round(ratio, 5)
    offload_s = result.get("full_offload", {}).get("step_s")
    for mode in result["modes"]:
        if mode.startswith("lora") and offload_s and result[mode].get("step_s"):
            ratios[f"{mode}_over_full_offload"] = {"step_s": round(result[mode]["step_s"] / offload_s, 4)}
    return ratios


def main() -> None:
    import modeling.beam  # noqa: F401 - registers model_type "beam"

    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU smoke sizes, fp32")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--normalize-moe-lora", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="alternate the modes this often (order effects)")
    parser.add_argument("--profile", action="store_true", help="then profile one step per mode (top ops)")
    parser.add_argument(
        "--beam-501b-bytes", action="store_true", help="only count the full Beam's publish bytes (meta device)"
    )
    args = parser.parse_args()
    if args.beam_501b_bytes:
        print(json.dumps(beam_501b_publish_bytes(args.lora_rank, float(args.lora_rank))))
        return
    size = SIZES["tiny" if args.tiny else "full"]
    cuda = torch.cuda.is_available() and not args.tiny
    args.modes = args.modes or [mode for mode in MODES if cuda or mode != "full_offload"]
    if "full_offload" in args.modes and not cuda:
        parser.error("--modes full_offload needs CUDA (the optimizer offload keeps fp32 copies of bf16 params)")
    result: dict = {
        "sizes": size,
        "dtype": "bfloat16" if cuda else "float32",
        "lora_rank": args.lora_rank,
        "normalize_moe_lora": args.normalize_moe_lora,
        "modes": args.modes,
    }
    backends = {}
    with tempfile.TemporaryDirectory() as model_dir:
        write_config(model_dir, size)
        for mode, config in configs(args, cuda).items():
            try:
                backends[mode], result[mode] = build(model_dir, config, cuda)
            except Exception as error:  # reported in the JSON; the other modes still run
                result[mode] = {"error": repr(error)[:500]}
            print(f"{mode}: built {result[mode]}", flush=True)
    batch = make_batch(size)  # trainer_step's: random tokens, loss on the second half
    timed_rounds(backends, result, batch, args, cuda)
    for mode in backends:
        result[mode]["step_s"] = round(statistics.median(result[mode]["steps_s"]), 4)
    if args.profile:
        for mode, backend in backends.items():
            profile_step(mode, backend, batch, cuda)
    result.update(ratios_to_full(result, cuda))
    if cuda:
        result["device"] = torch.cuda.get_device_name()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
