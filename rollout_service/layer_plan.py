"""The refit plan for engines whose layers vLLM processes after loading (online MXFP8 or FP8; vLLM's CPU kernels),
run in the vLLM worker.

Why: such an engine cannot take a version by plain copies (rollout_service/refit_plan.py): what it serves is
computed from the loaded weights (quantized, Marlin-repacked, prepacked). vLLM's layerwise reload does it per update:
every checkpoint tensor through the model's Python loaders (per expert for a MoE layer), each layer moved to the meta
device and materialized back, processed, and its results copied into the tensors the CUDA graphs read. On the 0.94 B
demo model served in online MXFP8 that is 0.36-0.62 s per update on an H100, most of it Python around ~1,800 loader
calls; the processing is a few whole-layer kernels (rollout_service/mxfp8_batched.py).

The loaders do the same every version: copies of bucket slices into slices of each layer's checkpoint-format
tensors. So, per manifest layout:

1. ``recording``: around vLLM's reload of the layout's first version, each layer's loader copies are recorded (the
   reload runs as usual: vLLM's ``_layerwise_process`` is wrapped to know the layer, and the layer's
   ``process_weights_after_loading`` to know when its loaders are done). A copy a replay could not reproduce, an
   attention layer that loads weights (vLLM finalizes those another way) or any other in-place change of a layer's
   tensor while it loads refuses the plan with the reason.
2. ``accept``: right after that reload, every layer is replayed into its served tensors (scribbled over first) and
   must give the reloaded bytes exactly; every tensor of a layer the plan does not write must hold what it held
   before the reload.
3. ``replay``: per layer, vLLM's own restore-to-meta and materialize, one batched copy of the recorded slices from this
   version's buckets, the layer's ``process_weights_after_loading`` and vLLM's copy back into the served tensors: the
   reload's steps for the layer without the loaders.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from rollout_service.bucket_slices import BucketSlice, PlanRefused, bucket_views, locate
from rollout_service.refit_plan import bits, same_values_as


@dataclass(frozen=True)
class LayerWrite:
    """One recorded write into a layer's checkpoint-format tensor ``tensor``: a strided view of it (offset in its
    elements) gets ``source`` (a bucket slice) or, without a source, the constant ``value``."""

    tensor: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    source: BucketSlice | None = None
    value: float = 0.0

    def target(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        base = tensors[self.tensor]
        return base.as_strided(self.shape, self.stride, base.storage_offset() + self.offset)


@dataclass
class LayerSteps:
    """What a replay does for one layer: its writes, then vLLM's processing and copy back."""

    name: str
    layer: torch.nn.Module
    writes: list[LayerWrite]
    loaded: tuple[str, ...]  # the tensors its loaders wrote (vLLM's copy back reads them for non-persistent buffers)
    served: dict[str, tuple] = field(default_factory=dict)  # served tensor -> (shape, dtype) when accepted

    def copies(self) -> list[LayerWrite]:
        return [write for write in self.writes if write.source is not None]


@dataclass
class LayeredPlan:
    layout: str
    layers: list[LayerSteps]
    nbytes: int = 0  # bytes copied from the buckets per replay

    def replay(self, buckets: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for steps in self.layers:
                replay_layer(steps, bucket_views([w.source for w in steps.copies()], buckets))

    def changed(self) -> str:
        """'' while every layer serves tensors of the names, shapes and dtypes it was accepted with (checked per
        update), else the first that changed. Their memory may move (vLLM's CPU MoE prepack makes new tensors after
        every load): a replay copies into whatever the layer serves when it starts, as vLLM's reload does."""
        for steps in self.layers:
            now = _signature(steps.layer)
            for name, signature in steps.served.items():
                if now.get(name) != signature:
                    return f"{steps.name}.{name}"
        return ""


def _reload_parts():
    from vllm.model_executor.model_loader.reload import layerwise, meta, utils

    return layerwise, meta, utils


def replay_layer(steps: LayerSteps, sources: list[torch.Tensor]) -> None:
    """vLLM's reload of one layer (``_layerwise_process`` after ``initialize_layerwise_reload``), the loaders replaced
    by the recorded writes."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    layerwise, meta, utils = _reload_parts()
    layer = steps.layer
    info = layerwise.get_layerwise_info(layer)
    info.kernel_tensors = utils.get_layer_params_buffers(layer)
    info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
    meta.restore_layer_on_meta(layer, info)
    try:
        meta.materialize_layer(layer, info)
        if hasattr(layer, "_already_called_process_weights_after_loading"):
            delattr(layer, "_already_called_process_weights_after_loading")
        tensors = utils.get_layer_tensors(layer)
        copies = steps.copies()
        if copies:
            torch._foreach_copy_([write.target(tensors) for write in copies], sources)
        for write in steps.writes:
            if write.source is None:
                write.target(tensors).fill_(write.value)
        info.loaded_weights = [(name, None) for name in steps.loaded]
        quant_method = getattr(layer, "quant_method", None)
        if isinstance(quant_method, QuantizeMethodBase):
            quant_method.process_weights_after_loading(layer)
            if hasattr(layer, "update_param_tp_status"):
                layer.update_param_tp_status()
        layerwise._copy_and_restore_kernel_tensors(layer, info)
    except BaseException:
        # the served tensors back on the layer (maybe half written): the failure propagates, the layer stays usable
        layerwise._place_kernel_tensors(layer, info)
        raise
    finally:
        info.reset()


class _LoaderWrites(TorchFunctionMode):
    """Active while one layer's loaders run inside vLLM's reload: every call is made as usual, and the writes into the
    layer's (materialized) tensors are recorded until its processing starts (``loading`` turns False)."""

    def __init__(self, layer: torch.nn.Module, entries: list[torch.Tensor], buckets: list[torch.Tensor], name: str):
        super().__init__()
        self.layer, self.entries, self.buckets, self.name = layer, entries, buckets, name
        self.writes: list[LayerWrite] = []
        self.refused = ""
        self.loading = True

    def _tensor_of(self, tensor) -> tuple[str, torch.Tensor] | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return None
        storage = tensor.untyped_storage().data_ptr()
        _, _, utils = _reload_parts()
        for name, own in utils.get_layer_tensors(self.layer).items():
            if own.device.type != "meta" and own.untyped_storage().data_ptr() == storage:
                return name, own
        return None

    def _write(self, name: str, own: torch.Tensor, target: torch.Tensor, source=None, value: float = 0.0) -> None:
        offset = target.storage_offset() - own.storage_offset()
        shape, stride = tuple(target.shape), tuple(target.stride())
        self.writes.append(LayerWrite(name, shape, stride, offset, self._source(name, target, source), value))

    def _source(self, name: str, target: torch.Tensor, source) -> BucketSlice | None:
        if source is None:
            return None
        what = f"{self.name}.{name}"
        if not isinstance(source, torch.Tensor) or tuple(source.shape) != tuple(target.shape):
            raise PlanRefused(f"a copy into {what} that is not a same-shape tensor copy")
        found = locate(source, self.buckets, what)
        if found is None:
            # a loader's contiguous or dtype-converted copy of an entry: replayed from the entry's slice, when exactly
            # one entry of the layer holds those values (two equal entries could not be told apart next version)
            matches = {locate(view, self.buckets, what) for view in self._equal_entries(source)} - {None}
            if len(matches) > 1:
                raise PlanRefused(f"a copy into {what} from a computed tensor equal to {len(matches)} entries")
            found = next(iter(matches), None)
        if found is None:
            raise PlanRefused(f"a copy into {what} from a tensor the loader computed (not a slice of the buckets)")
        return found

    def _equal_entries(self, source: torch.Tensor) -> list[torch.Tensor]:
        views = (same_values_as(source, entry) for entry in self.entries)
        return [view for view in views if view is not None]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.loading and not self.refused and name.endswith("_") and args:
            try:
                self._record(name, args)
            except PlanRefused as error:
                self.refused = str(error)
        return func(*args, **kwargs)

    def _record(self, name: str, args) -> None:
        owned = self._tensor_of(args[0])
        if owned is None:
            return
        tensor, own = owned
        if name == "copy_":
            self._write(tensor, own, args[0], source=args[1])
        elif name == "__setitem__":
            target = args[0][args[1]]
            if target.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr():
                raise PlanRefused(f"an indexed assignment into {self.name}.{tensor} that is not a view copy")
            if isinstance(args[2], torch.Tensor):
                self._write(tensor, own, target, source=args[2].expand_as(target))
            else:
                self._write(tensor, own, target, value=float(args[2]))
        elif name == "fill_" and isinstance(args[1], (int, float)):
            self._write(tensor, own, args[0], value=float(args[1]))
        elif name == "zero_":
            self._write(tensor, own, args[0], value=0.0)
        elif not name.startswith("__"):
            raise PlanRefused(f"the loader calls {name} on {self.name}.{tensor}")


@dataclass
class Recording:
    """The layers' recorded steps during one reload, or why no plan can come of it."""

    layout: str
    layers: list[LayerSteps] = field(default_factory=list)
    refused: str = ""
    before: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # tensor digests before the reload


@contextmanager
def recording(model: torch.nn.Module, buckets: list[torch.Tensor], layout: str) -> Iterator[Recording]:
    """Record the layers' loader writes during the vLLM reload run inside the block (module docstring, step 1)."""
    layerwise, _, _ = _reload_parts()
    names = {module: name for name, module in model.named_modules()}
    record = Recording(layout, before=tensor_digests(model))
    process_layer, finalize_attention = layerwise._layerwise_process, layerwise._finalize_attention_layer

    def recorded_process(layer, info):
        loaded = tuple(name for name, _ in info.loaded_weights)
        entries = [
            value
            for _, arguments in info.loaded_weights
            for key, value in arguments.arguments.items()
            if key != "param" and isinstance(value, torch.Tensor)
        ]
        writes = _LoaderWrites(layer, entries, buckets, names.get(layer, type(layer).__name__))
        with _loading_ends_at_processing(layer, writes), writes:
            process_layer(layer, info)
        if writes.refused and not record.refused:
            record.refused = writes.refused
        record.layers.append(LayerSteps(writes.name, layer, writes.writes, loaded))

    def watched_attention(layer, info, *args, **kwargs):
        if info.load_numel > 0 and not record.refused:
            record.refused = f"{names.get(layer, type(layer).__name__)}: an attention layer that loads weights"
        return finalize_attention(layer, info, *args, **kwargs)

    layerwise._layerwise_process, layerwise._finalize_attention_layer = recorded_process, watched_attention
    try:
        yield record
    finally:
        layerwise._layerwise_process, layerwise._finalize_attention_layer = process_layer, finalize_attention


@contextmanager
def _loading_ends_at_processing(layer: torch.nn.Module, writes: _LoaderWrites) -> Iterator[None]:
    quant_method = getattr(layer, "quant_method", None)
    process = getattr(quant_method, "process_weights_after_loading", None)
    if process is None:
        yield
        return
    own = "process_weights_after_loading" in vars(quant_method)

    def processing(*args, **kwargs):
        writes.loading = False
        return process(*args, **kwargs)

    quant_method.process_weights_after_loading = processing
    try:
        yield
    finally:
        if own:
            quant_method.process_weights_after_loading = process
        else:
            del quant_method.process_weights_after_loading


def _signature(layer: torch.nn.Module) -> dict[str, tuple]:
    _, _, utils = _reload_parts()
    return {name: (tuple(t.shape), t.dtype) for name, t in utils.get_layer_tensors(layer).items()}


def tensor_digests(model: torch.nn.Module) -> dict[tuple[str, str], tuple[int, int]]:
    """Per (module, tensor) two byte sums (all bytes; every other byte): equal before and after a reload that did
    not touch the tensor."""
    digests = {}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is None or tensor.device.type == "meta" or not tensor.numel():
                    continue
                raw = bits(tensor.detach())
                digests[(module_name, name)] = (int(raw.sum(dtype=torch.int64)), int(raw[::2].sum(dtype=torch.int64)))
    return digests


def accept(record: Recording, model: torch.nn.Module, buckets: list[torch.Tensor]) -> LayeredPlan | str:
    """The recorded plan once it reproduces the reload just made of the same version (module docstring, step 2); else
    why not. Any failure leaves the engine on vLLM's reload (a plan is an optimization)."""
    try:
        return _checked(record, model, buckets)
    except PlanRefused as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - see the docstring
        return f"checking failed with {type(error).__name__}: {error}"


def _checked(record: Recording, model: torch.nn.Module, buckets: list[torch.Tensor]) -> LayeredPlan:
    if record.refused:
        raise PlanRefused(record.refused)
    if not record.layers:
        raise PlanRefused("the reload processed no layer")
    planned = {steps.name for steps in record.layers}
    if len(planned) != len(record.layers):
        raise PlanRefused("a layer was processed twice in one reload")
    after = tensor_digests(model)
    changed = [key for key, digest in record.before.items() if key[0] not in planned and after.get(key) != digest]
    if changed:
        raise PlanRefused(f"the reload changed {'.'.join(changed[0])} outside the layers it processed")
    for steps in record.layers:
        _check_layer(steps, buckets)
        steps.served = _signature(steps.layer)
    nbytes = sum(int(torch.Size(w.shape).numel()) * w.source.dtype.itemsize for s in record.layers for w in s.copies())
    return LayeredPlan(record.layout, record.layers, nbytes)


def _check_layer(steps: LayerSteps, buckets: list[torch.Tensor]) -> None:
    """Replay one layer into its scribbled-over served tensors: each must come back as the reload left it."""
    _, _, utils = _reload_parts()
    served = utils.get_layer_tensors(steps.layer)
    reloaded = {name: tensor.detach().clone() for name, tensor in served.items()}
    with torch.no_grad():
        try:
            for tensor in served.values():
                _scribble_bytes(tensor)
            replay_layer(steps, bucket_views([w.source for w in steps.copies()], buckets))
            now = utils.get_layer_tensors(steps.layer)
            differing = [name for name in reloaded if not torch.equal(bits(now[name]), bits(reloaded[name]))]
        finally:
            for name, tensor in utils.get_layer_tensors(steps.layer).items():
                tensor.detach().copy_(reloaded[name])
    if differing:
        raise PlanRefused(f"replaying {steps.name} does not give vLLM's reloaded {differing[0]}")


def _scribble_bytes(tensor: torch.Tensor) -> None:
    data = tensor.detach()
    if data.is_contiguous():
        data.view(-1).view(torch.uint8).fill_(0xA5)
    elif data.is_floating_point():
        data.fill_(float("nan"))
    else:
        data.fill_(-1)
