"""The forward pass of the Megatron backend: masks, padding, one pipeline stage's output, megatron's schedule.

PP: the schedules need one [B, T] shape for every micro-batch (``batch.pad_to_common_shape``); log-probs exist only
on the last stage. Sequence parallelism splits the sequence evenly over the TP ranks (``pad_sequence_dim``).

Shape legend: _BT [samples, tokens], _BTV [samples, tokens, vocab], _B1TT megatron's [samples, 1, tokens, tokens].
"""

from __future__ import annotations

import torch

from trainer_service.megatron import cpu_shims
from trainer_service.torch_backend import temper


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


def stage_output(
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


def forward_backward(model: list, step_fn, forward_only: bool, shape: tuple[int, int], micro_batches=None) -> list:
    """megatron's schedule for this layout; returns the loss functions' outputs (last stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batches = micro_batches or [None]
    # The schedule keeps its token counter on device="cuda".
    with cpu_shims.cuda_tensors_on_cpu():
        return get_forward_backward_func()(
            forward_step_func=step_fn,
            data_iterator=iter(micro_batches),
            model=model,
            num_microbatches=len(micro_batches),
            seq_length=shape[1],
            micro_batch_size=shape[0],
            forward_only=forward_only,
        )
