"""Grouped-GEMM experts for megatron-core's ``MoELayer`` without Transformer Engine: ``GroupedExperts``.

A drop-in for the experts submodule (megatron-core's ``SequentialMLP``, one ``MLP`` per expert): the local
experts' weights are one tensor per projection, ``fc1.weight`` [E, 2F, H] (each expert's gate rows, then its up
rows, as ``SequentialMLP``'s ``linear_fc1``) and ``fc2.weight`` [E, H, F], and each projection runs over all
routed rows at once (``grouped_mm``): one ``torch._grouped_mm``, forward and backward, where the device and
dtype have it (bf16 on CUDA, fp32 and bf16 on a CPU torch), else the reference, a per-expert loop of matmuls
over the same layout.

Everything around the experts stays megatron-core's: the router (R3 replay acts there), the token dispatcher
(allgather / alltoall permutation, expert- and expert-tensor-parallel communication) and the activation
arithmetic of its ``MLP`` (SwiGLU, then the routing probability, in the same order and dtypes). With expert
parallelism a rank holds its slice of the experts; with expert tensor parallelism each expert's slice of F, and
the dispatcher does the communication, as it does for ``SequentialMLP``'s linears.

HF import and export go through megatron-bridge's own per-expert mappings (``grouped_bridge``); LoRA on the
experts is ``grouped_lora`` (one batched adapter per projection). ``configure_provider`` installs the experts
with ``grouped_experts_spec`` when ``trainer.megatron.moe_grouped_experts`` is on.

Shape legend: T routed rows on this rank (grouped by expert), E local experts, H hidden, F expert FFN width on
this rank, K / N a grouped matmul's inner / output width.
"""

from __future__ import annotations

import dataclasses
import inspect
from functools import cached_property, partial

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.utils import divide

# torch._grouped_mm (CUDA and CPU) wants row strides in whole 16 bytes; CUDA also 16-byte aligned start addresses.
_ALIGN_BYTES = 16


@dataclasses.dataclass
class ExpertRows:
    """Where each local expert's rows lie in the permuted input: rows ``offsets[e-1]:offsets[e]`` are expert e's."""

    tokens_per_expert: torch.Tensor
    offsets_E: torch.Tensor  # int32 running row ends, on the rows' device (what torch._grouped_mm takes)

    @classmethod
    def of(cls, tokens_per_expert: torch.Tensor, device: torch.device) -> ExpertRows:
        # The alltoall dispatcher hands the counts over on the host; the copy is tiny and needs no sync.
        offsets = torch.cumsum(tokens_per_expert.to(device=device, non_blocking=True), dim=0, dtype=torch.int32)
        return cls(tokens_per_expert, offsets)

    @cached_property
    def counts(self) -> list[int]:
        """Rows per expert on the host (the loop path splits by them; a device sync)."""
        return self.tokens_per_expert.tolist()


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: ``_grouped_mm``'s backward refuses expanded ones."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_runs(x_TK: torch.Tensor, w_EKN: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands here (else ``grouped_mm`` loops over the experts)."""
    if not hasattr(torch, "_grouped_mm") or x_TK.dtype != w_EKN.dtype:
        return False
    if x_TK.device.type == "cpu":
        return x_TK.dtype in (torch.float32, torch.bfloat16)
    if x_TK.device.type != "cuda" or x_TK.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x_TK.device) < (8, 0):
        return False
    # Widths are padded to the alignment (_aligned); the start addresses must be aligned already.
    return all(t.data_ptr() % _ALIGN_BYTES == 0 for t in (x_TK, w_EKN))


def _aligned(x_TK: torch.Tensor, w_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad K and N to whole 16-byte rows (LoRA ranks such as 2 or 4 are narrower); zeros change no product."""
    multiple = _ALIGN_BYTES // x_TK.element_size()
    pad_k, pad_n = -x_TK.shape[-1] % multiple, -w_EKN.shape[-1] % multiple
    if pad_k:
        x_TK = F.pad(x_TK, (0, pad_k))
        w_EKN = F.pad(w_EKN, (0, 0, 0, pad_k))
    if pad_n:
        w_EKN = F.pad(w_EKN, (0, pad_n))
    if w_EKN.stride(-1) != 1 and w_EKN.stride(-2) != 1:
        w_EKN = w_EKN.contiguous()
    return x_TK.contiguous(), w_EKN


def grouped_mm(x_TK: torch.Tensor, w_EKN: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """``out[r] = x[r] @ w[e]`` for every row r of expert e: one grouped matmul, or the per-expert loop."""
    if not grouped_mm_runs(x_TK, w_EKN):
        return loop_mm(x_TK, w_EKN, rows)
    width = w_EKN.shape[-1]
    x_TK, w_EKN = _aligned(x_TK, w_EKN)
    out_TN = torch._grouped_mm(x_TK, w_EKN, offs=rows.offsets_E)
    return _ContiguousGrad.apply(out_TN[:, :width] if out_TN.shape[-1] != width else out_TN)


def loop_mm(x_TK: torch.Tensor, w_EKN: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """The reference: one matmul per expert over its rows, as ``SequentialMLP`` runs them."""
    pieces = [x @ w for x, w in zip(torch.split(x_TK, rows.counts), w_EKN, strict=True)]
    return torch.cat(pieces) if pieces else x_TK.new_empty(0, w_EKN.shape[-1])


class GroupedExpertLinear(torch.nn.Module):
    """One projection of every local expert: ``weight`` [E, N, K] (each expert's [out, in], as a megatron linear).

    ``adapter`` (``grouped_lora.GroupedLoraAdapter``, or None) adds its low-rank term to the output.
    """

    def __init__(
        self,
        config,
        num_local_experts: int,
        input_size: int,
        output_size: int,
        *,
        init_method,
        partition_dim: int,
        stride: int,
        expert_process_groups: bool,
    ):
        super().__init__()
        self.config = config  # megatron-bridge's mappings read the owning module's config
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        weight = torch.empty(num_local_experts, output_size, input_size, dtype=config.params_dtype, device=device)
        self.weight = torch.nn.Parameter(weight)
        if config.perform_initialization:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                for expert_weight in self.weight.data:
                    init_method(expert_weight)
        # What megatron's expert linears carry: the sharded dim of the [E, out, in] tensor, and allreduce False
        # where gradients are reduced over the expert-data-parallel group instead of the data-parallel one.
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim, stride)
        self.weight.allreduce = not expert_process_groups
        self.adapter = None

    def forward(self, x_TK: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        out_TN = grouped_mm(x_TK, self.weight.transpose(1, 2), rows)
        if self.adapter is not None:
            out_TN = out_TN + self.adapter(x_TK, rows)
        return out_TN


def check_supported(config) -> None:
    """Refuse the expert settings whose arithmetic ``GroupedExperts`` does not reproduce."""
    unsupported = {
        "add_bias_linear": config.add_bias_linear,
        "use_te_activation_func": config.use_te_activation_func,
        "moe_latent_size": config.moe_latent_size is not None,
        "fp8": bool(config.fp8),
        "fp4": bool(config.fp4),
    }
    for field, value in unsupported.items():
        if value:
            raise ValueError(
                f"trainer.megatron.moe_grouped_experts: the model sets {field}, which grouped experts do not "
                "implement; set trainer.megatron.moe_grouped_experts=false (per-expert SequentialMLP)"
            )


def weighted_activation(config, fc1_TN: torch.Tensor, probs_T: torch.Tensor) -> torch.Tensor:
    """megatron-core ``MLP``'s activation of an expert, then its routing probability per row (same arithmetic)."""
    scale_T1 = probs_T.unsqueeze(-1)
    if config.bias_activation_fusion:
        if not (config.gated_linear_unit and config.activation_func is F.silu):
            raise ValueError("trainer.megatron.moe_grouped_experts: bias_activation_fusion is implemented for SwiGLU")
        return weighted_bias_swiglu_impl(fc1_TN, None, scale_T1, config.activation_func_fp8_input_store)
    if config.gated_linear_unit:
        gate, linear = torch.chunk(fc1_TN, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate, linear = gate.clamp(min=None, max=clamp), linear.clamp(min=-clamp, max=clamp)
        hidden = config.activation_func(gate) * (linear + config.glu_linear_offset)
    else:
        hidden = config.activation_func(fc1_TN)
    return (hidden * scale_T1).to(hidden.dtype)


class GroupedExperts(MegatronModule):
    """All local experts of one ``MoELayer``: two grouped matmuls (fc1 gate/up, fc2) around the activation."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, name: str | None = None):
        super().__init__(config=config)
        check_supported(config)
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        ffn = divide(config.moe_ffn_hidden_size, self.tp_group.size())
        # As megatron's ColumnParallelLinear / RowParallelLinear decide it for is_expert=True.
        expert_process_groups = (
            config.expert_model_parallel_size > 1
            or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        gated = config.gated_linear_unit
        self.fc1 = GroupedExpertLinear(
            config,
            num_local_experts,
            config.hidden_size,
            2 * ffn if gated else ffn,
            init_method=config.init_method,
            partition_dim=1,
            stride=2 if gated else 1,
            expert_process_groups=expert_process_groups,
        )
        self.fc2 = GroupedExpertLinear(
            config,
            num_local_experts,
            ffn,
            config.hidden_size,
            init_method=config.output_layer_init_method,
            partition_dim=2,
            stride=1,
            expert_process_groups=expert_process_groups,
        )

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """The experts' output for the dispatched rows [T, H] (grouped by expert), and no bias."""
        x_TH, probs_T = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: top-1 routing scales the input instead
            x_TH = (probs_T.unsqueeze(-1) * x_TH).to(x_TH.dtype)
            probs_T = torch.ones_like(probs_T)
        rows = ExpertRows.of(tokens_per_expert, x_TH.device)
        hidden_TF = weighted_activation(self.config, self.fc1(x_TH, rows), probs_T)
        return self.fc2(hidden_TF, rows), None

    def backward_dw(self):
        """Weight gradients are computed in the ordinary backward (no delayed-wgrad split)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        raise NotImplementedError(
            "GroupedExperts has no dist_checkpointing layout; fleetrl checkpoints per rank "
            "(trainer_service/megatron/checkpoint.py)"
        )


def with_grouped_experts(spec):
    """``spec`` with every ``SequentialMLP`` experts builder of its MoE layers replaced by ``GroupedExperts``.

    Walks the forms megatron-core and fleetrl build layer specs in: a block's ``layer_specs``, a layer
    ``ModuleSpec`` or partial, its ``submodules.mlp``, the ``MoELayer`` partial or spec and its ``MoESubmodules``.
    """
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[with_grouped_experts(layer) for layer in spec.layer_specs])
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=with_grouped_experts(spec.submodules))
    if isinstance(spec, partial) and "submodules" in spec.keywords:
        keywords = {**spec.keywords, "submodules": with_grouped_experts(spec.keywords["submodules"])}
        return partial(spec.func, *spec.args, **keywords)
    if isinstance(spec, MoESubmodules) and _is_sequential_mlp(spec.experts):
        return dataclasses.replace(spec, experts=GroupedExperts)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type) and hasattr(spec, "mlp"):
        return dataclasses.replace(spec, mlp=with_grouped_experts(spec.mlp))
    return spec


def _is_sequential_mlp(builder) -> bool:
    target = builder.module if isinstance(builder, ModuleSpec) else getattr(builder, "func", builder)
    return target is SequentialMLP


def grouped_experts_spec(base_spec, config, vp_stage: int | None = None):
    """A provider's ``transformer_layer_spec``: ``base_spec`` (a spec or the provider's spec function) with
    grouped experts. Bind ``base_spec`` with ``functools.partial``; the provider then calls it with itself."""
    if callable(base_spec) and not isinstance(base_spec, ModuleSpec):
        takes_stage = "vp_stage" in inspect.signature(base_spec).parameters
        base_spec = base_spec(config, vp_stage=vp_stage) if takes_stage else base_spec(config)
    return with_grouped_experts(base_spec)
