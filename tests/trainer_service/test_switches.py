"""Config switches the trainer does not implement (optimizer state streamed from disk): valid in the config,
refused by the trainer at start, never ignored; and the validation of the switches."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from protos.config import load_run_config

pytestmark = pytest.mark.unit

LORA_16 = Path(__file__).resolve().parents[2] / "recipes" / "beam" / "dapo-lora-16.yaml"


def test_a_switch_the_trainer_lacks_validates_here_and_is_refused_by_the_trainer():
    from trainer_service.__main__ import refuse_unimplemented

    full_ft = load_run_config(LORA_16.parent / "dapo-full-ft.yaml")
    refuse_unimplemented(full_ft.trainer)  # recompute and host-memory offload are the trainer's
    on_disk = load_run_config(LORA_16.parent / "dapo-full-ft.yaml", environ={"OPTIMIZER_STATE_DISK_DIR": "/nvme/opt"})
    with pytest.raises(ValueError, match="optimizer_state_disk_dir='/nvme/opt'"):
        refuse_unimplemented(on_disk.trainer)
    refuse_unimplemented(load_run_config(LORA_16).trainer)  # expert adapters at rank / top_k: grouped expert LoRA
    refuse_unimplemented(load_run_config([LORA_16, LORA_16.parent / "toy.yaml"]).trainer)
    with pytest.raises(pydantic.ValidationError, match="optimizer_cpu_offload"):
        load_run_config(overrides=["trainer.megatron.optimizer_state_disk_dir=/nvme"])
    with pytest.raises(pydantic.ValidationError, match="normalize_moe_lora needs trainer.lora.rank"):
        load_run_config(overrides=["trainer.lora.normalize_moe_lora=true"])
