"""Weight refit end to end: seconds from the trainer's step end to the engine serving the new version.

For each model (HF Qwen3-MoE configs: the GPU demo's 0.94 B and a 3.2 B), one vLLM engine (fleetrl's RolloutEngine,
bf16, ``load_format=dummy``: the benchmark's first update brings the weights) and one valkey; the "trainer" is this
process holding the HF-named bf16 weights on the GPU, perturbed before every version so that each carries new bytes.
Per transport (ipc, tcp) and engine path, ``--versions`` updates through fleetrl's real parts: ``WeightPublisher``
(pack -> announce) and ``WeightFollower.update_to`` (fetch for tcp -> pause -> load -> resume -> report):

- ``reload``: vLLM's ``reload_weights`` (checkpoint format, layerwise processing) per version (``rollout.refit_plan``
  off): what every update did before the refit plan.
- ``plan``: ``rollout.refit_plan`` on: the first update captures and checks the plan (``plan_first_s``), the later ones
  replay it.

``--engines bf16,mxfp8`` adds an engine serving vLLM's online MXFP8 (``rollout.quantization=mxfp8``: every update
is re-quantized and repacked in the engine) with three paths on the same engine:

- ``loop``: vLLM's reload with its MXFP8 MoE processing, a Python loop per expert (rollout_service.mxfp8_batched off).
- ``batched``: vLLM's reload with the experts quantized and repacked as one matrix per layer.
- ``plan``: batched, and ``rollout.refit_plan`` on: the layer plan (rollout_service.layer_plan) replays the loaders'
  copies and each layer's processing without vLLM's reload.

The same bytes are then loaded by each path and the served MXFP8 parameters must equal the loop's
(``mxfp8_paths_equal_loop``).

The JSON's ``mxfp8_to_bf16`` divides each MXFP8 path's ``update_s`` by the bf16 plan's, measured in the same run.

After every update the engine generates 16 tokens (``generate_s``), so an engine that stops serving after a reload
fails the run; ``--graphs`` serves with CUDA graphs as the recipes do (eager otherwise).

Figures (medians over the versions after the first): ``update_s`` (publish + update_to), ``GBps`` (bytes / update_s),
``publish_s`` with its parts (export = list the tensors, pack, announce), ``load_s`` (the engine's load alone),
``paused_s`` (generation held), the device copy of the same bytes measured in the same run, and ``ratio`` = device copy
/ update_s. Served weights are compared with the trainer's tensors (per-group sums) after each path, and after a plan
update the per-parameter sums must equal those after a reload of the same bytes.

    python benchmarks/weight_refit.py --models demo-1b,moe-3b --transports ipc,tcp --out refit.json
    python benchmarks/weight_refit.py --models demo-1b --transports ipc --engines bf16,mxfp8 --graphs --out mx.json
    FLEETRL_GPU_CHECKS_DRY=1 python benchmarks/weight_refit.py --models tiny --transports tcp   # CPU smoke

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import torch  # noqa: E402
from gpu_check_helpers import DRY, device_copy_s, expected_sums, served_equals  # noqa: E402

from modeling.tiny_model import GPU_DEMO_CONFIG  # noqa: E402

MODELS = {  # tiny_model.tiny_config overrides
    "tiny": dict(num_layers=2, hidden_size=64, num_experts=8, top_k=2, dtype="float32"),
    "demo-1b": GPU_DEMO_CONFIG,  # the GPU demo's 0.94 B
    "moe-3b": dict(
        num_layers=8,
        hidden_size=2048,
        num_experts=64,
        top_k=8,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        moe_intermediate_size=1024,
        dtype="bfloat16",
    ),  # fmt: skip
}


def model_dir(name: str, root: Path) -> tuple[Path, list[tuple[str, torch.Tensor]]]:
    """A config-only checkpoint directory for vLLM (dummy load) and the trainer's HF-named weights on the device."""
    from transformers import AutoModelForCausalLM

    from modeling.tiny_model import build_tokenizer, tiny_config

    overrides = MODELS[name]
    config = tiny_config(**overrides)
    config.architectures = ["Qwen3MoeForCausalLM"]  # a config without it serves no generation in vLLM
    path = root / name
    config.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    device = "cpu" if DRY else "cuda"
    dtype = getattr(torch, overrides["dtype"])
    generator = torch.Generator(device).manual_seed(0)
    weights = [
        (n, (torch.randn(p.shape, generator=generator, device=device) * 0.02).to(dtype))
        for n, p in meta.named_parameters()
    ]
    return path, weights


def perturb(weights, step: int) -> None:
    with torch.no_grad():
        for _, tensor in weights:
            tensor.add_(1e-3 * (1 if step % 2 else -1))


async def run_path(
    engine, weights, transport: str, path: str, versions: range, redis_url: str, keys, vary: bool = True
) -> dict:
    import redis
    import redis.asyncio as aioredis

    from protos.config import WeightBusConfig
    from rollout_service.weight_sync import WeightFollower
    from trainer_service.publisher import WeightPublisher

    bus = WeightBusConfig(transport=transport, bucket_mib=256)
    engine.config = engine.config.model_copy(update={"refit_plan": path == "plan"})
    if engine.config.quantization == "mxfp8":
        await engine.llm.collective_rpc("fleetrl_mxfp8_batched", args=(path in ("batched", "plan"),))
    publisher = WeightPublisher(redis.Redis.from_url(redis_url), keys, bus)
    follower = WeightFollower(engine, aioredis.Redis.from_url(redis_url), keys, bus, "bench")
    rows = []
    try:
        for version in versions:
            if vary:
                perturb(weights, version)
            sync()
            started = time.monotonic()
            publish_s = publisher.publish(version, iter(weights))
            await follower.update_to(version)
            update_s = time.monotonic() - started
            generate_s = await generate_once(engine, version)
            parts = getattr(publisher.sender, "last_parts", {})
            rows.append(
                dict(
                    update_s=update_s,
                    publish_s=publish_s,
                    load_s=engine.last_load_s,
                    paused_s=follower.last_paused_s,
                    generate_s=generate_s,
                    source=follower.last_source,
                    **parts,
                )
            )
        nbytes = publisher.last_stats.num_bytes
    finally:
        publisher.close()
    state = (await engine.llm.collective_rpc("fleetrl_refit_plan_state"))[0]
    steady = rows[1:] or rows
    figures = {
        key: round(statistics.median(r[key] for r in steady), 4)
        for key in steady[0]
        if isinstance(steady[0][key], float)
    }
    figures.update(bytes=nbytes, first_s=round(rows[0]["update_s"], 3), source=rows[-1]["source"])
    figures["GBps"] = round(nbytes / figures["update_s"] / 1e9, 2)
    figures["plan_state"] = state
    if engine.config.quantization == "mxfp8":  # served bytes are MXFP8 in Marlin's layout: compared path to path
        figures["mxfp8_batched"] = (await engine.llm.collective_rpc("fleetrl_mxfp8_batched"))[0]
    else:
        figures["served_equal_trainer"] = await served_equals(engine, expected_sums(weights, _raw()))
    return figures


async def generate_once(engine, version: int, timeout_s: float = 60.0) -> float:
    """Seconds to generate 16 tokens right after an update: the engine serves the new version (an engine whose
    kernels hang after a reload fails the benchmark here, naming the version, instead of passing silently)."""
    from rollout_service.engine import SamplingRequest

    request = SamplingRequest(
        [5, 6, 7, 8], 1, 16, 1.0, 1.0, -1, 0.0, [], version, 0, True, request_id=f"after-v{version}"
    )

    async def drain() -> None:
        async for _ in engine.generate(request):
            pass

    started = time.monotonic()
    try:
        await asyncio.wait_for(drain(), timeout_s)
    except TimeoutError:
        raise SystemExit(f"the engine generated nothing within {timeout_s:.0f} s after weights v{version}") from None
    return time.monotonic() - started


def _raw():
    from weight_bus.packing import WireCodec

    return WireCodec()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


async def paths_equal(engine, weights, redis_url: str, keys, version: int, paths: tuple[str, ...]) -> dict:
    """The same bytes loaded by each path in turn: every served parameter's sum must equal the first path's."""
    results = {}
    for label in paths:
        transport = "tcp" if DRY else "ipc"
        await run_path(engine, weights, transport, label, range(version, version + 1), redis_url, keys, vary=False)
        results[label] = (await engine.llm.collective_rpc("fleetrl_param_sums"))[0]
        version += 1
    first = results[paths[0]]
    differing = {label: [name for name in first if first[name] != results[label].get(name)][:8] for label in paths[1:]}
    return {"parameters": len(first), "differing": differing, "equal": not any(differing.values())}


PATHS = {"bf16": ("reload", "plan"), "mxfp8": ("loop", "batched", "plan")}


async def bench_model(name: str, args, root: Path, redis_url: str) -> dict:
    from protos.config import RolloutConfig
    from protos.redis_keys import RedisKeys
    from rollout_service.engine import RolloutEngine

    path, weights = model_dir(name, root)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    result: dict = {"bytes": nbytes, "device_copy_s": round(device_copy_s(nbytes), 5)}
    version = 1
    for kind in args.engines:
        config = RolloutConfig(
            dtype="float32" if DRY else "bfloat16",
            load_format="dummy",
            max_model_len=256,
            gpu_memory_utilization=0.3,
            kv_cache_gib=1 if DRY else 4,
            enforce_eager=not args.graphs,
            return_routed_experts="off",
            quantization="none" if kind == "bf16" else kind,
        )
        engine = RolloutEngine(str(path), config, server_id=f"refit-{name}-{kind}")
        started = time.monotonic()
        await engine.start()
        prefix = "" if kind == "bf16" else f"{kind}_"  # the bf16 keys keep their names from earlier runs
        result[f"{prefix}engine_start_s"] = round(time.monotonic() - started, 1)
        keys = RedisKeys(f"refit-{name}-{kind}")
        try:
            for transport in args.transports:
                for label in PATHS[kind]:
                    versions = range(version, version + args.versions)
                    figures = await run_path(engine, weights, transport, label, versions, redis_url, keys)
                    figures["ratio_to_device_copy"] = round(result["device_copy_s"] / figures["update_s"], 4)
                    result[f"{prefix}{transport}_{label}"] = figures
                    version += args.versions
                    print(name, kind, transport, label, json.dumps(figures), flush=True)
            check = "plan_equals_reload" if kind == "bf16" else f"{kind}_paths_equal_loop"
            result[check] = await paths_equal(engine, weights, redis_url, keys, version, PATHS[kind])
            version += len(PATHS[kind])
        finally:
            engine.shutdown()
    for transport in args.transports:
        bf16 = result.get(f"{transport}_plan")
        for label in PATHS["mxfp8"]:
            mxfp8 = result.get(f"mxfp8_{transport}_{label}")
            if bf16 and mxfp8:
                result[f"mxfp8_to_bf16_{transport}_{label}"] = round(mxfp8["update_s"] / bf16["update_s"], 3)
    return result


async def main_async(args) -> dict:
    from launcher.redis_server import EmbeddedRedis

    out = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "dry": DRY}
    redis_server = EmbeddedRedis(appendonly=False).start()
    try:
        with tempfile.TemporaryDirectory() as root:
            for name in args.models:
                out[name] = await bench_model(name, args, Path(root), redis_server.url)
                if args.out:
                    Path(args.out).write_text(json.dumps(out, indent=1))
    finally:
        redis_server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["demo-1b", "moe-3b"])
    parser.add_argument("--transports", type=lambda s: s.split(","), default=["ipc", "tcp"])
    parser.add_argument("--versions", type=int, default=4, help="updates per transport and path")
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs on (as served), not eager engines")
    parser.add_argument(
        "--engines", type=lambda s: s.split(","), default=["bf16"], help="bf16 and/or mxfp8 (online MXFP8, GPU)"
    )
    parser.add_argument("--out", default="", help="also write the JSON here (after every model)")
    args = parser.parse_args()
    out = asyncio.run(main_async(args))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
