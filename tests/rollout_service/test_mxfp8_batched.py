"""MXFP8 expert processing batched over experts: equal bytes to vLLM's per-expert loops, and the first-call check that
keeps vLLM's own function whenever a replacement differs or fails. (The Marlin repack kernel exists on GPUs only; its
batched form is checked in the worker on its first call there and by benchmarks/weight_refit.py --quantization.)"""

from __future__ import annotations

import pytest
import torch

from rollout_service import mxfp8_batched

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setitem(mxfp8_batched._STATE, "verdicts", {})
    monkeypatch.setitem(mxfp8_batched._STATE, "checked", set())
    monkeypatch.setitem(mxfp8_batched._STATE, "enabled", True)


def expert_weights(experts=6, outputs=64, inputs=128, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(experts, outputs, inputs, generator=generator) * 0.02
    weight[1, 3, :32] = 0.0  # an all-zero block: the smallest scale
    weight[2, 5, 40] = 300.0  # one block with a large outlier
    return weight.to(torch.bfloat16)


def test_experts_quantized_as_one_matrix_equal_vllms_loop_byte_for_byte():
    from vllm.model_executor.layers.quantization.online.mxfp8 import Mxfp8OnlineMoEMethod
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import mxfp8_e4m3_quantize

    weight = expert_weights()
    ours = mxfp8_batched.quantize_experts(mxfp8_e4m3_quantize, weight)
    loop = mxfp8_batched._STATE["originals"].get("quantize", (None, None, None))[2]
    loop = loop or Mxfp8OnlineMoEMethod._quantize_mxfp8_moe_weight
    theirs = loop(None, weight)  # vLLM's per-expert loop (its method reads nothing of self)
    assert ours[0].dtype == torch.float8_e4m3fn and ours[1].shape == (6, 64, 4)
    assert mxfp8_batched.same_bytes(ours, theirs) == ""


def vllm_scale_loop(scales: torch.Tensor, outputs: int, inputs: int) -> torch.Tensor:
    """The scale half of vLLM's prepare_mxfp8_moe_layer_for_marlin, expert by expert, as vLLM writes it."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_scales
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import mxfp8_marlin_process_scales

    per_expert = []
    for index in range(scales.shape[0]):
        s = scales[index][:outputs, : inputs // 32].contiguous()
        s = s.view(torch.float8_e8m0fnu).to(torch.get_default_dtype()).T.contiguous()
        s = marlin_permute_scales(s=s, size_k=inputs, size_n=outputs, group_size=32)
        per_expert.append(mxfp8_marlin_process_scales(s))
    return torch.cat([s.unsqueeze(0) for s in per_expert], 0)


@pytest.mark.parametrize(("outputs", "inputs"), [(128, 256), (64, 2048), (192, 64)])
def test_marlin_scales_permuted_for_all_experts_at_once_equal_vllms_loop(outputs, inputs):
    generator = torch.Generator().manual_seed(outputs + inputs)
    scales = torch.randint(100, 140, (5, outputs, inputs // 32), generator=generator, dtype=torch.uint8)
    ours = mxfp8_batched.marlin_scales_experts(scales, outputs, inputs)
    theirs = vllm_scale_loop(scales, outputs, inputs)
    assert ours.dtype == torch.float8_e8m0fnu and ours.shape == (5, inputs // 32, outputs)
    assert mxfp8_batched.same_bytes(ours, theirs) == ""


def test_same_bytes_names_the_result_whose_dtype_shape_or_bytes_differ():
    a = torch.arange(8, dtype=torch.uint8)
    assert mxfp8_batched.same_bytes((a, a), (a, a.clone())) == ""
    assert "result 1: bytes differ" in mxfp8_batched.same_bytes((a, a), (a, a + 1))
    assert "result 0: torch.int32" in mxfp8_batched.same_bytes(a.int(), a)
    assert "2 results against 1" in mxfp8_batched.same_bytes((a, a), a)


class Counted:
    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args):
        self.calls += 1
        return self.function(*args)


def test_a_batched_replacement_equal_on_its_first_call_serves_alone_after_it(fresh_state):
    original, batched = Counted(lambda x: x * 2), Counted(lambda x: x + x)
    call = mxfp8_batched.checked("demo", batched, original)
    assert torch.equal(call(torch.ones(3)), torch.full((3,), 2.0))
    assert (batched.calls, original.calls) == (1, 1)  # the first call checks against vLLM's function
    call(torch.ones(3))
    assert (batched.calls, original.calls) == (2, 1)
    assert mxfp8_batched._STATE["verdicts"]["demo"] == "equal"
    call(torch.ones(5))  # arguments of new shapes: checked once more
    call(torch.ones(5))
    assert (batched.calls, original.calls) == (4, 2)


def test_a_replacement_that_differs_or_fails_hands_every_call_to_vllms_function(fresh_state):
    original = Counted(lambda x: x * 2)
    wrong = mxfp8_batched.checked("wrong", lambda x: x * 3, original)
    assert torch.equal(wrong(torch.ones(2)), torch.full((2,), 2.0))  # vLLM's result, not the differing one
    assert torch.equal(wrong(torch.ones(2)), torch.full((2,), 2.0))
    assert mxfp8_batched._STATE["verdicts"]["wrong"] == "result 0: bytes differ"

    def broken(x):
        raise RuntimeError("no kernel image")

    failing = mxfp8_batched.checked("failing", broken, original)
    assert torch.equal(failing(torch.ones(2)), torch.full((2,), 2.0))
    assert "failed: RuntimeError: no kernel image" in mxfp8_batched._STATE["verdicts"]["failing"]


def test_switched_off_or_declined_calls_go_to_vllms_function(fresh_state):
    original, batched = Counted(lambda x: x * 2), Counted(lambda x: None)  # None: a case it does not cover
    call = mxfp8_batched.checked("declined", batched, original)
    call(torch.ones(1))
    assert original.calls == 1 and "declined" not in mxfp8_batched._STATE["verdicts"]
    mxfp8_batched.set_enabled(False)
    call(torch.ones(1))
    assert (batched.calls, original.calls) == (1, 2)


def test_the_installed_moe_quantize_is_checked_against_vllms_loop_in_the_worker(fresh_state):
    from vllm.model_executor.layers.quantization.online.mxfp8 import Mxfp8OnlineMoEMethod

    assert mxfp8_batched.install()  # as the worker extension's import does
    weight = expert_weights(experts=3, seed=1)
    q, scales = Mxfp8OnlineMoEMethod._quantize_mxfp8_moe_weight(None, weight)
    assert q.shape == (3, 64, 128) and scales.shape == (3, 64, 4)
    assert mxfp8_batched.state()["quantize"] == "equal"
