"""Peak memory and time of the LM-head log-prob loss, fused (``trainer_service.fused_logprobs``) vs unfused.

The loss is ``sum_t w_t * logprob_t`` over the response tokens, forward and backward (gradients of the hidden
states and of the LM-head weight), with Beam's final logit soft-cap (30) and a sampling temperature per row.
Unfused: the whole [N, V] logits (matmul, fp32, soft-cap, temperature, log-softmax, gather), as the trainer
computed them before. Fused: the same through tiles of ``--token-chunk`` x ``--vocab-chunk``.

Default sizes (GPU, bf16): 8 rows x 1,024 = 8,192 response tokens, vocabulary 151,936, hidden 5,120 (Beam).
Peak memory is what the loss adds on top of its inputs: on a GPU ``torch.cuda.max_memory_allocated`` minus what was
allocated before; on a CPU (``--tiny``) the bytes of live tensors created inside the loss (a dispatch-mode meter).
Values are compared on fp32 copies of the same inputs (log-probs, entropy, both gradients), goal 1e-5 relative.
The two paths alternate for ``--rounds`` rounds; medians. Last line: one JSON object. On a CUDA machine:
    PYTHONPATH=. python3 benchmarks/fused_logprobs.py
CPU run (small sizes, fp32):
    .venv/bin/python benchmarks/fused_logprobs.py --tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer_service.fused_logprobs import fused_token_logprobs, reference_token_logprobs

SIZES = {
    "full": dict(rows=8, row_tokens=1024, vocab=151936, hidden=5120, token_chunk=4096, vocab_chunk=16384),
    "tiny": dict(rows=8, row_tokens=128, vocab=8192, hidden=64, token_chunk=256, vocab_chunk=1024),
}
SOFTCAP = 30.0


class LiveTensorMeter(TorchDispatchMode):
    """Bytes of tensor storage created inside the mode and still alive, and their peak (views count once)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key)
        return out


def make_inputs(size: dict, dtype: torch.dtype, device: str, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = size["rows"] * size["row_tokens"]
    hidden_NH = torch.randn(tokens, size["hidden"], generator=generator).to(device, dtype).requires_grad_()
    weight_VH = (torch.randn(size["vocab"], size["hidden"], generator=generator) * size["hidden"] ** -0.5 * 4).to(
        device, dtype
    )
    targets_N = torch.randint(0, size["vocab"], (tokens,), generator=generator).to(device)
    temperatures_B = torch.linspace(0.6, 1.2, size["rows"])
    divisors_N = temperatures_B[:, None].expand(-1, size["row_tokens"]).reshape(-1).to(device)
    upstream_N = torch.randn(tokens, generator=generator).to(device)
    return hidden_NH, weight_VH.requires_grad_(), targets_N, divisors_N, upstream_N


def loss_and_grads(fused: bool, inputs, size: dict, with_entropy: bool = False):
    hidden_NH, weight_VH, targets_N, divisors_N, upstream_N = inputs
    if fused:
        chunks = dict(token_chunk=size["token_chunk"], vocab_chunk=size["vocab_chunk"])
        logprobs_N, entropy_N = fused_token_logprobs(
            hidden_NH, weight_VH, targets_N, divisors_N, SOFTCAP, with_entropy=with_entropy, **chunks
        )
    else:
        logprobs_N, entropy_N = reference_token_logprobs(
            hidden_NH, weight_VH, targets_N, divisors_N, SOFTCAP, with_entropy=with_entropy
        )
    loss = (upstream_N * logprobs_N).sum() + (entropy_N.sum() if with_entropy else 0.0)
    grads = torch.autograd.grad(loss, (hidden_NH, weight_VH))
    return logprobs_N.detach(), None if entropy_N is None else entropy_N.detach(), grads


def measure(fused: bool, inputs, size: dict, cuda: bool) -> tuple[float, float]:
    """(seconds, peak bytes the loss added) of one forward + backward."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        result = loss_and_grads(fused, inputs, size)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated() - before
    else:  # timed without the meter, whose per-op bookkeeping would dominate
        started = time.perf_counter()
        loss_and_grads(fused, inputs, size)
        seconds = time.perf_counter() - started
        with LiveTensorMeter() as meter:
            result = loss_and_grads(fused, inputs, size)
        peak = meter.peak
    del result
    return seconds, peak


def value_differences(size: dict, device: str) -> dict[str, float]:
    """fp32 inputs: fused minus unfused, relative to the unfused values' scale (max(1, |x|) for log-probs)."""
    inputs = make_inputs(size, torch.float32, device, seed=1)
    fused = loss_and_grads(True, inputs, size, with_entropy=True)
    unfused = loss_and_grads(False, inputs, size, with_entropy=True)
    logprob_scale = unfused[0].abs().clamp(min=1.0)
    return {
        "logprobs": float(((fused[0] - unfused[0]).abs() / logprob_scale).max()),
        "entropy": float(((fused[1] - unfused[1]).abs() / unfused[1].abs().clamp(min=1.0)).max()),
        "grad_hidden": float((fused[2][0] - unfused[2][0]).abs().max() / unfused[2][0].abs().max()),
        "grad_weight": float((fused[2][1] - unfused[2][1]).abs().max() / unfused[2][1].abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU sizes, fp32")
    parser.add_argument("--rounds", type=int, default=3, help="alternate fused/unfused this often")
    parser.add_argument("--token-chunk", type=int, default=None)
    parser.add_argument("--vocab-chunk", type=int, default=None)
    args = parser.parse_args()
    size = dict(SIZES["tiny" if args.tiny else "full"])
    size.update({k: v for k, v in (("token_chunk", args.token_chunk), ("vocab_chunk", args.vocab_chunk)) if v})
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    inputs = make_inputs(size, dtype, device)
    loss_and_grads(True, inputs, size)  # warm-up: kernels, allocator
    loss_and_grads(False, inputs, size)
    samples: dict[str, list[tuple[float, float]]] = {"fused": [], "unfused": []}
    for round_index in range(args.rounds):
        for name in ("fused", "unfused"):
            seconds, peak = measure(name == "fused", inputs, size, cuda)
            samples[name].append((seconds, peak))
            print(f"round {round_index} {name}: {seconds:.4f} s, peak {peak / 2**30:.3f} GiB", flush=True)
    result = {"sizes": size, "dtype": str(dtype).removeprefix("torch."), "softcap": SOFTCAP}
    for name, runs in samples.items():
        result[name] = {
            "step_s": round(statistics.median(s for s, _ in runs), 4),
            "peak_gib": round(max(p for _, p in runs) / 2**30, 4),
        }
    result["peak_ratio"] = round(result["fused"]["peak_gib"] / result["unfused"]["peak_gib"], 4)
    result["time_ratio"] = round(result["fused"]["step_s"] / result["unfused"]["step_s"], 3)
    del inputs
    result["max_relative_diff_fp32"] = value_differences(size, device)
    result["goal_peak_ratio_le_0.25"] = result["peak_ratio"] <= 0.25
    result["goal_values_1e-5"] = max(result["max_relative_diff_fp32"].values()) <= 1e-5
    if cuda:
        result["device"] = torch.cuda.get_device_name()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
