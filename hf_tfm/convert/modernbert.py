"""ModernBERT: pre-norm encoder, LayerNorm (no bias by default), fused Wqkv and GeGLU Wi, RoPE theta per layer
type, alternating global / bidirectional sliding-window layers, no attention norm on layer 0, dense+act+norm head."""

import re

import torch
from transformers import (
    ModernBertConfig,
    ModernBertForMaskedLM,
    ModernBertForQuestionAnswering,
    ModernBertForSequenceClassification,
    ModernBertModel,
)
from transformers.utils import logging

from ..configuration import LAYER_TYPES, TfmConfig
from .core import Family, Rule, common_blockers, need, register, sizes

logger = logging.get_logger(__name__)

MODERNBERT_BASE_RULES = [
    Rule("embed_tokens.weight", "embeddings.tok_embeddings.weight"),
    Rule("embed_norm.{p}", "embeddings.norm.{p}"),
    Rule("layers.{i}.self_attn.o_proj.{p}", "layers.{i}.attn.Wo.{p}"),
    Rule("layers.{i}.self_attn.{n}.{p}", "layers.{i}.attn.{n}.{p}"),  # q/k/v: Wqkv split / fused around the rules
    Rule("layers.{i}.mlp.down_proj.{p}", "layers.{i}.mlp.Wo.{p}"),
    Rule("layers.{i}.mlp.{n}.{p}", "layers.{i}.mlp.{n}.{p}"),  # gate/up: Wi split / fused around the rules
    Rule("layers.{i}.attn_norm.{p}", "layers.{i}.attn_norm.{p}"),
    Rule("layers.{i}.mlp_norm.{p}", "layers.{i}.mlp_norm.{p}"),
    Rule("norm.{p}", "final_norm.{p}"),
]
_MODERNBERT_HEAD = [Rule("head.dense.{p}", "head.dense.{p}"), Rule("head.norm.{p}", "head.norm.{p}")]
MODERNBERT_HEAD_RULES = {
    "base": [Rule("pooler.dense.{p}", "pooler.dense.{p}")],  # TfmModel's `add_pooling_layer`
    "sequence_classification": [*_MODERNBERT_HEAD, Rule("score.{p}", "classifier.{p}")],
    "masked_lm": [*_MODERNBERT_HEAD, Rule("lm_head.{p}", "decoder.{p}")],
}
# Fused in-tree weight -> the hf_tfm projections it holds, in its output-row order (ModernBertMLP: `input, gate =
# Wi(x).chunk(2)` and act(input) * gate, so the activated first half is our gate_proj).
_MODERNBERT_FUSED = {"attn.Wqkv": ("q_proj", "k_proj", "v_proj"), "mlp.Wi": ("gate_proj", "up_proj")}
_MB_FUSED = re.compile(r"(?P<pre>.*layers\.\d+\.)(?P<f>attn\.Wqkv|mlp\.Wi)\.(?P<p>weight|bias)")
_MB_PART = re.compile(
    r"(?P<pre>.*layers\.\d+\.)(?P<m>attn|mlp)\.(?P<n>[qkv]_proj|gate_proj|up_proj)\.(?P<p>weight|bias)"
)


# ModernBertForQuestionAnswering: model -> head (dense, act, norm) -> drop -> classifier; ours: model -> qa_outputs.
MODERNBERT_QA_REFUSAL = (
    "ModernBertForQuestionAnswering puts a dense + activation + norm head before its span classifier, "
    "which TfmForQuestionAnswering lacks"
)


def _modernbert_split(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        match = _MB_FUSED.fullmatch(key)
        if not match:
            out[key] = value
            continue
        names = _MODERNBERT_FUSED[match["f"]]
        module = match["f"].split(".")[0]
        for name, part in zip(names, value.chunk(len(names), dim=0), strict=True):
            out[f"{match['pre']}{module}.{name}.{match['p']}"] = part
    return out


def _modernbert_fuse(state: dict) -> dict:
    out, parts = {}, {}
    for key, value in state.items():
        match = _MB_PART.fullmatch(key)
        if match:
            parts.setdefault((match["pre"], match["m"], match["p"]), {})[match["n"]] = value
        else:
            out[key] = value
    for (pre, module, p), found in parts.items():
        fused = next(f for f in _MODERNBERT_FUSED if f.startswith(module + "."))
        out[f"{pre}{fused}.{p}"] = torch.cat([found[n] for n in _MODERNBERT_FUSED[fused]], dim=0)
    return out


def _modernbert_from_hf(c, head: str) -> dict:
    dropped = {k: getattr(c, k) for k in ("attention_dropout", "embedding_dropout", "mlp_dropout") if getattr(c, k)}
    if dropped:  # inference is exact; only training-time dropout placement differs
        logger.warning(f"ModernBERT {dropped}: hf_tfm places dropout differently and imports these as 0.")
    if head == "masked_lm" and not c.decoder_bias:
        raise ValueError(
            "ModernBERT with `decoder_bias=False` has no hf_tfm equivalent (the masked-LM head has a bias)."
        )
    if c.sparse_prediction:
        logger.warning(
            "ModernBERT `sparse_prediction=True` (a loss-time shortcut) is not imported: logits stay dense."
        )
    kwargs = sizes(c)
    kwargs.update(
        intermediate_size=c.intermediate_size,
        position_embedding_type="rope",
        rope_parameters={t: dict(c.rope_parameters[t]) for t in LAYER_TYPES if c.rope_parameters.get(t)},
        norm_type="layernorm",
        norm_bias=c.norm_bias,
        norm_eps=c.norm_eps,
        norm_position="pre",
        embedding_norm=True,
        first_layer_attn_norm=False,
        ffn_type="glu",
        hidden_act=c.hidden_activation,
        mlp_bias=c.mlp_bias,
        attention_bias=c.attention_bias,
        attention_out_bias=c.attention_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        is_causal=False,
        # local_attention // 2: the mask keeps |i - j| <= it, as ours for encoders. With no sliding layer it is unused
        # (hf_tfm refuses a window no layer reads), so it is not kept.
        sliding_window=c.sliding_window if "sliding_attention" in c.layer_types else None,
        layer_types=list(c.layer_types),
        classifier_pooling={"cls": "first", "mean": "mean"}[c.classifier_pooling],
        classifier_dense=True,
        classifier_activation=c.classifier_activation,
        classifier_norm=True,
        classifier_bias=True,
        classifier_dropout=float(c.classifier_dropout),
        head_dense_bias=c.classifier_bias,
        mlm_head_activation=c.classifier_activation,
        cls_token_id=c.cls_token_id,  # carried as plain config attributes (the tokenizer's special ids)
        sep_token_id=c.sep_token_id,
    )
    return kwargs


def _modernbert_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "modernbert"
    need(config, out, name, "is_causal", False)
    need(config, out, name, "position_embedding_type", "rope")
    need(config, out, name, "type_vocab_size", 0)
    need(config, out, name, "norm_type", "layernorm")
    need(config, out, name, "norm_position", "pre")
    need(config, out, name, "embedding_norm", True)
    need(config, out, name, "ffn_type", "glu")
    need(config, out, name, "attention_out_bias", config.attention_bias, "the same value as `attention_bias`")
    need(config, out, name, "num_key_value_heads", config.num_attention_heads, "`num_attention_heads` (no GQA)")
    need(config, out, name, "head_dim", config.hidden_size // config.num_attention_heads, "hidden/heads")
    need(config, out, name, "hidden_dropout", 0.0, "0.0 (its dropouts sit elsewhere)")
    need(config, out, name, "attention_dropout", 0.0, "0.0 (its dropouts sit elsewhere)")
    common_blockers(config, name, out, head, first_layer_attn_norm=False, flat_rope=False)
    if head in ("causal_lm", "token_classification"):
        out.append(f"head `{head}` (hf_tfm exports ModernBERT's base, masked-LM and sequence-classification heads)")
    if head == "question_answering":
        out.append(f"head `question_answering` ({MODERNBERT_QA_REFUSAL})")
    if head == "sequence_classification":
        need(config, out, name, "classifier_pooling", lambda v: v in ("first", "mean"), "'first' or 'mean'")
        need(config, out, name, "classifier_dense", True)
        need(config, out, name, "classifier_norm", True)
        need(config, out, name, "classifier_bias", True)
    return out


def _modernbert_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = sizes(config)
    kwargs.pop("use_cache")
    if config.rope_per_layer_type:
        rope = {t: dict(config.rope_parameters[t]) for t in LAYER_TYPES if config.rope_parameters.get(t)}
    else:  # one RoPE for every layer type
        rope = {t: dict(config.rope_parameters) for t in LAYER_TYPES}
    mlm_act = config.mlm_head_activation or "gelu"  # ffn_type="glu" is required
    dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
    kwargs.update(
        intermediate_size=config.intermediate_size,
        hidden_activation=config.hidden_act,
        norm_eps=config.norm_eps,
        norm_bias=config.norm_bias,
        attention_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
        layer_types=list(config.layer_types),
        rope_parameters=rope,
        classifier_pooling="mean" if config.classifier_pooling == "mean" else "cls",
        classifier_dropout=dropout,
        classifier_bias=config.head_dense_bias,
        classifier_activation=mlm_act if head == "masked_lm" else config.classifier_activation,
    )
    if config.sliding_window is not None:
        kwargs["local_attention"] = 2 * config.sliding_window
    for name in ("cls_token_id", "sep_token_id"):  # set by an import; a hand-built config falls back to the defaults
        if getattr(config, name, None) is not None:
            kwargs[name] = getattr(config, name)
    return kwargs


register(
    Family(
        name="modernbert",
        config_class=ModernBertConfig,
        classes={
            "base": ModernBertModel,
            "sequence_classification": ModernBertForSequenceClassification,
            "masked_lm": ModernBertForMaskedLM,
        },
        hf_prefix="model.",
        base_rules=MODERNBERT_BASE_RULES,
        head_rules=MODERNBERT_HEAD_RULES,
        config_from_hf=_modernbert_from_hf,
        blockers=_modernbert_blockers,
        config_to_hf=_modernbert_to_hf,
        split_state=_modernbert_split,
        fuse_state=_modernbert_fuse,
    ),
    refused={ModernBertForQuestionAnswering: MODERNBERT_QA_REFUSAL},
)
