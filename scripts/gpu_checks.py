#!/usr/bin/env python
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
  quantize  the public MXFP8 ``quantize`` call, one call at a time (outputs allocated), vs a device copy
  loop      ``fleetrl demo --config recipes/gpu-h200.yaml`` (summary.json)
  beam      the tiny Beam in vLLM's Beam plugin: routes over every decoder layer, the dense first layers' rows
            and the MoE layers' agreement with the HF reference
  overhead  ``benchmarks/rollout_overhead.py`` on the GPU (gRPC / in-process tokens/s, 1024 sequences)
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
LIMITS_S = {"smoke": 150, "engine": 330, "mxfp8": 240, "quantize": 90, "loop": 420, "beam": 150, "overhead": 330}
CHECK_MODEL = "qwen3-moe-1b"  # the GPU demo's 0.94 B Qwen3-MoE (12 layers, 48 experts top-4), warmed up once
# FLEETRL_GPU_CHECKS_DRY=1: the engine and mxfp8 sections' code on a CPU machine (tiny fp32 model, no routes, no
# device copies, MXFP8 only on the wire) to catch mistakes before a GPU lease; no figure of it means anything.
DRY = os.environ.get("FLEETRL_GPU_CHECKS_DRY", "") == "1"


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


class Result(dict):
    """A section's figures, written to its file after every change (a section that dies keeps what it had)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = Path(path)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.path.write_text(json.dumps(self, default=float))


def check_model() -> str:
    os.environ.setdefault("FLEETRL_CACHE", "/tmp/fleetrl-cache")
    from coordinator.launcher import tiny_model_dir

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
    from trainer_service.megatron_backend import MegatronBackend
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


async def section_engine(result: Result) -> None:
    import redis

    from coordinator.redis_server import EmbeddedRedis
    from protos.config import WeightBusConfig
    from protos.redis_keys import RedisKeys
    from rollout_service.engine import RolloutEngine
    from trainer_service.batch import build_batch

    model = check_model()
    engine = RolloutEngine(model, engine_config(), server_id="gpu-check")
    started = time.monotonic()
    await engine.start()
    result["engine_start_s"] = round(time.monotonic() - started, 1)
    result["vllm"] = engine.features.version
    result["fleetrl_spans_and_chunks"] = engine.features.fallback
    result["cuda_graphs"] = not engine.engine_kwargs(False)["enforce_eager"]
    result["routed_experts_available"] = engine.routed_experts_available
    groups = await generate_groups(engine, echo_prompts(32), 8, 32)
    sample = groups[0].samples[0]
    routes = sample.routed_experts
    result["routes"] = {
        "shape": list(routes.shape) if routes else None,
        "dtype": routes.dtype if routes else None,
        "expected_shape": [4 + 32 - 1, 12, 4],
    }
    result["spans"] = [[s.version, s.start, s.end] for s in sample.version_spans]
    result["route_agreement"] = None if DRY else route_agreement(model, groups)
    result["decode_tok_s_bf16"] = round(await decode_tok_s(engine), 1)
    backend, trainer = megatron_trainer(model)
    values = trainer.step(list(groups))  # the mismatch figures are of pi_old = the weights the engine serves
    result["r3"] = {
        k: values.get(k)
        for k in (
            "on_policy_abs_logprob_diff_r3",
            "on_policy_abs_logprob_diff_natural",
            "on_policy_tokens",
            "r3_replayed",
            "mean_abs_logprob_diff",
        )
    }
    redis_server = EmbeddedRedis().start()
    try:
        keys = RedisKeys("gpu-check")
        redis.Redis.from_url(redis_server.url).flushall()
        await update_engine(
            engine,
            backend,
            1,
            WeightBusConfig(transport="tcp", bucket_mib=256),
            keys,
            redis_server.url,
            result,
            "update_tcp",
        )
        backend.train_step(build_batch(list(groups)))  # new weights for each transport
        await update_engine(
            engine,
            backend,
            2,
            WeightBusConfig(transport="ipc", bucket_mib=256),
            keys,
            redis_server.url,
            result,
            "update_ipc",
        )
        backend.train_step(build_batch(list(groups)))
        await update_engine(
            engine,
            backend,
            3,
            WeightBusConfig(transport="tcp", bucket_mib=256, codec="mxfp8"),
            keys,
            redis_server.url,
            result,
            "update_tcp_mxfp8",
        )
        after = await generate_groups(engine, echo_prompts(8, seed=3), 4, 16)
        result["spans_after_updates"] = [[s.version, s.start, s.end] for s in after[0].samples[0].version_spans]
    finally:
        redis_server.stop()
        engine.shutdown()


async def section_mxfp8(result: Result) -> None:
    import redis

    from coordinator.redis_server import EmbeddedRedis
    from protos.config import WeightBusConfig
    from protos.redis_keys import RedisKeys
    from rollout_service.engine import RolloutEngine

    model = check_model()
    engine = RolloutEngine(model, engine_config(quantization="mxfp8"), server_id="gpu-check-mxfp8")
    started = time.monotonic()
    await engine.start()
    result["engine_start_s"] = round(time.monotonic() - started, 1)
    result["routed_experts_available"] = engine.routed_experts_available
    result["decode_tok_s_mxfp8"] = round(await decode_tok_s(engine), 1)
    groups = await generate_groups(engine, echo_prompts(32), 8, 32)
    backend, trainer = megatron_trainer(model)
    values = trainer.step(list(groups))
    result["r3"] = {k: values.get(k) for k in ("on_policy_abs_logprob_diff_r3", "on_policy_abs_logprob_diff_natural")}
    probe = echo_prompts(8, seed=5)
    before = await generate_groups(engine, probe, 1, 16, temperature=0.0)
    redis_server = EmbeddedRedis().start()
    try:
        keys = RedisKeys("gpu-check-mxfp8")
        redis.Redis.from_url(redis_server.url).flushall()
        for version, codec in ((1, "bf16"), (2, "mxfp8")):
            label = f"update_{codec}_wire"
            await update_engine(
                engine,
                backend,
                version,
                WeightBusConfig(bucket_mib=256, codec=codec),
                keys,
                redis_server.url,
                result,
                label,
            )
            after = await generate_groups(engine, probe, 1, 16, temperature=0.0)
            # the trainer took a step, so outputs move; what matters is that re-quantizing at load runs and is fast
            result[label] = {
                **result[label],
                "greedy_changed": sum(
                    list(a.samples[0].response_token_ids.to_numpy()) != list(b.samples[0].response_token_ids.to_numpy())
                    for a, b in zip(after, before, strict=True)
                ),
            }
    finally:
        redis_server.stop()
        engine.shutdown()


def section_quantize(result: Result) -> None:
    import statistics

    import torch

    from weight_bus.codecs import mxfp8

    x = torch.randn(32768, 16384, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    moved = x.numel() * 2 + x.numel() + x.numel() // 32

    def one_call_s(fn) -> float:
        times = []
        for _ in range(25):
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return statistics.median(times[5:])

    copy_s = one_call_s(lambda: y.copy_(x))
    quant_s = one_call_s(lambda: mxfp8.quantize(x))
    kernel_s = one_call_s(lambda: mxfp8._quantize_triton(x, "rceil"))
    result.update(copy_GBps=2 * x.numel() * 2 / copy_s / 1e9, quantize_GBps=moved / quant_s / 1e9)
    result["quantize_ratio"] = round(result["quantize_GBps"] / result["copy_GBps"], 4)
    result["kernel_path_ratio"] = round(moved / kernel_s / 1e9 / result["copy_GBps"], 4)
    result["quantize_call_ms"] = round(quant_s * 1e3, 4)
    result["copy_call_ms"] = round(copy_s * 1e3, 4)


async def section_smoke(result: Result) -> None:
    from modeling.tiny_model import init_tiny
    from protos.config import RolloutConfig
    from rollout_service.engine import RolloutEngine

    model = str(init_tiny(Path("/tmp/fleetrl-smoke-tiny")))
    config = RolloutConfig(
        dtype="bfloat16",
        max_model_len=256,
        gpu_memory_utilization=0.1,
        kv_cache_gib=1,
        enforce_eager=True,
        return_routed_experts="on",
    )
    engine = RolloutEngine(model, config, server_id="gpu-smoke")
    started = time.monotonic()
    await engine.start()
    result["engine_start_s"] = round(time.monotonic() - started, 1)
    result["vllm"] = engine.features.version
    result["features"] = {
        "engine_weight_versions": engine.features.engine_weight_versions,
        "request_stream_interval": engine.features.request_stream_interval,
    }
    try:
        groups = await generate_groups(engine, echo_prompts(4), 2, 20)
    finally:
        engine.shutdown()
    sample = groups[0].samples[0]
    result["tokens"] = len(sample.response_token_ids.to_numpy())
    result["spans"] = [[s.version, s.start, s.end] for s in sample.version_spans]
    result["routes_shape"] = list(sample.routed_experts.shape) if sample.routed_experts else None


def section_loop(result: Result, out: Path) -> None:
    env = {**os.environ, "FLEETRL_CACHE": os.environ.get("FLEETRL_CACHE", "/tmp/fleetrl-cache")}
    run_dir = Path("/tmp/fleetrl-gpu-loop")  # outside OUT: only the summary and log tails come back
    code = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "demo", "--config", "recipes/gpu-h200.yaml", "--out", str(run_dir)],
        cwd=ROOT,
        env=env,
        check=False,
    ).returncode
    result["exit"] = code
    summary = run_dir / "summary.json"
    if summary.exists():
        result["summary"] = json.loads(summary.read_text())
    result["log_tails"] = {
        log.name: log.read_text(errors="replace")[-2500:] for log in (run_dir / "logs").glob("*.log")
    }


def register_beam_plugin() -> None:
    """The Beam plugin is found through its ``vllm.general_plugins`` entry point, which only an installed
    distribution has: a minimal dist-info on the path (this process and the engine's) stands in for the install."""
    import importlib

    site = Path(os.environ.get("FLEETRL_PLUGIN_SITE", "/tmp/fleetrl-plugin-site"))
    info = site / "fleetrl_checks-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fleetrl-checks\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nfleetrl_beam = rollout_service.models:register\n")
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = f"{site}:{ROOT}:{os.environ.get('PYTHONPATH', '')}"
    importlib.invalidate_caches()


async def section_beam(result: Result) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import modeling.beam  # noqa: F401 - registers the HF config
    from modeling.beam.tiny import init_tiny_beam
    from protos.config import RolloutConfig
    from rollout_service.engine import RolloutEngine
    from trainer_service.routing_replay import record_routes

    register_beam_plugin()
    model = str(init_tiny_beam(Path(os.environ.get("FLEETRL_CACHE", "/tmp/fleetrl-cache")) / "gpu-check-beam"))
    config = RolloutConfig(
        dtype="float32",
        max_model_len=256,
        gpu_memory_utilization=0.2,
        kv_cache_gib=2,
        enforce_eager=True,
        return_routed_experts="on",
    )
    engine = RolloutEngine(model, config, server_id="gpu-check-beam")
    await engine.start()
    try:
        groups = await generate_groups(engine, echo_prompts(8), 2, 12)
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).cuda().eval()
    dense = hf.config.first_k_dense_replace
    agreement, dense_rows_zero = [], True
    for group in groups:
        sample = group.samples[0]
        ids = torch.tensor([list(group.prompt_token_ids.to_numpy()) + list(sample.response_token_ids.to_numpy())])
        with torch.no_grad(), record_routes(hf) as recorder:
            hf(input_ids=ids.cuda())
        reference = recorder.routes(*ids.shape)[0]  # [T, MoE layers, K]
        routes = torch.from_numpy(sample.routed_experts.to_numpy().astype("int64"))  # [T - 1, all layers, K]
        dense_rows_zero &= bool((routes[:, :dense] == 0).all())
        moe = routes[:, dense:]
        overlap = (moe.unsqueeze(-1) == reference[: len(moe)].unsqueeze(-2)).any(-1).float().mean()
        agreement.append(float(overlap))
    result["routes_shape"] = list(groups[0].samples[0].routed_experts.shape)
    result["layers"] = {
        "decoder": hf.config.num_hidden_layers,
        "dense_first": dense,
        "top_k": hf.config.num_experts_per_tok,
    }
    result["dense_rows_zero"] = dense_rows_zero
    result["moe_agreement_with_hf"] = sum(agreement) / len(agreement)


def section_overhead(result: Result) -> None:
    model = check_model()
    command = [
        sys.executable,
        "benchmarks/rollout_overhead.py",
        "--model",
        model,
        "--requests",
        "128",
        "--n",
        "8",
        "--max-tokens",
        "224",
        "--rounds",
        "3",
        "--stream-interval",
        "16",
        "rollout.dtype=bfloat16",
        "rollout.gpu_memory_utilization=0.4",
        "rollout.kv_cache_gib=16",
        "rollout.stream_interval=16",
        "rollout.max_num_seqs=1024",
        "rollout.max_model_len=256",
    ]
    output = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print(output.stdout[-4000:], output.stderr[-4000:])
    lines = [line for line in output.stdout.splitlines() if line.startswith("{")]
    result["stream_interval_16"] = json.loads(lines[-1]) if lines else {"exit": output.returncode}


def run_one(args: argparse.Namespace) -> None:
    import asyncio

    result = Result(args.result)
    name = args.section
    if name == "smoke":
        asyncio.run(section_smoke(result))
    elif name == "engine":
        asyncio.run(section_engine(result))
    elif name == "mxfp8":
        asyncio.run(section_mxfp8(result))
    elif name == "quantize":
        section_quantize(result)
    elif name == "loop":
        section_loop(result, Path(args.out))
    elif name == "beam":
        asyncio.run(section_beam(result))
    elif name == "overhead":
        section_overhead(result)


def main() -> None:
    args = parse_args()
    if args.section:
        run_one(args)
        return
    print(json.dumps(run_sections(args), default=float))


if __name__ == "__main__":
    main()
