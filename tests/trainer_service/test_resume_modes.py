"""trainer.resume 'latest' and 'from_path' (with trainer.resume_path): the checkpoint they pick, and a fresh backend
restored from it takes the next step bit-exactly as the run that wrote it (torch backend; Megatron on the tiny Beam,
full fine-tuning and LoRA)."""

from __future__ import annotations

import pytest
from synthetic import make_group

from modeling.beam.tiny import init_tiny_beam
from protos.config import LoraConfig, TrainerConfig
from trainer_service.__main__ import resume_target
from trainer_service.batch import build_batch
from trainer_service.checkpoint import CheckpointManager, TrainerState

pytestmark = pytest.mark.integration

ALL_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.fixture(scope="module")
def beam_dir(tmp_path_factory) -> str:
    return str(init_tiny_beam(tmp_path_factory.mktemp("beam"), seed=0))


def batch_of_step(step: int):
    return build_batch([make_group(2 * step + i, seed=7) for i in range(2)])


def run_and_checkpoint(make_backend, checkpoints: CheckpointManager, steps: int) -> dict[int, float]:
    """Train ``steps`` steps, checkpointing after each but the last; returns each step's loss."""
    backend, losses = make_backend(), {}
    for step in range(1, steps + 1):
        losses[step] = backend.train_step(batch_of_step(step))["loss"]
        if step < steps:
            checkpoints.save(backend, TrainerState(step, step))
    return losses


def next_step_loss(make_backend, config: TrainerConfig, checkpoints: CheckpointManager) -> tuple[int, float]:
    """A fresh backend restored from the checkpoint ``config.resume`` picks; (its step, the loss of the next one)."""
    path = checkpoints.resolve(resume_target(config))
    backend = make_backend()
    state = CheckpointManager.load(path, backend)
    return state.step, backend.train_step(batch_of_step(state.step + 1))["loss"]


def assert_latest_and_from_path_continue_bit_exactly(make_backend, tmp_path) -> None:
    checkpoints = CheckpointManager(tmp_path / "ckpt", keep_last=5)
    losses = run_and_checkpoint(make_backend, checkpoints, steps=4)  # checkpoints after steps 1, 2 and 3
    assert checkpoints.resolve(resume_target(TrainerConfig(resume="none"))) is None
    # bit-exact: ==, not approx, against the loss the uninterrupted run took
    assert next_step_loss(make_backend, TrainerConfig(resume="latest"), checkpoints) == (3, losses[4])
    from_path = TrainerConfig(resume="from_path", resume_path=str(tmp_path / "ckpt" / "step-000002"))
    assert next_step_loss(make_backend, from_path, checkpoints) == (2, losses[3])


def test_torch_backend_resumes_latest_and_from_path_bit_exactly(tmp_path):
    from modeling.tiny_model import init_tiny
    from trainer_service.torch_backend import TorchBackend

    model_dir = str(init_tiny(tmp_path / "tiny"))
    config = TrainerConfig(geo_mask=None, lr_warmup_steps=2)
    assert_latest_and_from_path_continue_bit_exactly(lambda: TorchBackend(model_dir, config), tmp_path)


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_megatron_beam_resumes_latest_and_from_path_bit_exactly(beam_dir, tmp_path, lora_rank):
    from trainer_service.megatron.backend import MegatronBackend

    lora = LoraConfig(rank=lora_rank, alpha=8, target_modules=ALL_TARGETS)
    config = TrainerConfig(backend="megatron", lr=1e-2, geo_mask=None, lora=lora)
    assert_latest_and_from_path_continue_bit_exactly(lambda: MegatronBackend(beam_dir, config), tmp_path)


def test_a_checkpoint_path_in_trainer_resume_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="trainer.resume=from_path and trainer.resume_path=/ckpt/step-000002"):
        TrainerConfig(resume="/ckpt/step-000002")
    with pytest.raises(ValueError, match="trainer.resume_path"):
        TrainerConfig(resume="from_path")
