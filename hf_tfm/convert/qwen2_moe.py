"""Qwen2-MoE: Qwen2's block (q/k/v bias, none on o_proj, optional sliding layers) with routed SwiGLU experts of
`moe_intermediate_size` plus a sigmoid-gated shared expert; `mlp_only_layers` and `decoder_sparse_step` keep some
layers dense (of `intermediate_size`). Top-k of the softmax, renormalised if `norm_topk_prob`."""

from transformers import (
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen2MoeForQuestionAnswering,
    Qwen2MoeForSequenceClassification,
    Qwen2MoeForTokenClassification,
    Qwen2MoeModel,
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


def _qwen2_moe_from_hf(c, head: str) -> dict:
    if c.num_experts == 0:  # Qwen2MoeDecoderLayer then builds dense layers only
        raise ValueError("Qwen2-MoE with `num_experts=0` is dense: import it as a Qwen2 model instead.")
    sliding = c.use_sliding_window and "sliding_attention" in c.layer_types
    kwargs = sizes(c)
    kwargs.update(
        num_key_value_heads=c.num_key_value_heads,
        intermediate_size=c.intermediate_size,
        position_embedding_type="rope",
        rope_parameters=dict(c.rope_parameters),
        norm_type="rmsnorm",
        norm_eps=c.rms_norm_eps,
        norm_position="pre",
        ffn_type="glu",
        hidden_act=c.hidden_act,
        attention_bias=c.qkv_bias,
        attention_out_bias=False,
        mlp_bias=False,
        attention_dropout=float(c.attention_dropout),
        hidden_dropout=0.0,
        is_causal=True,
        sliding_window=c.sliding_window if sliding else None,
        layer_types=list(c.layer_types) if sliding else None,
        classifier_pooling="last",
        classifier_bias=head == "token_classification",
        classifier_dropout=getattr(c, "classifier_dropout", None),
        **moe_from_hf(c, c.num_experts),
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        norm_topk_prob=c.norm_topk_prob,
        mlp_only_layers=list(c.mlp_only_layers) or None,
        decoder_sparse_step=c.decoder_sparse_step,
    )
    if head == "token_classification" and kwargs["classifier_dropout"] is None:
        kwargs["classifier_dropout"] = IN_TREE_DEFAULT_CLASSIFIER_DROPOUT
    return kwargs


def _qwen2_moe_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "qwen2_moe"
    need(config, out, name, "is_causal", True)
    need(config, out, name, "position_embedding_type", "rope")
    need(config, out, name, "norm_type", "rmsnorm")
    need(config, out, name, "norm_position", "pre")
    need(config, out, name, "embedding_norm", False)
    need(config, out, name, "type_vocab_size", 0)
    need(config, out, name, "attention_out_bias", False)
    need(config, out, name, "head_dim", config.hidden_size // config.num_attention_heads)
    common_blockers(config, name, out, head, hidden_dropout=False)
    moe_blockers(config, name, out, shared_expert=True, sparse_layer_rule=True)
    if head == "masked_lm":
        out.append(f"head `masked_lm` ({name} has no masked-LM class)")
    classifier_blockers(config, head, name, out, pooling="last", bias=False)
    return out


def _qwen2_moe_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = sizes(config)
    kwargs.update(
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.norm_eps,
        rope_parameters=dict(config.rope_parameters),
        attention_dropout=config.attention_dropout,
        qkv_bias=config.attention_bias,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        mlp_only_layers=list(config.mlp_only_layers or []),
        decoder_sparse_step=config.decoder_sparse_step,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=config.output_router_logits,
        **token_dropout_to_hf(config, head),
    )
    sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
    if sliding:  # the layer list itself; `max_window_layers` as small as Qwen2-MoE's rule allows for it
        kwargs.update(
            use_sliding_window=True,
            sliding_window=config.sliding_window,
            max_window_layers=sliding[-1] + 1,
            layer_types=list(config.layer_types),
        )
    return kwargs


register(
    Family(
        name="qwen2_moe",
        config_class=Qwen2MoeConfig,
        classes={
            "base": Qwen2MoeModel,
            "causal_lm": Qwen2MoeForCausalLM,
            "sequence_classification": Qwen2MoeForSequenceClassification,
            "token_classification": Qwen2MoeForTokenClassification,
            "question_answering": Qwen2MoeForQuestionAnswering,
        },
        hf_prefix="model.",
        base_rules=MOE_RULES + LLAMA_BASE_RULES,
        head_rules=LLAMA_HEAD_RULES,
        config_from_hf=_qwen2_moe_from_hf,
        blockers=_qwen2_moe_blockers,
        config_to_hf=_qwen2_moe_to_hf,
        moe=True,
    )
)
