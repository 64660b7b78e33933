"""GPT-2: learned positions, LayerNorm with bias, GELU MLP, biases everywhere, Conv1D (in, out) weights, fused qkv."""

import re

import torch
from transformers import (
    GPT2Config,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
)
from transformers.utils import logging

from ..configuration import TfmConfig
from .core import (
    IN_TREE_DEFAULT_CLASSIFIER_DROPOUT,
    Family,
    Rule,
    classifier_blockers,
    common_blockers,
    need,
    register,
    sizes,
    token_dropout_to_hf,
)

logger = logging.get_logger(__name__)

GPT2_BASE_RULES = [
    Rule("embed_tokens.weight", "wte.weight"),
    Rule("embed_positions.weight", "wpe.weight"),
    Rule("layers.{i}.attn_norm.{p}", "h.{i}.ln_1.{p}"),
    Rule("layers.{i}.mlp_norm.{p}", "h.{i}.ln_2.{p}"),
    Rule("layers.{i}.self_attn.o_proj.{p}", "h.{i}.attn.c_proj.{p}", transpose=True),
    Rule("layers.{i}.self_attn.{n}.{p}", "h.{i}.attn.{n}.{p}", transpose=True),  # q/k/v: fused below
    Rule("layers.{i}.mlp.up_proj.{p}", "h.{i}.mlp.c_fc.{p}", transpose=True),
    Rule("layers.{i}.mlp.down_proj.{p}", "h.{i}.mlp.c_proj.{p}", transpose=True),
    Rule("norm.{p}", "ln_f.{p}"),
]
GPT2_HEAD_RULES = {
    "causal_lm": [Rule("lm_head.{p}", "lm_head.{p}")],
    "sequence_classification": [Rule("score.{p}", "score.{p}")],
    "token_classification": [Rule("score.{p}", "classifier.{p}")],
    "question_answering": [Rule("qa_outputs.{p}", "qa_outputs.{p}")],
}
_C_ATTN = re.compile(r"(?P<pre>.*h\.\d+\.attn\.)c_attn\.(?P<p>weight|bias)")
_QKV = re.compile(r"(?P<pre>.*h\.\d+\.attn\.)(?P<n>q_proj|k_proj|v_proj)\.(?P<p>weight|bias)")


def _split_c_attn(state: dict) -> dict:
    """GPT-2's fused c_attn (Conv1D: weight (in, 3*out), bias (3*out)) -> per-projection q/k/v entries, same layout."""
    out = {}
    for key, value in state.items():
        match = _C_ATTN.fullmatch(key)
        if not match:
            out[key] = value
            continue
        dim = 1 if match["p"] == "weight" else 0
        for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=dim), strict=True):
            out[f"{match['pre']}{name}.{match['p']}"] = part
    return out


def _fuse_c_attn(state: dict) -> dict:
    out, parts = {}, {}
    for key, value in state.items():
        match = _QKV.fullmatch(key)
        if match:
            parts.setdefault((match["pre"], match["p"]), {})[match["n"]] = value
        else:
            out[key] = value
    for (pre, p), qkv in parts.items():
        dim = 1 if p == "weight" else 0
        out[f"{pre}c_attn.{p}"] = torch.cat([qkv["q_proj"], qkv["k_proj"], qkv["v_proj"]], dim=dim)
    return out


def _gpt2_from_hf(c, head: str) -> dict:
    for knob, ok in (
        ("scale_attn_weights", c.scale_attn_weights),
        ("scale_attn_by_inverse_layer_idx", not c.scale_attn_by_inverse_layer_idx),
        ("add_cross_attention", not c.add_cross_attention),
    ):
        if not ok:
            raise ValueError(f"GPT-2 with `{knob}={getattr(c, knob)}` has no hf_tfm equivalent.")
    if c.embd_pdrop != c.resid_pdrop:
        logger.warning("GPT-2 embd_pdrop != resid_pdrop: hf_tfm uses resid_pdrop for both (`hidden_dropout`).")
    kwargs = sizes(c)
    kwargs.update(
        intermediate_size=c.n_inner or 4 * c.hidden_size,
        position_embedding_type="learned",
        norm_type="layernorm",
        norm_bias=True,
        norm_eps=c.layer_norm_epsilon,
        norm_position="pre",
        ffn_type="mlp",
        hidden_act=c.activation_function,
        mlp_bias=True,
        attention_bias=True,
        attention_out_bias=True,
        attention_dropout=float(c.attn_pdrop),
        hidden_dropout=float(c.resid_pdrop),
        is_causal=True,
        classifier_pooling="last",
        classifier_bias=head == "token_classification",
        classifier_dropout=getattr(c, "classifier_dropout", None),
    )
    if head == "token_classification" and kwargs["classifier_dropout"] is None:
        kwargs["classifier_dropout"] = IN_TREE_DEFAULT_CLASSIFIER_DROPOUT
    return kwargs


def _gpt2_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "gpt2"
    need(config, out, name, "is_causal", True)
    need(config, out, name, "position_embedding_type", "learned")
    need(config, out, name, "norm_type", "layernorm")
    need(config, out, name, "norm_bias", True)
    need(config, out, name, "norm_position", "pre")
    need(config, out, name, "ffn_type", "mlp")
    need(config, out, name, "mlp_bias", True)
    need(config, out, name, "attention_bias", True)
    need(config, out, name, "attention_out_bias", True)
    need(config, out, name, "num_key_value_heads", config.num_attention_heads, "`num_attention_heads` (no GQA)")
    need(config, out, name, "head_dim", config.hidden_size // config.num_attention_heads, "hidden/heads")
    need(config, out, name, "layer_types", lambda v: set(v) == {"full_attention"}, "only 'full_attention'")
    need(config, out, name, "embedding_norm", False)
    need(config, out, name, "type_vocab_size", 0)
    common_blockers(config, name, out, head)
    if head == "masked_lm":
        out.append("head `masked_lm` (gpt2 has no masked-LM class)")
    classifier_blockers(config, head, name, out, pooling="last", bias=False)
    return out


def _gpt2_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = sizes(config)
    for ours, theirs in (
        ("hidden_size", "n_embd"),
        ("num_hidden_layers", "n_layer"),
        ("num_attention_heads", "n_head"),
        ("max_position_embeddings", "n_positions"),
    ):
        kwargs[theirs] = kwargs.pop(ours)
    kwargs.update(
        n_inner=None if config.intermediate_size == 4 * config.hidden_size else config.intermediate_size,
        activation_function=config.hidden_act,
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.norm_eps,
        **token_dropout_to_hf(config, head),
    )
    return kwargs


register(
    Family(
        name="gpt2",
        config_class=GPT2Config,
        classes={
            "base": GPT2Model,
            "causal_lm": GPT2LMHeadModel,
            "sequence_classification": GPT2ForSequenceClassification,
            "token_classification": GPT2ForTokenClassification,
            "question_answering": GPT2ForQuestionAnswering,
        },
        hf_prefix="transformer.",
        base_rules=GPT2_BASE_RULES,
        head_rules=GPT2_HEAD_RULES,
        config_from_hf=_gpt2_from_hf,
        blockers=_gpt2_blockers,
        config_to_hf=_gpt2_to_hf,
        split_state=_split_c_attn,
        fuse_state=_fuse_c_attn,
    )
)
