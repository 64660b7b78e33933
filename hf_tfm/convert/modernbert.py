"""ModernBERT: pre-norm encoder, LayerNorm (no bias by default), fused Wqkv and GeGLU Wi, RoPE theta per layer
type, alternating global / bidirectional sliding-window layers, no attention norm on layer 0, dense+act+norm head."""

import transformers
from transformers.utils import logging

from ..checks import need, need_all, need_default_head_dim, need_no_gqa
from ..configuration import LAYER_TYPES, TfmConfig
from .core import Family, Fused, Rule, common_blockers, in_tree_classes, register
from .fields import knobs_from_hf, knobs_to_hf, sizes

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
# Fused in-tree weights -> the hf_tfm projections each holds, in its output-row order (ModernBertMLP: `input, gate =
# Wi(x).chunk(2)` and act(input) * gate, so the activated first half is our gate_proj).
FUSED = Fused(
    r".*layers\.\d+\.",
    {"attn.Wqkv": ("attn.q_proj", "attn.k_proj", "attn.v_proj"), "mlp.Wi": ("mlp.gate_proj", "mlp.up_proj")},
)
# ModernBertForQuestionAnswering: model -> head (dense, act, norm) -> drop -> classifier; ours: model -> qa_outputs.
MODERNBERT_QA_REFUSAL = (
    "ModernBertForQuestionAnswering puts a dense + activation + norm head before its span classifier, "
    "which TfmForQuestionAnswering lacks"
)
# hf_tfm knob -> ModernBertConfig attribute, both ways
MODERNBERT_FIELDS = {
    "intermediate_size": "intermediate_size",
    "hidden_act": "hidden_activation",
    "norm_eps": "norm_eps",
    "norm_bias": "norm_bias",
    "attention_bias": "attention_bias",
    "mlp_bias": "mlp_bias",
    "layer_types": "layer_types",
}
# The block's fixed knobs: an import sets them, an export needs them (checked in this order)
MODERNBERT_BLOCK = {
    "is_causal": False,
    "position_embedding_type": "rope",
    "type_vocab_size": 0,
    "norm_type": "layernorm",
    "norm_position": "pre",
    "embedding_norm": True,
    "ffn_type": "glu",
}


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
    kwargs = {**sizes(c), **knobs_from_hf(c, MODERNBERT_FIELDS), **MODERNBERT_BLOCK}
    kwargs.update(
        rope_parameters={t: dict(c.rope_parameters[t]) for t in LAYER_TYPES if c.rope_parameters.get(t)},
        first_layer_attn_norm=False,
        attention_out_bias=c.attention_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # local_attention // 2: the mask keeps |i - j| <= it, as ours for encoders. With no sliding layer it is unused
        # (hf_tfm refuses a window no layer reads), so it is not kept.
        sliding_window=c.sliding_window if "sliding_attention" in c.layer_types else None,
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
    need_all(config, out, name, MODERNBERT_BLOCK)
    need(config, out, name, "attention_out_bias", config.attention_bias, "the same value as `attention_bias`")
    need_no_gqa(config, out, name)
    need_default_head_dim(config, out, name)
    for knob in ("hidden_dropout", "attention_dropout"):
        need(config, out, name, knob, 0.0, "0.0 (its dropouts sit elsewhere)")
    common_blockers(config, name, out, head, first_layer_attn_norm=False, flat_rope=False)
    if head in ("causal_lm", "token_classification"):
        out.append(f"head `{head}` (hf_tfm exports ModernBERT's base, masked-LM and sequence-classification heads)")
    if head == "question_answering":
        out.append(f"head `question_answering` ({MODERNBERT_QA_REFUSAL})")
    if head == "sequence_classification":
        need(config, out, name, "classifier_pooling", lambda v: v in ("first", "mean"), "'first' or 'mean'")
        need_all(config, out, name, {"classifier_dense": True, "classifier_norm": True, "classifier_bias": True})
    return out


def _modernbert_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = {**sizes(config), **knobs_to_hf(config, MODERNBERT_FIELDS)}
    kwargs.pop("use_cache")
    if config.rope_per_layer_type:
        rope = {t: dict(config.rope_parameters[t]) for t in LAYER_TYPES if config.rope_parameters.get(t)}
    else:  # one RoPE for every layer type
        rope = {t: dict(config.rope_parameters) for t in LAYER_TYPES}
    mlm_act = config.mlm_head_activation or "gelu"  # ffn_type="glu" is required
    dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
    kwargs.update(
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
        classes=in_tree_classes("ModernBert", ("base", "sequence_classification", "masked_lm")),
        base_rules=MODERNBERT_BASE_RULES,
        head_rules=MODERNBERT_HEAD_RULES,
        config_from_hf=_modernbert_from_hf,
        blockers=_modernbert_blockers,
        config_to_hf=_modernbert_to_hf,
        split_state=FUSED.split,
        fuse_state=FUSED.fuse,
    ),
    refused={transformers.ModernBertForQuestionAnswering: MODERNBERT_QA_REFUSAL},
)
