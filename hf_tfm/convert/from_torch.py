"""`from_torch`: turn a plain-PyTorch transformer (`nn.TransformerEncoder` or `nn.Transformer`, plus embeddings and
a head) into hf_tfm.

A model written against `torch.nn` (the tutorial `TransformerClassifier`, a GPT built from `nn.TransformerEncoder`
and a causal mask, a translation model built on `nn.Transformer`) becomes an ordinary hf_tfm model with the same
weights and the same outputs, so `Trainer`,
`generate()`, PEFT, `save_pretrained` and `push_to_hub` work on it. Every field of the torch modules is mapped
exactly or refused with a `ValueError` that says what and why; nothing is approximated. Dropout is the exception
that is reported, not refused: it does not change inference, and torch's dropout inside the feed-forward block has
no place in hf_tfm's (a warning says so).

What the torch modules cannot show is left to the caller: the torch model's forward. `embedding_scale` covers the
tutorials' `embedding(src) * sqrt(d_model)`; the causal mask is implied by `task="causal-lm"` (and, for
`nn.Transformer`, by `task="seq2seq-lm"`: its decoder runs with a causal `tgt_mask`).
"""

import dataclasses
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F
from transformers.utils import logging

from ..configuration import TfmConfig, TfmSeq2SeqConfig
from ..modeling import (
    TfmForCausalLM,
    TfmForConditionalGeneration,
    TfmForMaskedLM,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmModel,
    TfmPreTrainedModel,
)

logger = logging.get_logger(__name__)

TASKS: dict[str, type[TfmPreTrainedModel]] = {
    "feature-extraction": TfmModel,
    "sequence-classification": TfmForSequenceClassification,
    "token-classification": TfmForTokenClassification,
    "masked-lm": TfmForMaskedLM,
    "causal-lm": TfmForCausalLM,
    "seq2seq-lm": TfmForConditionalGeneration,  # an nn.Transformer body
}
# torch's TransformerEncoderLayer runs exactly these two itself (its fast path special-cases them); anything else
# is a custom activation. nn.GELU(approximate="tanh") is refused: torch's eval fast path computes it as exact gelu.
LAYER_ACTIVATIONS = {F.relu: "relu", F.gelu: "gelu"}
# Activation modules a head may hold between its dense layer and the output layer, as ACT2FN names.
HEAD_ACTIVATIONS = {nn.ReLU: "relu", nn.Tanh: "tanh", nn.SiLU: "silu"}
# The mapped values a caller may still override: training-time rates only (the parity does not depend on them).
OVERRIDABLE = {"attention_dropout", "hidden_dropout", "classifier_dropout"}


def sinusoidal_table(length: int, dim: int, layout: Literal["interleaved", "halves"]) -> torch.Tensor:
    """The fixed table PE[pos, :] in fp64: angle i is pos / 10000^(2i/dim); an odd `dim` drops the last cosine.

    "interleaved" (the paper, PyTorch's tutorials): sin at even dimensions, cos at odd ones. "halves" (fairseq,
    Marian): the sines, then the cosines.
    """
    positions = torch.arange(length, dtype=torch.float64)[:, None]
    angles = positions / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if layout == "interleaved":
        table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
    else:
        table = torch.cat((angles.sin(), angles.cos()), dim=-1)
    return table[:, :dim]


def detect_sinusoidal_layout(table: torch.Tensor) -> Literal["interleaved", "halves"]:
    """Which sinusoidal layout a (length, dim) table holds, or a `ValueError` when it holds neither.

    A table built in fp32 (as the tutorials do) drifts from the fp64 formula by about 1e-7 x position (the angles'
    rounding), so each row is allowed 1e-5 + 2e-7 x position; the two layouts differ by O(1) from position 1 on.
    """
    length, dim = table.shape
    tolerance = 1e-5 + 2e-7 * torch.arange(length, dtype=torch.float64)[:, None]
    errors = {}
    for layout in ("interleaved", "halves"):
        error = (table.detach().cpu().double() - sinusoidal_table(length, dim, layout)).abs()
        if bool((error <= tolerance).all()):
            return layout
        errors[layout] = error.max().item()
    raise ValueError(
        f"`positions` is a fixed ({length}, {dim}) table but not a sinusoidal one (max difference from the "
        f"interleaved formula {errors['interleaved']:.3g}, from the halves one {errors['halves']:.3g}). hf_tfm "
        "recomputes sinusoidal tables from the formula, so it cannot hold another fixed table; pass a trainable "
        "table as an nn.Embedding or nn.Parameter (learned positions)."
    )


def from_torch(
    body: nn.Module,
    *,
    embed_tokens: nn.Embedding,
    positions: nn.Embedding | nn.Parameter | torch.Tensor | None,
    head: nn.Module | None = None,
    task: str = "feature-extraction",
    pooling: Literal["first", "mean", "last"] | None = None,
    embedding_scale: float = 1.0,
    target_embed_tokens: nn.Embedding | None = None,
    **config_kwargs,
) -> TfmPreTrainedModel:
    """The hf_tfm model with the same architecture, weights and outputs as a plain-PyTorch transformer.

    Args:
        body: an `nn.TransformerEncoder` of `nn.TransformerEncoderLayer`s (`norm_first` either way, relu or gelu,
            any `layer_norm_eps`, `bias`, `batch_first`, with or without its final `norm`); or, with
            `task="seq2seq-lm"`, an `nn.Transformer` (its encoder and decoder layers likewise).
        embed_tokens: the token `nn.Embedding` (seq2seq: the source's); its `padding_idx` becomes `pad_token_id`.
        positions: an `nn.Embedding` or trainable `nn.Parameter` (learned positions), or a fixed sinusoidal table
            (a tensor of shape (length, d), (length, 1, d) or (1, length, d); its layout is detected).
            `None` is refused: hf_tfm has no position-free mode.
        head: the output layer. `nn.Linear` for sequence and token classification, the causal LM and the seq2seq
            LM's generator (tied when its weight is the (target) token embeddings'); for sequence classification
            also `nn.Sequential(Linear(d, d), activation, [LayerNorm(d)], [Dropout], Linear(d, labels))` (BERT's
            pooler); for the masked LM
            `nn.Sequential(Linear(d, d), activation, LayerNorm(d), Linear(d, vocab))`, the transform
            `TfmForMaskedLM` has. `None` for feature extraction.
        task: one of `TASKS`. "causal-lm" means the torch model runs the body with a causal mask; "seq2seq-lm"
            that it runs an `nn.Transformer` with a causal `tgt_mask` and the source's padding as
            `src_key_padding_mask` and `memory_key_padding_mask`.
        pooling: sequence classification only: how the torch model reduces the sequence ("first", "mean" of real
            tokens, or "last" real token).
        embedding_scale: the factor the torch forward multiplies the token embeddings by (tutorials:
            `math.sqrt(d_model)`): the `embedding_scale` knob (of both sides, for seq2seq).
        target_embed_tokens: seq2seq only: the target's token `nn.Embedding`; `None` or `embed_tokens` itself
            means one table for both sides (`share_encoder_decoder_embeddings`).
        config_kwargs: further `TfmConfig` fields the torch modules do not hold (`id2label`, `bos_token_id`,
            `eos_token_id`, `pad_token_id` when the embedding has no `padding_idx`, ...), and dropout rates;
            seq2seq: `TfmSeq2SeqConfig` fields (`decoder_start_token_id`, token ids) and side fields.

    Returns:
        The `TASKS[task]` model, in the body's train/eval mode, dtype and device.
    """
    _check_task(body, task, pooling)
    if task == "seq2seq-lm":
        return _seq2seq(body, embed_tokens, target_embed_tokens, positions, head, embedding_scale, config_kwargs)
    _check_encoder_body(body, target_embed_tokens)

    kwargs, state = _stack_fields(body, embed_tokens, embedding_scale, "encoder")
    d = kwargs["hidden_size"]
    tied = head is not None and _output_linear(head).weight is embed_tokens.weight
    position_kwargs, position_state = _positions(positions, d)
    kwargs.update(position_kwargs)
    state.update(position_state)

    kwargs["is_causal"] = task == "causal-lm"
    kwargs["tie_word_embeddings"] = tied
    head_kwargs, head_state = _head(head, task, d, kwargs)
    kwargs.update(head_kwargs)
    if task == "sequence-classification":
        kwargs["classifier_pooling"] = pooling

    config = _encoder_config(kwargs, config_kwargs)
    return _model_with_weights(task, config, body, state, head_state, tied)


def _check_task(body: nn.Module, task: str, pooling: str | None) -> None:
    """A `ValueError` unless `task` is known and goes with the kind of `body` and with `pooling`."""
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {list(TASKS)}, got {task!r}.")
    if isinstance(body, nn.TransformerDecoder):
        raise ValueError(
            "an nn.TransformerDecoder alone has no encoder to attend to: import the whole nn.Transformer with "
            "task='seq2seq-lm'."
        )
    if (type(body) is nn.Transformer) != (task == "seq2seq-lm"):
        raise ValueError(
            f"`task='seq2seq-lm'` goes with an nn.Transformer body and only with one; got task={task!r} and a "
            f"{type(body).__name__}."
        )
    if (pooling is not None) != (task == "sequence-classification"):
        raise ValueError(
            f"`pooling` ('first', 'mean' or 'last') is required for sequence classification and only there; got "
            f"pooling={pooling!r} with task={task!r}."
        )


def _check_encoder_body(body: nn.Module, target_embed_tokens: nn.Embedding | None) -> None:
    """A `ValueError` unless `body` is exactly an nn.TransformerEncoder and no target embeddings are given."""
    if target_embed_tokens is not None:
        raise ValueError("`target_embed_tokens` is for task 'seq2seq-lm' (an nn.Transformer's target side).")
    if type(body) is not nn.TransformerEncoder:
        raise ValueError(
            f"`body` must be an nn.TransformerEncoder, got {type(body).__name__}: a subclass or another module may "
            "run a forward hf_tfm does not reproduce."
        )


def _stack_fields(
    stack: nn.TransformerEncoder | nn.TransformerDecoder, tokens: nn.Embedding, embedding_scale: float, side: str
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The TfmConfig fields and the weights (hf_tfm names) of a layer stack, its final norm and its token
    embeddings; positions and head apart. `side` ("encoder", "decoder") names the stack in errors."""
    kwargs = _layers_config(stack)
    d = kwargs["hidden_size"]
    state = _layers_state(stack)
    kwargs["final_norm"] = stack.norm is not None
    if stack.norm is not None:
        state.update(_norm_state(stack.norm, "norm", d, kwargs, f"the final `norm` of the {side}"))
    kwargs.update(_embedding_config(tokens, d), embedding_scale=embedding_scale)
    state["embed_tokens.weight"] = tokens.weight.detach()
    return kwargs, state


def _encoder_config(kwargs: dict, config_kwargs: dict) -> TfmConfig:
    """The TfmConfig of the fields read from the torch modules plus the caller's `config_kwargs`, which may not
    override a read field (dropout rates apart)."""
    # The torch modules name no special tokens: none are invented (an eos id of 2 would stop generate() early).
    defaults = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    clashes = sorted(set(config_kwargs) & set(kwargs) - OVERRIDABLE)
    if clashes:
        raise ValueError(f"{clashes} are read from the torch modules; change the modules instead of overriding them.")
    return TfmConfig(**{**defaults, **kwargs, **config_kwargs})


def _model_with_weights(
    task: str,
    config: TfmConfig,
    body: nn.TransformerEncoder,
    state: dict[str, torch.Tensor],
    head_state: dict[str, torch.Tensor],
    tied: bool,
) -> TfmPreTrainedModel:
    """The `TASKS[task]` model of `config` holding the body's weights (`state`, hf_tfm names under the backbone) and
    the head's, in the body's dtype, device and train/eval mode."""
    parameter = next(body.parameters())
    model = TASKS[task](config).to(parameter.dtype)
    prefix = "" if task == "feature-extraction" else "model."
    full_state = {prefix + name: tensor for name, tensor in state.items()}
    full_state.update(head_state)
    if tied:
        full_state["lm_head.weight"] = full_state["model.embed_tokens.weight"]
    model.load_state_dict(full_state, strict=True)  # a weight nobody mapped is an error, not a random init
    return model.to(parameter.device).train(body.training)


def _seq2seq(
    body: nn.Transformer,
    embed_tokens: nn.Embedding,
    target_embed_tokens: nn.Embedding | None,
    positions,
    head: nn.Module | None,
    embedding_scale: float,
    config_kwargs: dict,
) -> TfmForConditionalGeneration:
    """An nn.Transformer with its embeddings, positions and generator as a TfmForConditionalGeneration."""
    if type(body.encoder) is not nn.TransformerEncoder or type(body.decoder) is not nn.TransformerDecoder:
        raise ValueError("`body` has a custom encoder or decoder: only nn.TransformerEncoder/Decoder stacks import.")
    target_embed_tokens = embed_tokens if target_embed_tokens is None else target_embed_tokens
    if isinstance(positions, nn.Embedding) or (isinstance(positions, nn.Parameter) and positions.requires_grad):
        raise ValueError(
            "learned `positions` shared by source and target: hf_tfm keeps one position table per side, which "
            "would train apart. Use sinusoidal positions, or import a model whose sides have tables of their own."
        )
    sides, state = {}, {}
    for side, stack, tokens in (
        ("encoder", body.encoder, embed_tokens),
        ("decoder", body.decoder, target_embed_tokens),
    ):
        kwargs, layer_state = _stack_fields(stack, tokens, embedding_scale, side)
        position_kwargs, position_state = _positions(positions, kwargs["hidden_size"])
        sides[side] = {**kwargs, **position_kwargs}
        state.update({f"model.{side}.{name}": tensor for name, tensor in {**layer_state, **position_state}.items()})
    if head is None or type(head) is not nn.Linear:
        raise ValueError(
            f"task 'seq2seq-lm' needs `head`, the generator: one nn.Linear(d, target vocabulary); got {head}."
        )
    shared = target_embed_tokens is embed_tokens
    tied = head.weight is target_embed_tokens.weight
    head_kwargs, head_state = _head(head, "causal-lm", sides["decoder"]["hidden_size"], sides["decoder"])
    sides["decoder"].update(head_kwargs)
    state.update(head_state)
    # The torch modules name no special tokens: none are invented. The sides take the token ids and other TfmConfig
    # fields of `config_kwargs` (the seq2seq config derives its own ids from the decoder's); it takes the rest.
    own = {f.name for f in dataclasses.fields(TfmSeq2SeqConfig)} - {f.name for f in dataclasses.fields(TfmConfig)}
    top = {name: config_kwargs.pop(name) for name in list(config_kwargs) if name in own}
    for side in sides.values():
        clashes = sorted(set(config_kwargs) & set(side) - OVERRIDABLE)
        if clashes:
            raise ValueError(f"{clashes} are read from the torch modules; change the modules, not the config.")
        side.update({"pad_token_id": None, "bos_token_id": None, "eos_token_id": None, **side, **config_kwargs})
    config = TfmSeq2SeqConfig(
        encoder=sides["encoder"],
        decoder=sides["decoder"],
        share_encoder_decoder_embeddings=shared,
        tie_word_embeddings=tied,
        **top,
    )
    parameter = next(body.parameters())
    model = TfmForConditionalGeneration(config).to(parameter.dtype)
    if shared:
        del state["model.decoder.embed_tokens.weight"]
    if tied:
        del state["lm_head.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - set(model.all_tied_weights_keys):
        raise ValueError(
            f"from_torch mapped the nn.Transformer incompletely: missing {missing}, unexpected {unexpected}"
        )
    return model.to(parameter.device).train(body.training)


# ---------------------------------------------------------------------------------------------------------------------
# The encoder and decoder layers


def _layers_config(body: nn.TransformerEncoder | nn.TransformerDecoder) -> dict:
    """The TfmConfig fields every layer agrees on, or a `ValueError` naming the first field where they differ."""
    if len(body.layers) == 0:
        raise ValueError("`body` has no layers.")
    layer_class = nn.TransformerDecoderLayer if isinstance(body, nn.TransformerDecoder) else nn.TransformerEncoderLayer
    configs = [_layer_config(layer, i, layer_class) for i, layer in enumerate(body.layers)]
    for i, config in enumerate(configs[1:], start=1):
        differ = sorted(k for k in config if config[k] != configs[0][k])
        if differ:
            raise ValueError(
                f"Layer {i} differs from layer 0 in {differ}: hf_tfm layers share one config, so every layer must "
                "be built alike."
            )
    return {**configs[0], "num_hidden_layers": len(configs)}


def _attention_config(attn: nn.MultiheadAttention, i: int, what: str) -> dict:
    if not attn._qkv_same_embed_dim or attn.in_proj_weight is None:
        raise ValueError(f"Layer {i}: {what} with kdim/vdim != embed_dim has no hf_tfm equivalent.")
    if attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError(f"Layer {i}: `add_bias_kv` / `add_zero_attn` {what} has no hf_tfm equivalent.")
    return {
        "num_attention_heads": attn.num_heads,
        "attention_bias": attn.in_proj_bias is not None,
        "attention_out_bias": attn.out_proj.bias is not None,
        "attention_dropout": float(attn.dropout),
    }


def _layer_config(layer: nn.Module, i: int, layer_class: type = nn.TransformerEncoderLayer) -> dict:
    if type(layer) is not layer_class:
        raise ValueError(
            f"Layer {i} is a {type(layer).__name__}, not an {layer_class.__name__}: a custom layer class may run "
            "a forward hf_tfm does not reproduce."
        )
    decoder = layer_class is nn.TransformerDecoderLayer
    d = layer.self_attn.embed_dim
    attention = _attention_config(layer.self_attn, i, "self-attention")
    if decoder and _attention_config(layer.multihead_attn, i, "cross-attention") != attention:
        raise ValueError(
            f"Layer {i}: `multihead_attn` differs from `self_attn` in heads, biases or dropout: hf_tfm's "
            "cross-attention is built like its self-attention."
        )
    linear1, linear2 = layer.linear1, layer.linear2
    if (linear1.bias is None) != (linear2.bias is None):
        raise ValueError(f"Layer {i}: `linear1` and `linear2` must both have a bias or both not (one `mlp_bias`).")
    if linear1.in_features != d or linear2.out_features != d or linear2.in_features != linear1.out_features:
        raise ValueError(
            f"Layer {i}: mismatched sizes: linear1 {linear1.in_features}->{linear1.out_features}, linear2 "
            f"{linear2.in_features}->{linear2.out_features}, d_model {d}."
        )
    norms = {name: getattr(layer, name) for name in ("norm1", "norm2", "norm3")[: 3 if decoder else 2]}
    for name, norm in norms.items():
        if type(norm) is not nn.LayerNorm or tuple(norm.normalized_shape) != (d,):
            raise ValueError(f"Layer {i}: `{name}` must be an nn.LayerNorm over d_model={d}, got {norm}.")
    first = norms["norm1"]
    if any(n.eps != first.eps or _has_bias(n) != _has_bias(first) for n in norms.values()):
        raise ValueError(f"Layer {i}: the norms differ in eps or bias (hf_tfm has one `norm_eps`).")
    dropouts = [getattr(layer, f"dropout{k}").p for k in range(1, len(norms) + 1)]
    if len(set(dropouts)) > 1:
        logger.warning(
            f"Layer {i}: the residual dropouts differ ({dropouts}); hf_tfm has one `hidden_dropout` and uses "
            "dropout1's. This changes training only."
        )
    if layer.dropout.p > 0 and i == 0:
        logger.warning(
            f"torch's dropout inside the feed-forward block (p={layer.dropout.p}) has no place in hf_tfm's; it is "
            "left out (hf_tfm applies `hidden_dropout` after the embeddings instead). This changes training only."
        )
    return {
        "hidden_size": d,
        **attention,
        "intermediate_size": linear1.out_features,
        "norm_type": "layernorm",
        "norm_eps": first.eps,
        "norm_bias": _has_bias(first),
        "norm_position": "pre" if layer.norm_first else "post",
        "ffn_type": "mlp",
        "hidden_act": _layer_activation(layer.activation, i),
        "mlp_bias": linear1.bias is not None,
        "hidden_dropout": float(layer.dropout1.p),
    }


def _layer_activation(activation, i: int) -> str:
    if isinstance(activation, nn.ReLU):
        return "relu"
    if isinstance(activation, nn.GELU) and activation.approximate == "none":
        return "gelu"
    name = None if isinstance(activation, nn.Module) else LAYER_ACTIVATIONS.get(activation)
    if name is None:
        raise ValueError(
            f"Layer {i}: activation {activation!r} is not relu or gelu (string, F.relu/F.gelu or nn.ReLU/nn.GELU()): "
            "a custom activation cannot be mapped to an hf_tfm `hidden_act` exactly."
        )
    return name


def _has_bias(norm: nn.LayerNorm) -> bool:
    # elementwise_affine=False is a LayerNorm with weight 1 and bias 0: hf_tfm's norm holds exactly that.
    return norm.bias is not None or not norm.elementwise_affine


def _layers_state(body: nn.TransformerEncoder | nn.TransformerDecoder) -> dict[str, torch.Tensor]:
    state = {}
    for i, layer in enumerate(body.layers):
        prefix = f"layers.{i}."
        state.update(_attention_state(layer.self_attn, f"{prefix}self_attn"))
        state.update(_linear_state(layer.linear1, f"{prefix}mlp.up_proj"))
        state.update(_linear_state(layer.linear2, f"{prefix}mlp.down_proj"))
        state.update(_norm_state(layer.norm1, f"{prefix}attn_norm"))
        if isinstance(layer, nn.TransformerDecoderLayer):  # norm2 follows cross-attention, norm3 the feed-forward
            state.update(_attention_state(layer.multihead_attn, f"{prefix}encoder_attn"))
            state.update(_norm_state(layer.norm2, f"{prefix}cross_attn_norm"))
            state.update(_norm_state(layer.norm3, f"{prefix}mlp_norm"))
        else:
            state.update(_norm_state(layer.norm2, f"{prefix}mlp_norm"))
    return state


def _attention_state(attn: nn.MultiheadAttention, name: str) -> dict[str, torch.Tensor]:
    # in_proj stacks the q, k and v projections row-wise: [q; k; v], each (d, d).
    d, state = attn.embed_dim, {}
    for projection, weight in zip(("q", "k", "v"), attn.in_proj_weight.detach().split(d), strict=True):
        state[f"{name}.{projection}_proj.weight"] = weight
    if attn.in_proj_bias is not None:
        for projection, bias in zip(("q", "k", "v"), attn.in_proj_bias.detach().split(d), strict=True):
            state[f"{name}.{projection}_proj.bias"] = bias
    return {**state, **_linear_state(attn.out_proj, f"{name}.o_proj")}


def _linear_state(linear: nn.Linear, name: str) -> dict[str, torch.Tensor]:
    state = {f"{name}.weight": linear.weight.detach()}
    if linear.bias is not None:
        state[f"{name}.bias"] = linear.bias.detach()
    return state


def _norm_state(
    norm: nn.Module, name: str, d: int | None = None, config: dict | None = None, what: str = ""
) -> dict[str, torch.Tensor]:
    """A LayerNorm's weights under `name`; with `config`, first check it fits the one `norm_eps` / `norm_bias`."""
    if config is not None:
        if type(norm) is not nn.LayerNorm or tuple(norm.normalized_shape) != (d,):
            raise ValueError(f"{what} must be an nn.LayerNorm over d_model={d}, got {norm}.")
        if norm.eps != config["norm_eps"] or _has_bias(norm) != config["norm_bias"]:
            raise ValueError(
                f"{what} has eps={norm.eps}, bias={_has_bias(norm)} but the layers' norms have "
                f"eps={config['norm_eps']}, bias={config['norm_bias']} (hf_tfm has one `norm_eps` and `norm_bias`)."
            )
    if not norm.elementwise_affine:
        shape = norm.normalized_shape
        return {f"{name}.weight": torch.ones(shape), f"{name}.bias": torch.zeros(shape)}
    state = {f"{name}.weight": norm.weight.detach()}
    if norm.bias is not None:
        state[f"{name}.bias"] = norm.bias.detach()
    return state


# ---------------------------------------------------------------------------------------------------------------------
# Embeddings and positions


def _embedding_config(embed_tokens: nn.Embedding, d: int) -> dict:
    if type(embed_tokens) is not nn.Embedding:
        raise ValueError(f"`embed_tokens` must be an nn.Embedding, got {type(embed_tokens).__name__}.")
    if embed_tokens.embedding_dim != d:
        raise ValueError(f"`embed_tokens` has embedding_dim={embed_tokens.embedding_dim} but the body d_model={d}.")
    if embed_tokens.max_norm is not None:
        raise ValueError("`embed_tokens` has `max_norm`: it renormalises rows at lookup, which hf_tfm does not.")
    config = {"vocab_size": embed_tokens.num_embeddings}
    if embed_tokens.padding_idx is not None:
        config["pad_token_id"] = embed_tokens.padding_idx
    return config


def _positions(positions, d: int) -> tuple[dict, dict[str, torch.Tensor]]:
    if positions is None:
        raise ValueError(
            "`positions=None`: hf_tfm has no position-free mode (each of its position types adds position "
            "information), so a model without positions cannot be reproduced."
        )
    if isinstance(positions, nn.Embedding):
        if positions.embedding_dim != d or positions.max_norm is not None:
            raise ValueError(f"`positions` must be an nn.Embedding(length, {d}) without max_norm, got {positions}.")
        table = positions.weight
    elif isinstance(positions, torch.Tensor):
        table = positions
        if table.ndim == 3 and 1 in table.shape[:2]:  # (length, 1, d) seq-first or (1, length, d) batch-first
            table = table.reshape(-1, table.shape[-1])
        if table.ndim != 2 or table.shape[1] != d:
            raise ValueError(
                f"`positions` must have shape (length, {d}), (length, 1, {d}) or (1, length, {d}); "
                f"got {tuple(positions.shape)}."
            )
    else:
        raise ValueError(f"`positions` must be an nn.Embedding, a tensor or an nn.Parameter, got {type(positions)}.")
    learned = isinstance(positions, nn.Embedding) or (isinstance(positions, nn.Parameter) and positions.requires_grad)
    config = {"max_position_embeddings": table.shape[0]}
    if learned:
        return {**config, "position_embedding_type": "learned"}, {"embed_positions.weight": table.detach()}
    layout = detect_sinusoidal_layout(table)
    return {**config, "position_embedding_type": "sinusoidal", "sinusoidal_layout": layout}, {}


# ---------------------------------------------------------------------------------------------------------------------
# Heads


def _output_linear(head: nn.Module) -> nn.Linear:
    linear = head[-1] if isinstance(head, nn.Sequential) and len(head) else head
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"`head` must be an nn.Linear or an nn.Sequential ending in one, got {head}.")
    return linear


def _head(head: nn.Module | None, task: str, d: int, config: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    if task == "feature-extraction":
        if head is not None:
            raise ValueError("task 'feature-extraction' has no head: pass `head=None` (or choose the head's task).")
        return {}, {}
    if head is None:
        raise ValueError(f"task {task!r} needs `head`, the torch model's output layer.")
    parts = list(head) if isinstance(head, nn.Sequential) else [head]
    dropout = 0.0
    if len(parts) > 1 and isinstance(parts[-2], nn.Dropout):  # hf_tfm's heads drop out right before the output
        dropout = parts.pop(-2).p
    out, transform = parts[-1], parts[:-1]
    if type(out) is not nn.Linear or out.in_features != d:
        raise ValueError(f"`head` must end in an nn.Linear({d}, n), got {out}.")
    vocab = config["vocab_size"]
    if task in ("masked-lm", "causal-lm") and out.out_features != vocab:
        raise ValueError(f"{task} head has {out.out_features} outputs but the vocabulary has {vocab} tokens.")
    if task == "causal-lm":
        if transform:
            raise ValueError(f"causal-lm `head` must be one nn.Linear (TfmForCausalLM's lm_head), got {head}.")
        return {"lm_head_bias": out.bias is not None}, _linear_state(out, "lm_head")
    kwargs = {"num_labels": out.out_features, "classifier_bias": out.bias is not None, "classifier_dropout": dropout}
    if task == "token-classification":
        if transform:
            raise ValueError(f"token-classification `head` must be one nn.Linear (its `score`), got {head}.")
        return kwargs, _linear_state(out, "score")
    if task == "sequence-classification":
        state = _linear_state(out, "score")
        if transform:
            dense, activation, norm = _transform(transform, d, config, "sequence-classification")
            kwargs.update(classifier_dense=True, classifier_activation=activation, classifier_norm=norm is not None)
            kwargs["head_dense_bias"] = dense.bias is not None
            state.update(_linear_state(dense, "head.dense"))
            if norm is not None:
                state.update(_norm_state(norm, "head.norm", d, config, "the head's LayerNorm"))
        return kwargs, state
    # masked-lm: TfmForMaskedLM always has the dense -> activation -> norm transform, and a biased decoder.
    if len(transform) != 3:
        raise ValueError(
            "masked-lm `head` must be nn.Sequential(Linear(d, d), activation, LayerNorm(d), Linear(d, vocab)): "
            "TfmForMaskedLM's head has that transform (BERT's). A plain Linear head is a token classifier over the "
            f"vocabulary (task 'token-classification'); got {head}."
        )
    dense, activation, norm = _transform(transform, d, config, "masked-lm")
    if dropout > 0:
        logger.warning(f"The masked-LM head's dropout (p={dropout}) has no place in TfmForMaskedLM; training only.")
    state = {
        **_linear_state(dense, "head.dense"),
        **_norm_state(norm, "head.norm", d, config, "the masked-LM head's LayerNorm"),
        "lm_head.weight": out.weight.detach(),
        # TfmForMaskedLM's decoder always has a bias: a zero one is the same layer.
        "lm_head.bias": out.bias.detach() if out.bias is not None else torch.zeros(out.out_features),
    }
    return {"mlm_head_activation": activation, "head_dense_bias": dense.bias is not None}, state


def _transform(parts: list[nn.Module], d: int, config: dict, task: str) -> tuple[nn.Linear, str, nn.Module | None]:
    """(dense, activation name, norm or None) of a head's Linear(d, d) -> activation [-> LayerNorm] transform."""
    if len(parts) not in (2, 3) or type(parts[0]) is not nn.Linear or parts[0].weight.shape != (d, d):
        raise ValueError(f"{task} head transform must be Linear({d}, {d}), activation[, LayerNorm({d})]; got {parts}.")
    activation = parts[1]
    name = HEAD_ACTIVATIONS.get(type(activation))
    if isinstance(activation, nn.GELU):
        name = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}[activation.approximate]
    if name is None:
        raise ValueError(f"{task} head activation {activation} is not relu, gelu, tanh or silu: no exact match")
    norm = parts[2] if len(parts) == 3 else None
    return parts[0], name, norm


__all__ = ["TASKS", "detect_sinusoidal_layout", "from_torch", "sinusoidal_table"]
