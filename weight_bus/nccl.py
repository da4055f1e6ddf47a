"""NCCL transport of the weight bus: the trainer (rank 0) broadcasts each version to the rollout GPUs.

The protocol and every decision (group generations, rounds, timeouts, who is dropped) are in
``nccl_group`` and run on CPU; the NCCL calls are in ``nccl_comm``. This module moves the bytes:

Publisher, per version: plan the layout from metadata -> write the round record -> for each chunk,
pack it on the GPU into one of two rotating device buffers (MXFP8 quantized there) while the sender
thread broadcasts the other and copies it to a pinned host bucket -> checksums on the host copy ->
hold on tcp (late receivers), snapshot, manifest in Redis. A broadcast that fails or times out aborts
the communicator; the publisher drops members with stale heartbeats, forms the next generation and
re-broadcasts from the host copy. It never waits beyond ``send_timeout_s`` per broadcast and
``group_timeout_s`` per group formation; after ``MAX_ATTEMPTS`` the version is announced anyway and
receivers catch up over tcp.

Subscriber: heartbeat; join each generation that lists it; receive rounds into two rotating device
buffers, copy each chunk to the host staging buffer while the next one arrives; wait for the manifest
and verify it. Requires one GPU per rank: it cannot run as 2 ranks on one GPU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import numpy as np
import redis
import torch

from channels.nccl_board import NcclBoard
from channels.version_board import VersionBoard
from protos.records import NcclGroup, NcclMember, NcclRound, WeightManifest
from protos.redis_keys import RedisKeys
from weight_bus import nccl_group as ng
from weight_bus import packing
from weight_bus.nccl_comm import NcclCommunicator, new_unique_id
from weight_bus.nccl_device import ChunkPacker, DeviceRing, FlatHost, host_buffer, new_event, on_stream
from weight_bus.pipeline import SendPipeline
from weight_bus.sender import PublishStats, WeightSender

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


class BroadcastFailed(RuntimeError):
    def __init__(self, outcome: ng.Outcome, what: str):
        self.outcome = outcome
        super().__init__(f"weight bus (nccl): {what}: {outcome.value}")


class NcclWeightPublisher:
    """Trainer side (rank 0, the only sender). Same interface as ``WeightSender``: ``publish``, ``close``, ``tcp``."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        config,
        device: torch.device | None = None,
        comm_factory: Callable[[bytes, int, int], NcclCommunicator] = NcclCommunicator,
        unique_id_factory: Callable[[], bytes] = new_unique_id,
    ):
        self.client, self.keys, self.config = client, keys, config
        self.comm_factory, self.unique_id_factory = comm_factory, unique_id_factory
        self.nccl_board = NcclBoard(client, keys)
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        # tcp hold (late receivers), snapshots, announce; its host buffers (pinned on a GPU) are recycled once a
        # version is dropped and no receiver reads it any more: allocating GBs of pinned memory per version is slow
        self.fallback = WeightSender(client, keys, config, transport="nccl", pinned=self.device.type == "cuda")
        self.tcp = self.fallback.tcp
        self.codec = self.fallback.codec
        self.ring = DeviceRing(self.fallback.bytes_per_bucket, self.device)
        self.group: NcclGroup | None = self.nccl_board.read_group()  # generations stay monotonic
        self.comm: NcclCommunicator | None = None

    def publish(self, version: int, named_tensors) -> PublishStats:
        started = time.monotonic()
        named = list(named_tensors)  # the layout is planned from metadata before the first byte moves
        entries, sizes = packing.plan_layout(packing.encoded_metas(named, self.codec), self.fallback.bytes_per_bucket)
        arrays = [self.tcp.allocate(size) for size in sizes]
        host = [torch.from_numpy(array) for array in arrays]
        self._ensure_group()
        failure = self._run_round(version, sizes, host, ChunkPacker(named, self.codec, entries, self.device))
        for _ in range(MAX_ATTEMPTS - 1):
            if failure is None:
                break
            self._rebuild_after(failure)
            failure = self._run_round(version, sizes, host, None)
        if failure is not None:
            logger.error("weight bus (nccl): v%d not broadcast (%s); receivers catch up over tcp", version, failure)
        manifest = self._manifest(version, entries, sizes, host)
        self.fallback.announce(manifest, arrays)  # the arrays themselves, so the pool gets back what it gave
        return PublishStats(version, time.monotonic() - started, len(entries), sum(sizes), len(sizes))

    def _run_round(self, version, sizes, host, packer: ChunkPacker | None) -> BroadcastFailed | None:
        """Pack (or reload from ``host``) and broadcast every chunk; host gets a copy of each chunk.

        A failed broadcast does not stop packing: the host copy must be complete for tcp and the retry.
        """
        comm, group = (self.comm if self.comm is not None and self.comm.alive else None), self.group
        if packer is None and comm is None:
            return None  # a retry with nobody left to send to
        if comm is not None and group is not None:
            record = NcclRound(group.generation, version, sizes, self.ring.nbytes, time.time())
            self.nccl_board.write_round(record)
        host_flat = FlatHost(host)
        failure: list[BroadcastFailed] = []

        def send(slot: int, item) -> None:
            chunk, packed = item
            buffer = self.ring.buffers[slot]
            if comm is not None and not failure:
                try:
                    self._broadcast(comm, buffer, chunk, packed)
                except (BroadcastFailed, TimeoutError, RuntimeError) as error:
                    comm.abort()
                    if not isinstance(error, BroadcastFailed):
                        error = BroadcastFailed(ng.Outcome.FAILED, str(error))
                    failure.append(error)
            if packer is not None:  # first pass: keep the host copy
                with on_stream(self.ring.copy_stream):
                    self.ring.copy_stream.wait_event(packed)
                    host_flat.slice(chunk).copy_(buffer[: chunk.nbytes], non_blocking=True)
                self.ring.copy_stream.synchronize()

        with SendPipeline(send) as pipe:
            for chunk in ng.plan_chunks(sizes, self.ring.nbytes):
                slot = pipe.acquire()
                buffer = self.ring.buffers[slot]
                if packer is not None:
                    packer.pack(chunk, buffer)
                else:
                    buffer[: chunk.nbytes].copy_(host_flat.slice(chunk), non_blocking=True)
                packed = new_event(self.device)
                packed.record()
                pipe.submit(slot, (chunk, packed))
        return failure[0] if failure else None

    def _broadcast(self, comm: NcclCommunicator, buffer: torch.Tensor, chunk: ng.Chunk, packed) -> None:
        stream = self.ring.comm_stream
        stream.wait_event(packed)
        comm.broadcast(buffer, chunk.nbytes, 0, stream.cuda_stream, self.config.send_timeout_s)
        done = new_event(self.device)
        done.record(stream)
        outcome = self.ring.watch(comm, done, self.config.send_timeout_s)
        if outcome is not ng.Outcome.DONE:
            raise BroadcastFailed(outcome, f"chunk {chunk.offset}+{chunk.nbytes} of generation {self.group.generation}")

    def _ensure_group(self) -> None:
        beats = self.nccl_board.read_heartbeats()
        alive = ng.alive_members(beats, time.time(), self.config.heartbeat_timeout_s)
        connected = self.comm is not None and self.comm.alive
        if not ng.needs_new_group(self.group, alive) and (connected or not alive):
            return
        self._form_group(alive)

    def _rebuild_after(self, failure: BroadcastFailed) -> None:
        keep, drop = ng.members_to_keep(
            self.group, self.nccl_board.read_heartbeats(), time.time(), self.config.heartbeat_timeout_s
        )
        logger.warning("%s; rebuilding the group without %s", failure, drop or "nobody (no stale heartbeat)")
        self._form_group(keep)

    def _form_group(self, members: list[str]) -> None:
        """Write the next generation and join it as rank 0; members that never join are dropped once."""
        for _ in range(2):
            if self.comm is not None:
                self.comm.abort()
                self.comm = None
            self.group = ng.next_group(self.group, members, self.unique_id_factory() if members else b"", time.time())
            self.nccl_board.write_group(self.group)
            if not members:
                return
            comm = self.comm_factory(self.group.unique_id, self.group.world_size, 0)
            try:
                comm.wait_ready(self.config.group_timeout_s, f"forming generation {self.group.generation}")
                self.comm = comm
                return
            except (TimeoutError, RuntimeError) as error:
                beats = self.nccl_board.read_heartbeats()
                members = [m for m in members if m in beats and beats[m].generation == self.group.generation]
                logger.warning("weight bus (nccl): %s; retrying with %s", error, members)

    def _manifest(self, version, entries, sizes, host) -> WeightManifest:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        flat = FlatHost(host)
        crcs = flat.checksums(entries)
        tensors = [msgspec.structs.replace(e, checksum=crc) for e, crc in zip(entries, crcs, strict=True)]
        return WeightManifest(version, tensors, sizes, self.tcp.address, "nccl", time.time())

    def close(self) -> None:
        if self.comm is not None:
            self.comm.abort()
        self.fallback.close()


class NcclWeightSubscriber:
    """Rollout side: one GPU process is one rank. ``receive`` returns the next verified version."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        config,
        member_id: str,
        device: torch.device | None = None,
        comm_factory: Callable[[bytes, int, int], NcclCommunicator] = NcclCommunicator,
    ):
        self.client, self.keys, self.config, self.member_id = client, keys, config, member_id
        self.comm_factory = comm_factory
        self.nccl_board = NcclBoard(client, keys)
        self.board = VersionBoard(client, keys)
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.generation = 0
        self.version = 0
        self.comm: NcclCommunicator | None = None
        self.ring: DeviceRing | None = None
        self._bounce: list[torch.Tensor] = []
        self._receiving = False
        self._progress_s = time.time()
        self._stop = threading.Event()
        self._beat()
        self._beater = threading.Thread(target=self._beat_loop, name=f"nccl-heartbeat-{member_id}", daemon=True)
        self._beater.start()

    def _beat(self) -> None:
        if self._receiving:  # the receive loop runs, with its own deadlines: it takes part in broadcasts
            self._progress_s = time.time()
        member = NcclMember(self.member_id, self.generation, self.version, time.time(), self._progress_s)
        self.nccl_board.heartbeat(member)

    def _beat_loop(self) -> None:
        while not self._stop.wait(ng.HEARTBEAT_S):
            try:
                self._beat()
            except redis.RedisError as error:  # Redis restarting: the next beat retries
                logger.warning("weight bus (nccl): heartbeat of %s failed: %s", self.member_id, error)

    def receive(self, min_version: int, into, timeout_s: float) -> WeightManifest:
        """Receive the next version newer than ``min_version`` into host ``into``; verify; return its manifest.

        ``into`` is a buffer, or a callable ``into(nbytes) -> buffer`` asked once a round announces its size (a
        rollout server stages each version in a file of that size). Raises TimeoutError when none arrives within
        ``timeout_s`` (the caller then catches up over tcp) and ChecksumError when the bytes do not match.
        """
        self._receiving = True
        self._beat()
        try:
            buffer_for = into if callable(into) else (lambda nbytes: into)
            return self._receive(min_version, buffer_for, timeout_s)
        finally:
            self._receiving = False

    def _receive(self, min_version: int, buffer_for, timeout_s: float) -> WeightManifest:
        deadline, received, view = time.monotonic() + timeout_s, None, None
        while time.monotonic() < deadline:
            group = self.nccl_board.read_group()
            if group is not None and group.generation > self.generation and group.rank_of(self.member_id):
                self._join(group)
                received = None  # a rebuilt group re-broadcasts the version
                continue
            if received is not None:
                manifest = self.board.manifest(received.version)
                if manifest is not None:
                    packing.verify(manifest, view)
                    self.version = manifest.version
                    return manifest
            else:
                record = self.nccl_board.read_round()
                if (
                    self.comm is not None
                    and record is not None
                    and record.generation == self.generation
                    and record.version > min_version
                ):
                    view = memoryview(buffer_for(sum(record.bucket_nbytes))).cast("B")
                    if self._receive_round(record, view) is ng.Outcome.DONE:
                        received = record
                    continue
            time.sleep(0.02)
        raise TimeoutError(
            f"weight bus (nccl): {self.member_id} got no version newer than v{min_version} in {timeout_s:.1f}s"
        )

    def _join(self, group: NcclGroup) -> None:
        if self.comm is not None:
            self.comm.abort()
            self.comm = None
        self.generation = group.generation  # the heartbeat now says we are joining it
        self._beat()
        comm = self.comm_factory(group.unique_id, group.world_size, group.rank_of(self.member_id))
        try:
            comm.wait_ready(self.config.group_timeout_s, f"joining generation {group.generation}")
            self.comm = comm
        except (TimeoutError, RuntimeError) as error:
            logger.warning("weight bus (nccl): %s could not join: %s", self.member_id, error)

    def _generations(self) -> tuple[int, int]:
        group = self.nccl_board.read_group()
        return self.generation, group.generation if group is not None else 0

    def _receive_round(self, record: NcclRound, view: memoryview) -> ng.Outcome:
        total = sum(record.bucket_nbytes)
        if view.nbytes < total:
            raise ValueError(f"receive buffer holds {view.nbytes} bytes, v{record.version} needs {total}")
        if self.ring is None or self.ring.nbytes != record.buffer_nbytes:
            self.ring = DeviceRing(record.buffer_nbytes, self.device)
            self._bounce = [host_buffer(record.buffer_nbytes, self.device) for _ in range(2)]
        target = np.frombuffer(view, dtype=np.uint8)
        in_flight: list[tuple[torch.cuda.Event, ng.Chunk] | None] = [None, None]
        for index, chunk in enumerate(ng.plan_chunks(record.bucket_nbytes, record.buffer_nbytes)):
            slot = index % 2
            self._flush(in_flight, slot, target)  # the slot's previous chunk is on the host before reuse
            outcome = self._receive_chunk(slot, chunk)
            if outcome is not ng.Outcome.DONE:
                self.comm.abort()
                self.comm = None
                logger.warning("weight bus (nccl): %s lost v%d: %s", self.member_id, record.version, outcome.value)
                return outcome
            done = new_event(self.device)
            with on_stream(self.ring.copy_stream):
                self.ring.copy_stream.wait_stream(self.ring.comm_stream)
                self._bounce[slot][: chunk.nbytes].copy_(self.ring.buffers[slot][: chunk.nbytes], non_blocking=True)
                done.record()
            in_flight[slot] = (done, chunk)
        for slot in (0, 1):
            self._flush(in_flight, slot, target)
        return ng.Outcome.DONE

    def _receive_chunk(self, slot: int, chunk: ng.Chunk) -> ng.Outcome:
        stream, timeout_s = self.ring.comm_stream, self.config.send_timeout_s
        try:
            self.comm.broadcast(self.ring.buffers[slot], chunk.nbytes, 0, stream.cuda_stream, timeout_s)
        except (TimeoutError, RuntimeError):
            return ng.Outcome.FAILED
        done = new_event(self.device)
        done.record(stream)
        return self.ring.watch(self.comm, done, timeout_s, generation_of=self._generations)

    def _flush(self, in_flight, slot: int, target: np.ndarray) -> None:
        if in_flight[slot] is None:
            return
        event, chunk = in_flight[slot]
        event.synchronize()
        target[chunk.offset : chunk.offset + chunk.nbytes] = self._bounce[slot][: chunk.nbytes].numpy()
        in_flight[slot] = None

    def close(self) -> None:
        self._stop.set()
        self._beater.join(timeout=5)
        self.nccl_board.leave(self.member_id)
        if self.comm is not None:
            self.comm.abort()
