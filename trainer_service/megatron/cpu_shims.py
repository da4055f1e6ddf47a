"""Every workaround megatron-core 0.19.2 / megatron-bridge 0.6.2 need here: CPU-only torch, Python 3.11, no TE.

``apply()`` is idempotent and must run before ``megatron.core`` / ``megatron.bridge`` are imported;
``import_bridge()`` does both. Items 2-4 and 6 apply only when CUDA is absent; 1 and 5 fix the Python / package set
and apply wherever they are needed. The list mirrors shared/notes/stack.md ("Megatron on CPU"):

1. ``typing.override`` on Python < 3.12 (megatron-bridge uses it; it is new in 3.12).
2. ``torch.cuda.current_device()`` returns ``"cpu"`` (megatron-core uses it as the ``device=`` of RoPE
   frequencies, the MoE router's buffers and the DDP grad buffers), and ``torch.cuda.Stream`` /
   ``current_stream`` / ``stream`` are no-op stand-ins (megatron-bridge wraps DDP construction in a side stream).
3. The tensor-parallel RNG tracker keeps its named states on the CPU generator: ``DotProductAttention`` forks the
   tracker even with dropout 0, and the stock tracker reads and writes CUDA RNG state.
4. ``cuda_tensors_on_cpu()``: megatron-core's optimizer, grad-norm and schedule code create tensors with
   ``device='cuda'`` (overflow flags, unit loss scale, norm accumulators, token counters) and accept only
   parameters whose ``tensor.type()`` is ``'torch.cuda.FloatTensor'`` (or Half/BFloat16). Inside this context (a
   no-op with CUDA) a torch function mode creates those tensors on the CPU and reports CPU tensor types under
   their CUDA names; the backend enters it around optimizer construction and step, the forward/backward schedule
   and checkpoint I/O.
5. Without Transformer Engine installed (CPU or GPU): ``import megatron.bridge`` imports
   ``transformer_engine.pytorch`` in ``megatron.bridge.peft.lora_layers`` (LoRA, unused here). That one module
   gets a placeholder for the duration of its own import; the placeholder is removed again, so megatron-core's own
   ``import transformer_engine`` probes still fail and it keeps its non-TE paths.
6. megatron-core wraps small elementwise helpers in ``torch.compile`` (its ``jit_fuser``); on a CPU torch each
   new input shape then compiles C++ through inductor (3 s for the first call, ~1 s per new shape here). The
   helpers on the Beam path (the attention output gate, the expert-bias token count) run as the plain Python
   functions they wrap.

``undo()`` reverts the process-wide patches of items 2, 3 and 6 (the trainer process never needs it; the test
suite calls it after every module, tests/conftest.py, so that no other test runs with ``torch.cuda`` patched).
Items 1 and 5 stay: they only make megatron importable and change nothing for code that does not import it. A
later ``apply()`` installs the patches again.

Settings that are not shims (local layer spec, fp32, no grouped GEMM, allgather dispatcher, no fused permute,
explicit causal mask) live in ``trainer_service.megatron.model``, where the model is configured.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import typing

import torch
from torch.overrides import TorchFunctionMode

_IMPORT_FIXES_APPLIED = False
# (owner, attribute, original value) of every CPU patch in force, in the order they were made; undo() reverts them.
_PATCHES: list[tuple[object, str, object]] = []
# The bridge module that imports transformer_engine unconditionally, and the modules it imports after that line:
# they are imported first so that nothing else is loaded while the placeholder is visible.
_TE_IMPORTING_MODULE = "megatron.bridge.peft.lora_layers"
_TE_MODULE_DEPENDENCIES = (
    "megatron.core.transformer.moe.moe_utils",
    "megatron.bridge.peft.adapter_wrapper",
    "megatron.bridge.peft.lora_merge",
)


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    """Install the shims (idempotent). Call before importing megatron."""
    global _IMPORT_FIXES_APPLIED
    if not _IMPORT_FIXES_APPLIED:
        _IMPORT_FIXES_APPLIED = True
        if sys.version_info < (3, 12) and not hasattr(typing, "override"):
            import typing_extensions

            typing.override = typing_extensions.override
        if importlib.util.find_spec("transformer_engine") is None:
            sys.meta_path.insert(0, _TransformerEnginePlaceholderFinder())
    if _PATCHES or not cuda_absent():
        return
    _patch(torch.cuda, "current_device", _cpu_current_device)
    _patch(torch.cuda, "Stream", _NullStream)
    _patch(torch.cuda, "current_stream", _null_stream)
    _patch(torch.cuda, "stream", _null_stream_context)
    _patch_rng_tracker()
    _run_compiled_helpers_eagerly()


def applied() -> bool:
    """Whether the CPU patches (items 2, 3, 6) are in force."""
    return bool(_PATCHES)


def undo() -> None:
    """Revert the CPU patches (items 2, 3, 6) in reverse order; a no-op when none are in force."""
    while _PATCHES:
        owner, attribute, original = _PATCHES.pop()
        setattr(owner, attribute, original)


def _patch(owner: object, attribute: str, value: object) -> None:
    # Read from __dict__ where there is one, so that a class attribute (a staticmethod, say) comes back as itself.
    original = vars(owner)[attribute] if attribute in vars(owner) else getattr(owner, attribute)
    _PATCHES.append((owner, attribute, original))
    setattr(owner, attribute, value)


def import_bridge():
    """Apply the shims and import megatron.bridge; returns ``AutoBridge``."""
    apply()
    from megatron.bridge import AutoBridge

    return AutoBridge


def _cpu_current_device() -> str:
    return "cpu"


# -- 2b. CUDA streams as no-ops ---------------------------------------------------------------------------------


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: on CPU every op is synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _null_stream(device=None) -> _NullStream:
    return _NullStream()


def _null_stream_context(stream=None):
    return contextlib.nullcontext()


# -- 3. RNG tracker on the CPU generator -----------------------------------------------------------------------


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=-1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` with the CPU generator in place of the CUDA one."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    _patch(mp_random, "_get_cuda_rng_state", _cpu_get_rng_state)
    _patch(mp_random, "_set_cuda_rng_state", _cpu_set_rng_state)
    _patch(mp_random.CudaRNGStatesTracker, "add", _cpu_tracker_add)


# -- 4. device='cuda' tensors of the optimizer on the CPU -------------------------------------------------------


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda"
    )


class _CudaTensorsOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def cuda_tensors_on_cpu():
    """Context in which ``device='cuda'`` tensor creation lands on the CPU (a no-op when CUDA is present)."""
    if not cuda_absent():
        return contextlib.nullcontext()
    return _CudaTensorsOnCpu()


# -- 5. transformer_engine placeholder, visible only while megatron.bridge.peft.lora_layers is imported ---------


class _Anything(types.ModuleType):
    """A module whose every attribute is a placeholder class (LoRA's TE code paths are never called)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Anything(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} is a CPU placeholder for Transformer Engine; it cannot run")

    def __mro_entries__(self, bases):
        return (object,)

    def __instancecheck__(self, instance) -> bool:
        return False


@contextlib.contextmanager
def _placeholder_transformer_engine():
    names = ("transformer_engine", "transformer_engine.pytorch")
    saved = {name: sys.modules.get(name) for name in names}
    root = _Anything("transformer_engine")
    root.pytorch = _Anything("transformer_engine.pytorch")
    sys.modules.update({"transformer_engine": root, "transformer_engine.pytorch": root.pytorch})
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


class _PlaceholderWhileExecLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module) -> None:
        for dependency in _TE_MODULE_DEPENDENCIES:
            importlib.import_module(dependency)
        with _placeholder_transformer_engine():
            self.real.exec_module(module)


class _TransformerEnginePlaceholderFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TE_IMPORTING_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PlaceholderWhileExecLoader(spec.loader)
        return spec


# -- 6. torch.compile'd megatron-core helpers run eagerly ------------------------------------------------------

_COMPILED_HELPERS = (
    ("megatron.core.transformer.attention", "Attention", "_apply_output_gate"),
    ("megatron.core.transformer.moe.router", "TopKRouter", "_apply_expert_bias"),
)


def _run_compiled_helpers_eagerly() -> None:
    for module_name, class_name, attribute in _COMPILED_HELPERS:
        owner = getattr(importlib.import_module(module_name), class_name)
        helper = owner.__dict__[attribute]
        # torch.compile keeps the wrapped function here; absent if a version stops compiling the helper.
        _patch(owner, attribute, getattr(helper, "_torchdynamo_orig_callable", helper))
