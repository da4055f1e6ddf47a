"""GroupedExperts (trainer_service/megatron/grouped_experts.py) against megatron-core's SequentialMLP, CPU fp32.

The grouped matmul against its per-expert loop; then the tiny Qwen3-MoE and the tiny Beam, each built twice from
one checkpoint (grouped experts and SequentialMLP experts): the same imported weights and HF export, log-probs,
and a training step's loss, grad norm and every gradient (the embedding's gradient is the experts' input
gradient carried back), with the model's own routing and with replayed routes (R3); and grouped experts split
over two expert-parallel or two expert-tensor-parallel ranks against the HF reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grouped_cases import assert_close, backend, gradients, parameters, sequential_names
from lora_cases import MODELS, lora_batch, make_model_dir
from test_megatron_beam import padded_batch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def kernels():
    from trainer_service.megatron import cpu_shims

    cpu_shims.apply()  # before megatron-core is imported
    from trainer_service.megatron import grouped_experts

    return grouped_experts


def _rows(kernels, counts: list[int]):
    return kernels.ExpertRows.of(torch.tensor(counts), torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_equals_the_per_expert_loop_forward_and_backward(kernels, dtype):
    generator = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 2]  # the second expert gets no rows
    x_TK = torch.randn(10, 16, generator=generator).to(dtype).requires_grad_()
    w_ENK = torch.randn(4, 24, 16, generator=generator).to(dtype).requires_grad_()
    assert kernels.grouped_mm_runs(x_TK, w_ENK.transpose(1, 2))  # a CPU torch runs torch._grouped_mm itself
    grouped = kernels.grouped_mm(x_TK, w_ENK.transpose(1, 2), _rows(kernels, counts))
    grouped.sum().backward()  # sum() hands back an expanded gradient, which _grouped_mm's backward refuses
    grads = (x_TK.grad, w_ENK.grad)
    x_TK.grad = w_ENK.grad = None
    looped = kernels.loop_mm(x_TK, w_ENK.transpose(1, 2), _rows(kernels, counts))
    looped.sum().backward()

    tolerance = {"rtol": 0.0, "atol": 0.0} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(grouped, looped, **tolerance)
    torch.testing.assert_close(grads[0], x_TK.grad, **tolerance)
    torch.testing.assert_close(grads[1], w_ENK.grad, **tolerance)
    assert torch.equal(grads[1][1], torch.zeros_like(grads[1][1]))  # no rows, no gradient


def test_padding_to_whole_16_byte_rows_changes_no_product(kernels):
    """torch._grouped_mm wants 16-byte row strides: K and N are zero-padded (a LoRA rank of 4 is 8 bytes of bf16);
    the loop shows the padding is exact."""
    generator = torch.Generator().manual_seed(1)
    rows = _rows(kernels, [2, 3])
    x_TK = torch.randn(5, 4, generator=generator, dtype=torch.bfloat16)
    w_EKN = torch.randn(2, 4, 6, generator=generator, dtype=torch.bfloat16)
    padded_x, padded_w = kernels._aligned(x_TK, w_EKN)
    assert padded_x.shape == (5, 8) and padded_w.shape == (2, 8, 8)
    expected = kernels.loop_mm(x_TK, w_EKN, rows)
    assert torch.equal(kernels.loop_mm(padded_x, padded_w, rows)[:, :6], expected)


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request, tmp_path_factory):
    return make_model_dir(request.param, tmp_path_factory)


def test_grouped_experts_match_sequential_mlp_with_natural_and_replayed_routes(model_dir):
    from trainer_service.megatron.grouped_experts import GroupedExperts
    from trainer_service.megatron.routing_replay import megatron_record_routes

    grouped, sequential = backend(model_dir, grouped=True), backend(model_dir, grouped=False)
    assert any(isinstance(module, GroupedExperts) for module in grouped.model[0].modules())
    assert not any(isinstance(module, GroupedExperts) for module in sequential.model[0].modules())
    imported = {name: p.detach() for name, p in parameters(sequential).items()}
    assert_close(sequential_names(parameters(grouped)), imported, rtol=0.0, atol=0.0)
    assert_close(dict(grouped.export_hf_weights()), dict(sequential.export_hf_weights()), rtol=0.0, atol=0.0)

    batch = lora_batch()
    mask = batch.attention_mask_BT[:, 1:].bool()
    want = sequential.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    got = grouped.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    torch.testing.assert_close(got[mask], want[mask], rtol=0.0, atol=1e-6)
    with megatron_record_routes(grouped.model) as recorder:
        grouped.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    replayed = recorder.routes(*batch.input_ids_BT.shape)

    for routes in (None, replayed):
        got, want = (
            grouped.train_step(batch, routed_experts=routes),
            sequential.train_step(batch, routed_experts=routes),
        )
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert_close(gradients(grouped), gradients(sequential), rtol=1e-5, atol=1e-7)
    # Two Adam steps of lr 1e-2 from gradients equal to 1e-5: the weights agree far inside one step.
    assert_close(dict(grouped.export_hf_weights()), dict(sequential.export_hf_weights()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 1)], ids=["ep2", "tp2-etp2"])
def test_grouped_experts_split_over_two_ranks_match_the_hf_reference(tmp_path, tp, ep):
    """Two gloo ranks: EP=2 (each rank holds 8 of the tiny Beam's 16 experts in its grouped weights) or TP=2 with
    expert TP 2 (each rank holds half of every expert's FFN width): logits equal the HF reference, the export
    gathers the HF checkpoint exactly, and a step equals one rank's."""
    from modeling.beam.tiny import init_tiny_beam
    from protos.config import TrainerConfig
    from trainer_service.torch_backend import TorchBackend

    beam_dir = str(init_tiny_beam(tmp_path / "beam", seed=0))
    out = tmp_path / "figures.json"
    worker = Path(__file__).with_name("megatron_beam_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    # The workers import this checkout's code, wherever the installed package points.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [*command, str(worker), beam_dir, str(tp), str(ep), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    figures = json.loads(out.read_text())
    config = TrainerConfig(backend="megatron", lr=1e-2, geo_mask=None)
    reference = TorchBackend(beam_dir, config).train_step(padded_batch())
    assert figures["grouped_experts"] and figures["export_exact"], figures
    assert figures["mean_kl"] <= 1e-6 and figures["top1"] == 1.0, figures
    assert figures["loss"] == pytest.approx(reference["loss"], abs=1e-6)
    assert figures["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)


def test_a_checkpoint_of_one_experts_layout_is_refused_by_the_other_naming_the_setting(tmp_path):
    from modeling.tiny_model import init_tiny

    model_dir = str(init_tiny(tmp_path / "tiny", seed=0))
    grouped = backend(model_dir, grouped=True)
    grouped.train_step(lora_batch())  # megatron's optimizer has a state to save once it has stepped
    grouped.save_checkpoint(tmp_path / "grouped")
    with pytest.raises(ValueError, match="trainer.megatron.moe_grouped_experts"):
        backend(model_dir, grouped=False).load_checkpoint(tmp_path / "grouped")
