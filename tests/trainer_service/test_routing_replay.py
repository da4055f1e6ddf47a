"""R3 (rollout routing replay): route alignment to the batch layout, and replay on transformers MoE models.

The Megatron side of replay is tested in test_megatron_backend.py, next to the backend it needs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from router_perturbation import perturb_unused_experts

from modeling.tiny_model import init_tiny
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan
from trainer_service.batch import build_batch
from trainer_service.routing_replay import NO_ROUTE, forced_routing, record_routes, routes_from_groups
from trainer_service.torch_backend import token_logprobs

pytestmark = pytest.mark.unit

NUM_LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_tiny(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _sample(response: list[int], routes: np.ndarray | None) -> Sample:
    return Sample(
        Array.from_numpy(np.array(response, np.int32)),
        Array.from_numpy(np.zeros(len(response), np.float32)),
        [VersionSpan(0, 0, len(response))],
        FinishReason.LENGTH,
        1.0,
        routed_experts=None if routes is None else Array.from_numpy(routes),
    )


def _group(prompt: list[int], samples: list[Sample]) -> TrajectoryGroup:
    return TrajectoryGroup("g", "p", Array.from_numpy(np.array(prompt, np.int32)), samples, "test", 0, 0, 0.0)


def _vllm_routes(num_tokens: int, offset: int) -> np.ndarray:
    """Routes as vLLM returns them: one row per forwarded token (prompt + response - 1), int32."""
    rows = np.arange(num_tokens - 1, dtype=np.int32)[:, None, None] + offset
    return np.broadcast_to(rows, (num_tokens - 1, NUM_LAYERS, TOP_K)).copy()


def test_routes_from_groups_aligns_each_sample_to_its_batch_row_and_marks_the_rest():
    groups = [
        _group([1, 4], [_sample([5, 6, 7], _vllm_routes(5, 0)), _sample([5], _vllm_routes(3, 100))]),
        _group([1, 4, 8], [_sample([9, 9], _vllm_routes(5, 200)), _sample([9, 9, 9, 9], _vllm_routes(7, 300))]),
    ]
    batch = build_batch(groups)
    routes = routes_from_groups(groups, width=batch.input_ids_BT.shape[1])

    assert routes.shape == (4, 7, NUM_LAYERS, TOP_K) and routes.dtype == torch.long
    row_lengths = batch.attention_mask_BT.sum(dim=1).tolist()  # prompt + response per row
    for row, (length, offset) in enumerate(zip(row_lengths, (0, 100, 200, 300), strict=True)):
        expected = torch.arange(length - 1)[:, None, None] + offset
        assert torch.equal(routes[row, : length - 1], expected.expand(length - 1, NUM_LAYERS, TOP_K))
        # The final token (never forwarded by vLLM) and the padding carry no route.
        assert (routes[row, length - 1 :] == NO_ROUTE).all()


def test_routes_from_groups_returns_none_when_any_sample_has_no_routes():
    groups = [_group([1, 4], [_sample([5, 6], _vllm_routes(4, 0)), _sample([5, 6], None)])]
    assert routes_from_groups(groups, width=4) is None
    assert routes_from_groups([_group([1, 4], [_sample([5, 6], None)])], width=4) is None


def test_routes_from_groups_rejects_routes_longer_than_the_token_row():
    groups = [_group([1, 4], [_sample([5, 6], _vllm_routes(6, 0))])]
    with pytest.raises(ValueError, match="routed positions"):
        routes_from_groups(groups, width=4)


def _inputs(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def test_replaying_recorded_routes_reproduces_recorded_logprobs_exactly(model):
    ids, attention = _inputs(3, 10)
    with torch.no_grad(), record_routes(model) as recorder:
        recorded = token_logprobs(model, ids, attention, 1.0)
    routes = recorder.routes(*ids.shape)
    assert routes.shape == (3, 10, NUM_LAYERS, TOP_K)
    with torch.no_grad(), forced_routing(model, routes):
        replayed = token_logprobs(model, ids, attention, 1.0)
    assert torch.equal(replayed, recorded)


def test_replay_reproduces_recorded_logprobs_after_the_router_changed(model):
    ids, attention = _inputs(1, 4, seed=3)
    with torch.no_grad(), record_routes(model) as recorder:
        recorded = token_logprobs(model, ids, attention, 1.0)
    routes = recorder.routes(*ids.shape)
    perturb_unused_experts([layer.mlp.gate.weight for layer in model.model.layers], routes)

    with torch.no_grad(), record_routes(model) as recorder:
        natural = token_logprobs(model, ids, attention, 1.0)
    assert not torch.equal(recorder.routes(*ids.shape), routes)
    assert (natural - recorded).abs().max() > 1e-3
    with torch.no_grad(), forced_routing(model, routes):
        replayed = token_logprobs(model, ids, attention, 1.0)
    # The gate renormalises a softmax over all experts, whose denominator the new rows changed: rounding only.
    torch.testing.assert_close(replayed, recorded, rtol=0, atol=1e-6)


def test_replay_keeps_router_gradients(model):
    ids, attention = _inputs(2, 6)
    with torch.no_grad(), record_routes(model) as recorder:
        model(input_ids=ids)
    with forced_routing(model, recorder.routes(*ids.shape)):
        token_logprobs(model, ids, attention, 1.0).sum().backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0


def test_no_routes_means_natural_routing_and_missing_positions_route_naturally(model):
    ids, attention = _inputs(2, 6)
    with torch.no_grad():
        natural = token_logprobs(model, ids, attention, 1.0)
        with forced_routing(model, None):
            assert torch.equal(token_logprobs(model, ids, attention, 1.0), natural)
        all_missing = torch.full((2, 6, NUM_LAYERS, TOP_K), NO_ROUTE)
        with forced_routing(model, all_missing):
            assert torch.equal(token_logprobs(model, ids, attention, 1.0), natural)


def test_forced_routing_rejects_routes_with_the_wrong_layer_count(model):
    ids, _ = _inputs(1, 4)
    with (
        pytest.raises(ValueError, match="layers"),
        forced_routing(model, torch.zeros(1, 4, 3, TOP_K, dtype=torch.long)),
    ):
        model(input_ids=ids)


def test_beam_sigmoid_router_replays_recorded_routes_exactly_and_still_learns(tmp_path):
    from transformers import AutoModelForCausalLM

    import modeling.beam  # noqa: F401 - registers the model type
    from modeling.beam.tiny import init_tiny_beam

    model = AutoModelForCausalLM.from_pretrained(str(init_tiny_beam(tmp_path / "beam")), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 4, 5, 6, 7, 8, 9, 10], [1, 9, 8, 7, 6, 5, 4, 3]])
    attention = torch.ones_like(ids)
    with torch.no_grad(), record_routes(model) as recorder:
        recorded = token_logprobs(model, ids, attention, 1.0)
    routes = recorder.routes(*ids.shape)
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert routes.shape[2] == len(routers) > 0
    with torch.no_grad(), forced_routing(model, routes):
        assert torch.equal(token_logprobs(model, ids, attention, 1.0), recorded)  # own routes: bit-exact
    with torch.no_grad():  # the trainer's router drifts: natural routing changes, replay holds
        for router in routers:
            router.e_score_correction_bias.copy_(torch.linspace(2.0, -2.0, router.e_score_correction_bias.numel()))
        natural = token_logprobs(model, ids, attention, 1.0)
    assert (natural - recorded).abs().max() > 1e-4
    with forced_routing(model, routes):
        replayed = token_logprobs(model, ids, attention, 1.0)
        assert torch.allclose(replayed, recorded, atol=1e-6)
        replayed.sum().backward()
    assert all(router.weight.grad is not None and router.weight.grad.abs().sum() > 0 for router in routers)


def test_beam_routes_over_every_decoder_layer_as_vllm_reports_them_replay_the_moe_layers(tmp_path):
    """vLLM's routes span all decoder layers (Beam's dense first layers hold zeros); replay picks each router's own
    layer, so the dense rows are never read and the MoE rows land on the right router."""
    from transformers import AutoModelForCausalLM

    import modeling.beam  # noqa: F401 - registers the model type
    from modeling.beam.tiny import init_tiny_beam

    model = AutoModelForCausalLM.from_pretrained(str(init_tiny_beam(tmp_path / "beam")), dtype=torch.float32).eval()
    config = model.config
    assert config.first_k_dense_replace > 0  # the tiny Beam has dense first layers, as the 501B one does
    ids = torch.tensor([[1, 4, 5, 6, 7, 8, 9, 10]])
    attention = torch.ones_like(ids)
    with torch.no_grad(), record_routes(model) as recorder:
        recorded = token_logprobs(model, ids, attention, 1.0)
    moe_routes = recorder.routes(*ids.shape)  # [B, T, MoE layers, K]
    all_layers = torch.zeros(*ids.shape, config.num_hidden_layers, moe_routes.shape[-1], dtype=torch.long)
    all_layers[:, :, config.first_k_dense_replace :] = moe_routes  # dense rows stay 0, as vLLM leaves them
    with torch.no_grad():
        routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        for router in routers:  # move natural routing away, so only a correct replay gives back `recorded`
            router.e_score_correction_bias.copy_(torch.linspace(2.0, -2.0, router.e_score_correction_bias.numel()))
        with forced_routing(model, all_layers):
            assert torch.allclose(token_logprobs(model, ids, attention, 1.0), recorded, atol=1e-6)
        shifted = torch.roll(all_layers, shifts=1, dims=2)  # the layer order off by one: not the recorded routes
        with forced_routing(model, shifted):
            assert (token_logprobs(model, ids, attention, 1.0) - recorded).abs().max() > 1e-4
