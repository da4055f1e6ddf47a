"""The Megatron training backend: megatron-bridge builds a megatron-core GPTModel from the HF checkpoint.

Same interface as ``TorchBackend``: ``train_step``, ``token_logprobs``, ``export_hf_weights`` (HF layout, experts
per expert, as vLLM loads them), plus ``save_checkpoint`` / ``load_checkpoint`` (model, optimizer, RNG; resuming
is bit-exact). The optimizer is megatron-core's (distributed optimizer over the data-parallel ranks) and the step
runs through megatron-core's ``forward_backward_func``.

Parallel layout: TP, PP, EP and DP (context parallelism is refused). Every rank calls every method with the same
arguments and gets the same result back:
  - DP: ``train_step`` trains this data-parallel rank's contiguous shard of the batch's rows; the loss keeps the
    whole batch's denominator and is scaled by the DP size, which undoes megatron DDP's grad averaging, so one step
    with DP=n equals one step with DP=1 on the same batch. ``token_logprobs`` runs the whole batch on every replica.
  - PP: the schedules need one [B, T] shape for every micro-batch, so micro-batches are padded with dummy rows
    (loss_mask 0, attention_mask 1 so that softmax always has a key); log-probs and the loss exist only on the last
    stage and are broadcast from there (``ranks.broadcast_tensor`` / ``ranks.broadcast_json``).

On a CPU-only torch it runs on gloo in fp32, with the shims of ``megatron_cpu_shims`` and the CPU-safe model
settings of ``_configure_provider`` (shared/notes/stack.md, "Megatron on CPU").

Shape legend: _BT [samples, tokens], _BTV [samples, tokens, vocab], routes_BTLK see ``routing_replay``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch

from protos.config import MegatronConfig, TrainerConfig
from trainer_service import lora, megatron_beam, megatron_checkpoint, megatron_cpu_shims, megatron_lora, ranks
from trainer_service.batch import (
    TrainBatch,
    data_parallel_shard,
    logit_divisors,
    pad_to_common_shape,
    split_micro_batches,
)
from trainer_service.losses import loss_denominator, policy_loss
from trainer_service.routing_replay import NO_ROUTE, megatron_forced_routing
from trainer_service.torch_backend import loss_config, temper

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def init_distributed(device: str, timeout_s: float = 1800.0) -> None:
    """Join torch.distributed: torchrun's env when present, else a world of one on a free local port.

    ``timeout_s``: how long a collective may wait (ranks > 0 wait in one while rank 0 waits for groups).
    """
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
        return
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device).index or 0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout)


def init_model_parallel(config: MegatronConfig) -> None:
    """Set megatron's parallel groups once per process; a second backend must ask for the same layout."""
    from megatron.core import parallel_state as mpu

    sizes = (
        config.tensor_model_parallel_size,
        config.pipeline_model_parallel_size,
        config.context_parallel_size,
        config.expert_model_parallel_size,
    )
    if mpu.model_parallel_is_initialized():
        current = (
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_context_parallel_world_size(),
            mpu.get_expert_model_parallel_world_size(),
        )
        if current != sizes:
            raise ValueError(f"megatron parallel sizes (tp, pp, cp, ep) already set to {current}, asked {sizes}")
        return
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=sizes[0],
        pipeline_model_parallel_size=sizes[1],
        context_parallel_size=sizes[2],
        expert_model_parallel_size=sizes[3],
        expert_tensor_parallel_size=config.expert_tensor_parallel_size,
    )


def _check_supported(config: MegatronConfig) -> None:
    if config.context_parallel_size != 1:
        raise ValueError(
            "megatron.context_parallel_size: only 1 is implemented in MegatronBackend (TP, PP, EP and DP are)"
        )


def _configure_provider(provider, config: MegatronConfig, on_cpu: bool) -> None:
    """Model settings: the local (non-TE) layer spec, no fusions that need TE/apex, the policy loss alone."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    dtype = _DTYPES[config.params_dtype]
    provider.tensor_model_parallel_size = config.tensor_model_parallel_size
    provider.pipeline_model_parallel_size = config.pipeline_model_parallel_size
    provider.expert_model_parallel_size = config.expert_model_parallel_size
    if config.expert_tensor_parallel_size is not None:  # None: megatron's default, the TP size
        provider.expert_tensor_parallel_size = config.expert_tensor_parallel_size
    provider.context_parallel_size = config.context_parallel_size
    # MoE with TP > 1 needs sequence parallel in megatron-core.
    provider.sequence_parallel = config.tensor_model_parallel_size > 1
    # The bridge defaults to the TE spec, which fails without Transformer Engine; a provider that brings its own
    # local spec (Beam) keeps it.
    if not getattr(provider, "has_local_layer_spec", False):
        provider.transformer_layer_spec = local_layer_spec
    provider.persist_layer_norm = False
    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.autocast_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = False
    provider.moe_grouped_gemm = config.moe_grouped_gemm
    provider.moe_token_dispatcher_type = config.moe_token_dispatcher
    provider.moe_permute_fusion = False  # the bridge turns it on; it needs TE
    provider.moe_enable_routing_replay = config.routing_replay
    # Only routers with an expert bias (Beam) read it.
    provider.moe_router_bias_update_rate = config.moe_router_bias_update_rate
    # RL trains on the policy loss alone: no load-balancing term unless asked for.
    provider.moe_aux_loss_coeff = config.moe_aux_loss_coeff
    if config.moe_aux_loss_coeff == 0.0:
        provider.moe_router_load_balancing_type = "none"
    provider.gradient_accumulation_fusion = False
    provider.bias_dropout_fusion = False
    provider.masked_softmax_fusion = False
    provider.apply_rope_fusion = False
    provider.cross_entropy_loss_fusion = False
    provider.use_cpu_initialization = on_cpu
    # The pipeline's p2p step ends with torch.cuda.synchronize(); gloo's send/recv are synchronous already.
    provider.batch_p2p_sync = not on_cpu


def attention_mask_B1TT(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask (True = masked): causal and key padding, as transformers masks a padded batch.

    Passed explicitly because megatron-core's default causal mask is built on CUDA.
    """
    seq = attention_mask_BT.shape[1]
    future_TT = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=attention_mask_BT.device), diagonal=1)
    padded_key_BT = attention_mask_BT == 0
    return (future_TT[None] | padded_key_BT[:, None, :])[:, None]


def pad_sequence_dim(tensor_BT: torch.Tensor, multiple: int, value: int) -> torch.Tensor:
    """Right-pad dim 1 to a multiple of ``multiple`` with ``value``.

    Sequence parallelism splits the sequence evenly over the TP ranks; right padding (masked keys, after every
    real token) changes no real position's output under causal attention.
    """
    extra = -tensor_BT.shape[1] % multiple
    if extra == 0:
        return tensor_BT
    padding = tensor_BT.new_full((tensor_BT.shape[0], extra, *tensor_BT.shape[2:]), value)
    return torch.cat([tensor_BT, padding], dim=1)


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
        AutoBridge = megatron_cpu_shims.import_bridge()
        megatron_beam.register()  # fleetrl's own bridge: BeamForCausalLM checkpoints
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.utils import get_model_config
        from transformers import AutoConfig

        _check_supported(config.megatron)
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
            self.bridge = AutoBridge.from_hf_pretrained(model_path, dtype=_DTYPES[config.megatron.params_dtype])
        self.model, self.optimizer = self._build(config, on_cpu=self.device.type == "cpu", load_weights=not random_init)
        model_config = get_model_config(self.model[0])
        self.num_layers = model_config.num_layers
        # Sequence lengths must split evenly over the TP ranks under sequence parallelism.
        self.sequence_multiple = model_config.tensor_model_parallel_size if model_config.sequence_parallel else 1

    def _build(self, config: TrainerConfig, on_cpu: bool, load_weights: bool):
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.utils import get_model_config

        provider = self.bridge.to_megatron_provider(load_weights=load_weights)
        _configure_provider(provider, config.megatron, on_cpu)
        provider.finalize()
        if config.lora.enabled:  # after the bridge's weight-loading hook, before DDP wraps the chunks
            provider.register_pre_wrap_hook(megatron_lora.lora_pre_wrap_hook(config.lora))
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=config.megatron.use_distributed_optimizer
        )
        bf16 = config.megatron.params_dtype == "bfloat16"
        model = provider.provide_distributed_model(
            ddp_config=ddp_config, wrap_with_ddp=True, use_cpu_initialization=on_cpu, bf16=bf16, fp16=False
        )
        with megatron_cpu_shims.cuda_tensors_on_cpu():
            optimizer = self._optimizer(config, model, bf16)
        model_config = get_model_config(model[0])
        # What megatron.training wires up: grads reduced after backward, loss scaled by the optimizer.
        model_config.finalize_model_grads_func = finalize_model_grads
        model_config.grad_scale_func = optimizer.scale_loss
        return model, optimizer

    @staticmethod
    def _optimizer(config: TrainerConfig, model: list, bf16: bool):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        return get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=config.lr,
                min_lr=config.lr,
                weight_decay=config.weight_decay,
                adam_beta1=0.9,
                adam_beta2=0.99,
                adam_eps=1e-8,
                clip_grad=config.grad_clip,
                bf16=bf16,
                params_dtype=_DTYPES[config.megatron.params_dtype],
                use_distributed_optimizer=config.megatron.use_distributed_optimizer,
            ),
            model,
        )

    # -- forward -------------------------------------------------------------------------------------------

    def _padded(self, input_ids_BT, attention_mask_BT, routes_BTLK):
        """The inputs right-padded for sequence parallelism (padded routes are NO_ROUTE)."""
        multiple = self.sequence_multiple
        routes = None if routes_BTLK is None else pad_sequence_dim(routes_BTLK, multiple, NO_ROUTE)
        return pad_sequence_dim(input_ids_BT, multiple, 0), pad_sequence_dim(attention_mask_BT, multiple, 0), routes

    def _stage_output(
        self,
        model,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        temperature: float | torch.Tensor | None,
    ) -> torch.Tensor:
        """This pipeline stage's forward: hidden states [T, B, H] (sent on), or log-probs [B, T-1] on the last stage.

        Earlier stages' hidden states arrive through megatron's ``set_input_tensor``; the ids, positions and mask
        are given to every stage (RoPE and attention need them).
        """
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        seq = input_ids_BT.shape[1]
        position_ids_BT = torch.arange(seq, device=input_ids_BT.device).expand_as(input_ids_BT)
        output = model(
            input_ids=input_ids_BT, position_ids=position_ids_BT, attention_mask=attention_mask_B1TT(attention_mask_BT)
        )
        if not mpu.is_pipeline_last_stage():
            return output
        logits_BTV = temper(output[:, :-1].float(), temperature)  # one, or per row (batch.logit_divisors)
        return -vocab_parallel_cross_entropy(logits_BTV.contiguous(), input_ids_BT[:, 1:].contiguous())

    def _forward_backward(self, step_fn, forward_only: bool, shape: tuple[int, int], micro_batches=None) -> list:
        """megatron's schedule for this layout; returns the loss functions' outputs (last stage only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro_batches = micro_batches or [None]
        # The schedule keeps its token counter on device="cuda".
        with megatron_cpu_shims.cuda_tensors_on_cpu():
            return get_forward_backward_func()(
                forward_step_func=step_fn,
                data_iterator=iter(micro_batches),
                model=self.model,
                num_microbatches=len(micro_batches),
                seq_length=shape[1],
                micro_batch_size=shape[0],
                forward_only=forward_only,
            )

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
            output = self._stage_output(model, ids, attention, divisors)
            out["logprobs"] = output
            return output, lambda output: (output.sum(), {})

        for chunk in self.model:
            chunk.eval()
        try:
            with megatron_forced_routing(self.model, routed_experts, self.num_layers):
                self._forward_backward(step_fn, forward_only=True, shape=tuple(ids.shape))
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
            # Replay targets are set for this micro-batch's forward; backward reuses the saved routing.
            with megatron_forced_routing(self.model, routes, self.num_layers):
                output = self._stage_output(model, ids, attention, logit_divisors(micro, self.temperature))
            if mpu.is_pipeline_last_stage():
                output = output[:, : micro.input_ids_BT.shape[1] - 1]
            return output, partial(self._loss_fn, micro, weight, loss_scale)

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        padded_shape = tuple(micro_batches[0].input_ids_BT.shape)
        per_micro = self._forward_backward(step_fn, forward_only=False, shape=padded_shape, micro_batches=micro_batches)
        metrics = self._step_metrics(per_micro)
        with megatron_cpu_shims.cuda_tensors_on_cpu():
            grad_norm, skipped = self._optimizer_step(metrics["loss"])
        metrics.update(grad_norm=grad_norm, skipped=float(skipped))
        return metrics

    @staticmethod
    def _step_metrics(per_micro: list[dict[str, float]]) -> dict[str, float]:
        """The step's figures on every rank: summed over micro-batches and data-parallel shards on the last
        pipeline stage (each figure is already weighted by its share of the batch), then broadcast."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        metrics = {key: sum(m[key] for m in per_micro) for key in per_micro[0]} if per_micro else {}
        if mpu.is_pipeline_last_stage() and mpu.get_data_parallel_world_size() > 1:
            keys = sorted(metrics)
            group = mpu.get_data_parallel_group()
            values = torch.tensor(
                [metrics[key] for key in keys], dtype=torch.float64, device=ranks.collective_device(group)
            )
            dist.all_reduce(values, group=group)
            metrics = dict(zip(keys, values.tolist(), strict=True))
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            metrics = ranks.broadcast_json(
                metrics, mpu.get_pipeline_model_parallel_last_rank(), mpu.get_pipeline_model_parallel_group()
            )
        return metrics

    def _optimizer_step(self, loss: float) -> tuple[float, bool]:
        """megatron-core's ``optimizer.step()`` split open, so that a non-finite norm skips instead of clipping
        every gradient to NaN (its own skip threshold compares ``norm > threshold``, which NaN never is)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        found_inf = self.optimizer.prepare_grads()
        # Reduced over the model-parallel ranks (and the data-parallel ones with the distributed optimizer); the
        # loss is the broadcast one: the decision below is taken alike everywhere, and checked to be.
        grad_norm = float(self.optimizer.get_grad_norm())
        skipped = ranks.any_rank(bool(found_inf) or not (math.isfinite(loss) and math.isfinite(grad_norm)))
        if skipped:
            logger.error("non-finite loss %.4g or grad norm %.4g: step skipped", loss, grad_norm)
            return grad_norm, True
        for optimizer in megatron_checkpoint.sub_optimizers(self.optimizer):
            if optimizer.get_parameters():
                clip_grad_by_total_norm_fp32(optimizer.get_parameters(), self.config.grad_clip, grad_norm)
        self.optimizer.step_with_ready_grads()
        return grad_norm, False

    # -- weights and checkpoints ---------------------------------------------------------------------------

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in the HF checkpoint layout (experts per expert); every rank must iterate."""
        # Plain tuples, as TorchBackend yields (the bridge yields its own named tuple type).
        # On a GPU the tensors stay there: the ipc and nccl transports pack (and MXFP8-quantize) them on the device,
        # the tcp one copies each to the host itself.
        exported = self.bridge.export_hf_weights(self.model, cpu=self.device.type == "cpu", show_progress=False)
        # LoRA: adapters merged by the bridge; only the adapted layers are published (every rank still iterates).
        yield from lora.published(((name, tensor) for name, tensor in exported), self.config.lora)

    def save_checkpoint(self, directory: str | Path) -> None:
        """Model, optimizer (incl. the distributed optimizer's sharded Adam state) and RNG states, a file per rank."""
        megatron_checkpoint.save(self.model, self.optimizer, directory)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what ``save_checkpoint`` wrote (same parallel layout); the next step is bit-identical."""
        megatron_checkpoint.load(self.model, self.optimizer, directory)
