"""Every family of the supported-models table builds from its own transformers config at toy size (unit tier)."""

from __future__ import annotations

import json

import pytest
import torch

from modeling.families import FAMILIES, build_model, init_family
from modeling.tiny_model import build_tokenizer

pytestmark = pytest.mark.unit

# The architecture each family must keep at toy size: the config fields that make it that family.
ARCHITECTURE = {
    "deepseek_v3": dict(
        first_k_dense_replace=1,
        n_shared_experts=1,
        kv_lora_rank=512,  # + qk_rope_head_dim 64: the one MLA cache width vLLM's CPU MLA backend runs
        qk_rope_head_dim=64,
        q_lora_rank=32,
        topk_method="noaux_tc",  # what makes vLLM's model keep the router's e_score_correction_bias
        scoring_func="sigmoid",
    ),
    "glm4_5": dict(first_k_dense_replace=1, n_shared_experts=1, use_qk_norm=True, attention_bias=True),
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "nemotron_h": dict(hybrid_override_pattern="M*-"),  # Mamba-2, attention, MLP
    "mimo": dict(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=0),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_builds_with_its_architecture_and_gives_finite_logits(family):
    config = FAMILIES[family]()
    for key, value in ARCHITECTURE.get(family, {}).items():
        assert getattr(config, key) == value, key
    assert config.vocab_size == 64 >= len(build_tokenizer())  # every char-tokenizer id is in the vocabulary
    model = build_model(family, seed=0)
    ids = torch.tensor([[1, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, 7, 64)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0  # random weights, not a constant output


def test_a_saved_family_reloads_with_the_same_logits_and_keeps_its_vllm_architecture(tmp_path):
    from transformers import AutoModelForCausalLM

    path = init_family("mimo", tmp_path / "mimo", seed=3)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[1, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, build_model("mimo", seed=3)(input_ids=ids).logits)
