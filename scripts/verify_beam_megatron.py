"""Beam on the Megatron path against the HF reference, on whatever device is there (the tests cover the CPU).

On a GPU this is the check the CPU tests cannot make: megatron-core's CUDA code paths (alltoall dispatcher,
CUDA RNG tracker, bf16 kernels) under the Beam spec. Prints one JSON object:

- ``fp32``: Megatron fp32 vs HF fp32 logits (full vocabulary, every real position): mean/max KL, top-1;
- ``per_row_temperature``: rows scored at different sampling temperatures vs HF fp32 at the same: max |dlogp|;
- ``bf16``: Megatron bf16 vs HF fp32, next to HF bf16 vs HF fp32 (the bf16 floor);
- ``r3``: routes recorded in a Megatron forward, expert biases then shifted so routing changes, replayed:
  max |logit difference| to the recorded forward (0 = bit-equal);
- ``lora``: three LoRA steps, then HF loaded with the merged export vs Megatron with adapters: max |logprob diff|.

    PYTHONPATH=/tmp/site:. python3 scripts/verify_beam_megatron.py        # (device: wheels as in docs/benchmarks.md)
    .venv/bin/python scripts/verify_beam_megatron.py                      # CPU
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "trainer_service"))


def main() -> None:
    from test_megatron_beam import compare, long_rows_BT, megatron_logits, shift_expert_biases
    from transformers import AutoModelForCausalLM

    import modeling.beam  # noqa: F401 - registers model_type "beam"
    from modeling.beam.tiny import init_tiny_beam
    from protos.config import LoraConfig, MegatronConfig, TrainerConfig
    from trainer_service.megatron.backend import MegatronBackend
    from trainer_service.megatron.routing_replay import megatron_record_routes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dispatcher = "alltoall" if device == "cuda" else "allgather"
    work = Path(tempfile.mkdtemp())
    beam_dir = str(init_tiny_beam(work / "beam", seed=0))
    bf16_dir = work / "beam_bf16"
    AutoModelForCausalLM.from_pretrained(beam_dir, dtype=torch.float32).to(torch.bfloat16).save_pretrained(bf16_dir)
    ids_BT, mask_BT = long_rows_BT()
    ids_dev, mask_dev = ids_BT.to(device), mask_BT.to(device)

    def hf_logits(directory, dtype):
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).to(device).eval()
        with torch.no_grad():
            return model(input_ids=ids_dev, attention_mask=mask_dev, use_cache=False).logits.float()

    def config(dtype: str, **kwargs) -> TrainerConfig:
        megatron = MegatronConfig(params_dtype=dtype, moe_token_dispatcher=dispatcher)
        return TrainerConfig(backend="megatron", lr=1e-2, geo_mask=None, megatron=megatron, **kwargs)

    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dispatcher": dispatcher}
    reference = hf_logits(beam_dir, torch.float32)
    fp32 = MegatronBackend(beam_dir, config("float32"), device=device)
    result["fp32"] = compare(reference, megatron_logits(fp32, ids_dev, mask_dev), mask_dev)
    result["per_row_temperature"] = verify_temperatures(fp32, reference, ids_BT, mask_BT)

    bf16 = MegatronBackend(str(bf16_dir), config("bfloat16"), device=device)
    result["bf16"] = {
        "megatron_vs_hf_fp32": compare(reference, megatron_logits(bf16, ids_dev, mask_dev), mask_dev),
        "hf_bf16_vs_hf_fp32": compare(reference, hf_logits(bf16_dir, torch.bfloat16), mask_dev),
    }
    del bf16

    with megatron_record_routes(fp32.model) as recorder:
        recorded = megatron_logits(fp32, ids_dev, mask_dev)
    routes = recorder.routes(*ids_BT.shape)
    shift_expert_biases(fp32)
    natural = megatron_logits(fp32, ids_dev, mask_dev)
    replayed = megatron_logits(fp32, ids_dev, mask_dev, routes)  # on the CPU, as batches carry them
    result["r3"] = {
        "natural_moved_by": (natural - recorded).abs().max().item(),
        "replayed_off_by": (replayed - recorded).abs().max().item(),
    }
    del fp32

    result["lora"] = verify_lora(beam_dir, config("float32", lora=LoraConfig(rank=8, alpha=16)), device, work)
    print(json.dumps(result, indent=1))


def verify_temperatures(backend, reference_BTV: torch.Tensor, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict:
    """Rows scored at their own sampling temperature (a batch that spans a live change) vs HF fp32 at the same."""
    temperatures_B = torch.tensor([0.5, 1.0, 0.7, 1.3] * ids_BT.shape[0])[: ids_BT.shape[0]]
    tempered = reference_BTV[:, :-1].cpu() / temperatures_B[:, None, None]
    expected = torch.log_softmax(tempered, dim=-1).gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
    actual = backend.token_logprobs(ids_BT, mask_BT, temperature=temperatures_B)
    mask = mask_BT[:, 1:].bool()
    return {
        "temperatures": temperatures_B.tolist(),
        "max_abs_logprob_diff": (actual - expected)[mask].abs().max().item(),
    }


def verify_lora(beam_dir: str, config, device: str, work: Path) -> dict:
    from safetensors.torch import load_file, save_file
    from synthetic import make_group
    from transformers import AutoModelForCausalLM

    from trainer_service.batch import build_batch
    from trainer_service.megatron.backend import MegatronBackend
    from trainer_service.torch_backend import token_logprobs

    backend = MegatronBackend(beam_dir, config, device=device)
    batch = build_batch([make_group(i) for i in range(8)])
    for _ in range(3):
        metrics = backend.train_step(batch)
    published = dict(backend.export_hf_weights())
    merged_dir = work / "merged"
    shutil.copytree(beam_dir, merged_dir)
    state = load_file(str(merged_dir / "model.safetensors"))
    save_file(
        {**state, **{name: t.contiguous() for name, t in published.items()}}, str(merged_dir / "model.safetensors")
    )
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        reference = token_logprobs(merged, batch.input_ids_BT.to(device), batch.attention_mask_BT.to(device), 1.0)
    adapted = backend.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    mask = batch.attention_mask_BT[:, 1:].bool()
    return {
        "published_tensors": len(published),
        "checkpoint_tensors": len(state),
        "grad_norm": metrics["grad_norm"],
        "max_abs_logprob_diff": (adapted - reference.cpu())[mask].abs().max().item(),
    }


if __name__ == "__main__":
    main()
