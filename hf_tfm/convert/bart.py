"""BART and mBART: learned positions behind an offset of 2, embedding LayerNorm, GELU MLP, biases everywhere.

BART is post-norm; mBART is the same stack pre-norm, with a final LayerNorm after each side. `final_logits_bias` (a
buffer of shape (1, vocab)) is the LM head's bias. The layer names here are fairseq's, which Marian shares
(`marian.py` reuses `SEQ2SEQ_RULES` and the bias moves).
"""

import math

from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BartModel,
    MBartConfig,
    MBartForConditionalGeneration,
    MBartModel,
)
from transformers.utils import logging

from ..configuration import TfmConfig, TfmSeq2SeqConfig
from .core import Family, Rule, common_blockers, need, register, same_on_both_sides, side_blockers

logger = logging.get_logger(__name__)

_PROJECTIONS = [("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("o_proj", "out_proj")]
SEQ2SEQ_RULES = [  # `{n}` is the side: encoder or decoder
    Rule("{n}.embed_tokens.weight", "{n}.embed_tokens.weight"),
    Rule("{n}.embed_positions.weight", "{n}.embed_positions.weight"),
    Rule("{n}.embed_norm.{p}", "{n}.layernorm_embedding.{p}"),
    Rule("{n}.norm.{p}", "{n}.layer_norm.{p}"),
    *(
        Rule(f"{{n}}.layers.{{i}}.{attn}.{ours}.{{p}}", f"{{n}}.layers.{{i}}.{attn}.{theirs}.{{p}}")
        for attn in ("self_attn", "encoder_attn")
        for ours, theirs in _PROJECTIONS
    ),
    Rule("{n}.layers.{i}.attn_norm.{p}", "{n}.layers.{i}.self_attn_layer_norm.{p}"),
    Rule("{n}.layers.{i}.cross_attn_norm.{p}", "{n}.layers.{i}.encoder_attn_layer_norm.{p}"),
    Rule("{n}.layers.{i}.mlp.up_proj.{p}", "{n}.layers.{i}.fc1.{p}"),
    Rule("{n}.layers.{i}.mlp.down_proj.{p}", "{n}.layers.{i}.fc2.{p}"),
    Rule("{n}.layers.{i}.mlp_norm.{p}", "{n}.layers.{i}.final_layer_norm.{p}"),
]
SEQ2SEQ_HEAD_RULES = {"seq2seq_lm": [Rule("lm_head.{p}", "lm_head.{p}")]}
# `shared` is the table both sides read when they share one; hf_tfm keeps it as the encoder's.
SHARED_ALIASES = {
    "model.shared.weight": "model.encoder.embed_tokens.weight",
    "shared.weight": "encoder.embed_tokens.weight",
}
NORM_EPS = 1e-5  # BART, mBART and Marian build nn.LayerNorm with its default eps
# Fields the in-tree configs hold once for both sides.
ONE_FIELD_KNOBS = ("vocab_size", "max_position_embeddings", "hidden_act", "hidden_dropout", "attention_dropout")


def bias_from_hf(state: dict) -> dict:
    """`final_logits_bias` (1, vocab) is the LM head's bias (vocab)."""
    if "final_logits_bias" in state:
        state = {**state, "lm_head.bias": state["final_logits_bias"][0]}
        del state["final_logits_bias"]
    return state


def bias_to_hf(state: dict) -> dict:
    if "lm_head.bias" in state:  # without one, the in-tree class keeps its zero buffer
        state = {**state, "final_logits_bias": state["lm_head.bias"][None]}
        del state["lm_head.bias"]
    return state


def warn_unmapped_dropout(c, family: str) -> None:
    """Dropout hf_tfm has no place for: it changes training only (the parity checks run in eval)."""
    for knob in ("activation_dropout", "encoder_layerdrop", "decoder_layerdrop"):
        if getattr(c, knob, 0):
            logger.warning(f"{family} `{knob}`={getattr(c, knob)} has no hf_tfm equivalent and is dropped.")


def sides_from_hf(c, common: dict) -> dict:
    """TfmSeq2SeqConfig kwargs from an in-tree config with `encoder_*` / `decoder_*` sizes and `common` block knobs."""
    common = {
        **common,
        "hidden_size": c.d_model,
        "max_position_embeddings": c.max_position_embeddings,
        "embedding_scale": math.sqrt(c.d_model) if c.scale_embedding else 1.0,
        "norm_type": "layernorm",
        "norm_eps": NORM_EPS,
        "norm_bias": True,
        "ffn_type": "mlp",
        "hidden_act": c.activation_function,
        "mlp_bias": True,
        "attention_bias": True,
        "attention_out_bias": True,
        "attention_dropout": float(c.attention_dropout),
        "hidden_dropout": float(c.dropout),
        "initializer_range": c.init_std,
        "pad_token_id": c.pad_token_id,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "use_cache": c.use_cache,
    }
    side = {
        side: {
            **common,
            "num_hidden_layers": getattr(c, f"{side}_layers"),
            "num_attention_heads": getattr(c, f"{side}_attention_heads"),
            "intermediate_size": getattr(c, f"{side}_ffn_dim"),
        }
        for side in ("encoder", "decoder")
    }
    side["decoder"]["lm_head_bias"] = True  # `final_logits_bias`
    return {
        **side,
        "decoder_start_token_id": c.decoder_start_token_id,
        "pad_token_id": c.pad_token_id,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
    }


def sides_to_hf(config: TfmSeq2SeqConfig) -> dict:
    enc, dec = config.encoder, config.decoder
    return {
        "vocab_size": enc.vocab_size,
        "d_model": enc.hidden_size,
        "max_position_embeddings": enc.max_position_embeddings,
        **{
            f"{name}_{field}": getattr(side, knob)
            for name, side in (("encoder", enc), ("decoder", dec))
            for field, knob in (
                ("layers", "num_hidden_layers"),
                ("attention_heads", "num_attention_heads"),
                ("ffn_dim", "intermediate_size"),
            )
        },
        "activation_function": enc.hidden_act,
        "dropout": enc.hidden_dropout,
        "attention_dropout": enc.attention_dropout,
        "init_std": dec.initializer_range,
        "scale_embedding": enc.embedding_scale != 1.0,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "decoder_start_token_id": config.decoder_start_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
        "use_cache": dec.use_cache,
    }


def block_blockers(side: TfmConfig, out: list[str], family: str) -> None:
    """The fairseq block all three families share: LayerNorm (eps 1e-5), GELU-family MLP, biases, no GQA."""
    need(side, out, family, "norm_type", "layernorm")
    need(side, out, family, "norm_bias", True)
    need(side, out, family, "norm_eps", NORM_EPS)
    need(side, out, family, "ffn_type", "mlp")
    need(side, out, family, "mlp_bias", True)
    need(side, out, family, "attention_bias", True)
    need(side, out, family, "attention_out_bias", True)
    need(side, out, family, "num_key_value_heads", side.num_attention_heads, "`num_attention_heads` (no GQA)")
    need(side, out, family, "head_dim", side.hidden_size // side.num_attention_heads, "hidden/heads")
    need(side, out, family, "layer_types", lambda v: set(v) == {"full_attention"}, "only 'full_attention'")
    need(side, out, family, "type_vocab_size", 0)
    scaled = math.sqrt(side.hidden_size)
    need(side, out, family, "embedding_scale", lambda v: v in (1.0, scaled), f"1.0 or sqrt(hidden_size)={scaled}")


def _bart_from_hf(c, head: str, name: str) -> dict:
    warn_unmapped_dropout(c, name)
    pre = name == "mbart"
    common = {
        "vocab_size": c.vocab_size,
        "position_embedding_type": "learned",
        "position_offset": 2,
        "embedding_norm": True,
        "norm_position": "pre" if pre else "post",
        "final_norm": pre,
    }
    # BART ties all its token tables or none (`tie_word_embeddings`).
    tied = c.tie_word_embeddings
    return {**sides_from_hf(c, common), "share_encoder_decoder_embeddings": tied, "tie_word_embeddings": tied}


def _bart_blockers(config: TfmSeq2SeqConfig, head: str, name: str) -> list[str]:
    pre = name == "mbart"

    def check(side: TfmConfig, out: list[str]) -> None:
        need(side, out, name, "position_embedding_type", "learned")
        need(side, out, name, "position_offset", 2)
        need(side, out, name, "embedding_norm", True)
        need(side, out, name, "norm_position", "pre" if pre else "post")
        block_blockers(side, out, name)
        common_blockers(side, name, out, head, final_norm=pre)

    out = side_blockers(config, check)
    same_on_both_sides(config, out, name, (*ONE_FIELD_KNOBS, "embedding_scale"))
    need(config, out, name, "share_encoder_decoder_embeddings", config.tie_word_embeddings, "= tie_word_embeddings")
    return out


def _bart_to_hf(config: TfmSeq2SeqConfig, head: str) -> dict:
    return sides_to_hf(config)


def _bart_family(name: str, config_class, backbone, lm) -> Family:
    return Family(
        name=name,
        config_class=config_class,
        classes={"seq2seq": backbone, "seq2seq_lm": lm},
        hf_prefix="model.",
        base_rules=SEQ2SEQ_RULES,
        head_rules=SEQ2SEQ_HEAD_RULES,
        config_from_hf=lambda c, head: _bart_from_hf(c, head, name),
        blockers=lambda config, head: _bart_blockers(config, head, name),
        config_to_hf=_bart_to_hf,
        hf_aliases=SHARED_ALIASES,
        split_state=bias_from_hf,
        fuse_state=bias_to_hf,
        seq2seq=True,
    )


register(
    _bart_family("bart", BartConfig, BartModel, BartForConditionalGeneration),
    _bart_family("mbart", MBartConfig, MBartModel, MBartForConditionalGeneration),
)
