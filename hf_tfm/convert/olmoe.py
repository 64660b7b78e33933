"""OLMoE: a Llama-style block whose q/k norms (RMSNorm) span the whole q and k projections, with SwiGLU experts of
`intermediate_size` in every layer; top-k of the softmax, renormalised if `norm_topk_prob`."""

from ..checks import need, need_all, need_default_head_dim, need_full_attention
from ..configuration import TfmConfig
from .core import common_blockers, moe_blockers, register
from .fields import moe_fields
from .llama_like import MOE_BLOCK, llama_style_from_hf, llama_style_to_hf, moe_family

# OLMoE's `intermediate_size` is each expert's width
OLMOE_FIELDS = {
    "moe_intermediate_size": "intermediate_size",
    "attention_bias": "attention_bias",
    **moe_fields("num_experts"),
    "norm_topk_prob": "norm_topk_prob",
}


def _olmoe_from_hf(c, head: str) -> dict:
    if c.clip_qkv is not None:
        raise ValueError(f"OLMoE with `clip_qkv={c.clip_qkv}` has no hf_tfm equivalent (q/k/v are never clamped).")
    # q/k norms over whole projections; the dense width (no layer has one) kept as the experts'
    own = {"qk_norm": True, "qk_norm_scope": "projection", "intermediate_size": c.intermediate_size}
    return llama_style_from_hf(c, OLMOE_FIELDS) | own | {"attention_out_bias": c.attention_bias, "mlp_bias": False}


def _olmoe_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "olmoe"
    need_all(config, out, name, MOE_BLOCK)
    need(config, out, name, "attention_out_bias", config.attention_bias, "the same value as `attention_bias`")
    need_default_head_dim(config, out, name, why=None)
    need_full_attention(config, out, name)
    common_blockers(config, name, out, head, hidden_dropout=False, qk_norm_scope="projection")
    moe_blockers(config, name, out)
    if head not in ("base", "causal_lm"):
        out.append(f"head `{head}` ({name} has base and causal-LM classes only)")
    return out


register(
    moe_family(
        "olmoe",
        "Olmoe",
        ("base", "causal_lm"),
        config_from_hf=_olmoe_from_hf,
        blockers=_olmoe_blockers,
        config_to_hf=lambda config, head: llama_style_to_hf(config, OLMOE_FIELDS),
    )
)
