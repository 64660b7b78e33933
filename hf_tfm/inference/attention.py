"""The one attention a decoding model runs on a CPU (`decode_attention`), installed by the loader
(`use_decode_attention`), never on import.

A prompt (many queries) takes transformers' sdpa, over the static cache's filled slots only. A step (one query, or the
few of a speculative verify step) takes the plain formula, written so that the key/value heads of grouped-query
attention are a view, not a copy: in a compiled step Inductor fuses its products and softmax into one loop per layer,
where sdpa stays a library call per layer (about 50 us each, a fifth of a q4 step on the bench's base shape). The
compiled step (`hf_tfm.inference.aot`) traces this same function.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

DECODE_ATTENTION = "hf_tfm_decode"
# Queries a compiled call may carry and still take the plain formula: a step, or a speculative verify step
STEP_QUERIES = 64


def decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' sdpa, except for a step on a CPU (one query, or up to `STEP_QUERIES` in a compiled graph): there
    sdpa's kernel costs more than its arithmetic and the plain formula, which Inductor fuses, does not.
    `attention_mask` is sdpa's (True where a query may attend: a prompt's results are sdpa's to the bit);
    `position_bias` (ALiBi) adds to the scores either way."""
    queries = query.shape[2]
    step = queries == 1 or (torch.compiler.is_compiling() and queries <= STEP_QUERIES)
    if query.device.type == "cpu" and step:
        return _plain_attention(module, query, key, value, attention_mask, scaling, dropout, position_bias)
    if queries > 1 and query.device.type == "cpu" and attention_mask is not None and not torch.compiler.is_compiling():
        key, value, attention_mask, position_bias = _attended_keys(query, key, value, attention_mask, position_bias)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=scaling,
        dropout=dropout,
        position_bias=position_bias,
        **kwargs,
    )


def _plain_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    dropout: float,
    position_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scaling + bias, masked) v, the query heads grouped by their key/value head: modeling's
    `repeat_kv` would copy the whole cache for grouped-query attention at every step, where grouping is a view."""
    batch, heads, queries, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * queries, dim)  # (B, H_kv, G * T, D)
    scores = torch.matmul(grouped, key.transpose(2, 3)) * scaling  # (B, H_kv, G * T, S)
    scores = scores.view(batch, kv_heads, heads // kv_heads, queries, slots)  # (B, H_kv, G, T, S)
    if position_bias is not None:  # (B, H, T, S)
        scores = scores + position_bias.reshape(batch, kv_heads, heads // kv_heads, queries, slots)
    if mask is not None:  # (B, 1, T, S), True where the query may attend
        scores = scores.masked_fill(~mask[:, :, None], torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights.view(batch, kv_heads, -1, slots), value)  # (B, H_kv, G * T, D)
    # (B, H_kv, G, T, D), then the heads merged: one `view` to (B, H, T, D) would give the head dimension a stride that
    # a verify step's symbolic token count leaves unsimplified, and torch.export then fails on the copy's guard
    out = out.view(batch, kv_heads, heads // kv_heads, queries, dim).flatten(1, 2)  # (B, H, T, D)
    out = out.transpose(1, 2).contiguous()  # (B, T, H, D)
    return out, weights.reshape(batch, heads, queries, slots)


def _attended_keys(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    position_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A prompt's keys, values, mask and bias without the static cache's slots no query attends yet (a prompt of 128
    tokens before 512 new ones would otherwise score all 640 slots); with no mask where the rest is plain causal
    attention over the prompt alone, which sdpa's causal kernel computes without reading a mask. Eager prompts only:
    the cut depends on the mask's values."""
    if mask.dtype != torch.bool:
        return key, value, mask, position_bias
    attended = mask.any(dim=2).flatten(0, -2).any(dim=0)  # (S,): slots some query of some sequence attends
    used = int(attended.nonzero().max()) + 1 if attended.any() else mask.shape[-1]
    key, value, mask = key[:, :, :used], value[:, :, :used], mask[..., :used]
    if position_bias is not None:
        return key, value, mask, position_bias[..., :used]
    queries = query.shape[2]
    causal = torch.ones(queries, used, dtype=torch.bool, device=mask.device).tril(used - queries)
    if used == queries and torch.equal(mask, causal.expand_as(mask)):
        return key, value, None, None  # sdpa then takes is_causal from the module (True for a causal LM)
    return key, value, mask, None


def register_decode_attention() -> None:
    """Register `decode_attention` in transformers' attention and mask registries under `DECODE_ATTENTION`."""
    if DECODE_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, decode_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, sdpa_mask)


def use_decode_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Give a CPU `model` on sdpa `decode_attention` (registered on first use); returns `model`. Other backends
    (eager, flash) and devices keep theirs."""
    register_decode_attention()
    if model.config._attn_implementation == "sdpa" and model.device.type == "cpu":
        model.set_attn_implementation(DECODE_ATTENTION)
    return model


__all__ = ["DECODE_ATTENTION", "decode_attention", "register_decode_attention", "use_decode_attention"]
