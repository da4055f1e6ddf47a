"""One real end-to-end run of `fleetrl demo`: every role a process, two vLLM servers, Redis, weight bus.

The weights travel in MXFP8 here (the demo's default is bf16, which the rollout tests cover): every
version reaches both servers through quantize -> tcp -> dequantize -> reload.
"""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from modeling.tiny_model import init_tiny

pytestmark = pytest.mark.e2e

# How the launcher's role processes and vLLM's engine processes look in `ps` (not, say, a pytest run of
# tests/rollout_service/). Anything else starting vLLM on this machine meanwhile would count too.
ROLE_COMMANDS = (
    "-m rollout_service serve",
    "-m trainer_service train",
    "valkey-server",
    "-m coordinator run",
    "VLLM::",
)


@pytest.mark.timeout(600)
def test_short_demo_trains_publishes_and_stays_within_staleness_bound(tmp_path):
    model = init_tiny(tmp_path / "model")
    out = tmp_path / "run"
    before = {p.pid for p in psutil.process_iter()}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "demo",
            "--steps",
            "3",
            "--out",
            str(out),
            f"model_path={model}",
            "groups_per_step=4",
            "coordinator.group_size=4",
            "coordinator.admin_port=0",  # a free port: another demo on this machine may hold the default
            "weight_bus.codec=mxfp8",
        ],
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["trajectories_trained"] == 3 * 4 * 4
    assert summary["trajectories_produced"] >= summary["trajectories_trained"]
    assert summary["max_staleness_seen"] <= summary["max_staleness_allowed"] == 1
    assert summary["weight_versions_published"] == 3
    assert summary["rollout_servers"] == 2
    assert set(summary["rollout_server_versions"].values()) == {3}
    # Every process the demo started is gone (no orphaned engines or Redis).
    leftovers = [
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if p.pid not in before and any(s in " ".join(p.info["cmdline"] or []) for s in ROLE_COMMANDS)
    ]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]


@pytest.mark.timeout(600)
def test_short_beam_demo_with_a_two_rank_megatron_lora_trainer_keeps_vllm_equal_to_the_trainer(tmp_path):
    """Tiny Beam, trainer = Megatron under torchrun with PP=2 training LoRA adapters, vLLM's Beam model serving:
    at staleness 0 every trained token's rollout logprob equals the trainer's, so the merged partial weight
    updates reach vLLM intact on every step."""
    from modeling.beam.tiny import init_tiny_beam

    model = init_tiny_beam(tmp_path / "beam")
    out = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "demo",
            "--steps",
            "3",
            "--out",
            str(out),
            f"model_path={model}",
            "groups_per_step=4",
            "coordinator.group_size=4",
            "coordinator.admin_port=0",
            "max_staleness=0",
            "trainer.backend=megatron",
            "trainer.num_processes=2",
            "trainer.megatron.pipeline_model_parallel_size=2",
            "trainer.lora.rank=8",
            "trainer.lora.alpha=16",
            "trainer.lr=5e-2",
        ],
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories_trained"] == 3 * 4 * 4 and summary["weight_versions_published"] == 3
    assert set(summary["rollout_server_versions"].values()) == {3}  # vLLM's Beam model took every version
    assert summary["max_staleness_seen"] == 0
    assert summary["max_abs_logprob_diff"] < 5e-3, summary


@pytest.mark.timeout(300)
def test_short_agent_demo_trains_every_group_its_agents_submit_once_and_logs_the_reward(tmp_path):
    """recipes/demo-agent.yaml, shortened: the run is fed by its two example agents alone (their own processes,
    the SDK over the agent API); every session they submit is trained, once, and each step logs its reward."""
    steps, groups_per_step, group_size = 3, 2, 2
    model = init_tiny(tmp_path / "model")
    out = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "demo",
            "--config",
            "recipes/demo-agent.yaml",
            "--steps",
            str(steps),
            "--out",
            str(out),
            f"model_path={model}",
            f"groups_per_step={groups_per_step}",
            f"coordinator.group_size={group_size}",
            "rollout.num_servers=1",
            "coordinator.admin_port=0",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    trained = steps * groups_per_step * group_size
    assert summary["steps"] == steps and summary["trajectories_trained"] == summary["trajectories_produced"] == trained
    agents = [json.loads((out / "logs" / f"agent-{i}.log").read_text().strip().splitlines()[-1]) for i in range(2)]
    assert sum(a["sessions_submitted"] for a in agents) == trained and not any(a["sessions_failed"] for a in agents)
    assert sum(a["groups_queued"] for a in agents) == steps * groups_per_step
    assert len(summary["rewards"]) == steps and all(0.0 <= r <= 1.0 for r in summary["rewards"])
    assert summary["max_staleness_seen"] <= summary["max_staleness_allowed"]
