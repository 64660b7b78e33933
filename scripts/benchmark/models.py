"""The sizes, and the pairs the bench times: each in-tree model built from its config (random weights, no dropout),
and the hf_tfm side ``hf_tfm.from_hf(in_tree_model)``: an equivalent config, the same weights (copied), dtype and
attention backend (sdpa), so the two compute the same function.

- ``llama``: ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU, no biases, untied head)
- ``gpt2``: ``GPT2LMHeadModel`` (learned positions, LayerNorm, gelu_new MLP, biases, tied head)
- ``bert``: ``BertForSequenceClassification`` (post-norm, learned positions, token types, embedding LayerNorm, pooler)
- ``modernbert``: ``ModernBertForSequenceClassification`` (pre-norm, RoPE, bias-free LayerNorm, GeGLU, embedding norm,
  dense+act+norm head), all layers global attention (``layer_types``), as ``train_flops`` counts
- ``bart``: ``BartForConditionalGeneration`` (encoder-decoder: post-norm, learned positions, embedding LayerNorm, GELU
  MLP, biases, tied head; as many decoder as encoder layers)
- ``mixtral``: ``MixtralForCausalLM``, the llama pair's shape with a mixture of 8 SwiGLU experts in every layer, top-2,
  each half the llama FFN's width (the same active FFN FLOPs per token); ``train_flops`` counts the active parameters
  (router + 2 experts per token). Both sides run transformers' default experts kernel; extra rows time hf_tfm's
  train step and prefill on the eager and grouped_mm kernels, and batch-8 decoding on those and batched_mm, each in
  interleaved rounds

Every matmul has the same shape on both sides, so FLOPs match. The one layout difference (GPT-2's Conv1D ``x @ W`` and
fused ``c_attn`` where hf_tfm has ``nn.Linear`` and separate q/k/v) is listed in the JSON ``notes``, with BERT's pooler
and ModernBERT's head, which both sides run and ``train_flops`` leaves out (one row per sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    ModernBertConfig,
    ModernBertForSequenceClassification,
    PreTrainedConfig,
)

from hf_tfm import from_hf

SIZES = {
    # hidden, layers, heads, vocab; optional: kv_heads (grouped-query attention; default heads), intermediate (the
    # SwiGLU width; default glu_intermediate(hidden)), positions (max_position_embeddings; default 512) and pairs (the
    # only pairs the size builds; default all)
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 512},
    "small": {"hidden": 256, "layers": 4, "heads": 4, "vocab": 8192},
    "base": {"hidden": 768, "layers": 12, "heads": 12, "vocab": 16384},
    # TinyLlama-1.1B's shape, with random weights (nothing is downloaded): a Llama, so the llama pair only
    "tinyllama": {
        "hidden": 2048,
        "layers": 22,
        "heads": 32,
        "kv_heads": 4,
        "intermediate": 5632,
        "vocab": 32000,
        "positions": 2048,
        "pairs": ("llama",),
    },
}
SHAPES = {
    # train/prefill batch x seq; decode prompt / new tokens
    "tiny": {"batch": 2, "seq": 32, "prompt": 8, "new": 4, "decode_batches": (1, 2)},
    "small": {"batch": 8, "seq": 256, "prompt": 32, "new": 64, "decode_batches": (1, 8)},
    "base": {"batch": 8, "seq": 256, "prompt": 32, "new": 64, "decode_batches": (1, 8)},
    "tinyllama": {"batch": 8, "seq": 256, "prompt": 32, "new": 64, "decode_batches": (1, 8)},
}
# MiB of fp32 weights in the streaming-bandwidth GEMV: well beyond the caches (the development machine's L3 holds
# 480 MiB), except for the test's tiny size
BANDWIDTH_MIB = {"tiny": 16, "small": 2048, "base": 2048, "tinyllama": 2048}
ALL_TASKS = (
    "train",
    "prefill",
    "decode_b1",
    "decode_b8",
    "cls_train",
    "s2s_train",
    "s2s_generate_b1",
    "s2s_generate_b8",
)
PAIR_TASKS = {
    "llama": ("train", "prefill", "decode_b1", "decode_b8"),
    "gpt2": ("train", "prefill", "decode_b1", "decode_b8"),
    "bert": ("cls_train",),
    "modernbert": ("cls_train",),
    "bart": ("s2s_train", "s2s_generate_b1", "s2s_generate_b8"),
    "mixtral": ("train", "prefill", "decode_b1", "decode_b8"),
}
CAUSAL_PAIRS = ("llama", "gpt2", "mixtral")
NUM_LABELS = 2
NUM_EXPERTS, TOP_K = 8, 2
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
NOTES = {
    "gpt2": "GPT-2 uses Conv1D (x @ W) and a fused c_attn where hf_tfm uses nn.Linear (x @ W.T) and separate q/k/v "
    "projections: same FLOPs.",
    "bert": "BERT's pooler (hidden x hidden + tanh on the [CLS] row) is hf_tfm's classifier dense: both sides run it; "
    "not counted in train_flops (negligible).",
    "modernbert": "ModernBERT: all layers global attention (layer_types), so attention work matches train_flops; its "
    "head's dense+act+norm on the pooled row runs on both sides (not counted in train_flops, negligible).",
    "mixtral": f"Mixtral: {NUM_EXPERTS} experts, top-{TOP_K}, each half the llama FFN's width; train_flops counts the "
    "active parameters (router + experts each token uses), tokens per expert vary with the routing. Both sides run "
    "transformers' default experts kernel (grouped_mm).",
}

# (in, out) of a matmul weight, per token of the step's sequence; seq2seq: (in, out, rows per step)
Linears = list[tuple[int, ...]]


def glu_intermediate(hidden: int) -> int:
    return 64 * ((8 * hidden // 3 + 63) // 64)


def builds(size: str, pair: str) -> bool:
    """Whether `size` builds pair `pair` (TinyLlama's shape is a Llama's only)."""
    return pair in SIZES[size].get("pairs", PAIR_TASKS)


@dataclass
class Pair:
    name: str
    ours: nn.Module
    theirs: nn.Module
    theirs_name: str
    kind: str  # "causal", "encoder" or "seq2seq"
    linears: Linears = field(default_factory=list)  # every matmul weight's
    attn: dict = field(default_factory=dict)  # layers, heads, head_dim, causal
    notes: str = ""


def s2s_shapes(shp: dict) -> tuple[int, int]:
    """(source, target) lengths of the seq2seq train step."""
    return shp["seq"], max(2, shp["seq"] // 4)


def _dims(s: dict) -> dict:
    return {
        "vocab_size": s["vocab"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "max_position_embeddings": s.get("positions", 512),
    }


def _stack(s: dict, ffn: Linears, kv_heads: int, head: bool) -> Linears:
    """Every layer's q, k, v and o (k and v narrower with grouped-query attention), then its FFN's, then the LM
    head's when `head`."""
    h = s["hidden"]
    kv = kv_heads * (h // s["heads"])
    return [(h, h), (h, kv), (h, kv), (h, h), *ffn] * s["layers"] + ([(h, s["vocab"])] if head else [])


def _glu(h: int, inter: int) -> Linears:  # gate and up, then down
    return [(h, inter), (h, inter), (inter, h)]


def _llama(s: dict, shp: dict) -> tuple[type, PreTrainedConfig, Linears]:
    h, inter, kv = s["hidden"], s.get("intermediate", glu_intermediate(s["hidden"])), s.get("kv_heads", s["heads"])
    gqa = {"num_key_value_heads": kv, "intermediate_size": inter}
    cfg = LlamaConfig(**_dims(s), **IDS, **gqa, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return LlamaForCausalLM, cfg, _stack(s, _glu(h, inter), kv, head=True)


def _mixtral(s: dict, shp: dict) -> tuple[type, PreTrainedConfig, Linears]:
    h, kv = s["hidden"], s.get("kv_heads", s["heads"])
    inter = s.get("intermediate", glu_intermediate(h)) // TOP_K
    moe = {"num_local_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K, "num_key_value_heads": kv}
    cfg = MixtralConfig(
        **_dims(s), **IDS, **moe, intermediate_size=inter, rms_norm_eps=1e-6, tie_word_embeddings=False
    )
    # per token: the router, then top-k experts (GLU: gate, up, down each)
    return MixtralForCausalLM, cfg, _stack(s, [(h, NUM_EXPERTS)] + _glu(h, inter) * TOP_K, kv, head=True)


def _gpt2(s: dict, shp: dict) -> tuple[type, PreTrainedConfig, Linears]:
    h, inter = s["hidden"], 4 * s["hidden"]
    dims = {"vocab_size": s["vocab"], "n_embd": h, "n_layer": s["layers"], "n_head": s["heads"], "n_positions": 512}
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    cfg = GPT2Config(**dims, **IDS, **no_dropout, n_inner=inter, activation_function="gelu_new")
    return GPT2LMHeadModel, cfg, _stack(s, [(h, inter), (inter, h)], s["heads"], head=True)


def _bert(s: dict, shp: dict) -> tuple[type, PreTrainedConfig, Linears]:
    h, inter = s["hidden"], 4 * s["hidden"]
    no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    cfg = BertConfig(**_dims(s), **no_dropout, intermediate_size=inter, num_labels=NUM_LABELS, pad_token_id=0)
    return BertForSequenceClassification, cfg, _stack(s, [(h, inter), (inter, h)], s["heads"], head=False)


def _modernbert(s: dict, shp: dict) -> tuple[type, PreTrainedConfig, Linears]:
    h, inter, layers = s["hidden"], glu_intermediate(s["hidden"]), s["layers"]
    # All layers global (the default alternates with sliding-window layers), as train_flops counts.
    kwargs = dict(**_dims(s), **IDS, cls_token_id=1, sep_token_id=2, intermediate_size=inter, num_labels=NUM_LABELS)
    try:
        cfg = ModernBertConfig(**kwargs, layer_types=["full_attention"] * layers)
    except StrictDataclassError:  # transformers < 5.2x rejects all-global layers at init; set them after it
        cfg = ModernBertConfig(**kwargs)
        cfg.layer_types = ["full_attention"] * layers
    return ModernBertForSequenceClassification, cfg, _stack(s, _glu(h, inter), s["heads"], head=False)


def _bart(s: dict, shp: dict) -> tuple[type, PreTrainedConfig, Linears]:
    h, inter, layers = s["hidden"], 4 * s["hidden"], s["layers"]
    sides = {
        f"{side}_{k}": v
        for side in ("encoder", "decoder")
        for k, v in (("layers", layers), ("attention_heads", s["heads"]), ("ffn_dim", inter))
    }
    no_dropout = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
    cfg = BartConfig(vocab_size=s["vocab"], d_model=h, max_position_embeddings=512, **sides, **no_dropout, **IDS)
    cfg.decoder_start_token_id = 1
    src, tgt = shp["batch"] * s2s_shapes(shp)[0], shp["batch"] * s2s_shapes(shp)[1]
    encoder = [(h, h, src)] * 4 + [(h, inter, src), (inter, h, src)]
    # decoder: self-attention and FFN on the target; cross-attention q/o on the target, k/v on the source
    decoder = (
        [(h, h, tgt)] * 4 + [(h, h, tgt), (h, h, src), (h, h, src), (h, h, tgt)] + [(h, inter, tgt), (inter, h, tgt)]
    )
    return BartForConditionalGeneration, cfg, (encoder + decoder) * layers + [(h, s["vocab"], tgt)]


# pair -> (size, task shapes) -> (in-tree class, its config, the (in, out) shape of each of its matmuls)
IN_TREE: dict[str, Callable[[dict, dict], tuple[type, PreTrainedConfig, Linears]]] = {
    "llama": _llama,
    "gpt2": _gpt2,
    "bert": _bert,
    "modernbert": _modernbert,
    "bart": _bart,
    "mixtral": _mixtral,
}


def in_tree_model(name: str, size: str, dtype: torch.dtype, attn: str, shp: dict) -> tuple[nn.Module, Linears]:
    """The in-tree model of pair `name` (random weights, no dropout) and the (in, out) shape of each of its matmuls."""
    if name not in IN_TREE:
        raise ValueError(name)
    cls, cfg, linears = IN_TREE[name](SIZES[size], shp)
    return cls._from_config(cfg, attn_implementation=attn, dtype=dtype), linears


def build_pair(name: str, size: str, dtype: torch.dtype, attn: str, device: str) -> Pair:
    """The in-tree model and `from_hf` of it: equivalent config, same weights, same dtype and attention backend."""
    theirs, linears = in_tree_model(name, size, dtype, attn, SHAPES[size])
    ours = from_hf(theirs)
    kind = "causal" if name in CAUSAL_PAIRS else "seq2seq" if name == "bart" else "encoder"
    pair = Pair(name, ours, theirs, type(theirs).__name__, kind, linears, notes=NOTES.get(name, ""))
    s = SIZES[size]
    pair.attn = {
        "layers": s["layers"],
        "heads": s["heads"],
        "head_dim": s["hidden"] // s["heads"],
        "causal": kind == "causal",
    }
    for model in (pair.ours, pair.theirs):
        model.to(device)
        if pair.kind in ("causal", "seq2seq"):  # decode exactly `new` tokens: no EOS stop, same processors for both
            gc_ = model.generation_config
            gc_.eos_token_id = None
            gc_.pad_token_id = 0
            gc_.do_sample = False
            gc_.forced_eos_token_id = gc_.forced_bos_token_id = None
    return pair


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
