"""Qwen2-MoE: Qwen2's block (q/k/v bias, none on o_proj, optional sliding layers) with routed SwiGLU experts of
`moe_intermediate_size` plus a sigmoid-gated shared expert; `mlp_only_layers` and `decoder_sparse_step` keep some
layers dense (of `intermediate_size`). Top-k of the softmax, renormalised if `norm_topk_prob`."""

from ..checks import need_all, need_default_head_dim
from ..configuration import TfmConfig
from .core import DECODER_HEADS, common_blockers, last_token_head_blockers, moe_blockers, register
from .fields import last_token_classifier, moe_fields, token_dropout_to_hf
from .llama_like import MOE_BLOCK, llama_style_from_hf, llama_style_to_hf, moe_family

QWEN2_MOE_FIELDS = {
    "intermediate_size": "intermediate_size",
    "attention_bias": "qkv_bias",
    **moe_fields("num_experts"),
    "moe_intermediate_size": "moe_intermediate_size",
    "shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
    "decoder_sparse_step": "decoder_sparse_step",
}


def _qwen2_moe_from_hf(c, head: str) -> dict:
    if c.num_experts == 0:  # Qwen2MoeDecoderLayer then builds dense layers only
        raise ValueError("Qwen2-MoE with `num_experts=0` is dense: import it as a Qwen2 model instead.")
    sliding = c.use_sliding_window and "sliding_attention" in c.layer_types
    kwargs = llama_style_from_hf(c, QWEN2_MOE_FIELDS) | last_token_classifier(c, head)
    kwargs.update(
        attention_out_bias=False,
        mlp_bias=False,
        sliding_window=c.sliding_window if sliding else None,
        layer_types=list(c.layer_types) if sliding else None,
        mlp_only_layers=list(c.mlp_only_layers) or None,
    )
    return kwargs


def _qwen2_moe_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "qwen2_moe"
    need_all(config, out, name, {**MOE_BLOCK, "attention_out_bias": False})
    need_default_head_dim(config, out, name, why=None)
    common_blockers(config, name, out, head, hidden_dropout=False)
    moe_blockers(config, name, out, shared_expert=True, sparse_layer_rule=True)
    last_token_head_blockers(config, head, name, out)
    return out


def _qwen2_moe_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = llama_style_to_hf(config, QWEN2_MOE_FIELDS) | token_dropout_to_hf(config, head)
    kwargs["mlp_only_layers"] = list(config.mlp_only_layers or [])
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
    moe_family(
        "qwen2_moe",
        "Qwen2Moe",
        DECODER_HEADS,
        config_from_hf=_qwen2_moe_from_hf,
        blockers=_qwen2_moe_blockers,
        config_to_hf=_qwen2_moe_to_hf,
    )
)
