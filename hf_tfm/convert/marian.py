"""Marian (MarianMTModel): fairseq's block (see `bart.py`) with sinusoidal positions and scaled embeddings.

The sinusoid is the `halves` layout (all sines, then all cosines), which Marian computes itself and never saves: on
import it is checked against hf_tfm's formula and dropped, on export the in-tree class builds its own. Marian can keep
separate encoder and decoder vocabularies (`share_encoder_decoder_embeddings=False`, `decoder_vocab_size`).
"""

import re

import torch
import transformers

from ..checks import need
from ..configuration import TfmConfig, TfmSeq2SeqConfig
from ..modeling import TfmSinusoidalEmbedding
from .bart import (
    ONE_FIELD_KNOBS,
    SEQ2SEQ_HEAD_RULES,
    SEQ2SEQ_RULES,
    SHARED_ALIASES,
    bias_from_hf,
    bias_to_hf,
    sides_from_hf,
    sides_to_hf,
    stack_blockers,
    warn_unmapped_dropout,
)
from .core import Family, in_tree_classes, register, same_on_both_sides, side_blockers

_POSITIONS = re.compile(r"(model\.)?(encoder|decoder)\.embed_positions\.weight")
# Its sinusoid (all sines, then all cosines), post-norm, no norm after the embeddings
MARIAN_POSITIONS = {
    "position_embedding_type": "sinusoidal",
    "sinusoidal_layout": "halves",
    "embedding_norm": False,
    "norm_position": "post",
}
# Marian builds its table in float64 and stores it in float32; hf_tfm computes in float32: they differ by ~1e-7 x pos.
SINUSOID_ATOL = 1e-5


def _marian_split(state: dict) -> dict:
    state = bias_from_hf(state)
    for key in [k for k in state if _POSITIONS.fullmatch(k)]:
        table = state.pop(key).float()
        length, dim = table.shape
        ours = TfmSinusoidalEmbedding(
            TfmConfig(
                hidden_size=dim,
                num_attention_heads=1,
                position_embedding_type="sinusoidal",
                sinusoidal_layout="halves",
            )
        )
        expected = ours(torch.arange(length)[None], torch.float32)[0]
        if not torch.allclose(table, expected, atol=SINUSOID_ATOL * max(1, length / 512), rtol=0):
            raise ValueError(
                f"Marian `{key}` is not the sinusoid hf_tfm computes (was it trained?): no hf_tfm equivalent."
            )
    return state


def _marian_from_hf(c, head: str) -> dict:
    warn_unmapped_dropout(c, "marian")
    # Marian ties its tables only with `tie_word_embeddings` (then all of them, shared or not): untied, both sides
    # read their own table even with `share_encoder_decoder_embeddings`.
    share = c.share_encoder_decoder_embeddings and c.tie_word_embeddings
    kwargs = sides_from_hf(c, {**MARIAN_POSITIONS, "final_norm": False})
    kwargs["encoder"]["vocab_size"] = c.vocab_size
    kwargs["decoder"]["vocab_size"] = c.vocab_size if c.share_encoder_decoder_embeddings else c.decoder_vocab_size
    return {**kwargs, "share_encoder_decoder_embeddings": share, "tie_word_embeddings": c.tie_word_embeddings}


def _marian_blockers(config: TfmSeq2SeqConfig, head: str) -> list[str]:
    name = "marian"

    def check(side: TfmConfig, out: list[str]) -> None:
        stack_blockers(side, out, name, head, MARIAN_POSITIONS, final_norm=False)

    out = side_blockers(config, check)
    one_field = tuple(k for k in ONE_FIELD_KNOBS if k != "vocab_size")  # Marian has `decoder_vocab_size`
    same_on_both_sides(config, out, name, (*one_field, "embedding_scale"))
    if config.share_encoder_decoder_embeddings:  # Marian shares its table only when it ties the head to it too
        need(config, out, name, "tie_word_embeddings", True, "True with `share_encoder_decoder_embeddings`")
    return out


def _marian_to_hf(config: TfmSeq2SeqConfig, head: str) -> dict:
    share = config.share_encoder_decoder_embeddings
    return {
        **sides_to_hf(config),
        "share_encoder_decoder_embeddings": share,
        "decoder_vocab_size": config.decoder.vocab_size,
    }


register(
    Family(
        name="marian",
        classes=in_tree_classes("Marian", ("seq2seq", "seq2seq_lm"), seq2seq_lm=transformers.MarianMTModel),
        base_rules=[r for r in SEQ2SEQ_RULES if "embed_positions" not in r.tfm],
        head_rules=SEQ2SEQ_HEAD_RULES,
        config_from_hf=_marian_from_hf,
        blockers=_marian_blockers,
        config_to_hf=_marian_to_hf,
        hf_aliases=SHARED_ALIASES,
        split_state=_marian_split,
        fuse_state=bias_to_hf,
        seq2seq=True,
    )
)
