"""Mixtral: Mistral's block (RoPE, RMSNorm, GQA, optional sliding window on every layer) with a sparse mixture of
SwiGLU experts in every layer: top-k of the softmax, always renormalised, routing weights kept in fp32."""

from ..checks import need, need_all
from ..configuration import TfmConfig
from .core import DECODER_HEADS, common_blockers, last_token_head_blockers, moe_blockers, register
from .fields import last_token_classifier, moe_fields, token_dropout_to_hf
from .llama_like import MOE_BLOCK, llama_style_from_hf, llama_style_to_hf, moe_family

# Mixtral's `intermediate_size` is each expert's width
MIXTRAL_FIELDS = {
    "moe_intermediate_size": "intermediate_size",
    "sliding_window": "sliding_window",
    **moe_fields("num_local_experts"),
    "router_jitter_noise": "router_jitter_noise",
}


def _mixtral_from_hf(c, head: str) -> dict:
    kwargs = llama_style_from_hf(c, MIXTRAL_FIELDS) | last_token_classifier(c, head)
    kwargs.update(
        intermediate_size=c.intermediate_size,
        head_dim=c.head_dim or c.hidden_size // c.num_attention_heads,
        attention_bias=False,
        mlp_bias=False,
        norm_topk_prob=True,
        router_weights_fp32=True,
    )
    return kwargs


def _mixtral_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "mixtral"
    need_all(config, out, name, {**MOE_BLOCK, "attention_bias": False, "attention_out_bias": False})
    common_blockers(config, name, out, head, hidden_dropout=False)
    kinds = set(config.layer_types)
    need(config, out, name, "layer_types", lambda v: len(kinds) == 1, "one kind for every layer (`sliding_window`)")
    moe_blockers(config, name, out, norm_topk_prob=True, router_weights_fp32=True, jitter=True)
    last_token_head_blockers(config, head, name, out)
    return out


def _mixtral_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = llama_style_to_hf(config, MIXTRAL_FIELDS) | token_dropout_to_hf(config, head)
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        kwargs["head_dim"] = config.head_dim  # MixtralConfig keeps None for the default
    return kwargs


register(
    moe_family(
        "mixtral",
        "Mixtral",
        DECODER_HEADS,
        config_from_hf=_mixtral_from_hf,
        blockers=_mixtral_blockers,
        config_to_hf=_mixtral_to_hf,
    )
)
