"""One rank of the multi-rank adapter-only export check, started by test_megatron_lora_adapters.py:
``torchrun --nproc-per-node 2 adapter_export_worker.py BEAM_DIR OUT_JSON``.

The tiny Beam with LoRA on every target (grouped expert adapters, normalize_moe_lora) under EP=2, then (megatron's
parallel state rebuilt in the same processes) PP=2. Per layout, rank 0 writes whether ``W + alpha / rank * B @ A``
of every exported adapter equals the merged export, and whether every rank got the same adapters.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from test_lora_adapter_export import ALPHA, RANK, merged_from_adapters

from protos.config import LoraConfig, MegatronConfig, TrainerConfig
from trainer_service import lora


def layout_figures(beam_dir: str, parallel: MegatronConfig) -> dict:
    from trainer_service.megatron.backend import MegatronBackend

    config = TrainerConfig(
        backend="megatron",
        geo_mask=None,
        num_processes=2,
        megatron=parallel,
        lora=LoraConfig(rank=RANK, alpha=ALPHA, normalize_moe_lora=True, sync="adapters"),
    )
    backend = MegatronBackend(beam_dir, config)
    with torch.no_grad():  # B non-zero, the same function of the name on every rank
        for name, parameter in backend.model[0].named_parameters():
            if name.endswith(("linear_out.weight", "lora_b")):
                generator = torch.Generator().manual_seed(sum(name.encode()))
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    adapters = {name: tensor.clone() for name, tensor in backend.export_adapter_weights()}
    merged = {name: tensor.clone() for name, tensor in backend.export_hf_weights()}
    checksum = torch.tensor([sum(float(t.double().sum()) for t in adapters.values()), float(len(adapters))])
    checksums = [torch.zeros(2, dtype=checksum.dtype) for _ in range(dist.get_world_size())]
    dist.all_gather(checksums, checksum)
    record = backend.adapter_record()
    rebuilt = merged_from_adapters(load_file(f"{beam_dir}/model.safetensors"), adapters, record)
    adapted = {name for name in merged if lora.target_of(name) is not None}
    return {
        "names_match": rebuilt.keys() == adapted,
        "max_abs_diff": max(float((rebuilt[name] - merged[name]).abs().max()) for name in adapted & rebuilt.keys()),
        "expert_rank": record.expert_rank,
        "num_adapter_tensors": len(adapters),
        "same_on_every_rank": all(torch.equal(checksums[0], other) for other in checksums),
    }


def main(beam_dir: str, out_path: str) -> None:
    from megatron.core import parallel_state

    results = {"ep2": layout_figures(beam_dir, MegatronConfig(expert_model_parallel_size=2))}
    parallel_state.destroy_model_parallel()
    results["pp2"] = layout_figures(beam_dir, MegatronConfig(pipeline_model_parallel_size=2))
    if dist.get_rank() == 0:
        with open(out_path, "w") as out:
            json.dump(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
