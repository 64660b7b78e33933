"""Named TfmConfig presets for `hf-tfm --config NAME`: a few useful starting points, not a zoo.

Each preset is a dict of `TfmConfig` fields (an encoder-decoder's: one dict per side); `load_config` turns a preset
name or a JSON file into a config and applies overrides (the tokenizer's vocabulary size and special ids, for
example). `vocab_size` in a preset is only a placeholder: the training commands set it from the tokenizer.
"""

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from .configuration import TfmConfig, TfmSeq2SeqConfig, upgrade_saved_config

_LLAMA = {"position_embedding_type": "rope", "norm_type": "rmsnorm", "ffn_type": "glu", "hidden_act": "silu"}
_GPT2 = {
    "position_embedding_type": "learned",
    "norm_type": "layernorm",
    "ffn_type": "mlp",
    "hidden_act": "gelu_new",
    "attention_bias": True,
    "mlp_bias": True,
    "norm_eps": 1e-5,
}
_BERT = {
    "is_causal": False,
    "position_embedding_type": "learned",
    "norm_type": "layernorm",
    "norm_position": "post",
    "embedding_norm": True,
    "ffn_type": "mlp",
    "hidden_act": "gelu",
    "attention_bias": True,
    "mlp_bias": True,
    "norm_eps": 1e-12,
    "type_vocab_size": 2,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
}

# "Attention Is All You Need": sinusoidal positions, post-norm LayerNorm, ReLU MLP with biases, dropout 0.1, token
# embeddings scaled by sqrt(d_model) and shared by both sides and the output layer.
_PAPER = {
    "position_embedding_type": "sinusoidal",
    "norm_type": "layernorm",
    "norm_eps": 1e-5,
    "norm_position": "post",
    "ffn_type": "mlp",
    "hidden_act": "relu",
    "attention_bias": True,
    "mlp_bias": True,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
}


def _seq2seq(encoder: dict[str, Any], decoder_layers: int | None = None) -> dict[str, Any]:
    """An encoder-decoder preset: the decoder is built like the encoder (`decoder_layers` deep)."""
    layers = decoder_layers or encoder["num_hidden_layers"]
    return {"encoder": encoder, "decoder": {**encoder, "num_hidden_layers": layers}}


PRESETS: dict[str, dict[str, Any]] = {
    # decoders
    "tiny-decoder": {**_LLAMA, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
    "small-decoder": {
        **_LLAMA,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "llama-style": {
        **_LLAMA,
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
    },
    # small-decoder's shape with 8 experts per layer, top-2, each half its dense width: the same active FFN compute
    # per token and about 3x the parameters. `output_router_logits`: training adds the load-balancing loss.
    "small-moe": {
        **_LLAMA,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 352,
        "output_router_logits": True,
    },
    "gpt2-style": {
        **_GPT2,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 1024,
    },
    # encoders
    "tiny-encoder": {
        **_LLAMA,
        "is_causal": False,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "classifier_pooling": "mean",
    },
    "small-encoder": {
        **_LLAMA,
        "is_causal": False,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "classifier_pooling": "mean",
    },
    "bert-style": {
        **_BERT,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 512,
    },
    # encoder-decoders (TfmSeq2SeqConfig)
    "tiny-seq2seq": _seq2seq({**_LLAMA, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}),
    "small-seq2seq": _seq2seq(
        {**_LLAMA, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2},
        decoder_layers=2,
    ),
    "transformer-base": _seq2seq(
        {
            **_PAPER,
            "hidden_size": 512,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "intermediate_size": 2048,
            "embedding_scale": 512**0.5,
        }
    ),
}


def load_config(name_or_path: str | os.PathLike, **overrides: Any) -> TfmConfig | TfmSeq2SeqConfig:
    """A config from a preset name, a JSON file, or a model folder holding `config.json`; `overrides` win.

    Encoder-decoder presets and files give a `TfmSeq2SeqConfig`; there the overrides apply to both sides (the
    tokenizer's vocabulary and special ids are both sides'), except its own fields (`decoder_start_token_id`, ...).
    Raises `ValueError` with the list of presets when the name is neither a preset nor an existing file.
    """
    key = str(name_or_path)
    if key in PRESETS:
        fields: dict[str, Any] = copy.deepcopy(PRESETS[key])
    else:
        path = Path(key)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"unknown config {key!r}: not a preset ({', '.join(PRESETS)}) and not a JSON file")
        try:
            fields = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(fields, dict):
            raise ValueError(f"{path} must hold a JSON object of TfmConfig fields")
        fields = upgrade_saved_config(fields)  # before `transformers_version` goes: it marks a saved config
        model_type = fields.pop("model_type", TfmConfig.model_type)
        if model_type not in (TfmConfig.model_type, TfmSeq2SeqConfig.model_type):
            raise ValueError(f"{path} describes a {model_type!r} model, not {TfmConfig.model_type!r}")
        _drop_saved_keys(fields)
    if "encoder" in fields:
        return _load_seq2seq(fields, overrides)
    return TfmConfig(**_override(fields, overrides))


def _drop_saved_keys(fields: dict[str, Any]) -> None:
    for key in ("architectures", "auto_map", "transformers_version", "dtype", "model_type"):
        fields.pop(key, None)


def _override(fields: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    fields = {**fields, **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        fields.pop("layer_types", None)  # re-derived for the new depth
    return fields


def _load_seq2seq(fields: dict[str, Any], overrides: dict[str, Any]) -> TfmSeq2SeqConfig:
    own = {f.name for f in dataclasses.fields(TfmSeq2SeqConfig)} - {f.name for f in dataclasses.fields(TfmConfig)}
    side_overrides = {k: v for k, v in overrides.items() if k not in own}
    top = {k: v for k, v in fields.items() if k not in ("encoder", "decoder")}
    top.update({k: v for k, v in overrides.items() if k in own or k.endswith("_token_id")})
    sides = {}
    for side in ("encoder", "decoder"):
        side_fields = dict(fields[side])
        _drop_saved_keys(side_fields)
        sides[side] = _override(side_fields, side_overrides)
    return TfmSeq2SeqConfig(**top, **sides)


__all__ = ["PRESETS", "load_config"]
