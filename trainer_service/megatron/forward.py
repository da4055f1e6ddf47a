"""The forward pass of the Megatron backend: masks, padding, one pipeline stage's output, megatron's schedule.

PP: the schedules need one [B, T] shape for every micro-batch (``batch.pad_to_common_shape``); log-probs exist only
on the last stage. Sequence parallelism splits the sequence evenly over the TP ranks (``pad_sequence_dim``).

Shape legend: _BT [samples, tokens], _BTV [samples, tokens, vocab], _B1TT megatron's [samples, 1, tokens, tokens].
"""

from __future__ import annotations

from functools import partial

import torch

from trainer_service.fused_logprobs import fused_token_logprobs, per_token_divisors
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


def is_right_padded(attention_mask_BT: torch.Tensor) -> bool:
    """Whether every row's real tokens come first (the mask never rises again along a row)."""
    return bool((attention_mask_BT[:, 1:] <= attention_mask_BT[:, :-1]).all())


def stage_output(
    model,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float | torch.Tensor | None,
    fused_attention: bool = False,
    fused_logprobs: bool = False,
) -> torch.Tensor:
    """This pipeline stage's forward: hidden states [T, B, H] (sent on), or log-probs [B, T-1] on the last stage.

    Earlier stages' hidden states arrive through megatron's ``set_input_tensor``; the ids, positions and mask
    are given to every stage (RoPE and attention need them). ``fused_attention``: the model's core attention is
    ``FusedCoreAttention``, which needs no mask for right-padded rows. ``fused_logprobs``: the last stage scores
    the targets through ``fused_token_logprobs`` (GPTModel's ``output_processor``) instead of the logits.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    seq = input_ids_BT.shape[1]
    position_ids_BT = torch.arange(seq, device=input_ids_BT.device).expand_as(input_ids_BT)
    mask = None if fused_attention and is_right_padded(attention_mask_BT) else attention_mask_B1TT(attention_mask_BT)
    inputs = dict(input_ids=input_ids_BT, position_ids=position_ids_BT, attention_mask=mask)
    if fused_logprobs:
        return model(**inputs, output_processor=partial(_fused_lm_head_logprobs, input_ids_BT, temperature))
    output = model(**inputs)
    if not mpu.is_pipeline_last_stage():
        return output
    logits_BTV = temper(output[:, :-1].float(), temperature)  # one, or per row (batch.logit_divisors)
    return -vocab_parallel_cross_entropy(logits_BTV.contiguous(), input_ids_BT[:, 1:].contiguous())


def _fused_lm_head_logprobs(input_ids_BT, temperature, *, hidden_states, output_layer, output_weight, **unused):
    """GPTModel ``output_processor``: [B, T-1] log-probs of the next tokens from the final hidden states [T, B, H].

    The output layer's own input handling is repeated (sequence-parallel all-gather, or the identity whose backward
    sums the hidden-state gradient over the tensor-parallel ranks); its soft-cap (Beam) is applied in the tiles.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

    if getattr(output_layer.config, "use_mup", False):
        raise ValueError("trainer.fused_lm_head_logprobs does not apply MuP logit scaling; set it to false")
    group = getattr(output_layer, "tp_group", None) or mpu.get_tensor_model_parallel_group()
    if output_layer.sequence_parallel:
        hidden_TBH = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True, group=group)
    else:
        hidden_TBH = copy_to_tensor_model_parallel_region(hidden_states, group=group)
    hidden_BTH = hidden_TBH.transpose(0, 1)[:, :-1]
    batch, positions, hidden_size = hidden_BTH.shape
    weight_VH = output_layer.weight if output_weight is None else output_weight
    logprobs_N, _ = fused_token_logprobs(
        hidden_BTH.reshape(-1, hidden_size),
        weight_VH,
        input_ids_BT[:, 1:].reshape(-1),
        per_token_divisors(temperature, batch, positions, hidden_BTH.device),
        getattr(output_layer.config, "final_logit_softcapping", None),
        vocab_start=mpu.get_tensor_model_parallel_rank() * weight_VH.shape[0],
        group=group,
    )
    return logprobs_N.view(batch, positions)


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
