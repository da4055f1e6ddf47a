"""Two rotating buffers between packing and sending, so bucket k+1 is packed while bucket k is sent.

The caller's thread packs (it owns the trainer's tensors, CUDA streams and generators); a sender thread
sends. ``acquire`` blocks until one of the ``num_buffers`` slots is free again, so at most that many
buckets are alive at once: the memory bound of the publisher side, as in vLLM's packed NCCL transfer
and NeMo-RL's refit (``packed_num_buffers = 2``).

Usage::

    with SendPipeline(send) as pipe:
        for bucket in buckets:        # packing happens inside the iterator, after acquire()
            slot = pipe.acquire()
            ... pack into slots[slot] ...
            pipe.submit(slot, packed)
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_DONE = object()


class SendPipeline:
    """Runs ``send(slot, item)`` on a worker thread; the caller packs the next slot meanwhile."""

    def __init__(self, send: Callable[[int, Any], None], num_buffers: int = 2, name: str = "weight-bus-send"):
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers}")
        self._send = send
        self._num_buffers = num_buffers
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(num_buffers):
            self._free.put(slot)
        self._ready: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_sent = 0

    def __enter__(self) -> SendPipeline:
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._ready.put(_DONE)
        # The sender's own operations carry timeouts; this join only waits for them to return.
        self._thread.join()
        if exc is None:
            self._raise_if_failed()

    def acquire(self, poll_s: float = 0.1) -> int:
        """A free slot index (blocks while both are packed or being sent); re-raises a sender error."""
        while True:
            self._raise_if_failed()
            try:
                return self._free.get(timeout=poll_s)
            except queue.Empty:
                if not self._thread.is_alive():
                    self._raise_if_failed()
                    raise RuntimeError("weight bus: the sender thread stopped without an error") from None

    def submit(self, slot: int, item: Any) -> None:
        """Hand the packed ``slot`` to the sender; it is freed once ``send`` returns."""
        self._ready.put((slot, item))

    def release(self, slot: int) -> None:
        """Give back a slot that was acquired but not submitted (nothing was left to pack)."""
        self._free.put(slot)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            job = self._ready.get()
            if job is _DONE:
                return
            slot, item = job
            if self._error is None:  # after a failure, drain without sending
                try:
                    self._send(slot, item)
                    self.num_sent += 1
                except BaseException as error:  # noqa: BLE001 - re-raised on the caller's thread
                    logger.warning("weight bus: sending slot %d failed: %s", slot, error)
                    self._error = error
            self._free.put(slot)
