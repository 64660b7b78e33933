"""hf_tfm models: one configurable transformer stack (encoder or decoder) with Hugging Face heads.

Every variant is decided in one place: `NORM_CLASSES` picks the norm, `make_ffn` the feed-forward (dense `TfmMLP` or
mixture of experts), `TfmModel.__init__` the position scheme, `TfmBlock.forward` the residual layout. Attention goes
through transformers' attention interface and masks through its masking utilities, so eager, sdpa, flex and flash
kernels, KV caches and packing all come from transformers. Checkpoint folders (saving all at once, damaged files,
the code a folder carries) are `checkpoint.py`'s, the FSDP2 workarounds `distributed.py`'s. This file imports only
torch, transformers and those modules beside it, which import no other hf_tfm module: a saved checkpoint carries all
of them as remote code and loads where hf_tfm is not installed.
"""

import functools
import inspect
import math
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache, StaticLayer
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.integrations import use_experts_implementation
from transformers.integrations.sdpa_attention import repeat_kv  # (B, H_kv, S, D) -> (B, H, S, D) for GQA
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    create_causal_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPast,
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    ModelOutput,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bart.modeling_bart import shift_tokens_right
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .checkpoint import repair_remote_code, staged_save, weights_damage
from .configuration import TfmConfig, TfmSeq2SeqConfig
from .distributed import full_shape, prepare_fsdp, share_tied_tensors

logger = logging.get_logger(__name__)

# ---------------------------------------------------------------------------------------------------------------------
# Norms. The class names contain "LayerNorm"/"RMSNorm" on purpose: transformers' default init recognises them by name.


class TfmLayerNorm(nn.LayerNorm):
    """LayerNorm with an optional bias (`config.norm_bias`)."""

    def __init__(self, hidden_size: int, eps: float, bias: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, bias=bias)


class TfmRMSNorm(nn.Module):
    """RMSNorm (arXiv:1910.07467), computed in fp32 like Llama's so imported weights match it exactly."""

    def __init__(self, hidden_size: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(full_shape(self.weight))}, eps={self.variance_epsilon}"


NORM_CLASSES = {"layernorm": TfmLayerNorm, "rmsnorm": TfmRMSNorm}


def make_norm(config: TfmConfig, size: int | None = None) -> nn.Module:
    """The one place that turns `norm_type` into a module."""
    return NORM_CLASSES[config.norm_type](size or config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


# ---------------------------------------------------------------------------------------------------------------------
# Positions. Absolute schemes (learned, sinusoidal) add to the embeddings; RoPE rotates q/k; ALiBi biases the scores.
# Every computed buffer is non-persistent and rebuilt in `_init_weights`, because `from_pretrained` builds on meta.


class TfmRotaryEmbedding(nn.Module):
    """Rotary embedding (arXiv:2104.09864) in the rotate-half layout, with transformers' RoPE scaling types.

    With a flat `rope_parameters` there is one `inv_freq`; nested by layer type (`config.rope_per_layer_type`) there
    is one `{layer_type}_inv_freq` per used layer type, in the layout `dynamic_rope_update` expects, and `forward`
    takes the `layer_type`.
    """

    def __init__(self, config: TfmConfig) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.layer_types = sorted(set(config.layer_types)) if config.rope_per_layer_type else []
        if self.layer_types:
            self.rope_type, self.attention_scaling = {}, {}
            for layer_type in self.layer_types:
                self.rope_type[layer_type] = config.rope_parameters[layer_type]["rope_type"]
                inv_freq, self.attention_scaling[layer_type] = self.rope_init_fn(layer_type)(
                    config, layer_type=layer_type
                )
                setattr(self, f"{layer_type}_inv_freq", nn.Buffer(inv_freq, persistent=False))
                setattr(self, f"{layer_type}_original_inv_freq", nn.Buffer(inv_freq.clone(), persistent=False))
            return
        self.rope_type = config.rope_parameters["rope_type"]
        inv_freq, self.attention_scaling = self.rope_init_fn()(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    def rope_init_fn(self, layer_type: str | None = None) -> Callable:
        rope_type = self.rope_type if layer_type is None else self.rope_type[layer_type]
        return self.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]

    @staticmethod
    def compute_default_rope_parameters(
        config: TfmConfig, device=None, layer_type: str | None = None, **kwargs
    ) -> tuple[torch.Tensor, float]:
        params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
        base, dim = params["rope_theta"], config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device, torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update  # rebuilds inv_freq for the "dynamic" and "longrope" scaling types
    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq if layer_type is None else getattr(self, f"{layer_type}_inv_freq")
        scaling = self.attention_scaling if layer_type is None else self.attention_scaling[layer_type]
        freqs = position_ids[..., None].float() * inv_freq.to(x.device)  # (B, T, D/2), always in fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # two slices: fewer dispatcher ops than chunk -> split -> narrow (decode overhead)
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D): broadcast over heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class TfmSinusoidalEmbedding(nn.Module):
    """Fixed sinusoidal positions ("Attention Is All You Need"), computed for any position.

    Angle i is pos / 10000^(2i/D). `sinusoidal_layout="interleaved"` is the paper's table: sin on even dimensions,
    cos on odd ones; "halves" is fairseq's and Marian's: all sines, then all cosines. An odd D drops the last cosine.
    """

    def __init__(self, config: TfmConfig) -> None:
        super().__init__()
        self.dim = config.hidden_size
        self.interleaved = config.sinusoidal_layout == "interleaved"
        self.inv_freq = nn.Buffer(self.compute_inv_freq(self.dim), persistent=False)

    @staticmethod
    def compute_inv_freq(dim: int, device: torch.device | None = None) -> torch.Tensor:
        return 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:
            # `model.to(torch.bfloat16)` casts this buffer too: frequencies off by 2^-9 turn position p's angles by up
            # to p * 2^-9 rad (a whole radian at p = 512), so the table is computed from fp32 ones whatever its dtype.
            inv_freq = self.compute_inv_freq(self.dim, inv_freq.device)
        angles = position_ids[..., None].float() * inv_freq  # (B, T, ceil(D/2))
        if self.interleaved:
            emb = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
        else:
            emb = torch.cat((angles.sin(), angles.cos()), dim=-1)
        return emb[..., : self.dim].to(dtype)


class TfmAlibi(nn.Module):
    """ALiBi (arXiv:2108.12409): a per-head linear penalty -slope * |i - j| added to attention scores."""

    def __init__(self, config: TfmConfig) -> None:
        super().__init__()
        self.slopes = nn.Buffer(self.compute_slopes(config.num_attention_heads), persistent=False)

    @staticmethod
    def compute_slopes(num_heads: int) -> torch.Tensor:
        # Geometric slopes 2^(-8/n * i); for a non-power-of-2 head count, interleave the next power's (as the paper).
        def power_of_2_slopes(n: int) -> list[float]:
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            return [start * start**i for i in range(n)]

        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_2_slopes(closest)
        if closest < num_heads:
            slopes += power_of_2_slopes(2 * closest)[0::2][: num_heads - closest]
        return torch.tensor(slopes, dtype=torch.float)

    def forward(self, q_positions: torch.Tensor, k_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        distance = (q_positions[:, None] - k_positions[None, :]).abs().float()  # (T, S)
        return (-self.slopes[:, None, None] * distance).unsqueeze(0).to(dtype)  # (1, H, T, S)


# ---------------------------------------------------------------------------------------------------------------------
# Attention

# The KV cache's keyword and output field: `past_key_values` up to transformers 5.2x, `cache` in newer releases (the
# old name a deprecated alias). What depends on the release (5.16.1 to the newest) is decided here and below, once.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
# Continuous batching passes its `PagedAttentionCache` as `cache=`: the model's own cache keyword from 5.2x on, where
# the model updates it like any cache; before, it reached the attention kernel in its kwargs and the kernel updated it.
PAGED_CACHE_UPDATED_BY_MODEL = CACHE_NAME == "cache"


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, S)
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask  # additive float mask from masking_utils (min-dtype where masked)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, T, H, D)
    return out, weights


class TfmAttention(nn.Module):
    """Multi-head / grouped-query attention; the kernel comes from transformers' attention interface.

    Self-attention, or (`is_cross_attention`) a decoder's attention over the encoder output: keys and values come from
    the encoder's states, get no positions, and are computed once per source and kept in the cross-attention cache.
    """

    def __init__(self, config: TfmConfig, layer_idx: int, is_cross_attention: bool = False) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_kv_groups
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_cross_attention = is_cross_attention
        self.is_causal = config.is_causal and not is_cross_attention  # sdpa / flash read it when the mask is None
        sliding = config.layer_types[layer_idx] == "sliding_attention" and not is_cross_attention
        # Flash kernels read this as (window - 1) tokens either side: a decoder's self + (window - 1) previous tokens,
        # so an encoder (+-window tokens, as its mask) passes window + 1.
        self.sliding_window = (config.sliding_window + (not config.is_causal)) if sliding else None

        q_dim, kv_dim = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.attention_out_bias)
        # Self-attention's q, k and v as one layer, of `qkv_sizes` outputs: built for decoding by
        # `hf_tfm.inference.fuse_projections` (one pass over the weights); checkpoints and PEFT keep the three layers
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes: tuple[int, int, int] | None = None
        # None, or the q/k norm's scope: each head's values ("head"), or the whole projection ("projection", OLMoE)
        self.qk_norm = config.qk_norm_scope if config.qk_norm else None
        per_head = self.qk_norm == "head"
        self.q_norm = make_norm(config, self.head_dim if per_head else q_dim) if config.qk_norm else nn.Identity()
        self.k_norm = make_norm(config, self.head_dim if per_head else kv_dim) if config.qk_norm else nn.Identity()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        cache: Cache | None = None,
        key_value_states: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)  # -1 heads: tensor parallelism shards the head count

        if self.is_cross_attention:  # no positions: a source token's keys are the same for every target token
            query = self._heads(self.q_proj(hidden_states), self.q_norm, hidden_shape).transpose(1, 2)  # (B, H, T, D)
            key, value = self._cross_key_value(key_value_states, cache)
        else:
            query, key, value = self._self_projections(hidden_states)
            query = self._heads(query, self.q_norm, hidden_shape).transpose(1, 2)  # (B, H, T, D)
            key = self._heads(key, self.k_norm, hidden_shape).transpose(1, 2)
            value = value.view(hidden_shape).transpose(1, 2)  # (B, H_kv, T, D), as the key
            if position_embeddings is not None:
                query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
            if isinstance(cache, PagedAttentionCache):  # continuous batching: all sequences packed in one row
                if PAGED_CACHE_UPDATED_BY_MODEL:
                    key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)  # fills the kernel's kwargs
                else:
                    kwargs["cache"] = cache  # the paged kernels of these releases write and read the cache themselves
            elif cache is not None:
                key, value = cache.update(key, value, self.layer_idx)  # (B, H_kv, S, D) with S = past + T
            if position_bias is not None:
                kwargs["position_bias"] = position_bias

        # Looked up and called here, in `forward`: vLLM's Transformers backend finds the attention call in this source.
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return self.o_proj(out.reshape(*input_shape, -1)), weights

    def _self_projections(self, states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, T, C) -> queries, keys and values (B, T, heads * D): one product where decoding fused the layers."""
        if self.qkv_proj is not None:
            return self.qkv_proj(states).split(self.qkv_sizes, dim=-1)
        return self.q_proj(states), self.k_proj(states), self.v_proj(states)

    def _heads(self, x: torch.Tensor, norm: nn.Module, shape: tuple) -> torch.Tensor:
        """(B, T, heads * D) -> (B, T, heads, D) queries or keys, normed over the whole projection or per head."""
        if self.qk_norm == "projection":
            x = norm(x)
        x = x.view(shape)
        return norm(x) if self.qk_norm == "head" else x  # no Identity module call when off (decode overhead)

    def _cross_key_value(
        self, states: torch.Tensor, cache: EncoderDecoderCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder states' keys and values: projected at the first decoder step, then read back from the cache."""
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            return layer.keys, layer.values
        kv_shape = (*states.shape[:-1], -1, self.head_dim)
        key = self._heads(self.k_proj(states), self.k_norm, kv_shape)
        key, value = key.transpose(1, 2), self.v_proj(states).view(kv_shape).transpose(1, 2)  # (B, H_kv, S, D)
        if cache is not None:
            key, value = cache.cross_attention_cache.update(key, value, self.layer_idx)
            cache.is_updated[self.layer_idx] = True
        return key, value


class TfmMLP(nn.Module):
    """Feed-forward: `mlp` is down(act(up(x))); `glu` is down(act(gate(x)) * up(x)) (SwiGLU, GeGLU)."""

    def __init__(self, config: TfmConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.is_glu = config.ffn_type == "glu"
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias) if self.is_glu else None
        self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]
        # gate and up as one layer (gate's outputs first): built for decoding by `hf_tfm.inference.fuse_projections`
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_glu:
            return self.down_proj(self.act_fn(self.up_proj(x)))
        gate, up = self._gate_up(x)
        return self.down_proj(self.act_fn(gate) * up)

    def _gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """gate's and up's outputs: one product where decoding fused the layers."""
        if self.gate_up_proj is not None:
            return self.gate_up_proj(x).chunk(2, dim=-1)
        return self.gate_proj(x), self.up_proj(x)


# ---------------------------------------------------------------------------------------------------------------------
# Mixture of experts (`num_experts`; Switch Transformer arXiv:2101.03961, Mixtral arXiv:2401.04088). A router picks
# each token's top-k experts; the experts are fused 3-D parameters run by transformers' experts interface, chosen per
# call by `config._experts_implementation` (eager, batched_mm, grouped_mm, ...). Module and parameter names are
# Qwen2-MoE's, so PEFT targets, the TP / EP plans and the saved checkpoint layout are those of the in-tree MoE models.


class TfmTopKRouter(nn.Module):
    """Linear router: softmax over all experts in fp32, then the top-k probabilities as routing weights.

    Not an `nn.Linear` (as in-tree routers): `target_modules="all-linear"` leaves it alone; LoRA reaches it through
    `target_parameters=["mlp.gate.weight"]`. Returns `(router_logits, top_k_weights, top_k_index)`, logits first for
    the `router_logits` recorder.
    """

    def __init__(self, config: TfmConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.weights_fp32 = config.router_weights_fp32
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits = nn.functional.linear(hidden_states, self.weight)  # (T, E), in the hidden dtype
        probs = nn.functional.softmax(router_logits, dim=-1, dtype=torch.float32)
        top_k_weights, top_k_index = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        if self.norm_topk_prob:
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        if not self.weights_fp32:  # Mixtral scales the expert outputs in fp32; Qwen2-MoE and OLMoE in the hidden dtype
            top_k_weights = top_k_weights.to(router_logits.dtype)
        return router_logits, top_k_weights, top_k_index

    def extra_repr(self) -> str:
        return f"{full_shape(self.weight)[1]} -> {self.num_experts} experts, top-{self.top_k}"


@use_experts_implementation
class TfmExperts(nn.Module):
    """`num_experts` gated FFNs as 3-D parameters, each expert in `nn.Linear` (out, in) layout: `gate_up_proj`
    (E, 2 I, H) holds [gate; up], `down_proj` (E, H, I). `forward` is the eager path; the decorator dispatches to the
    configured implementation on every call, so `set_experts_implementation` takes effect at once."""

    def __init__(self, config: TfmConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts  # the local count under expert parallelism (rewritten by its plan)
        h, i = config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, h, i))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)  # (T, H)
        with torch.no_grad():
            # Index `num_experts` is expert parallelism's "routed to another rank" sentinel: counted, then skipped.
            expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()  # (E + 1, k, T) -> hit experts
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            gate, up = nn.functional.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, current.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        experts, width, hidden = full_shape(self.gate_up_proj)
        return f"{experts} x ({hidden} -> 2 x {width // 2} -> {hidden})"


class TfmSparseMoeBlock(nn.Module):
    """Routed experts, plus (with `shared_expert_intermediate_size`) a dense expert every token uses, scaled by a
    sigmoid gate (Qwen2-MoE)."""

    def __init__(self, config: TfmConfig) -> None:
        super().__init__()
        self.jitter_noise = config.router_jitter_noise
        self.gate = TfmTopKRouter(config)
        self.experts = TfmExperts(config)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size is not None:
            self.shared_expert = TfmMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral: the experts see the jittered input too
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        hidden_states = hidden_states.reshape(-1, shape[-1])  # (B * T, H): routing is per token
        _, top_k_weights, top_k_index = self.gate(hidden_states)
        out = self.experts(hidden_states, top_k_index, top_k_weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return out.reshape(shape)


def make_ffn(config: TfmConfig, layer_idx: int) -> nn.Module:
    """The feed-forward of layer `layer_idx`: experts where `config.is_sparse_layer(layer_idx)`, else `TfmMLP`."""
    return TfmSparseMoeBlock(config) if config.is_sparse_layer(layer_idx) else TfmMLP(config)


def load_balancing_loss_func(
    gate_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (arXiv:2101.03961, eqs. 4-6) over every sparse layer's router logits.

    E * sum_e f_e * P_e, with f_e the share of top-k assignments to expert e and P_e its mean router probability,
    counting real tokens only when a 2-D `attention_mask` is given; perfect balance gives `top_k`. The same function
    as transformers' (a copy of the one in its in-tree MoE models, which no stable module exports; a test checks it).
    """
    device = gate_logits[0].device
    # histc instead of bincount: no device-to-host sync; CPU takes floats, GPUs need ints to be deterministic.
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = 0.0
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)  # (B * T,)
    for layer_logits in gate_logits:
        probs = nn.functional.softmax(layer_logits.to(device), dim=-1)  # (B * T, E)
        _, selected = torch.topk(probs, top_k, dim=-1)
        if mask is None:
            counts = torch.histc(selected.reshape(-1).to(histc_dtype), bins=num_experts, min=0, max=num_experts)
            tokens_per_expert = tokens_per_expert + counts
            prob_per_expert = prob_per_expert + probs.float().sum(dim=0)
            rows = rows + probs.shape[0]
        else:
            counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
            tokens_per_expert = tokens_per_expert + counts.scatter_add_(
                0, selected.reshape(-1), mask.repeat_interleave(top_k)
            )
            prob_per_expert = prob_per_expert + (probs.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return torch.sum((tokens_per_expert / rows) * (prob_per_expert / rows).unsqueeze(0)) * num_experts


# The heads' outputs with a mixture-of-experts backbone: their dense output plus the expert fields of a mixin. The
# mixin comes first among the bases, so its fields come last (a dataclass orders fields from the last base up) and the
# dense output's fields keep their places in a tuple output (`return_dict=False`).


@dataclass
class TfmMoeModelOutput(MoeModelOutputWithPast):
    """The backbone's output with experts: `router_logits`, and `cross_attentions` when it is a seq2seq decoder."""

    cross_attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class MoeHeadFields:
    """What a head's output gains with experts: the load-balancing loss and every sparse layer's router logits."""

    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class MoeSeq2SeqFields:
    """What an encoder-decoder's output gains with experts on either side: each side's router logits (no aux loss)."""

    router_logits: tuple[torch.FloatTensor, ...] | None = None  # the decoder's, as a causal LM's
    encoder_router_logits: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class TfmMoeSequenceClassifierOutput(MoeHeadFields, SequenceClassifierOutput):
    pass


@dataclass
class TfmMoeTokenClassifierOutput(MoeHeadFields, TokenClassifierOutput):
    pass


@dataclass
class TfmMoeQuestionAnsweringModelOutput(MoeHeadFields, QuestionAnsweringModelOutput):
    pass


@dataclass
class TfmMoeMaskedLMOutput(MoeHeadFields, MaskedLMOutput):
    pass


@dataclass
class TfmMoeSeq2SeqModelOutput(MoeSeq2SeqFields, Seq2SeqModelOutput):
    pass


@dataclass
class TfmMoeSeq2SeqLMOutput(MoeSeq2SeqFields, Seq2SeqLMOutput):
    pass


MOE_OUTPUTS = {
    CausalLMOutputWithPast: MoeCausalLMOutputWithPast,
    SequenceClassifierOutput: TfmMoeSequenceClassifierOutput,
    TokenClassifierOutput: TfmMoeTokenClassifierOutput,
    QuestionAnsweringModelOutput: TfmMoeQuestionAnsweringModelOutput,
    MaskedLMOutput: TfmMoeMaskedLMOutput,
}


class TfmBlock(GradientCheckpointingLayer):
    """One transformer layer. `norm_position` and `parallel_residual` choose the residual layout, here only.

    With `add_cross_attention` (a seq2seq decoder) a cross-attention sub-layer over the encoder output sits between
    the self-attention and the feed-forward, with its own norm, as in "Attention Is All You Need". Called without
    `encoder_hidden_states` it is skipped, as BART's decoder skips it: the decoder then runs alone, a causal LM.
    """

    def __init__(self, config: TfmConfig, layer_idx: int) -> None:
        super().__init__()
        self.norm_position = config.norm_position
        self.parallel_residual = config.parallel_residual
        self.self_attn = TfmAttention(config, layer_idx)
        cross = config.add_cross_attention
        self.encoder_attn = TfmAttention(config, layer_idx, is_cross_attention=True) if cross else None
        self.mlp = make_ffn(config, layer_idx)
        # The norm of the attention sub-layer (before it, or after the residual); layer 0 may skip it (pre-norm only).
        self.attn_norm = make_norm(config) if layer_idx > 0 or config.first_layer_attn_norm else nn.Identity()
        self.cross_attn_norm = make_norm(config) if cross else None
        self.mlp_norm = make_norm(config)  # the norm of the feed-forward sub-layer
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,  # positional: gradient checkpointing passes args on
        encoder_attention_mask: torch.Tensor | None = None,
        cross_cache: EncoderDecoderCache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        x = hidden_states
        # Dropout is the identity in eval mode or at p=0: skip its module call (per-token decode overhead).
        drop = self.dropout if self.training and self.dropout.p > 0 else _identity
        attn, mlp = self.self_attn, self.mlp
        if self.parallel_residual:  # GPT-J / NeoX / PaLM: both sub-layers read the same input
            return x + drop(attn(self.attn_norm(x), attention_mask, **kwargs)[0]) + drop(mlp(self.mlp_norm(x)))

        source = (encoder_hidden_states, encoder_attention_mask, cross_cache)
        if self.norm_position == "pre":
            x = x + drop(attn(self.attn_norm(x), attention_mask, **kwargs)[0])
            if self.encoder_attn is not None and encoder_hidden_states is not None:
                x = x + drop(self.cross_attend(self.cross_attn_norm(x), *source))
            return x + drop(mlp(self.mlp_norm(x)))
        x = self.attn_norm(x + drop(attn(x, attention_mask, **kwargs)[0]))  # post-norm (original Transformer, BERT)
        if self.encoder_attn is not None and encoder_hidden_states is not None:
            x = self.cross_attn_norm(x + drop(self.cross_attend(x, *source)))
        return self.mlp_norm(x + drop(mlp(x)))

    def cross_attend(
        self,
        x: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None,
        cross_cache: EncoderDecoderCache | None,
    ) -> torch.Tensor:
        out, _ = self.encoder_attn(
            x, encoder_attention_mask, cache=cross_cache, key_value_states=encoder_hidden_states
        )
        return out


# ---------------------------------------------------------------------------------------------------------------------
# Models


def accepts_cache_alias(forward: Callable) -> Callable:
    """Take the cache as `cache` or `past_key_values` on every release (generate and PEFT pass the release's name)."""
    if CACHE_NAME == "cache":  # the release's own deprecation path, with its warning
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def forward_with_alias(*args, **kwargs):
        if "past_key_values" in kwargs:  # the current name on this release: no warning
            kwargs["cache"] = kwargs.pop("past_key_values")
        return forward(*args, **kwargs)

    return forward_with_alias


try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers < 5.2x: the same slicing, inline in each model (int or 1-D positions)

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]


# Every checkpoint names all heads of its kind, so any Auto class can load it with remote code (a new head starts
# untrained). Encoder-decoder checkpoints have their own config class and heads.
SEQ2SEQ_AUTO_MAP = {
    "AutoConfig": "configuration.TfmSeq2SeqConfig",
    "AutoModel": "modeling.TfmSeq2SeqModel",
    "AutoModelForSeq2SeqLM": "modeling.TfmForConditionalGeneration",
}
AUTO_MAP = {
    "AutoConfig": "configuration.TfmConfig",
    "AutoModel": "modeling.TfmModel",
    "AutoModelForCausalLM": "modeling.TfmForCausalLM",
    "AutoModelForSequenceClassification": "modeling.TfmForSequenceClassification",
    "AutoModelForMaskedLM": "modeling.TfmForMaskedLM",
    "AutoModelForTokenClassification": "modeling.TfmForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling.TfmForQuestionAnswering",
}


class TfmPreTrainedModel(PreTrainedModel):
    """Shared class attributes, weight init and checkpoint layout of every hf_tfm model."""

    config: TfmConfig
    config_class = TfmConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TfmBlock"]
    _skip_keys_device_placement = [CACHE_NAME]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _auto_map = AUTO_MAP
    _can_record_outputs = {
        "hidden_states": TfmBlock,
        "attentions": OutputRecorder(TfmAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(TfmAttention, index=1, layer_name="encoder_attn"),
        "router_logits": OutputRecorder(TfmTopKRouter, index=0),  # one (B * T, E) tensor per sparse layer
    }

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """`PreTrainedModel.save_pretrained`, all at once (`checkpoint.staged_save`), with an `auto_map` entry for
        every hf_tfm head.

        The checkpoint is written to a hidden folder next to `save_directory`, which replaces it only once complete:
        a reader, or a save that fails or is killed midway, finds the old checkpoint or the new one, never a mix.
        Nothing is staged, and transformers' save runs as it is, on a rank that does not write, on every rank of a
        `distributed_checkpoint` (each writes its own files) and at a file's path (which transformers refuses). A
        model whose class torch generated (native FSDP2's `FSDPTfmForCausalLM`) would carry torch's code, not ours:
        `checkpoint.repair_remote_code` puts ours back.
        """
        options = inspect.signature(PreTrainedModel.save_pretrained).bind(self, save_directory, *args, **kwargs)
        options.apply_defaults()
        options = options.arguments
        writes = self.should_save_on_this_rank(options["is_main_process"])
        writing = nullcontext(save_directory)
        if writes and not options.get("distributed_checkpoint") and not Path(save_directory).is_file():
            writing = staged_save(save_directory, options["variant"], getattr(self, "_hf_peft_config_loaded", False))
        if options["push_to_hub"]:  # transformers names the repository after the folder: the target, not a staging one
            kwargs.setdefault("repo_id", os.fspath(save_directory).split(os.path.sep)[-1])
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **self._auto_map}
        try:
            with writing as folder:
                super().save_pretrained(folder, *args, **kwargs)
                if writes and type(self).__module__.startswith("torch."):
                    repair_remote_code(Path(folder), type(self), __file__, self._auto_map)
        finally:
            self.config.auto_map = {**self.config.auto_map, **self._auto_map}
        # transformers' barrier (TP, FSDP) let the other ranks go once rank 0 had written; they wait for the swap too
        self.barrier_after_gathered_checkpoint_save(getattr(self.config, "distributed_config", None))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> "TfmPreTrainedModel":
        """`PreTrainedModel.from_pretrained`; a damaged local checkpoint fails naming the file and the problem.

        transformers reports a truncated safetensors file only as "Error while deserializing header": here the error
        names the file (`checkpoint.weights_damage`). Every other error is transformers' own, with its type and advice
        (a size mismatch stays the `RuntimeError` that suggests `ignore_mismatched_sizes=True`).
        """
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except Exception as err:
            damage = weights_damage(pretrained_model_name_or_path)
            if damage is None:
                raise
            raise OSError(damage) from err

    @classmethod
    def maybe_distribute_model(cls, model: "TfmPreTrainedModel", distributed_config, *args, **kwargs):
        """transformers' TP / FSDP2 setup, with tied weights shared by one FSDP2 parameter (`prepare_fsdp`)."""
        prepare_fsdp(model, distributed_config)
        return super().maybe_distribute_model(model, distributed_config, *args, **kwargs)

    def gather_sharded_state_dict_for_save(self, model_to_save, state_dict: dict, *args, **kwargs) -> dict:
        """transformers' gathered state dict, with tied weights sharing one tensor again (`share_tied_tensors`)."""
        state_dict = super().gather_sharded_state_dict_for_save(model_to_save, state_dict, *args, **kwargs)
        return share_tied_tensors(model_to_save, state_dict)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if module is getattr(self, "embed_tokens", None) and _paper_embeddings(self.config):
            # The init that goes with the paper's scale (tensor2tensor's, fairseq's): std 1/sqrt(d) times sqrt(d)
            # gives token embeddings of unit variance, the scale of the +-1 table they are added to. At
            # initializer_range they would start ~50x smaller, and bf16 sums would get ~15% of their signal wrong.
            init.normal_(module.weight, mean=0.0, std=self.config.hidden_size**-0.5)
            return
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, TfmAttention):  # GPT-2 scaled init: keeps the residual stream's variance flat with depth
            init.normal_(module.o_proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))
        elif isinstance(module, TfmMLP):
            init.normal_(module.down_proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))
        elif isinstance(module, TfmExperts):  # created with torch.empty; down_proj scaled as the dense one's
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))
        elif isinstance(module, TfmTopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, TfmSinusoidalEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq(module.dim))
        elif isinstance(module, TfmAlibi):
            init.copy_(module.slopes, module.compute_slopes(self.config.num_attention_heads))
        elif isinstance(module, TfmRotaryEmbedding) and module.layer_types:
            # Per-layer-type buffers: transformers' default rotary init (flat `inv_freq` only) skips these.
            for layer_type in module.layer_types:
                inv_freq, _ = module.rope_init_fn(layer_type)(module.config, layer_type=layer_type)
                init.copy_(getattr(module, f"{layer_type}_inv_freq"), inv_freq)
                init.copy_(getattr(module, f"{layer_type}_original_inv_freq"), inv_freq)


def _paper_embeddings(config: TfmConfig) -> bool:
    """Sinusoidal positions with token embeddings scaled by sqrt(hidden_size): the default there, and the paper's."""
    scaled = math.isclose(config.embedding_scale, math.sqrt(config.hidden_size))
    return config.position_embedding_type == "sinusoidal" and scaled


def _full_length_cross_layers(cache: EncoderDecoderCache, source_length: int) -> None:
    """Make the cross-attention cache keep every source token, before its first use.

    `generate()` builds the cross-attention cache from the decoder's config, so a decoder with sliding-window layers
    gets sliding cross-attention layers, which would keep only the last window - 1 encoder keys for the next steps.
    """
    layers = cache.cross_attention_cache.layers
    for i, layer in enumerate(layers):
        if layer.is_sliding and not cache.is_updated.get(i):
            layers[i] = StaticLayer(max_cache_len=source_length) if isinstance(layer, StaticLayer) else DynamicLayer()


def _check_ids(ids: torch.Tensor, limit: int, name: str, knob: str) -> None:
    """Out-of-range ids would index past an embedding table: say which, instead of an opaque IndexError."""
    if torch.compiler.is_compiling() or ids.numel() == 0:
        return
    low, high = (t.item() for t in torch.aminmax(ids))  # two syncs, no extra comparison kernels
    if low < 0 or high >= limit:
        raise ValueError(f"`{name}` must lie in [0, {limit}) ({knob}), got values in [{low}, {high}].")


class TfmModel(TfmPreTrainedModel):
    """The backbone: embeddings, `num_hidden_layers` blocks and (pre-norm) a final norm. Encoder or decoder."""

    def __new__(cls, config: TfmConfig | None = None, *args, **kwargs) -> "TfmModel":
        # A backbone with experts is a `TfmMoeModel` wherever it is built: bare, under a head or a seq2seq side.
        if cls is TfmModel and getattr(config, "num_experts", None) is not None:
            cls = TfmMoeModel
        return super().__new__(cls)

    def __init__(self, config: TfmConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        # No padding_idx: it would freeze the pad row's gradient, and GPT-2-style vocabularies use eos as pad (a
        # real token). Padding needs no help: masked keys and -100 labels already give pad tokens no gradient.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = None
        self.rotary_emb = None
        self.alibi = None
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(
                config.max_position_embeddings + config.position_offset, config.hidden_size
            )
        elif config.position_embedding_type == "sinusoidal":
            self.embed_positions = TfmSinusoidalEmbedding(config)
        elif config.position_embedding_type == "rope":
            self.rotary_emb = TfmRotaryEmbedding(config)
        else:
            self.alibi = TfmAlibi(config)
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size > 0 else None
        )
        self.embed_norm = make_norm(config) if config.embedding_norm else nn.Identity()
        self.embed_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(TfmBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config) if config.final_norm else nn.Identity()
        # BERT's pooler, kept so an imported one is not lost; heads pass add_pooling_layer=False (as BERT's do).
        self.pooler = None
        if config.add_pooling_layer and add_pooling_layer:
            self.pooler = TfmPredictionHead(config, config.classifier_activation, norm=False)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @accepts_cache_alias
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        config = self.config
        # A seq2seq decoder's inputs are the caller's `decoder_*` arguments: errors name those.
        arg = "decoder_" if config.add_cross_attention else ""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(f"Pass exactly one of `{arg}input_ids` or `{arg}inputs_embeds`.")
        config._validate_attn_implementation(config._attn_implementation)
        if use_cache is None:  # an encoder has nothing to decode; training builds no cache (packing relies on it)
            use_cache = config.use_cache and config.is_causal and not self.training
        fresh_cache = use_cache and cache is None
        cache, self_cache, past_length = self._caches(cache, fresh_cache, encoder_hidden_states)
        if input_ids is not None:
            _check_ids(input_ids, config.vocab_size, f"{arg}input_ids", "vocab_size")
            inputs_embeds = self.embed_tokens(input_ids)
        position_ids = self._position_ids(inputs_embeds, attention_mask, position_ids, past_length, arg)
        hidden_states = self._embed(inputs_embeds, position_ids, token_type_ids)

        masks = attention_mask
        if not isinstance(masks, dict):  # generate() may pass masks already built per layer type
            # An empty cache we just made adds no offset; leaving it out lets the masks see packed position_ids.
            masks = self._build_masks(inputs_embeds, attention_mask, None if fresh_cache else self_cache, position_ids)
        # A seq2seq decoder's layers also read the encoder output. No `*args` here: llm-compressor's tracer wraps a
        # call with starred arguments whole, and would then not see the layers it calibrates one by one.
        hidden_states = self._layers(
            hidden_states,
            inputs_embeds,
            position_ids,
            masks,
            cache,
            self_cache,
            encoder_hidden_states,
            encoder_attention_mask,
            **kwargs,
        )
        return self._output(hidden_states, input_ids, attention_mask, cache if use_cache else None)

    def _caches(
        self, cache: Cache | None, fresh: bool, encoder_hidden_states: torch.Tensor | None
    ) -> tuple[Cache | None, Cache | None, int]:
        """The cache this call fills (a new one when `fresh`), the part of it that self-attention, positions and
        masks read (the decoder's own tokens), and how many tokens that part holds already."""
        config = self.config
        if fresh:
            cache = DynamicCache(config=config)
            if config.add_cross_attention:  # cross-attention keys span the whole source: no sliding layers there
                cache = EncoderDecoderCache(cache, DynamicCache())
        paged = isinstance(cache, PagedAttentionCache)  # continuous batching: positions and masks come prepared
        if paged and (self.alibi is not None or not config.is_causal or config.add_cross_attention):
            knob = "position_embedding_type='alibi'" if self.alibi is not None else "is_causal=False"
            knob = "add_cross_attention=True" if config.add_cross_attention else knob
            raise ValueError(
                f"`{knob}` cannot run under continuous batching: its paged attention is causal self-attention with "
                "no position bias. Use generate(), or a causal rope/learned/sinusoidal decoder-only model."
            )
        self_cache = cache
        if isinstance(cache, EncoderDecoderCache):
            self_cache = cache.self_attention_cache
            if encoder_hidden_states is not None:
                _full_length_cross_layers(cache, encoder_hidden_states.shape[1])
        past_length = self_cache.get_seq_length() if self_cache is not None and not paged else 0
        return cache, self_cache, past_length

    def _position_ids(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | dict | None,
        position_ids: torch.LongTensor | None,
        past_length: int,
        arg: str,
    ) -> torch.LongTensor:
        """The given positions, else each token's count of real tokens before it (with a 2-D mask), else
        `past_length` onwards; a 2-D mask must cover the cached and the new tokens."""
        batch_size, seq_length = inputs_embeds.shape[:2]
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2:
            if attention_mask.shape != (batch_size, past_length + seq_length):
                raise ValueError(
                    f"`{arg}attention_mask` has shape {tuple(attention_mask.shape)} but the inputs need "
                    f"({batch_size}, {past_length + seq_length}): (batch, cached + new tokens)."
                )
            if position_ids is None:  # count real tokens only, so left padding does not shift positions
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq_length:]
        if position_ids is None:  # a length-independent arange: a static cache's length is a tensor under compile
            position_ids = (torch.arange(seq_length, device=inputs_embeds.device) + past_length)[None]
        return position_ids

    def _embed(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.LongTensor | None
    ) -> torch.Tensor:
        """The first layer's input: token embeddings (scaled), absolute positions and token types added, then the
        embedding norm and dropout where the config has them."""
        config = self.config
        hidden_states = inputs_embeds * config.embedding_scale if config.embedding_scale != 1.0 else inputs_embeds
        if self.embed_positions is not None:
            hidden_states = hidden_states + self._absolute_positions(position_ids, inputs_embeds.dtype)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(position_ids)
            _check_ids(token_type_ids, config.type_vocab_size, "token_type_ids", "type_vocab_size")
            hidden_states = hidden_states + self.token_type_embeddings(token_type_ids)
        if config.embedding_norm:
            hidden_states = self.embed_norm(hidden_states)
        if self.training and self.embed_dropout.p > 0:
            hidden_states = self.embed_dropout(hidden_states)
        return hidden_states

    def _layers(
        self,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        masks: dict[str, torch.Tensor | None],
        cache: Cache | None,
        self_cache: Cache | None,
        encoder_hidden_states: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """Every block in turn, each given its layer type's mask, RoPE or ALiBi bias (and a decoder's the encoder
        output), then the final norm."""
        config = self.config
        position_embeddings = self._rotary(hidden_states, position_ids)
        biases = self._alibi_biases(inputs_embeds, self_cache) if self.alibi is not None else {}
        cross_mask = None
        if config.add_cross_attention and encoder_hidden_states is not None:
            cross_mask = self._cross_mask(inputs_embeds, encoder_hidden_states, encoder_attention_mask)
        for layer, layer_type in zip(self.layers, config.layer_types, strict=True):
            hidden_states = layer(
                hidden_states,
                masks[layer_type],
                encoder_hidden_states,
                encoder_attention_mask=cross_mask,
                cross_cache=cache if config.add_cross_attention else None,
                position_embeddings=position_embeddings.get(layer_type),
                position_bias=biases.get(layer_type),
                cache=self_cache,
                **kwargs,
            )
        return self.norm(hidden_states)

    def _output(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | dict | None,
        cache: Cache | None,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """The backbone's output class (with experts: the MoE one), or with BERT's pooler the pooled output too."""
        config = self.config
        if self.pooler is None:  # `router_logits` is filled in by `capture_outputs` when requested
            output_class = (
                BaseModelOutputWithPastAndCrossAttentions if config.num_experts is None else TfmMoeModelOutput
            )
            return output_class(last_hidden_state=hidden_states, **{CACHE_NAME: cache})
        mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 else None
        pad_mask = None
        if mask is None and input_ids is not None and config.pad_token_id is not None:
            pad_mask = input_ids != config.pad_token_id
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=hidden_states,
            pooler_output=self.pooler(pool(hidden_states, mask, config.classifier_pooling, pad_mask)),
            **{CACHE_NAME: cache},
        )

    def _rotary(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple]:
        """RoPE (cos, sin) per layer type: one shared pair, or one per type when `rope_parameters` is nested."""
        if self.rotary_emb is None:
            return {}
        if self.rotary_emb.layer_types:
            return {t: self.rotary_emb(hidden_states, position_ids, t) for t in self.rotary_emb.layer_types}
        shared = self.rotary_emb(hidden_states, position_ids)
        return dict.fromkeys(self.config.layer_types, shared)

    def _absolute_positions(self, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(self.embed_positions, nn.Embedding) and not torch.compiler.is_compiling():
            limit = self.config.max_position_embeddings
            if int(position_ids.max()) >= limit:
                side = "the decoder's " if self.config.add_cross_attention else ""
                raise ValueError(
                    f"Position {int(position_ids.max())} is out of range for {side}learned positions: "
                    f"max_position_embeddings={limit}. Shorten the input or use rope/alibi/sinusoidal positions."
                )
        if isinstance(self.embed_positions, nn.Embedding):
            return self.embed_positions(position_ids + self.config.position_offset)
        return self.embed_positions(position_ids, dtype)

    def _cross_mask(
        self, inputs_embeds: torch.Tensor, encoder_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor
    ) -> torch.Tensor | None:
        """Every target token sees every real source token: the encoder's padding mask, as transformers builds it."""
        mask = encoder_attention_mask
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape != encoder_hidden_states.shape[:2]:
            raise ValueError(
                f"The source's `attention_mask` has shape {tuple(encoder_attention_mask.shape)} but the encoder "
                f"output is {tuple(encoder_hidden_states.shape[:2])}: (batch, source tokens)."
            )
        return create_bidirectional_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=encoder_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
        )

    def _build_masks(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.Tensor,
    ) -> dict[str, torch.Tensor | None]:
        """One mask per layer type, from transformers' masking utilities (bool, float, BlockMask or None)."""
        kinds = set(self.config.layer_types)
        masks = {}
        if self.config.is_causal:  # padding, packing (position_ids restarts) and the cache offset are handled inside
            kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                CACHE_NAME: cache,  # the masks take the release's cache keyword
                "position_ids": position_ids,
            }
            if "full_attention" in kinds:
                masks["full_attention"] = create_causal_mask(**kwargs)
            if "sliding_attention" in kinds:
                masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
            return masks
        kwargs = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask}
        if attention_mask is None and position_ids.shape[0] == 1 and inputs_embeds.shape[0] == 1:
            # Padding-free packing: keep each packed sequence to itself (the causal path does this on its own).
            packed = find_packed_sequence_indices(position_ids)
            if packed is not None:
                kwargs["and_mask_function"] = packed_sequence_mask_function(packed)
        if "full_attention" in kinds:
            masks["full_attention"] = create_bidirectional_mask(**kwargs)
        if "sliding_attention" in kinds:
            masks["sliding_attention"] = create_bidirectional_sliding_window_mask(**kwargs)
        return masks

    def _alibi_biases(self, inputs_embeds: torch.Tensor, cache: Cache | None) -> dict[str, torch.Tensor]:
        """ALiBi bias per layer type, on the same absolute query/key indices the masks use (cache offsets included)."""
        batch_size, seq_length = inputs_embeds.shape[:2]
        biases = {}
        device = self.alibi.slopes.device
        for layer_type in set(self.config.layer_types):
            q_offset, kv_length, kv_offset = 0, seq_length, 0
            if cache is not None:
                layer_idx = self.config.layer_types.index(layer_type)
                q_offset = cache.get_query_offset(layer_idx)
                kv_length, kv_offset = cache.get_mask_sizes(seq_length, layer_idx)
            q_positions = torch.arange(seq_length, device=device) + q_offset
            k_positions = torch.arange(kv_length, device=device) + kv_offset
            bias = self.alibi(q_positions, k_positions, inputs_embeds.dtype)  # (1, H, T, S)
            biases[layer_type] = bias.expand(batch_size, -1, -1, -1)  # a view; flex indexes the bias per batch row
        return biases


class TfmMoeModel(TfmModel):
    """The backbone of a config with experts (`num_experts`): `TfmModel(config)` builds this class for one.

    Its own class, as in-tree MoE families have theirs (Qwen2MoeModel beside Qwen2Model), for the checkpoint layout:
    checkpoints store the experts one by one (`mlp.experts.N.gate_proj.weight`, ...: the layout Qwen2-MoE, OLMoE and
    Qwen3-MoE publish) and load back into the fused parameters. transformers converts a custom model's weights only
    when the class name (or model_type) of a PreTrainedModel in it is registered; registering this class keeps the
    conversion off dense models, which have nothing to convert (in-tree dense models have none either).
    """


# `overwrite`: remote-code copies of this file register again.
register_checkpoint_conversion_mapping(
    TfmMoeModel.__name__, get_checkpoint_conversion_mapping("qwen2_moe"), overwrite=True
)


class TfmHeadModel(TfmPreTrainedModel):
    """What every task head shares: the backbone under `model` (built without a pooler: heads pool for themselves)."""

    def __init__(self, config: TfmConfig) -> None:
        super().__init__(config)
        self.model = TfmModel(config, add_pooling_layer=False)

    def backbone(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        token_type_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,  # only the causal LM decodes; the other heads build no cache unless asked
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            token_type_ids=token_type_ids,
            use_cache=use_cache,
            **kwargs,
        )

    def head_output(
        self,
        output_class: type[ModelOutput],
        backbone_output: ModelOutput,
        attention_mask: torch.Tensor | dict | None,
        loss_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        **fields: torch.Tensor | None,
    ) -> ModelOutput:
        """What every head's forward ends with, as transformers' `Generic*` heads end: its `output_class` from the
        head's own `fields` (loss, logits, ...) and the backbone's hidden states, attentions and (where the class has
        the field) cache.

        With experts it is the MoE output class (`MoeCausalLMOutputWithPast`, ...), with the load-balancing loss where
        router logits were recorded (`output_router_logits`): `aux_loss`, `router_logits`, and `loss +
        router_aux_loss_coef * aux_loss`; a dense model has no routers, and its output is the dense class, as in-tree
        Llama's. Under Trainer's gradient accumulation and DDP (`num_items_in_batch`, the step's label count that the
        head's loss divides by), `aux_loss` joins the loss with this batch's share of those labels (`loss_labels`,
        counted as Trainer counts them): the micro-batches' terms then sum to their token-weighted mean, where a
        plain sum would weigh it by the accumulation steps times the processes.
        """
        if CACHE_NAME in output_class.__dataclass_fields__:
            fields[CACHE_NAME] = getattr(backbone_output, CACHE_NAME)
        fields |= {"hidden_states": backbone_output.hidden_states, "attentions": backbone_output.attentions}
        if self.config.num_experts is None:
            return output_class(**fields)
        router_logits = getattr(backbone_output, "router_logits", None)
        loss, aux_loss = fields.get("loss"), None
        if router_logits:  # empty when no layer is sparse
            mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 else None
            if mask is not None:  # decoding: the cached tokens' columns have no router logits in this call
                mask = mask[:, -backbone_output.last_hidden_state.shape[1] :]
            config = self.config
            aux_loss = load_balancing_loss_func(router_logits, config.num_experts, config.num_experts_per_tok, mask)
            if loss is not None:
                share = 1.0
                if num_items_in_batch is not None and loss_labels is not None:
                    share = loss_labels.ne(-100).sum() / num_items_in_batch
                loss = loss + config.router_aux_loss_coef * share * aux_loss.to(loss.device)
        fields |= {"loss": loss, "aux_loss": aux_loss, "router_logits": router_logits}
        return MOE_OUTPUTS[output_class](**fields)


class TfmForCausalLM(TfmHeadModel, GenerationMixin):
    """Decoder language model: the backbone plus `lm_head` (tied to `embed_tokens` when `tie_word_embeddings`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: TfmConfig) -> None:
        super().__init__(config)
        if not config.is_causal:
            logger.warning("TfmForCausalLM built with `is_causal=False`: every token will see the future.")
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @accepts_cache_alias
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
        outputs = self.backbone(
            input_ids, attention_mask, position_ids, inputs_embeds, cache=cache, use_cache=use_cache, **kwargs
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        counted = kwargs.get("shift_labels", None if labels is None else labels[..., 1:])  # the items the loss counts
        items = kwargs.get("num_items_in_batch")
        return self.head_output(
            CausalLMOutputWithPast, outputs, attention_mask, counted, items, loss=loss, logits=logits
        )


def pool(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, how: str, pad_mask: torch.Tensor | None):
    """(B, T, C) -> (B, C): the first token, the mean of real tokens, or the last real token (left or right padded)."""
    if how == "first":
        return hidden_states[:, 0]
    real = attention_mask if attention_mask is not None else pad_mask
    if real is None:
        return hidden_states[:, -1] if how == "last" else hidden_states.mean(dim=1)
    real = real.to(hidden_states.device, hidden_states.dtype)
    if how == "mean":
        return (hidden_states * real[..., None]).sum(1) / real.sum(1, keepdim=True).clamp(min=1.0)
    positions = torch.arange(real.shape[1], device=real.device, dtype=real.dtype)
    last = (positions * real).argmax(-1)  # the rightmost real token, wherever the padding sits
    return hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), last]


class TfmForSequenceClassification(TfmHeadModel):
    """Sequence classifier / regressor: pooled backbone output -> [dense, act, norm] -> dropout -> `score`."""

    # The loss is a mean per batch (transformers' sequence-classification loss takes no `num_items_in_batch`), so
    # Trainer must average the accumulated micro-batches itself; it would not, seeing the forward's **kwargs.
    accepts_loss_kwargs = False

    def __init__(self, config: TfmConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
        # Optional dense -> `classifier_activation` (-> norm) on the pooled vector: BERT's pooler, ModernBERT's head.
        self.head = None
        if config.classifier_dense:
            self.head = TfmPredictionHead(config, config.classifier_activation, norm=config.classifier_norm)
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=config.classifier_bias)
        self.post_init()

    @accepts_cache_alias
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SequenceClassifierOutput:
        outputs = self.backbone(
            input_ids, attention_mask, position_ids, inputs_embeds, token_type_ids, cache, bool(use_cache), **kwargs
        )
        pad_mask = None
        if attention_mask is None and input_ids is not None and self.config.pad_token_id is not None:
            pad_mask = input_ids != self.config.pad_token_id
        mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 else None
        pooled = pool(outputs.last_hidden_state, mask, self.config.classifier_pooling, pad_mask)
        if self.head is not None:
            pooled = self.head(pooled)
        logits = self.score(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
        # its loss is a batch mean: no item count
        return self.head_output(SequenceClassifierOutput, outputs, attention_mask, loss=loss, logits=logits)


class TfmForTokenClassification(TfmHeadModel):
    """Per-token classifier (NER, tagging): backbone -> dropout -> `score`."""

    def __init__(self, config: TfmConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=config.classifier_bias)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,  # accepted (pipelines and Trainer pass it) and ignored: this head never caches
        **kwargs: Unpack[TransformersKwargs],
    ) -> TokenClassifierOutput:
        outputs = self.backbone(input_ids, attention_mask, position_ids, inputs_embeds, token_type_ids, **kwargs)
        logits = self.score(self.dropout(outputs.last_hidden_state))
        loss = None if labels is None else self.loss_function(logits, labels, self.config)
        # its loss is a batch mean: no item count
        return self.head_output(TokenClassifierOutput, outputs, attention_mask, loss=loss, logits=logits)


class TfmForQuestionAnswering(TfmHeadModel):
    """Extractive question answering: backbone -> `qa_outputs` -> per-token start and end logits of the answer span."""

    def __init__(self, config: TfmConfig) -> None:
        super().__init__(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        use_cache: bool | None = None,  # accepted (pipelines and Trainer pass it) and ignored: this head never caches
        **kwargs: Unpack[TransformersKwargs],
    ) -> QuestionAnsweringModelOutput:
        outputs = self.backbone(input_ids, attention_mask, position_ids, inputs_embeds, token_type_ids, **kwargs)
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).unbind(dim=-1)  # (B, T) each
        start_logits, end_logits = start_logits.contiguous(), end_logits.contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions, **kwargs)
        logits = {"start_logits": start_logits, "end_logits": end_logits}
        # its loss is a batch mean: no item count
        return self.head_output(QuestionAnsweringModelOutput, outputs, attention_mask, loss=loss, **logits)


class TfmPredictionHead(nn.Module):
    """The masked-LM transform before the vocabulary projection: dense -> activation -> norm (BERT, ModernBERT)."""

    def __init__(self, config: TfmConfig, activation: str | None = None, norm: bool = True) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.head_dense_bias)
        # The masked-LM head uses `mlm_head_activation` or the MLP's (gelu for glu); the classifier passes its own.
        default = config.mlm_head_activation or ("gelu" if config.ffn_type == "glu" else config.hidden_act)
        self.act = ACT2FN[activation or default]
        self.norm = make_norm(config) if norm else nn.Identity()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(hidden_states)))


class TfmForMaskedLM(TfmHeadModel):
    """Masked language model: backbone -> prediction head -> `lm_head` (tied to `embed_tokens`, with a bias)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # sharded on the vocabulary, as the tied `embed_tokens`

    def __init__(self, config: TfmConfig) -> None:
        super().__init__(config)
        if config.is_causal:
            logger.warning("TfmForMaskedLM built with `is_causal=True`: masked tokens cannot see their right context.")
        self.head = TfmPredictionHead(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,  # accepted (pipelines and Trainer pass it) and ignored: this head never caches
        **kwargs: Unpack[TransformersKwargs],
    ) -> MaskedLMOutput:
        outputs = self.backbone(input_ids, attention_mask, position_ids, inputs_embeds, token_type_ids, **kwargs)
        logits = self.lm_head(self.head(outputs.last_hidden_state))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        items = kwargs.get("num_items_in_batch")
        return self.head_output(MaskedLMOutput, outputs, attention_mask, labels, items, loss=loss, logits=logits)


# ---------------------------------------------------------------------------------------------------------------------
# Encoder-decoder: two TfmModel stacks, the decoder's with cross-attention (`TfmSeq2SeqConfig.encoder` / `.decoder`).


class TfmSeq2SeqPreTrainedModel(TfmPreTrainedModel):
    """What the encoder-decoder classes share: the config class, the embedding ties, the remote-code entries.

    The encoder and decoder are `TfmModel`s, which initialise their own weights from their own side's config.
    """

    config: TfmSeq2SeqConfig
    config_class = TfmSeq2SeqConfig
    _auto_map = SEQ2SEQ_AUTO_MAP
    _can_record_outputs = {}  # the encoder and decoder record their own layers

    @property
    def _tied_weights_keys(self) -> dict[str, str]:
        """Targets tied to sources, from the config: decoder tokens to encoder tokens (`share_...`), the LM head to
        the decoder's tokens (`tie_word_embeddings`), always to the table that is actually stored."""
        config, ties = self.config, {}
        prefix = "model." if self.base_model is not self else ""
        encoder_tokens, decoder_tokens = f"{prefix}encoder.embed_tokens.weight", f"{prefix}decoder.embed_tokens.weight"
        if config.share_encoder_decoder_embeddings and not prefix:
            ties[decoder_tokens] = encoder_tokens
        if config.tie_word_embeddings and prefix:
            ties["lm_head.weight"] = encoder_tokens if config.share_encoder_decoder_embeddings else decoder_tokens
        return ties

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """transformers reads ties only when `config.tie_word_embeddings`; the shared encoder/decoder table is tied
        by `share_encoder_decoder_embeddings` alone, so this model's own ties come from `_tied_weights_keys`."""
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return dict(self._tied_weights_keys)

    def _init_weights(self, module: nn.Module) -> None:
        PreTrainedModel._init_weights(self, module)  # only the head: each side's TfmModel initialises itself

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """transformers' resize of the token table both sides share (and of the tied head); both sides' configs
        follow. Sides with a table each (`share_encoder_decoder_embeddings=False`) resize one by one."""
        if not self.config.share_encoder_decoder_embeddings:
            raise ValueError(
                "The encoder and decoder have a token table each (`share_encoder_decoder_embeddings=False`): resize "
                "them one by one with `model.get_encoder().resize_token_embeddings(...)` and "
                "`model.get_decoder().resize_token_embeddings(...)` (and the head, if untied)."
            )
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.config.encoder.vocab_size = self.config.decoder.vocab_size = embeddings.num_embeddings
        return embeddings


class TfmSeq2SeqModel(TfmSeq2SeqPreTrainedModel):
    """The encoder-decoder backbone: `encoder` reads the source, `decoder` the target so far (and the source)."""

    def __init__(self, config: TfmSeq2SeqConfig) -> None:
        super().__init__(config)
        self.encoder = TfmModel(config.encoder, add_pooling_layer=False)
        self.decoder = TfmModel(config.decoder, add_pooling_layer=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embed_tokens = value
        if self.config.share_encoder_decoder_embeddings:
            self.decoder.embed_tokens = value

    @accepts_cache_alias
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqModelOutput | TfmMoeSeq2SeqModelOutput:
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError(
                "Pass `decoder_input_ids` or `decoder_inputs_embeds` (or `labels` to a TfmForConditionalGeneration, "
                "which shifts them right into decoder inputs)."
            )
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):  # a tuple: (last_hidden_state, [hidden_states, ...])
            encoder_outputs = BaseModelOutput(*encoder_outputs[:3])
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            inputs_embeds=decoder_inputs_embeds,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            cache=cache,
            use_cache=use_cache,
            **kwargs,
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **{CACHE_NAME: getattr(decoder_outputs, CACHE_NAME)},
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        if self.config.encoder.num_experts is None and self.config.decoder.num_experts is None:
            return output
        return TfmMoeSeq2SeqModelOutput(
            **output,
            router_logits=getattr(decoder_outputs, "router_logits", None),
            encoder_router_logits=getattr(encoder_outputs, "router_logits", None),
        )


class TfmForConditionalGeneration(TfmSeq2SeqPreTrainedModel, GenerationMixin):
    """Sequence-to-sequence LM (translation, summarisation, any text-to-text task): the backbone plus `lm_head`."""

    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: TfmSeq2SeqConfig) -> None:
        super().__init__(config)
        self.model = TfmSeq2SeqModel(config)
        decoder = config.decoder
        self.lm_head = nn.Linear(decoder.hidden_size, decoder.vocab_size, bias=decoder.lm_head_bias)
        # The logits are aligned with `labels` already (the decoder inputs are the shifted ones): a masked-LM loss,
        # which does not shift again and normalises by `num_items_in_batch` under gradient accumulation.
        self.loss_type = "ForMaskedLM"
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder inputs for teacher forcing: `labels` shifted right behind `decoder_start_token_id` (-100 -> pad)."""
        if self.config.pad_token_id is None or self.config.decoder_start_token_id is None:
            raise ValueError(
                "Building decoder inputs from `labels` needs `pad_token_id` and `decoder_start_token_id`."
            )
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    @accepts_cache_alias
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqLMOutput | TfmMoeSeq2SeqLMOutput:
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=cache,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache if labels is None else False,  # teacher forcing decodes nothing
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.decoder.vocab_size, **kwargs)
        output_class = TfmMoeSeq2SeqLMOutput if isinstance(outputs, TfmMoeSeq2SeqModelOutput) else Seq2SeqLMOutput
        return output_class(
            loss=loss,
            logits=logits,
            **{key: value for key, value in outputs.items() if key != "last_hidden_state"},
        )


__all__ = [
    "TfmForCausalLM",
    "TfmForConditionalGeneration",
    "TfmForMaskedLM",
    "TfmForQuestionAnswering",
    "TfmForSequenceClassification",
    "TfmForTokenClassification",
    "TfmModel",
    "TfmMoeModel",
    "TfmPreTrainedModel",
    "TfmSeq2SeqModel",
    "TfmSeq2SeqPreTrainedModel",
]
