"""Every recipe in the repo is a valid run config (the schema is strict: a stale key fails here, not at launch), and
the composed recipes (a base plus small deltas) say what the full recipes said."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from protos.config import load_run_config, read_config_file

pytestmark = pytest.mark.unit

RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes"
RECIPES = sorted(RECIPE_DIR.glob("**/*.yaml"))

# What the recipes resolved to when each was written out in full (commit b8e6702, before they were rewritten as a
# base plus deltas), in today's spelling: every key the files wrote and every value off the schema's default. The
# Beam recipes reproduce SkyRL's published Beam runs (shared/seeds), so these values must not drift.
EXPECTED: dict[str, dict[str, object]] = {
    "beam/dapo-full-ft.yaml": {
        "run_id": "beam-dapo-full-ft",
        "model_path": "/models/Beam-501B-A23B",
        "num_steps": 50,
        "groups_per_step": 64,
        "max_staleness": 1,
        "temperature": 1.0,
        "coordinator.chat_template_kwargs": {"reasoning_effort": "minimal"},
        "coordinator.dynamic_sampling": False,
        "coordinator.eval.at_start": True,
        "coordinator.eval.datasets": ["../shared/data/aime-2024.jsonl", "../shared/data/aime-2025.jsonl"],
        "coordinator.eval.interval_steps": 5,
        "coordinator.eval.samples_per_problem": 8,
        "coordinator.eval.timeout_s": 7200.0,
        "coordinator.group_size": 8,
        "coordinator.overlong.buffer_len": 2048,
        "coordinator.overlong.enabled": True,
        "coordinator.overlong.penalty_factor": 1.0,
        "coordinator.request_timeout_s": 3600.0,
        "coordinator.reward_fn": "math",
        "coordinator.sampling.max_tokens": 8192,
        "coordinator.sampling.top_p": 1.0,
        "coordinator.task": "../shared/data/dapo-math-sample.parquet",
        "rollout.dtype": "bfloat16",
        "rollout.max_model_len": 10240,
        "rollout.num_servers": 4,
        "rollout.pipeline_parallel_size": 2,
        "rollout.return_routed_experts": "on",
        "rollout.tensor_parallel_size": 8,
        "trainer.backend": "megatron",
        "trainer.batch_timeout_s": 7200.0,
        "trainer.ckpt_interval": 5,
        "trainer.clip_high": 0.28,
        "trainer.clip_low": 0.2,
        "trainer.geo_mask": [0.99, 1.01],
        "trainer.loss_agg": "token-mean",
        "trainer.lr": 1e-06,
        "trainer.megatron.expert_model_parallel_size": 8,
        "trainer.megatron.moe_grouped_gemm": False,
        "trainer.megatron.moe_token_dispatcher": "alltoall",
        "trainer.megatron.params_dtype": "bfloat16",
        "trainer.megatron.pipeline_model_parallel_size": 4,
        "trainer.megatron.routing_replay": True,
        "trainer.megatron.tensor_model_parallel_size": 1,
        "trainer.mini_batches": 2,
        "trainer.num_nodes": 4,
        "trainer.num_processes": 8,
        "weight_bus.codec": "bf16",
        "weight_bus.transport": "nccl",
    },
    "beam/dapo-lora.yaml": {
        "run_id": "beam-dapo-lora",
        "model_path": "/models/Beam-501B-A23B",
        "num_steps": 50,
        "groups_per_step": 32,
        "max_staleness": 1,
        "temperature": 1.0,
        "coordinator.chat_template_kwargs": {"reasoning_effort": "minimal"},
        "coordinator.dynamic_sampling": False,
        "coordinator.eval.at_start": True,
        "coordinator.eval.datasets": ["../shared/data/aime-2024.jsonl", "../shared/data/aime-2025.jsonl"],
        "coordinator.eval.interval_steps": 5,
        "coordinator.eval.samples_per_problem": 8,
        "coordinator.eval.timeout_s": 7200.0,
        "coordinator.group_size": 8,
        "coordinator.overlong.buffer_len": 2048,
        "coordinator.overlong.enabled": True,
        "coordinator.overlong.penalty_factor": 1.0,
        "coordinator.request_timeout_s": 3600.0,
        "coordinator.reward_fn": "math",
        "coordinator.sampling.max_tokens": 8192,
        "coordinator.sampling.top_p": 1.0,
        "coordinator.task": "../shared/data/dapo-math-sample.parquet",
        "rollout.dtype": "bfloat16",
        "rollout.max_model_len": 10240,
        "rollout.num_servers": 1,
        "rollout.pipeline_parallel_size": 2,
        "rollout.return_routed_experts": "on",
        "rollout.tensor_parallel_size": 8,
        "trainer.backend": "megatron",
        "trainer.batch_timeout_s": 7200.0,
        "trainer.ckpt_interval": 5,
        "trainer.clip_high": 0.28,
        "trainer.clip_low": 0.2,
        "trainer.geo_mask": [0.99, 1.01],
        "trainer.lora.alpha": 64.0,
        "trainer.lora.rank": 32,
        "trainer.lora.target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        "trainer.loss_agg": "token-mean",
        "trainer.lr": 1e-05,
        "trainer.megatron.expert_model_parallel_size": 8,
        "trainer.megatron.expert_tensor_parallel_size": 1,
        "trainer.megatron.moe_grouped_gemm": False,
        "trainer.megatron.moe_token_dispatcher": "alltoall",
        "trainer.megatron.params_dtype": "bfloat16",
        "trainer.megatron.pipeline_model_parallel_size": 2,
        "trainer.megatron.routing_replay": True,
        "trainer.megatron.tensor_model_parallel_size": 4,
        "trainer.mini_batches": 1,
        "trainer.num_nodes": 2,
        "trainer.num_processes": 8,
        "weight_bus.codec": "bf16",
        "weight_bus.transport": "nccl",
    },
    "beam/dapo-mxfp8.yaml": {
        "run_id": "beam-dapo-mxfp8",
        "model_path": "/models/Beam-501B-A23B",
        "num_steps": 50,
        "groups_per_step": 64,
        "max_staleness": 1,
        "temperature": 1.0,
        "coordinator.chat_template_kwargs": {"reasoning_effort": "minimal"},
        "coordinator.dynamic_sampling": False,
        "coordinator.eval.at_start": True,
        "coordinator.eval.datasets": ["../shared/data/aime-2024.jsonl", "../shared/data/aime-2025.jsonl"],
        "coordinator.eval.interval_steps": 5,
        "coordinator.eval.samples_per_problem": 8,
        "coordinator.eval.timeout_s": 7200.0,
        "coordinator.group_size": 8,
        "coordinator.overlong.buffer_len": 2048,
        "coordinator.overlong.enabled": True,
        "coordinator.overlong.penalty_factor": 1.0,
        "coordinator.request_timeout_s": 3600.0,
        "coordinator.reward_fn": "math",
        "coordinator.sampling.max_tokens": 8192,
        "coordinator.sampling.top_p": 1.0,
        "coordinator.task": "../shared/data/dapo-math-sample.parquet",
        "rollout.dtype": "bfloat16",
        "rollout.enable_expert_parallel": True,
        "rollout.max_model_len": 10240,
        "rollout.num_servers": 4,
        "rollout.quantization": "mxfp8",
        "rollout.return_routed_experts": "on",
        "rollout.tensor_parallel_size": 8,
        "trainer.backend": "megatron",
        "trainer.batch_timeout_s": 7200.0,
        "trainer.ckpt_interval": 5,
        "trainer.clip_high": 0.28,
        "trainer.clip_low": 0.2,
        "trainer.geo_mask": [0.99, 1.01],
        "trainer.lr": 1e-06,
        "trainer.megatron.params_dtype": "bfloat16",
        "trainer.megatron.pipeline_model_parallel_size": 8,
        "trainer.megatron.routing_replay": True,
        "trainer.mini_batches": 2,
        "trainer.num_nodes": 1,
        "trainer.num_processes": 8,
        "weight_bus.codec": "mxfp8",
        "weight_bus.receive_mode": "dequantize",
        "weight_bus.transport": "nccl",
    },
    "demo-beam-lora.yaml": {
        "run_id": "demo-beam-lora",
        "tiny_model": "beam",
        "num_steps": 50,
        "groups_per_step": 16,
        "max_staleness": 1,
        "temperature": 1.0,
        "coordinator.group_size": 8,
        "coordinator.sampling.max_tokens": 8,
        "coordinator.sampling.top_p": 1.0,
        "coordinator.task": "echo",
        "rollout.num_servers": 2,
        "trainer.geo_mask": None,
        "trainer.lora.alpha": 16.0,
        "trainer.lora.rank": 8,
        "trainer.lr": 0.005,
        "trainer.token_tis_cap": 2.0,
    },
    "demo-beam.yaml": {
        "run_id": "demo-beam",
        "tiny_model": "beam",
        "num_steps": 50,
        "groups_per_step": 16,
        "max_staleness": 1,
        "temperature": 1.0,
        "coordinator.group_size": 8,
        "coordinator.sampling.max_tokens": 8,
        "coordinator.sampling.top_p": 1.0,
        "coordinator.task": "echo",
        "rollout.num_servers": 2,
        "trainer.geo_mask": None,
        "trainer.lr": 0.002,
        "trainer.token_tis_cap": 2.0,
    },
    "demo-echo.yaml": {
        "run_id": "demo",
        "num_steps": 50,
        "groups_per_step": 16,
        "max_staleness": 1,
        "temperature": 1.0,
        "coordinator.group_size": 8,
        "coordinator.sampling.max_tokens": 8,
        "coordinator.sampling.top_p": 1.0,
        "coordinator.task": "echo",
        "rollout.num_servers": 2,
        "trainer.geo_mask": None,
        "trainer.lr": 0.005,
        "trainer.token_tis_cap": 2.0,
    },
    "demo-agent.yaml": {
        "run_id": "demo-agent",
        "num_steps": 30,
        "groups_per_step": 16,
        "coordinator.group_size": 8,
        "agent.enabled": True,
        "agent.only_agents": True,
        "agent.demo_agents": 2,
    },
    "bench-async.yaml": {
        "run_id": "bench-async",
        "num_steps": 60,
        "groups_per_step": 32,
        "max_staleness": 1,
        "temperature": 1.0,
        "coordinator.group_size": 8,
        "coordinator.sampling.max_tokens": 8,
        "coordinator.sampling.top_p": 1.0,
        "coordinator.task": "echo",
        "rollout.num_servers": 1,
        "trainer.geo_mask": None,
        "trainer.lr": 0.002,
        "trainer.micro_batch_tokens": 48,
        "trainer.mini_batches": 1,
        "trainer.token_tis_cap": 2.0,
    },
    "demo-math.yaml": {
        "run_id": "demo-math",
        "num_steps": 10,
        "groups_per_step": 8,
        "max_staleness": 1,
        "temperature": 1.0,
        "coordinator.chat_template_kwargs": {},
        "coordinator.dynamic_sampling": True,
        "coordinator.dynamic_sampling_max_tries": 4,
        "coordinator.eval.at_start": True,
        "coordinator.eval.datasets": ["../shared/data/aime-2025.jsonl"],
        "coordinator.eval.interval_steps": 5,
        "coordinator.eval.samples_per_problem": 4,
        "coordinator.group_size": 8,
        "coordinator.overlong.buffer_len": 16,
        "coordinator.overlong.enabled": True,
        "coordinator.overlong.penalty_factor": 0.5,
        "coordinator.prompt_template": "{problem}\nanswer in \\boxed{}.",
        "coordinator.reward_fn": "math",
        "coordinator.sampling.max_tokens": 32,
        "coordinator.sampling.top_p": 1.0,
        "coordinator.task": "../shared/data/dapo-math-sample.parquet",
        "rollout.num_servers": 2,
        "trainer.geo_mask": None,
        "trainer.lr": 0.005,
        "trainer.token_tis_cap": 2.0,
    },
    "gpu-h200.yaml": {
        "run_id": "gpu-h200",
        "tiny_model": "qwen3-moe-1b",
        "num_steps": 24,
        "groups_per_step": 16,
        "max_staleness": 1,
        "temperature": 1.0,
        "coordinator.group_size": 8,
        "coordinator.sampling.max_tokens": 8,
        "coordinator.sampling.top_p": 1.0,
        "coordinator.task": "echo",
        "rollout.dtype": "bfloat16",
        "rollout.gpu_memory_utilization": 0.35,
        "rollout.kv_cache_gib": 8.0,
        "rollout.max_model_len": 256,
        "rollout.num_servers": 1,
        "rollout.return_routed_experts": "on",
        "rollout.stream_interval": 16,
        "trainer.backend": "megatron",
        "trainer.ckpt_interval": 12,
        "trainer.geo_mask": None,
        "trainer.lr": 0.0003,
        "trainer.measure_replay_mismatch": True,
        "trainer.megatron.params_dtype": "bfloat16",
        "trainer.megatron.routing_replay": True,
        "trainer.token_tis_cap": 2.0,
        "weight_bus.bucket_mib": 256.0,
        "weight_bus.transport": "ipc",
    },
}


def test_recipes_are_found():
    assert len(RECIPES) >= 5


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(RECIPE_DIR)))
def test_recipe_validates_against_the_run_config_schema_without_warnings(recipe, caplog):
    with caplog.at_level(logging.WARNING, logger="protos.config.loading"):
        config = load_run_config(recipe)
    assert config.run_id and config.num_steps > 0
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def _flat(values: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value and key != "chat_template_kwargs":
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_composed_recipe_says_what_the_full_recipe_said(name):
    resolved = _flat(load_run_config(RECIPE_DIR / name).model_dump(mode="json"))
    wrong = {key: (resolved.get(key), value) for key, value in EXPECTED[name].items() if resolved.get(key) != value}
    assert not wrong, wrong  # key: (now, expected)


def test_every_recipe_is_pinned_or_is_a_base_of_others():
    bases = {(path.parent / base).resolve() for path in RECIPES if (base := _base(path))}
    unpinned = {p for p in RECIPES if str(p.relative_to(RECIPE_DIR)) not in EXPECTED} - bases
    assert not unpinned, f"add the recipe's values to EXPECTED: {sorted(map(str, unpinned))}"


def test_beam_recipes_are_one_base_plus_deltas():
    beam = [p for p in RECIPES if p.parent.name == "beam" and p.name != "dapo.yaml"]
    assert beam and all(_base(p) == "dapo.yaml" for p in beam)
    base_keys = len(_flat(read_config_file(RECIPE_DIR / "beam" / "dapo.yaml")))
    for path in beam:  # a delta is small: the base holds the run, the delta its layout and what differs
        assert len(_flat(yaml.safe_load(path.read_text()))) < base_keys / 2, path


def _base(path: Path) -> str | None:
    return yaml.safe_load(path.read_text()).get("base")
