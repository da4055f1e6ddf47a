"""The layer plan (rollout_service.layer_plan) on CPU, through vLLM's own layerwise reload of a toy model whose layers
are processed after loading (as an online-MXFP8 layer is: the served tensors are computed from the loaded ones, of
another shape and dtype): recorded during a reload, checked against it, replayed for later versions into the same
served memory; refused wherever a replay would serve something other than vLLM's reload."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload import layerwise
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from rollout_service import layer_plan, refit_plan
from tests.rollout_service.test_refit_plan import pack
from weight_bus.ipc import iter_device_tensors

pytestmark = pytest.mark.unit


class Processed(QuantizeMethodBase):
    """A stand-in quantization: the served weight is the loaded one transposed, doubled and cast to bf16, with a
    per-column scale beside it (as MXFP8's weight + weight_scale)."""

    def __init__(self, drift: bool = False):
        self.drift, self.calls = drift, 0  # drift: processing that depends on how often it ran (never replayable)

    def create_weights(self, *args, **kwargs) -> None:
        pass

    def apply(self, layer, *args, **kwargs):
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        served = (layer.weight.t() * 2 + (self.calls if self.drift else 0)).to(torch.bfloat16).contiguous()
        layer.weight = nn.Parameter(served, requires_grad=False)
        layer.weight_scale = nn.Parameter(served.float().abs().amax(dim=1), requires_grad=False)


def fused_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int) -> None:
    """As QKVParallelLinear's: each shard's rows narrowed out of the fused parameter."""
    param.data.narrow(0, 4 * shard_id, loaded_weight.shape[0]).copy_(loaded_weight)


def computing_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int) -> None:
    param.data.narrow(0, 4 * shard_id, loaded_weight.shape[0]).copy_(loaded_weight * 2)


def cloning_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int) -> None:
    """As vLLM's GPU loaders that make a contiguous copy of the entry before copying it in."""
    fused_loader(param, loaded_weight.clone(), shard_id)


class Layer(nn.Module):
    def __init__(self, quant_method: QuantizeMethodBase | None, loader=fused_loader):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.weight.weight_loader = loader
        self.quant_method = quant_method


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.weight.weight_loader = default_weight_loader


class ToyModel(nn.Module):
    """Two processed layers (q/k fused) and an unprocessed norm, loaded by name as vLLM models do."""

    def __init__(self, drift: bool = False, loader=fused_loader):
        super().__init__()
        self.layers = nn.ModuleList([Layer(Processed(drift), loader) for _ in range(2)])
        self.norm = Norm()
        self.untouched = nn.Module()
        self.untouched.register_buffer("cache", torch.arange(6.0))  # a derived buffer no load writes

    def load_weights(self, weights) -> set[str]:
        for name, tensor in weights:
            if name == "norm.weight":
                self.norm.weight.weight_loader(self.norm.weight, tensor)
                continue
            index, part = name.split(".")[1], name.split(".")[2]
            param = self.layers[int(index)].weight
            param.weight_loader(param, tensor, 0 if part == "q" else 1)
        return set()


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    named = [(f"layers.{i}.{part}.weight", torch.randn(4, 4, generator=gen)) for i in range(2) for part in "qk"]
    return [*named, ("norm.weight", torch.randn(4, generator=gen))]


def served_model(drift: bool = False, loader=fused_loader) -> ToyModel:
    """A model as vLLM leaves it after its first load: checkpoint format recorded, then loaded and processed."""
    model = ToyModel(drift, loader)
    layerwise.record_metadata_for_reloading(model)
    model.load_weights(checkpoint(0))
    for layer in model.layers:
        layer.quant_method.process_weights_after_loading(layer)
    return model


def reload(model: nn.Module, manifest, buckets) -> None:
    """vLLM's reload_weights (checkpoint format) without the runner around it."""
    layerwise.initialize_layerwise_reload(model)
    model.load_weights(iter_device_tensors(manifest, buckets))
    layerwise.finalize_layerwise_reload(model, None)


def recorded(model: nn.Module, manifest, buckets):
    """What the worker does on a layout's first version: vLLM's reload with the recording on, then the check."""
    with layer_plan.recording(model, buckets, refit_plan.layout_key(manifest)) as record:
        reload(model, manifest, buckets)
    return layer_plan.accept(record, model, buckets)


def served_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_a_recorded_plan_replays_later_versions_as_vllms_reload_does_into_the_same_memory():
    manifest, buckets = pack(checkpoint(1))
    planned, reloaded = served_model(), served_model()
    plan = recorded(planned, manifest, buckets)
    assert isinstance(plan, layer_plan.LayeredPlan), plan
    assert [steps.name for steps in plan.layers] == ["layers.0", "layers.1", "norm"]
    assert [len(steps.copies()) for steps in plan.layers] == [2, 2, 1]
    assert plan.nbytes == (4 * 16 + 4) * 4
    memory = {name: t.data_ptr() for name, t in served_tensors(planned).items()}
    for seed in (2, 3):
        manifest, buckets = pack(checkpoint(seed))
        plan.replay(buckets)
        reload(reloaded, manifest, buckets)
        for name, tensor in served_tensors(reloaded).items():
            assert torch.equal(served_tensors(planned)[name], tensor), (seed, name)
    assert planned.layers[0].weight.dtype == torch.bfloat16 and planned.layers[0].weight.shape == (4, 8)
    # the served tensors stay where they were (CUDA graphs read them there)
    assert {name: t.data_ptr() for name, t in served_tensors(planned).items()} == memory
    assert plan.changed() == ""


def test_processing_that_does_not_repeat_itself_is_refused_at_the_check():
    manifest, buckets = pack(checkpoint(1))
    model = served_model(drift=True)
    refused = recorded(model, manifest, buckets)
    assert isinstance(refused, str) and "does not give vLLM's reloaded weight" in refused
    # the reload's bytes are what the model serves after the refused check
    reference = served_model(drift=True)
    reload(reference, manifest, buckets)
    assert torch.equal(model.layers[1].weight, reference.layers[1].weight)


def test_a_loader_that_copies_a_computed_tensor_is_refused_with_the_tensor_named():
    manifest, buckets = pack(checkpoint(1))
    refused = recorded(served_model(loader=computing_loader), manifest, buckets)
    assert isinstance(refused, str) and "layers.0.weight" in refused and "computed" in refused


def test_a_computed_copy_equal_to_two_entries_is_refused_as_they_cannot_be_told_apart():
    same = torch.randn(4, 4)
    named = [(name, same.clone() if ".0." in name else tensor) for name, tensor in checkpoint(1)]
    manifest, buckets = pack(named)
    refused = recorded(served_model(loader=cloning_loader), manifest, buckets)
    assert isinstance(refused, str) and "equal to 2 entries" in refused


def test_a_contiguous_copy_of_the_loaded_entry_is_replayed_from_the_entry_slice():
    manifest, buckets = pack(checkpoint(1))
    planned = served_model(loader=cloning_loader)
    plan = recorded(planned, manifest, buckets)
    assert isinstance(plan, layer_plan.LayeredPlan), plan
    manifest, buckets = pack(checkpoint(2))
    plan.replay(buckets)
    reference = served_model()
    reload(reference, manifest, buckets)
    assert torch.equal(planned.layers[0].weight, reference.layers[0].weight)


def test_a_reload_that_changes_a_tensor_outside_the_processed_layers_is_refused():
    manifest, buckets = pack(checkpoint(1))
    model = served_model()
    with layer_plan.recording(model, buckets, "layout") as record:
        reload(model, manifest, buckets)
        model.untouched.cache.add_(1)  # as a model's load_weights writing past the weight loaders
    refused = layer_plan.accept(record, model, buckets)
    assert isinstance(refused, str) and "untouched.cache" in refused


def test_a_served_tensor_of_another_shape_is_named_and_the_recording_leaves_vllm_as_it_was():
    manifest, buckets = pack(checkpoint(1))
    model = served_model()
    plan = recorded(model, manifest, buckets)
    assert layerwise._layerwise_process.__name__ == "_layerwise_process"
    assert "process_weights_after_loading" not in vars(model.layers[0].quant_method)
    model.layers[1].weight_scale = nn.Parameter(torch.zeros(3), requires_grad=False)
    assert plan.changed() == "layers.1.weight_scale"
