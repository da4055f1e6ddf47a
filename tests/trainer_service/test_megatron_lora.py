"""LoRA on the Megatron backend (megatron-bridge PEFT ``LoRA``): adapters only trained, in the optimizer and the
checkpoint; the merged export reproduces the adapted log-probs.

The same tiny Qwen3-MoE and Beam as test_lora.py (the torch backend), CPU, gloo world size 1.
"""

from __future__ import annotations

import pytest
import torch
from lora_cases import ALL_TARGETS, MODELS, lora_batch, lora_config, make_model_dir

from trainer_service import lora
from trainer_service.torch_backend import token_logprobs

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request, tmp_path_factory):
    return make_model_dir(request.param, tmp_path_factory)


def _megatron(model_dir: str, **kwargs):
    from trainer_service.megatron.backend import MegatronBackend

    return MegatronBackend(model_dir, lora_config(backend="megatron", **kwargs))


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
        assert backend.train_step(lora_batch())["skipped"] == 0.0
    assert all(torch.equal(p, frozen[name]) for name, p in backend.model[0].named_parameters() if not p.requires_grad)

    merged = {**base_state, **{name: t.contiguous() for name, t in backend.export_hf_weights()}}
    shutil.copy(f"{model_dir}/config.json", tmp_path / "config.json")
    save_file(merged, str(tmp_path / "model.safetensors"))
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    batch = lora_batch(seed=1)
    with torch.no_grad():
        reference = token_logprobs(plain, batch.input_ids_BT, batch.attention_mask_BT, 1.0)
    adapted = backend.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    mask = batch.attention_mask_BT[:, 1:].bool()
    assert (adapted - reference)[mask].abs().max() < 1e-4
    changed = [name for name, tensor in merged.items() if not torch.equal(tensor, base_state[name])]
    assert changed and all(lora.target_of(name) for name in changed)  # only adapted weights moved


def test_megatron_lora_resumes_bit_exactly(model_dir, tmp_path):
    from megatron_checks import assert_resume_is_bit_identical

    assert_resume_is_bit_identical(model_dir, lora_config(backend="megatron"), lora_batch(), tmp_path)


def test_megatron_lora_checkpoint_holds_adapters_not_the_base(model_dir, tmp_path):
    backend = _megatron(model_dir)
    backend.train_step(lora_batch())  # megatron's optimizer has a state to save once it has stepped
    backend.save_checkpoint(tmp_path / "lora")
    state = torch.load(tmp_path / "lora" / "rank00000.pt", weights_only=False)
    saved = sum(t.numel() for t in state["model"][0].values() if isinstance(t, torch.Tensor))
    adapters = sum(p.numel() for p in backend.model[0].parameters() if p.requires_grad)
    assert saved == adapters
    with pytest.raises(ValueError, match="trainer.lora.rank"):
        _megatron(model_dir, rank=0).load_checkpoint(tmp_path / "lora")
    with pytest.raises(ValueError, match="trainer.lora"):
        _megatron(model_dir, rank=8).load_checkpoint(tmp_path / "lora")
