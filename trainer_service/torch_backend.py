"""The torch training backend: a transformers causal LM, AdamW, grad clipping, HF-layout export.

Runs on CPU (the demo's default) and on GPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch

from protos.config import TrainerConfig
from trainer_service.batch import TrainBatch
from trainer_service.losses import PolicyLossConfig, policy_loss

logger = logging.getLogger(__name__)


def loss_config(config: TrainerConfig) -> PolicyLossConfig:
    return PolicyLossConfig(
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        loss_agg=config.loss_agg,
        geo_mask=tuple(config.geo_mask) if config.geo_mask else None,
        token_tis_cap=config.token_tis_cap,
        icepop=tuple(config.icepop) if config.icepop else None,
    )


def token_logprobs(model, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probability of every next token: [B, T-1] for inputs [B, T]."""
    logits = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False).logits[:, :-1]
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)


class TorchBackend:
    """Owns the model and optimizer; ``train_step`` is one optimizer step on one batch."""

    def __init__(self, model_path: str, config: TrainerConfig, temperature: float = 1.0, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(config.seed)
        self.config = config
        self.temperature = temperature
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.99)
        )
        self.loss_config = loss_config(config)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Forward, loss, backward, clip, step. A non-finite loss or gradient skips the step."""
        ids = batch.input_ids_BT.to(self.device)
        attention = batch.attention_mask_BT.to(self.device)
        logprobs = token_logprobs(self.model, ids, attention, self.temperature)
        loss_mask = batch.loss_mask_BT.to(self.device)
        # One optimizer step per batch: pi_old is the current policy before the step.
        old_logprobs = logprobs.detach()
        loss, metrics = policy_loss(
            logprobs, old_logprobs, batch.rollout_logprobs_BT.to(self.device),
            batch.advantages_B.to(self.device), loss_mask, self.loss_config,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip))
        skipped = not (math.isfinite(loss.item()) and math.isfinite(grad_norm))
        if skipped:
            logger.error("non-finite loss %.4g or grad norm %.4g: step skipped", loss.item(), grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        metrics.update(loss=loss.item(), grad_norm=grad_norm, skipped=float(skipped))
        return metrics

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in the HF checkpoint layout vLLM loads (experts per expert, layer order)."""
        from transformers.core_model_loading import revert_weight_conversion

        state = {name: tensor.detach() for name, tensor in self.model.state_dict().items()}
        yield from revert_weight_conversion(self.model, state).items()
