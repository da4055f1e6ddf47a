"""The refit plan (rollout_service.refit_plan) on CPU: captured from vLLM-style loaders over packed buckets, checked
against a real load of the same version, replayed into the served parameters; and refused wherever a replay would
serve something other than what vLLM's own load serves."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from protos.records import WeightManifest
from rollout_service import refit_plan
from weight_bus import nccl_group as ng
from weight_bus import packing
from weight_bus.ipc import iter_device_tensors
from weight_bus.nccl_device import ChunkPacker

pytestmark = pytest.mark.unit


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


class TinyServedModel(nn.Module):
    """vLLM's layout in miniature: q and k fused into one parameter (narrowed copies, as QKVParallelLinear), an
    embedding padded past the vocabulary (rows beyond it never loaded), a norm through default_weight_loader."""

    def __init__(self, loader_transposes: bool = False):
        super().__init__()
        self.qk = _param(6, 4)
        self.embed = _param(8, 4)
        self.norm = _param(4)
        self.loader_transposes = loader_transposes

    def load_weights(self, weights) -> set[str]:
        for name, tensor in weights:
            if name in ("q.weight", "k.weight"):
                rows = (0, 4) if name == "q.weight" else (4, 2)
                self.qk.data.narrow(0, *rows).copy_(tensor.t().contiguous().t() if self.loader_transposes else tensor)
            elif name == "embed.weight":  # as VocabParallelEmbedding: the rows, then the padding zeroed
                self.embed.data[: tensor.shape[0]] = tensor
                self.embed.data[tensor.shape[0] :].fill_(0)
            else:
                default_weight_loader(self.norm, tensor)
        return {"qk", "embed", "norm"}


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q.weight": (4, 4), "k.weight": (2, 4), "embed.weight": (5, 4), "norm.weight": (4,)}
    return [(name, torch.randn(*shape, generator=gen)) for name, shape in shapes.items()]


def pack(named) -> tuple[WeightManifest, list[torch.Tensor]]:
    """The ipc publisher's packing, on the CPU: (manifest, uint8 buckets)."""
    entries, sizes = packing.plan_layout(packing.encoded_metas(named, packing.RAW), 64)
    buckets = [torch.empty(size, dtype=torch.uint8) for size in sizes]
    packer = ChunkPacker(named, packing.RAW, entries, torch.device("cpu"))
    for index, (size, bucket) in enumerate(zip(sizes, buckets, strict=True)):
        packer.pack(ng.Chunk(index, 0, size, 0), bucket)
    return WeightManifest(1, entries, sizes, "", "ipc", 0.0), buckets


def captured_and_checked(model: nn.Module, manifest, buckets, process=None) -> refit_plan.RefitPlan:
    """What the worker does on a layout's first version: capture, reload the safe way, check."""
    plan = refit_plan.capture(model, iter_device_tensors(manifest, buckets), buckets, refit_plan.layout_key(manifest))
    masks = refit_plan.written_masks(plan, model)
    before = refit_plan.parameter_digests(model, masks)
    model.load_weights(iter_device_tensors(manifest, buckets))  # the reload
    if process is not None:
        process(model)  # what a process_weights_after_loading would do
    refit_plan.check(plan, model, buckets, before, masks)
    return plan


def test_a_plan_records_one_slice_copy_per_tensor_into_its_parameter():
    manifest, buckets = pack(checkpoint(0))
    model = TinyServedModel()
    plan = refit_plan.capture(model, iter_device_tensors(manifest, buckets), buckets, refit_plan.layout_key(manifest))
    assert [(c.parameter, c.shape) for c in plan.copies] == [
        ("qk", (4, 4)),
        ("qk", (2, 4)),
        ("embed", (5, 4)),
        ("norm", (4,)),
    ]
    assert model.qk.abs().sum() == 0  # capturing wrote nothing
    assert plan.nbytes == (16 + 8 + 20 + 4) * 4
    assert [(f.parameter, tuple(f.target.shape), f.value) for f in plan.fills] == [("embed", (3, 4), 0.0)]


def test_replaying_the_plan_serves_the_same_bytes_as_the_loaders_for_every_later_version():
    manifest, buckets = pack(checkpoint(0))
    served = TinyServedModel()
    plan = captured_and_checked(served, manifest, buckets)
    for seed in (1, 2):
        later_manifest, later_buckets = pack(checkpoint(seed))
        assert refit_plan.layout_key(later_manifest) == plan.layout
        plan.replay(later_buckets)
        reference = TinyServedModel()
        reference.load_weights(checkpoint(seed))
        for (name, got), (_, want) in zip(served.named_parameters(), reference.named_parameters(), strict=True):
            assert torch.equal(got, want), name


def test_a_loader_that_copies_from_a_computed_tensor_of_other_values_is_refused_at_capture():
    class Scaling(TinyServedModel):
        def load_weights(self, weights):
            for name, tensor in weights:
                if name == "q.weight":
                    self.qk.data.narrow(0, 0, 4).copy_(tensor * 2)

    manifest, buckets = pack(checkpoint(0))
    with pytest.raises(refit_plan.PlanRefused, match=r"computed .*\(4, 4\) torch.float32.*while loading q.weight"):
        refit_plan.capture(Scaling(), iter_device_tensors(manifest, buckets), buckets, "layout")


def test_a_copy_from_a_contiguous_clone_of_the_loaded_entry_is_replayed_from_the_entry_slice():
    """vLLM's GPU loaders may hand over a copy of the entry with its values unchanged: the plan copies the slice."""
    manifest, buckets = pack(checkpoint(0))
    served = TinyServedModel(loader_transposes=True)
    plan = captured_and_checked(served, manifest, buckets)
    assert [(c.parameter, c.shape) for c in plan.copies[:2]] == [("qk", (4, 4)), ("qk", (2, 4))]
    later_manifest, later_buckets = pack(checkpoint(1))
    plan.replay(later_buckets)
    reference = TinyServedModel()
    reference.load_weights(checkpoint(1))
    assert all(torch.equal(a, b) for a, b in zip(served.parameters(), reference.parameters(), strict=True))


def test_a_copy_from_a_dtype_converted_entry_is_replayed_as_a_converting_copy():
    class HalfNorm(TinyServedModel):
        def __init__(self):
            super().__init__()
            self.norm = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)

        def load_weights(self, weights):
            for name, tensor in weights:
                if name == "norm.weight":
                    self.norm.data.copy_(tensor.to(torch.bfloat16))

    manifest, buckets = pack(checkpoint(0))
    served = HalfNorm()
    plan = captured_and_checked(served, manifest, buckets)
    assert [(c.parameter, c.dtype) for c in plan.copies] == [("norm", torch.float32)]  # fp32 slice, bf16 target
    plan.replay(pack(checkpoint(2))[1])
    assert torch.equal(served.norm, dict(checkpoint(2))["norm.weight"].to(torch.bfloat16))


def test_a_computed_copy_of_a_constant_entry_is_refused_as_a_reshuffle_cannot_be_told_apart():
    class Reversing(TinyServedModel):
        def load_weights(self, weights):
            for name, tensor in weights:
                if name == "norm.weight":
                    self.norm.data.copy_(tensor.flip(0))

    named = [(n, torch.ones_like(t) if n == "norm.weight" else t) for n, t in checkpoint(0)]
    manifest, buckets = pack(named)
    with pytest.raises(refit_plan.PlanRefused, match="computed"):
        refit_plan.capture(Reversing(), iter_device_tensors(manifest, buckets), buckets, "layout")


def test_a_loader_that_fails_in_any_way_leaves_a_reason_instead_of_an_exception():
    class Broken(TinyServedModel):
        def load_weights(self, weights):
            raise RuntimeError("CUDA out of memory")

    manifest, buckets = pack(checkpoint(0))
    reason = refit_plan.attempt(Broken(), iter_device_tensors(manifest, buckets), buckets, "layout")
    assert reason == "capturing failed with RuntimeError: CUDA out of memory"
    model = TinyServedModel()
    attempt = refit_plan.attempt(model, iter_device_tensors(manifest, buckets), buckets, "layout")
    assert isinstance(attempt, refit_plan.Attempt)
    model.load_weights(iter_device_tensors(manifest, buckets))
    # the check given no buckets to read the version from fails inside (an IndexError), not with a refusal
    assert refit_plan.accept(attempt, model, []).startswith("checking failed with IndexError")


def test_masks_are_kept_only_for_parameters_the_plan_writes_in_part():
    class PartlyLoaded(TinyServedModel):
        def load_weights(self, weights):  # k never comes: the rows of qk after q's stay as they are
            super().load_weights((n, t) for n, t in weights if n != "k.weight")

    manifest, buckets = pack(checkpoint(0))
    model = PartlyLoaded()
    plan = refit_plan.capture(model, iter_device_tensors(manifest, buckets), buckets, "layout")
    masks = refit_plan.written_masks(plan, model)
    assert masks["embed"] is None and masks["norm"] is None  # copies (and the padding's fill) cover them whole
    assert masks["qk"].tolist() == [[True] * 4] * 4 + [[False] * 4] * 2
    assert set(refit_plan.parameter_digests(model, masks)) == {"qk"}


def test_processing_after_the_load_that_changes_the_bytes_refuses_the_plan():
    manifest, buckets = pack(checkpoint(0))

    def scale_norm(model):
        model.norm.data.mul_(2.0)

    with pytest.raises(refit_plan.PlanRefused, match="norm"):
        captured_and_checked(TinyServedModel(), manifest, buckets, process=scale_norm)


def test_a_reload_that_writes_bytes_outside_the_plan_refuses_it():
    manifest, buckets = pack(checkpoint(0))

    def fill_padding(model):  # processing that writes the padded rows past the vocabulary with other than the zeros
        model.embed.data[5:] = 1.0

    with pytest.raises(refit_plan.PlanRefused, match="embed"):
        captured_and_checked(TinyServedModel(), manifest, buckets, process=fill_padding)


def test_an_in_place_change_of_a_parameter_other_than_a_copy_is_refused():
    class Filling(TinyServedModel):
        def load_weights(self, weights):
            super().load_weights(weights)
            self.norm.data.zero_()

    manifest, buckets = pack(checkpoint(0))
    with pytest.raises(refit_plan.PlanRefused, match="zero_"):
        refit_plan.capture(Filling(), iter_device_tensors(manifest, buckets), buckets, "layout")


def test_overlapping_copies_are_refused():
    class Overlapping(TinyServedModel):
        def load_weights(self, weights):
            for name, tensor in weights:
                if name == "q.weight":
                    self.qk.data.narrow(0, 0, 4).copy_(tensor)
                    self.qk.data.narrow(0, 2, 4).copy_(tensor)

    manifest, buckets = pack(checkpoint(0))
    with pytest.raises(refit_plan.PlanRefused, match="overlapping"):
        refit_plan.capture(Overlapping(), iter_device_tensors(manifest, buckets), buckets, "layout")


def test_the_layout_key_changes_with_any_entry():
    manifest, _ = pack(checkpoint(0))
    bigger, _ = pack(checkpoint(0) + [("extra.weight", torch.zeros(2))])
    assert refit_plan.layout_key(manifest) != refit_plan.layout_key(bigger)


def test_a_plan_whose_parameters_moved_to_new_memory_is_refused_and_no_longer_served():
    manifest, buckets = pack(checkpoint(0))
    model = TinyServedModel()
    plan = captured_and_checked(model, manifest, buckets)
    assert refit_plan.still_served(plan, model)

    def reallocate(model):  # a reload that hands the layer fresh parameters
        model.norm = nn.Parameter(model.norm.detach().clone(), requires_grad=False)

    assert not (reallocate(model) or refit_plan.still_served(plan, model))
    with pytest.raises(refit_plan.PlanRefused, match="moved norm"):
        captured_and_checked(TinyServedModel(), manifest, buckets, process=reallocate)
