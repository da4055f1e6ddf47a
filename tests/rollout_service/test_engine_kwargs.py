"""The engine arguments built from the Beam recipes: what vLLM is asked for (no engine is started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from protos.config import load_run_config

pytestmark = pytest.mark.unit

BEAM = Path(__file__).resolve().parents[2] / "recipes" / "beam"
LORA_16 = BEAM / "dapo-lora-16.yaml"


def test_the_mxfp8_recipe_builds_the_engine_arguments_vllm_takes():
    from rollout_service.engine import RolloutEngine

    config = load_run_config(LORA_16.parent / "dapo-mxfp8.yaml")
    kwargs = RolloutEngine(config.model_path, config.rollout).engine_kwargs(on_cpu=False)
    assert kwargs["quantization"] == "mxfp8" and kwargs["enable_expert_parallel"]
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (8, 1)
    assert "kv_cache_dtype" not in kwargs and kwargs["dtype"] == "bfloat16"  # 'auto': the engine's bf16
    fp8_kv = load_run_config(LORA_16.parent / "dapo-mxfp8.yaml", environ={"KV_CACHE_DTYPE": "fp8_e4m3"})
    assert RolloutEngine("", fp8_kv.rollout).engine_kwargs(on_cpu=False)["kv_cache_dtype"] == "fp8_e4m3"
    with pytest.raises(ValueError, match="rollout.quantization"):
        RolloutEngine("", config.rollout).engine_kwargs(on_cpu=True)


def test_the_lora_recipes_serve_adapters_in_lora_slots_at_the_guides_rank():
    from rollout_service.engine import RolloutEngine

    config = load_run_config(LORA_16)
    assert config.trainer.lora.sync == "adapters"
    kwargs = RolloutEngine(config.model_path, config.rollout).engine_kwargs(on_cpu=False)
    assert kwargs["enable_lora"] and (kwargs["max_lora_rank"], kwargs["max_loras"]) == (64, 1)
    toy = load_run_config([LORA_16, BEAM / "toy.yaml"])  # the CPU engine: merged layers (MoE has no CPU LoRA)
    assert toy.trainer.lora.sync == "merged" and "enable_lora" not in RolloutEngine("", toy.rollout).engine_kwargs(True)


@pytest.mark.parametrize(
    "config, dtype, backend",
    [
        ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, "float32", "CPU_MLA"),  # AMX MLA loads bf16 only
        ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, "bfloat16", None),  # vLLM's own choice
        ({"model_type": "qwen3_moe"}, "float32", None),  # no MLA: no attention backend asked for
    ],
)
def test_an_fp32_cpu_engine_of_an_mla_checkpoint_asks_for_the_reference_cpu_mla_backend(
    tmp_path, config, dtype, backend
):
    import json

    from protos.config import RolloutConfig
    from rollout_service.engine import RolloutEngine

    (tmp_path / "config.json").write_text(json.dumps(config))
    kwargs = RolloutEngine(str(tmp_path), RolloutConfig(dtype=dtype)).engine_kwargs(on_cpu=True)
    assert kwargs.get("attention_backend") == backend
    assert "attention_backend" not in RolloutEngine(str(tmp_path), RolloutConfig(dtype=dtype)).engine_kwargs(False)


def test_the_gpu_mxfp8_recipe_serves_online_mxfp8_with_ipc_updates_for_fifty_steps():
    from rollout_service.engine import RolloutEngine

    config = load_run_config(BEAM.parent / "gpu-h200-mxfp8.yaml")
    kwargs = RolloutEngine(config.model_path, config.rollout).engine_kwargs(on_cpu=False)
    assert kwargs["quantization"] == "mxfp8" and kwargs["enable_return_routed_experts"]
    assert (config.weight_bus.transport, config.weight_bus.codec, config.num_steps) == ("ipc", "bf16", 50)
    assert list(config.trainer.geo_mask) == [0.99, 1.01]


def test_a_server_restarted_beside_a_grown_trainer_asks_vllm_only_for_the_share_still_free(monkeypatch):
    """With the KV cache sized in bytes, vLLM uses gpu_memory_utilization only to refuse a start when that share is not
    free; a rollout server restarted on the GPU its trainer has grown into must still start (the GPU chaos run)."""
    from rollout_service import engine_args
    from rollout_service.engine import RolloutEngine

    config = load_run_config(Path(__file__).resolve().parents[2] / "recipes" / "gpu-h200.yaml")
    assert config.rollout.kv_cache_gib and config.rollout.gpu_memory_utilization == 0.35
    asked = []

    def free_share(devices: int) -> float | None:
        asked.append(devices)
        return free[0]

    monkeypatch.setattr(engine_args, "gpu_free_share", free_share)
    engine = RolloutEngine(config.model_path or "", config.rollout)
    free = [26.72 / 79.18]  # what the restarted server found in that run
    assert engine.engine_kwargs(on_cpu=False)["gpu_memory_utilization"] == round(26.72 / 79.18 - 0.02, 4)
    free = [0.9]  # a first start on an idle GPU keeps the recipe's share
    assert engine.engine_kwargs(on_cpu=False)["gpu_memory_utilization"] == 0.35
    free = [None]  # no NVML: the recipe's share
    assert engine.engine_kwargs(on_cpu=False)["gpu_memory_utilization"] == 0.35
    assert asked == [1, 1, 1]  # one GPU per engine in the recipe (tensor x pipeline parallel)
    sized_by_share = config.rollout.model_copy(update={"kv_cache_gib": None})
    free = [0.05]  # without kv_cache_gib the share sizes the KV cache: never lowered behind the user's back
    assert RolloutEngine("", sized_by_share).engine_kwargs(on_cpu=False)["gpu_memory_utilization"] == 0.35
    assert engine_args.gpu_free_share(1) is None or 0.0 <= engine_args.gpu_free_share(1) <= 1.0
