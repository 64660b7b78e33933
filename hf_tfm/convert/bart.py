"""BART and mBART: learned positions behind an offset of 2, embedding LayerNorm, GELU MLP, biases everywhere.

BART is post-norm; mBART is the same stack pre-norm, with a final LayerNorm after each side. `final_logits_bias` (a
buffer of shape (1, vocab)) is the LM head's bias. The layer names here are fairseq's, which Marian shares
(`marian.py` reuses `SEQ2SEQ_RULES` and the bias moves).
"""

import math

from transformers.utils import logging

from ..checks import need, need_all, need_default_head_dim, need_full_attention, need_no_gqa
from ..configuration import TfmConfig, TfmSeq2SeqConfig
from .core import Family, Rule, common_blockers, in_tree_classes, register, same_on_both_sides, side_blockers

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
# The fairseq block's fixed knobs on both sides: an import sets them, an export needs them (checked in this order)
FAIRSEQ_BLOCK = {
    "norm_type": "layernorm",
    "norm_bias": True,
    "norm_eps": NORM_EPS,
    "ffn_type": "mlp",
    "mlp_bias": True,
    "attention_bias": True,
    "attention_out_bias": True,
}
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
        **FAIRSEQ_BLOCK,
        "hidden_act": c.activation_function,
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
    need_all(side, out, family, FAIRSEQ_BLOCK)
    need_no_gqa(side, out, family)
    need_default_head_dim(side, out, family)
    need_full_attention(side, out, family)
    need(side, out, family, "type_vocab_size", 0)
    scaled = math.sqrt(side.hidden_size)
    need(side, out, family, "embedding_scale", lambda v: v in (1.0, scaled), f"1.0 or sqrt(hidden_size)={scaled}")


def stack_blockers(side: TfmConfig, out: list[str], family: str, head: str, positions: dict, final_norm: bool) -> None:
    """One side of a fairseq model: its `positions` and norm placement, the shared block, the common knobs."""
    need_all(side, out, family, positions)
    block_blockers(side, out, family)
    common_blockers(side, family, out, head, final_norm=final_norm)


def _positions(name: str) -> dict:
    """Learned positions behind an offset of 2, a norm after the embeddings; mBART pre-norm, BART post-norm."""
    norm = "pre" if name == "mbart" else "post"
    return {"position_embedding_type": "learned", "position_offset": 2, "embedding_norm": True, "norm_position": norm}


def _bart_from_hf(c, head: str, name: str) -> dict:
    warn_unmapped_dropout(c, name)
    common = {"vocab_size": c.vocab_size, **_positions(name), "final_norm": name == "mbart"}
    # BART ties all its token tables or none (`tie_word_embeddings`).
    tied = c.tie_word_embeddings
    return {**sides_from_hf(c, common), "share_encoder_decoder_embeddings": tied, "tie_word_embeddings": tied}


def _bart_blockers(config: TfmSeq2SeqConfig, head: str, name: str) -> list[str]:
    def check(side: TfmConfig, out: list[str]) -> None:
        stack_blockers(side, out, name, head, _positions(name), final_norm=name == "mbart")

    out = side_blockers(config, check)
    same_on_both_sides(config, out, name, (*ONE_FIELD_KNOBS, "embedding_scale"))
    need(config, out, name, "share_encoder_decoder_embeddings", config.tie_word_embeddings, "= tie_word_embeddings")
    return out


def _bart_to_hf(config: TfmSeq2SeqConfig, head: str) -> dict:
    return sides_to_hf(config)


def _bart_family(name: str, prefix: str) -> Family:
    return Family(
        name=name,
        classes=in_tree_classes(prefix, ("seq2seq", "seq2seq_lm")),
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
    _bart_family("bart", "Bart"),
    _bart_family("mbart", "MBart"),
)
