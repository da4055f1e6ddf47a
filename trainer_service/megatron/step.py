"""The optimizer step of the Megatron backend: the step's figures reduced over ranks, clip, step or skip.

DP: each data-parallel rank trains a contiguous shard of the batch's rows; the loss keeps the whole batch's
denominator and is scaled by the DP size, which undoes megatron DDP's grad averaging, so one step with DP=n equals
one step with DP=1 on the same batch. Every rank returns the same figures.
"""

from __future__ import annotations

import logging
import math

import torch

from trainer_service import ranks
from trainer_service.megatron import checkpoint as megatron_checkpoint

logger = logging.getLogger(__name__)


def step_metrics(per_micro: list[dict[str, float]]) -> dict[str, float]:
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


def optimizer_step(optimizer, loss: float, grad_clip: float) -> tuple[float, bool]:
    """megatron-core's ``optimizer.step()`` split open, so that a non-finite norm skips instead of clipping
    every gradient to NaN (its own skip threshold compares ``norm > threshold``, which NaN never is).

    Returns the gradient norm and whether the step was skipped.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = optimizer.prepare_grads()
    # Reduced over the model-parallel ranks (and the data-parallel ones with the distributed optimizer); the
    # loss is the broadcast one: the decision below is taken alike everywhere, and checked to be.
    grad_norm = float(optimizer.get_grad_norm())
    skipped = ranks.any_rank(bool(found_inf) or not (math.isfinite(loss) and math.isfinite(grad_norm)))
    if skipped:
        logger.error("non-finite loss %.4g or grad norm %.4g: step skipped", loss, grad_norm)
        return grad_norm, True
    for sub_optimizer in megatron_checkpoint.sub_optimizers(optimizer):
        if sub_optimizer.get_parameters():
            clip_grad_by_total_norm_fp32(sub_optimizer.get_parameters(), grad_clip, grad_norm)
    optimizer.step_with_ready_grads()
    return grad_norm, False
