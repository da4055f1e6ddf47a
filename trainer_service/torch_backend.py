"""The torch training backend: a transformers causal LM, AdamW, grad clipping, HF-layout export.

Runs on CPU (the demo's default) and on GPU. ``trainer.lora.rank > 0`` trains low-rank adapters on a frozen
base (``trainer_service.lora``): the optimizer holds only the adapters, checkpoints hold only the adapters, and
the export is the merged weights of the adapted layers, or the adapters alone (``export_adapter_weights``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.nn.utils import parametrize

from protos.config import TrainerConfig
from protos.records import LoraAdapter
from trainer_service import lora
from trainer_service.batch import TrainBatch, logit_divisors, split_micro_batches
from trainer_service.fused_logprobs import fused_token_logprobs, per_token_divisors
from trainer_service.losses import PolicyLossConfig, loss_denominator, policy_loss
from trainer_service.routing_replay import forced_routing

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


def token_logprobs(
    model,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float | torch.Tensor | None,
    fused: bool = False,
) -> torch.Tensor:
    """Log-probability of every next token: [B, T-1] for inputs [B, T], at ``temperature`` (one, or [B] per row).

    ``fused``: from the final hidden states through the LM head in tiles (``fused_logprobs``), with the model's
    final logit soft-cap (``config.final_logit_softcapping``, Beam) if it has one; the logits are never built.
    """
    if fused:
        return _fused_token_logprobs(model, input_ids_BT, attention_mask_BT, temperature)
    logits = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False).logits[:, :-1]
    logprobs = torch.log_softmax(temper(logits.float(), temperature), dim=-1)
    return logprobs.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)


def _fused_token_logprobs(model, input_ids_BT, attention_mask_BT, temperature) -> torch.Tensor:
    decoder = getattr(model, model.base_model_prefix)
    hidden_BTH = decoder(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False).last_hidden_state
    hidden_BTH = hidden_BTH[:, :-1]
    batch, positions, hidden_size = hidden_BTH.shape
    logprobs_N, _ = fused_token_logprobs(
        hidden_BTH.reshape(-1, hidden_size),
        model.get_output_embeddings().weight,
        input_ids_BT[:, 1:].reshape(-1),
        per_token_divisors(temperature, batch, positions, hidden_BTH.device),
        getattr(model.config, "final_logit_softcapping", None),
    )
    return logprobs_N.view(batch, positions)


def temper(logits_BTV: torch.Tensor, temperature: float | torch.Tensor | None) -> torch.Tensor:
    """Logits divided by the sampling temperature: one for all rows, or [B] (``batch.logit_divisors``); None, 0 and
    1 leave them as they are."""
    if isinstance(temperature, torch.Tensor):
        return logits_BTV / temperature.to(logits_BTV)[:, None, None]
    if temperature is not None and temperature > 0 and temperature != 1.0:
        return logits_BTV / temperature
    return logits_BTV


class TorchBackend:
    """Owns the model, optimizer and LR schedule; ``train_step`` is one optimizer step on one batch."""

    def __init__(self, model_path: str, config: TrainerConfig, temperature: float = 1.0, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        import modeling.beam  # noqa: F401 - registers model_type "beam" with transformers' Auto classes

        torch.manual_seed(config.seed)
        self.config = config
        self.temperature = temperature
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.train()
        if config.lora.enabled:
            adapted = lora.apply_lora(self.model, config.lora)
            logger.info(
                "LoRA rank %d on %d weights (%s)", config.lora.rank, adapted, ", ".join(config.lora.target_modules)
            )
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.99)
        )
        warmup = config.lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.loss_config = loss_config(config)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward per micro-batch, clip, step. A non-finite loss or gradient skips the step."""
        micro_batches = split_micro_batches(batch, self.config.micro_batch_tokens)
        agg = self.loss_config.loss_agg
        total = loss_denominator(batch.loss_mask_BT, agg)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, metrics = 0.0, {}
        for micro in micro_batches:
            weight = loss_denominator(micro.loss_mask_BT, agg) / total
            with parametrize.cached():  # merge each adapted weight once per forward, not once per use
                loss, micro_metrics = self._micro_step(micro)
            (loss * weight).backward()
            loss_sum += loss.item() * weight
            for key, value in micro_metrics.items():  # figures of the step = weighted mean of its parts
                metrics[key] = metrics.get(key, 0.0) + value * weight
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, self.config.grad_clip))
        skipped = not (math.isfinite(loss_sum) and math.isfinite(grad_norm))
        if skipped:
            logger.error("non-finite loss %.4g or grad norm %.4g: step skipped", loss_sum, grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
        metrics.update(
            loss=loss_sum,
            grad_norm=grad_norm,
            skipped=float(skipped),
            micro_batches=float(len(micro_batches)),
            lr=self.scheduler.get_last_lr()[0],
        )
        return metrics

    def _micro_step(self, micro: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        ids = micro.input_ids_BT.to(self.device)
        routes = None if micro.routed_experts_BTLK is None else micro.routed_experts_BTLK.to(self.device)
        with forced_routing(self.model, routes):  # R3: the experts the rollout engine chose (None: natural)
            logprobs = token_logprobs(
                self.model,
                ids,
                micro.attention_mask_BT.to(self.device),
                logit_divisors(micro, self.temperature),
                fused=self.config.fused_lm_head_logprobs,
            )
        # pi_old: fixed at the training step's start (mini-batches), else the current policy before this update.
        old = logprobs.detach() if micro.old_logprobs_BT is None else micro.old_logprobs_BT.to(self.device)
        return policy_loss(
            logprobs,
            old,
            micro.rollout_logprobs_BT.to(self.device),
            micro.advantages_B.to(self.device),
            micro.loss_mask_BT.to(self.device),
            self.loss_config,
        )

    @torch.no_grad()
    def policy_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] logprobs of the current policy for the whole batch (pi_old of a step in mini-batches)."""
        out = torch.zeros_like(batch.rollout_logprobs_BT)
        rows = 0
        for micro in split_micro_batches(batch, self.config.micro_batch_tokens):
            routes = None if micro.routed_experts_BTLK is None else micro.routed_experts_BTLK.to(self.device)
            with forced_routing(self.model, routes), parametrize.cached():
                logprobs = token_logprobs(
                    self.model,
                    micro.input_ids_BT.to(self.device),
                    micro.attention_mask_BT.to(self.device),
                    logit_divisors(micro, self.temperature),
                    fused=self.config.fused_lm_head_logprobs,
                )
            out[rows : rows + logprobs.shape[0], : logprobs.shape[1]] = logprobs.cpu()
            rows += logprobs.shape[0]
        return out

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in the HF checkpoint layout vLLM loads (experts per expert, layer order).

        Under LoRA: the merged weights of the adapted layers only (``lora.is_published``).
        """
        from transformers.core_model_loading import revert_weight_conversion

        state = lora.merged_state(self.model)
        yield from lora.published(iter(revert_weight_conversion(self.model, state).items()), self.config.lora)

    def export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA only: the adapters alone in PEFT names, as vLLM's LoRA slot loads them (``lora.adapter_weights``)."""
        yield from lora.adapter_weights(self.model, self.config.lora)

    def adapter_record(self) -> LoraAdapter:
        """LoRA only: what ``export_adapter_weights`` yields (rank, alpha, HF modules, expert rank)."""
        return lora.adapter_record(self.config.lora, lora.expert_adapter_rank(self.model, self.config.lora))

    def save_checkpoint(self, directory: Path) -> None:
        """Model (LoRA: the adapters) as safetensors; optimizer, LR schedule and RNG as a tensors-only torch file."""
        self.checkpoint_snapshot()(directory)

    def checkpoint_snapshot(self) -> Callable[[Path], None]:
        """The state of ``save_checkpoint`` as it is now, copied to host memory (into the previous snapshot's buffers,
        whose files must be written by now); the function returned writes it."""
        from safetensors.torch import save_file

        from trainer_service.snapshots import copied, model_tensors

        previous_tensors, previous_state = getattr(self, "_snapshot", (None, None))
        if self.config.lora.enabled:
            name, metadata = "adapters.safetensors", None
            tensors = copied({k: v.contiguous() for k, v in lora.adapter_state(self.model).items()}, previous_tensors)
        else:
            name, (tensors, metadata) = "model.safetensors", model_tensors(self.model, previous_tensors)
        state = copied(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "cpu_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
            previous_state,
        )
        self._snapshot = (tensors, state)

        def write(directory: Path) -> None:
            save_file(tensors, str(Path(directory) / name), metadata=metadata or None)
            torch.save(state, Path(directory) / "optimizer.pt")

        return write

    def load_checkpoint(self, directory: Path) -> None:
        from safetensors.torch import load_model

        if self.config.lora.enabled:
            self._load_adapters(directory / "adapters.safetensors")
        else:
            load_model(self.model, str(directory / "model.safetensors"), device=str(self.device))
        # weights_only: the file holds tensors, numbers and dicts; nothing executable is unpickled.
        state = torch.load(directory / "optimizer.pt", weights_only=True, map_location=self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["cpu_rng"])
        if state["cuda_rng"]:
            torch.cuda.set_rng_state_all(state["cuda_rng"])

    def _load_adapters(self, path: Path) -> None:
        from safetensors.torch import load_file

        if not path.exists():
            raise FileNotFoundError(
                f"{path}: no adapters in this checkpoint (was it written with trainer.lora.rank=0?)"
            )
        saved = load_file(str(path), device=str(self.device))
        current = lora.adapter_state(self.model)
        if saved.keys() != current.keys():
            raise ValueError(
                f"{path}: adapters {len(saved)} tensors, this model {len(current)}: trainer.lora (rank, target_modules) "
                "must match the run that wrote the checkpoint"
            )
        with torch.no_grad():
            for name, tensor in current.items():
                if saved[name].shape != tensor.shape:
                    raise ValueError(
                        f"{path}: {name} has shape {tuple(saved[name].shape)}, trainer.lora.rank gives "
                        f"{tuple(tensor.shape)}"
                    )
                tensor.copy_(saved[name])
