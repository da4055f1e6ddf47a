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

import mmap
import os


class WeightLoaderExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's model runner."""

    def fleetrl_load_staged_weights(self, staging_path: str, manifest_bytes: bytes) -> int:
        """Load every tensor listed in the manifest from the staging file; returns the count loaded."""
        from protos.records import decode_manifest
        from weight_bus.packing import iter_tensors

        manifest = decode_manifest(manifest_bytes)
        dequantize_to = self._fleetrl_dequantize_target(manifest)
        fd = os.open(staging_path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            # A private copy-on-write map: writable views for torch, nothing written back to the file.
            buffer = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else bytearray()
        finally:
            os.close(fd)
        loaded = 0

        def counted():
            nonlocal loaded
            for name, tensor in iter_tensors(manifest, memoryview(buffer), dequantize_to=dequantize_to):
                loaded += 1
                yield name, tensor

        self.model_runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        self._prepack_cpu_moe_experts()
        return loaded

    def fleetrl_ipc_unopenable_reason(self, record_bytes: bytes) -> str:
        """'' when this worker can open the trainer's IPC buckets (same GPU, another process), else why not."""
        from protos.records import decode_ipc_version
        from weight_bus.ipc import why_not_openable

        return why_not_openable(decode_ipc_version(record_bytes), self.model_runner.device)

    def fleetrl_load_ipc_weights(self, record_bytes: bytes, manifest_bytes: bytes) -> int:
        """Load a version straight from the trainer's device buckets (transport 'ipc'); returns the count loaded,
        or -1 when the buckets cannot be opened (nothing is loaded then: every handle opens before any write)."""
        import torch

        from protos.records import decode_ipc_version, decode_manifest
        from weight_bus.ipc import IpcUnavailable, iter_device_tensors, open_version

        manifest = decode_manifest(manifest_bytes)
        try:
            buckets = open_version(decode_ipc_version(record_bytes), self.model_runner.device)
        except IpcUnavailable as error:
            import logging

            logging.getLogger(__name__).warning("weight bus (ipc): %s; the version comes over tcp", error)
            return -1
        loaded = 0

        def counted():
            nonlocal loaded
            for name, tensor in iter_device_tensors(manifest, buckets, self._fleetrl_dequantize_target(manifest)):
                loaded += 1
                yield name, tensor

        try:
            self.model_runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
            torch.cuda.synchronize(self.model_runner.device)  # done reading the trainer's memory
        finally:
            buckets.clear()  # the closure above holds the list: drop the opened allocations
            torch.cuda.ipc_collect()
        return loaded

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
            if experts is not None and type(experts).__name__.startswith("CPU") and hasattr(module, "w13_weight"):
                experts.process_weights_after_loading(module)

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
        trainer's tensors. On CPU vLLM repacks linear weights into kernel buffers, whose parameters then read 0."""
        model = self.model_runner.get_model()
        return {name: float(param.detach().double().sum().item()) for name, param in model.named_parameters()}
