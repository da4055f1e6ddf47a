"""Turn trajectory groups into padded training tensors (GRPO groups stay whole).

Shape legend: _B [samples], _BT [samples, tokens of prompt + response - 1] (next-token targets).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protos.records import TrajectoryGroup
from trainer_service.losses import compute_advantages
from trainer_service.routing_replay import NO_ROUTE, routes_from_groups


@dataclass
class TrainBatch:
    input_ids_BT: torch.Tensor  # [B, T+1] prompt + response, right-padded
    attention_mask_BT: torch.Tensor  # [B, T+1]
    loss_mask_BT: torch.Tensor  # [B, T] 1 where target token is a response token
    rollout_logprobs_BT: torch.Tensor  # [B, T]
    advantages_B: torch.Tensor
    rewards_B: torch.Tensor
    min_versions_B: torch.Tensor
    num_response_tokens: int
    routed_experts_BTLK: torch.Tensor | None = None  # rollout routes for R3 (routing_replay); None = natural
    old_logprobs_BT: torch.Tensor | None = None  # pi_old when fixed before the step (mini-batches); None = detach
    temperatures_B: torch.Tensor | None = None  # sampling temperature of each row's group; < 0 / None = not recorded


def build_batch(groups: list[TrajectoryGroup], pad_id: int = 0) -> TrainBatch:
    """Flatten groups (equal group sizes) into one padded batch with GRPO advantages."""
    group_size = len(groups[0].samples)
    rows, masks, rollout_lps, rewards, versions, temperatures = [], [], [], [], [], []
    for group in groups:
        if len(group.samples) != group_size:
            raise ValueError(f"group {group.group_id} has {len(group.samples)} samples, expected {group_size}")
        prompt = group.prompt_token_ids.to_numpy().astype(np.int64)
        for sample in group.samples:
            response = sample.response_token_ids.to_numpy().astype(np.int64)
            rows.append(np.concatenate([prompt, response]))
            mask = np.zeros(len(prompt) + len(response) - 1, dtype=np.float32)
            # an agent's appended tokens (tool results, user turns) are context, not trained (Sample.loss_mask)
            mask[len(prompt) - 1 :] = 1.0 if sample.loss_mask is None else sample.loss_mask.to_numpy()
            masks.append(mask)
            lps = np.zeros_like(mask)
            lps[len(prompt) - 1 :] = sample.rollout_logprobs.to_numpy()
            rollout_lps.append(lps)
            rewards.append(sample.reward)
            versions.append(sample.min_version)
            temperatures.append(group.sampling_temperature)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width - 1))
    rollout = torch.zeros((len(rows), width - 1))
    for i, (row, mask, lps) in enumerate(zip(rows, masks, rollout_lps, strict=True)):
        input_ids[i, : len(row)] = torch.from_numpy(row)
        attention[i, : len(row)] = 1
        loss_mask[i, : len(mask)] = torch.from_numpy(mask)
        rollout[i, : len(lps)] = torch.from_numpy(lps)
    rewards_B = torch.tensor(rewards, dtype=torch.float32)
    return TrainBatch(
        input_ids_BT=input_ids,
        attention_mask_BT=attention,
        loss_mask_BT=loss_mask,
        rollout_logprobs_BT=rollout,
        advantages_B=compute_advantages(rewards_B, group_size),
        rewards_B=rewards_B,
        min_versions_B=torch.tensor(versions),
        num_response_tokens=int(loss_mask.sum().item()),
        routed_experts_BTLK=routes_from_groups(groups, width),
        temperatures_B=torch.tensor(temperatures, dtype=torch.float32),
    )


def logit_divisors(batch: TrainBatch, temperature: float) -> torch.Tensor | float:
    """[B] what each row's logits are divided by: the temperature its group was sampled at (a live change reaches
    the trainer later than the groups drawn after it), ``temperature`` where the group recorded none, and 1 at
    temperature 0 (greedy: the engine reports untempered logprobs). 1.0 when that is 1 for every row."""
    if batch.temperatures_B is None:
        return temperature if temperature > 0 else 1.0
    divisors = torch.where(batch.temperatures_B < 0, temperature, batch.temperatures_B)
    divisors = torch.where(divisors > 0, divisors, 1.0)
    return 1.0 if bool((divisors == 1.0).all()) else divisors


def select_rows(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    """The sub-batch of ``rows``, trimmed to its longest row (less padding to compute)."""
    index = torch.tensor(rows, dtype=torch.long)
    width = int(batch.attention_mask_BT[index].sum(dim=1).max())
    loss_mask = batch.loss_mask_BT[index, : width - 1]
    return TrainBatch(
        input_ids_BT=batch.input_ids_BT[index, :width],
        attention_mask_BT=batch.attention_mask_BT[index, :width],
        loss_mask_BT=loss_mask,
        rollout_logprobs_BT=batch.rollout_logprobs_BT[index, : width - 1],
        advantages_B=batch.advantages_B[index],
        rewards_B=batch.rewards_B[index],
        min_versions_B=batch.min_versions_B[index],
        num_response_tokens=int(loss_mask.sum().item()),
        routed_experts_BTLK=None if batch.routed_experts_BTLK is None else batch.routed_experts_BTLK[index, :width],
        old_logprobs_BT=None if batch.old_logprobs_BT is None else batch.old_logprobs_BT[index, : width - 1],
        temperatures_B=None if batch.temperatures_B is None else batch.temperatures_B[index],
    )


def split_micro_batches(batch: TrainBatch, max_tokens: int) -> list[TrainBatch]:
    """Split a step's batch into micro-batches of at most ``max_tokens`` padded tokens each.

    Rows keep their order (advantages were computed over whole groups before the split); a row
    longer than the budget gets a micro-batch of its own. ``max_tokens <= 0`` keeps one batch.
    """
    if max_tokens <= 0:
        return [batch]
    lengths = batch.attention_mask_BT.sum(dim=1).tolist()
    micro, current, longest = [], [], 0
    for row, length in enumerate(lengths):
        if current and max(longest, length) * (len(current) + 1) > max_tokens:
            micro.append(select_rows(batch, current))
            current, longest = [], 0
        current.append(row)
        longest = max(longest, length)
    micro.append(select_rows(batch, current))
    return micro


def split_mini_batches(batch: TrainBatch, num_mini: int, group_size: int) -> list[TrainBatch]:
    """Split a step's batch into ``num_mini`` mini-batches of whole GRPO groups (rows are group-major)."""
    num_groups = len(batch.advantages_B) // group_size
    if num_mini < 1 or num_groups % num_mini:
        raise ValueError(f"trainer.mini_batches={num_mini} must divide the step's {num_groups} groups")
    rows_per_mini = len(batch.advantages_B) // num_mini
    return [select_rows(batch, list(range(i * rows_per_mini, (i + 1) * rows_per_mini))) for i in range(num_mini)]


# -- shapes for parallel layouts (MegatronBackend) ---------------------------------------------------------


def data_parallel_shard(batch: TrainBatch, dp_rank: int, dp_size: int) -> TrainBatch:
    """This data-parallel rank's contiguous share of the batch's rows (sizes differ by at most one row).

    A rank left without rows gets one dummy row (it must still run the step: DDP reduces grads over every rank).
    """
    if dp_size == 1:
        return batch
    bounds = [len(batch.advantages_B) * i // dp_size for i in range(dp_size + 1)]
    rows = list(range(bounds[dp_rank], bounds[dp_rank + 1]))
    if not rows:
        return pad_rows(select_rows(batch, [0]), num_rows=1, width=2, keep=0)
    return select_rows(batch, rows)


def pad_rows(batch: TrainBatch, num_rows: int, width: int, keep: int | None = None) -> TrainBatch:
    """``batch`` as [num_rows, width]: real rows right-padded (attention 0, loss 0) and dummy rows appended.

    Dummy rows have loss_mask 0, advantage 0 and attention_mask 1 on every (pad) token, so that softmax always
    has a key (no NaN) and nothing reaches the loss or a metric. ``keep``: how many real rows to keep (all).
    """
    keep = len(batch.advantages_B) if keep is None else keep

    def grow(tensor: torch.Tensor | None, value, columns: int) -> torch.Tensor | None:
        if tensor is None:
            return None
        out = tensor.new_full((num_rows, columns, *tensor.shape[2:]), value)
        real = tensor[:keep, :columns]
        out[:keep, : real.shape[1]] = real
        return out

    def per_row(tensor: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([tensor[:keep], tensor.new_full((num_rows - keep,), value)])

    attention = grow(batch.attention_mask_BT, 0, width)
    attention[keep:] = 1
    return TrainBatch(
        input_ids_BT=grow(batch.input_ids_BT, 0, width),
        attention_mask_BT=attention,
        loss_mask_BT=grow(batch.loss_mask_BT, 0.0, width - 1),
        rollout_logprobs_BT=grow(batch.rollout_logprobs_BT, 0.0, width - 1),
        advantages_B=per_row(batch.advantages_B, 0.0),
        rewards_B=per_row(batch.rewards_B, 0.0),
        min_versions_B=per_row(batch.min_versions_B, 0),
        num_response_tokens=int(batch.loss_mask_BT[:keep].sum().item()),
        routed_experts_BTLK=grow(batch.routed_experts_BTLK, NO_ROUTE, width),
        old_logprobs_BT=grow(batch.old_logprobs_BT, 0.0, width - 1),
        temperatures_B=None if batch.temperatures_B is None else per_row(batch.temperatures_B, 1.0),
    )


def pad_to_common_shape(micro_batches: list[TrainBatch]) -> list[TrainBatch]:
    """Pipeline schedules send one activation shape for every micro-batch of a step: pad all to the largest."""
    num_rows = max(len(micro.advantages_B) for micro in micro_batches)
    width = max(micro.input_ids_BT.shape[1] for micro in micro_batches)
    return [
        micro if tuple(micro.input_ids_BT.shape) == (num_rows, width) else pad_rows(micro, num_rows, width)
        for micro in micro_batches
    ]
