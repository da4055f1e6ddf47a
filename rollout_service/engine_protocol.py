"""GenerationEngine: what the gRPC servicer, the weight follower and the server's main loop need of an engine.

Two engines satisfy it: ``RolloutEngine`` (vLLM AsyncLLM, ``engine.py``) and ``SyntheticEngine`` (the stand-in of
``synthetic_engine.py``: seeded tokens at a set rate, no vLLM). ``rollout.engine`` picks one
(``rollout_service.__main__.make_engine``); tests/rollout_service/test_synthetic_engine.py checks that both keep to
this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from protos.config import RolloutConfig
from rollout_service.engine import SampleChunk, SamplingRequest


class GenerationEngine(Protocol):
    """One engine of one rollout server: generation, operator pause/resume, and committing weight versions."""

    model_path: str
    config: RolloutConfig
    server_id: str
    policy_version: int  # the version labelling tokens sampled from now on
    vocab_size: int
    routed_experts_available: bool
    held_by_operator: bool  # paused through the API: a weight update must not resume it
    last_load_s: float  # seconds the last commit spent loading weights (reported; 0 where none are loaded)
    last_commit_paused: bool  # whether the last commit paused generation (logged by the weight follower)
    # False: a commit labels the version without loading bytes, so the weight follower fetches none
    loads_weight_bytes: bool

    async def start(self) -> None:
        """Bring the engine up; generation works after this."""

    def load(self) -> tuple[int, int, float]:
        """(running, waiting, KV-cache usage) as last seen."""

    def num_unfinished(self) -> int:
        """Requests the engine still holds."""

    def generate(self, request: SamplingRequest) -> AsyncIterator[SampleChunk]:
        """Stream chunks of every sample of ``request``; the last chunk of a sample is ``finished``."""

    async def pause(self, mode: str = "keep") -> None:
        """An operator's pause (keep | wait | abort); it holds across weight updates until ``resume``."""

    async def resume(self) -> None:
        """End an operator's pause."""

    async def abort(self, request_ids: list[str]) -> None:
        """Abort these requests; their streams end."""

    async def ipc_unopenable_reason(self, record_bytes: bytes) -> str:
        """'' when the engine can load a version straight from the trainer's CUDA IPC buckets, else why not."""

    async def commit_weights(
        self,
        version: int,
        staging_path: str,
        manifest_bytes: bytes,
        ipc_record: bytes | None = None,
        load_timeout_s: float | None = None,
    ) -> float:
        """Put ``version`` in force between a pause(keep) and a resume; returns the seconds generation was paused."""

    @property
    def errored(self) -> bool:
        """True once the engine cannot serve any more (the server must stop)."""

    def shutdown(self) -> None:
        """Release the engine."""
