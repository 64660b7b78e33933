"""BERT: post-norm, embedding LayerNorm, token types, learned positions, pooler (dense + tanh), MLM transform."""

from ..checks import need, need_all, need_default_head_dim, need_full_attention, need_no_gqa
from ..configuration import TfmConfig
from .core import Family, Rule, classifier_blockers, common_blockers, in_tree_classes, register
from .fields import knobs_from_hf, knobs_to_hf, sizes

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


# hf_tfm knob -> BertConfig attribute, both ways
BERT_FIELDS = {
    "intermediate_size": "intermediate_size",
    "hidden_act": "hidden_act",
    "hidden_dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "type_vocab_size": "type_vocab_size",
    "norm_eps": "layer_norm_eps",
    "classifier_dropout": "classifier_dropout",
}
# An encoder with learned positions, and its layers' fixed knobs: an import sets them, an export needs them (checked
# in this order, the token types between the two)
BERT_INPUTS = {"is_causal": False, "position_embedding_type": "learned"}
BERT_LAYERS = {
    "norm_type": "layernorm",
    "norm_bias": True,
    "norm_position": "post",
    "embedding_norm": True,
    "ffn_type": "mlp",
    "mlp_bias": True,
    "attention_bias": True,
    "attention_out_bias": True,
}
# BertPooler and the sequence classifier's pooling: the first token, a dense layer with bias, tanh
BERT_POOLER = {"classifier_pooling": "first", "classifier_activation": "tanh", "head_dense_bias": True}


def _bert_from_hf(c, head: str) -> dict:
    for knob in ("is_decoder", "add_cross_attention"):
        if getattr(c, knob, False):
            raise ValueError(f"BERT with `{knob}=True` has no hf_tfm equivalent (hf_tfm imports BERT encoders).")
    if head == "question_answering" and c.num_labels != 2:
        raise ValueError(
            f"BertForQuestionAnswering with `num_labels={c.num_labels}` has no hf_tfm equivalent (needs 2)."
        )
    kwargs = {**sizes(c), **knobs_from_hf(c, BERT_FIELDS), **BERT_INPUTS, **BERT_LAYERS, **BERT_POOLER}
    return kwargs | {"classifier_dense": True, "classifier_bias": True}


def _bert_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "bert"
    need_all(config, out, name, BERT_INPUTS)
    need(config, out, name, "type_vocab_size", lambda v: v > 0, "> 0 (BERT always has token type embeddings)")
    need_all(config, out, name, BERT_LAYERS)
    need_no_gqa(config, out, name)
    need_default_head_dim(config, out, name)
    need_full_attention(config, out, name)
    common_blockers(config, name, out, head, base_pooler=True, final_norm=False)
    if head == "base" and config.add_pooling_layer:
        need_all(config, out, name, BERT_POOLER)
    if head == "causal_lm":
        out.append("head `causal_lm` (hf_tfm exports BERT encoders only)")
    if head == "question_answering":  # BertForQuestionAnswering sizes qa_outputs by num_labels; ours is always 2
        need(config, out, name, "num_labels", 2)
    if head == "masked_lm":
        need(config, out, name, "head_dense_bias", True)
        need(config, out, name, "mlm_head_activation", lambda v: v in (None, config.hidden_act), "None / hidden_act")
    classifier_blockers(config, head, name, out, pooling="first", bias=True, dense=True)
    return out


register(
    Family(
        name="bert",
        classes=in_tree_classes(
            "Bert", ("base", "sequence_classification", "token_classification", "masked_lm", "question_answering")
        ),
        base_rules=BERT_BASE_RULES,
        head_rules=BERT_HEAD_RULES,
        config_from_hf=_bert_from_hf,
        blockers=_bert_blockers,
        config_to_hf=lambda config, head: {**sizes(config), **knobs_to_hf(config, BERT_FIELDS)},
        hf_aliases={"cls.predictions.bias": "cls.predictions.decoder.bias"},
    )
)
