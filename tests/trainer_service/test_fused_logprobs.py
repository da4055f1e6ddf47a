"""trainer_service.fused_logprobs against the unfused fp32 computation, and its use in the torch backend.

Tiles smaller than the inputs (7 tokens x 13 vocabulary entries over 50 x 100) make every tile boundary count:
the online log-sum-exp across vocabulary tiles, targets in every tile, ragged last tiles.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import modeling.beam  # noqa: F401  (registers model_type "beam" with transformers)
from modeling.beam.tiny import init_tiny_beam
from modeling.tiny_model import init_tiny
from trainer_service.fused_logprobs import fused_token_logprobs, per_token_divisors, reference_token_logprobs
from trainer_service.torch_backend import token_logprobs

pytestmark = pytest.mark.unit

NUM_TOKENS, VOCAB, HIDDEN = 50, 100, 16
TILES = dict(token_chunk=7, vocab_chunk=13)


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden_NH = torch.randn(NUM_TOKENS, HIDDEN, generator=generator, requires_grad=True)
    weight_VH = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.8).requires_grad_()
    targets_N = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=generator)
    divisors_N = torch.rand(NUM_TOKENS, generator=generator) + 0.5
    # Random weights on each output, so that every position's gradient differs.
    return hidden_NH, weight_VH, targets_N, divisors_N, torch.randn(NUM_TOKENS, generator=generator)


def _close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-5) -> bool:
    actual, expected = actual.detach(), expected.detach()
    return float((actual - expected).abs().max()) <= tolerance * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_fused_logprobs_and_gradients_equal_the_unfused_fp32_computation(softcap):
    hidden_NH, weight_VH, targets_N, divisors_N, upstream_N = _inputs()
    fused_N, _ = fused_token_logprobs(hidden_NH, weight_VH, targets_N, divisors_N, softcap, **TILES)
    reference_N, _ = reference_token_logprobs(hidden_NH, weight_VH, targets_N, divisors_N, softcap)
    grads = torch.autograd.grad((upstream_N * fused_N).sum(), (hidden_NH, weight_VH))
    reference_grads = torch.autograd.grad((upstream_N * reference_N).sum(), (hidden_NH, weight_VH))

    assert _close(fused_N, reference_N)
    assert all(_close(g, r) for g, r in zip(grads, reference_grads, strict=True))
    assert float(reference_grads[1].abs().max()) > 0.1  # the comparison is not of near-zero gradients


def test_softcap_and_per_row_temperature_change_the_result():
    """Sensitivity: the fused result follows both knobs (a fused path that ignored one would fail the test above
    only if the reference ignored it too)."""
    hidden_NH, weight_VH, targets_N, divisors_N, _ = _inputs()
    plain_N, _ = fused_token_logprobs(hidden_NH, weight_VH, targets_N, **TILES)
    capped_N, _ = fused_token_logprobs(hidden_NH, weight_VH, targets_N, softcap=3.0, **TILES)
    tempered_N, _ = fused_token_logprobs(hidden_NH, weight_VH, targets_N, divisors_N, **TILES)
    assert float((capped_N - plain_N).abs().max()) > 0.1
    assert float((tempered_N - plain_N).abs().max()) > 0.1


def test_fused_entropy_and_its_gradient_equal_the_unfused_computation():
    hidden_NH, weight_VH, targets_N, divisors_N, upstream_N = _inputs(seed=1)
    entropy_weights_N = torch.randn(NUM_TOKENS, generator=torch.Generator().manual_seed(5))
    fused_N, fused_entropy_N = fused_token_logprobs(
        hidden_NH, weight_VH, targets_N, divisors_N, 3.0, with_entropy=True, **TILES
    )
    reference_N, reference_entropy_N = reference_token_logprobs(
        hidden_NH, weight_VH, targets_N, divisors_N, 3.0, with_entropy=True
    )
    fused_loss = (upstream_N * fused_N + entropy_weights_N * fused_entropy_N).sum()
    reference_loss = (upstream_N * reference_N + entropy_weights_N * reference_entropy_N).sum()
    grads = torch.autograd.grad(fused_loss, (hidden_NH, weight_VH))
    reference_grads = torch.autograd.grad(reference_loss, (hidden_NH, weight_VH))

    assert _close(fused_entropy_N, reference_entropy_N)
    assert all(_close(g, r) for g, r in zip(grads, reference_grads, strict=True))


def test_a_frozen_lm_head_gets_no_gradient_and_the_hidden_states_still_do():
    hidden_NH, weight_VH, targets_N, _, upstream_N = _inputs()
    frozen_VH = weight_VH.detach()
    fused_N, _ = fused_token_logprobs(hidden_NH, frozen_VH, targets_N, **TILES)
    reference_N, _ = reference_token_logprobs(hidden_NH, frozen_VH, targets_N)
    (grad,) = torch.autograd.grad((upstream_N * fused_N).sum(), (hidden_NH,))
    (reference_grad,) = torch.autograd.grad((upstream_N * reference_N).sum(), (hidden_NH,))
    assert _close(grad, reference_grad)


def test_one_tile_holds_the_whole_input_when_the_chunks_are_large():
    hidden_NH, weight_VH, targets_N, divisors_N, _ = _inputs()
    fused_N, _ = fused_token_logprobs(hidden_NH, weight_VH, targets_N, divisors_N, 3.0)
    reference_N, _ = reference_token_logprobs(hidden_NH, weight_VH, targets_N, divisors_N, 3.0)
    assert _close(fused_N, reference_N)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_NH=torch.zeros(NUM_TOKENS, HIDDEN + 1)), "hidden_NH"),
        (dict(targets_N=torch.zeros(NUM_TOKENS + 1, dtype=torch.long)), "targets_N"),
        (dict(divisors_N=torch.ones(3)), "divisors_N"),
        (dict(token_chunk=0), "token_chunk"),
    ],
)
def test_bad_inputs_are_refused_naming_the_argument(change, message):
    hidden_NH, weight_VH, targets_N, divisors_N, _ = _inputs()
    arguments = dict(hidden_NH=hidden_NH, weight_VH=weight_VH, targets_N=targets_N, divisors_N=divisors_N) | change
    with pytest.raises(ValueError, match=message):
        fused_token_logprobs(**arguments)


def test_per_token_divisors_follow_temper_rules():
    assert per_token_divisors(None, 2, 3, "cpu") is None
    assert per_token_divisors(1.0, 2, 3, "cpu") is None
    assert per_token_divisors(0.0, 2, 3, "cpu") is None  # greedy: untempered
    assert per_token_divisors(0.5, 2, 3, "cpu").tolist() == [0.5] * 6
    per_row = per_token_divisors(torch.tensor([0.5, 2.0]), 2, 3, "cpu")
    assert per_row.tolist() == [0.5, 0.5, 0.5, 2.0, 2.0, 2.0]


# -- the torch backend ------------------------------------------------------------------------------------------


def _padded_rows(vocab: int, lengths=(23, 17, 9)):
    generator = torch.Generator().manual_seed(3)
    ids_BT = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask_BT = torch.zeros_like(ids_BT)
    for row, length in enumerate(lengths):
        ids_BT[row, :length] = torch.randint(3, vocab, (length,), generator=generator)
        mask_BT[row, :length] = 1
    return ids_BT, mask_BT


@pytest.mark.parametrize("kind", ["qwen3_moe", "beam"])
def test_torch_backend_fused_logprobs_and_gradients_equal_the_logits_path(kind, tmp_path):
    """Tiny Qwen3-MoE and tiny Beam (soft-cap 30 on its spread LM head), padded rows at their own temperatures."""
    path = init_tiny(tmp_path, seed=0) if kind == "qwen3_moe" else init_tiny_beam(tmp_path, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids_BT, mask_BT = _padded_rows(model.config.vocab_size)
    temperatures_B = torch.tensor([0.7, 1.0, 1.3])
    real_BT = mask_BT[:, 1:].bool()
    results = {}
    for fused in (False, True):
        model.zero_grad()
        logprobs_BT = token_logprobs(model, ids_BT, mask_BT, temperatures_B, fused=fused)
        logprobs_BT[real_BT].sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[fused] = (logprobs_BT.detach()[real_BT], grads)

    (fused_lp, fused_grads), (plain_lp, plain_grads) = results[True], results[False]
    assert _close(fused_lp, plain_lp)
    assert fused_grads.keys() == plain_grads.keys() and "lm_head.weight" in fused_grads
    assert all(_close(fused_grads[name], plain_grads[name]) for name in plain_grads)
