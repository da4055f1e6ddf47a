"""The two rotating buffers between packing and sending (weight_bus.pipeline)."""

from __future__ import annotations

import threading

import pytest

from weight_bus.pipeline import SendPipeline

pytestmark = pytest.mark.unit


def test_bucket_k_plus_1_is_packed_while_bucket_k_is_sent_with_at_most_two_alive():
    packed = [threading.Event() for _ in range(7)]
    log: list[tuple[str, int]] = []
    in_use: set[int] = set()
    max_in_use = 0

    def send(slot: int, index: int) -> None:
        log.append(("send-start", index))
        if index < 5:  # a send still going once the next bucket is packed (or after 10 s: no overlap, a failure)
            packed[index + 1].wait(timeout=10)
        log.append(("send-end", index))
        in_use.discard(slot)

    with SendPipeline(send) as pipe:
        for index in range(6):
            slot = pipe.acquire()
            assert slot not in in_use  # a slot is never packed while it is still being sent
            in_use.add(slot)
            max_in_use = max(max_in_use, len(in_use))
            log.append(("pack", index))
            packed[index].set()
            pipe.submit(slot, index)
    assert max_in_use == 2
    assert pipe.num_sent == 6
    # Overlap: bucket k+1 was packed before bucket k finished sending.
    for index in range(5):
        assert log.index(("pack", index + 1)) < log.index(("send-end", index)), log


def test_a_sender_error_reaches_the_packing_thread_and_stops_sending():
    sent: list[int] = []

    def send(slot: int, index: int) -> None:
        if index == 1:
            raise TimeoutError("bucket 1: receiver made no progress")
        sent.append(index)

    with pytest.raises(TimeoutError, match="bucket 1"):
        with SendPipeline(send) as pipe:
            for index in range(10):
                pipe.submit(pipe.acquire(), index)
    assert sent == [0]  # nothing after the failure was sent


def test_release_returns_an_unused_slot():
    with SendPipeline(lambda slot, item: None, num_buffers=1) as pipe:
        slot = pipe.acquire()
        pipe.release(slot)
        assert pipe.acquire() == slot
        pipe.release(slot)
