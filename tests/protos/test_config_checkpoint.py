"""rollout.max_model_len from the user's checkpoint (issue 28): unset, it is the context length of model_path's
config.json (protos/config/checkpoint.py), resolved once where the run's config is validated; set, it is kept, and
refused above the checkpoint's. Checkpoints here are config.json files written in tmp_path (no model, no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from protos.config import DEMO_MAX_MODEL_LEN, RunConfig, load_run_config
from protos.config.checkpoint import checkpoint_context_length

pytestmark = pytest.mark.unit

RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes"


def checkpoint(path: Path, config: dict, tokenizer_config: dict | None = None) -> Path:
    """A checkpoint directory as far as the run's config reads it: config.json (and tokenizer_config.json)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def test_unset_max_model_len_is_the_checkpoints_max_position_embeddings(tmp_path):
    model = checkpoint(tmp_path / "model", {"max_position_embeddings": 40960})
    config = load_run_config(overrides=[f"model_path={model}"])
    assert config.rollout.max_model_len == 40960


def test_an_explicit_max_model_len_within_the_checkpoint_is_kept(tmp_path):
    model = checkpoint(tmp_path / "model", {"max_position_embeddings": 40960})
    config = load_run_config(overrides=[f"model_path={model}", "rollout.max_model_len=1024"])
    assert config.rollout.max_model_len == 1024


def test_max_model_len_above_the_checkpoint_is_an_error_naming_the_field_and_both_lengths(tmp_path):
    model = checkpoint(tmp_path / "model", {"max_position_embeddings": 4096})
    with pytest.raises(pydantic.ValidationError) as raised:
        load_run_config(overrides=[f"model_path={model}", "rollout.max_model_len=8192"])
    message = str(raised.value)
    assert "rollout.max_model_len" in message and "8192" in message and "4096" in message
    assert "max_position_embeddings" in message


def test_fleetrl_demo_refuses_a_max_model_len_above_the_checkpoint_before_any_process_starts(tmp_path, capsys):
    from launcher.cli import main

    model = checkpoint(tmp_path / "model", {"max_position_embeddings": 4096})
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--out", str(out), f"model_path={model}", "rollout.max_model_len=8192"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "rollout.max_model_len" in err and "8192" in err and "4096" in err
    assert not out.exists()  # no run directory: nothing was started


def test_a_nested_configs_length_is_read_from_its_text_config(tmp_path):
    nested = {"model_type": "qwen2_5_vl", "text_config": {"max_position_embeddings": 32768}, "vision_config": {}}
    model = checkpoint(tmp_path / "model", nested)
    assert load_run_config(overrides=[f"model_path={model}"]).rollout.max_model_len == 32768


def test_max_tokens_is_checked_against_the_resolved_length(tmp_path):
    model = checkpoint(tmp_path / "model", {"max_position_embeddings": 64})
    with pytest.raises(pydantic.ValidationError, match=r"max_tokens must be below rollout.max_model_len \(64 >= 64\)"):
        load_run_config(overrides=[f"model_path={model}", "coordinator.sampling.max_tokens=64"])
    assert load_run_config(overrides=[f"model_path={model}", "coordinator.sampling.max_tokens=63"])


def test_the_demos_tiny_models_and_the_synthetic_engine_keep_their_256_tokens(tmp_path):
    assert DEMO_MAX_MODEL_LEN == 256
    assert RunConfig().rollout.max_model_len == 256  # model_path '': the tiny model is built later, by the launcher
    assert load_run_config(overrides=["tiny_model=beam"]).rollout.max_model_len == 256
    model = checkpoint(tmp_path / "model", {"max_position_embeddings": 40960})
    synthetic = load_run_config(overrides=[f"model_path={model}", "rollout.engine=synthetic"])
    assert synthetic.rollout.max_model_len == 256  # the stand-in engine serves no checkpoint


def test_a_max_model_len_above_the_demo_models_context_is_refused_when_the_config_loads():
    with pytest.raises(
        pydantic.ValidationError, match=r"rollout.max_model_len=512 is above .* tiny model 'qwen3-moe' \(256\)"
    ):
        load_run_config(overrides=["rollout.max_model_len=512"])
    assert load_run_config(overrides=["tiny_model=beam", "rollout.max_model_len=1024"]).rollout.max_model_len == 1024
    synthetic = load_run_config(overrides=["rollout.engine=synthetic", "rollout.max_model_len=4096"])
    assert synthetic.rollout.max_model_len == 4096  # the stand-in serves no model


def test_the_demo_models_are_built_with_the_context_lengths_the_config_checks():
    from modeling.beam.tiny import tiny_beam_config
    from modeling.tiny_model import GPU_DEMO_CONFIG, tiny_config
    from protos.config.rollout import TINY_CONTEXT_LENGTH

    built = {
        "qwen3-moe": tiny_config().max_position_embeddings,
        "qwen3-moe-1b": tiny_config(**GPU_DEMO_CONFIG).max_position_embeddings,
        "beam": tiny_beam_config().max_position_embeddings,
    }
    assert built == TINY_CONTEXT_LENGTH


def test_the_launcher_hands_the_roles_the_resolved_length(tmp_path):
    from launcher.demo import DemoLauncher

    model = checkpoint(tmp_path / "model", {"max_position_embeddings": 2048})
    config = load_run_config(overrides=[f"model_path={model}"])
    (tmp_path / "run").mkdir()
    config_path = DemoLauncher(config, tmp_path / "run").prepare("redis://127.0.0.1:1/0")
    assert json.loads(config_path.read_text())["rollout"]["max_model_len"] == 2048
    assert load_run_config(config_path).rollout.max_model_len == 2048  # what every role loads


def test_a_checkpoint_this_machine_cannot_read_leaves_the_length_to_the_roles(tmp_path):
    """deploy/ renders on a machine without the model volume: the length stays unset and each pod reads it from the
    checkpoint it mounts; an explicit one is kept unchecked."""
    absent = tmp_path / "mounted-elsewhere"
    assert load_run_config(overrides=[f"model_path={absent}"]).rollout.max_model_len is None
    explicit = load_run_config(overrides=[f"model_path={absent}", "rollout.max_model_len=100000"])
    assert explicit.rollout.max_model_len == 100000


def test_a_config_json_without_a_length_key_asks_for_max_model_len(tmp_path):
    model = checkpoint(tmp_path / "model", {"hidden_size": 64})
    with pytest.raises(pydantic.ValidationError, match=r"names no context length.*set rollout.max_model_len"):
        load_run_config(overrides=[f"model_path={model}"])
    assert load_run_config(overrides=[f"model_path={model}", "rollout.max_model_len=512"]).rollout.max_model_len == 512


@pytest.mark.parametrize(
    ("config", "tokenizer_config", "tokens"),
    [
        ({"n_positions": 1024}, None, 1024),  # GPT-2's key
        ({"max_position_embeddings": 8192, "seq_length": 4096}, None, 4096),  # the smallest key
        ({"max_position_embeddings": 8192, "model_max_length": 131072}, None, 131072),  # Command-R's wins
        ({"max_position_embeddings": 40960}, {"model_max_length": 32768}, 32768),  # the tokenizer's caps it
        ({"max_position_embeddings": 40960}, {"model_max_length": 1e30}, 40960),  # transformers' "no limit"
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None, 8192),
        ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, None, 16384),
        (  # YaRN's max_position_embeddings is already the scaled length
            {"max_position_embeddings": 131072, "rope_scaling": {"type": "yarn", "factor": 4.0}},
            None,
            131072,
        ),
        ({"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "default"}}, None, 8192),
    ],
)
def test_the_context_length_is_the_one_vllm_derives_from_the_same_files(tmp_path, config, tokenizer_config, tokens):
    length = checkpoint_context_length(str(checkpoint(tmp_path / "model", config, tokenizer_config)))
    assert length is not None and length.tokens == tokens


def test_vllms_long_length_override_turns_the_refusal_into_a_warning(tmp_path, monkeypatch, caplog):
    model = checkpoint(tmp_path / "model", {"max_position_embeddings": 4096})
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    config = load_run_config(overrides=[f"model_path={model}", "rollout.max_model_len=8192"])
    assert config.rollout.max_model_len == 8192
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in caplog.text


@pytest.mark.parametrize("recipe", sorted(RECIPE_DIR.glob("**/*.yaml")), ids=lambda p: str(p.relative_to(RECIPE_DIR)))
def test_every_recipe_keeps_its_max_model_len(recipe):
    """The tiny-model recipes (model_path '') run at 256 as before unless they set it; the Beam recipes set theirs."""
    config = load_run_config(recipe)
    expected = 10240 if config.model_path else {"toy.yaml": 1024}.get(recipe.name, 256)
    assert config.rollout.max_model_len == expected
