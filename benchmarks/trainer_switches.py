"""The Megatron trainer's speed and memory switches, each on and off, one ``MegatronBackend`` step at a time.

Same model and batch as benchmarks/trainer_step.py (its ``SIZES``, ``write_config``, ``make_batch`` and
``model_flops``): by default a 3.4 B-parameter Qwen3-MoE, 2 x 4,096 tokens, bf16. Settings (``--settings``), run in
this order every round (``--rounds``), so that each switch is measured next to its "off" state:

    stock                    every switch off: megatron-core's eager attention with a [B, 1, T, T] mask, whole
                             logits, torch's default AdamW
    fused_attention          trainer.megatron.fused_attention on (over stock)
    fused_lm_head_logprobs   trainer.fused_lm_head_logprobs on (over stock)
    fused_adam               trainer.megatron.fused_adam on (over stock)
    defaults                 fleetrl's defaults: the three above on
    recompute_selective      defaults + trainer.megatron.recompute=selective (core attention)
    recompute_full           defaults + trainer.megatron.recompute=full
    optimizer_cpu_offload    defaults + trainer.megatron.optimizer_cpu_offload (all of the optimizer state; CUDA only)

Each setting builds its own backend (the switches act at build time) in a child process of its own (megatron keeps
a built model referenced, so only the process's exit frees it: two 3.4 B backends with Adam state would not fit
one H200), and takes ``--warmup`` then ``--steps`` timed steps (median s/step). Peak memory: on a GPU
``max_memory_allocated`` over the timed steps (parameters, gradients and optimizer state included); on a CPU
(``--tiny``) the bytes of live tensors created during one extra step (activations and temporaries only). A setting
that fails is recorded with its error and the run goes on; the last line printed is one JSON object. On a CUDA machine:
    PYTHONPATH=. python3 -u benchmarks/trainer_switches.py
CPU run (tiny sizes, fp32):
    .venv/bin/python benchmarks/trainer_switches.py --tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import traceback

import torch
from fused_logprobs import LiveTensorMeter  # benchmarks/ is on sys.path when a benchmark runs as a script
from trainer_step import SIZES, child_json, make_batch, model_flops, write_config

STOCK = {"megatron.fused_attention": False, "megatron.fused_adam": False, "fused_lm_head_logprobs": False}
DEFAULTS = {"megatron.fused_attention": True, "megatron.fused_adam": True, "fused_lm_head_logprobs": True}
SETTINGS = {
    "stock": STOCK,
    "fused_attention": STOCK | {"megatron.fused_attention": True},
    "fused_lm_head_logprobs": STOCK | {"fused_lm_head_logprobs": True},
    "fused_adam": STOCK | {"megatron.fused_adam": True},
    "defaults": DEFAULTS,
    "recompute_selective": DEFAULTS | {"megatron.recompute": "selective"},
    "recompute_full": DEFAULTS | {"megatron.recompute": "full"},
    "optimizer_cpu_offload": DEFAULTS | {"megatron.optimizer_cpu_offload": True},
}


def trainer_config(switches: dict, cuda: bool):
    from protos.config import MegatronConfig, TrainerConfig

    megatron = {key.removeprefix("megatron."): value for key, value in switches.items() if key.startswith("megatron.")}
    trainer = {key: value for key, value in switches.items() if not key.startswith("megatron.")}
    parallel = dict(
        params_dtype="bfloat16" if cuda else "float32", moe_token_dispatcher="alltoall" if cuda else "allgather"
    )
    return TrainerConfig(
        backend="megatron", lr=1e-6, geo_mask=None, megatron=MegatronConfig(**parallel, **megatron), **trainer
    )


def run_setting(name: str, model_dir: str, batch, args, cuda: bool) -> dict:
    """Build, warm up, time; the backend is dropped when this returns."""
    from trainer_service.megatron.backend import MegatronBackend

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    started = time.perf_counter()
    backend = MegatronBackend(
        model_dir, trainer_config(SETTINGS[name], cuda), device="cuda" if cuda else "cpu", random_init=True
    )
    build_s = time.perf_counter() - started
    for _ in range(args.warmup):
        backend.train_step(batch)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        sync()
        started = time.perf_counter()
        metrics = backend.train_step(batch)
        sync()
        times.append(time.perf_counter() - started)
        if metrics["skipped"]:
            raise RuntimeError(f"{name}: a non-finite step ({metrics})")
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        with LiveTensorMeter() as meter:
            backend.train_step(batch)
        peak = meter.peak
    return {
        "build_s": round(build_s, 1),
        "steps_s": [round(t, 4) for t in times],
        "peak_mib": round(peak / 2**20, 1),
    }


def run_one_setting(name: str, size: dict, args, cuda: bool) -> dict:
    """``run_setting`` in this (child) process; a failure is its result."""
    with tempfile.TemporaryDirectory() as model_dir:
        write_config(model_dir, size)
        try:
            return run_setting(name, model_dir, make_batch(size), args, cuda)
        except Exception as error:  # recorded; the parent goes on with the other settings
            traceback.print_exc()
            return {"error": f"{type(error).__name__}: {str(error)[:300]}"}


def summarize(runs: list[dict], flops: float) -> dict:
    errors = [run["error"] for run in runs if "error" in run]
    times = [t for run in runs if "error" not in run for t in run["steps_s"]]
    if not times:
        return {"error": errors[0]}
    step_s = statistics.median(times)
    return {
        "step_s": round(step_s, 4),
        "tflops_per_gpu": round(flops / step_s / 1e12, 1),
        "peak_mib": max(run["peak_mib"] for run in runs if "error" not in run),
        "build_s": [run["build_s"] for run in runs if "error" not in run],
        "steps_s": times,
        **({"errors": errors} if errors else {}),
    }


def main() -> None:
    from trainer_service.megatron import beam

    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU smoke sizes, fp32")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole sequence of settings")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset, in run order")
    parser.add_argument("--one-setting", choices=list(SETTINGS), help="internal: run this setting, print its JSON")
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; known: {', '.join(SETTINGS)}")
    size = SIZES["tiny" if args.tiny else "full"]
    cuda = torch.cuda.is_available() and not args.tiny
    if args.one_setting:
        beam.register()  # the CPU shims, before megatron is imported
        print(json.dumps(run_one_setting(args.one_setting, size, args, cuda)))
        return
    flops = model_flops(size)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    argv = [f"--warmup={args.warmup}", f"--steps={args.steps}"] + ["--tiny"] * args.tiny
    for round_index in range(args.rounds):
        for name in names:
            run = child_json([__file__, *argv, f"--one-setting={name}"])
            runs[name].append(run)
            median = "" if "error" in run else f"median {statistics.median(run['steps_s']):.4f} s/step, "
            print(f"round {round_index} {name}: " + run.get("error", f"{median}peak {run['peak_mib']} MiB"), flush=True)
    result = {"sizes": size, "dtype": "bfloat16" if cuda else "float32", "model_tflop_per_step": round(flops / 1e12, 3)}
    result["settings"] = {name: summarize(name_runs, flops) for name, name_runs in runs.items()}
    stock = result["settings"].get("stock", {}).get("step_s")
    for summary in result["settings"].values():
        if stock and "step_s" in summary:
            summary["speedup_vs_stock"] = round(stock / summary["step_s"], 3)
    if cuda:
        result["device"] = torch.cuda.get_device_name()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
