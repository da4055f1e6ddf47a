"""A user's own checkpoint (issue 28): a tiny Qwen3-MoE with the byte-level BPE tokenizer, its ChatML template in
tokenizer_config.json and embedding rows padded above the tokenizer (`fleetrl model init-tiny --tokenizer bpe`,
modeling/user_checkpoint.py), through the math task's prompts and a whole `fleetrl demo --config
recipes/demo-math.yaml` run on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.evaluation import load_eval_sets
from coordinator.tasks import PromptRenderer, build_task, load_tokenizer
from modeling.bpe_tokenizer import build_bpe_tokenizer
from protos.config import load_run_config

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE = REPO_ROOT / "recipes" / "demo-math.yaml"
CHECKPOINT_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
}


@pytest.mark.integration
def test_math_prompts_are_rendered_with_the_checkpoints_chat_template(shared_data, tmp_path, monkeypatch):
    build_bpe_tokenizer(shared_data / "dapo-math-sample.parquet").save_pretrained(tmp_path, save_jinja_files=False)
    tokenizer = load_tokenizer(str(tmp_path))  # what the coordinator loads from model_path
    monkeypatch.chdir(REPO_ROOT)  # the recipe's paths are relative to the repository root
    config = load_run_config(RECIPE, overrides=["coordinator.dataset_limit=64"])
    task = build_task(config.coordinator, config.rollout.max_model_len, tokenizer, None)
    limit = config.rollout.max_model_len - config.coordinator.sampling.max_tokens
    for prompt in (task.next_prompt() for _ in range(8)):
        text = tokenizer.decode(prompt.prompt_token_ids)
        # DAPO rows are chat messages already (the recipe's prompt_template is for plain rows: the AIME files)
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert len(prompt.prompt_token_ids) <= limit
    sets = load_eval_sets(config.coordinator, PromptRenderer(tokenizer, {}), config.rollout.max_model_len)
    assert len(sets[0].problems) >= 20  # most AIME problems fit in 256 tokens of this vocabulary
    aime = tokenizer.decode(sets[0].problems[0].prompt_token_ids)  # a plain row, through prompt_template
    assert aime.startswith("<|im_start|>user\n") and aime.endswith(
        "answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_demo_math_runs_to_the_end_on_a_checkpoint_with_the_bpe_tokenizer(shared_data, tmp_path):
    model, out = tmp_path / "model", tmp_path / "run"
    init = [sys.executable, "-m", "launcher.cli", "model", "init-tiny", str(model), "--tokenizer", "bpe"]
    subprocess.run(init, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    assert CHECKPOINT_FILES <= {p.name for p in model.iterdir()}
    # The recipe as a user runs it, made cheap for CI: one server, few and short samples, a two-problem eval.
    overrides = [
        f"model_path={model}",
        "groups_per_step=2",
        "coordinator.group_size=4",
        "coordinator.sampling.max_tokens=16",
        "coordinator.overlong.buffer_len=8",
        "coordinator.dynamic_sampling=false",  # a random model's equal rewards would be resampled up to 4 times
        "coordinator.eval.limit=2",
        "coordinator.eval.samples_per_problem=2",
        "coordinator.admin_port=0",  # a free port: another demo on this machine may hold the default
        "rollout.num_servers=1",
    ]
    command = [sys.executable, "-m", "launcher.cli", "demo", "--config", str(RECIPE), "--steps", "2"]
    result = subprocess.run(
        [*command, "--out", str(out), *overrides], cwd=REPO_ROOT, capture_output=True, text=True, timeout=580
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trajectories_trained"] == 2 * 2 * 4
    assert summary["eval"]["eval/aime-2025/num_problems"] == 2
    assert "no chat template" not in (out / "logs" / "coordinator.log").read_text()
    exported = out / "export" / "hf"  # the trained checkpoint keeps the user's tokenizer, template and padded rows
    assert "chat_template" in json.loads((exported / "tokenizer_config.json").read_text())
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == 4096


@pytest.mark.unit
@pytest.mark.parametrize("option", [["--family", "beam"], ["--warmup-steps", "10"]])
def test_init_tiny_with_bpe_refuses_what_it_does_not_build(option, tmp_path, capsys):
    from launcher.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["model", "init-tiny", str(tmp_path / "model"), "--tokenizer", "bpe", *option])
    assert exited.value.code == 2 and "--tokenizer bpe builds only" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()
