"""One rank of a multi-process Beam run of MegatronBackend on gloo (CPU), started by torchrun from
test_megatron_beam.py: ``torchrun --nproc_per_node N megatron_beam_worker.py BEAM_DIR TP EP OUT_JSON``.

Rank 0 writes the logit parity figures against the HF reference, whether the HF export is exact, and the loss
and grad norm of one training step.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from test_megatron_beam import compare, long_rows_BT, megatron_logits, padded_batch
from transformers import AutoModelForCausalLM

import modeling.beam  # noqa: F401  (registers model_type "beam" with transformers)
from protos.config import MegatronConfig, TrainerConfig
from trainer_service.megatron.backend import MegatronBackend


def gather_vocab_shards(logits_BTV: torch.Tensor) -> torch.Tensor:
    """With TP the output layer's logits are split over the vocabulary; put the shards back together."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(logits_BTV) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, logits_BTV.contiguous(), group=group)
    return torch.cat(shards, dim=-1)


def main(beam_dir: str, tp: int, ep: int, out_path: str) -> None:
    parallel = MegatronConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    config = TrainerConfig(
        backend="megatron", lr=1e-2, geo_mask=None, megatron=parallel, num_processes=int(os.environ["WORLD_SIZE"])
    )  # set by torchrun
    backend = MegatronBackend(beam_dir, config)
    ids, mask = long_rows_BT()
    logits = gather_vocab_shards(megatron_logits(backend, ids, mask))
    # Every rank takes part in the gathers; clones, since unsharded tensors are views of the trained parameters.
    exported = {name: tensor.clone() for name, tensor in backend.export_hf_weights()}
    metrics = backend.train_step(padded_batch())
    if dist.get_rank() != 0:
        return
    reference = AutoModelForCausalLM.from_pretrained(beam_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    checkpoint = load_file(f"{beam_dir}/model.safetensors")
    exact = sorted(exported) == sorted(checkpoint) and all(
        exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor)
        for name, tensor in checkpoint.items()
    )
    from trainer_service.megatron.grouped_experts import GroupedExperts

    result = {
        **compare(expected, logits, mask),
        "grouped_experts": any(isinstance(module, GroupedExperts) for module in backend.model[0].modules()),
        "export_exact": exact,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
    }
    with open(out_path, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
