"""Beam for vLLM, built from vLLM's own layers (the HF reference is ``modeling.beam.modeling_beam``).

Registered out of tree through the ``vllm.general_plugins`` entry point (``rollout_service.models``).
Mapping from the reference:

- Attention: ``QKVParallelLinear`` + vLLM ``Attention`` with a per-layer ``sliding_window`` (sliding
  layers, RoPE via ``get_rope``) or none (full layers, NoPE). vLLM's attention backends take one
  scalar scale per layer, so SSMax's per-position, per-head factor ``s_h * log(pos + 1)`` is applied
  to q before attention; softmax((c q) k) is exactly SSMax's softmax(c (q k)).
- The output gate logits live in the checkpoint's ``q_proj`` (per head: query rows, then gate rows);
  ``load_weights`` splits them into ``qkv_proj``'s q shard and a column-parallel ``output_gate``,
  so both shard by head under tensor parallelism.
- MoE: ``FusedMoEFactory`` with grouped sigmoid top-k and ``e_score_correction_bias``; the router is
  a ``GateLinear`` holding fp32 weight and bias with fp32 logits whatever the model dtype. Its
  ``MoERunner`` carries the layer index, so routed experts are captured on GPU like any vLLM MoE.
- Final logit soft-capping through ``LogitsProcessor(soft_cap=...)``.
- Pipeline parallelism (``SupportsPP``): ``make_layers`` builds only this rank's decoder layers
  (``PPMissingLayer`` elsewhere) under their global prefixes, so the layer type, dense-vs-MoE choice
  and the ``MoERunner`` layer id all follow the global layer index; the residual scale uses the
  global layer count. The embedding lives only on the first rank, the final norm and LM head only on
  the last. Ranks exchange only ``hidden_states``: with sandwich norms each layer finishes its own
  residual adds, so there is no pending residual to send. ``AutoWeightsLoader`` skips every
  checkpoint tensor that belongs to a ``PPMissingLayer``, on start-up and on weight reloads.

- LoRA (``SupportsLoRA``, fleetrl's adapter-only sync): vLLM wraps qkv_proj, output_gate, o_proj, the dense MLPs
  and the MoE runner; an adapter of the checkpoint's q_proj is split like the weight
  (``split_q_and_gate_adapters``: B's query rows to q_proj, its gate rows to output_gate, both sharing A).

Not supported: EPLB, quantized checkpoints.
"""

# No `from __future__ import annotations`: support_torch_compile reads the real forward annotations.
from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import GateLinear
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.models.interfaces import SupportsLoRA, SupportsPP
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    WeightsMapper,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.sequence import IntermediateTensors

from rollout_service.vllm_adapter import moe_factory

FULL = "full_attention"


class BeamMLP(nn.Module):
    """Dense SwiGLU MLP of the first ``first_k_dense_replace`` layers."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant_config, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


class BeamMoE(nn.Module):
    """Routed experts with DeepSeek-V3 grouped sigmoid routing; router weight, bias and logits in fp32."""

    def __init__(self, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        num_experts = config.n_routed_experts
        self.gate = GateLinear(
            config.hidden_size,
            num_experts,
            out_dtype=torch.float32,
            params_dtype=torch.float32,
            force_fp32_compute=True,
            prefix=f"{prefix}.gate",
        )
        # Selection bias (checkpoint name mlp.gate.e_score_correction_bias); stays fp32 like the weight.
        self.gate.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
        )
        self.experts = moe_factory()(
            gate=self.gate,
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            quant_config=vllm_config.quant_config,
            use_grouped_topk=True,
            num_expert_group=config.n_group,
            topk_group=config.topk_group,
            scoring_func="sigmoid",
            routed_scaling_factor=config.routed_scaling_factor,
            e_score_correction_bias=self.gate.e_score_correction_bias,
            router_logits_dtype=torch.float32,
            prefix=f"{prefix}.experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # The runner computes the router logits itself through ``gate``.
        return self.experts(hidden_states=hidden_states, router_logits=hidden_states)


class BeamAttention(nn.Module):
    """GQA, q/k RMSNorm, RoPE + window or NoPE + SSMax, sigmoid output gate (per head)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        quant_config = vllm_config.quant_config
        tp_size = get_tensor_model_parallel_world_size()
        layer_idx = extract_layer_index(prefix)
        self.is_full = config.layer_types[layer_idx] == FULL
        self.head_dim = config.head_dim
        self.gate_dim = config.head_dim if config.attn_output_gate == "elementwise" else 1
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=False, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )  # fmt: skip
        self.output_gate = ColumnParallelLinear(
            hidden, config.num_attention_heads * self.gate_dim, bias=False, prefix=f"{prefix}.output_gate"
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, hidden, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )  # fmt: skip
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        if self.is_full:
            self.rotary_emb = None
            self.ssmax_scale = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            set_weight_attrs(self.ssmax_scale, {"weight_loader": sharded_weight_loader(0)})
        else:
            self.rotary_emb = get_rope(
                self.head_dim, max_position=config.max_position_embeddings, rope_parameters=config.rope_parameters
            )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=None if self.is_full else config.sliding_window,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv, _ = self.qkv_proj(hidden_states)
        gate, _ = self.output_gate(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        if self.is_full:
            # SSMax: n = pos + 1 keys visible to a causal query; fp32 factor, as in the reference.
            factor = torch.log(positions.float() + 1.0)[:, None, None] * self.ssmax_scale.float()[None, :, None]
            q, k = (q.float() * factor).to(k.dtype).reshape(num_tokens, -1), k.reshape(num_tokens, -1)
        else:
            q, k = self.rotary_emb(positions, q.reshape(num_tokens, -1), k.reshape(num_tokens, -1))
        out = self.attn(q, k, v).view(num_tokens, self.num_heads, self.head_dim)
        out = out * torch.sigmoid(gate.view(num_tokens, self.num_heads, self.gate_dim))
        output, _ = self.o_proj(out.reshape(num_tokens, self.q_size))
        return output


class BeamDecoderLayer(nn.Module):
    """Sandwich RMSNorms around attention and MLP; residual adds scaled by scale_depth / sqrt(layers)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        # Global layer count (not this pipeline stage's), as in the reference.
        self.residual_scale = config.scale_depth / config.num_hidden_layers**0.5
        self.self_attn = BeamAttention(vllm_config, prefix=f"{prefix}.self_attn")
        if extract_layer_index(prefix) >= config.first_k_dense_replace:
            self.mlp = BeamMoE(vllm_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = BeamMLP(config.hidden_size, config.intermediate_size, vllm_config.quant_config, f"{prefix}.mlp")
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.residual_scale * self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.residual_scale * self.post_feedforward_layernorm(mlp)


@support_torch_compile
class BeamModel(nn.Module):
    """Embedding (first pipeline rank), this rank's decoder layers, final norm (last rank)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        pp_group = get_pp_group()
        if pp_group.is_first_rank:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
            )
        else:
            self.embed_tokens = PPMissingLayer()
        # Layers keep their global prefix ("model.layers.N"): extract_layer_index gives the global N.
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: BeamDecoderLayer(vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        if pp_group.is_last_rank:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer()
        # Only the residual stream crosses stages: each layer completes its own residual adds.
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        else:
            assert intermediate_tensors is not None, "a later pipeline stage needs the previous stage's output"
            hidden_states = intermediate_tensors["hidden_states"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states = layer(positions, hidden_states)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states})
        return self.norm(hidden_states)


def split_q_and_gate(weights: Iterable[tuple[str, torch.Tensor]], config) -> Iterable[tuple[str, torch.Tensor]]:
    """Split each checkpoint ``q_proj`` ([heads * (head_dim + gate_dim), H], per head: query rows then
    gate rows) into ``q_proj`` (query rows) and ``output_gate`` (gate rows), both head-major."""
    head_dim = config.head_dim
    gate_dim = head_dim if config.attn_output_gate == "elementwise" else 1
    for name, tensor in weights:
        if not name.endswith("self_attn.q_proj.weight"):
            yield name, tensor
            continue
        per_head = tensor.view(config.num_attention_heads, head_dim + gate_dim, tensor.shape[-1])
        yield name, per_head[:, :head_dim].reshape(-1, tensor.shape[-1])
        yield name.replace("q_proj", "output_gate"), per_head[:, head_dim:].reshape(-1, tensor.shape[-1])


def split_q_and_gate_adapters(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A PEFT adapter of the checkpoint as vLLM's Beam layers take it: each ``q_proj`` adapter's B
    ([heads * (head_dim + gate_dim), r], per head: query rows then gate rows) splits into ``q_proj``'s (query
    rows) and ``output_gate``'s (gate rows); both keep q_proj's A. ``config``: the checkpoint's BeamConfig."""
    head_dim, heads = config.head_dim, config.num_attention_heads
    gate_dim = head_dim if config.attn_output_gate == "elementwise" else 1
    split = {}
    for name, tensor in tensors.items():
        if ".self_attn.q_proj.lora_B." in name:
            per_head = tensor.view(heads, head_dim + gate_dim, tensor.shape[-1])
            split[name] = per_head[:, :head_dim].reshape(-1, tensor.shape[-1])
            split[name.replace(".q_proj.", ".output_gate.")] = per_head[:, head_dim:].reshape(-1, tensor.shape[-1])
        elif ".self_attn.q_proj.lora_A." in name:  # a copy: a safetensors file holds no shared storage
            split[name], split[name.replace(".q_proj.", ".output_gate.")] = tensor, tensor.clone()
        else:
            split[name] = tensor
    return split


class BeamForCausalLM(nn.Module, SupportsPP, SupportsLoRA):
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            # Dense layers only: expert weights (".mlp.experts.E.gate_proj") go to the MoE runner.
            ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
            ".mlp.up_proj": (".mlp.gate_up_proj", 1),
        }
    )
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    embedding_modules: dict[str, str] = {}  # LoRA: neither the embedding nor the LM head is adapted

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.model = BeamModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        # Untied embeddings and LM head: the head is its own tensor, held by the last rank only.
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=config.final_logit_softcapping)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # AutoWeightsLoader drops tensors of PPMissingLayer modules (other stages' layers, embedding
        # or head): the same skip as is_pp_missing_parameter in hand-written loaders.
        loader = AutoWeightsLoader(self)
        return loader.load_weights(split_q_and_gate(weights, self.config), mapper=self.hf_to_vllm_mapper)
