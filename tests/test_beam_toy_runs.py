"""The four Beam runs of the launch guide at toy scale: `fleetrl demo --config recipes/beam/<run>.yaml --config
recipes/beam/toy.yaml`, each with its own switches (recipes/beam/toy.yaml says what the toy changes and why), on a
random tiny Beam. Each run trains 2 steps with the Megatron trainer, evaluates both AIME files under the guide's
labels, checkpoints every step and exports the final policy as an HF checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BEAM = Path(__file__).resolve().parents[1] / "recipes" / "beam"
RUNS = ["dapo-lora-16.yaml", "dapo-lora-32.yaml", "dapo-full-ft.yaml", "dapo-mxfp8.yaml"]


@pytest.fixture(scope="module")
def tiny_beam(tmp_path_factory) -> Path:
    from modeling.beam.tiny import init_tiny_beam

    return init_tiny_beam(tmp_path_factory.mktemp("tiny-beam"))  # random weights: no warm-up, nothing to learn


@pytest.mark.timeout(900)
@pytest.mark.parametrize("recipe", RUNS)
def test_beam_run_at_toy_scale_trains_evaluates_checkpoints_and_exports(tmp_path, tiny_beam, recipe, shared_data):
    # shared_data: the recipes train on the guide's DAPO-Math slice and evaluate on AIME from ../shared/data
    out = tmp_path / "run"
    # One run logs to an offline Weights & Biases run, set through the guide's variables (LOGGER, LOG_PATH).
    wandb_env = {"LOGGER": "wandb", "LOG_PATH": str(tmp_path / "logs"), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env = {**os.environ, **(wandb_env if recipe == "dapo-full-ft.yaml" else {})}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "demo",
            "--config",
            str(BEAM / recipe),
            "--config",
            str(BEAM / "toy.yaml"),
            "--out",
            str(out),
            f"model_path={tiny_beam}",
            "coordinator.admin_port=0",  # a free port: another demo on this machine may hold the default
        ],
        capture_output=True,
        text=True,
        timeout=880,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trajectories_trained"] == 2 * 2 * 4
    assert summary["weight_versions_published"] == 2 and set(summary["rollout_server_versions"].values()) == {2}
    # the guide's eval labels: AIME 2024 under its dataset label, AIME 2025 under its own
    assert summary["eval"]["eval/math_dapo/num_problems"] == 2 and summary["eval"]["eval/aime-2025/num_problems"] == 2
    rows = [json.loads(line) for line in (out / "export" / "eval" / "v2.jsonl").open()]
    assert {row["dataset"] for row in rows} == {"math_dapo", "aime-2025"} and len(rows) == 2 * 2 * 2
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000001", "step-000002"]
    index = json.loads((out / "export" / "hf" / "model.safetensors.index.json").read_text())
    hf_names = set(index["weight_map"])
    assert (out / "export" / "hf" / "config.json").exists() and (out / "export" / "hf" / "tokenizer.json").exists()
    assert any(".mlp.experts." in name for name in hf_names) and "lm_head.weight" in hf_names
    lora = config["trainer"]["lora"]
    assert (out / "export" / "adapters").exists() == (lora["rank"] > 0)
    if recipe.startswith("dapo-lora"):
        assert (lora["rank"], lora["alpha"], config["trainer"]["lr"]) == (64, 64.0, 1e-5)
    else:
        assert config["trainer"]["lr"] == 1e-6 and config["trainer"]["resume"] == "latest"
    if recipe == "dapo-mxfp8.yaml":
        assert config["weight_bus"]["codec"] == "mxfp8" and config["trainer"]["geo_mask"] == [0.99, 1.01]
    if recipe == "dapo-full-ft.yaml":  # role logs and the offline run under LOG_PATH
        assert (tmp_path / "logs" / "trainer.log").exists()
        assert list((tmp_path / "logs").glob("wandb/offline-run-*/run-*.wandb"))
