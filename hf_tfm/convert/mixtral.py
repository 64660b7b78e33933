"""Mixtral: Mistral's block (RoPE, RMSNorm, GQA, optional sliding window on every layer) with a sparse mixture of
SwiGLU experts in every layer: top-k of the softmax, always renormalised, routing weights kept in fp32."""

from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    MixtralForQuestionAnswering,
    MixtralForSequenceClassification,
    MixtralForTokenClassification,
    MixtralModel,
)

from ..configuration import TfmConfig
from .core import (
    IN_TREE_DEFAULT_CLASSIFIER_DROPOUT,
    MOE_RULES,
    Family,
    classifier_blockers,
    common_blockers,
    moe_blockers,
    moe_from_hf,
    need,
    register,
    sizes,
    token_dropout_to_hf,
)
from .llama_like import LLAMA_BASE_RULES, LLAMA_HEAD_RULES


def _mixtral_from_hf(c, head: str) -> dict:
    kwargs = sizes(c)
    kwargs.update(
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim or c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.intermediate_size,  # Mixtral's `intermediate_size` is each expert's width
        position_embedding_type="rope",
        rope_parameters=dict(c.rope_parameters),
        norm_type="rmsnorm",
        norm_eps=c.rms_norm_eps,
        norm_position="pre",
        ffn_type="glu",
        hidden_act=c.hidden_act,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=float(c.attention_dropout),
        hidden_dropout=0.0,
        is_causal=True,
        sliding_window=c.sliding_window,
        classifier_pooling="last",
        classifier_bias=head == "token_classification",
        classifier_dropout=getattr(c, "classifier_dropout", None),
        **moe_from_hf(c, c.num_local_experts),
        norm_topk_prob=True,
        router_weights_fp32=True,
        router_jitter_noise=c.router_jitter_noise,
    )
    if head == "token_classification" and kwargs["classifier_dropout"] is None:
        kwargs["classifier_dropout"] = IN_TREE_DEFAULT_CLASSIFIER_DROPOUT
    return kwargs


def _mixtral_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "mixtral"
    need(config, out, name, "is_causal", True)
    need(config, out, name, "position_embedding_type", "rope")
    need(config, out, name, "norm_type", "rmsnorm")
    need(config, out, name, "norm_position", "pre")
    need(config, out, name, "embedding_norm", False)
    need(config, out, name, "type_vocab_size", 0)
    need(config, out, name, "attention_bias", False)
    need(config, out, name, "attention_out_bias", False)
    common_blockers(config, name, out, head, hidden_dropout=False)
    kinds = set(config.layer_types)
    need(config, out, name, "layer_types", lambda v: len(kinds) == 1, "one kind for every layer (`sliding_window`)")
    moe_blockers(config, name, out, norm_topk_prob=True, router_weights_fp32=True, jitter=True)
    if head == "masked_lm":
        out.append(f"head `masked_lm` ({name} has no masked-LM class)")
    classifier_blockers(config, head, name, out, pooling="last", bias=False)
    return out


def _mixtral_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = sizes(config)
    kwargs.update(
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.moe_intermediate_size,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.norm_eps,
        rope_parameters=dict(config.rope_parameters),
        attention_dropout=config.attention_dropout,
        sliding_window=config.sliding_window,
        num_local_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=config.output_router_logits,
        router_jitter_noise=config.router_jitter_noise,
        **token_dropout_to_hf(config, head),
    )
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        kwargs["head_dim"] = config.head_dim  # MixtralConfig keeps None for the default
    return kwargs


register(
    Family(
        name="mixtral",
        config_class=MixtralConfig,
        classes={
            "base": MixtralModel,
            "causal_lm": MixtralForCausalLM,
            "sequence_classification": MixtralForSequenceClassification,
            "token_classification": MixtralForTokenClassification,
            "question_answering": MixtralForQuestionAnswering,
        },
        hf_prefix="model.",
        base_rules=MOE_RULES + LLAMA_BASE_RULES,
        head_rules=LLAMA_HEAD_RULES,
        config_from_hf=_mixtral_from_hf,
        blockers=_mixtral_blockers,
        config_to_hf=_mixtral_to_hf,
        moe=True,
    )
)
