"""Llama, Mistral and Qwen2: one block (RoPE, RMSNorm, SwiGLU, pre-norm, GQA); they differ in biases and windows."""

from transformers import (
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
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForQuestionAnswering,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2Model,
)

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
    kwargs = sizes(c)
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
    need(config, out, name, "is_causal", True)
    need(config, out, name, "position_embedding_type", "rope")
    need(config, out, name, "norm_type", "rmsnorm")
    need(config, out, name, "norm_position", "pre")
    need(config, out, name, "ffn_type", "glu")
    need(config, out, name, "embedding_norm", False)
    need(config, out, name, "type_vocab_size", 0)
    common_blockers(config, name, out, head, hidden_dropout=False)
    sliding = set(config.layer_types)
    if name == "llama":
        need(config, out, name, "attention_out_bias", config.attention_bias, "the same value as `attention_bias`")
        need(config, out, name, "layer_types", lambda v: sliding == {"full_attention"}, "only 'full_attention'")
    elif name == "mistral":
        need(config, out, name, "attention_bias", False)
        need(config, out, name, "attention_out_bias", False)
        need(config, out, name, "mlp_bias", False)
        need(config, out, name, "layer_types", lambda v: sliding == {"sliding_attention"}, "only sliding layers")
    else:
        need(config, out, name, "attention_bias", True)
        need(config, out, name, "attention_out_bias", False)
        need(config, out, name, "mlp_bias", False)
        need(config, out, name, "head_dim", config.hidden_size // config.num_attention_heads)
    if head == "masked_lm":
        out.append(f"head `masked_lm` ({name} has no masked-LM class)")
    classifier_blockers(config, head, name, out, pooling="last", bias=False)
    return out


def _llama_like_to_hf(config: TfmConfig, head: str, name: str) -> dict:
    kwargs = sizes(config)
    kwargs.update(
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.norm_eps,
        rope_parameters=dict(config.rope_parameters),
        attention_dropout=config.attention_dropout,
        **token_dropout_to_hf(config, head),
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


register(
    _llama_like(
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
    _llama_like(
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
    _llama_like(
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
)
