"""Device side of the NCCL weight bus: the two rotating device buffers, their streams, packing into them.

CUDA streams and events on a GPU; on a CPU device (the protocol tests) host stand-ins that complete at
once, so the same publisher and subscriber code runs in both.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from weight_bus import checksums, packing
from weight_bus import nccl_group as ng

POLL_S = 0.002


class HostEvent:
    """Stands in for a CUDA event on a CPU device (tests): host work is done when it returns."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostStream(HostEvent):
    cuda_stream = 0

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def new_event(device: torch.device):
    return torch.cuda.Event() if device.type == "cuda" else HostEvent()


def on_stream(stream):
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    # Pinned host memory makes the device-to-host copies asynchronous.
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


class DeviceRing:
    """Two rotating device buffers plus the streams that pack, broadcast and copy them."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = nbytes
        self.device = device
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        cuda = device.type == "cuda"
        self.comm_stream = torch.cuda.Stream(device) if cuda else HostStream()
        self.copy_stream = torch.cuda.Stream(device) if cuda else HostStream()

    def watch(self, comm, event, timeout_s: float, generation_of=None) -> ng.Outcome:
        """Poll a broadcast's completion event and the communicator's error state until an outcome."""
        deadline, generation, current, next_check = time.monotonic() + timeout_s, 0, 0, 0.0
        while True:
            now = time.monotonic()
            if generation_of is not None and now >= next_check:  # a subscriber also watches for a rebuild
                generation, current = generation_of()
                next_check = now + 0.2
            outcome = ng.watch_outcome(event.query(), comm.async_error(), now, deadline, generation, current)
            if outcome is not ng.Outcome.WAIT:
                return outcome
            time.sleep(POLL_S)


class ChunkPacker:
    """Copies encoded tensors (on the GPU) into a device buffer chunk by chunk, in layout order."""

    def __init__(self, named_tensors, codec: packing.WireCodec, entries, device: torch.device):
        self.payloads = (
            payload.detach().to(device, non_blocking=True).contiguous().view(-1).view(torch.uint8)
            for _, payload, _ in packing.encode_tensors(named_tensors, codec)
        )
        self.entries, self.cursor, self.current = entries, 0, None

    def pack(self, chunk: ng.Chunk, buffer: torch.Tensor) -> None:
        target, end = buffer[: chunk.nbytes], chunk.start + chunk.nbytes
        target.zero_()  # deterministic padding, as in tcp buckets
        while self.cursor < len(self.entries):
            entry = self.entries[self.cursor]
            if entry.bucket != chunk.bucket or (entry.offset >= end and entry.nbytes > 0):
                return
            if self.current is None:
                self.current = next(self.payloads)
            low, high = max(entry.offset, chunk.start), min(entry.offset + entry.nbytes, end)
            if high > low:
                source = self.current[low - entry.offset : high - entry.offset]
                target[low - chunk.start : high - chunk.start].copy_(source)
            if entry.offset + entry.nbytes > end:
                return  # the rest of this tensor goes into the next chunk
            self.cursor, self.current = self.cursor + 1, None


class FlatHost:
    """Host buckets addressed as one end-to-end buffer."""

    def __init__(self, buckets: list[torch.Tensor]):
        self.buckets = buckets
        self.starts = np.cumsum([0] + [len(b) for b in buckets]).tolist()

    def slice(self, chunk: ng.Chunk) -> torch.Tensor:
        return self.buckets[chunk.bucket][chunk.start : chunk.start + chunk.nbytes]

    def crc32(self, entry) -> int:
        return self.checksums([entry])[0]

    def checksums(self, entries) -> list[int]:
        """crc32 of each entry's bytes, on the shared checksum pool (all cores, not one)."""
        arrays = [bucket.numpy() for bucket in self.buckets]
        return checksums.crc32_many([arrays[e.bucket][e.offset : e.offset + e.nbytes] for e in entries])
