"""The HF export of the final policy: safetensors shards, their index, and the checkpoint's config and tokenizer files.

``export_policy`` runs at the end of a run on every rank (the backend's ``export_hf_weights`` is a collective); rank 0
writes ``<export_path>/hf``, a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads. Tensors are
streamed into shards of ``shard_bytes``: a Beam-sized policy never sits in host memory whole.

LoRA: the backend exports the merged weights of the adapted layers only (what a rollout server needs), so the other
tensors are streamed from the base checkpoint (``model_path``), which LoRA never changes. The adapters themselves go
to ``<export_path>/adapters`` in the backend's checkpoint format (every rank its shard).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 * 2**30


class ShardWriter:
    """Writes (name, tensor) pairs into ``model-NNNNN.safetensors`` shards of at most ``shard_bytes`` (a larger tensor
    gets a shard of its own), then the index that maps every name to its shard."""

    def __init__(self, directory: Path, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.directory = directory
        self.shard_bytes = shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shard_names: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self.pending:
            raise ValueError(f"HF export: tensor {name} exported twice")
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def close(self) -> list[str]:
        """Flush, rename the shards to ``model-0000i-of-0000N.safetensors`` and write the index; returns the names."""
        self._flush()
        count = len(self.shard_names)
        final = {}
        for index, name in enumerate(self.shard_names, start=1):
            final[name] = f"model-{index:05d}-of-{count:05d}.safetensors"
            (self.directory / name).rename(self.directory / final[name])
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {tensor: final[shard] for tensor, shard in sorted(self.weight_map.items())},
        }
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return sorted(self.weight_map)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"shard-{len(self.shard_names):05d}.partial"
        save_file(self.pending, str(self.directory / name), metadata={"format": "pt"})
        self.shard_names.append(name)
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.pending, self.pending_bytes = {}, 0


def base_tensors(model_path: str | Path, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the HF checkpoint at ``model_path`` whose name is not in ``skip``, one at a time."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors to complete the LoRA export from")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # safe_open handles have keys(), no __iter__
                if name not in skip:
                    yield name, handle.get_tensor(name)


def copy_model_files(model_path: str | Path, out_dir: Path) -> list[str]:
    """The checkpoint's files other than weights (config, generation config, tokenizer, chat template, code)."""
    copied = []
    for path in sorted(Path(model_path).iterdir()):
        if path.is_file() and path.suffix not in WEIGHT_SUFFIXES and path.name != INDEX_FILE:
            shutil.copy2(path, out_dir / path.name)
            copied.append(path.name)
    return copied


def export_policy(backend, model_path: str, export_path: Path, lora_enabled: bool, is_rank0: bool) -> Path | None:
    """Write the final policy as an HF checkpoint under ``export_path/hf`` (every rank must call: the export is a
    collective); under LoRA also the adapters under ``export_path/adapters``. Returns the HF directory on rank 0."""
    out_dir = export_path / "hf"
    if not is_rank0:
        for _name, _tensor in backend.export_hf_weights():
            pass
        if lora_enabled:
            backend.save_checkpoint(export_path / "adapters")
        return None
    partial = out_dir.with_name("hf.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    writer = ShardWriter(partial)
    for name, tensor in backend.export_hf_weights():
        writer.add(name, tensor)
    if lora_enabled:  # the layers LoRA left alone, as the base checkpoint has them
        for name, tensor in base_tensors(model_path, set(writer.weight_map) | set(writer.pending)):
            writer.add(name, tensor)
    names = writer.close()
    copy_model_files(model_path, partial)
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    if lora_enabled:
        adapters = export_path / "adapters"
        adapters.mkdir(parents=True, exist_ok=True)
        backend.save_checkpoint(adapters)
    logger.info(
        "HF export of the final policy: %d tensors, %.2f GB in %s", len(names), writer.total_bytes / 1e9, out_dir
    )
    return out_dir
