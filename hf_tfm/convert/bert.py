"""BERT: post-norm, embedding LayerNorm, token types, learned positions, pooler (dense + tanh), MLM transform."""

from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)

from ..configuration import TfmConfig
from .core import Family, Rule, classifier_blockers, common_blockers, need, register, sizes

BERT_BASE_RULES = [
    Rule("embed_tokens.weight", "embeddings.word_embeddings.weight"),
    Rule("embed_positions.weight", "embeddings.position_embeddings.weight"),
    Rule("token_type_embeddings.weight", "embeddings.token_type_embeddings.weight"),
    Rule("embed_norm.{p}", "embeddings.LayerNorm.{p}"),
    Rule("layers.{i}.self_attn.q_proj.{p}", "encoder.layer.{i}.attention.self.query.{p}"),
    Rule("layers.{i}.self_attn.k_proj.{p}", "encoder.layer.{i}.attention.self.key.{p}"),
    Rule("layers.{i}.self_attn.v_proj.{p}", "encoder.layer.{i}.attention.self.value.{p}"),
    Rule("layers.{i}.self_attn.o_proj.{p}", "encoder.layer.{i}.attention.output.dense.{p}"),
    Rule("layers.{i}.attn_norm.{p}", "encoder.layer.{i}.attention.output.LayerNorm.{p}"),
    Rule("layers.{i}.mlp.up_proj.{p}", "encoder.layer.{i}.intermediate.dense.{p}"),
    Rule("layers.{i}.mlp.down_proj.{p}", "encoder.layer.{i}.output.dense.{p}"),
    Rule("layers.{i}.mlp_norm.{p}", "encoder.layer.{i}.output.LayerNorm.{p}"),
]
BERT_HEAD_RULES = {
    "base": [Rule("pooler.dense.{p}", "pooler.dense.{p}")],  # TfmModel's `add_pooling_layer`
    "sequence_classification": [Rule("head.dense.{p}", "bert.pooler.dense.{p}"), Rule("score.{p}", "classifier.{p}")],
    "token_classification": [Rule("score.{p}", "classifier.{p}")],
    "question_answering": [Rule("qa_outputs.{p}", "qa_outputs.{p}")],
    "masked_lm": [
        Rule("head.dense.{p}", "cls.predictions.transform.dense.{p}"),
        Rule("head.norm.{p}", "cls.predictions.transform.LayerNorm.{p}"),
        Rule("lm_head.{p}", "cls.predictions.decoder.{p}"),
    ],
}


def _bert_from_hf(c, head: str) -> dict:
    for knob in ("is_decoder", "add_cross_attention"):
        if getattr(c, knob, False):
            raise ValueError(f"BERT with `{knob}=True` has no hf_tfm equivalent (hf_tfm imports BERT encoders).")
    if head == "question_answering" and c.num_labels != 2:
        raise ValueError(
            f"BertForQuestionAnswering with `num_labels={c.num_labels}` has no hf_tfm equivalent (needs 2)."
        )
    kwargs = sizes(c)
    kwargs.update(
        intermediate_size=c.intermediate_size,
        position_embedding_type="learned",
        type_vocab_size=c.type_vocab_size,
        norm_type="layernorm",
        norm_bias=True,
        norm_eps=c.layer_norm_eps,
        norm_position="post",
        embedding_norm=True,
        ffn_type="mlp",
        hidden_act=c.hidden_act,
        mlp_bias=True,
        attention_bias=True,
        attention_out_bias=True,
        attention_dropout=float(c.attention_probs_dropout_prob),
        hidden_dropout=float(c.hidden_dropout_prob),
        is_causal=False,
        classifier_pooling="first",
        classifier_dense=True,
        classifier_activation="tanh",
        classifier_bias=True,
        classifier_dropout=c.classifier_dropout,
    )
    return kwargs


def _bert_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "bert"
    need(config, out, name, "is_causal", False)
    need(config, out, name, "position_embedding_type", "learned")
    need(config, out, name, "type_vocab_size", lambda v: v > 0, "> 0 (BERT always has token type embeddings)")
    need(config, out, name, "norm_type", "layernorm")
    need(config, out, name, "norm_bias", True)
    need(config, out, name, "norm_position", "post")
    need(config, out, name, "embedding_norm", True)
    need(config, out, name, "ffn_type", "mlp")
    need(config, out, name, "mlp_bias", True)
    need(config, out, name, "attention_bias", True)
    need(config, out, name, "attention_out_bias", True)
    need(config, out, name, "num_key_value_heads", config.num_attention_heads, "`num_attention_heads` (no GQA)")
    need(config, out, name, "head_dim", config.hidden_size // config.num_attention_heads, "hidden/heads")
    need(config, out, name, "layer_types", lambda v: set(v) == {"full_attention"}, "only 'full_attention'")
    common_blockers(config, name, out, head, base_pooler=True, final_norm=False)
    if head == "base" and config.add_pooling_layer:  # BertPooler: first token, dense with bias, tanh
        need(config, out, name, "classifier_pooling", "first")
        need(config, out, name, "classifier_activation", "tanh")
        need(config, out, name, "head_dense_bias", True)
    if head == "causal_lm":
        out.append("head `causal_lm` (hf_tfm exports BERT encoders only)")
    if head == "question_answering":  # BertForQuestionAnswering sizes qa_outputs by num_labels; ours is always 2
        need(config, out, name, "num_labels", 2)
    if head == "masked_lm":
        need(config, out, name, "head_dense_bias", True)
        need(config, out, name, "mlm_head_activation", lambda v: v in (None, config.hidden_act), "None / hidden_act")
    classifier_blockers(config, head, name, out, pooling="first", bias=True, dense=True)
    return out


def _bert_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = sizes(config)
    kwargs.update(
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        type_vocab_size=config.type_vocab_size,
        layer_norm_eps=config.norm_eps,
        classifier_dropout=config.classifier_dropout,
    )
    return kwargs


register(
    Family(
        name="bert",
        config_class=BertConfig,
        classes={
            "base": BertModel,
            "sequence_classification": BertForSequenceClassification,
            "token_classification": BertForTokenClassification,
            "masked_lm": BertForMaskedLM,
            "question_answering": BertForQuestionAnswering,
        },
        hf_prefix="bert.",
        base_rules=BERT_BASE_RULES,
        head_rules=BERT_HEAD_RULES,
        config_from_hf=_bert_from_hf,
        blockers=_bert_blockers,
        config_to_hf=_bert_to_hf,
        hf_aliases={"cls.predictions.bias": "cls.predictions.decoder.bias"},
    )
)
