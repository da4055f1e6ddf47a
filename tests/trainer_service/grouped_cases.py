"""Shared by the grouped-experts tests: a backend per experts layout, and their tensors under one naming
(tests/ has no packages: import by name).

``sequential_names`` renames a grouped model's tensors to the ``SequentialMLP`` model's: ``experts.fc1.weight``
[E, 2F, H] becomes ``experts.local_experts.<e>.linear_fc1.weight`` per expert, and the grouped adapters
``lora_a`` [E, R, H] / ``lora_b`` [E, 2F, R] become the per-expert adapter's ``linear_in.weight`` [R, H] /
``linear_out.weight`` [2F, R] (views: writing through them writes the grouped tensor).
"""

from __future__ import annotations

import re

import torch

from protos.config import MegatronConfig, TrainerConfig

_GROUPED = re.compile(r"^(?P<prefix>.*\.experts\.)fc(?P<fc>[12])\.(?P<kind>weight|adapter\.lora_a|adapter\.lora_b)$")


def megatron_config(grouped: bool, **megatron) -> MegatronConfig:
    return MegatronConfig(moe_grouped_experts=grouped, moe_grouped_lora=grouped, **megatron)


def backend(model_dir: str, grouped: bool, **trainer):
    from trainer_service.megatron.backend import MegatronBackend

    config = TrainerConfig(backend="megatron", lr=1e-2, geo_mask=None, megatron=megatron_config(grouped), **trainer)
    return MegatronBackend(model_dir, config)


def sequential_names(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors by their ``SequentialMLP`` names (with megatron-bridge's per-expert adapters)."""
    renamed = {}
    for name, tensor in named.items():
        match = _GROUPED.match(name)
        if match is None:
            renamed[name] = tensor
            continue
        base = f"{match['prefix']}local_experts.{{}}.linear_fc{match['fc']}"
        for expert, tensor_e in enumerate(tensor):
            if match["kind"] == "weight":
                renamed[base.format(expert) + ".weight"] = tensor_e
            elif match["kind"].endswith("lora_a"):
                renamed[base.format(expert) + ".adapter.linear_in.weight"] = tensor_e
            else:
                renamed[base.format(expert) + ".adapter.linear_out.weight"] = tensor_e
    return renamed


def parameters(backend) -> dict[str, torch.nn.Parameter]:
    """The model's parameters by megatron name (no DDP prefix, no LoRA ``to_wrap``)."""
    return {
        name.removeprefix("module.").replace(".to_wrap.", "."): parameter
        for name, parameter in backend.model[0].named_parameters()
    }


def gradients(backend) -> dict[str, torch.Tensor]:
    """The last step's gradient of every trainable parameter (megatron's ``main_grad`` buffers), sequential names."""
    named = {name: p.main_grad for name, p in parameters(backend).items() if p.requires_grad}
    return sequential_names(named)


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())[:6]
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
