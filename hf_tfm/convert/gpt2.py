"""GPT-2: learned positions, LayerNorm with bias, GELU MLP, biases everywhere, Conv1D (in, out) weights, fused qkv."""

import transformers
from transformers.utils import logging

from ..checks import need_all, need_default_head_dim, need_full_attention, need_no_gqa
from ..configuration import TfmConfig
from .core import (
    DECODER_HEADS,
    Family,
    Fused,
    Rule,
    common_blockers,
    in_tree_classes,
    last_token_head_blockers,
    register,
)
from .fields import knobs_from_hf, knobs_to_hf, last_token_classifier, sizes, token_dropout_to_hf

logger = logging.get_logger(__name__)

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
# GPT-2's c_attn (Conv1D: weight (in, 3*out), bias (3*out)) holds q/k/v, all queries first
C_ATTN = Fused(r".*h\.\d+\.", {"attn.c_attn": ("attn.q_proj", "attn.k_proj", "attn.v_proj")}, conv1d=True)


# The block's fixed knobs: an import sets them, an export needs them (checked in this order)
GPT2_BLOCK = {
    "is_causal": True,
    "position_embedding_type": "learned",
    "norm_type": "layernorm",
    "norm_bias": True,
    "norm_position": "pre",
    "ffn_type": "mlp",
    "mlp_bias": True,
    "attention_bias": True,
    "attention_out_bias": True,
}
# hf_tfm knob -> GPT2Config attribute (`resid_pdrop` also gives `embd_pdrop` on export)
GPT2_FIELDS = {
    "hidden_act": "activation_function",
    "norm_eps": "layer_norm_epsilon",
    "attention_dropout": "attn_pdrop",
    "hidden_dropout": "resid_pdrop",
}
# Sizes GPT2Config takes under its own names on export
GPT2_SIZES = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "n_positions",
}


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
    kwargs = {**sizes(c), **GPT2_BLOCK, **knobs_from_hf(c, GPT2_FIELDS), **last_token_classifier(c, head)}
    kwargs["intermediate_size"] = c.n_inner or 4 * c.hidden_size
    return kwargs


def _gpt2_blockers(config: TfmConfig, head: str) -> list[str]:
    out: list[str] = []
    name = "gpt2"
    need_all(config, out, name, GPT2_BLOCK)
    need_no_gqa(config, out, name)
    need_default_head_dim(config, out, name)
    need_full_attention(config, out, name)
    need_all(config, out, name, {"embedding_norm": False, "type_vocab_size": 0})
    common_blockers(config, name, out, head)
    last_token_head_blockers(config, head, name, out)
    return out


def _gpt2_to_hf(config: TfmConfig, head: str) -> dict:
    kwargs = {GPT2_SIZES.get(knob, knob): value for knob, value in sizes(config).items()}
    kwargs.update(
        knobs_to_hf(config, GPT2_FIELDS), embd_pdrop=config.hidden_dropout, **token_dropout_to_hf(config, head)
    )
    kwargs["n_inner"] = None if config.intermediate_size == 4 * config.hidden_size else config.intermediate_size
    return kwargs


register(
    Family(
        name="gpt2",
        classes=in_tree_classes("GPT2", DECODER_HEADS, causal_lm=transformers.GPT2LMHeadModel),
        base_rules=GPT2_BASE_RULES,
        head_rules=GPT2_HEAD_RULES,
        config_from_hf=_gpt2_from_hf,
        blockers=_gpt2_blockers,
        config_to_hf=_gpt2_to_hf,
        split_state=C_ATTN.split,
        fuse_state=C_ATTN.fuse,
    )
)
