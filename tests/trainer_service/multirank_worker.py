"""One rank of a 2-rank MegatronBackend run on gloo (CPU), started by test_megatron_multirank.py through torchrun:
``torchrun --nproc-per-node 2 multirank_worker.py OUT_DIR QWEN_DIR BEAM_DIR``.

Each rank writes ``OUT_DIR/rank<r>.pt``: per layout (PP=2, DP=2) and model, the log-probs of a padded batch (natural and with replayed
routes), the figures and exported HF weights of one training step with several micro-batches, and whether
resuming from a checkpoint repeats the next step bit-exactly. The test compares them with world size 1. The
inputs are built here and imported by the test, so both sides see the same tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from synthetic import make_group

from protos.config import MegatronConfig, TrainerConfig
from trainer_service.batch import build_batch

MICRO_BATCH_TOKENS = 40  # several micro-batches of different shapes per step
# Adam's first update is -lr * g / (|g| + 1e-8): near-zero gradients turn float roundoff into sign-like flips.
# Clipping the gradient far below Adam's eps makes the update linear in the gradient, so two layouts' weights
# compare at fp32 precision; lr 1 makes the update large against the weights' own rounding.
LR, GRAD_CLIP = 1.0, 1e-9


def trainer_config(pp: int = 1, num_processes: int = 1, micro_batch_tokens: int = MICRO_BATCH_TOKENS) -> TrainerConfig:
    return TrainerConfig(
        backend="megatron",
        lr=LR,
        grad_clip=GRAD_CLIP,
        geo_mask=None,
        micro_batch_tokens=micro_batch_tokens,
        num_processes=num_processes,
        megatron=MegatronConfig(pipeline_model_parallel_size=pp),
    )


def step_batch(seed: int = 7):
    """Six groups of four rows, 5-15 tokens each: several micro-batches, uneven data-parallel shards."""
    return build_batch([make_group(i, seed=seed) for i in range(6)])


def random_routes(batch, num_layers: int, top_k: int, num_experts: int, seed: int = 3) -> torch.Tensor:
    """routes_BTLK of distinct random experts per (row, token, layer)."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = batch.input_ids_BT.shape
    scores = torch.rand(rows, width, num_layers, num_experts, generator=generator)
    return scores.topk(top_k, dim=-1).indices


def model_figures(backend, routes_shape: tuple[int, int, int], checkpoint_dir: Path, resume=None) -> dict:
    """Log-probs (natural, replayed), one step's figures and weights, and (``resume`` given: a function that
    builds a fresh backend) whether resuming from a checkpoint repeats the next step exactly, on this rank."""
    batch = step_batch()
    routes = random_routes(batch, *routes_shape)
    figures = {
        "logprobs": backend.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT),
        "replayed": backend.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT, routed_experts=routes),
        "step": backend.train_step(batch),
        # Clones: unsharded tensors can be views of the trained parameters.
        "weights": {name: tensor.clone() for name, tensor in backend.export_hf_weights()},
    }
    if resume is None:
        return figures
    backend.save_checkpoint(checkpoint_dir)
    next_batch = step_batch(seed=8)
    expected = backend.train_step(next_batch)
    expected_weights = dict(backend.export_hf_weights())
    resumed = resume()
    resumed.load_checkpoint(checkpoint_dir)
    got = resumed.train_step(next_batch)
    figures["resume_exact"] = (got["loss"], got["grad_norm"]) == (expected["loss"], expected["grad_norm"]) and all(
        torch.equal(expected_weights[name], tensor) for name, tensor in resumed.export_hf_weights()
    )
    return figures


def non_finite_step(backend) -> dict:
    """A NaN advantage in the first row (one data-parallel shard, the last pipeline stage's loss): every rank must
    skip the step and keep its weights."""
    batch = step_batch()
    batch.advantages_B[0] = float("nan")
    before = {name: tensor.clone() for name, tensor in backend.export_hf_weights()}
    skipped = backend.train_step(batch)["skipped"]
    return {"skipped": skipped, "kept": all(torch.equal(before[name], t) for name, t in backend.export_hf_weights())}


def layout_figures(layout: str, out: Path, qwen_dir: str, beam_dir: str | None) -> dict:
    """``model_figures`` of each model under ``layout`` ("pp": PP=2, "dp": DP=2)."""
    import torch.distributed as dist

    from trainer_service.megatron.backend import MegatronBackend

    config = trainer_config(pp=2 if layout == "pp" else 1, num_processes=2)
    results = {}
    for name, model_dir, routes_shape in (("qwen", qwen_dir, (2, 2, 16)), ("beam", beam_dir, (5, 4, 16))):
        if model_dir:
            backend = MegatronBackend(model_dir, config)
            # Resuming is checked on Qwen3-MoE (Beam's checkpoints are the same code, tested at world size 1).
            rebuild = (lambda: MegatronBackend(qwen_dir, config)) if name == "qwen" else None
            results[name] = model_figures(backend, routes_shape, out / f"ckpt-{layout}-{name}", rebuild)
            if name == "qwen":
                results[name]["nan_step"] = non_finite_step(backend)
    results["layout"] = {
        "pp": backend.model[0].module.config.pipeline_model_parallel_size,
        "world": dist.get_world_size(),
    }
    return results


def main(out_dir: str, qwen_dir: str, beam_dir: str) -> None:
    """PP=2 on both models, then (megatron's parallel state rebuilt in the same processes) DP=2 on Qwen3-MoE:
    one torchrun start, since importing megatron is most of its cost."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    out = Path(out_dir)
    results = {"pp": layout_figures("pp", out, qwen_dir, beam_dir)}
    parallel_state.destroy_model_parallel()
    results["dp"] = layout_figures("dp", out, qwen_dir, None)
    torch.save(results, out / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
