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
