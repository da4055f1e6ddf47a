"""The transformers reference of Beam behaves as the card says, on a tiny random checkpoint (CPU, fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import modeling.beam.modeling_beam as modeling_beam
from modeling.beam import BeamConfig, BeamForCausalLM
from modeling.beam.configuration_beam import FULL, SLIDING
from modeling.beam.moe_beam import BeamRouter
from modeling.beam.tiny import init_tiny_beam, spread_random_weights, tiny_beam_config
from modeling.tiny_model import init_tiny

pytestmark = pytest.mark.unit


def _model(**overrides) -> BeamForCausalLM:
    torch.manual_seed(0)
    model = BeamForCausalLM(tiny_beam_config(**overrides)).eval()
    spread_random_weights(model, seed=0)
    return model


def _tokens(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 52, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logprobs(model, ids) -> torch.Tensor:
    return torch.log_softmax(model(ids, use_cache=False).logits.double(), dim=-1)


def _mean_kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return init_tiny_beam(tmp_path_factory.mktemp("beam"))


def test_default_config_is_the_published_beam_shape():
    config = BeamConfig()
    assert config.layer_types.count(SLIDING) == 43 and config.layer_types.count(FULL) == 9
    assert config.first_k_dense_replace == 3 and config.num_hidden_layers == 52
    with torch.device("meta"):
        model = BeamForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    routed = (config.num_hidden_layers - config.first_k_dense_replace) * config.n_routed_experts * per_expert
    active = total - routed * (1 - config.num_experts_per_tok / config.n_routed_experts)
    assert round(total / 1e9) == 501 and round(active / 1e9) == 23  # "501B-A23B"


def test_sliding_layers_ignore_tokens_beyond_the_window():
    model = _model(layer_types=[SLIDING] * 6)
    ids = _tokens(120)
    changed = ids.clone()
    changed[0, 0] = 51 if ids[0, 0] != 51 else 50
    base, other = model(ids, use_cache=False).logits, model(changed, use_cache=False).logits
    reach = 6 * (16 - 1)  # each sliding layer moves information at most window - 1 positions
    # Not bit-equal: the tokens an expert sees change, and its GEMM rounds differently per batch size.
    assert (base[0, reach + 1 :] - other[0, reach + 1 :]).abs().max() < 1e-4
    assert (base[0, 1:16] - other[0, 1:16]).abs().amax(-1).min() > 1e-2
    # With the card's layout, full (NoPE) layers carry the change to every later position.
    full = _model()
    assert not torch.allclose(full(ids, use_cache=False).logits[0, -1], full(changed, use_cache=False).logits[0, -1])


def test_router_weight_and_bias_stay_fp32_after_casting_the_model_to_bf16(checkpoint):
    model = _model()
    gate = model.model.layers[1].mlp.gate
    weight, bias = gate.weight.detach().clone(), gate.e_score_correction_bias.clone()
    model.to(torch.bfloat16)
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.weight, weight) and torch.equal(gate.e_score_correction_bias, bias)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.experts[0].up_proj.weight.dtype == torch.bfloat16
    logits_seen = []
    gate.register_forward_hook(lambda module, args, out: logits_seen.append(out[2]))
    with torch.no_grad():
        model(_tokens(8), use_cache=False)
    assert logits_seen[0].dtype == torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    exact = reference.state_dict()
    router_tensors = {name: t for name, t in loaded.state_dict().items() if ".mlp.gate." in name}
    assert len(router_tensors) == 2 * 5  # weight and bias of 5 MoE layers
    for name, tensor in router_tensors.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, exact[name]), name


def test_softcap_bounds_logits_at_30():
    model = _model()
    model.lm_head.weight.data *= 100.0  # raw logits in the thousands
    with torch.no_grad():
        hidden = model.model(_tokens(32), use_cache=False).last_hidden_state
        raw = model.lm_head(hidden)
        logits = model(_tokens(32), use_cache=False).logits
    assert raw.abs().max() > 300
    assert logits.abs().max() <= 30.0
    assert torch.allclose(logits, 30.0 * torch.tanh(raw / 30.0))


def test_grouped_topk_picks_experts_only_from_the_top_groups():
    router = BeamRouter(tiny_beam_config())  # 16 experts, 4 groups of 4, keep 2 groups, top-4
    router.weight.data.zero_()  # every sigmoid score is 0.5: selection follows the bias alone
    bias = torch.full((16,), -0.3)
    bias[0] = 0.4  # the single best expert, but its group (0) has a weak runner-up
    bias[4:6] = 0.2  # group 1: top-2 sum 0.4
    bias[8:10] = 0.15  # group 2: top-2 sum 0.3; group 0's top-2 sum is 0.1, group 3's -0.6
    router.e_score_correction_bias.copy_(bias)
    weights, ids, _ = router(torch.randn(5, 64))
    assert all(set(row) == {4, 5, 8, 9} for row in ids.tolist())
    # Weights come from the unbiased scores (all 0.5), normalized then scaled by 2.5.
    assert torch.allclose(weights, torch.full_like(weights, 2.5 / 4))

    router = BeamRouter(tiny_beam_config())
    router.weight.data.normal_()
    router.e_score_correction_bias.normal_(std=0.1)
    hidden = torch.randn(256, 64)
    _, ids, logits = router(hidden)
    biased = logits.sigmoid() + router.e_score_correction_bias
    group_scores = biased.view(256, 4, 4).topk(2, dim=-1).values.sum(-1)
    top_groups = group_scores.topk(2, dim=-1).indices
    assert all(set(e // 4 for e in row) <= set(g) for row, g in zip(ids.tolist(), top_groups.tolist(), strict=False))


def test_parity_threshold_detects_a_single_wrong_detail(monkeypatch):
    """Each plausible misreading moves the logits by far more than the 1e-6 KL the vLLM test allows."""
    model, ids = _model(), _tokens(200, seed=1)
    reference = _logprobs(model, ids)
    sliding = [layer.self_attn for layer in model.model.layers if not layer.self_attn.is_full]
    gates = [layer.mlp.gate for layer in model.model.layers[1:]]
    figures = {}
    with monkeypatch.context() as patch:
        for attn in sliding:
            patch.setattr(attn, "window", 15)
        figures["window off by one"] = _mean_kl(reference, _logprobs(model, ids))
    with monkeypatch.context() as patch:
        patch.setattr(modeling_beam, "ssmax_query_scale", lambda scale, pos: torch.ones(*pos.shape, scale.numel(), 1))
        figures["plain softmax on full layers"] = _mean_kl(reference, _logprobs(model, ids))
    biases = [gate.e_score_correction_bias.clone() for gate in gates]
    for gate in gates:
        gate.e_score_correction_bias.zero_()
    figures["correction bias ignored"] = _mean_kl(reference, _logprobs(model, ids))
    for gate, bias in zip(gates, biases, strict=False):
        gate.e_score_correction_bias.copy_(bias)
    with monkeypatch.context() as patch:
        for gate in gates:
            patch.setattr(gate, "topk_group", 4)
        figures["no group limit"] = _mean_kl(reference, _logprobs(model, ids))
    print("KL of single-detail errors:", json.dumps(figures))
    assert min(figures.values()) > 1e-4, figures


def test_generation_with_kv_cache_equals_full_recompute():
    model, ids = _model(), _tokens(12)
    generated = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    sequence = ids
    with torch.no_grad():
        for _ in range(40):
            next_id = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_id], dim=1)
    assert torch.equal(generated, sequence)  # 52 positions: sliding caches roll over the 16-slot window


def test_checkpoint_loads_through_auto_classes_with_the_tiny_tokenizer(checkpoint, tmp_path):
    config = AutoConfig.from_pretrained(checkpoint)
    assert isinstance(config, BeamConfig) and config.architectures == ["BeamForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert isinstance(model, BeamForCausalLM) and model.dtype == torch.float32
    names = set(model.state_dict())
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.2.self_attn.ssmax_scale" in names and "model.layers.0.self_attn.ssmax_scale" not in names
    reference = init_tiny(tmp_path / "qwen")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (checkpoint / name).read_text() == (reference / name).read_text()


def test_headwise_gate_variant_has_one_gate_logit_per_head():
    model = _model(attn_output_gate="headwise")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * (32 + 1), 64)
    assert torch.isfinite(model(_tokens(20), use_cache=False).logits).all()
