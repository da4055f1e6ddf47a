"""fleetrl's GPU checks in one command on a CUDA machine (written for one H200); the last line is one JSON object.

    python scripts/gpu_checks.py [--sections engine,mxfp8,quantize,loop,overhead] [--out DIR]

Each section runs in its own process under its own time limit; a section that fails is reported (with the tail of
its output) and the next one runs. Results also go to DIR/gpu_checks.json as each section ends.

  smoke     the tiny model in an eager engine: start, generate, routes (a minute; catches API breaks early)
  engine    the vLLM engine (bf16, CUDA graphs, routed experts) in fleetrl's RolloutEngine: start time, version
            spans, routes' shape/dtype and layer order against the HF reference, bf16 decode tok/s; the Megatron
            trainer's on-policy |dlogp| with R3 and without; weight updates over tcp, ipc (colocated) and tcp with
            MXFP8 on the wire, each checked equal to the trainer's weights and timed against a device copy
  mxfp8     the engine serving MXFP8 (online quantization): decode tok/s against bf16, |dlogp| with R3, weight
            updates re-quantized at load (bf16 on the wire, and MXFP8 on the wire dequantized first)
  mxfp8_bandwidth  bf16 against MXFP8 serving on a 14.5 B Qwen3-MoE (random weights) where decoding is
            bandwidth-bound: decode tok/s at 8 and 64 sequences
  quantize  the public MXFP8 ``quantize`` call, one call at a time (outputs allocated), vs a device copy
  loop      ``fleetrl demo --config recipes/gpu-h200.yaml`` (summary.json)
  chaos     the same demo (60 steps) with its trainer killed mid-step and its rollout server mid-stream (SIGKILL,
            the launcher restarts them): time lost per fault, restarts, trajectories produced / trained exactly
            once, final versions of trainer and server (scripts/gpu_check_chaos.py; not in the default list)
  beam      the tiny Beam in vLLM's Beam plugin: routes over every decoder layer, the dense first layers' rows
            and the MoE layers' agreement with the HF reference
  overhead  ``benchmarks/rollout_overhead.py`` on the GPU (gRPC / in-process tokens/s, 1024 sequences)
  lora_adapter_sync  adapter-only LoRA sync against merged weights with expert adapters (tiny Qwen3-MoE and tiny
            Beam, fp32): greedy tokens equal and |dlogp| < 2e-4 through the LoRA slot and through merged weights,
            pinned host staging, bytes each publish sent (scripts/gpu_check_lora.py)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LIMITS_S = {
    "smoke": 150,
    "engine": 330,
    "mxfp8": 330,
    "mxfp8_bandwidth": 300,
    "quantize": 90,
    "loop": 420,
    "chaos": 480,
    "beam": 150,
    "overhead": 420,
    "lora_adapter_sync": 420,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="engine,mxfp8,quantize,loop,overhead")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu-checks"))
    parser.add_argument("--section", default="", help=argparse.SUPPRESS)  # one section, in this process
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    return parser.parse_args()


def run_sections(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for name in [s for s in args.sections.split(",") if s]:
        result_path, log_path = out / f"{name}.json", out / f"{name}.log"
        started = time.monotonic()
        with open(log_path, "wb") as log:
            # Its own session: on a timeout the whole group goes (vLLM's engine processes hold GPU memory).
            child = subprocess.Popen(
                [sys.executable, "-u", __file__, "--section", name, "--result", str(result_path), "--out", str(out)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
            try:
                code = child.wait(timeout=LIMITS_S[name])
            except subprocess.TimeoutExpired:
                code = "timeout"
            try:
                os.killpg(child.pid, signal.SIGKILL)  # whatever the section left running
            except ProcessLookupError:
                pass
            child.wait()
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        result.update(exit=code, seconds=round(time.monotonic() - started, 1))
        if code != 0:
            result["log_tail"] = log_path.read_text(errors="replace")[-1500:]
        results[name] = result
        (out / "gpu_checks.json").write_text(json.dumps(results, indent=1))
        print(f"{name}: exit {code} in {result['seconds']} s", flush=True)
    return results


def run_one(args: argparse.Namespace) -> None:
    import asyncio

    from gpu_check_chaos import section_chaos
    from gpu_check_helpers import Result
    from gpu_check_lora import section_lora_adapter_sync
    from gpu_check_sections import (
        section_beam,
        section_engine,
        section_loop,
        section_mxfp8,
        section_mxfp8_bandwidth,
        section_overhead,
        section_quantize,
        section_smoke,
    )

    result = Result(args.result)
    name = args.section
    if name == "smoke":
        asyncio.run(section_smoke(result))
    elif name == "engine":
        asyncio.run(section_engine(result))
    elif name == "mxfp8":
        asyncio.run(section_mxfp8(result))
    elif name == "mxfp8_bandwidth":
        asyncio.run(section_mxfp8_bandwidth(result))
    elif name == "quantize":
        section_quantize(result)
    elif name == "loop":
        section_loop(result, Path(args.out))
    elif name == "chaos":
        section_chaos(result, Path(args.out))
    elif name == "beam":
        asyncio.run(section_beam(result))
    elif name == "overhead":
        section_overhead(result)
    elif name == "lora_adapter_sync":
        asyncio.run(section_lora_adapter_sync(result))


def main() -> None:
    args = parse_args()
    if args.section:
        run_one(args)
        return
    print(json.dumps(run_sections(args), default=float))


if __name__ == "__main__":
    main()
