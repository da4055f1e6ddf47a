"""The Megatron backend's speed and memory switches on CPU (gloo world size 1, fp32): each equals the stock path.

- fused attention (``FusedCoreAttention``, Beam's ``BeamFusedCoreAttention``) and the fused LM-head log-probs,
  against megatron-core's eager attention and the whole-logits path: log-probs and every gradient of one step,
  on the tiny Qwen3-MoE and the tiny Beam (window 16, so rows of 70 tokens cross five window blocks), right- and
  left-padded;
- activation recompute (full, selective) against none, with rollout routes replayed (R3) that natural routing
  would not choose, so a recompute that re-routed would change the gradients;
- the fused AdamW kernel against torch's default AdamW;
- optimizer CPU offload: refused with the key named where it cannot run.

The attention functions are also checked alone against an eager softmax in float64.
"""

from __future__ import annotations

import pytest
import torch

import modeling.beam  # noqa: F401  (registers model_type "beam" with transformers)
from modeling.beam.tiny import init_tiny_beam
from modeling.tiny_model import init_tiny
from protos.config import MegatronConfig, TrainerConfig
from trainer_service.batch import TrainBatch
from trainer_service.megatron.backend import MegatronBackend
from trainer_service.megatron.forward import is_right_padded
from trainer_service.megatron.fused_attention import causal_attention, masked_attention
from trainer_service.megatron.model import fp32_shards_as_leaves

pytestmark = pytest.mark.integration

STOCK = dict(fused_attention=False, fused_adam=False)
LENGTHS = {"qwen3_moe": (23, 17, 9), "beam": (70, 50, 33)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        "qwen3_moe": str(init_tiny(tmp_path_factory.mktemp("qwen"), seed=0, num_experts=16)),
        "beam": str(init_tiny_beam(tmp_path_factory.mktemp("beam"), seed=0)),
    }


def _config(fused_lm_head: bool = False, **megatron) -> TrainerConfig:
    # No clipping: gradients are compared as computed.
    return TrainerConfig(
        backend="megatron",
        lr=1e-2,
        geo_mask=None,
        grad_clip=1e9,
        fused_lm_head_logprobs=fused_lm_head,
        megatron=MegatronConfig(**(STOCK | megatron)),
    )


def _rows(lengths, left_padded: bool = False, vocab: int = 64):
    generator = torch.Generator().manual_seed(0)
    ids_BT = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask_BT = torch.zeros_like(ids_BT)
    for row, length in enumerate(lengths):
        real = slice(max(lengths) - length, None) if left_padded else slice(0, length)
        ids_BT[row, real] = torch.randint(3, vocab, (length,), generator=generator)
        mask_BT[row, real] = 1
    return ids_BT, mask_BT


def _batch(lengths) -> TrainBatch:
    """Right-padded rows; every target after the first 4 tokens is trained, at its row's temperature."""
    ids_BT, mask_BT = _rows(lengths)
    loss_mask_BT = mask_BT[:, 1:].float()
    loss_mask_BT[:, :3] = 0.0
    rows = len(lengths)
    return TrainBatch(
        input_ids_BT=ids_BT,
        attention_mask_BT=mask_BT,
        loss_mask_BT=loss_mask_BT,
        rollout_logprobs_BT=-3.0 * loss_mask_BT,
        advantages_B=torch.linspace(-1.0, 1.0, rows),
        rewards_B=torch.zeros(rows),
        min_versions_B=torch.zeros(rows, dtype=torch.long),
        num_response_tokens=int(loss_mask_BT.sum()),
        temperatures_B=torch.tensor([0.7, 1.0, 1.3])[:rows],
    )


def _step(backend: MegatronBackend, batch: TrainBatch, routes=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """One step's figures and every parameter's gradient (megatron's ``main_grad``, left in place after the step)."""
    metrics = backend.train_step(batch, routed_experts=routes)
    grads = {
        name: param.main_grad.detach().clone()
        for name, param in backend.model[0].named_parameters()
        if getattr(param, "main_grad", None) is not None
    }
    return metrics, grads


def _assert_same_step(actual, expected, tolerance: float = 1e-5) -> None:
    (metrics, grads), (expected_metrics, expected_grads) = actual, expected
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], rel=tolerance, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(expected_metrics["grad_norm"], rel=tolerance)
    assert grads.keys() == expected_grads.keys() and len(grads) > 10
    scale = max(float(g.abs().max()) for g in expected_grads.values())
    worst = max(float((grads[name] - g).abs().max()) for name, g in expected_grads.items())
    assert worst <= tolerance * scale, (worst, scale)


def _layers(backend: MegatronBackend) -> list:
    return list(backend.model[0].module.decoder.layers)


def _random_routes(backend: MegatronBackend, batch: TrainBatch, seed: int = 0) -> torch.Tensor:
    """Distinct random experts per token and MoE router: routes natural routing would (almost) never take."""
    from megatron.core.utils import get_model_config

    config = get_model_config(backend.model[0])
    num_routers = sum(
        1 for _, module in backend.model[0].named_modules() if module.__class__.__name__.endswith("Router")
    )
    rows, seq = batch.input_ids_BT.shape
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, seq, num_routers, config.num_moe_experts, generator=generator)
    return scores.topk(config.moe_router_topk, dim=-1).indices


# -- attention functions ---------------------------------------------------------------------------------------


def _eager_attention(q_BNTD, k_BGTD, v_BGTD, scale, window=None, masked_B1TT=None):
    groups = q_BNTD.shape[1] // k_BGTD.shape[1]
    k_BNTD, v_BNTD = k_BGTD.repeat_interleave(groups, 1), v_BGTD.repeat_interleave(groups, 1)
    seq = q_BNTD.shape[2]
    query_T1, key_1T = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    blocked_TT = key_1T > query_T1
    if window is not None:
        blocked_TT |= key_1T < query_T1 - window
    blocked = blocked_TT if masked_B1TT is None else blocked_TT | masked_B1TT
    scores = (q_BNTD @ k_BNTD.transpose(-1, -2) * scale).masked_fill(blocked, float("-inf"))
    return scores.softmax(-1) @ v_BNTD


@pytest.mark.parametrize("seq, window", [(37, None), (37, 4), (40, 7), (16, 15), (5, 16), (64, 15)])
def test_fused_attention_functions_equal_eager_softmax_attention(seq, window):
    generator = torch.Generator().manual_seed(seq)
    q_BNTD = torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=generator)
    k_BGTD, v_BGTD = (torch.randn(2, 2, seq, 8, dtype=torch.float64, generator=generator) for _ in range(2))
    masked_B1TT = torch.zeros(2, 1, 1, seq, dtype=torch.bool)
    masked_B1TT[1, ..., :3] = True  # left padding of row 1: its first 3 queries are padding too
    expected = _eager_attention(q_BNTD, k_BGTD, v_BGTD, 0.3, window)
    expected_masked = _eager_attention(q_BNTD, k_BGTD, v_BGTD, 0.3, window, masked_B1TT)

    assert torch.allclose(causal_attention(q_BNTD, k_BGTD, v_BGTD, 0.3, window), expected, atol=1e-12)
    masked = masked_attention(q_BNTD, k_BGTD, v_BGTD, masked_B1TT, 0.3, window)
    assert torch.allclose(masked[0], expected_masked[0], atol=1e-12)
    assert torch.allclose(masked[1, :, 3:], expected_masked[1, :, 3:], atol=1e-12)
    assert not masked.isnan().any()  # the padded queries see at least themselves


def test_only_right_padded_batches_take_the_maskless_path():
    assert is_right_padded(_rows((5, 3))[1])
    assert not is_right_padded(_rows((5, 3), left_padded=True)[1])


# -- whole models ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3_moe", "beam"])
def test_fused_attention_and_lm_head_give_the_stock_logprobs_and_gradients(model_dirs, kind):
    stock = MegatronBackend(model_dirs[kind], _config())
    fused = MegatronBackend(model_dirs[kind], _config(fused_lm_head=True, fused_attention=True))
    core_attentions = {type(layer.self_attention.core_attention).__name__ for layer in _layers(fused)}
    assert core_attentions == {"BeamFusedCoreAttention" if kind == "beam" else "FusedCoreAttention"}
    batch = _batch(LENGTHS[kind])
    for left_padded in (False, True):
        ids_BT, mask_BT = _rows(LENGTHS[kind], left_padded)
        real_BT = (mask_BT[:, :-1] * mask_BT[:, 1:]).bool()  # a real query and a real target
        expected = stock.token_logprobs(ids_BT, mask_BT, temperature=batch.temperatures_B)[real_BT]
        actual = fused.token_logprobs(ids_BT, mask_BT, temperature=batch.temperatures_B)[real_BT]
        assert bool(((actual - expected).abs() <= 1e-5 * expected.abs().clamp(min=1.0)).all())
    _assert_same_step(_step(fused, batch), _step(stock, batch))


@pytest.mark.parametrize(
    "kind, recompute, modules",
    [
        ("qwen3_moe", "full", ["core_attn"]),
        ("qwen3_moe", "selective", ["core_attn", "moe"]),
        ("beam", "full", ["core_attn"]),
    ],
)
def test_activation_recompute_gives_the_same_step_with_replayed_routes(model_dirs, kind, recompute, modules):
    fused = dict(fused_lm_head=True, fused_attention=True)  # recompute re-runs the fused attention too
    plain, natural = (MegatronBackend(model_dirs[kind], _config(**fused)) for _ in range(2))
    recomputing = MegatronBackend(model_dirs[kind], _config(**fused, recompute=recompute, recompute_modules=modules))
    batch = _batch(LENGTHS[kind])
    routes = _random_routes(plain, batch)
    replayed = _step(plain, batch, routes)
    assert abs(replayed[0]["grad_norm"] - _step(natural, batch)[0]["grad_norm"]) > 1e-3 * replayed[0]["grad_norm"]
    _assert_same_step(_step(recomputing, batch, routes), replayed)
    # The weights are the same again after that step; now natural routing, re-run alike in the recompute.
    _assert_same_step(_step(recomputing, batch), _step(plain, batch))


def test_fused_adamw_takes_the_step_of_torch_default_adamw(model_dirs):
    default = MegatronBackend(model_dirs["qwen3_moe"], _config())
    fused = MegatronBackend(model_dirs["qwen3_moe"], _config(fused_adam=True))
    inner = [sub.optimizer for sub in fused.optimizer.chained_optimizers]
    assert all(group["fused"] for optimizer in inner for group in optimizer.param_groups)
    before = {name: tensor.clone() for name, tensor in default.export_hf_weights()}
    batch = _batch(LENGTHS["qwen3_moe"])
    for _ in range(2):  # the second step reads the moments and step counters the first wrote
        assert default.train_step(batch)["loss"] == pytest.approx(fused.train_step(batch)["loss"], rel=1e-6)
    expected, actual = dict(default.export_hf_weights()), dict(fused.export_hf_weights())
    assert max(float((expected[name] - before[name]).abs().max()) for name in before) > 1e-3  # weights moved
    differences = torch.cat([(actual[name] - expected[name]).abs().flatten() for name in expected])
    # Rounding only; it is amplified where a gradient is near Adam's eps (a few elements in 10^5).
    assert float((differences > 1e-6).float().mean()) < 1e-4 and float(differences.max()) < 1e-2 * 1e-2


def test_optimizer_offload_names_the_key_where_it_cannot_run(model_dirs):
    with pytest.raises(ValueError, match="optimizer_cpu_offload"):
        MegatronConfig(optimizer_cpu_offload=True)  # fp32 params have no main copy to offload
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        MegatronConfig(optimizer_cpu_offload=True, params_dtype="bfloat16", use_distributed_optimizer=False)
    offloading = _config(optimizer_cpu_offload=True, params_dtype="bfloat16")
    with pytest.raises(ValueError, match="optimizer_cpu_offload needs CUDA"):
        MegatronBackend(model_dirs["qwen3_moe"], offloading)


def _optimizer_params(backend: MegatronBackend) -> list[torch.Tensor]:
    chained = backend.optimizer.chained_optimizers
    return [param for sub in chained for group in sub.optimizer.param_groups for param in group["params"]]


def _router_weights(backend: MegatronBackend) -> dict[str, torch.Tensor]:
    return {name: p for name, p in backend.model[0].named_parameters() if name.endswith("router.weight")}


def test_fp32_router_shards_become_leaves_the_offload_optimizer_accepts_and_still_step_the_router(model_dirs):
    """Beam keeps its router weight fp32 in a bf16 model. megatron-core's optimizer shard of it is a non-leaf view,
    which HybridDeviceOptimizer (optimizer_cpu_offload, CUDA only) hands to torch.optim.Optimizer, and that refuses
    it; under ``fp32_shards_as_leaves`` the shards are leaves over the router's own storage and the step is the
    same."""
    config = _config(params_dtype="bfloat16")
    stock = MegatronBackend(model_dirs["beam"], config)
    with fp32_shards_as_leaves():
        leafy = MegatronBackend(model_dirs["beam"], config)
    routers = _router_weights(leafy)
    assert routers and all(p.dtype == torch.float32 for p in routers.values())
    assert not all(param.is_leaf for param in _optimizer_params(stock))  # megatron-core 0.19.2 as it is
    with pytest.raises(ValueError, match="non-leaf"):
        torch.optim.AdamW(_optimizer_params(stock))
    torch.optim.AdamW(_optimizer_params(leafy))  # what HybridDeviceOptimizer's constructor checks
    storages = {param.untyped_storage().data_ptr() for param in _optimizer_params(leafy)}
    assert all(p.untyped_storage().data_ptr() in storages for p in routers.values())
    before = {name: p.detach().clone() for name, p in routers.items()}
    batch = _batch(LENGTHS["beam"])
    assert leafy.train_step(batch)["loss"] == pytest.approx(stock.train_step(batch)["loss"], rel=1e-6)
    for name, stock_weight in _router_weights(stock).items():
        assert float((routers[name].detach() - before[name]).abs().max()) > 0.0  # the step wrote through the leaf
        torch.testing.assert_close(routers[name], stock_weight, rtol=0, atol=0)
