"""The weight bus's section: transport, codec, buckets, snapshots, timeouts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from protos.config.base import Strict


class WeightBusConfig(Strict):
    """How new weights travel from trainer to rollout servers."""

    transport: Literal["tcp", "nccl", "ipc"] = Field(
        "tcp",
        description="'tcp': receivers pull over sockets (CPU machines, tests); 'nccl': the trainer broadcasts "
        "to one process per GPU (weight_bus.nccl) and still serves late receivers over tcp; 'ipc': a trainer that "
        "shares its GPU with the rollout engine (colocated) hands it the packed buckets by CUDA IPC handles "
        "(weight_bus.ipc), tcp for receivers that cannot open them; without CUDA at the trainer it is tcp.",
    )
    host: str = Field("127.0.0.1", description="Interface the publisher binds.")
    port: int = Field(0, ge=0, description="Publisher port; 0 picks a free one.")
    bucket_mib: float = Field(
        512.0, gt=0, description="Bucket size in MiB; a larger tensor gets a bucket of its own (nccl splits it)."
    )
    keep_versions: int = Field(4, gt=0, description="Versions the publisher keeps to serve late receivers.")
    fetch_timeout_s: float = Field(60.0, gt=0, description="Deadline of one receive without progress.")
    codec: Literal["bf16", "mxfp8"] = Field(
        "bf16",
        description="Wire codec. 'bf16': pass-through, every tensor travels in its own dtype. 'mxfp8': eligible "
        "2-D weights travel as float8_e4m3 + uint8 E8M0 scales per 1x32 block (about 52% of bf16 bytes); norms, "
        "biases, routers, e_score_correction_bias, embeddings and the LM head stay in their own dtype.",
    )
    mxfp8_rule: Literal["rceil", "floor"] = Field(
        "rceil", description="MXFP8 scale rule: 'rceil' never clips (NVIDIA recipe); 'floor' is the OCP spec rule."
    )
    quantize_embeddings: bool = Field(False, description="With codec 'mxfp8', quantize the token embeddings too.")
    quantize_lm_head: bool = Field(False, description="With codec 'mxfp8', quantize the LM head too.")
    receive_mode: Literal["dequantize", "mxfp8"] = Field(
        "dequantize",
        description="Rollout side, for MXFP8 manifests. 'dequantize': decode (q, scale) pairs to the engine's dtype "
        "at load. 'mxfp8': load the pairs as they are into an engine serving an MXFP8 checkpoint (GPU only: "
        "vLLM on CPU has no MXFP8 kernel).",
    )
    snapshot_dir: str = Field(
        "",
        description="Directory (shared with the rollout servers) where the publisher writes each version's manifest "
        "and buckets, so a receiver can load it when the publisher is unreachable; '' = off.",
    )
    keep_snapshots: int = Field(2, ge=1, le=8, description="Snapshots kept in snapshot_dir (oldest removed first).")
    send_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest the publisher waits on a receiver making no progress (tcp: one socket send; nccl: one "
        "bucket broadcast) before it gives up on that receiver.",
    )
    load_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Rollout side: longest the engine's pause before a version, and then its load, may each take. "
        "Past half of it the engine's workers print their stacks to the server's log; past all of it the server "
        "stops (the engine may hold part of the new weights) and its supervisor restarts it on the latest version.",
    )
    group_timeout_s: float = Field(
        120.0, gt=0, description="nccl: deadline for forming or re-forming the broadcast group."
    )
    heartbeat_timeout_s: float = Field(
        10.0,
        gt=0,
        description="nccl: a subscriber whose heartbeat in Redis is older than this is left out of a rebuilt group.",
    )

    @model_validator(mode="after")
    def _receive_mode_fits_codec(self) -> WeightBusConfig:
        if self.receive_mode == "mxfp8" and self.codec != "mxfp8":
            raise ValueError(
                "weight_bus.receive_mode='mxfp8' needs weight_bus.codec='mxfp8' (an MXFP8 engine cannot load "
                "bf16 weights); set codec='mxfp8' or receive_mode='dequantize'"
            )
        return self
