"""OLMoE: a Llama-style block whose q/k norms (RMSNorm) span the whole q and k projections, with SwiGLU experts of
`intermediate_size` in every layer; top-k of the softmax, renormalised if `norm_topk_prob`."""

from transformers import OlmoeConfig, OlmoeForCausalLM, OlmoeModel

from ..configuration import TfmConfig
from .core import MOE_RULES, Family, common_blockers, moe_blockers, moe_from_hf, need, register, sizes
from .llama_like import LLAMA_BASE_RULES, LLAMA_HEAD_RULES


def _olmoe_from_hf(c, head: str) -> dict:
    if c.clip_qkv is not None:
        raise ValueError(f"OLMoE with `clip_qkv={c.clip_qkv}` has no hf_tfm equivalent (q/k/v are never clamped).")
    kwargs = sizes(c)
    kwargs.update(
        num_key_value_heads=c.num_key_value_heads,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.intermediate_size,  # OLMoE's `intermediate_size` is each expert's width
        position_embedding_type="rope",
        rope_parameters=dict(c.rope_parameters),
        norm_type="rmsnorm",
        norm_eps=c.rms_norm_eps,
        norm_position="pre",
        ffn_type="glu",
        hidden_act=c.hidden_act,
        attention_bias=c.attention_bias,
        attention_out_bias=c.attention_bias,
        mlp_bias=False,
        qk_norm=True,
        qk_norm_scope="projection",
        attention_dropout=float(c.attention_dropout),
        hidden_dropout=0.0,
        is_causal=True,
        **moe_from_hf(c, c.num_experts),
        norm_topk_prob=c.norm_topk_prob,
    )
    return kwargs


def _olmoe_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "olmoe"
    need(config, out, name, "is_causal", True)
    need(config, out, name, "position_embedding_type", "rope")
    need(config, out, name, "norm_type", "rmsnorm")
    need(config, out, name, "norm_position", "pre")
    need(config, out, name, "embedding_norm", False)
    need(config, out, name, "type_vocab_size", 0)
    need(config, out, name, "attention_out_bias", config.attention_bias, "the same value as `attention_bias`")
    need(config, out, name, "head_dim", config.hidden_size // config.num_attention_heads)
    need(config, out, name, "layer_types", lambda v: set(v) == {"full_attention"}, "only 'full_attention'")
    common_blockers(config, name, out, head, hidden_dropout=False, qk_norm_scope="projection")
    moe_blockers(config, name, out)
    if head not in ("base", "causal_lm"):
        out.append(f"head `{head}` ({name} has base and causal-LM classes only)")
    return out


def _olmoe_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = sizes(config)
    kwargs.update(
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.moe_intermediate_size,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.norm_eps,
        rope_parameters=dict(config.rope_parameters),
        attention_bias=config.attention_bias,
        attention_dropout=config.attention_dropout,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=config.output_router_logits,
    )
    return kwargs


register(
    Family(
        name="olmoe",
        config_class=OlmoeConfig,
        classes={"base": OlmoeModel, "causal_lm": OlmoeForCausalLM},
        hf_prefix="model.",
        base_rules=MOE_RULES + LLAMA_BASE_RULES,
        head_rules={"causal_lm": LLAMA_HEAD_RULES["causal_lm"]},
        config_from_hf=_olmoe_from_hf,
        blockers=_olmoe_blockers,
        config_to_hf=_olmoe_to_hf,
        moe=True,
    )
)
