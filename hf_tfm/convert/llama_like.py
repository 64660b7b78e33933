"""Llama, Mistral and Qwen2: one block (RoPE, RMSNorm, SwiGLU, pre-norm, GQA); they differ in biases and windows.

The tables here are also those of the Llama-style mixture-of-experts families (`mixtral.py`, `qwen2_moe.py`,
`olmoe.py`): weight names, the knobs named alike and the block's fixed values.
"""

from ..checks import need, need_all, need_default_head_dim
from ..configuration import TfmConfig
from .core import (
    DECODER_HEADS,
    MOE_RULES,
    Family,
    Rule,
    common_blockers,
    in_tree_classes,
    last_token_head_blockers,
    register,
)
from .fields import knobs_from_hf, knobs_to_hf, last_token_classifier, sizes, token_dropout_to_hf

LLAMA_BASE_RULES = [
    Rule("embed_tokens.{p}", "embed_tokens.{p}"),
    Rule("layers.{i}.self_attn.{n}.{p}", "layers.{i}.self_attn.{n}.{p}"),
    Rule("layers.{i}.mlp.{n}.{p}", "layers.{i}.mlp.{n}.{p}"),
    Rule("layers.{i}.attn_norm.{p}", "layers.{i}.input_layernorm.{p}"),
    Rule("layers.{i}.mlp_norm.{p}", "layers.{i}.post_attention_layernorm.{p}"),
    Rule("norm.{p}", "norm.{p}"),
]
LLAMA_HEAD_RULES = {
    "causal_lm": [Rule("lm_head.{p}", "lm_head.{p}")],
    "sequence_classification": [Rule("score.{p}", "score.{p}")],
    "token_classification": [Rule("score.{p}", "score.{p}")],
    "question_answering": [Rule("qa_outputs.{p}", "qa_outputs.{p}")],
}
# hf_tfm knob -> the in-tree attribute, alike in every Llama-style family (each adds its own entries)
LLAMA_FIELDS = {
    "num_key_value_heads": "num_key_value_heads",
    "hidden_act": "hidden_act",
    "norm_eps": "rms_norm_eps",
    "rope_parameters": "rope_parameters",
    "attention_dropout": "attention_dropout",
}
# The block's fixed knobs: an import sets them, an export needs them (checked in this order)
LLAMA_BLOCK = {
    "is_causal": True,
    "position_embedding_type": "rope",
    "norm_type": "rmsnorm",
    "norm_position": "pre",
    "ffn_type": "glu",
    "embedding_norm": False,
    "type_vocab_size": 0,
}
# The mixture-of-experts families' blockers leave `ffn_type` out (their experts are SwiGLU whatever it says)
MOE_BLOCK = {knob: value for knob, value in LLAMA_BLOCK.items() if knob != "ffn_type"}
# Per family: the in-tree fields of its own, both ways
_FIELDS = {
    "llama": {"intermediate_size": "intermediate_size", "attention_bias": "attention_bias", "mlp_bias": "mlp_bias"},
    "mistral": {"intermediate_size": "intermediate_size"},
    "qwen2": {"intermediate_size": "intermediate_size"},
}


def llama_style_from_hf(c, fields: dict[str, str]) -> dict:
    """What every Llama-style import reads and sets: the sizes, `LLAMA_FIELDS` and the family's `fields`, the block,
    no dropout outside attention."""
    return {**sizes(c), **knobs_from_hf(c, {**LLAMA_FIELDS, **fields}), **LLAMA_BLOCK, "hidden_dropout": 0.0}


def llama_style_to_hf(config: TfmConfig, fields: dict[str, str]) -> dict:
    """The in-tree config kwargs of `llama_style_from_hf`'s fields, from the hf_tfm config."""
    return {**sizes(config), **knobs_to_hf(config, {**LLAMA_FIELDS, **fields})}


def _llama_like_from_hf(c, head: str, name: str) -> dict:
    kwargs = llama_style_from_hf(c, _FIELDS[name]) | last_token_classifier(c, head)
    kwargs["head_dim"] = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if name == "llama":
        kwargs["attention_out_bias"] = c.attention_bias  # one knob for every projection
    elif name == "mistral":
        kwargs.update(attention_bias=False, mlp_bias=False, sliding_window=c.sliding_window)
    else:  # qwen2: q/k/v bias, none on o_proj; per-layer full / sliding attention
        window = c.sliding_window
        layer_types = list(c.layer_types) if window is not None else None
        if layer_types is not None and "sliding_attention" not in layer_types:
            window = None
        kwargs.update(
            attention_bias=True,
            attention_out_bias=False,
            mlp_bias=False,
            sliding_window=window,
            layer_types=layer_types,
        )
    return kwargs


def _llama_like_blockers(config: TfmConfig, head: str, name: str) -> list[str]:
    out: list[str] = []
    need_all(config, out, name, LLAMA_BLOCK)
    common_blockers(config, name, out, head, hidden_dropout=False)
    sliding = set(config.layer_types)
    if name == "llama":
        need(config, out, name, "attention_out_bias", config.attention_bias, "the same value as `attention_bias`")
        need(config, out, name, "layer_types", lambda v: sliding == {"full_attention"}, "only 'full_attention'")
    elif name == "mistral":
        need_all(config, out, name, {"attention_bias": False, "attention_out_bias": False, "mlp_bias": False})
        need(config, out, name, "layer_types", lambda v: sliding == {"sliding_attention"}, "only sliding layers")
    else:
        need_all(config, out, name, {"attention_bias": True, "attention_out_bias": False, "mlp_bias": False})
        need_default_head_dim(config, out, name, why=None)
    last_token_head_blockers(config, head, name, out)
    return out


def _llama_like_to_hf(config: TfmConfig, head: str, name: str) -> dict:
    kwargs = llama_style_to_hf(config, _FIELDS[name]) | token_dropout_to_hf(config, head)
    if name in ("llama", "mistral"):
        kwargs["head_dim"] = config.head_dim
    if name == "mistral":
        kwargs["sliding_window"] = config.sliding_window
    sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
    if name == "qwen2" and sliding:
        kwargs.update(
            use_sliding_window=True,
            sliding_window=config.sliding_window,
            max_window_layers=sliding[0],
            layer_types=list(config.layer_types),
        )
    return kwargs


def _llama_like(name: str, prefix: str) -> Family:
    return Family(
        name=name,
        classes=in_tree_classes(prefix, DECODER_HEADS),
        base_rules=LLAMA_BASE_RULES,
        head_rules=LLAMA_HEAD_RULES,
        config_from_hf=lambda c, head: _llama_like_from_hf(c, head, name),
        blockers=lambda c, head: _llama_like_blockers(c, head, name),
        config_to_hf=lambda c, head: _llama_like_to_hf(c, head, name),
    )


def moe_family(name: str, prefix: str, heads: tuple[str, ...], **mappings) -> Family:
    """A Llama-style family with experts (Mixtral, Qwen2-MoE, OLMoE): Llama's weight names and the experts', and its
    `config_from_hf`, `blockers` and `config_to_hf` (`mappings`)."""
    return Family(
        name=name,
        classes=in_tree_classes(prefix, heads),
        base_rules=MOE_RULES + LLAMA_BASE_RULES,
        head_rules={head: rules for head, rules in LLAMA_HEAD_RULES.items() if head in heads},
        moe=True,
        **mappings,
    )


register(_llama_like("llama", "Llama"), _llama_like("mistral", "Mistral"), _llama_like("qwen2", "Qwen2"))
