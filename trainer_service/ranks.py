"""The trainer as several ranks (torchrun): collectives on msgspec/JSON bytes, and rank 0's feed of orders.

Layout: every rank builds the same backend and ``Trainer`` and runs the same ``Trainer.step`` on the same groups
(deterministic, so staleness drops, mini-batches and ledgers agree). Only rank 0 talks to Redis: it reads the
queue, filters by the ledger, reads control commands, publishes weights, writes the trainer state and acknowledges
entries. It hands the other ranks ``protos.records.StepOrder`` records, msgspec bytes in a uint8 tensor (length first, no pickle):

    TRAIN     one step's groups
    CONTROL   operator commands (``sync``, ``set``) read while waiting for groups; applied on every rank at once,
              so a ``sync`` (a collective export) runs at a step boundary on all ranks
    STOP      rank 0 was asked to stop (SIGTERM): every rank leaves the loop at the same step boundary
    ERROR     rank 0 failed (e.g. no groups within ``trainer.batch_timeout_s``): every rank raises

The other ranks wait for the next order inside a broadcast, so the process group's timeout
(``process_group_timeout_s``) must exceed ``trainer.batch_timeout_s``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

import torch

from protos.records import OrderKind, StepOrder, TrajectoryGroup, decode_order, encode

logger = logging.getLogger(__name__)


def world_rank() -> int:
    """This process's rank: torch.distributed's once joined, torchrun's ``RANK`` before that, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def process_group_timeout_s(batch_timeout_s: float) -> float:
    """Collectives wait at least this long: ranks > 0 sit in a broadcast while rank 0 waits for groups."""
    return max(1800.0, 2 * batch_timeout_s + 300.0)


# -- collectives on bytes --------------------------------------------------------------------------------------


def collective_device(group=None) -> torch.device:
    """Where a collective's tensors must live: the current GPU for NCCL groups, else the CPU (gloo)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_bytes(payload: bytes | None, src: int = 0, group=None) -> bytes:
    """``payload`` of rank ``src`` on every rank of ``group`` (``src`` is a global rank): length, then bytes."""
    import torch.distributed as dist

    device = collective_device(group)
    sender = dist.get_rank() == src
    length = torch.tensor([len(payload) if sender else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    if sender:
        buffer = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        )
        buffer = buffer.to(device)
    else:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if buffer.numel():
        dist.broadcast(buffer, src=src, group=group)
    return payload if sender else buffer.cpu().numpy().tobytes()


def broadcast_json(value, src: int = 0, group=None):
    """A JSON value of rank ``src`` on every rank (floats round-trip exactly)."""
    return json.loads(broadcast_bytes(json.dumps(value).encode(), src, group))


def broadcast_tensor(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """``tensor`` of rank ``src`` on every rank; the others pass a tensor of the same shape and dtype to fill."""
    import torch.distributed as dist

    tensor = tensor.contiguous()
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank when ``flag`` is True on any rank of ``group``."""
    import torch.distributed as dist

    value = torch.tensor([1.0 if flag else 0.0], device=collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


# -- rank 0 -> all ranks: what to do next -----------------------------------------------------------------------


def send_order(order: StepOrder) -> None:
    broadcast_bytes(encode(order), src=0)


def receive_order() -> StepOrder:
    return decode_order(broadcast_bytes(None, src=0))


class OrderFeed:
    """Each rank's source of the next step's groups.

    Rank 0 (``read_groups`` given) reads them and broadcasts them when the world has several ranks; the others
    receive. ``read_groups(relay)`` gets ``relay_commands`` for the commands it reads while it waits;
    ``apply_commands(sync, settings)`` acts on them on every rank at the same point.
    """

    def __init__(
        self,
        read_groups: Callable[[Callable[[bool, list[tuple[str, str]]], None]], list[TrajectoryGroup]] | None,
        apply_commands: Callable[[bool, list[tuple[str, str]]], None],
    ):
        self.read_groups = read_groups
        self.apply_commands = apply_commands
        self.multi_rank = world_size() > 1

    def next_groups(self, stop) -> list[TrajectoryGroup] | None:
        """The next step's groups on every rank, or None when the run stops (rank 0 was asked to)."""
        if self.read_groups is None:
            return self._receive()
        if stop.is_set():
            if self.multi_rank:
                send_order(StepOrder(OrderKind.STOP))
            return None
        try:
            groups = self.read_groups(self.relay_commands)
        except BaseException as error:
            if self.multi_rank:  # the other ranks must not wait for an order that never comes
                send_order(StepOrder(OrderKind.ERROR, message=f"{type(error).__name__}: {error}"[:2000]))
            raise
        if not groups:  # stopped while waiting
            return self.next_groups(stop)
        if self.multi_rank:
            send_order(StepOrder(OrderKind.TRAIN, groups=groups))
        return groups

    def relay_commands(self, sync: bool, settings: list[tuple[str, str]]) -> None:
        """Rank 0: hand control commands to every rank (they sit in ``next_groups``), then act on them here."""
        if not sync and not settings:
            return
        if self.multi_rank:
            send_order(StepOrder(OrderKind.CONTROL, sync=sync, settings=settings))
        self.apply_commands(sync, settings)

    def _receive(self) -> list[TrajectoryGroup] | None:
        while True:
            order = receive_order()
            if order.kind == OrderKind.CONTROL:
                self.apply_commands(order.sync, list(order.settings))
            elif order.kind == OrderKind.TRAIN:
                return list(order.groups)
            elif order.kind == OrderKind.STOP:
                return None
            else:
                raise RuntimeError(f"trainer rank 0 failed, stopping rank {world_rank()}: {order.message}")


def publish_weights(publisher, backend, version: int) -> float:
    """Every rank iterates the (collective) export; rank 0 hands it to ``publisher``, the others drain it."""
    from trainer_service.publisher import policy_update

    tensors, adapter = policy_update(backend)
    if publisher is not None:
        return publisher.publish(version, tensors, adapter)
    for _name, _tensor in tensors:
        pass
    return 0.0


class _PathAnnouncingBackend:
    """Rank 0's backend inside ``CheckpointManager.save``: tells the other ranks where to write their shards."""

    def __init__(self, backend):
        self.backend = backend
        self.model = backend.model  # the free-space check counts its parameters

    def save_checkpoint(self, directory) -> None:
        broadcast_bytes(str(directory).encode(), src=0)
        self.backend.save_checkpoint(directory)


def save_checkpoint(checkpoints, backend, state) -> None:
    """Every rank writes its model/optimizer shard into the directory rank 0 prepared; rank 0 writes the trainer
    state and publishes the checkpoint. Returns on rank 0 once every rank's shard is written (a barrier)."""
    from trainer_service.checkpoint import CheckpointSpaceError

    if world_size() == 1:
        checkpoints.save(backend, state)
    elif world_rank() == 0:
        try:
            checkpoints.save(_PathAnnouncingBackend(backend), state)
        except CheckpointSpaceError:
            broadcast_bytes(b"", src=0)  # refused before the path went out: the other ranks wait for it
            raise
    else:
        directory = broadcast_bytes(None, src=0).decode()
        if not directory:
            raise CheckpointSpaceError("rank 0 refused the checkpoint: no room for it (its log says where)")
        backend.save_checkpoint(directory)


def resolve_checkpoint(checkpoints, resume: str):
    """The checkpoint every rank resumes from: rank 0 resolves ``trainer.resume`` and tells the others."""
    from pathlib import Path

    restored = checkpoints.resolve(resume) if world_rank() == 0 else None
    if world_size() > 1:
        restored = broadcast_json(str(restored or "") if world_rank() == 0 else None) or None
    return Path(restored) if restored else None
