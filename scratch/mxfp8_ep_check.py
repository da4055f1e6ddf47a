"""One-off GPU check: does vLLM start the MXFP8 recipe's engine (online mxfp8 + expert parallelism + routed
experts) at TP2 on two GPUs, and which switch refuses it? Each case in its own process; JSON per case."""

import json
import os
import subprocess
import sys
import time

CASES = {
    "recipe": [],
    "no_ep": ["rollout.enable_expert_parallel=false"],
    "no_r3": ["rollout.return_routed_experts=off"],
    "bf16_ep": ["rollout.quantization=none", "weight_bus.codec=bf16"],
}

CHILD = r"""
import json, sys, time
from protos.config import load_run_config
from rollout_service.engine import RolloutEngine
overrides = json.loads(sys.argv[2])
config = load_run_config("recipes/beam/dapo-mxfp8.yaml", [
    f"model_path={sys.argv[1]}", "placement=disaggregated", "rollout.tensor_parallel_size=2",
    "rollout.max_model_len=256", "coordinator.sampling.max_tokens=16", "coordinator.overlong.buffer_len=8",
    "rollout.gpu_memory_utilization=0.4", "rollout.enforce_eager=true", *overrides])
kwargs = RolloutEngine(config.model_path, config.rollout).engine_kwargs(on_cpu=False)
kwargs.pop("worker_extension_cls")
print("KWARGS", json.dumps(kwargs), flush=True)
from vllm import LLM, SamplingParams
started = time.monotonic()
llm = LLM(**kwargs)
out = llm.generate([{"prompt_token_ids": [1, 5, 6, 7]}], SamplingParams(max_tokens=8, temperature=1.0))
routes = getattr(out[0].outputs[0], "routed_experts", None)
print("RESULT", json.dumps({"start_s": time.monotonic() - started, "tokens": list(out[0].outputs[0].token_ids),
      "routes_shape": None if routes is None else list(routes.shape)}), flush=True)
"""


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp")
    model = "/tmp/mx-model"
    if not os.path.exists(f"{model}/config.json"):
        from modeling.tiny_model import GPU_DEMO_CONFIG, init_tiny

        init_tiny(model, **{**GPU_DEMO_CONFIG, "num_layers": 4})
    results = {}
    for name, overrides in CASES.items():
        started = time.monotonic()
        try:
            child = subprocess.run(
                [sys.executable, "-c", CHILD, model, json.dumps(overrides)],
                capture_output=True,
                text=True,
                timeout=240,
            )
            lines = (child.stdout + child.stderr).splitlines()
            result = next((json.loads(l[7:]) for l in lines if l.startswith("RESULT ")), None)
            errors = [l for l in lines if "Error" in l or "error" in l or "not supported" in l][-8:]
            results[name] = {
                "rc": child.returncode,
                "result": result,
                "errors": errors,
                "wall_s": time.monotonic() - started,
            }
            with open(f"{out_dir}/{name}.log", "w") as handle:
                handle.write(child.stdout + child.stderr)
        except subprocess.TimeoutExpired:
            results[name] = {"rc": "timeout", "wall_s": time.monotonic() - started}
        print(name, json.dumps(results[name])[:2000], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
