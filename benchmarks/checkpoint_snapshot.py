"""What a checkpoint costs the training step, before and after snapshots (trainer_service/snapshots.py).

A state of ``--gib`` GiB of tensors on the device (bf16 weights, fp32 main weights and two fp32 Adam moments, as a
megatron checkpoint holds them) is checkpointed twice:

    step_wrote     ``torch.save`` of the device state, as the step did before (the files into the page cache, the
                   device-to-host copy inside it); fsync then ran on the writer's thread (``fsync_s``)
    snapshot       ``copied``: the state copied to host memory, all the step waits for now; the writer's thread then
                   writes it (``thread_write_s``) and fsyncs it. ``snapshot_into_reused_buffers_s``: the same copy
                   into host buffers allocated and touched before (what reusing them between checkpoints would cost)

The last line printed is one JSON object. On a CUDA machine:
    PYTHONPATH=. python3 -u benchmarks/checkpoint_snapshot.py --gib 15.3 --dir /tmp/ckpt-bench
CPU run (small):
    .venv/bin/python benchmarks/checkpoint_snapshot.py --gib 0.05
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

from trainer_service.snapshots import copied


def make_state(gib: float, device: str) -> dict:
    """Tensors of about ``gib`` GiB: per 14 bytes of a parameter, bf16 weight (2) + fp32 main (4) + two moments (8)."""
    num_params = int(gib * 2**30 / 14)
    num_tensors = 64
    numel = num_params // num_tensors
    state = {"model": {}, "main": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for i in range(num_tensors):
        state["model"][f"w{i}"] = torch.randn(numel, device=device, dtype=torch.bfloat16)
        for part in ("main", "exp_avg", "exp_avg_sq"):
            state[part][f"w{i}"] = torch.randn(numel, device=device, dtype=torch.float32)
    return state


def timed_save(state: dict, path: Path) -> tuple[float, float]:
    """Seconds of ``torch.save`` and of the fsync after it."""
    started = time.monotonic()
    torch.save(state, path)
    saved = time.monotonic()
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    return saved - started, time.monotonic() - saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=15.3)
    parser.add_argument("--dir", default="/tmp/ckpt-bench")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    state = make_state(args.gib, device)
    if device == "cuda":
        torch.cuda.synchronize()
    step_wrote_s, fsync_before_s = timed_save(state, root / "step_wrote.pt")
    (root / "step_wrote.pt").unlink()
    started = time.monotonic()
    snapshot = copied(state)
    snapshot_s = time.monotonic() - started
    thread_write_s, fsync_after_s = timed_save(snapshot, root / "snapshot.pt")
    started = time.monotonic()  # the same copy into the host buffers of the first (allocated and touched already)
    for part, tensors in state.items():
        for name, tensor in tensors.items():
            snapshot[part][name].copy_(tensor)
    reused_s = time.monotonic() - started
    shutil.rmtree(root, ignore_errors=True)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "state_gib": sum(t.numel() * t.element_size() for part in state.values() for t in part.values()) / 2**30,
        "step_waited_before_s": round(step_wrote_s, 2),
        "fsync_before_s": round(fsync_before_s, 2),
        "step_waits_now_s": round(snapshot_s, 2),
        "snapshot_into_reused_buffers_s": round(reused_s, 2),
        "thread_write_s": round(thread_write_s, 2),
        "fsync_after_s": round(fsync_after_s, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
