"""CTranslate2 model folders for hf_tfm causal LMs and encoder-decoders, their spec built from `TfmConfig` +
`state_dict` (no in-tree family, no `to_hf`, no transformers converter).

A causal LM (`TfmForCausalLM`) is written as a `TransformerDecoderModelSpec` for `ctranslate2.Generator`, an
encoder-decoder (`TfmForConditionalGeneration`) as a `TransformerSpec` for `ctranslate2.Translator`, an encoder's
backbone (`TfmModel`, `is_causal=False`: features, and BERT's pooler when it has one) as a
`TransformerEncoderModelSpec` for `ctranslate2.Encoder`; a config whose knobs CTranslate2 does not compute exactly is
refused with a `ValueError` naming every one. What maps to what, on
either stack:

* `norm_position`: pre-norm, or post-norm (the spec's `pre_norm=False`: each sub-layer's norm after its residual sum,
  as hf_tfm's); `final_norm` is the stack's `layer_norm` (after post-norm layers too), `embedding_norm` its
  `layernorm_embedding`. `norm_type`: CTranslate2 picks the norm per weight (a `beta` makes a LayerNorm, none an
  RMSNorm), so a LayerNorm without `norm_bias` gets a zero beta; `norm_eps` is the model's one `layer_norm_epsilon`.
* `ffn_type`: "glu" is `ffn_glu` (`linear_0` the gate, `linear_0_noact` the up projection), "mlp" the plain FFN;
  `hidden_act`: silu/swish -> SWISH, gelu/gelu_python -> GELU (erf), gelu_new/gelu_pytorch_tanh/gelu_fast ->
  GELUTanh, quick_gelu -> GELUSigmoid (x * sigmoid(1.702 x)), relu -> RELU; any other is refused.
* Positions: `rope` is `rotary_dim=0` (every dimension) with `rotary_interleave=False` (hf_tfm's rotate-half halves,
  no q/k permutation), `rotary_base` = `rope_theta`, linear and llama3 scaling (the llama3 factor is written on
  each layer: the spec leaves it out and CTranslate2 would then use 1); `alibi` (decoders) uses CTranslate2's slopes,
  which are hf_tfm's (the paper's, interleaved for a head count that is not a power of 2), added after the 1/sqrt(d)
  scaling; `learned` writes the table from row `position_offset` on; `sinusoidal` writes hf_tfm's own table (either
  layout) for `max_position_embeddings` positions: CTranslate2's built-in sinusoid is tensor2tensor's (positions
  from 1, another frequency ladder), not hf_tfm's.
* Attention: `num_key_value_heads` -> `num_heads_kv`, `head_dim`, q/k/v fused into one projection (k/v into one for
  cross-attention; biases with `attention_bias`, the output projection's with `attention_out_bias`), `qk_norm` (head
  scope, the model's norm type) -> `q_norm` / `k_norm` before RoPE; a decoder's cross-attention with its norm.
* `parallel_residual` (decoders) -> `input_layer_norm` / `post_attention_layer_norm` (x + attn(n1(x)) + ffn(n2(x))).
* `embedding_scale` -> `scale_embeddings` (any value: CTranslate2 multiplies by the stored number); the head reads the
  unscaled table, tied or not (`projection`), with `lm_head_bias`. Token-type embeddings (`type_vocab_size`, row 0
  everywhere: a decoder's, or an encoder given no types) are folded into the position table, or into an untied token
  table when there is none and `embedding_scale` is 1. A standalone encoder keeps its token-type table as a second
  source embedding, added (`token_type_ids` in `Encoder.forward_batch`, as CTranslate2's BERT). The pooler
  (`add_pooling_layer`) is the spec's `pooler_dense` + activation on the first token. Encoder and decoder tables,
  shared or not, are written once each (CTranslate2 aliases equal arrays).

Refused: experts, sliding windows (CTranslate2 prefills a prompt longer than the window in window-sized chunks whose
queries see the whole previous chunk, more than hf_tfm's window, and its `forward_batch` fails on such sequences),
`first_layer_attn_norm=False` (CTranslate2 adds an attention residual only through its norm), q/k norms over the
whole projection, RoPE scalings other than linear and llama3 or on part of the dimensions; a cross-attending
`TfmConfig` alone, and task heads on an encoder (its Encoder returns features and the pooler only); ALiBi or a
parallel residual in an encoder (alone or in an encoder-decoder), a pooler that pools other than the first token or
whose activation CTranslate2 lacks; in an encoder-decoder, `qk_norm` in the decoder (CTranslate2's cross-attention
norms the queries before splitting the heads) and two `norm_eps`.

The tokenizer's vocabulary (in id order, padded to `vocab_size` with unused tokens) is the model's `vocabulary.json`
(encoder-decoders: `shared_vocabulary.json`, or a source and a target one), and its files are copied beside it.
`verify_ctranslate2` runs the folder in a fresh process (no torch there) and compares greedy tokens and logits with
the hf_tfm model.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import staged_folder
from ..checks import need, need_dense, need_full_attention, need_rope
from ..configuration import TfmConfig, TfmSeq2SeqConfig
from ..programs import run_program
from ._common import (
    TOKENIZER_FILES,
    agreement_report,
    encoder_max_diff,
    eos_ids,
    greedy_references,
    other_routes,
    prompt_ids,
)
from .registry import ExportFormat

RUNTIME = "CTranslate2"
SIDE = "ctranslate2_side"  # verification's side (hf_tfm.programs): neither torch nor hf_tfm
# --quantize value -> what CTranslate2's own quantization (`Converter.convert`) does with the weights. Norms, biases
# and position tables stay float32 except in float16 / bfloat16 folders. A CPU without float16 / bfloat16 kernels runs
# those folders as float32 (converted at load); `verify_ctranslate2` reports the type that ran.
TYPES = {
    "float32": "float32 weights (exact)",
    "int8": "int8 weights, one scale per row (runs as int8_float32 on CPUs)",
    "int8_float32": "int8 weights, one scale per row, float32 for the rest",
    "int16": "int16 weights, one scale per tensor (Intel MKL)",
    "float16": "float16 weights and activations",
    "bfloat16": "bfloat16 weights and activations",
}
# hf_tfm `hidden_act` (transformers ACT2FN names) -> the ctranslate2.specs.common_spec.Activation that computes it
ACTIVATIONS = {
    "silu": "SWISH",
    "swish": "SWISH",
    "gelu": "GELU",
    "gelu_python": "GELU",
    "gelu_new": "GELUTanh",
    "gelu_pytorch_tanh": "GELUTanh",
    "gelu_fast": "GELUTanh",
    "quick_gelu": "GELUSigmoid",
    "relu": "RELU",
}
# The pooler's activation (`classifier_activation`): CTranslate2's Activation names
POOLER_ACTIVATIONS = {**ACTIVATIONS, "tanh": "Tanh"}
# RoPE types whose frequencies CTranslate2 computes as transformers does: linear divides positions by the factor,
# llama3 rescales the frequencies once. dynamic, yarn and longrope (CTranslate2's "su" differs) are not computed.
ROPE_TYPES = ("default", "linear", "llama3")
INSTALL_HINT = (
    'CTranslate2 export needs the `ctranslate2` package: pip install ctranslate2 (or pip install "hf-tfm[export]")'
)


def _import_ctranslate2():
    try:
        import ctranslate2
        import ctranslate2.converters
        import ctranslate2.specs
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return ctranslate2


# ---------------------------------------------------------------------------------------------------------------------
# What CTranslate2 computes, or why not


def _stack_blockers(config: TfmConfig, out: list[str], family: str) -> None:
    """What neither CTranslate2 stack (encoder or decoder) computes."""
    need_dense(config, out, family)
    need(config, out, family, "first_layer_attn_norm", True, "True (it adds a residual only through the norm)")
    window = (
        "only 'full_attention' (its sliding window prefills a prompt longer than the window in chunks that see "
        "more than the window)"
    )
    need_full_attention(config, out, family, window)
    acts = list(ACTIVATIONS)
    need(config, out, family, "hidden_act", lambda v: v in ACTIVATIONS, f"one of {acts}")
    if config.qk_norm:
        need(config, out, family, "qk_norm_scope", "head", "'head' (its q/k norms act per head)")
    if config.type_vocab_size > 0 and config.position_embedding_type in ("rope", "alibi"):
        why = "1.0 to fold the token-type row into the token table (no position table to hold it)"
        need(config, out, family, "embedding_scale", 1.0, why)
    if config.position_embedding_type == "rope":
        need_rope(config, out, family, ROPE_TYPES)


def _encoder_blockers(config: TfmConfig, out: list[str]) -> None:
    family = f"{RUNTIME}'s encoder"
    _stack_blockers(config, out, family)
    no_alibi = "no 'alibi' (its encoder has no ALiBi)"
    need(config, out, family, "position_embedding_type", lambda v: v != "alibi", no_alibi)
    need(config, out, family, "parallel_residual", False, "False (its encoder layers are sequential)")


def _seq2seq_blockers(config: TfmSeq2SeqConfig) -> list[str]:
    out: list[str] = []
    _encoder_blockers(config.encoder, out)
    family = f"{RUNTIME}'s decoder"
    _stack_blockers(config.decoder, out, family)
    # Its cross-attention normalises the queries over the whole projection, before splitting the heads.
    need(config.decoder, out, family, "qk_norm", False, "False (its cross-attention norms the queries unsplit)")
    one_eps = f"the encoder's {config.encoder.norm_eps} (one layer_norm_epsilon for the whole model)"
    need(config.decoder, out, family, "norm_eps", config.encoder.norm_eps, one_eps)
    return out


def ctranslate2_blockers(config: TfmConfig | TfmSeq2SeqConfig) -> list[str]:
    """Empty when CTranslate2 computes `config` exactly (a causal LM's as a Generator, an encoder-decoder's as a
    Translator, an encoder's backbone as an Encoder); else every knob that keeps it out (each message names the
    runtime and its stack)."""
    if isinstance(config, TfmSeq2SeqConfig):
        return _seq2seq_blockers(config)
    out: list[str] = []
    if not config.is_causal:
        family = f"{RUNTIME}'s encoder"
        need(config, out, family, "add_cross_attention", False, "False (an encoder alone attends to itself)")
        _encoder_blockers(config, out)
        if config.add_pooling_layer:  # BERT's pooler: the first token -> dense -> activation
            need(config, out, family, "classifier_pooling", "first", "'first' (its pooler reads the first token)")
            acts = list(POOLER_ACTIVATIONS)
            need(config, out, family, "classifier_activation", lambda v: v in POOLER_ACTIVATIONS, f"one of {acts}")
        return out
    family = f"{RUNTIME}'s decoder"
    need(config, out, family, "add_cross_attention", False, "False (a decoder-only language model)")
    _stack_blockers(config, out, family)
    return out


# What a refusal names besides: after an in-tree family, its next step and the other runtimes; else the runtimes
ROUTES = (
    "then CTranslate2's own transformers converter, where it has that family",
    "ONNX through transformers.exporters",
    "ONNX through transformers.exporters traces hf_tfm's own code (every knob).",
)
# The classes it takes -> what runs them; a TfmMoeModel folder is the backbone with experts, a TfmModel
RUNNERS = {"TfmForCausalLM": "a Generator", "TfmForConditionalGeneration": "a Translator", "TfmModel": "an Encoder"}
# The classes whose config must be an encoder's (is_causal=False) -> True, a decoder's -> False
KINDS = {"TfmForCausalLM": False, "TfmModel": True, "TfmMoeModel": True}


def _class_refusal(architecture: str) -> str | None:
    if architecture in (*RUNNERS, "TfmMoeModel"):
        return None
    return f"{RUNTIME} export takes {', '.join(RUNNERS)} models, not {architecture}"


def _wrong_kind(config: TfmConfig | TfmSeq2SeqConfig, architecture: str) -> bool:
    """Whether the config's kind of stack (decoder or encoder) is not the one this class is exported as."""
    if isinstance(config, TfmSeq2SeqConfig) or architecture not in KINDS:  # a Translator's pair: no kind to check
        return False
    return KINDS[architecture] != (not config.is_causal)


def refusal(config: TfmConfig | TfmSeq2SeqConfig, architecture: str) -> str | None:
    """Why a model of this config and class is not exported to CTranslate2 (the class, else every blocking knob), or
    None."""
    if _wrong_kind(config, architecture):
        return f"{RUNTIME} exports a {architecture} only with is_causal={not KINDS[architecture]}"
    return _class_refusal(architecture) or "; ".join(ctranslate2_blockers(config)) or None


def _summary(config: TfmConfig | TfmSeq2SeqConfig, architecture: str) -> str:
    return f"{RUNNERS.get(architecture, RUNNERS['TfmModel'])}, its spec built from the config"


def _require_exact(config: TfmConfig | TfmSeq2SeqConfig, architecture: str) -> None:
    """A `ValueError` naming the class that does not fit the config's kind of stack, or every blocking knob, the
    runtime and the routes that do take the config."""
    if _wrong_kind(config, architecture):
        kind = "an encoder (is_causal=False)" if KINDS[architecture] else "a decoder (is_causal=True)"
        raise ValueError(
            f"{RUNTIME} exports a {architecture} as {kind}; this config has is_causal={config.is_causal}."
        )
    blockers = ctranslate2_blockers(config)
    if blockers:
        raise ValueError(
            f"{RUNTIME} does not compute this hf_tfm config exactly, blocked by: {'; '.join(blockers)}. "
            f"{other_routes(config, *ROUTES)}"
        )


# ---------------------------------------------------------------------------------------------------------------------
# The spec


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A float32 copy: CTranslate2 quantizes the arrays of a spec in place, which on a view would rewrite the
    model's own weights."""
    return tensor.detach().to(torch.float32).cpu().numpy().copy()


def _set_norm(spec, norm: torch.nn.Module, config: TfmConfig) -> None:
    """gamma, and beta for a LayerNorm: CTranslate2 runs an RMSNorm where there is no beta, so a bias-free LayerNorm
    gets a zero one."""
    spec.gamma = _array(norm.weight)
    if config.norm_type == "layernorm":
        bias = norm.bias if norm.bias is not None else torch.zeros_like(norm.weight)
        spec.beta = _array(bias)


def _set_linear(spec, *linears: torch.nn.Linear) -> None:
    """One CTranslate2 linear from one or more `nn.Linear`s stacked on their outputs (q, k, v -> one projection)."""
    spec.weight = np.concatenate([_array(linear.weight) for linear in linears])
    if any(linear.bias is not None for linear in linears):
        biases = [linear.bias if linear.bias is not None else torch.zeros(linear.out_features) for linear in linears]
        spec.bias = np.concatenate([_array(bias) for bias in biases])


def _norm_spec(ct2, config: TfmConfig):
    return ct2.specs.common_spec.LayerNormSpec(rms_norm=config.norm_type == "rmsnorm")


def _rope(config: TfmConfig) -> dict | None:
    return config.rope_parameters if config.position_embedding_type == "rope" else None


def _stack_options(ct2, config: TfmConfig) -> dict[str, Any]:
    """The spec arguments an encoder and a decoder stack share."""
    specs = ct2.specs
    rope = _rope(config) or {}
    scaling = {
        "linear": specs.attention_spec.RotaryScalingType.Linear,
        "llama3": specs.attention_spec.RotaryScalingType.Llama3,
    }
    heads = config.num_attention_heads
    return {
        "num_layers": config.num_hidden_layers,
        "num_heads": heads,
        # pre_norm=True builds the final norm the config asks for; post-norm is switched on once built (a post-norm
        # spec drops it, and hf_tfm can have one after post-norm layers).
        "pre_norm": True,
        "no_final_norm": not config.final_norm,
        "activation": specs.common_spec.Activation[ACTIVATIONS[config.hidden_act]],
        "layernorm_embedding": config.embedding_norm,
        "ffn_glu": config.ffn_type == "glu",
        "rms_norm": config.norm_type == "rmsnorm",
        "rotary_dim": 0 if rope else None,
        "rotary_interleave": False,
        "rotary_scaling_type": scaling.get(rope.get("rope_type")),
        "rotary_scaling_factor": rope.get("factor", 1),
        "rotary_base": rope.get("rope_theta", 10000),
        "num_heads_kv": config.num_key_value_heads if config.num_key_value_heads != heads else None,
        "head_dim": config.head_dim,
        "qk_norm": config.qk_norm,
    }


def _decoder_spec(ct2, config: TfmConfig, cross_attention: bool):
    return ct2.specs.TransformerDecoderSpec(
        **_stack_options(ct2, config),
        with_encoder_attention=cross_attention,
        # hf_tfm's bias is -slope * (i - j); CTranslate2's "negative positions" give slope * (j - last key), equal
        # for the newest query and off by a per-row constant (which softmax ignores) for the earlier ones.
        alibi=config.position_embedding_type == "alibi",
        alibi_use_positive_positions=False,
        scale_alibi=False,  # hf_tfm adds the bias to the scaled scores
        parallel_residual=config.parallel_residual,
    )


def _position_table(config: TfmConfig, backbone: torch.nn.Module, fold_types: bool = True) -> np.ndarray | None:
    """The absolute positions hf_tfm adds for positions 0 .. max_position_embeddings - 1 (None for rope / alibi),
    with the token-type row (type 0 everywhere: a decoder, or an encoder given no types) folded in unless the spec
    has the type table itself (`fold_types=False`)."""
    positions = torch.arange(config.max_position_embeddings)
    if config.position_embedding_type == "learned":
        table = backbone.embed_positions.weight[config.position_offset :]
    elif config.position_embedding_type == "sinusoidal":
        table = backbone.embed_positions(positions[None], torch.float32)[0]
    else:
        return None
    if backbone.token_type_embeddings is not None and fold_types:
        table = table + backbone.token_type_embeddings.weight[0]
    return _array(table)


def _set_stack(
    ct2, spec, embeddings_spec, config: TfmConfig, backbone: torch.nn.Module, types_spec: Any = None
) -> None:
    """Embeddings, positions, norms and layers of one encoder or decoder stack. `types_spec`: the spec's second
    source embedding, which takes the token-type table (else its row 0 is folded in)."""
    spec.pre_norm = config.norm_position == "pre"
    table = _position_table(config, backbone, fold_types=types_spec is None)
    if table is not None:
        spec.position_encodings.encodings = table
    if types_spec is not None:
        types_spec.weight = _array(backbone.token_type_embeddings.weight)
    embeddings = backbone.embed_tokens.weight
    if backbone.token_type_embeddings is not None and table is None and types_spec is None:
        # No position table to hold the token-type row: an untied token table with it (exact, the scale is 1).
        embeddings = embeddings + backbone.token_type_embeddings.weight[0]
    embeddings_spec.weight = _array(embeddings)
    # A float is the multiplier itself; 1.0 (or False) multiplies by nothing.
    spec.scale_embeddings = np.float32(config.embedding_scale) if config.embedding_scale != 1.0 else False
    if config.embedding_norm:
        _set_norm(spec.layernorm_embedding, backbone.embed_norm, config)
    if config.final_norm:
        _set_norm(spec.layer_norm, backbone.norm, config)
    for layer_spec, layer in zip(spec.layer, backbone.layers, strict=True):
        _set_layer(ct2, layer_spec, layer, config)


def _set_attention(ct2, spec, attn: torch.nn.Module, config: TfmConfig, cross: bool = False) -> None:
    if cross:  # queries from the decoder, keys and values (one projection) from the encoder output
        _set_linear(spec.linear[0], attn.q_proj)
        _set_linear(spec.linear[1], attn.k_proj, attn.v_proj)
    else:
        _set_linear(spec.linear[0], attn.q_proj, attn.k_proj, attn.v_proj)
    _set_linear(spec.linear[-1], attn.o_proj)
    if config.qk_norm:  # the spec's q/k norms are RMSNorms; hf_tfm's have the model's norm type
        spec.q_norm, spec.k_norm = _norm_spec(ct2, config), _norm_spec(ct2, config)
        _set_norm(spec.q_norm, attn.q_norm, config)
        _set_norm(spec.k_norm, attn.k_norm, config)
    rope = _rope(config)
    if rope and rope["rope_type"] == "llama3" and not cross:
        # The spec writes the factor for linear scaling only (CTranslate2 reads a missing one as 1: no scaling) and,
        # in an encoder, no original length: set here, on the frozen spec object.
        values = {
            "rotary_scaling_factor": rope["factor"],
            "rotary_low_freq_factor": rope["low_freq_factor"],
            "rotary_high_freq_factor": rope["high_freq_factor"],
        }
        for name, value in values.items():
            object.__setattr__(spec, name, np.float32(value))
        original = rope.get("original_max_position_embeddings", config.max_position_embeddings)
        object.__setattr__(spec, "original_max_position_embeddings", np.int32(original))


def _set_layer(ct2, spec, layer: torch.nn.Module, config: TfmConfig) -> None:
    _set_attention(ct2, spec.self_attention, layer.self_attn, config)
    if config.parallel_residual:  # the spec's parallel norms are LayerNorms; hf_tfm's have the model's norm type
        spec.input_layer_norm, spec.post_attention_layer_norm = _norm_spec(ct2, config), _norm_spec(ct2, config)
        _set_norm(spec.input_layer_norm, layer.attn_norm, config)
        _set_norm(spec.post_attention_layer_norm, layer.mlp_norm, config)
    else:  # before the sub-layer, or (post-norm) after its residual sum
        _set_norm(spec.self_attention.layer_norm, layer.attn_norm, config)
        _set_norm(spec.ffn.layer_norm, layer.mlp_norm, config)
    if layer.encoder_attn is not None:
        _set_attention(ct2, spec.attention, layer.encoder_attn, config, cross=True)
        _set_norm(spec.attention.layer_norm, layer.cross_attn_norm, config)
    mlp = layer.mlp
    if config.ffn_type == "glu":  # act(linear_0(x)) * linear_0_noact(x)
        _set_linear(spec.ffn.linear_0, mlp.gate_proj)
        _set_linear(spec.ffn.linear_0_noact, mlp.up_proj)
    else:
        _set_linear(spec.ffn.linear_0, mlp.up_proj)
    _set_linear(spec.ffn.linear_1, mlp.down_proj)


def _model_spec(ct2, model: torch.nn.Module):
    """The `TransformerDecoderModelSpec` of a causal LM, or the `TransformerSpec` of an encoder-decoder, its weights
    set. The head reads the unscaled token table when tied (CTranslate2 scales the embeddings' output only)."""
    specs = ct2.specs
    if not isinstance(model.config, TfmSeq2SeqConfig) and not model.config.is_causal:  # TfmModel, an encoder
        config: TfmConfig = model.config
        options = _stack_options(ct2, config)
        if config.type_vocab_size > 0:  # token types: a second table, added to the tokens' (BERT's layout)
            options.update(num_source_embeddings=2, embeddings_merge=specs.common_spec.EmbeddingsMerge.ADD)
        encoder = specs.TransformerEncoderSpec(**options)
        types = encoder.embeddings[1] if config.type_vocab_size > 0 else None
        _set_stack(ct2, encoder, encoder.embeddings[0], config, model, types_spec=types)
        if model.pooler is None:
            return specs.TransformerEncoderModelSpec(encoder)
        activation = specs.common_spec.Activation[POOLER_ACTIVATIONS[config.classifier_activation]]
        spec = specs.TransformerEncoderModelSpec(encoder, pooling_layer=True, pooling_activation=activation)
        _set_linear(spec.pooler_dense, model.pooler.dense)
        return spec
    if isinstance(model.config, TfmSeq2SeqConfig):
        config: TfmSeq2SeqConfig = model.config
        encoder = specs.TransformerEncoderSpec(**_stack_options(ct2, config.encoder))
        decoder = _decoder_spec(ct2, config.decoder, cross_attention=True)
        _set_stack(ct2, encoder, encoder.embeddings[0], config.encoder, model.model.encoder)
        _set_stack(ct2, decoder, decoder.embeddings, config.decoder, model.model.decoder)
        _set_linear(decoder.projection, model.lm_head)
        return specs.TransformerSpec(encoder, decoder)
    decoder = _decoder_spec(ct2, model.config, cross_attention=False)
    _set_stack(ct2, decoder, decoder.embeddings, model.config, model.model)
    _set_linear(decoder.projection, model.lm_head)
    return specs.TransformerDecoderModelSpec(decoder)


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer


def _tokenizer(source: str | None, tokenizer: Any) -> tuple[dict[str, int], str | None, Any]:
    """The tokenizer's vocabulary (token -> id, added tokens included), its unknown token, and how to put its files
    in a folder: a function of the destination."""
    from tokenizers import Tokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):  # a tokenizer object
        vocab = dict(tokenizer.get_vocab())
        return vocab, tokenizer.unk_token, tokenizer.save_pretrained
    path = Path(tokenizer) if tokenizer is not None else Path(source) if source else None
    if path is not None and path.is_file():  # a tokenizer.json
        backend = Tokenizer.from_file(str(path))
        unk = json.loads(path.read_text(encoding="utf-8")).get("model", {}).get("unk_token")
        return backend.get_vocab(with_added_tokens=True), unk, lambda out: shutil.copy(path, Path(out) / path.name)
    if path is not None and (path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # runs no folder code
        files = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]

        def copy(out: str | os.PathLike) -> None:
            for file in files:
                shutil.copy(file, Path(out) / file.name)

        return dict(loaded.get_vocab()), loaded.unk_token, copy
    raise ValueError(
        f"{RUNTIME} models carry their vocabulary: no tokenizer.json found"
        + (f" in {source}" if source else "")
        + "; pass `tokenizer=` (a tokenizer, its folder or its tokenizer.json)."
    )


def _vocabulary(vocab: dict[str, int], config: TfmConfig, where: str) -> list[str]:
    """The `vocab_size` token strings in id order, ids the tokenizer does not use filled with unused tokens
    (CTranslate2 maps strings to ids, so every entry must be distinct)."""
    if max(vocab.values()) >= config.vocab_size:
        raise ValueError(
            f"{where}: token id {max(vocab.values())} is outside the model's vocab_size {config.vocab_size}."
        )
    tokens: list[str | None] = [None] * config.vocab_size
    for token, token_id in vocab.items():
        tokens[token_id] = token
    taken = set(vocab)
    for i, token in enumerate(tokens):
        if token is None:
            name, n = f"[PAD{i}]", 0
            while name in taken:
                n += 1
                name = f"[PAD{i}.{n}]"
            tokens[i] = name
            taken.add(name)
    return tokens


# ---------------------------------------------------------------------------------------------------------------------
# Export


def _load(model_or_folder: Any) -> tuple[torch.nn.Module, str | None]:
    from .. import modeling

    if isinstance(model_or_folder, (str, os.PathLike)):
        folder = Path(model_or_folder)
        saved = folder / "config.json"
        model_type = json.loads(saved.read_text()).get("model_type") if saved.is_file() else None
        seq2seq = model_type == TfmSeq2SeqConfig.model_type
        config = (TfmSeq2SeqConfig if seq2seq else TfmConfig).from_pretrained(folder)
        default = "TfmForConditionalGeneration" if seq2seq else "TfmForCausalLM"
        architecture = (getattr(config, "architectures", None) or [default])[0]
        refused = _class_refusal(architecture)
        if refused:
            raise ValueError(f"{folder}: {refused}.")
        _require_exact(config, architecture)  # refuse before loading any weight
        loads = "TfmModel" if architecture == "TfmMoeModel" else architecture
        return getattr(modeling, loads).from_pretrained(folder), str(folder)
    takes = tuple(getattr(modeling, name) for name in RUNNERS)
    if not isinstance(model_or_folder, takes):
        raise ValueError(f"{_class_refusal(type(model_or_folder).__name__)}.")
    return model_or_folder, getattr(model_or_folder, "name_or_path", None) or None


def _converter(ct2, build):
    """A `ctranslate2.converters.Converter` whose `_load` returns the spec `build()` makes (validated, quantized and
    saved by `Converter.convert`)."""

    class TfmConverter(ct2.converters.Converter):
        def _load(self):
            return build()

    return TfmConverter()


def export_ctranslate2(
    model_or_folder: Any, out: str | os.PathLike, quantize: str | None = None, tokenizer: Any = None
) -> Path:
    """Write an hf_tfm causal LM or encoder-decoder (model or saved folder) as a CTranslate2 model folder `out`
    (model.bin, config.json, the vocabulary and the tokenizer's files); see `hf_tfm.exporters.export`. `quantize` is
    one of `TYPES` (None: float32). An existing `out` is replaced once the new export is complete if it is an empty
    folder or a CTranslate2 model folder (a model.bin); anything else there raises `FileExistsError`."""
    qtype = quantize or "float32"
    if qtype not in TYPES:
        raise ValueError(f"quantize={quantize!r}: {RUNTIME} types written here are {list(TYPES)}.")
    ct2 = _import_ctranslate2()
    out = Path(out)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / "model.bin").is_file())):
        raise FileExistsError(
            f"{out} exists and is not a {RUNTIME} model folder: remove it, or pick another path to export to."
        )
    model, source = _load(model_or_folder)
    config = model.config
    _require_exact(config, type(model).__name__)
    vocab, unk, save_tokenizer = _tokenizer(source, tokenizer)
    named = tokenizer is None or isinstance(tokenizer, (str, os.PathLike))
    where = str(tokenizer or source) if named else type(tokenizer).__name__  # for error messages
    seq2seq = isinstance(config, TfmSeq2SeqConfig)
    decoder = config.decoder if seq2seq else config
    tokens = _vocabulary(vocab, decoder, where)

    def build():
        with torch.no_grad():
            spec = _model_spec(ct2, model)
        if seq2seq:  # one shared_vocabulary.json when the sides' sizes agree
            spec.register_source_vocabulary(_vocabulary(vocab, config.encoder, where))
            spec.register_target_vocabulary(tokens)
            start = config.decoder_start_token_id  # None: Translator callers pass it in a target prefix
            spec.config.decoder_start_token = tokens[start] if start is not None else None
        else:
            spec.register_vocabulary(tokens)
        eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
        spec.config.bos_token = tokens[config.bos_token_id] if config.bos_token_id is not None else tokens[0]
        spec.config.eos_token = tokens[eos] if eos is not None else tokens[0]
        spec.config.unk_token = unk if unk in vocab else ""  # CTranslate2 appends an unknown token it does not find
        spec.config.layer_norm_epsilon = float(decoder.norm_eps)  # the encoder's is the same (blockers)
        return spec

    with staged_folder(out) as tmp:  # an earlier export (checked above) is replaced once the new one is complete
        _converter(ct2, build).convert(str(tmp), quantization=qtype, force=True)
        save_tokenizer(tmp)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Verification in CTranslate2


def verify_ctranslate2(
    exported: str | os.PathLike,
    model_or_folder: Any,
    prompts: list[list[int]] | list[str] | None = None,
    max_new_tokens: int = 32,
    fresh_process: bool = True,
) -> dict[str, Any]:
    """Run the CTranslate2 folder `exported` (in a fresh process unless `fresh_process=False`) and compare it with the
    hf_tfm model it came from: greedy tokens (`max_new_tokens` per prompt, EOS suppressed on both sides) and the
    logits on hf_tfm's greedy sequences. A causal LM runs in `ctranslate2.Generator` (`generate_batch`, then
    `forward_batch`), an encoder-decoder in `ctranslate2.Translator` (`translate_batch` from the prompt as the source,
    then with the reference forced as the target prefix for its logits).

    `prompts` are token ids, or texts for the tokenizer (the model folder's, else the export's); None: two texts of
    different lengths. Returns `tokens_equal`, `agreement` (the share of generated positions with equal tokens),
    `max_logit_diff`, and the `compute_type` CTranslate2 ran (the saved type, or what this CPU runs it as).
    """
    _import_ctranslate2()
    folder = Path(exported).resolve()
    model, source = _load(model_or_folder)
    config = model.config
    seq2seq = isinstance(config, TfmSeq2SeqConfig)
    own = source is not None and (Path(source) / "tokenizer.json").is_file()
    prompts = prompt_ids(prompts, source if own else folder)  # texts: else through the export's copy
    if not seq2seq and not config.is_causal:
        return _verify_encoder(folder, model, prompts, fresh_process)
    references = greedy_references(model, prompts, max_new_tokens)
    ours = []
    with torch.no_grad():
        for prompt, reference in zip(prompts, references, strict=True):
            if seq2seq:  # the logits that chose each new token
                inputs = {"input_ids": torch.tensor([prompt]), "decoder_input_ids": torch.tensor([reference[:-1]])}
            else:
                inputs = {"input_ids": torch.tensor([reference])}
            ours.append(model(**inputs).logits[0].float())
    args = {
        "path": str(folder),
        "seq2seq": seq2seq,
        "prompts": prompts,
        "references": references,
        "max_new_tokens": max_new_tokens,
        "end_ids": eos_ids(config),
    }
    theirs = run_program(SIDE, args, RUNTIME, fresh_process=fresh_process)
    return {
        "compute_type": theirs["compute_type"],
        **agreement_report(ours, theirs, references, prompts, seq2seq, max_new_tokens),
    }


def _verify_encoder(folder: Path, model: torch.nn.Module, prompts: list[list[int]], fresh: bool) -> dict[str, Any]:
    """The Encoder's outputs on the prompts as one padded batch against the model on each prompt alone (per-token
    outputs compared on the prompt's own positions): `outputs`, `max_diff`, `prompts`, `compute_type`."""
    token_types = model.config.type_vocab_size > 0
    args = {"path": str(folder), "prompts": [list(map(int, p)) for p in prompts], "encoder": True}
    theirs = run_program(SIDE, {**args, "token_types": token_types}, RUNTIME, fresh_process=fresh)
    compute_type = theirs.pop("compute_type")
    diff = encoder_max_diff(model, prompts, theirs, folder)
    return {"compute_type": compute_type, "outputs": sorted(theirs), "max_diff": diff, "prompts": len(prompts)}


FORMAT = ExportFormat(
    name="ctranslate2",
    title="CTranslate2",
    runtime=RUNTIME,
    takes=(*RUNNERS, "TfmMoeModel"),
    quantize=tuple(TYPES),
    requires=("ctranslate2",),
    blockers=ctranslate2_blockers,
    refusal=refusal,
    summary=_summary,
    export=export_ctranslate2,
    verify=verify_ctranslate2,
    recognizes=lambda path: (path / "model.bin").is_file(),
)


__all__ = ["ACTIVATIONS", "FORMAT", "TYPES", "ctranslate2_blockers", "export_ctranslate2", "verify_ctranslate2"]
