"""The HF export of the final policy: a directory transformers loads, holding the trained weights (LoRA: the merged
policy, completed from the base checkpoint, and the adapters), sharded with an index."""

from __future__ import annotations

import json

import pytest
import torch
from synthetic import make_group
from transformers import AutoModelForCausalLM, AutoTokenizer

from modeling.beam.tiny import init_tiny_beam
from protos.config import LoraConfig, TrainerConfig
from trainer_service.batch import build_batch
from trainer_service.hf_export import export_policy
from trainer_service.torch_backend import TorchBackend

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def beam_dir(tmp_path_factory) -> str:
    return str(init_tiny_beam(tmp_path_factory.mktemp("beam"), seed=1))


def trained(model_dir: str, config: TrainerConfig) -> TorchBackend:
    backend = TorchBackend(model_dir, config)
    for step in range(2):
        backend.train_step(build_batch([make_group(2 * step + i, seed=5) for i in range(2)]))
    return backend


def loaded_state(directory) -> dict[str, torch.Tensor]:
    import modeling.beam  # noqa: F401 - registers model_type "beam" with transformers

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_full_fine_tuning_export_loads_in_transformers_with_the_trained_weights(beam_dir, tmp_path):
    backend = trained(beam_dir, TrainerConfig(geo_mask=None, lr=1e-2))
    out = export_policy(backend, beam_dir, tmp_path / "export", lora_enabled=False, is_rank0=True)
    assert out == tmp_path / "export" / "hf" and not (tmp_path / "export" / "adapters").exists()
    state = loaded_state(out)
    exported = dict(backend.export_hf_weights())
    base = loaded_state(beam_dir)
    assert set(exported) == set(state)
    assert all(torch.equal(state[name], tensor) for name, tensor in exported.items())
    assert any(not torch.equal(state[name], base[name]) for name in exported)  # training moved the weights
    assert AutoTokenizer.from_pretrained(out).encode("12") == AutoTokenizer.from_pretrained(beam_dir).encode("12")


def test_lora_export_is_the_merged_policy_completed_from_the_base_plus_the_adapters(beam_dir, tmp_path):
    lora = LoraConfig(rank=4, alpha=8, target_modules=["linear_qkv", "linear_proj"])
    backend = trained(beam_dir, TrainerConfig(geo_mask=None, lr=1e-2, lora=lora))
    out = export_policy(backend, beam_dir, tmp_path / "export", lora_enabled=True, is_rank0=True)
    state, base = loaded_state(out), loaded_state(beam_dir)
    merged = dict(backend.export_hf_weights())  # the adapted layers only: attention projections
    assert merged and all(".self_attn." in name for name in merged)
    assert set(state) == set(base)
    for name, tensor in state.items():
        assert torch.equal(tensor, merged.get(name, base[name])), name
    assert any(not torch.equal(merged[name], base[name]) for name in merged)
    assert (tmp_path / "export" / "adapters" / "adapters.safetensors").exists()


def test_shards_split_at_the_size_limit_and_the_index_names_every_tensor(beam_dir, tmp_path):
    from trainer_service.hf_export import ShardWriter

    writer = ShardWriter(tmp_path, shard_bytes=4096)
    tensors = {f"t{i}": torch.full((300,), float(i)) for i in range(5)}  # 1,200 bytes each: 3 per shard
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert index["metadata"]["total_size"] == 5 * 1200
    twice = ShardWriter(tmp_path)
    twice.add("t0", tensors["t0"])
    with pytest.raises(ValueError, match="t0 exported twice"):
        twice.add("t0", tensors["t0"])
