"""LoRA: frozen base, adapters only in the optimizer and the checkpoint, merged export of whole vLLM layers.

Torch backend on the tiny Qwen3-MoE (fused expert tensors) and the tiny Beam (per-expert modules); the Megatron
backend's LoRA is test_megatron_lora.py. The engine side (a partial update into a real vLLM server) is
tests/rollout_service/test_server_weight_updates.py.
"""

from __future__ import annotations

import pytest
import torch
from lora_cases import ALL_TARGETS, MODELS, lora_batch, lora_config, make_model_dir

from protos.config import LoraConfig, TrainerConfig
from trainer_service import lora
from trainer_service.torch_backend import TorchBackend, token_logprobs

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request, tmp_path_factory):
    return make_model_dir(request.param, tmp_path_factory)


def test_step_zero_is_the_base_model_and_training_moves_only_the_published_layers(model_dir):
    base = dict(TorchBackend(model_dir, TrainerConfig()).export_hf_weights())
    backend = TorchBackend(model_dir, lora_config())
    exported = dict(backend.export_hf_weights())
    assert exported.keys() == {name for name in base if lora.is_published(name, ALL_TARGETS)}
    assert all(torch.equal(tensor, base[name]) for name, tensor in exported.items())  # B = 0 at the start

    frozen = {name: p.clone() for name, p in backend.model.named_parameters() if not p.requires_grad}
    for _ in range(2):
        metrics = backend.train_step(lora_batch())
        assert metrics["skipped"] == 0.0 and metrics["grad_norm"] > 0
    assert all(torch.equal(p, frozen[name]) for name, p in backend.model.named_parameters() if not p.requires_grad)
    assert {id(p) for p in backend.trainable} == {
        id(p) for group in backend.optimizer.param_groups for p in group["params"]
    }
    assert all(".lora_" in name for name, p in backend.model.named_parameters() if p.requires_grad)
    trained = dict(backend.export_hf_weights())
    changed = {name for name, tensor in trained.items() if not torch.equal(tensor, base[name])}
    assert changed and changed <= trained.keys()
    # Routers and their correction bias travel (whole MoE block) but never change, and stay fp32.
    routers = [name for name in trained if name.endswith("mlp.gate.weight")]
    assert routers and all(name not in changed and trained[name].dtype == torch.float32 for name in routers)


def test_merged_export_reproduces_the_adapted_models_logprobs(model_dir, tmp_path):
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    backend = TorchBackend(model_dir, lora_config())
    for _ in range(3):
        backend.train_step(lora_batch())
    base = dict(TorchBackend(model_dir, TrainerConfig()).export_hf_weights())
    merged = {**base, **dict(backend.export_hf_weights())}
    shutil.copy(f"{model_dir}/config.json", tmp_path / "config.json")
    save_file({name: tensor.contiguous() for name, tensor in merged.items()}, str(tmp_path / "model.safetensors"))
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    batch = lora_batch(seed=1)
    backend.model.eval()
    with torch.no_grad():
        adapted = token_logprobs(backend.model, batch.input_ids_BT, batch.attention_mask_BT, 1.0)
        reference = token_logprobs(plain, batch.input_ids_BT, batch.attention_mask_BT, 1.0)
        untrained = token_logprobs(
            TorchBackend(model_dir, TrainerConfig()).model.eval(), batch.input_ids_BT, batch.attention_mask_BT, 1.0
        )
    mask = batch.attention_mask_BT[:, 1:].bool()
    assert (adapted - reference)[mask].abs().max() < 1e-5
    assert (adapted - untrained)[mask].abs().max() > 1e-3  # the adapters did change the policy


@pytest.mark.parametrize("target", ALL_TARGETS)
def test_each_target_publishes_whole_vllm_layers(model_dir, target):
    names = [name for name, _ in TorchBackend(model_dir, TrainerConfig()).export_hf_weights()]
    published = {name for name in names if lora.is_published(name, [target])}
    assert published
    if target == "linear_qkv":  # one QKVParallelLinear: q, k and v always together
        assert {name.rsplit(".", 2)[-2] for name in published} == {"q_proj", "k_proj", "v_proj"}
    elif target == "linear_proj":
        assert all(name.endswith("self_attn.o_proj.weight") for name in published)
    else:  # a FusedMoE holds gate_up and down: the MoE block goes whole, router and bias included
        moe_layers = {name.split(".mlp.")[0] for name in names if ".mlp.experts." in name}
        for layer in moe_layers:
            block = {name for name in names if name.startswith(f"{layer}.mlp.")}
            assert block <= published
        assert not any("self_attn" in name or "norm" in name or "embed" in name for name in published)


def test_adapter_checkpoint_resumes_bit_exactly_and_holds_only_adapters(model_dir, tmp_path):
    config = lora_config()
    continuing = TorchBackend(model_dir, config)
    continuing.train_step(lora_batch())
    continuing.save_checkpoint(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
    expected = [
        continuing.train_step(lora_batch(seed=2))["grad_norm"],
        continuing.train_step(lora_batch(seed=3))["grad_norm"],
    ]

    resumed = TorchBackend(model_dir, config)
    resumed.load_checkpoint(tmp_path)
    actual = [resumed.train_step(lora_batch(seed=2))["grad_norm"], resumed.train_step(lora_batch(seed=3))["grad_norm"]]
    assert actual == expected
    final = dict(continuing.export_hf_weights())
    assert all(torch.equal(final[name], tensor) for name, tensor in resumed.export_hf_weights())


def test_bad_lora_settings_and_mismatched_checkpoints_are_refused_naming_the_field(model_dir, tmp_path):
    with pytest.raises(ValueError, match="trainer.lora.dropout"):
        TorchBackend(model_dir, TrainerConfig(lora=LoraConfig(rank=4, dropout=0.1)))
    TorchBackend(model_dir, lora_config(rank=4)).save_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="trainer.lora.rank"):
        TorchBackend(model_dir, lora_config(rank=8)).load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="trainer.lora"):
        TorchBackend(model_dir, lora_config(target_modules=["linear_qkv"])).load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="trainer.lora.rank=0"):
        full = tmp_path / "full"
        full.mkdir()
        TorchBackend(model_dir, TrainerConfig()).save_checkpoint(full)
        TorchBackend(model_dir, lora_config()).load_checkpoint(full)
