"""Exact-parity conversion between hf_tfm and transformers' in-tree model families.

`from_hf(model_or_path)` turns an in-tree Llama, Mistral, Qwen2, GPT-2, BERT or ModernBERT model (object or saved
folder) into the hf_tfm model with the same architecture and weights; `to_hf(model)` writes the in-tree class back
whenever the config is expressible by one, and otherwise raises a `ValueError` naming every knob that blocks it.
`convert_path(src, dst)` does either on saved folders, picking the direction from the source's `model_type`.

Each family is three small tables: how its config maps onto `TfmConfig` knobs, which knob values it needs on the way
back, and how its weight names map onto hf_tfm's (with GPT-2's Conv1D transpose and fused q/k/v, and ModernBERT's
fused Wqkv / Wi, as the only reshaping). The weights are moved with a strict `load_state_dict`, so a tensor nobody
mapped is an error, not a silently random weight.
"""

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoConfig,
    BertConfig,
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    GenerationConfig,
    GPT2Config,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MistralForQuestionAnswering,
    MistralForSequenceClassification,
    MistralForTokenClassification,
    MistralModel,
    ModernBertConfig,
    ModernBertForMaskedLM,
    ModernBertForQuestionAnswering,
    ModernBertForSequenceClassification,
    ModernBertModel,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForQuestionAnswering,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2Model,
)
from transformers.utils import logging

from . import modeling
from .configuration import LAYER_TYPES, TfmConfig
from .modeling import (
    TfmForCausalLM,
    TfmForMaskedLM,
    TfmForQuestionAnswering,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmModel,
    TfmPreTrainedModel,
)

logger = logging.get_logger(__name__)

HEADS = ("base", "causal_lm", "sequence_classification", "token_classification", "masked_lm", "question_answering")
TFM_CLASSES = {
    "base": TfmModel,
    "causal_lm": TfmForCausalLM,
    "sequence_classification": TfmForSequenceClassification,
    "token_classification": TfmForTokenClassification,
    "masked_lm": TfmForMaskedLM,
    "question_answering": TfmForQuestionAnswering,
}
IN_TREE_DEFAULT_CLASSIFIER_DROPOUT = 0.1  # GenericForTokenClassification / GPT-2's fallback when the config has none
# Config fields every head carries unchanged in both directions (labels, problem type).
CARRIED_FIELDS = ("id2label", "label2id", "problem_type")


def _head_of(model: torch.nn.Module) -> str:
    for head, cls in TFM_CLASSES.items():
        if type(model) is cls:
            return head
    for family in FAMILIES.values():
        for head, cls in family.classes.items():
            if type(model) is cls:
                return head
    if type(model) in REFUSED_IMPORTS:
        raise ValueError(f"No hf_tfm import for {type(model).__name__}: {REFUSED_IMPORTS[type(model)]}.")
    raise ValueError(f"No conversion for {type(model).__name__}.")


# ---------------------------------------------------------------------------------------------------------------------
# Weight-name rules. A template like "layers.{i}.attn_norm.{p}" matches a key with a layer index and weight/bias; the
# same rule read right-to-left maps the other way. `transpose` marks GPT-2's Conv1D weights ((in, out) layout).


@dataclass(frozen=True)
class Rule:
    tfm: str
    hf: str
    transpose: bool = False


def _regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, group in (("i", r"\d+"), ("p", r"weight|bias"), ("n", r"[a-z_]+")):
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{group})")
    return re.compile(pattern)


def _rename(key: str, rules: list[Rule], to_hf: bool) -> tuple[str, bool] | None:
    for rule in rules:
        src, dst = (rule.tfm, rule.hf) if to_hf else (rule.hf, rule.tfm)
        match = _regex(src).fullmatch(key)
        if match:
            return dst.format(**match.groupdict()), rule.transpose and match.groupdict().get("p") == "weight"
    return None


def _prefixed(rules: list[Rule], tfm_prefix: str, hf_prefix: str) -> list[Rule]:
    return [Rule(tfm_prefix + r.tfm, hf_prefix + r.hf, r.transpose) for r in rules]


# ---------------------------------------------------------------------------------------------------------------------
# Families


@dataclass
class Family:
    name: str
    config_class: type
    classes: dict[str, type]  # head -> in-tree class
    hf_prefix: str  # the in-tree base model's attribute inside its heads ("model.", "transformer.", "bert.")
    base_rules: list[Rule]
    head_rules: dict[str, list[Rule]]
    config_from_hf: Callable  # (hf_config, head) -> TfmConfig kwargs
    blockers: Callable  # (TfmConfig, head) -> list of "knob=value (needs ...)"
    config_to_hf: Callable  # (TfmConfig, head) -> in-tree config kwargs
    hf_aliases: dict[str, str] = field(default_factory=dict)  # in-tree key -> the key it must equal (tied copies)
    split_state: Callable | None = None  # in-tree state dict -> the same with fused projections split (before rules)
    fuse_state: Callable | None = None  # the reverse, after the rules (GPT-2's c_attn, ModernBERT's Wqkv and Wi)
    head_prefixes: dict[str, str] = field(default_factory=dict)  # head -> hf_prefix where a head differs (Llama QA)

    def rules(self, head: str) -> list[Rule]:
        if head == "base":
            return self.base_rules + self.head_rules.get("base", [])
        prefix = self.head_prefixes.get(head, self.hf_prefix)
        return _prefixed(self.base_rules, "model.", prefix) + self.head_rules.get(head, [])


def _need(config: TfmConfig, out: list[str], family: str, knob: str, expected, why: str | None = None) -> None:
    """Append a blocker message when `config.<knob>` differs from `expected` (a value or a predicate)."""
    value = getattr(config, knob)
    ok = expected(value) if callable(expected) else value == expected
    if not ok:
        needs = why or f"{expected!r}"
        out.append(f"`{knob}`={value!r} ({family} needs {needs})")


def _common_blockers(config: TfmConfig, family: str, out: list[str], head: str) -> None:
    _need(config, out, family, "qk_norm", False)
    if head == "base" and family != "bert":  # heads build no backbone pooler
        _need(config, out, family, "add_pooling_layer", False, "False (no pooler in its base model)")
    _need(config, out, family, "parallel_residual", False)
    _need(config, out, family, "first_layer_attn_norm", family != "modernbert")
    _need(config, out, family, "final_norm", family != "bert")  # BERT is post-norm: no norm after the last layer
    if family != "modernbert":
        _need(config, out, family, "rope_parameters", lambda v: not config.rope_per_layer_type, "one flat RoPE dict")
    if family in ("llama", "mistral", "qwen2"):  # no dropout outside attention in these blocks
        _need(config, out, family, "hidden_dropout", 0.0)


def _classifier_blockers(config: TfmConfig, head: str, family: str, out: list[str], pooling: str, bias: bool) -> None:
    if head == "sequence_classification":
        _need(config, out, family, "classifier_pooling", pooling)
        _need(config, out, family, "classifier_bias", bias)
        dense = family == "bert"
        _need(config, out, family, "classifier_dense", dense)
        if dense:
            _need(config, out, family, "classifier_activation", "tanh")
            _need(config, out, family, "classifier_norm", False)
            _need(config, out, family, "head_dense_bias", True)
    if head == "token_classification":
        _need(config, out, family, "classifier_bias", True)


def _sizes(c) -> dict:
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "max_position_embeddings": c.max_position_embeddings,
        "initializer_range": c.initializer_range,
        "pad_token_id": c.pad_token_id,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "tie_word_embeddings": c.tie_word_embeddings,
        "use_cache": getattr(c, "use_cache", True),  # ModernBERT (an encoder) has none
    }


def _token_dropout_to_hf(config: TfmConfig, head: str) -> dict:
    """Only the token classifier of Llama-like / GPT-2 models reads a (non-field) `classifier_dropout`."""
    if head != "token_classification":
        return {}
    p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
    return {} if p == IN_TREE_DEFAULT_CLASSIFIER_DROPOUT else {"classifier_dropout": p}


# --- Llama, Mistral, Qwen2: one block (RoPE, RMSNorm, SwiGLU, pre-norm, GQA); they differ in biases and windows.

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


def _llama_like_from_hf(c, head: str, name: str) -> dict:
    kwargs = _sizes(c)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kwargs.update(
        num_key_value_heads=c.num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=c.intermediate_size,
        position_embedding_type="rope",
        rope_parameters=dict(c.rope_parameters),
        norm_type="rmsnorm",
        norm_eps=c.rms_norm_eps,
        norm_position="pre",
        ffn_type="glu",
        hidden_act=c.hidden_act,
        attention_dropout=float(c.attention_dropout),
        hidden_dropout=0.0,
        is_causal=True,
        classifier_pooling="last",
        classifier_bias=head == "token_classification",
        classifier_dropout=getattr(c, "classifier_dropout", None),
    )
    if head == "token_classification" and kwargs["classifier_dropout"] is None:
        kwargs["classifier_dropout"] = IN_TREE_DEFAULT_CLASSIFIER_DROPOUT
    if name == "llama":
        kwargs.update(attention_bias=c.attention_bias, attention_out_bias=c.attention_bias, mlp_bias=c.mlp_bias)
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
    _need(config, out, name, "is_causal", True)
    _need(config, out, name, "position_embedding_type", "rope")
    _need(config, out, name, "norm_type", "rmsnorm")
    _need(config, out, name, "norm_position", "pre")
    _need(config, out, name, "ffn_type", "glu")
    _need(config, out, name, "embedding_norm", False)
    _need(config, out, name, "type_vocab_size", 0)
    _common_blockers(config, name, out, head)
    sliding = set(config.layer_types)
    if name == "llama":
        _need(config, out, name, "attention_out_bias", config.attention_bias, "the same value as `attention_bias`")
        _need(config, out, name, "layer_types", lambda v: sliding == {"full_attention"}, "only 'full_attention'")
    elif name == "mistral":
        _need(config, out, name, "attention_bias", False)
        _need(config, out, name, "attention_out_bias", False)
        _need(config, out, name, "mlp_bias", False)
        _need(config, out, name, "layer_types", lambda v: sliding == {"sliding_attention"}, "only sliding layers")
    else:
        _need(config, out, name, "attention_bias", True)
        _need(config, out, name, "attention_out_bias", False)
        _need(config, out, name, "mlp_bias", False)
        _need(config, out, name, "head_dim", config.hidden_size // config.num_attention_heads)
    if head == "masked_lm":
        out.append(f"head `masked_lm` ({name} has no masked-LM class)")
    _classifier_blockers(config, head, name, out, pooling="last", bias=False)
    return out


def _llama_like_to_hf(config: TfmConfig, head: str, name: str) -> dict:
    kwargs = _sizes(config)
    kwargs.update(
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.norm_eps,
        rope_parameters=dict(config.rope_parameters),
        attention_dropout=config.attention_dropout,
        **_token_dropout_to_hf(config, head),
    )
    if name == "llama":
        kwargs.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, head_dim=config.head_dim)
    elif name == "mistral":
        kwargs.update(sliding_window=config.sliding_window, head_dim=config.head_dim)
    else:
        sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
        if sliding:
            kwargs.update(
                use_sliding_window=True,
                sliding_window=config.sliding_window,
                max_window_layers=sliding[0],
                layer_types=list(config.layer_types),
            )
    return kwargs


def _llama_like(name: str, config_class, classes) -> Family:
    heads = ("base", "causal_lm", "sequence_classification", "token_classification", "question_answering")
    classes = dict(zip(heads, classes, strict=True))
    return Family(
        name=name,
        config_class=config_class,
        classes=classes,
        hf_prefix="model.",
        # LlamaForQuestionAnswering / Qwen2's keep their backbone under `transformer.` (Mistral's under `model.`)
        head_prefixes={"question_answering": classes["question_answering"].base_model_prefix + "."},
        base_rules=LLAMA_BASE_RULES,
        head_rules=LLAMA_HEAD_RULES,
        config_from_hf=lambda c, head: _llama_like_from_hf(c, head, name),
        blockers=lambda c, head: _llama_like_blockers(c, head, name),
        config_to_hf=lambda c, head: _llama_like_to_hf(c, head, name),
    )


# --- GPT-2: learned positions, LayerNorm with bias, GELU MLP, biases everywhere, Conv1D (in, out) weights, fused qkv.

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
    kwargs = _sizes(c)
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
    _need(config, out, name, "is_causal", True)
    _need(config, out, name, "position_embedding_type", "learned")
    _need(config, out, name, "norm_type", "layernorm")
    _need(config, out, name, "norm_bias", True)
    _need(config, out, name, "norm_position", "pre")
    _need(config, out, name, "ffn_type", "mlp")
    _need(config, out, name, "mlp_bias", True)
    _need(config, out, name, "attention_bias", True)
    _need(config, out, name, "attention_out_bias", True)
    _need(config, out, name, "num_key_value_heads", config.num_attention_heads, "`num_attention_heads` (no GQA)")
    _need(config, out, name, "head_dim", config.hidden_size // config.num_attention_heads, "hidden/heads")
    _need(config, out, name, "layer_types", lambda v: set(v) == {"full_attention"}, "only 'full_attention'")
    _need(config, out, name, "embedding_norm", False)
    _need(config, out, name, "type_vocab_size", 0)
    _common_blockers(config, name, out, head)
    if head == "masked_lm":
        out.append("head `masked_lm` (gpt2 has no masked-LM class)")
    _classifier_blockers(config, head, name, out, pooling="last", bias=False)
    return out


def _gpt2_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = _sizes(config)
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
        **_token_dropout_to_hf(config, head),
    )
    return kwargs


# --- BERT: post-norm, embedding LayerNorm, token types, learned positions, pooler (dense + tanh), MLM transform.

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
    kwargs = _sizes(c)
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
    _need(config, out, name, "is_causal", False)
    _need(config, out, name, "position_embedding_type", "learned")
    _need(config, out, name, "type_vocab_size", lambda v: v > 0, "> 0 (BERT always has token type embeddings)")
    _need(config, out, name, "norm_type", "layernorm")
    _need(config, out, name, "norm_bias", True)
    _need(config, out, name, "norm_position", "post")
    _need(config, out, name, "embedding_norm", True)
    _need(config, out, name, "ffn_type", "mlp")
    _need(config, out, name, "mlp_bias", True)
    _need(config, out, name, "attention_bias", True)
    _need(config, out, name, "attention_out_bias", True)
    _need(config, out, name, "num_key_value_heads", config.num_attention_heads, "`num_attention_heads` (no GQA)")
    _need(config, out, name, "head_dim", config.hidden_size // config.num_attention_heads, "hidden/heads")
    _need(config, out, name, "layer_types", lambda v: set(v) == {"full_attention"}, "only 'full_attention'")
    _common_blockers(config, name, out, head)
    if head == "base" and config.add_pooling_layer:  # BertPooler: first token, dense with bias, tanh
        _need(config, out, name, "classifier_pooling", "first")
        _need(config, out, name, "classifier_activation", "tanh")
        _need(config, out, name, "head_dense_bias", True)
    if head == "causal_lm":
        out.append("head `causal_lm` (hf_tfm exports BERT encoders only)")
    if head == "question_answering":  # BertForQuestionAnswering sizes qa_outputs by num_labels; ours is always 2
        _need(config, out, name, "num_labels", 2)
    if head == "masked_lm":
        _need(config, out, name, "head_dense_bias", True)
        _need(config, out, name, "mlm_head_activation", lambda v: v in (None, config.hidden_act), "None / hidden_act")
    _classifier_blockers(config, head, name, out, pooling="first", bias=True)
    return out


def _bert_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = _sizes(config)
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


# --- ModernBERT: pre-norm encoder, LayerNorm (no bias by default), fused Wqkv and GeGLU Wi, RoPE theta per layer type,
# alternating global / bidirectional sliding-window layers, no attention norm on layer 0, dense+act+norm head.

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
    kwargs = _sizes(c)
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
    _need(config, out, name, "is_causal", False)
    _need(config, out, name, "position_embedding_type", "rope")
    _need(config, out, name, "type_vocab_size", 0)
    _need(config, out, name, "norm_type", "layernorm")
    _need(config, out, name, "norm_position", "pre")
    _need(config, out, name, "embedding_norm", True)
    _need(config, out, name, "ffn_type", "glu")
    _need(config, out, name, "attention_out_bias", config.attention_bias, "the same value as `attention_bias`")
    _need(config, out, name, "num_key_value_heads", config.num_attention_heads, "`num_attention_heads` (no GQA)")
    _need(config, out, name, "head_dim", config.hidden_size // config.num_attention_heads, "hidden/heads")
    _need(config, out, name, "hidden_dropout", 0.0, "0.0 (its dropouts sit elsewhere)")
    _need(config, out, name, "attention_dropout", 0.0, "0.0 (its dropouts sit elsewhere)")
    _common_blockers(config, name, out, head)
    if head in ("causal_lm", "token_classification"):
        out.append(f"head `{head}` (hf_tfm exports ModernBERT's base, masked-LM and sequence-classification heads)")
    if head == "question_answering":
        out.append(f"head `question_answering` ({MODERNBERT_QA_REFUSAL})")
    if head == "sequence_classification":
        _need(config, out, name, "classifier_pooling", lambda v: v in ("first", "mean"), "'first' or 'mean'")
        _need(config, out, name, "classifier_dense", True)
        _need(config, out, name, "classifier_norm", True)
        _need(config, out, name, "classifier_bias", True)
    return out


def _modernbert_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = _sizes(config)
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


FAMILIES: dict[str, Family] = {
    "llama": _llama_like(
        "llama",
        LlamaConfig,
        (
            LlamaModel,
            LlamaForCausalLM,
            LlamaForSequenceClassification,
            LlamaForTokenClassification,
            LlamaForQuestionAnswering,
        ),
    ),
    "mistral": _llama_like(
        "mistral",
        MistralConfig,
        (
            MistralModel,
            MistralForCausalLM,
            MistralForSequenceClassification,
            MistralForTokenClassification,
            MistralForQuestionAnswering,
        ),
    ),
    "qwen2": _llama_like(
        "qwen2",
        Qwen2Config,
        (
            Qwen2Model,
            Qwen2ForCausalLM,
            Qwen2ForSequenceClassification,
            Qwen2ForTokenClassification,
            Qwen2ForQuestionAnswering,
        ),
    ),
    "gpt2": Family(
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
    ),
    "bert": Family(
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
    ),
    "modernbert": Family(
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
}
# In-tree heads whose structure hf_tfm does not have: importing one raises this reason instead of guessing.
REFUSED_IMPORTS: dict[type, str] = {ModernBertForQuestionAnswering: MODERNBERT_QA_REFUSAL}


# ---------------------------------------------------------------------------------------------------------------------
# Public API


def _load_in_tree(path: str | Path) -> PreTrainedModel:
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in FAMILIES:
        raise ValueError(
            f"`model_type={config.model_type!r}` in {path} is not importable; supported: {sorted(FAMILIES)}."
        )
    architecture = (config.architectures or [FAMILIES[config.model_type].classes["base"].__name__])[0]
    return getattr(transformers, architecture).from_pretrained(path)


def _build(cls, config, source: torch.nn.Module, state: dict) -> PreTrainedModel:
    """Instantiate `cls(config)` with the source's attention backend, load `state` strictly, match dtype."""
    config._attn_implementation = source.config._attn_implementation
    # A backbone carries a pooler when the weights have one (BertModel's `add_pooling_layer`, our config knob).
    pooler = any(key.startswith("pooler.") for key in state)
    model = cls(config, add_pooling_layer=pooler) if cls is BertModel else cls(config)
    dtype = next(source.parameters()).dtype
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in _tied_targets(model)]
    if missing or unexpected:
        raise ValueError(
            f"Weight mapping for {cls.__name__} is incomplete: missing {missing}, unexpected {unexpected}."
        )
    model.to(dtype)
    model.config.dtype = dtype  # saved as config.json's "dtype", as from_pretrained would record it
    if getattr(source, "generation_config", None) is not None and model.can_generate():
        model.generation_config = GenerationConfig.from_dict(source.generation_config.to_dict())
    model.train(source.training)
    return model


def _tied_targets(model: PreTrainedModel) -> set[str]:
    """Keys that are tied copies of another weight (filled by tying, not by the state dict)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return set(getattr(model, "all_tied_weights_keys", {}) or {})


def from_hf(model_or_path: PreTrainedModel | str | Path) -> TfmPreTrainedModel:
    """An in-tree Llama / Mistral / Qwen2 / GPT-2 / BERT / ModernBERT model (object or folder) as hf_tfm's equivalent.

    The head follows the source: `*Model` -> `TfmModel`, `*ForCausalLM`/`GPT2LMHeadModel` -> `TfmForCausalLM`,
    `*ForSequenceClassification`, `*ForTokenClassification`, `*ForQuestionAnswering`, `*ForMaskedLM` -> the hf_tfm head
    of that name (not ModernBertForQuestionAnswering, whose span head has an extra transform). Weights
    are copied (GPT-2's Conv1D ones transposed), the attention backend, dtype and generation config are kept.
    """
    source = _load_in_tree(model_or_path) if isinstance(model_or_path, (str, Path)) else model_or_path
    family = FAMILIES.get(source.config.model_type)
    if family is None:
        raise ValueError(
            f"No hf_tfm import for model_type={source.config.model_type!r}; supported: {sorted(FAMILIES)}."
        )
    head = _head_of(source)
    kwargs = family.config_from_hf(source.config, head)
    kwargs.update({name: getattr(source.config, name) for name in CARRIED_FIELDS})
    state = source.state_dict()
    if family.split_state is not None:
        state = family.split_state(state)
    rules = family.rules(head)
    converted = {}
    for key, value in state.items():
        if key in family.hf_aliases:
            continue
        renamed = _rename(key, rules, to_hf=False)
        if renamed is None:
            raise ValueError(f"from_hf: no hf_tfm counterpart for {family.name} weight `{key}`.")
        name, transpose = renamed
        converted[name] = value.t() if transpose else value
    kwargs["add_pooling_layer"] = head == "base" and any(key.startswith("pooler.") for key in converted)
    config = TfmConfig(**kwargs)
    return _build(TFM_CLASSES[head], config, source, {k: v.detach().clone() for k, v in converted.items()})


def export_blockers(config: TfmConfig, head: str = "base") -> dict[str, list[str]]:
    """For each in-tree family, the knobs that keep `config` (with this head) from being exported to it."""
    blockers = {name: family.blockers(config, head) for name, family in FAMILIES.items()}
    for name, found in blockers.items():
        if head == "causal_lm":  # no in-tree family has a bias on its causal LM head
            _need(config, found, name, "lm_head_bias", False)
    return blockers


def to_hf(model: TfmPreTrainedModel | str | Path) -> PreTrainedModel:
    """The in-tree transformers model equal to an hf_tfm model, or a `ValueError` naming every blocking knob.

    The first family that expresses the config exactly wins, in the order llama, mistral, qwen2, gpt2, bert, modernbert
    (so an all-full-attention Mistral comes back as Llama, which is the same architecture). The result saves and loads
    with plain transformers, no `trust_remote_code`.
    """
    if isinstance(model, (str, Path)):
        config = TfmConfig.from_pretrained(model)
        architecture = (config.architectures or ["TfmModel"])[0]
        model = getattr(modeling, architecture).from_pretrained(model)
    head = _head_of(model)
    config = model.config
    blockers = export_blockers(config, head)
    name = next((name for name, found in blockers.items() if not found and head in FAMILIES[name].classes), None)
    if name is None:
        ranked = sorted(blockers.items(), key=lambda item: len(item[1]))
        closest, found = ranked[0]
        others = "; ".join(f"{n}: {len(b)} knobs" for n, b in ranked[1:])
        raise ValueError(
            f"This hf_tfm config ({head}) has no in-tree transformers equivalent. Closest family: {closest}, blocked "
            f"by: {'; '.join(found)}. Other families: {others}."
        )
    family = FAMILIES[name]
    kwargs = family.config_to_hf(config, head)
    kwargs.update({field_name: getattr(config, field_name) for field_name in CARRIED_FIELDS})
    hf_config = family.config_class(**kwargs)

    rules = family.rules(head)
    converted = {}
    for key, value in model.state_dict().items():
        renamed = _rename(key, rules, to_hf=True)
        if renamed is None:
            raise ValueError(f"to_hf: no {name} counterpart for hf_tfm weight `{key}`.")
        hf_key, transpose = renamed
        converted[hf_key] = value.t() if transpose else value
    if family.fuse_state is not None:
        converted = family.fuse_state(converted)
    for alias, original in family.hf_aliases.items():
        if original in converted:
            converted[alias] = converted[original]
    return _build(family.classes[head], hf_config, model, {k: v.detach().clone() for k, v in converted.items()})


def convert_path(src: str | Path, dst: str | Path) -> PreTrainedModel:
    """Convert a saved folder: hf_tfm -> in-tree if its `model_type` is "hf_tfm", else in-tree -> hf_tfm.

    Writes safetensors and the config (and generation config) to `dst`, and copies the other files of `src`
    (tokenizer and the like) unchanged. Returns the converted model.
    """
    src, dst = Path(src), Path(dst)
    config = TfmConfig.get_config_dict(src)[0]
    converted = to_hf(src) if config.get("model_type") == TfmConfig.model_type else from_hf(src)
    dst.mkdir(parents=True, exist_ok=True)
    converted.save_pretrained(dst, safe_serialization=True)
    skip = re.compile(r"config\.json|generation_config\.json|.*\.safetensors(\.index\.json)?|pytorch_model.*|.*\.py")
    for file in src.iterdir() if src.is_dir() else ():  # a Hub id has no local files to carry
        if file.is_file() and not skip.fullmatch(file.name) and not (dst / file.name).exists():
            shutil.copy2(file, dst / file.name)
    return converted


__all__ = ["convert_path", "export_blockers", "from_hf", "to_hf"]
