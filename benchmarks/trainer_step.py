"""One MegatronBackend training step of a random MoE: SequentialMLP vs grouped experts, and R3 vs natural routing.

Builds a Qwen3-MoE HF config (default: 8 layers, hidden 2048, 64 experts top-8, expert FFN 1024, GQA 16/4,
vocab 32768), random-initialises it through megatron-bridge (``MegatronBackend(random_init=True)``), and times
``train_step`` on random tokens in three modes:

    sequential    megatron-core's SequentialMLP experts (trainer.megatron.moe_grouped_experts=false), natural routing
    grouped       GroupedExperts (grouped matmuls), natural routing
    grouped_r3    GroupedExperts, replaying routes recorded from a forward of the same batch (R3)

grouped and grouped_r3 share one backend and alternate round by round; sequential runs first on its own backend.
Each backend is built in a child process of its own, one after the other (two 3.4 B-parameter backends with Adam
state do not fit one H200, and megatron keeps a built model referenced, so only a process exit frees it). A mode
that fails (out of memory, a kernel error, a crashed child) is reported in the JSON with its error; the others run.

Model FLOPs per step (3x forward, recompute not counted):
    forward = 2 * tokens * (attention projections + router + top_k experts + LM head, per-token parameters)
            + 2 * 2 * batch * seq^2 * heads * head_dim * layers / 2   (QK^T and AV, causal half)

Prints one line per round and mode and, last, one JSON object; ``--profile`` then prints the top ops of one step per
mode (GPU time on CUDA). On a CUDA machine:
    PYTHONPATH=. python3 -u benchmarks/trainer_step.py [--profile]
CPU smoke run (tiny sizes, fp32):
    .venv/bin/python benchmarks/trainer_step.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
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


# mode -> (grouped experts, replay recorded routes); modes that share a backend alternate round by round.
MODES = {"sequential": (False, False), "grouped": (True, False), "grouped_r3": (True, True)}


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


def build(model_dir: str, grouped: bool, cuda: bool):
    from protos.config import MegatronConfig, TrainerConfig
    from trainer_service.megatron.backend import MegatronBackend

    megatron = MegatronConfig(
        params_dtype="bfloat16" if cuda else "float32",
        moe_token_dispatcher="alltoall" if cuda else "allgather",
        moe_grouped_experts=grouped,
    )
    config = TrainerConfig(backend="megatron", lr=1e-6, geo_mask=None, megatron=megatron)
    return MegatronBackend(model_dir, config, device="cuda" if cuda else "cpu", random_init=True)


def profile_step(mode: str, backend, batch, cuda: bool, routes=None) -> None:
    """Print the top ops of one ``train_step`` under ``torch.profiler`` (GPU time on CUDA, else CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        backend.train_step(batch, routed_experts=routes)
        if cuda:
            torch.cuda.synchronize()
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"--- {mode}: top ops by {sort_by}")
    print(profiler.key_averages().table(sort_by=sort_by, row_limit=18, max_name_column_width=60), flush=True)


def recorded_routes(backend, batch, size: dict) -> torch.Tensor:
    from trainer_service.megatron.routing_replay import megatron_record_routes

    with megatron_record_routes(backend.model) as recorder:
        backend.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    return recorder.routes(size["batch"], size["seq"])


def run_backend(model_dir: str, modes: list[str], size: dict, args, cuda: bool) -> dict[str, dict]:
    """Build one backend and alternate ``modes`` on it for ``args.rounds`` rounds; failures are results too."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results: dict[str, dict] = {mode: {"steps_s": []} for mode in modes}
    backend = None
    try:
        started = time.perf_counter()
        backend = build(model_dir, MODES[modes[0]][0], cuda)
        for mode in modes:
            results[mode]["build_s"] = round(time.perf_counter() - started, 1)
            results[mode]["params_b"] = round(sum(p.numel() for p in backend.model[0].parameters()) / 1e9, 3)
        batch = make_batch(size)
        routes = recorded_routes(backend, batch, size) if any(MODES[mode][1] for mode in modes) else None
        for round_index in range(args.rounds):
            for mode in modes:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                mode_routes = routes if MODES[mode][1] else None
                round_times = time_steps(backend, batch, mode_routes, args.warmup, args.steps, sync)
                results[mode]["steps_s"] += [round(t, 4) for t in round_times]
                if cuda:
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    results[mode]["peak_gib"] = round(max(peak, results[mode].get("peak_gib", 0.0)), 1)
                print(f"round {round_index} {mode}: median {statistics.median(round_times):.4f} s/step", flush=True)
        for mode in modes if args.profile else []:
            profile_step(mode, backend, batch, cuda, routes if MODES[mode][1] else None)
    except Exception as error:  # a benchmark reports a failed mode in its JSON and goes on with the others
        print(f"{modes}: failed: {error!r}", flush=True)
        for mode in modes:
            results[mode]["error"] = repr(error)[:500]
    finally:
        del backend
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return results


def summarize(results: dict[str, dict], flops: float) -> dict:
    """Median step time and TFLOP/s per mode, the grouped speed-up and R3's cost."""
    for mode, figures in results.items():
        if figures["steps_s"] and "error" not in figures:
            step_s = statistics.median(figures["steps_s"])
            figures.update(step_s=round(step_s, 4), tflops_per_gpu=round(flops / step_s / 1e12, 1))
            print(f"{mode}: {step_s:.4f} s/step, {flops / step_s / 1e12:.1f} TFLOP/s/GPU", flush=True)
    step = {mode: figures.get("step_s") for mode, figures in results.items()}
    summary = {}
    if step.get("sequential") and step.get("grouped"):
        summary["grouped_speedup"] = round(step["sequential"] / step["grouped"], 2)
    if step.get("grouped") and step.get("grouped_r3"):
        summary["r3_overhead_pct"] = round(100 * (step["grouped_r3"] / step["grouped"] - 1), 1)
    return summary


def child_json(argv: list[str]) -> dict:
    """Run ``python -u argv...`` in a fresh process and return the JSON object it prints last, so that a built
    backend's memory is all given back on exit (megatron keeps references to a built model) and a crash still
    leaves a result: ``{"error": ...}`` with the exit code and the output's last lines. The output passes through."""
    child = subprocess.Popen([sys.executable, "-u", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    result = None  # the child's JSON line; warnings (NCCL's at exit) may follow it
    for line in child.stdout:
        print(line, end="", flush=True)
        tail = (tail + [line.rstrip()])[-20:]
        if line.startswith("{"):
            result = json.loads(line)
    returncode = child.wait()
    if returncode == 0 and result is not None:
        return result
    return {"error": (f"exit code {returncode}: " + " | ".join(tail[-5:]))[:500]}


def run_in_child(modes: list[str], argv: list[str]) -> dict[str, dict]:
    """``run_backend`` for ``modes`` in a fresh process (``child_json``)."""
    results = child_json([__file__, *argv, "--modes", *modes, "--one-backend"])
    if "error" in results:
        return {mode: {"steps_s": [], "error": results["error"]} for mode in modes}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU smoke sizes, fp32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternate grouped/grouped_r3 this often")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--profile", action="store_true", help="then profile one step per mode (top ops)")
    parser.add_argument("--one-backend", action="store_true", help="internal: run the given modes of one backend")
    args = parser.parse_args()
    size = SIZES["tiny" if args.tiny else "full"]
    cuda = torch.cuda.is_available() and not args.tiny
    if args.one_backend:
        with tempfile.TemporaryDirectory() as model_dir:
            write_config(model_dir, size)
            print(json.dumps(run_backend(model_dir, args.modes, size, args, cuda)))
        return
    flops = model_flops(size)
    result: dict = {
        "sizes": size,
        "dtype": "bfloat16" if cuda else "float32",
        "model_tflop_per_step": round(flops / 1e12, 3),
        "modes": {},
    }
    argv = (
        [f"--warmup={args.warmup}", f"--steps={args.steps}", f"--rounds={args.rounds}"]
        + ["--tiny"] * args.tiny
        + ["--profile"] * args.profile
    )
    for sharing in (["sequential"], ["grouped", "grouped_r3"]):
        modes = [mode for mode in sharing if mode in args.modes]
        if modes:
            result["modes"].update(run_in_child(modes, argv))
    result.update(summarize(result["modes"], flops))
    if cuda:
        result["device"] = torch.cuda.get_device_name()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
