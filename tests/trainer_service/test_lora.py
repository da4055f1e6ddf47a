"""LoRA: frozen base, adapters only in the optimizer and the checkpoint, merged export of whole vLLM layers.

Torch backend on the tiny Qwen3-MoE (fused expert tensors) and the tiny Beam (per-expert modules). The engine
side (a partial update into a real vLLM server) is tests/rollout_service/test_server.py.
"""

from __future__ import annotations

import pytest
import torch
from synthetic import make_group

from modeling.beam.tiny import init_tiny_beam
from modeling.tiny_model import init_tiny
from protos.config import LoraConfig, TrainerConfig
from trainer_service import lora
from trainer_service.batch import build_batch
from trainer_service.torch_backend import TorchBackend, token_logprobs

pytestmark = pytest.mark.integration

ALL_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.fixture(scope="module", params=["qwen3-moe", "beam"])
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "beam":
        return str(init_tiny_beam(directory, seed=0))
    return str(init_tiny(directory, seed=0))


def _config(rank: int = 4, target_modules=ALL_TARGETS, **kwargs) -> TrainerConfig:
    return TrainerConfig(
        lr=1e-2, geo_mask=None, lora=LoraConfig(rank=rank, alpha=8, target_modules=target_modules), **kwargs
    )


def _batch(seed: int = 0):
    return build_batch([make_group(i, seed=seed) for i in range(4)])


def test_step_zero_is_the_base_model_and_training_moves_only_the_published_layers(model_dir):
    base = dict(TorchBackend(model_dir, TrainerConfig()).export_hf_weights())
    backend = TorchBackend(model_dir, _config())
    exported = dict(backend.export_hf_weights())
    assert exported.keys() == {name for name in base if lora.is_published(name, ALL_TARGETS)}
    assert all(torch.equal(tensor, base[name]) for name, tensor in exported.items())  # B = 0 at the start

    frozen = {name: p.clone() for name, p in backend.model.named_parameters() if not p.requires_grad}
    for _ in range(2):
        metrics = backend.train_step(_batch())
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

    backend = TorchBackend(model_dir, _config())
    for _ in range(3):
        backend.train_step(_batch())
    base = dict(TorchBackend(model_dir, TrainerConfig()).export_hf_weights())
    merged = {**base, **dict(backend.export_hf_weights())}
    shutil.copy(f"{model_dir}/config.json", tmp_path / "config.json")
    save_file({name: tensor.contiguous() for name, tensor in merged.items()}, str(tmp_path / "model.safetensors"))
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    batch = _batch(seed=1)
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
    config = _config()
    continuing = TorchBackend(model_dir, config)
    continuing.train_step(_batch())
    continuing.save_checkpoint(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
    expected = [continuing.train_step(_batch(seed=2))["grad_norm"], continuing.train_step(_batch(seed=3))["grad_norm"]]

    resumed = TorchBackend(model_dir, config)
    resumed.load_checkpoint(tmp_path)
    actual = [resumed.train_step(_batch(seed=2))["grad_norm"], resumed.train_step(_batch(seed=3))["grad_norm"]]
    assert actual == expected
    final = dict(continuing.export_hf_weights())
    assert all(torch.equal(final[name], tensor) for name, tensor in resumed.export_hf_weights())


def test_bad_lora_settings_and_mismatched_checkpoints_are_refused_naming_the_field(model_dir, tmp_path):
    with pytest.raises(ValueError, match="trainer.lora.dropout"):
        TorchBackend(model_dir, TrainerConfig(lora=LoraConfig(rank=4, dropout=0.1)))
    TorchBackend(model_dir, _config(rank=4)).save_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="trainer.lora.rank"):
        TorchBackend(model_dir, _config(rank=8)).load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="trainer.lora"):
        TorchBackend(model_dir, _config(target_modules=["linear_qkv"])).load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="trainer.lora.rank=0"):
        full = tmp_path / "full"
        full.mkdir()
        TorchBackend(model_dir, TrainerConfig()).save_checkpoint(full)
        TorchBackend(model_dir, _config()).load_checkpoint(full)


# -- Megatron backend (megatron-bridge PEFT LoRA) ---------------------------------------------------------------


def _megatron(model_dir: str, **kwargs):
    from trainer_service.megatron_backend import MegatronBackend

    return MegatronBackend(model_dir, _config(backend="megatron", **kwargs))


def test_megatron_lora_trains_adapters_only_and_its_merged_export_reproduces_its_logprobs(model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    backend = _megatron(model_dir)
    trainable = [name for name, p in backend.model[0].named_parameters() if p.requires_grad]
    assert trainable and all(".adapter." in name for name in trainable)
    base_state = load_file(f"{model_dir}/model.safetensors")
    exported = dict(backend.export_hf_weights())
    assert exported.keys() == {name for name in base_state if lora.is_published(name, ALL_TARGETS)}
    assert all(torch.equal(tensor, base_state[name]) for name, tensor in exported.items())  # B = 0: the base

    frozen = {name: p.clone() for name, p in backend.model[0].named_parameters() if not p.requires_grad}
    for _ in range(3):
        assert backend.train_step(_batch())["skipped"] == 0.0
    assert all(torch.equal(p, frozen[name]) for name, p in backend.model[0].named_parameters() if not p.requires_grad)

    merged = {**base_state, **{name: t.contiguous() for name, t in backend.export_hf_weights()}}
    shutil.copy(f"{model_dir}/config.json", tmp_path / "config.json")
    save_file(merged, str(tmp_path / "model.safetensors"))
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    batch = _batch(seed=1)
    with torch.no_grad():
        reference = token_logprobs(plain, batch.input_ids_BT, batch.attention_mask_BT, 1.0)
    adapted = backend.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    mask = batch.attention_mask_BT[:, 1:].bool()
    assert (adapted - reference)[mask].abs().max() < 1e-4
    changed = [name for name, tensor in merged.items() if not torch.equal(tensor, base_state[name])]
    assert changed and all(lora.target_of(name) for name in changed)  # only adapted weights moved


def test_megatron_lora_resumes_bit_exactly(model_dir, tmp_path):
    from megatron_checks import assert_resume_is_bit_identical

    assert_resume_is_bit_identical(model_dir, _config(backend="megatron"), _batch(), tmp_path)


def test_megatron_lora_checkpoint_holds_adapters_not_the_base(model_dir, tmp_path):
    backend = _megatron(model_dir)
    backend.train_step(_batch())  # megatron's optimizer has a state to save once it has stepped
    backend.save_checkpoint(tmp_path / "lora")
    state = torch.load(tmp_path / "lora" / "rank00000.pt", weights_only=False)
    saved = sum(t.numel() for t in state["model"][0].values() if isinstance(t, torch.Tensor))
    adapters = sum(p.numel() for p in backend.model[0].parameters() if p.requires_grad)
    assert saved == adapters
    with pytest.raises(ValueError, match="trainer.lora.rank"):
        _megatron(model_dir, rank=0).load_checkpoint(tmp_path / "lora")
    with pytest.raises(ValueError, match="trainer.lora"):
        _megatron(model_dir, rank=8).load_checkpoint(tmp_path / "lora")
