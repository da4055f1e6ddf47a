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

# The launch guide's settings every Beam run shares (shared/seeds/000_6e842dc880aa9843.txt), as fleetrl keys.
GUIDE_COMMON: dict[str, object] = {
    "model_path": "/models/Beam-501B-A23B",
    "num_steps": 50,
    "temperature": 1.0,
    "placement": "colocated",
    "export_dir": "~/exports/{run_id}",
    "data_dir": "../shared/data",
    "coordinator.task": "dapo-math-sample.parquet",
    "coordinator.reward_fn": "math",
    "coordinator.reasoning_effort": "minimal",
    "coordinator.group_size": 8,
    "coordinator.sampling.top_p": 1.0,
    "coordinator.sampling.max_tokens": 8192,
    "coordinator.overlong.enabled": True,
    "coordinator.overlong.buffer_len": 2048,
    "coordinator.dynamic_sampling": False,
    "coordinator.eval.datasets": ["aime-2024.jsonl", "aime-2025.jsonl"],
    "coordinator.eval.labels": {"aime-2024.jsonl": "math_dapo"},
    "coordinator.eval.interval_steps": 5,
    "coordinator.eval.samples_per_problem": 8,
    "rollout.max_model_len": 10240,
    "rollout.dtype": "bfloat16",
    "rollout.kv_cache_dtype": "auto",
    "rollout.tensor_parallel_size": 8,
    "rollout.return_routed_experts": "on",
    "trainer.backend": "megatron",
    "trainer.num_processes": 8,
    "trainer.clip_low": 0.2,
    "trainer.clip_high": 0.28,
    "trainer.loss_agg": "token-mean",
    "trainer.ckpt_dir": "~/ckpts/{run_id}",
    "trainer.megatron.tensor_model_parallel_size": 4,
    "trainer.megatron.expert_model_parallel_size": 8,
    "trainer.megatron.expert_tensor_parallel_size": 1,
    "trainer.megatron.params_dtype": "bfloat16",
    "trainer.megatron.routing_replay": True,
    "weight_bus.transport": "ipc",
}
GUIDE_LORA: dict[str, object] = {
    "trainer.lr": 1e-05,
    "trainer.lora.rank": 64,
    "trainer.lora.alpha": 64.0,
    "trainer.lora.target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
    "trainer.lora.normalize_moe_lora": True,
    "trainer.lora.sync": "adapters",
    "rollout.lora.enabled": True,
    "rollout.lora.max_rank": 64,
    "rollout.lora.max_expert_rank": 8,
    "trainer.megatron.pipeline_model_parallel_size": 2,
    "trainer.ckpt_interval": 10,
    "trainer.resume": "none",
    "rollout.pipeline_parallel_size": 2,
    "trainer.geo_mask": None,
    "weight_bus.codec": "bf16",
}
GUIDE_FULL_FT: dict[str, object] = {
    "trainer.lr": 1e-06,
    "trainer.lora.rank": 0,
    "groups_per_step": 64,
    "trainer.mini_batches": 2,
    "trainer.num_nodes": 8,
    "trainer.ckpt_interval": 25,
    "trainer.resume": "latest",
    "trainer.megatron.recompute": "full",
    "trainer.megatron.optimizer_cpu_offload": True,
    "trainer.megatron.optimizer_state_disk_dir": "",
}

# What the recipes resolved to when each was written out in full (commit b8e6702, before they were rewritten as a
# base plus deltas), in today's spelling: every key the files wrote and every value off the schema's default. The
# Beam recipes are the launch guide's four runs (shared/seeds; recipes/beam/README.md): their values must not drift.
EXPECTED: dict[str, dict[str, object]] = {
    "beam/dapo-lora-16.yaml": {
        **GUIDE_COMMON,
        **GUIDE_LORA,
        "run_id": "beam-dapo-lora-16",
        "groups_per_step": 32,
        "trainer.mini_batches": 1,
        "trainer.num_nodes": 2,
        "rollout.num_servers": 1,
    },
    "beam/dapo-lora-32.yaml": {
        **GUIDE_COMMON,
        **GUIDE_LORA,
        "run_id": "beam-dapo-lora-32",
        "groups_per_step": 64,
        "trainer.mini_batches": 2,
        "trainer.num_nodes": 4,
        "rollout.num_servers": 2,
    },
    "beam/dapo-full-ft.yaml": {
        **GUIDE_COMMON,
        **GUIDE_FULL_FT,
        "run_id": "beam-dapo-full-ft",
        "trainer.megatron.pipeline_model_parallel_size": 4,
        "trainer.geo_mask": None,
        "rollout.num_servers": 4,
        "rollout.pipeline_parallel_size": 2,
        "rollout.quantization": "none",
        "weight_bus.codec": "bf16",
    },
    "beam/dapo-mxfp8.yaml": {
        **GUIDE_COMMON,
        **GUIDE_FULL_FT,
        "run_id": "beam-dapo-mxfp8",
        "trainer.megatron.pipeline_model_parallel_size": 8,
        "trainer.geo_mask": [0.99, 1.01],
        "rollout.num_servers": 8,
        "rollout.pipeline_parallel_size": 1,
        "rollout.enable_expert_parallel": True,
        "rollout.quantization": "mxfp8",
        "weight_bus.codec": "mxfp8",
        "weight_bus.receive_mode": "dequantize",
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
    "bench-async-tail.yaml": {
        "run_id": "bench-async-tail",
        "num_steps": 60,
        "groups_per_step": 16,
        "max_staleness": 1,
        "coordinator.group_size": 8,
        "coordinator.sampling.max_tokens": 96,
        "coordinator.task": "tail",
        "coordinator.tail_min_tokens": 1,
        "rollout.num_servers": 1,
        "trainer.geo_mask": None,
        "trainer.lr": 0.002,
        "trainer.micro_batch_tokens": 512,
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
    "gpu-h200-mxfp8.yaml": {
        "run_id": "gpu-h200-mxfp8",
        "tiny_model": "qwen3-moe-1b",
        "num_steps": 50,
        "rollout.quantization": "mxfp8",
        "trainer.ckpt_interval": 0,
        "trainer.geo_mask": [0.99, 1.01],
        "weight_bus.codec": "bf16",
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
        if isinstance(value, dict) and value and key not in ("chat_template_kwargs", "labels"):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_composed_recipe_says_what_the_full_recipe_said(name):
    resolved = _flat(load_run_config(RECIPE_DIR / name).model_dump(mode="json"))
    wrong = {key: (resolved.get(key), value) for key, value in EXPECTED[name].items() if resolved.get(key) != value}
    assert not wrong, wrong  # key: (now, expected)


# Deltas applied on top of other recipes (a second --config), not runs of their own.
OVERLAYS = {"beam/toy.yaml"}


def test_every_recipe_is_pinned_or_is_a_base_of_others():
    bases = {(path.parent / base).resolve() for path in RECIPES if (base := _base(path))}
    named = set(EXPECTED) | OVERLAYS
    unpinned = {p for p in RECIPES if str(p.relative_to(RECIPE_DIR)) not in named} - bases
    assert not unpinned, f"add the recipe's values to EXPECTED: {sorted(map(str, unpinned))}"


def test_beam_recipes_are_one_base_plus_deltas():
    beam = [p for p in RECIPES if p.parent.name == "beam" and p.name not in ("dapo.yaml", "toy.yaml")]
    assert len(beam) == 4
    for path in beam:  # every run's base chain ends in dapo.yaml (a run may build on another run: lora-32 on lora-16)
        chain = path
        while _base(chain) != "dapo.yaml":
            chain = chain.parent / _base(chain)
    base_keys = len(_flat(read_config_file(RECIPE_DIR / "beam" / "dapo.yaml")))
    for path in beam:  # a delta is small: the base holds the run, the delta its layout and what differs
        assert len(_flat(yaml.safe_load(path.read_text()))) < base_keys / 2, path


def _base(path: Path) -> str | None:
    return yaml.safe_load(path.read_text()).get("base")


@pytest.mark.parametrize("run", ["dapo-lora-16.yaml", "dapo-lora-32.yaml", "dapo-full-ft.yaml", "dapo-mxfp8.yaml"])
def test_the_toy_overlay_keeps_each_runs_own_switches_on_a_one_rank_layout(run):
    full = load_run_config(RECIPE_DIR / "beam" / run)
    toy = load_run_config([RECIPE_DIR / "beam" / run, RECIPE_DIR / "beam" / "toy.yaml"])
    assert toy.trainer.num_nodes * toy.trainer.num_processes == 1 and toy.rollout.num_servers == 1
    kept = ("lr", "mini_batches", "clip_low", "clip_high", "loss_agg", "geo_mask", "resume", "lora.rank", "lora.alpha")
    for key in kept:
        assert _flat(toy.trainer.model_dump())[key] == _flat(full.trainer.model_dump())[key], key
    assert (toy.placement, toy.weight_bus.codec, toy.coordinator.eval.labels) == (
        full.placement,
        full.weight_bus.codec,
        full.coordinator.eval.labels,
    )
    assert toy.coordinator.reasoning_effort == full.coordinator.reasoning_effort == "minimal"
