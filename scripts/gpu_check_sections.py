"""The sections of scripts/gpu_checks.py, one function each (the driver runs each in its own process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_helpers import (
    DRY,
    ROOT,
    Result,
    check_model,
    decode_tok_s,
    echo_prompts,
    engine_config,
    generate_groups,
    megatron_trainer,
    route_agreement,
    update_engine,
)


async def section_engine(result: Result) -> None:
    from rollout_service.engine import RolloutEngine

    model = check_model()
    engine = RolloutEngine(model, engine_config(), server_id="gpu-check")
    started = time.monotonic()
    await engine.start()
    result["engine_start_s"] = round(time.monotonic() - started, 1)
    result["vllm"] = engine.features.version
    result["fleetrl_spans_and_chunks"] = engine.features.fallback
    result["cuda_graphs"] = not engine.engine_kwargs(False)["enforce_eager"]
    result["routed_experts_available"] = engine.routed_experts_available
    try:
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
        result["r3"] = {key: values.get(key) for key in R3_FIGURES}
        await _updates_over_each_transport(engine, backend, groups, result)
    finally:
        engine.shutdown()


R3_FIGURES = (
    "on_policy_abs_logprob_diff_r3",
    "on_policy_abs_logprob_diff_natural",
    "on_policy_tokens",
    "r3_replayed",
    "mean_abs_logprob_diff",
)
# Versions 1, 2, 3 go out over these, each after a training step so that every transport carries new weights.
UPDATE_TRANSPORTS = (
    ("update_tcp", {"transport": "tcp"}),
    ("update_ipc", {"transport": "ipc"}),
    ("update_tcp_mxfp8", {"transport": "tcp", "codec": "mxfp8"}),
)


async def _updates_over_each_transport(engine, backend, groups, result: Result) -> None:
    import redis

    from launcher.redis_server import EmbeddedRedis
    from protos.config import WeightBusConfig
    from protos.redis_keys import RedisKeys
    from trainer_service.batch import build_batch

    redis_server = EmbeddedRedis().start()
    try:
        keys = RedisKeys("gpu-check")
        redis.Redis.from_url(redis_server.url).flushall()
        for version, (name, bus) in enumerate(UPDATE_TRANSPORTS, start=1):
            if version > 1:
                backend.train_step(build_batch(list(groups)))  # new weights for each transport
            bus_config = WeightBusConfig(bucket_mib=256, **bus)
            await update_engine(engine, backend, version, bus_config, keys, redis_server.url, result, name)
        after = await generate_groups(engine, echo_prompts(8, seed=3), 4, 16)
        result["spans_after_updates"] = [[s.version, s.start, s.end] for s in after[0].samples[0].version_spans]
    finally:
        redis_server.stop()


async def section_mxfp8(result: Result) -> None:
    import redis

    from launcher.redis_server import EmbeddedRedis
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


# A Qwen3-MoE large enough that decoding reads weights, not launches: 24 layers, hidden 2048, 64 experts top-8 with
# FFN 1536 (14.5 B parameters, 29 GB in bf16). Random weights (vLLM's dummy load): tok/s does not depend on values.
BANDWIDTH_MODEL = dict(
    num_hidden_layers=24,
    hidden_size=2048,
    num_experts=64,
    num_local_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=1536,
    intermediate_size=6144,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    dtype="bfloat16",
)


def bandwidth_model_dir() -> str:
    """The check model's tokenizer and config, scaled to BANDWIDTH_MODEL, without weights (dummy load)."""
    import shutil

    source, target = Path(check_model()), Path("/tmp/fleetrl-bandwidth-moe")
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, target / path.name)
    config = {**json.loads((source / "config.json").read_text()), **BANDWIDTH_MODEL}
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return str(target)


async def section_mxfp8_bandwidth(result: Result) -> None:
    """bf16 against MXFP8 serving where decoding is bandwidth-bound: one engine after the other, same requests."""
    from rollout_service.engine import RolloutEngine

    model = bandwidth_model_dir()
    result["model"] = {k: BANDWIDTH_MODEL[k] for k in ("num_hidden_layers", "hidden_size", "num_experts")}
    for quantization in ("none", "mxfp8"):
        config = engine_config(
            quantization=quantization,
            load_format="dummy",
            return_routed_experts="off",
            gpu_memory_utilization=0.5,
            kv_cache_gib=4,
            max_num_seqs=64,
        )
        engine = RolloutEngine(model, config, server_id=f"bandwidth-{quantization}")
        started = time.monotonic()
        await engine.start()
        figures = {"engine_start_s": round(time.monotonic() - started, 1)}
        try:
            for batch in (8, 64):
                figures[f"decode_tok_s_batch_{batch}"] = round(await decode_tok_s(engine, batch, 128), 1)
        finally:
            engine.shutdown()
        result[quantization] = figures
    for batch in (8, 64):
        key = f"decode_tok_s_batch_{batch}"
        result[f"mxfp8_over_bf16_batch_{batch}"] = round(result["mxfp8"][key] / result["none"][key], 3)


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
        [sys.executable, "-m", "launcher.cli", "demo", "--config", "recipes/gpu-h200.yaml", "--out", str(run_dir)],
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
        "128",
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
