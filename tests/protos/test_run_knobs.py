"""The launch guide's run knobs as config keys: env aliases (a variable overrides the recipe, a dotted override both),
their validation, path expansion, the colocated layout's checks and the chat template's reasoning effort."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from protos.config import ENV_ALIASES, env_overrides, load_run_config

pytestmark = pytest.mark.unit

LORA_16 = Path(__file__).resolve().parents[2] / "recipes" / "beam" / "dapo-lora-16.yaml"


def test_an_env_variable_overrides_the_recipe_and_a_dotted_override_overrides_both():
    environ = {"MAX_TRAINING_STEPS": "20", "CKPT_INTERVAL": "5", "RESUME_MODE": "latest", "LOGGER": "wandb"}
    config = load_run_config(LORA_16, ["trainer.ckpt_interval=3"], environ=environ)
    assert config.num_steps == 20 and config.trainer.resume == "latest" and config.logger.backend == "wandb"
    assert config.trainer.ckpt_interval == 3  # the command line wins
    assert load_run_config(LORA_16).num_steps == 50  # no environ: the roles read resolved configs only


def test_every_guide_variable_sets_its_key():
    environ = {
        "MAX_TRAINING_STEPS": "7",
        "REASONING_EFFORT": "xhigh",
        "LOGGER": "console",
        "RUN_NAME": "my-run",
        "PROJECT_NAME": "beam-rl",
        "LOG_PATH": "/logs/{run_id}",
        "CKPT_PATH": "/ckpts/{run_id}",
        "EXPORT_PATH": "/exports/{run_id}",
        "CKPT_INTERVAL": "0",
        "RESUME_MODE": "none",
        "MODEL_PATH": "/models/beam",
        "DATA_DIR": "/data/dapo",
        "OPTIMIZER_STATE_DISK_DIR": "/nvme/opt",
        "KV_CACHE_DTYPE": "fp8_e4m3",
    }
    assert set(environ) == set(ENV_ALIASES)
    offload = ["trainer.megatron.optimizer_cpu_offload=true", "trainer.megatron.params_dtype=bfloat16"]
    config = load_run_config(LORA_16, offload, environ=environ)
    assert (config.num_steps, config.coordinator.reasoning_effort, config.run_id) == (7, "xhigh", "my-run")
    assert (config.logger.project_name, config.trainer.ckpt_interval, config.trainer.resume) == ("beam-rl", 0, "none")
    assert str(config.log_path()) == "/logs/my-run" and str(config.export_path()) == "/exports/my-run"
    assert config.expand_path(config.trainer.ckpt_dir) == "/ckpts/my-run" and config.model_path == "/models/beam"
    assert (
        config.trainer.megatron.optimizer_state_disk_dir == "/nvme/opt" and config.rollout.kv_cache_dtype == "fp8_e4m3"
    )
    assert config.with_dataset_paths().coordinator.task == "/data/dapo/dapo-math-sample.parquet"
    labels = config.with_dataset_paths().coordinator.eval.labels
    assert labels == {"/data/dapo/aime-2024.jsonl": "math_dapo"}


def test_an_empty_variable_is_unset_except_the_optimizer_disk_dir_where_empty_means_host_memory():
    assert env_overrides({"MAX_TRAINING_STEPS": "", "OPTIMIZER_STATE_DISK_DIR": ""}) == [
        "trainer.megatron.optimizer_state_disk_dir="
    ]
    recipe = LORA_16.parent / "dapo-full-ft.yaml"
    config = load_run_config(recipe, environ={"OPTIMIZER_STATE_DISK_DIR": ""})
    assert config.trainer.megatron.optimizer_cpu_offload and config.trainer.megatron.optimizer_state_disk_dir == ""


@pytest.mark.parametrize(
    ("environ", "field"),
    [
        ({"REASONING_EFFORT": "extreme"}, "coordinator.reasoning_effort"),
        ({"LOGGER": "tensorboard"}, "logger.backend"),
        ({"RESUME_MODE": "from_path"}, "trainer.resume_path"),
        ({"CKPT_INTERVAL": "-1"}, "trainer.ckpt_interval"),
        ({"KV_CACHE_DTYPE": "bfloat16"}, "rollout.kv_cache_dtype"),
        ({"RUN_NAME": "two words"}, "run_id"),
    ],
)
def test_a_bad_variable_fails_naming_its_key(environ, field):
    with pytest.raises(pydantic.ValidationError) as error:
        load_run_config(LORA_16, environ=environ)
    assert field in str(error.value).replace("\n", " ") or field.split(".")[-1] in str(error.value)


def test_reasoning_effort_goes_into_the_chat_template_once():
    config = load_run_config(overrides=["coordinator.reasoning_effort=minimal"])
    assert config.coordinator.template_kwargs() == {"reasoning_effort": "minimal"}
    with pytest.raises(pydantic.ValidationError, match="keep coordinator.reasoning_effort only"):
        load_run_config(
            overrides=["coordinator.reasoning_effort=low", "coordinator.chat_template_kwargs={reasoning_effort: high}"]
        )


def test_eval_labels_must_name_eval_files():
    with pytest.raises(pydantic.ValidationError, match="not in coordinator.eval.datasets"):
        load_run_config(overrides=["coordinator.eval.datasets=[a.jsonl]", "coordinator.eval.labels={b.jsonl: x}"])
