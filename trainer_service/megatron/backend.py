"""The Megatron training backend: megatron-bridge builds a megatron-core GPTModel from the HF checkpoint.

Same interface as ``TorchBackend``: ``train_step``, ``token_logprobs``, ``export_hf_weights`` (HF layout, experts
per expert, as vLLM loads them), plus ``save_checkpoint`` / ``load_checkpoint`` (model, optimizer, RNG; resuming
is bit-exact). The optimizer is megatron-core's (distributed optimizer over the data-parallel ranks) and the step
runs through megatron-core's ``forward_backward_func``.

Parallel layout: TP, PP, EP and DP (context parallelism is refused). Every rank calls every method with the same
arguments and gets the same result back:
  - DP: ``train_step`` trains this data-parallel rank's contiguous shard of the batch's rows (``step``).
    ``token_logprobs`` runs the whole batch on every replica.
  - PP: the schedules need one [B, T] shape for every micro-batch, so micro-batches are padded with dummy rows
    (loss_mask 0, attention_mask 1 so that softmax always has a key); log-probs and the loss exist only on the last
    stage and are broadcast from there (``ranks.broadcast_tensor`` / ``ranks.broadcast_json``).

On a CPU-only torch it runs on gloo in fp32, with the shims of ``cpu_shims`` and the CPU-safe model settings of
``model.configure_provider`` (shared/notes/stack.md, "Megatron on CPU").

Shape legend: _BT [samples, tokens], _BTV [samples, tokens, vocab], routes_BTLK see ``routing_replay``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

from protos.config import TrainerConfig
from protos.records import LoraAdapter
from trainer_service import lora, ranks
from trainer_service.batch import (
    TrainBatch,
    data_parallel_shard,
    logit_divisors,
    pad_to_common_shape,
    split_micro_batches,
)
from trainer_service.export_plan import PlannedExport
from trainer_service.losses import loss_denominator, policy_loss
from trainer_service.megatron import beam, cpu_shims, step
from trainer_service.megatron import checkpoint as megatron_checkpoint
from trainer_service.megatron.forward import forward_backward, pad_sequence_dim, stage_output
from trainer_service.megatron.model import DTYPES, build_model, use_fused_adam
from trainer_service.megatron.parallel import check_supported, init_distributed, init_model_parallel
from trainer_service.megatron.routing_replay import megatron_clear_routing_replay, megatron_forced_routing
from trainer_service.routing_replay import NO_ROUTE
from trainer_service.torch_backend import loss_config


class MegatronBackend:
    """Owns the megatron model chunks and optimizer; ``train_step`` is one optimizer step on one batch."""

    def __init__(
        self,
        model_path: str,
        config: TrainerConfig,
        temperature: float = 1.0,
        device: str = "cpu",
        random_init: bool = False,
    ):
        """``random_init``: build from ``config.json`` alone with random weights (benchmarks), else load weights."""
        cpu_shims.import_bridge()
        beam.register()  # fleetrl's own bridge: BeamForCausalLM checkpoints
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.utils import get_model_config
        from transformers import AutoConfig

        # AutoBridge whose model bridges also map grouped experts (trainer.megatron.moe_grouped_experts).
        from trainer_service.megatron.grouped_bridge import GroupedExpertsAutoBridge as AutoBridge

        check_supported(config.megatron)
        self.config = config
        self.temperature = temperature
        self.device = torch.device(device)
        self.loss_config = loss_config(config)
        init_distributed(device, ranks.process_group_timeout_s(config.batch_timeout_s))
        init_model_parallel(config.megatron)
        torch.manual_seed(config.seed)
        model_parallel_cuda_manual_seed(config.seed)
        if random_init:
            self.bridge = AutoBridge.from_hf_config(AutoConfig.from_pretrained(model_path))
        else:
            self.bridge = AutoBridge.from_hf_pretrained(model_path, dtype=DTYPES[config.megatron.params_dtype])
        self.model, self.optimizer = build_model(
            self.bridge, config, on_cpu=self.device.type == "cpu", load_weights=not random_init
        )
        model_config = get_model_config(self.model[0])
        self.num_layers = model_config.num_layers
        self.fusions = dict(
            fused_attention=config.megatron.fused_attention, fused_logprobs=config.fused_lm_head_logprobs
        )
        # Full recompute re-runs every layer's router in the backward, selective 'moe' the MoE layers'.
        recompute = config.megatron
        self.recompute_reruns_routers = recompute.recompute == "full" or (
            recompute.recompute == "selective" and "moe" in recompute.recompute_modules
        )
        # Sequence lengths must split evenly over the TP ranks under sequence parallelism.
        self.sequence_multiple = model_config.tensor_model_parallel_size if model_config.sequence_parallel else 1
        # The export: through a plan learned from the bridge where one process holds every weight (no collectives).
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self._export = PlannedExport(
            lambda: [p for chunk in self.model for p in chunk.parameters()],
            lambda: self.bridge.export_hf_weights(self.model, cpu=self.device.type == "cpu", show_progress=False),
            enabled=config.megatron.export_plan and world_size == 1 and not config.lora.enabled,
        )

    # -- forward -------------------------------------------------------------------------------------------

    def _padded(self, input_ids_BT, attention_mask_BT, routes_BTLK):
        """The inputs right-padded for sequence parallelism (padded routes are NO_ROUTE)."""
        multiple = self.sequence_multiple
        routes = None if routes_BTLK is None else pad_sequence_dim(routes_BTLK, multiple, NO_ROUTE)
        return pad_sequence_dim(input_ids_BT, multiple, 0), pad_sequence_dim(attention_mask_BT, multiple, 0), routes

    @torch.no_grad()
    def token_logprobs(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        routed_experts: torch.Tensor | None = None,
        temperature: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The torch backend's ``token_logprobs`` (eval mode, no grad): [B, T-1] on the CPU, the same on every rank.

        Every data-parallel replica runs the whole batch; the last pipeline stage broadcasts the result.
        ``temperature``: one or [B] per row; None: the backend's own.
        """
        from megatron.core import parallel_state as mpu

        ids, attention, routed_experts = self._padded(
            input_ids_BT.to(self.device), attention_mask_BT.to(self.device), routed_experts
        )
        out: dict[str, torch.Tensor] = {}

        divisors = self.temperature if temperature is None else temperature

        def step_fn(data_iterator, model):
            output = stage_output(model, ids, attention, divisors, **self.fusions)
            out["logprobs"] = output
            return output, lambda output: (output.sum(), {})

        for chunk in self.model:
            chunk.eval()
        try:
            with megatron_forced_routing(self.model, routed_experts, self.num_layers):
                forward_backward(self.model, step_fn, forward_only=True, shape=tuple(ids.shape))
        finally:
            for chunk in self.model:
                chunk.train()
        if mpu.is_pipeline_last_stage():
            logprobs_BT = out["logprobs"].float()
        else:
            logprobs_BT = torch.empty(ids.shape[0], ids.shape[1] - 1, device=self.device)
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            logprobs_BT = ranks.broadcast_tensor(
                logprobs_BT, mpu.get_pipeline_model_parallel_last_rank(), mpu.get_pipeline_model_parallel_group()
            )
        return logprobs_BT[:, : input_ids_BT.shape[1] - 1].cpu()

    def policy_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] logprobs of the current policy for the whole batch (pi_old of a step in mini-batches)."""
        return self.token_logprobs(
            batch.input_ids_BT,
            batch.attention_mask_BT,
            batch.routed_experts_BTLK,
            logit_divisors(batch, self.temperature),
        )

    # -- step ----------------------------------------------------------------------------------------------

    def _loss_fn(self, micro: TrainBatch, weight: float, loss_scale: float, logprobs_BT: torch.Tensor):
        # pi_old: fixed at the training step's start (mini-batches), else the current policy before this update.
        old_BT = logprobs_BT.detach() if micro.old_logprobs_BT is None else micro.old_logprobs_BT.to(self.device)
        loss, metrics = policy_loss(
            logprobs_BT,
            old_BT,
            micro.rollout_logprobs_BT.to(self.device),
            micro.advantages_B.to(self.device),
            micro.loss_mask_BT.to(self.device),
            self.loss_config,
        )
        metrics = {key: value * weight for key, value in metrics.items()}  # summed over micro-batches below
        metrics["loss"] = loss.item() * weight
        metrics["micro_batches"] = 1.0  # summed over micro-batches and data-parallel ranks
        return loss * (weight * loss_scale), metrics

    def train_step(self, batch: TrainBatch, routed_experts: torch.Tensor | None = None) -> dict[str, float]:
        """Forward/backward per micro-batch (``trainer.micro_batch_tokens``), clip, step. A non-finite loss or
        gradient skips the step. Every rank returns the same figures.

        ``routed_experts``: routes_BTLK from ``routing_replay.routes_from_groups``; by default the batch's own
        (``batch.routed_experts_BTLK``, filled by ``build_batch``); None: natural routing.
        """
        from megatron.core import parallel_state as mpu

        if routed_experts is not None:
            batch = dataclasses.replace(batch, routed_experts_BTLK=routed_experts)
        agg = self.loss_config.loss_agg
        total = loss_denominator(batch.loss_mask_BT, agg)  # the whole batch's, over every data-parallel shard
        shard = data_parallel_shard(batch, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
        micro_batches = split_micro_batches(shard, self.config.micro_batch_tokens)
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            micro_batches = pad_to_common_shape(micro_batches)
        # The schedule divides each micro-batch's loss by their number, DDP averages grads over the DP ranks: undo
        # both, so the summed weighted losses are the whole batch's loss.
        loss_scale = len(micro_batches) * mpu.get_data_parallel_world_size()

        def step_fn(data_iterator, model):
            micro = next(data_iterator)
            has_tokens = bool(micro.loss_mask_BT.sum() > 0)  # a dummy-only micro-batch counts for nothing
            weight = loss_denominator(micro.loss_mask_BT, agg) / total if has_tokens else 0.0
            ids, attention, routes = self._padded(
                micro.input_ids_BT.to(self.device), micro.attention_mask_BT.to(self.device), micro.routed_experts_BTLK
            )
            # Replay targets are set for this micro-batch's forward; backward reuses the saved routing, or replays
            # them again where activation recompute re-runs the routers.
            with megatron_forced_routing(self.model, routes, self.num_layers, self.recompute_reruns_routers):
                output = stage_output(model, ids, attention, logit_divisors(micro, self.temperature), **self.fusions)
            if mpu.is_pipeline_last_stage():
                output = output[:, : micro.input_ids_BT.shape[1] - 1]
            return output, partial(self._loss_fn, micro, weight, loss_scale)

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        padded_shape = tuple(micro_batches[0].input_ids_BT.shape)
        try:
            per_micro = forward_backward(
                self.model, step_fn, forward_only=False, shape=padded_shape, micro_batches=micro_batches
            )
        finally:
            megatron_clear_routing_replay(self.model)
        metrics = step.step_metrics(per_micro)
        with cpu_shims.cuda_tensors_on_cpu():
            grad_norm, skipped = step.optimizer_step(self.optimizer, metrics["loss"], self.config.grad_clip)
        metrics.update(grad_norm=grad_norm, skipped=float(skipped))
        return metrics

    # -- weights and checkpoints ---------------------------------------------------------------------------

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in the HF checkpoint layout (experts per expert); every rank must iterate."""
        # Plain tuples, as TorchBackend yields (the bridge yields its own named tuple type).
        # On a GPU the tensors stay there: the ipc and nccl transports pack (and MXFP8-quantize) them on the device,
        # the tcp one copies each to the host itself.
        exported = self._export()
        # LoRA: adapters merged by the bridge; only the adapted layers are published (every rank still iterates).
        yield from lora.published(((name, tensor) for name, tensor in exported), self.config.lora)

    def export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA only: the adapters alone in PEFT names, as vLLM's LoRA slot loads them; every rank must iterate."""
        from trainer_service.megatron import adapter_export

        yield from adapter_export.export_adapter_weights(
            self.bridge, self.model, self.config.lora, cpu=self.device.type == "cpu"
        )

    def adapter_record(self) -> LoraAdapter:
        """LoRA only: what ``export_adapter_weights`` yields (rank, alpha, HF modules, expert rank)."""
        from trainer_service.megatron.adapter_export import expert_adapter_rank

        return lora.adapter_record(self.config.lora, expert_adapter_rank(self.model, self.config.lora))

    def save_checkpoint(self, directory: str | Path) -> None:
        """Model, optimizer (incl. the distributed optimizer's sharded Adam state) and RNG states, a file per rank."""
        megatron_checkpoint.save(self.model, self.optimizer, directory)

    def checkpoint_snapshot(self) -> Callable[[Path], None]:
        """One process: the state of ``save_checkpoint`` as it is now, in host memory (the previous snapshot's buffers,
        whose file must be written by now); the function returned writes it (no collective: on the checkpoint
        writer's thread while the next step trains)."""
        self._snapshot = megatron_checkpoint.snapshot(self.model, self.optimizer, getattr(self, "_snapshot", None))
        return partial(megatron_checkpoint.write, self._snapshot)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what ``save_checkpoint`` wrote (same parallel layout); the next step is bit-identical."""
        megatron_checkpoint.load(self.model, self.optimizer, directory)
        if self.config.megatron.fused_adam:  # the loaded param groups carry the flag they were saved with
            use_fused_adam(self.optimizer)
