"""The launchers' checks made before any process starts (fleetrl demo, and the user errors of fleetrl up, scale and
down), and the summary's speed figures."""

from __future__ import annotations

import pytest

from launcher.demo import check_gpu_layout
from launcher.run_figures import speed_figures
from protos.config import load_run_config

pytestmark = pytest.mark.unit


def test_nccl_on_a_machine_without_a_gpu_per_rank_is_refused_with_the_alternatives():
    config = load_run_config("recipes/gpu-h200.yaml", ["weight_bus.transport=nccl"])
    for num_gpus in (0, 1):
        with pytest.raises(ValueError, match=r"needs one GPU per rank: 1 trainer \+ 1 rollout GPUs.*'ipc'"):
            check_gpu_layout(config, num_gpus)
    check_gpu_layout(config, 2)  # one for the trainer, one for the engine
    check_gpu_layout(load_run_config("recipes/gpu-h200.yaml"), 1)  # ipc shares the one GPU


def test_speed_figures_are_medians_after_the_first_step_with_the_replay_mismatch_means():
    steps = [
        {
            "train_s": 9.0,
            "step_s": 20.0,
            "publish_s": 5.0,
            "on_policy_abs_logprob_diff_r3": 0.004,
            "on_policy_abs_logprob_diff_natural": 0.02,
        }
    ] + [{"train_s": t, "step_s": 2 * t, "publish_s": 1.0} for t in (1.0, 2.0, 3.0)]
    # each server's first update (a plan recorded, caches cold) is left out, as the first step is
    updates = {("rollout-0", 1): (9.0, 9.0), ("rollout-0", 2): (0.5, 0.25), ("rollout-0", 3): (0.7, 0.35)}
    updates |= {("rollout-1", 2): (8.0, 8.0), ("rollout-1", 3): (0.4, 0.15)}
    figures = speed_figures(steps, [0.0, 100.0, 300.0], updates)
    assert (figures["train_s_per_step"], figures["step_s"], figures["publish_s"]) == (2.0, 4.0, 1.0)
    assert figures["rollout_tokens_per_s"] == 200.0  # idle reports (0 tok/s) left out
    assert (figures["weight_update_s"], figures["weight_update_paused_s"]) == (0.5, 0.25)  # medians of 3 later ones
    assert speed_figures(steps, [], {})["weight_update_s"] == 0.0
    assert figures["on_policy_abs_logprob_diff_r3"] == 0.004 and figures["on_policy_abs_logprob_diff_natural"] == 0.02


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--config", "missing.yaml"], "missing.yaml does not exist"),
        (["trainer.lr=-1"], "trainer.lr: Input should be greater than 0"),
        (["trainer.learning_rate=1"], "trainer.learning_rate: Extra inputs are not permitted"),
        (["trainer.icepop=[0.5"], "is not a valid value"),
        (["max_stalenes=1"], "max_stalenes: Extra inputs are not permitted"),
        (["max_staleness=-1"], "max_staleness: Input should be greater than or equal to 0"),
        (["rollout.num_steps=3"], "rollout.num_steps: Extra inputs are not permitted (num_steps is a top-level key"),
    ],
)
def test_demo_user_errors_print_one_line_and_exit_2(args, needle):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "launcher.cli", "demo", *args], capture_output=True, text=True)
    assert done.returncode == 2
    assert needle in done.stderr and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["rollout"], "usage: fleetrl rollout serve --model PATH"),
        (["rollout", "serve", "--model", "no/such/dir"], "model_path no/such/dir is not a directory"),
        (["rollout", "serve"], "model_path must be set"),
        (
            ["rollout", "serve", "--model", ".", "rollout.max_num_seq=4"],
            "rollout.max_num_seq: Extra inputs are not permitted",
        ),
        (["rollout", "serve", "--model", ".", "--config", "missing.yaml"], "missing.yaml does not exist"),
    ],
)
def test_rollout_serve_user_errors_print_one_line_and_exit_2(args, needle):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True)
    assert done.returncode == 2
    assert needle in done.stderr and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["up", "recipes/demo-echo.yaml", "--ray", "local", "launcher.restart.max_restarts=-1"],
            "fleetrl up: invalid config: launcher.restart.max_restarts: Input should be greater than or equal to 0",
        ),
        (["up", "missing.yaml"], "missing.yaml does not exist"),
        (["scale", "rollout=many", "--run-dir", "."], "expected ROLE=COUNT (e.g. rollout=3), got 'rollout=many'"),
        (["scale", "rollout=2"], "name the run: --run-dir DIR (of `fleetrl up`), or --ray ADDRESS --run-id ID"),
        (["down", "--run-dir", "no/such/run"], "no/such/run/ray_run.json does not exist"),
    ],
)
def test_up_scale_and_down_user_errors_print_one_line_and_exit_2(args, needle):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
