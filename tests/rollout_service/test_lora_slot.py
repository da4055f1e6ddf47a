"""The rollout side of adapter-only sync without an engine (rollout_service.lora_slot): what the engine is asked
for, which engines are refused, and the PEFT directory written from a received adapter's bytes.

The engine itself (a server taking adapter versions over the bus, against merged weights) is
test_lora_adapter_sync.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from modeling.beam.tiny import init_tiny_beam
from modeling.tiny_model import init_tiny
from protos.config import RolloutLoraConfig
from protos.records import LoraAdapter
from rollout_service import lora_slot
from tests.rollout_service.lora_models import adapter_trainer, make_dense_model, set_random_adapters
from weight_bus.packing import pack

pytestmark = pytest.mark.unit

SLOTS = RolloutLoraConfig(enabled=True, max_rank=8)


@pytest.fixture(scope="module")
def dense_beam(tmp_path_factory):
    return make_dense_model("beam", tmp_path_factory.mktemp("dense-beam"))


def staged_adapter(backend, version: int, path) -> object:
    """Pack the backend's adapters as the publisher does and lay the buckets end to end in ``path`` (the staging
    file a receiver fills); returns the manifest."""
    manifest, buckets = pack(backend.export_adapter_weights(), version, 2**20, adapter=backend.adapter_record())
    path.write_bytes(b"".join(bytes(bucket) for bucket in buckets))
    return manifest


def test_the_engine_gets_lora_slots_at_the_configured_rank_and_only_fleetrls_target_modules():
    assert lora_slot.engine_lora_kwargs(RolloutLoraConfig()) == {}
    kwargs = lora_slot.engine_lora_kwargs(RolloutLoraConfig(enabled=True, max_rank=64, max_loras=2))
    assert kwargs["enable_lora"] and (kwargs["max_lora_rank"], kwargs["max_loras"], kwargs["max_cpu_loras"]) == (
        64,
        2,
        2,
    )
    assert "gate" not in kwargs["lora_target_modules"]  # routers stay unwrapped
    assert {"qkv_proj", "o_proj", "experts", "output_gate"} <= set(kwargs["lora_target_modules"])


def test_the_cpu_engine_refuses_lora_slots_on_moe_models_naming_why(tmp_path, dense_beam):
    moe_models = [str(init_tiny(tmp_path / "qwen3-moe")), str(init_tiny_beam(tmp_path / "beam"))]
    for model in moe_models:
        with pytest.raises(ValueError, match="needs a dense model(.|\n)*'triton.language' has no attribute 'float32'"):
            lora_slot.check_engine_supports(SLOTS, model, on_cpu=True)
        lora_slot.check_engine_supports(SLOTS, model, on_cpu=False)  # a GPU engine runs the Triton MoE LoRA
        lora_slot.check_engine_supports(RolloutLoraConfig(), model, on_cpu=True)  # no slots: nothing to refuse
    lora_slot.check_engine_supports(SLOTS, dense_beam, on_cpu=True)


def test_a_received_beam_adapter_becomes_a_peft_dir_with_q_proj_split_from_the_output_gate(dense_beam, tmp_path):
    backend = adapter_trainer(dense_beam)
    set_random_adapters(backend, seed=1)
    manifest = staged_adapter(backend, 3, tmp_path / "staged")
    slot = lora_slot.LoraSlot(SLOTS, dense_beam, str(tmp_path / "slot"))
    directory = slot.write(3, str(tmp_path / "staged"), manifest)

    config = json.loads((directory / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")
    assert config["target_modules"] == [*backend.adapter_record().target_modules, "output_gate"]
    written = load_file(str(directory / "adapter_model.safetensors"))
    sent = dict(backend.export_adapter_weights())
    hf = backend.model.config
    for name, tensor in sent.items():
        if ".q_proj.lora_B." not in name:
            assert torch.equal(written[name], tensor), name
            continue
        # Per head: head_dim query rows (q_proj, inside vLLM's qkv_proj), then head_dim gate rows (output_gate).
        per_head = torch.cat(
            [
                written[name].view(hf.num_attention_heads, hf.head_dim, -1),
                written[name.replace(".q_proj.", ".output_gate.")].view(hf.num_attention_heads, hf.head_dim, -1),
            ],
            dim=1,
        )
        assert torch.equal(per_head.reshape(tensor.shape), tensor), name
        a_name = name.replace(".lora_B.", ".lora_A.")
        assert torch.equal(written[a_name.replace(".q_proj.", ".output_gate.")], sent[a_name])


def test_an_adapter_the_slots_cannot_hold_or_an_engine_without_slots_is_refused_before_any_pause(tmp_path):
    manifest = pack([], 4, 2**20, adapter=LoraAdapter(16, 16.0, ["q_proj"], expert_rank=4))[0]
    with pytest.raises(ValueError, match="rank 16, above rollout.lora.max_rank 8"):
        lora_slot.check_adapter_fits(SLOTS, manifest)
    fits_rank = RolloutLoraConfig(enabled=True, max_rank=16, max_expert_rank=1)
    with pytest.raises(ValueError, match="expert rank 4, above rollout.lora.max_expert_rank 1"):
        lora_slot.check_adapter_fits(fits_rank, manifest)
    with pytest.raises(ValueError, match="no LoRA slots: set rollout.lora.enabled=true"):
        lora_slot.adapter_to_load(None, 4, str(tmp_path / "none"), manifest)
    weights = pack([("model.norm.weight", torch.ones(4))], 4, 2**20)[0]
    slot = lora_slot.LoraSlot(SLOTS, "", str(tmp_path / "slot"))
    with pytest.raises(ValueError, match="full weights(.|\n)*trainer.lora.sync='adapters'"):
        lora_slot.adapter_to_load(slot, 4, str(tmp_path / "none"), weights)
    assert lora_slot.adapter_to_load(None, 4, str(tmp_path / "none"), weights) is None  # weights, no slots: load


def test_the_zero_adapter_is_rank_one_zeros_on_every_layers_o_proj(dense_beam, tmp_path):
    hf = lora_slot.read_hf_config(dense_beam)
    lora_slot.write_zero_adapter(tmp_path, hf)
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert len(tensors) == 2 * hf.num_hidden_layers and all(not t.any() for t in tensors.values())
    a = tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"]
    assert a.shape == (1, hf.num_attention_heads * hf.head_dim)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 1
