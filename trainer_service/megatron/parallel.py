"""torch.distributed and megatron-core's parallel groups for the Megatron backend.

Parallel layout: TP, PP, EP and DP (context parallelism is refused). ``init_distributed`` joins torchrun's world
when its environment is set, else a world of one on a free local port (gloo on the CPU, NCCL on a GPU).
"""

from __future__ import annotations

import os
import socket

import torch

from protos.config import MegatronConfig


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


def check_supported(config: MegatronConfig) -> None:
    """Refuse the layouts the backend does not implement (context parallelism)."""
    if config.context_parallel_size != 1:
        raise ValueError(
            "megatron.context_parallel_size: only 1 is implemented in MegatronBackend (TP, PP, EP and DP are)"
        )
