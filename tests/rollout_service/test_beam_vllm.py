"""Beam in vLLM (out-of-tree plugin, CPU engine) matches the transformers reference on a tiny checkpoint.

Full-vocabulary logprobs come from vLLM's ``prompt_logprobs=-1`` (with ``max_logprobs=-1``): for
every prompt position the log-softmax of vLLM's own (soft-capped) logits, compared with the HF
reference position by position. Figures are printed (run with ``-s``) and quoted in
docs/models/beam.md.
"""

from __future__ import annotations

import json
import sys

import cloudpickle
import pytest
import torch
from transformers import AutoModelForCausalLM

import modeling.beam  # noqa: F401  (registers model_type "beam" with transformers)
from modeling.beam.tiny import init_tiny_beam
from protos.records import encode
from weight_bus.packing import pack

pytestmark = pytest.mark.integration

VOCAB = 64
MAX_MODEL_LEN = 512
WORKER_EXTENSION = "rollout_service.worker_extension.WeightLoaderExtension"
PROMPT_LENGTHS = (300, 200, 120)  # 617 scored positions, beyond the 16-token window many times over


def _prompts(seed: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 52, (n,), generator=generator).tolist() for n in lengths]


def _start_llm(model_dir, dtype: str):
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        dtype=dtype,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
        max_logprobs=-1,
        enable_prefix_caching=False,
        worker_extension_cls=WORKER_EXTENSION,
        seed=0,
    )


def _stop_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def _vllm_logprobs(llm, prompts) -> list[torch.Tensor]:
    """[len - 1, VOCAB] float64 log-probabilities of every prompt position after the first."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = []
    for output in outputs:
        table = torch.full((len(output.prompt_token_ids) - 1, VOCAB), float("nan"), dtype=torch.float64)
        for position, entries in enumerate(output.prompt_logprobs[1:]):
            for token_id, entry in entries.items():
                table[position, token_id] = entry.logprob
        assert not table.isnan().any(), "vLLM returned fewer than VOCAB logprobs for some position"
        result.append(table)
    return result


@torch.no_grad()
def _hf_logprobs(model, prompts) -> list[torch.Tensor]:
    return [torch.log_softmax(model(torch.tensor([p]), use_cache=False).logits[0, :-1].double(), -1) for p in prompts]


def _compare(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> dict:
    """KL(reference || candidate) per position, top-1 agreement, largest logprob gap."""
    p, q = torch.cat(reference), torch.cat(candidate)
    kl = (p.exp() * (p - q)).sum(-1)
    return {
        "positions": int(p.shape[0]),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "top1_agreement": float((p.argmax(-1) == q.argmax(-1)).double().mean()),
        "max_abs_logprob_diff": float((p - q).abs().max()),
    }


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    sequence = torch.tensor([prompt])
    for _ in range(num_tokens):
        next_id = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_id], dim=1)
    return sequence[0, len(prompt) :].tolist()


def _vllm_greedy(llm, prompts, num_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module", autouse=True)
def vllm_env():
    """Engine settings for this module only (engine processes inherit them at start)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        # The route test sends functions to the worker through collective_rpc (pickle, loopback only).
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_tiny_beam(tmp_path_factory.mktemp("beam"), seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    """One fp32 CPU engine for the module (start-up is the slow part); the reload test runs last."""
    engine = _start_llm(model_dir, "float32")
    yield engine
    _stop_llm(engine)


def test_vllm_fp32_full_vocab_logprobs_match_hf(llm, hf_model):
    prompts = _prompts(seed=1)
    figures = _compare(_hf_logprobs(hf_model, prompts), _vllm_logprobs(llm, prompts))
    print("BEAM fp32 vLLM vs HF:", json.dumps(figures))
    assert abs(figures["mean_kl"]) <= 1e-6, figures
    assert figures["top1_agreement"] == 1.0, figures


def test_vllm_greedy_generation_equals_hf(llm, hf_model):
    prompts = _prompts(seed=2, lengths=(40, 25, 9))
    expected = [_hf_greedy(hf_model, prompt, 48) for prompt in prompts]
    assert _vllm_greedy(llm, prompts, 48) == expected


def test_vllm_bf16_logprobs_close_to_hf(tmp_path_factory):
    """Reported, loosely bounded: vLLM bf16 must be no worse than HF's own bf16 rounding.

    A briefly trained checkpoint (10 echo warm-up steps) is used: a random one with peaked
    attention and logits is chaotic under bf16 (routes flip), which says nothing about serving.
    """
    model_dir = init_tiny_beam(tmp_path_factory.mktemp("beam_bf16"), seed=0, warmup_steps=10)
    prompts = _prompts(seed=3)
    fp32 = _hf_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), prompts)
    bf16 = _hf_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval(), prompts)
    engine = _start_llm(model_dir, "bfloat16")
    try:
        vllm_bf16 = _vllm_logprobs(engine, prompts)
    finally:
        _stop_llm(engine)
    figures = {
        "vllm_bf16_vs_hf_fp32": _compare(fp32, vllm_bf16),
        "hf_bf16_vs_hf_fp32": _compare(fp32, bf16),
        "vllm_bf16_vs_hf_bf16": _compare(bf16, vllm_bf16),
    }
    print("BEAM bf16:", json.dumps(figures))
    floor = figures["hf_bf16_vs_hf_fp32"]["mean_kl"]
    assert figures["vllm_bf16_vs_hf_fp32"]["mean_kl"] <= 5 * floor + 1e-3, figures
    assert figures["vllm_bf16_vs_hf_fp32"]["top1_agreement"] >= 0.8, figures


def _install_route_recorder(worker) -> int:
    """In the worker: record each MoE layer's chosen expert ids through the router's capture hook,
    the hook vLLM's GPU routed-experts capturer binds (``bind_routed_experts_capturer``)."""
    from functools import partial

    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    store = worker.__dict__.setdefault("beam_routes", {})

    def record(layer_id, topk_ids):
        store.setdefault(layer_id, []).append(topk_ids.detach().cpu().clone())

    runners = [m for m in worker.model_runner.get_model().modules() if isinstance(m, MoERunner)]
    for runner in runners:
        runner.router.set_capture_fn(partial(record, runner.layer_id))
    return len(runners)


def _collect_routes(worker) -> dict[int, list[list[int]]]:
    """In the worker: the recorded routes per layer index, expert ids sorted per token; unhooks."""
    import torch as worker_torch
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    for module in worker.model_runner.get_model().modules():
        if isinstance(module, MoERunner):
            module.router.set_capture_fn(None)
    store = worker.__dict__.pop("beam_routes", {})
    return {layer: worker_torch.cat(ids).sort(-1).values.tolist() for layer, ids in store.items()}


@torch.no_grad()
def _hf_routes(model, prompt: list[int]) -> dict[int, list[list[int]]]:
    routes, hooks = {}, []

    def recorder(index):
        def record(module, args, out):  # BeamRouter returns (weights, ids, logits)
            routes[index] = out[1].sort(-1).values.tolist()

        return record

    for index, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(recorder(index)))
    model(torch.tensor([prompt]), use_cache=False)
    for hook in hooks:
        hook.remove()
    return routes


def test_vllm_routes_tokens_to_the_same_experts_as_hf(llm, hf_model):
    """Routed experts per layer index, as vLLM would return them on GPU, equal the reference routes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker cannot import this test module
    (num_moe_layers,) = llm.collective_rpc(_install_route_recorder)
    prompt = _prompts(seed=5, lengths=(150,))[0]
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=1), use_tqdm=False)
    (routes,) = llm.collective_rpc(_collect_routes)
    assert num_moe_layers == 5 and sorted(routes) == [1, 2, 3, 4, 5]
    assert routes == _hf_routes(hf_model, prompt)


def _stage(tensors: dict[str, torch.Tensor], path) -> bytes:
    """Pack tensors as the weight bus would and write the buckets end to end; returns the manifest."""
    manifest, buckets = pack(tensors.items(), version=1, bytes_per_bucket=1 << 20)
    with open(path, "wb") as staging:
        for bucket in buckets:
            staging.write(bucket.tobytes())
    return encode(manifest)


def test_weight_reload_into_running_engine_matches_hf_with_new_weights(llm, tmp_path_factory):
    new_dir = init_tiny_beam(tmp_path_factory.mktemp("beam_new"), seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    state = new_model.state_dict()  # HF names, router weight and bias fp32, e_score_correction_bias included
    staging = tmp_path_factory.mktemp("staging") / "weights.bin"
    prompts = _prompts(seed=4, lengths=(200, 64))
    before = _vllm_logprobs(llm, prompts)

    (loaded,) = llm.collective_rpc("fleetrl_load_staged_weights", args=(str(staging), _stage(state, staging)))

    assert loaded == len(state)
    after = _vllm_logprobs(llm, prompts)
    figures = _compare(_hf_logprobs(new_model, prompts), after)
    print("BEAM fp32 after reload, vLLM vs HF(new weights):", json.dumps(figures))
    assert _compare(after, before)["mean_kl"] > 1e-2  # the weights really changed
    assert abs(figures["mean_kl"]) <= 1e-6 and figures["top1_agreement"] == 1.0, figures
    assert _vllm_greedy(llm, prompts, 32) == [_hf_greedy(new_model, p, 32) for p in prompts]
