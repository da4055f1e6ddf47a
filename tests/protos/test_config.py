"""The run config tree (protos.config): defaults, dotted overrides, validation, YAML files."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from protos.config import RunConfig, apply_overrides, load_run_config

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_defaults_load_without_a_file():
    config = load_run_config()
    assert config == RunConfig()
    assert config.run_id == "demo"
    assert config.trainer.lr == 5e-3
    assert config.max_staleness == 1
    assert config.temperature == 1.0
    assert config.weight_bus.transport == "tcp"
    assert config.coordinator.sampling.max_tokens < config.rollout.max_model_len


def test_dotted_overrides_reach_nested_sections():
    config = load_run_config(
        overrides=["trainer.lr=1e-6", "coordinator.sampling.top_p=0.9", "rollout.weight_updates=manual"]
    )
    assert config.trainer.lr == pytest.approx(1e-6)
    assert config.coordinator.sampling.top_p == pytest.approx(0.9)
    assert config.rollout.weight_updates == "manual"
    # untouched siblings keep their defaults
    assert config.coordinator.sampling.top_k == -1
    assert config.trainer.lr_warmup_steps == 0


def test_override_values_are_parsed_as_yaml():
    config = load_run_config(overrides=["trainer.geo_mask=null", "trainer.icepop=[0.5, 2.0]", "run_id=exp-a"])
    assert config.trainer.geo_mask is None
    assert config.trainer.icepop == (0.5, 2.0)
    assert config.run_id == "exp-a"


def test_unknown_key_is_an_error_naming_the_key():
    with pytest.raises(pydantic.ValidationError, match=r"trainer\.learning_rate"):
        load_run_config(overrides=["trainer.learning_rate=1e-6"])


def test_out_of_range_value_is_an_error_naming_the_field():
    with pytest.raises(pydantic.ValidationError, match=r"trainer\.lr") as info:
        load_run_config(overrides=["trainer.lr=-1"])
    assert "greater than 0" in str(info.value)


def test_override_without_equals_sign_is_a_value_error():
    with pytest.raises(ValueError, match=r"not KEY=VALUE"):
        load_run_config(overrides=["trainer.lr"])


def test_override_through_a_scalar_is_refused():
    with pytest.raises(ValueError, match=r"not a section"):
        apply_overrides({"trainer": {"lr": 1.0}}, ["trainer.lr.x=1"])


def test_max_tokens_not_below_max_model_len_is_an_error():
    with pytest.raises(pydantic.ValidationError, match=r"max_tokens must be below rollout.max_model_len"):
        load_run_config(overrides=["coordinator.sampling.max_tokens=256", "rollout.max_model_len=256"])
    config = load_run_config(overrides=["coordinator.sampling.max_tokens=255", "rollout.max_model_len=256"])
    assert config.coordinator.sampling.max_tokens == 255


def test_run_id_with_a_colon_is_refused():
    with pytest.raises(pydantic.ValidationError, match=r"run_id"):
        load_run_config(overrides=["run_id=a:b"])


def test_yaml_file_is_loaded_and_overrides_win(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "run_id: yaml-run\n"
        "num_steps: 7\ntemperature: 0.5\n"
        "trainer:\n  lr: 2.0e-4\n"
        "coordinator:\n  sampling: {max_tokens: 16}\n"
    )
    config = load_run_config(path, overrides=["num_steps=9"])
    assert config.run_id == "yaml-run"
    assert config.trainer.lr == pytest.approx(2e-4)
    assert config.num_steps == 9
    assert config.temperature == 0.5
    assert config.coordinator.sampling.max_tokens == 16


def test_yaml_file_without_a_mapping_is_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"mapping"):
        load_run_config(path)


def test_json_file_is_loaded(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(RunConfig(run_id="json-run").model_dump_json())
    assert load_run_config(path) == RunConfig(run_id="json-run")


def test_demo_echo_recipe_loads():
    config = load_run_config(REPO_ROOT / "recipes" / "demo-echo.yaml")
    assert config.run_id == "demo"
    assert config.coordinator.task == "echo"
    assert config.groups_per_step == 16
    assert config.num_steps == 50
    assert config.trainer.geo_mask is None
    assert config.trainer.token_tis_cap == 2.0
    assert config.rollout.num_servers == 2


def test_text_fields_keep_override_values_as_strings():
    config = load_run_config(
        overrides=[
            "run_id=42",
            "coordinator.task=2024.jsonl",
            "trainer.resume=none",
            "coordinator.prompt_template='{problem}?'",
        ]
    )
    assert (config.run_id, config.coordinator.task, config.trainer.resume) == ("42", "2024.jsonl", "none")
    assert config.coordinator.prompt_template == "{problem}?"  # YAML quotes still come off
    assert load_run_config(overrides=["trainer.lr=1e-6"]).trainer.lr == 1e-6  # numbers still parse


def test_trainer_ranks_must_fit_the_backend_and_the_megatron_layout():
    with pytest.raises(ValueError, match="needs trainer.backend='megatron'"):
        load_run_config(None, ["trainer.num_processes=2"])
    with pytest.raises(ValueError, match="not a multiple of megatron TP x PP x CP = 4"):
        load_run_config(
            None,
            ["trainer.backend=megatron", "trainer.num_processes=6", "trainer.megatron.pipeline_model_parallel_size=4"],
        )
    with pytest.raises(ValueError, match="EP x ETP = 8 does not divide the 4 ranks"):
        load_run_config(
            None,
            [
                "trainer.backend=megatron",
                "trainer.num_processes=8",
                "trainer.megatron.pipeline_model_parallel_size=2",
                "trainer.megatron.expert_model_parallel_size=8",
            ],
        )
    config = load_run_config(
        None,
        [
            "trainer.backend=megatron",
            "trainer.num_nodes=2",
            "trainer.num_processes=8",
            "trainer.megatron.tensor_model_parallel_size=4",
            "trainer.megatron.pipeline_model_parallel_size=2",
            "trainer.megatron.expert_model_parallel_size=8",
            "trainer.megatron.expert_tensor_parallel_size=1",
        ],
    )
    assert config.trainer.num_nodes * config.trainer.num_processes == 16


def test_lora_settings_are_checked():
    assert not load_run_config(None, []).trainer.lora.enabled
    assert load_run_config(None, ["trainer.lora.rank=8"]).trainer.lora.enabled
    with pytest.raises(ValueError, match="target_modules"):
        load_run_config(None, ["trainer.lora.rank=8", "trainer.lora.target_modules=[q_proj]"])
    with pytest.raises(ValueError, match="moe_router_bias_update_rate"):
        load_run_config(None, ["trainer.lora.rank=8", "trainer.megatron.moe_router_bias_update_rate=0.001"])


def test_adapter_sync_and_the_engines_lora_slots_go_together():
    adapters = ["trainer.lora.rank=64", "trainer.lora.sync=adapters", "rollout.lora.enabled=true"]
    config = load_run_config(None, adapters)
    assert config.rollout.lora.max_rank == 64 and config.rollout.lora.expert_rank_limit() == 64
    with pytest.raises(ValueError, match="set rollout.lora.enabled=true"):
        load_run_config(None, adapters[:2])
    with pytest.raises(ValueError, match="set trainer.lora.sync='adapters'"):
        load_run_config(None, ["trainer.lora.rank=8", "rollout.lora.enabled=true"])
    with pytest.raises(ValueError, match=r"rollout.lora.max_rank \(32\) is below trainer.lora.rank \(64\)"):
        load_run_config(None, [*adapters, "rollout.lora.max_rank=32"])
    with pytest.raises(ValueError, match="needs trainer.lora.rank > 0"):
        load_run_config(None, ["trainer.lora.sync=adapters", "rollout.lora.enabled=true"])
    with pytest.raises(ValueError, match="max_expert_rank"):
        load_run_config(None, [*adapters, "rollout.lora.max_rank=8", "rollout.lora.max_expert_rank=16"])
    with pytest.raises(ValueError, match="rollout.lora.max_rank"):  # vLLM's slot sizes only
        load_run_config(None, [*adapters, "rollout.lora.max_rank=48"])
    assert load_run_config(None, [*adapters, "rollout.lora.max_expert_rank=8"]).rollout.lora.expert_rank_limit() == 8


def _literal_fields(model=RunConfig, prefix=""):
    """(dotted key, choices) of every Literal field in the tree, Optional ones included."""
    from typing import Literal, get_args, get_origin

    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        annotation = field.annotation
        candidates = (annotation, *get_args(annotation))
        section = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if section is not None:
            yield from _literal_fields(section, f"{prefix}{name}.")
            continue
        literal = next((c for c in candidates if get_origin(c) is Literal), None)
        if get_origin(annotation) is list and get_origin(get_args(annotation)[0]) is Literal:
            yield f"{prefix}{name}", get_args(get_args(annotation)[0]), True
        elif literal is not None:
            yield f"{prefix}{name}", get_args(literal), False


def test_every_literal_field_takes_each_documented_value_on_the_command_line():
    """``rollout.return_routed_experts=on`` was read by YAML as True and refused: overrides go by the field's type."""
    fields = {key: (choices, is_list) for key, choices, is_list in _literal_fields()}
    assert {"rollout.return_routed_experts", "weight_bus.receive_mode", "trainer.lora.target_modules"} <= set(fields)
    # values some fields need beside them to validate (receive_mode=mxfp8 needs codec=mxfp8)
    companions = {
        ("weight_bus.receive_mode", "mxfp8"): ["weight_bus.codec=mxfp8"],
        ("trainer.resume", "from_path"): ["trainer.resume_path=/ckpt/step-000001"],
        ("placement", "colocated"): ["rollout.num_servers=1", "rollout.gpu_memory_utilization=0.5"],
        ("trainer.lora.sync", "adapters"): ["trainer.lora.rank=8", "rollout.lora.enabled=true"],
    }
    for key, (choices, is_list) in fields.items():
        for choice in choices:
            written = f"[{choice}]" if is_list else choice
            config = load_run_config(overrides=[f"{key}={written}", *companions.get((key, choice), [])])
            node = config
            for part in key.split("."):
                node = getattr(node, part)
            assert node == ([choice] if is_list else choice), (key, choice, node)


def test_a_literal_override_outside_its_choices_names_the_field_and_the_choices():
    with pytest.raises(pydantic.ValidationError, match=r"rollout\.return_routed_experts(.|\n)*'auto', 'on' or 'off'"):
        load_run_config(overrides=["rollout.return_routed_experts=yes"])


def test_a_recipe_composes_from_its_base_and_several_files_merge_in_order(tmp_path):
    (tmp_path / "base.yaml").write_text("run_id: base\nnum_steps: 7\ntrainer:\n  lr: 1.0e-3\n  seed: 3\n")
    (tmp_path / "delta.yaml").write_text("base: base.yaml\nrun_id: delta\ntrainer:\n  lr: 2.0e-3\n")
    (tmp_path / "more.yaml").write_text("max_staleness: 3\n")
    config = load_run_config([tmp_path / "delta.yaml", tmp_path / "more.yaml"], ["num_steps=9"])
    assert (config.run_id, config.trainer.lr, config.max_staleness) == ("delta", 2e-3, 3)
    assert config.num_steps == 9  # the base's 7, then the override
    assert load_run_config(tmp_path / "delta.yaml").trainer.seed == 3  # sections merge key by key
    assert load_run_config(tmp_path / "delta.yaml").num_steps == 7


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"missing\.yaml does not exist"):
        load_run_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("trainer: [unclosed\n")
    with pytest.raises(ValueError, match=r"bad\.yaml is not valid YAML"):
        load_run_config(tmp_path / "bad.yaml")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ValueError, match="loops back"):
        load_run_config(tmp_path / "loop.yaml")


def test_a_validation_error_is_described_on_one_line_naming_each_field():
    from protos.config import describe_config_error

    with pytest.raises(pydantic.ValidationError) as caught:
        load_run_config(overrides=["trainer.lr=-1", "rollout.dtype=float64"])
    line = describe_config_error(caught.value)
    assert "\n" not in line and "trainer.lr: Input should be greater than 0" in line and "rollout.dtype" in line


def test_keys_several_roles_read_live_once_at_the_top_and_dotted_overrides_set_them():
    config = load_run_config(overrides=["num_steps=3", "groups_per_step=2", "max_staleness=0", "temperature=0.7"])
    assert (config.num_steps, config.groups_per_step, config.max_staleness) == (3, 2, 0)
    assert config.temperature == pytest.approx(0.7)
    sampling = config.training_sampling()  # what a training request gets: the section at the run's temperature
    assert sampling.temperature == pytest.approx(0.7) and sampling.max_tokens == config.coordinator.sampling.max_tokens
    assert config.eval_sampling() == sampling  # eval without its own sampling samples as training does
    from protos.config import CoordinatorConfig, TrainerConfig, TrainingSamplingConfig

    assert "num_steps" not in TrainerConfig.model_fields and "temperature" not in TrainingSamplingConfig.model_fields
    assert not {"groups_per_step", "max_staleness"} & set(CoordinatorConfig.model_fields)


def test_a_moved_key_in_its_old_section_of_a_file_is_refused_naming_the_top_level_key(tmp_path):
    from protos.config import describe_config_error

    path = tmp_path / "old.yaml"
    path.write_text("coordinator: {groups_per_step: 3, sampling: {temperature: 0.5}}\n")
    with pytest.raises(pydantic.ValidationError) as caught:
        load_run_config(path)
    line = describe_config_error(caught.value)
    assert "coordinator.groups_per_step: Extra inputs are not permitted (groups_per_step is a top-level key" in line
    assert "coordinator.sampling.temperature: Extra inputs are not permitted (temperature is a top-level key" in line


def test_a_moved_key_written_inside_a_section_is_a_one_line_error_saying_where_it_lives():
    from protos.config import describe_config_error

    with pytest.raises(pydantic.ValidationError) as caught:
        load_run_config(overrides=["trainer.max_staleness=1"])
    line = describe_config_error(caught.value)
    assert (
        line
        == "trainer.max_staleness: Extra inputs are not permitted (max_staleness is a top-level key: write max_staleness=...)"
    )


def test_eval_with_several_samples_needs_a_temperature_above_zero_from_its_own_sampling_or_the_run():
    evals = ["coordinator.eval.datasets=[a.jsonl]", "coordinator.eval.samples_per_problem=4"]
    with pytest.raises(pydantic.ValidationError, match="samples_per_problem > 1 needs a sampling temperature > 0"):
        load_run_config(overrides=[*evals, "temperature=0"])
    config = load_run_config(overrides=[*evals, "temperature=0", "coordinator.eval.sampling.temperature=0.6"])
    assert config.eval_sampling().temperature == pytest.approx(0.6) and config.training_sampling().temperature == 0
