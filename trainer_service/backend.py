"""The interface every training backend offers the trainer (``Trainer``, ``__main__``, ``ranks``, checkpoints).

``TorchBackend`` (transformers models, CPU or one GPU) and ``MegatronBackend`` (megatron-core through
megatron-bridge, any parallel layout) both satisfy it; ``tests/trainer_service/test_backend_protocol.py`` checks
their signatures against it, so a method added to one backend and used by the trainer must be added to the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from protos.records import LoraAdapter
from trainer_service.batch import TrainBatch


@runtime_checkable
class Backend(Protocol):
    temperature: float  # sampling temperature of rows that record none (`fleetrl set temperature` moves it)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One training step on ``batch`` (micro-batched, clipped); a non-finite loss or gradient skips it
        (``skipped`` = 1). Returns the step's figures, the same on every rank."""

    def policy_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] logprobs of the current policy for the batch (no grad), routes replayed when it carries them."""

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights in the HF checkpoint layout vLLM loads; a collective on several ranks (every rank iterates)."""

    def export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA only: the adapters alone in PEFT names, as vLLM's LoRA slot loads them (a collective, like
        ``export_hf_weights``); published under ``trainer.lora.sync='adapters'``."""

    def adapter_record(self) -> LoraAdapter:
        """LoRA only: what ``export_adapter_weights`` yields (rank, alpha, HF modules, expert rank)."""

    def save_checkpoint(self, directory: Path) -> None:
        """Model, optimizer and RNG state into ``directory`` (this rank's shard)."""

    def checkpoint_snapshot(self) -> Callable[[Path], None]:
        """One process: the state ``save_checkpoint`` writes, as it is now, copied to host memory; the function
        returned writes those files into a directory on any thread (the next step may train meanwhile)."""

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what ``save_checkpoint`` wrote; the next step is bit-identical to continuing."""
