"""Methods injected into every vLLM worker (``worker_extension_cls``), run via ``collective_rpc``.

Tensors cannot travel as ``collective_rpc`` arguments (they do not pickle on CPU), so the server stages
received weights in a shared-memory file and passes its path plus the manifest; the worker maps the file
and feeds views of it to vLLM's layerwise ``reload_weights``, which shards, fuses and repacks in place.

MXFP8 manifests: an engine serving an unquantized model gets each (q, scale) pair dequantized to its
own dtype here, one tensor at a time (weight_bus.receive_mode 'dequantize'); an engine serving an MXFP8
checkpoint gets the pairs as they are, in vLLM's checkpoint names ``x.weight`` + ``x.weight_scale``
(receive_mode 'mxfp8', GPU only).
"""

from __future__ import annotations

import logging
import mmap
import os

from rollout_service import mxfp8_batched
from rollout_service.kernel_scratch import kept_across_reload
from rollout_service.load_watchdog import profiled_load, stacks_if_slow
from rollout_service.reload_notices import quiet_derived_buffer_warnings

# vLLM imports this module in each worker before it loads the model, so the MXFP8 experts' processing is batched from
# the first load on (each replacement checks itself against vLLM's loop on its first call).
mxfp8_batched.install()

log = logging.getLogger(__name__)


class WeightLoaderExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's model runner."""

    def fleetrl_load_staged_weights(
        self, staging_path: str, manifest_bytes: bytes, use_plan: bool = True, stacks_after_s: float = 0.0
    ) -> int:
        """Load every tensor listed in the manifest from the staging file; returns the count loaded. A load running
        past ``stacks_after_s`` prints this worker's stacks (rollout_service.load_watchdog)."""
        import torch

        from protos.records import decode_manifest

        manifest = decode_manifest(manifest_bytes)
        fd = os.open(staging_path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            # A private copy-on-write map: writable views for torch, nothing written back to the file.
            buffer = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else bytearray()
        finally:
            os.close(fd)
        flat = torch.frombuffer(buffer, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        starts = [0]
        for nbytes in manifest.bucket_nbytes:
            starts.append(starts[-1] + nbytes)
        buckets = [flat[start:end] for start, end in zip(starts, starts[1:], strict=False)]
        with stacks_if_slow(stacks_after_s):
            loaded = self._fleetrl_load(manifest, buckets, use_plan)
            self._prepack_cpu_moe_experts()
        return loaded

    def fleetrl_ipc_unopenable_reason(self, record_bytes: bytes) -> str:
        """'' when this worker can open the trainer's IPC buckets (same GPU, another process), else why not."""
        from protos.records import decode_ipc_version
        from weight_bus.ipc import why_not_openable

        return why_not_openable(decode_ipc_version(record_bytes), self.model_runner.device)

    def fleetrl_load_ipc_weights(
        self, record_bytes: bytes, manifest_bytes: bytes, use_plan: bool = True, stacks_after_s: float = 0.0
    ) -> int:
        """Load a version straight from the trainer's device buckets (transport 'ipc'); returns the count loaded,
        or -1 when the buckets cannot be opened (nothing is loaded then: every handle opens before any write)."""
        import torch

        from protos.records import decode_ipc_version, decode_manifest
        from weight_bus.ipc import IpcUnavailable, open_version

        manifest = decode_manifest(manifest_bytes)
        try:
            buckets = open_version(decode_ipc_version(record_bytes), self.model_runner.device)
        except IpcUnavailable as error:
            log.warning("weight bus (ipc): %s; the version comes over tcp", error)
            return -1
        try:
            with stacks_if_slow(stacks_after_s):
                loaded = self._fleetrl_load(manifest, buckets, use_plan)
                torch.cuda.synchronize(self.model_runner.device)  # done reading the trainer's memory
        finally:
            buckets.clear()
            torch.cuda.ipc_collect()
        return loaded

    def _fleetrl_load(self, manifest, buckets, use_plan: bool) -> int:
        """Load one version from ``buckets`` (uint8 tensors, one per manifest bucket): through the layout's accepted
        plan, else vLLM's reload (recording and checking a plan on the way when one may be tried)."""
        from rollout_service import refit_plan

        plans = self.__dict__.setdefault("_fleetrl_plans", {})  # layout -> an accepted plan, or why it was refused
        layout = refit_plan.layout_key(manifest)
        if use_plan and self._fleetrl_replayed(plans, layout, buckets, manifest.version):
            return len(manifest.tensors)
        dequantize_to = self._fleetrl_dequantize_target(manifest)
        kind = self._fleetrl_plan_kind(manifest, dequantize_to) if use_plan and layout not in plans else "-"
        if kind not in ("copies", "layers", "-"):
            plans[layout] = f"refused: {kind}"
            log.info("weight updates keep vLLM's reload (no refit plan): %s", kind)
        return self._fleetrl_reload(manifest, buckets, dequantize_to, plans, layout, kind)

    def _fleetrl_replayed(self, plans: dict, layout: str, buckets, version: int) -> bool:
        """Load through the layout's accepted plan; False when there is none (or it no longer fits the served
        memory: dropped, to be recorded again). A replay only copies and processes: a failure there is a bug and
        propagates (the update fails loudly rather than serving half-updated weights)."""
        from rollout_service import layer_plan, refit_plan

        known = plans.get(layout)
        model = self.model_runner.get_model()
        if isinstance(known, refit_plan.RefitPlan) and refit_plan.still_served(known, model):
            with profiled_load(version, "plan"):
                known.replay(buckets)
            self.fleetrl_last_load_path = "plan"
            return True
        changed = known.changed() if isinstance(known, layer_plan.LayeredPlan) else "-"
        if not changed:
            with profiled_load(version, "layer plan"), kept_across_reload(model):
                known.replay(buckets)
            self.fleetrl_last_load_path = "layer plan"
            return True
        if isinstance(known, (refit_plan.RefitPlan, layer_plan.LayeredPlan)):
            what = "a parameter moved to new memory" if changed == "-" else f"{changed} changed shape or dtype"
            log.warning("refit plan dropped: %s; recording it again", what)
            del plans[layout]
        return False

    def _fleetrl_reload(self, manifest, buckets, dequantize_to, plans: dict, layout: str, kind: str) -> int:
        """vLLM's layerwise reload of one version; with ``kind`` 'copies' or 'layers' a plan of that kind is
        captured on the way and kept once it reproduces the reload."""
        from contextlib import nullcontext

        from rollout_service import layer_plan, refit_plan
        from rollout_service.reload_routing import route_reload_weights
        from weight_bus.ipc import iter_device_tensors

        model = self.model_runner.get_model()
        attempt = None
        if kind == "copies":
            attempt = refit_plan.attempt(model, iter_device_tensors(manifest, buckets), buckets, layout)
            if isinstance(attempt, str):
                plans[layout], attempt = f"refused: {attempt}", None
                log.warning("weight updates keep vLLM's reload (no refit plan): %s", plans[layout])
        loaded = 0

        def counted():
            nonlocal loaded
            for name, tensor in iter_device_tensors(manifest, buckets, dequantize_to):
                loaded += 1
                yield name, tensor

        # Some models' loaders write tensors past the weight loaders the layerwise reload counts (gpt-oss).
        routed = route_reload_weights(model, counted())
        recorded = layer_plan.recording(model, buckets, layout) if kind == "layers" else nullcontext()
        # Marlin's lock arrays stay where the CUDA graphs captured them (rollout_service/kernel_scratch.py); vLLM's
        # false "RotaryEmbedding: Failed to load weights" is dropped (rollout_service/reload_notices.py).
        with (
            profiled_load(manifest.version, "reload"),
            kept_across_reload(model),
            quiet_derived_buffer_warnings(model),
            recorded as record,
        ):
            self.model_runner.reload_weights(weights_iterator=routed, is_checkpoint_format=True)
        self.fleetrl_last_load_path = "reload"
        if attempt is not None:
            self._fleetrl_keep(plans, layout, refit_plan.accept(attempt, model, buckets))
            del attempt  # its masks and the plan's views of this version's buckets
        if record is not None:
            with kept_across_reload(model):
                self._fleetrl_keep(plans, layout, layer_plan.accept(record, model, buckets))
        return loaded

    @staticmethod
    def _fleetrl_keep(plans: dict, layout: str, accepted) -> None:
        """Keep an accepted plan for the layout, or the reason it was refused."""
        if isinstance(accepted, str):
            plans[layout] = f"refused: {accepted}"
            log.warning("weight updates keep vLLM's reload (refit plan refused): %s", accepted)
            return
        plans[layout] = accepted
        log.info(
            "refit plan accepted: %s, %.1f MiB copied per update", _plan_summary(accepted), accepted.nbytes / 2**20
        )

    def _fleetrl_plan_kind(self, manifest, dequantize_to) -> str:
        """'copies' (rollout_service.refit_plan) or 'layers' (rollout_service.layer_plan) when a plan may be tried
        for ``manifest``, else why not."""
        runner = self.model_runner
        if dequantize_to is not None or any(entry.codec != "raw" for entry in manifest.tensors):
            return "MXFP8 pairs are decoded at load"
        if getattr(runner, "lora_config", None) is not None:
            return "LoRA layers derive state from the base weights at load"
        # Quantized layers and vLLM's CPU kernels serve tensors computed from the loaded ones (quantized, repacked,
        # prepacked): only a plan that re-runs each layer's processing reproduces them.
        if runner.device.type != "cuda" or runner.model_config.quantization is not None:
            return "layers"
        return "copies"

    def fleetrl_refit_plan_state(self) -> dict[str, str]:
        """Per manifest layout: 'accepted (<copies>)' or why its plan was refused; plus the last load's path."""
        plans = self.__dict__.get("_fleetrl_plans", {})
        state = {
            layout[:12]: plan if isinstance(plan, str) else f"accepted ({_plan_summary(plan)})"
            for layout, plan in plans.items()
        }
        state["last_load"] = getattr(self, "fleetrl_last_load_path", "")
        return state

    def _fleetrl_dequantize_target(self, manifest):
        """The dtype MXFP8 pairs are decoded to, or None to load them as they are."""
        from rollout_service.vllm_adapter import serves_mxfp8_checkpoint

        model_config = self.model_runner.model_config
        # An online-quantized engine (quantization 'mxfp8') takes high-precision weights and re-quantizes them at
        # load (layerwise reload runs process_weights_after_loading); only an MXFP8 checkpoint takes the pairs.
        serves_mxfp8 = serves_mxfp8_checkpoint(model_config.quantization)
        has_mxfp8 = any(entry.codec == "mxfp8" for entry in manifest.tensors)
        if serves_mxfp8 and not has_mxfp8:
            raise ValueError(
                f"weights v{manifest.version}: the engine serves an MXFP8 checkpoint but the publisher sent "
                "unquantized weights; set weight_bus.codec='mxfp8'"
            )
        return None if serves_mxfp8 or not has_mxfp8 else model_config.dtype

    def _prepack_cpu_moe_experts(self) -> None:
        """Re-run the CPU MoE experts' prepack after a reload.

        vLLM 0.32's unquantized MoE method skips ``fused_experts.process_weights_after_loading`` on a
        weight update, so on CPU the reloaded expert weights stay in checkpoint layout while the
        grouped-GEMM kernel reads them as prepacked: outputs become garbage (found by reloading
        identical weights and comparing logprobs). Prepacking here restores the kernel's layout.
        """
        import torch

        if torch.cuda.is_available():
            return
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            # By the class chain: on a CPU with AMX tiles the bf16 kernel is X86CPUUnquantizedExperts (a subclass of
            # CPUUnquantizedExperts that pads and prepacks for AMX), whose own name does not start with "CPU".
            is_cpu_kernel = any(cls.__name__.startswith("CPU") for cls in type(experts).__mro__)
            if experts is not None and is_cpu_kernel and hasattr(module, "w13_weight"):
                experts.process_weights_after_loading(module)

    def fleetrl_mxfp8_batched(self, enabled: bool | None = None) -> dict[str, str]:
        """Switch the batched MXFP8 expert processing on or off (None: leave it); returns its verdicts."""
        return mxfp8_batched.state() if enabled is None else mxfp8_batched.set_enabled(enabled)

    def fleetrl_allocate_pipeline_receive_buffer(self) -> bool:
        """Make the buffer a later pipeline stage receives the previous stage's hidden states into.

        vLLM creates it in the runner's ``_dummy_run``, which the CPU runner calls only while warming up
        compiled graphs: with ``enforce_eager`` on CPU a PP > 1 engine fails its first step
        (``gpu_model_runner`` asserts ``intermediate_tensors is not None``). Same allocation as ``_dummy_run``;
        returns whether one was made (not on the first stage, nor when it exists).
        """
        from vllm.distributed import get_pp_group

        runner = self.model_runner
        if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
            return False
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
        )
        return True

    def fleetrl_state_checksum(self) -> float:
        """Sum of all parameters: a cheap fingerprint tests use to see that weights changed."""
        model = self.model_runner.get_model()
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))

    def fleetrl_param_sums(self) -> dict[str, float]:
        """fp64 sum of each parameter by vLLM's name (fused ones included): the GPU checks compare them with the
        trainer's tensors (fp8 ones by their bytes). On CPU vLLM repacks linear weights into kernel buffers, whose
        parameters then read 0."""
        model = self.model_runner.get_model()
        return {name: _fingerprint(param.detach()) for name, param in model.named_parameters()}


def _plan_summary(plan) -> str:
    """'<n> copies' for a copy plan, '<n> layers, <m> copies' for a layer plan."""
    if hasattr(plan, "layers"):
        return f"{len(plan.layers)} layers, {sum(len(steps.copies()) for steps in plan.layers)} copies"
    return f"{len(plan.copies)} copies"


def _fingerprint(tensor) -> float:
    """fp64 sum of the values; of the bytes for one-byte floats (MXFP8 E4M3 weights, E8M0 scales), whose conversions
    torch does not offer for every dtype and whose served layout (Marlin's) only compares with itself anyway."""
    import torch

    if tensor.element_size() == 1 and tensor.dtype.is_floating_point:
        tensor = tensor.contiguous().view(torch.uint8)
    return float(tensor.double().sum().item())
