"""The refit plan: every copy vLLM's loaders make from a version's buckets into the served parameters, captured once
and replayed as one batched device copy per later version (runs inside the vLLM worker).

Why: vLLM's ``reload_weights`` (checkpoint format) runs every tensor through its model's Python loaders, moves each
layer to the meta device and back and re-runs ``process_weights_after_loading``: ~0.5 s for 1.9 GB on an H200 whose
device copy of the same bytes takes ~1 ms. For an unquantized model whose processing leaves the loaded layout as it
is, an update is only copies of bucket slices into parameter slices, and those are the same every version.

1. ``capture``: run the model's own ``load_weights`` over views of the buckets with copies recorded instead of made
   (a torch function mode). Anything a plan could not replay ends the capture with a reason: a copy from something
   that is not a bucket slice (a loader that transposes into a temporary, a dequantized pair), into something that is
   not a parameter, of another shape, overlapping writes, any other in-place change of a parameter.
2. ``check``: the caller then loads the same version the safe way (vLLM's reload); the plan is accepted only if it
   reproduces that exactly: replaying it into scribbled-over targets gives the reloaded bytes bit for bit, and every
   parameter byte the plan does not write is what it was before the reload (nothing written some other way).
3. ``replay``: bind the recorded slices to a later version's buckets (same manifest layout) and copy them with
   ``torch._foreach_copy_``.

Plans are keyed by the manifest's layout (names, dtypes, shapes, bucket offsets): a new layout is captured anew.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from rollout_service.bucket_slices import PlanRefused, bucket_views, locate


@dataclass(frozen=True)
class SliceCopy:
    """One recorded copy: ``target`` (a view of a served parameter) <- a slice of bucket ``bucket``."""

    target: torch.Tensor
    parameter: str
    bucket: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    element_offset: int  # from the bucket's first byte, in elements of ``dtype``


@dataclass(frozen=True)
class ConstantFill:
    """A recorded ``fill_`` of a parameter slice with a constant (vLLM zeroes an embedding's padded rows)."""

    target: torch.Tensor
    parameter: str
    value: float


@dataclass
class RefitPlan:
    layout: str
    copies: list[SliceCopy]
    nbytes: int = 0  # bytes copied per replay
    fills: tuple[ConstantFill, ...] = ()

    def sources(self, buckets: list[torch.Tensor]) -> list[torch.Tensor]:
        """The copies' sources as views of ``buckets`` (uint8, one per manifest bucket). Bound anew per version:
        each comes in fresh memory (a new staging map, new IPC allocations), and a kept view would keep it mapped."""
        return bucket_views(self.copies, buckets)

    def replay(self, buckets: list[torch.Tensor]) -> None:
        with torch.no_grad():
            torch._foreach_copy_([copy.target for copy in self.copies], self.sources(buckets))
            for fill in self.fills:  # disjoint from every copy (refused otherwise), so the order does not matter
                fill.target.fill_(fill.value)

    def writes(self) -> list[SliceCopy | ConstantFill]:
        return [*self.copies, *self.fills]


def layout_key(manifest) -> str:
    """What makes two versions' buckets interchangeable for one plan."""
    digest = hashlib.sha256()
    for entry in manifest.tensors:
        digest.update(f"{entry.name}|{entry.dtype}|{entry.shape}|{entry.codec}|{entry.bucket}|{entry.offset};".encode())
    digest.update(str(manifest.bucket_nbytes).encode())
    return digest.hexdigest()


class _RecordCopies(TorchFunctionMode):
    """Records ``copy_`` into parameters instead of copying; refuses what a replay could not reproduce.

    Each copy is resolved to a bucket slice when it is made (no loader temporary is kept alive), with the entry the
    loaders are loading at that moment (``loading[0]``) as the fallback source of a copy from a computed tensor."""

    def __init__(self, parameter_storages: dict[int, str], buckets: list[torch.Tensor], loading: list):
        super().__init__()
        self.parameter_storages = parameter_storages
        self.buckets, self.loading = buckets, loading
        self.copies: list[SliceCopy] = []
        self.fills: list[ConstantFill] = []

    def _parameter_of(self, tensor) -> str | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        return self.parameter_storages.get(tensor.untyped_storage().data_ptr())

    def _record(self, target: torch.Tensor, source, parameter: str) -> None:
        # (the mode is off inside its own handler: the checks' tensor calls are not recorded)
        self.copies.append(_slice_copy(target, source, parameter, self.buckets, self.loading[0]))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "copy_" and self._parameter_of(args[0]) is not None:
            self._record(args[0], args[1], self._parameter_of(args[0]))
            return args[0]
        if name == "__setitem__" and self._parameter_of(args[0]) is not None:
            target = args[0][args[1]]
            if not isinstance(args[2], torch.Tensor) or target.untyped_storage().data_ptr() != (
                args[0].untyped_storage().data_ptr()
            ):
                raise PlanRefused(f"an indexed assignment into {self._parameter_of(args[0])} that is not a view copy")
            self._record(target, args[2], self._parameter_of(args[0]))
            return None
        if name == "fill_" and self._parameter_of(args[0]) is not None and isinstance(args[1], (int, float)):
            self.fills.append(ConstantFill(args[0], self._parameter_of(args[0]), float(args[1])))
            return args[0]
        if name.endswith("_") and not name.startswith("__") and self._parameter_of(args[0] if args else None):
            raise PlanRefused(f"the loader calls {name} on parameter {self._parameter_of(args[0])}")
        return func(*args, **kwargs)


def capture(model: torch.nn.Module, weights, buckets: list[torch.Tensor], layout: str) -> RefitPlan:
    """Run ``model.load_weights(weights)`` recording its copies (nothing is written); ``weights`` yields views of
    ``buckets``. Raises PlanRefused when a copy cannot be replayed from the buckets."""
    parameter_storages = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
    for name, parameter in model.named_parameters():
        loader = getattr(parameter, "weight_loader", None)
        if getattr(loader, "__name__", "") == "online_process_loader":  # vLLM's layerwise reload left in place
            raise PlanRefused(f"{name} still has vLLM's deferred (online-processing) loader")
    loading: list = [None]  # (name, view) of the entry the loaders are at

    def tracked():
        for name, tensor in weights:
            loading[0] = (name, tensor)
            yield name, tensor

    recorder = _RecordCopies(parameter_storages, buckets, loading)
    with torch.no_grad(), recorder:
        model.load_weights(tracked())
    copies = recorder.copies
    if not copies:
        raise PlanRefused("the loaders made no copy into a parameter")
    _refuse_overlaps([*copies, *recorder.fills])
    nbytes = sum(c.target.numel() * c.target.element_size() for c in copies)
    return RefitPlan(layout, copies, nbytes, tuple(recorder.fills))


def _slice_copy(target: torch.Tensor, source, parameter: str, buckets: list[torch.Tensor], loading=None) -> SliceCopy:
    if not isinstance(source, torch.Tensor):
        raise PlanRefused(f"a copy into {parameter} from {type(source).__name__}, not a tensor")
    if tuple(target.shape) != tuple(source.shape):
        raise PlanRefused(f"a copy into {parameter} of shape {tuple(target.shape)} from {tuple(source.shape)}")
    if source.device != target.device and target.device.type != "cpu" and source.device.type != "cpu":
        raise PlanRefused(f"a copy into {parameter} across devices {source.device} -> {target.device}")
    found = _bucket_slice(target, source, parameter, buckets)
    if found is None and loading is not None:
        # A loader that hands over a computed tensor whose values are the loaded entry's own (vLLM's GPU loaders
        # make contiguous or dtype-converted copies): copy from the entry's slice instead; copy_ converts alike,
        # and the check against vLLM's reload proves the replay gives the same bytes.
        view = same_values_as(source, loading[1])
        found = None if view is None else _bucket_slice(target, view, parameter, buckets)
    if found is None:
        entry = f"while loading {loading[0]} {tuple(loading[1].shape)} {loading[1].dtype}" if loading else ""
        raise PlanRefused(
            f"a copy into {parameter} from a tensor the loader computed (not a slice of the buckets): "
            f"{tuple(source.shape)} {source.dtype} on {source.device}, contiguous={source.is_contiguous()} {entry}"
        )
    return found


def _bucket_slice(target: torch.Tensor, source: torch.Tensor, parameter: str, buckets) -> SliceCopy | None:
    found = locate(source, buckets, parameter)
    if found is None:
        return None
    return SliceCopy(target, parameter, found.bucket, found.dtype, found.shape, found.stride, found.element_offset)


def same_values_as(source: torch.Tensor, view) -> torch.Tensor | None:
    """``view`` (or its leading rows, as a vocabulary shard narrows) when ``source`` holds exactly its values, maybe
    converted to ``source``'s dtype; None otherwise. A constant view proves nothing (any reshuffle of it looks the
    same), so it never matches."""
    if not isinstance(view, torch.Tensor) or view.device != source.device or view.numel() == 0:
        return None
    if tuple(view.shape) != tuple(source.shape):
        if view.dim() != source.dim() or view.dim() == 0 or tuple(view.shape[1:]) != tuple(source.shape[1:]):
            return None
        if source.shape[0] > view.shape[0]:
            return None
        view = view.narrow(0, 0, source.shape[0])
    flat = view.reshape(-1)
    if not bool((flat != flat[0]).any()):
        return None
    converted = view if view.dtype == source.dtype else view.to(source.dtype)
    return view if torch.equal(bits(converted), bits(source)) else None


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 0)
    start = tensor.data_ptr()
    return start, start + (span + 1) * tensor.element_size() if tensor.numel() else start


def _refuse_overlaps(copies: list[SliceCopy | ConstantFill]) -> None:
    """A batched copy writes in any order: two copies into the same bytes would race."""
    extents = sorted((*_extent(c.target), c.parameter) for c in copies if c.target.numel())
    for (_, end, name), (start, _, other) in zip(extents, extents[1:], strict=False):
        if start < end:
            raise PlanRefused(f"two copies write overlapping bytes ({name}, {other})")


def parameter_digests(model: torch.nn.Module, masks: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """fp64 sum of each parameter (of its bytes outside ``masks[name]`` where given; none of a parameter the plan
    writes whole, ``masks[name] is None``): equal before and after a reload when the reload did not touch them."""
    digests = {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            values = parameter.detach()
            if masks is not None and name in masks:
                if masks[name] is None:
                    continue
                values = values[~masks[name]]
            # sum(dtype=) widens inside the kernel: no fp64 copy of a large expert tensor
            digests[name] = float(values.sum(dtype=torch.float64)) if values.numel() else 0.0
    return digests


def written_masks(plan: RefitPlan, model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Per parameter the plan writes: None where its copies cover it whole (the usual case: no memory spent), else
    a bool mask, True where one of its copies lands (writes never overlap: refused at capture)."""
    parameters = dict(model.named_parameters())
    written: dict[str, int] = {}
    for copy in plan.writes():
        written[copy.parameter] = written.get(copy.parameter, 0) + copy.target.numel()
    masks: dict[str, torch.Tensor | None] = {
        name: None for name, count in written.items() if count == parameters[name].numel()
    }
    for copy in plan.writes():
        _refuse_outside(copy, parameters[copy.parameter])
    for copy in plan.writes():
        if copy.parameter in masks and masks[copy.parameter] is None:
            continue
        parameter = parameters[copy.parameter]
        _refuse_outside(copy, parameter)
        mask = masks.get(copy.parameter)
        if mask is None:
            mask = masks[copy.parameter] = torch.zeros(parameter.shape, dtype=torch.bool, device=parameter.device)
        offset = (copy.target.data_ptr() - parameter.data_ptr()) // parameter.element_size()
        if copy.target.numel():
            mask.as_strided(copy.target.shape, copy.target.stride(), mask.storage_offset() + offset).fill_(True)
    return masks


def _refuse_outside(copy: SliceCopy | ConstantFill, parameter: torch.Tensor) -> None:
    """A write recorded for ``parameter`` (by its storage) must land inside it: two parameters sharing one storage
    would otherwise be told apart wrongly."""
    if not copy.target.numel():
        return
    start, end = _extent(copy.target)
    first = parameter.data_ptr()
    if start < first or end > first + parameter.numel() * parameter.element_size():
        raise PlanRefused(f"a write into {copy.parameter}'s storage that lands outside the parameter")


def check(plan: RefitPlan, model: torch.nn.Module, buckets, before: dict[str, float], masks) -> None:
    """Raise PlanRefused unless replaying ``plan`` reproduces the reload the caller just made of the same version.

    ``before``: ``parameter_digests(model, masks)`` taken before that reload (the bytes the plan does not write)."""
    after = parameter_digests(model, masks)
    changed = [name for name in before if before[name] != after.get(name)]
    if changed:
        raise PlanRefused(f"the reload wrote {changed[:3]} (outside the plan's copies) some other way")
    parameters = dict(model.named_parameters())
    moved = [c.parameter for c in plan.writes() if c.target.untyped_storage().data_ptr() != _storage(parameters, c)]
    if moved:  # the reload gave the parameter new memory: the recorded targets are no longer what is served
        raise PlanRefused(f"the reload moved {moved[0]} to new memory")
    sources = plan.sources(buckets)
    by_parameter: dict[str, list[int]] = {}
    for index, copy in enumerate(plan.copies):
        by_parameter.setdefault(copy.parameter, []).append(index)
    fills_of: dict[str, list[ConstantFill]] = {}
    for fill in plan.fills:
        fills_of.setdefault(fill.parameter, []).append(fill)
        by_parameter.setdefault(fill.parameter, [])
    with torch.no_grad():
        for name, indices in by_parameter.items():
            parameter = parameters[name].detach()
            reloaded = parameter.clone()
            try:
                for write in [*(plan.copies[i] for i in indices), *fills_of.get(name, ())]:
                    _scribble(write.target)
                if indices:
                    torch._foreach_copy_([plan.copies[i].target for i in indices], [sources[i] for i in indices])
                for fill in fills_of.get(name, ()):
                    fill.target.fill_(fill.value)
                same = torch.equal(bits(parameter), bits(reloaded))
            finally:
                parameter.copy_(reloaded)
            if not same:
                raise PlanRefused(f"replaying the plan into {name} does not give vLLM's reloaded bytes")


def _storage(parameters: dict[str, torch.Tensor], copy: SliceCopy | ConstantFill) -> int:
    parameter = parameters.get(copy.parameter)
    return -1 if parameter is None else parameter.untyped_storage().data_ptr()


def still_served(plan: RefitPlan, model: torch.nn.Module) -> bool:
    """Whether every parameter the plan writes is still in the memory it was captured in (checked per update)."""
    parameters = dict(model.named_parameters())
    return all(copy.target.untyped_storage().data_ptr() == _storage(parameters, copy) for copy in plan.writes())


def _scribble(target: torch.Tensor) -> None:
    target.fill_(float("nan") if target.is_floating_point() else -1)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


@dataclass
class Attempt:
    """A plan captured on a layout's first version, waiting for vLLM's reload of that version to be checked against."""

    plan: RefitPlan
    masks: dict[str, torch.Tensor | None]
    before: dict[str, float]


def attempt(model: torch.nn.Module, weights, buckets: list[torch.Tensor], layout: str) -> Attempt | str:
    """Capture a plan and take the digests its check needs; on any failure the reason (a plan is an optimization:
    whatever goes wrong in it must leave the engine loading the safe way, never fail the update)."""
    try:
        plan = capture(model, weights, buckets, layout)
        masks = written_masks(plan, model)
        return Attempt(plan, masks, parameter_digests(model, masks))
    except PlanRefused as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 -- see the docstring
        return f"capturing failed with {type(error).__name__}: {error}"


def accept(attempt: Attempt, model: torch.nn.Module, buckets: list[torch.Tensor]) -> RefitPlan | str:
    """``attempt``'s plan once it reproduces the reload the caller just made of the same version; else why not."""
    try:
        check(attempt.plan, model, buckets, attempt.before, attempt.masks)
        return attempt.plan
    except PlanRefused as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 -- as in attempt()
        return f"checking failed with {type(error).__name__}: {error}"
