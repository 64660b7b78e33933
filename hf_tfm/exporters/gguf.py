"""GGUF for llama.cpp, written from `TfmConfig` + `state_dict` with the `gguf` package (no llama.cpp converter).

A config is written as the llama.cpp architecture whose graph computes it exactly, or refused with every knob that
keeps each architecture from it:

* `llama`: RoPE (default, linear or llama3 scaling), RMSNorm, pre-norm, SwiGLU, GQA, no biases, tied or untied head.
  llama.cpp rotates adjacent pairs, hf_tfm halves (rotate-half), so q/k rows are permuted as llama.cpp's converter
  does (and transformers' GGUF loader undoes). With experts on every layer it is Mixtral's block (llama.cpp writes
  Mixtral as `llama`): softmax over the experts, top-k probabilities renormalised, no shared expert.
* `qwen2`: the same block with q/k/v biases and `heads * head_dim == hidden`; RoPE in the halves layout (no permute).
* `qwen3`: the llama block with an RMSNorm of each head's queries and keys before RoPE (`qk_norm`, head scope), any
  `head_dim`, no biases; RoPE in the halves layout (no permute).
* `gpt2`: learned positions, LayerNorm, GELU MLP (tanh approximation, llama.cpp's only GELU), biases everywhere.
  Exact through transformers' loader; llama.cpp's CPU GELU reads an fp16 table, so its own logits are near (~1e-3).
* `bloom`: ALiBi (the paper's slopes, llama.cpp's `max_alibi_bias` 8), a LayerNorm after the embeddings, then the
  gpt2 block without position tables: LayerNorm, tanh-GELU MLP of 4 * hidden, biases everywhere, no GQA. Its graph
  adds `slope * j` where hf_tfm adds `-slope * |i - j|`: per query row they differ by a constant, which the causal
  softmax removes.
* `refact`: the llama block (RMSNorm, SwiGLU, no biases, GQA) with ALiBi instead of RoPE.
* `gptneox`: RoPE, LayerNorm, tanh-GELU MLP, biases everywhere, the attention and the feed-forward one after the other
  or in parallel (`parallel_residual`: x + attn(n1(x)) + mlp(n2(x))).
* `mpt`: LayerNorm, tanh-GELU MLP, any biases, GQA, with ALiBi or an absolute position table (learned, or hf_tfm's
  sinusoidal table written out row by row).
* `bert` (an encoder, `TfmModel`, for embeddings): BERT's block: learned positions (token type 0 added: llama.cpp
  passes no types), an embedding LayerNorm, post-norm LayerNorm layers, tanh-GELU MLP, no final norm.
* `qwen2moe`: Qwen2-MoE's block: the qwen2 attention (q/k/v biases), every layer's feed-forward routed experts
  (softmax over the experts, top-k probabilities not renormalised: `norm_topk_prob=False`) plus the sigmoid-gated
  shared expert.
* `qwen3moe`: Qwen3-MoE's block: the qwen3 attention (per-head qk-norm, no biases), every layer's feed-forward routed
  experts with the top-k probabilities renormalised (`norm_topk_prob=True`), no shared expert.

The folder's tokenizer goes in as the llama.cpp vocabulary that tokenizes as it does (`gguf_vocab`: byte-level BPE with
a pre-tokenizer llama.cpp names, SentencePiece-shaped BPE, WordPiece), or the export is refused before anything is
written. K-quants (`q4_k_m`) are llama.cpp's own: the file is written in F32, then llama.cpp's quantizer rewrites it.
`verify_gguf` runs a written file in llama.cpp itself (llama-cpp-python, in a process of its own) or loads it back
through transformers' own GGUF loader (an in-tree Llama, Qwen2, Qwen3, GPT-2, BLOOM, Qwen2-MoE, Qwen3-MoE or Mixtral),
and compares logits and greedy tokens; where llama.cpp is available it also compares llama.cpp's tokenizer with the
folder's (`gguf_vocab.tokenizer_agreement`).
"""

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import staged_file
from ..checks import Need, need, need_all, need_default_head_dim, need_no_gqa, need_rope
from ..configuration import TfmConfig, TfmSeq2SeqConfig
from ..programs import run_program
from ._common import agreement_report, encoder_max_diff, eos_ids, greedy_references, other_routes, prompt_ids
from .gguf_vocab import Vocabulary, gguf_vocabulary, load_tokenizer, tokenizer_agreement, write_vocabulary
from .registry import ExportFormat

RUNTIME = "llama.cpp"
ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "gpt2",
    "bloom",
    "qwen2moe",
    "qwen3moe",
    "refact",
    "gptneox",
    "mpt",
    "bert",
)
# The architectures transformers' GGUF loader reads back (llama with experts through an in-tree Mixtral built here):
# `verify_gguf` checks the others in llama.cpp only.
TRANSFORMERS_READS = ("llama", "qwen2", "qwen3", "gpt2", "bloom", "qwen2moe", "qwen3moe")
LAYERNORM = ("gpt2", "bloom", "gptneox", "mpt")  # LayerNorm + tanh-GELU MLP blocks, one fused q/k/v projection
MOE = ("qwen2moe", "qwen3moe")  # experts on every layer (llama takes them too: Mixtral's block)
# --quantize value -> (GGMLQuantizationType name for 2-D weights, LlamaFileType name for general.file_type)
TYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M"),  # llama.cpp's quantizer: Q4_K, with Q6_K for half the v/down projections
}
# Types only llama.cpp's quantizer writes (the gguf package has no K-quant encoder) -> its llama_ftype constant
LLAMA_CPP_QUANTIZED = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
LLAMA_CPP_HINT = (
    "needs llama.cpp: pip install llama-cpp-python, or set HF_TFM_LLAMA_CPP_PYTHON to a Python that has it"
)
QUANT_BLOCK = 32  # Q8_0 / Q4_0 quantize runs of 32 values along the last dimension
# RoPE scaling types the llama.cpp graph computes as transformers does: linear is its `freq_scale`, llama3 its
# `rope_freqs` factors. dynamic (recomputed per length) and longrope have no llama/qwen form; yarn is not checked.
ROPE_TYPES = {"llama": ("default", "linear", "llama3")}
ROPE_TYPES |= dict.fromkeys(("qwen2", "qwen3", "qwen2moe", "qwen3moe", "gptneox"), ("default", "linear"))
# Weights kept in F32 whatever the type, as llama.cpp's converter and quantizer keep them: the routers (rounded, a
# router sends tokens to other experts) and the position table.
F32_WEIGHTS = ("ffn_gate_inp.weight", "position_embd.weight")
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # ggml's GELU is the tanh approximation
NO_SLIDING = "only 'full_attention' (its graph has no sliding window)"
# What a refusal names besides: after an in-tree family, its next step and the other runtimes; else the runtimes
ROUTES = (
    "then that family's own tools",
    "ONNX / ExecuTorch through transformers.exporters (they trace hf_tfm's code)",
    "No in-tree family takes it either (`hf-tfm convert` refuses it); ONNX / ExecuTorch through "
    "transformers.exporters trace hf_tfm's own code.",
)
INSTALL_HINT = 'GGUF export needs the `gguf` package: pip install gguf (or pip install "hf-tfm[export]")'


def _import_gguf():
    try:
        import gguf
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return gguf


# ---------------------------------------------------------------------------------------------------------------------
# Which architecture, or why none


# What each llama.cpp graph written here computes, as tables like convert/'s: knob -> the value it needs, or a `Need`
# (a predicate, the words a refusal gives, when it applies). A refusal names the knobs in the order they are checked:
# a decoder's inputs, its feed-forward (dense or experts), its layout, its positions, then its block.
DECODER = {"is_causal": Need(True, "True (a decoder)"), "add_cross_attention": False}
DENSE = {"num_experts": Need(None, "None (no mixture-of-experts layers)")}


def has_experts(config: TfmConfig) -> bool:
    return config.num_experts is not None


# Experts on every layer (llama's graph takes them too: Mixtral's block)
EXPERTS = {
    "num_experts": Need(lambda v: v is not None, "experts (a number, not None)"),
    "mlp_only_layers": Need(lambda v: not v, "none (experts on every layer)", has_experts),
    "decoder_sparse_step": Need(1, "1 (experts on every layer)", has_experts),
}
# How the graph routes: qwen2moe scales by the softmax's top-k probabilities as they are, then adds its shared expert
RENORMALISED = {
    "norm_topk_prob": Need(True, "True (top-k probabilities renormalised)", has_experts),
    "shared_expert_intermediate_size": Need(None, "None (no shared expert)", has_experts),
}
ROUTING = dict.fromkeys(("llama", "qwen3moe"), RENORMALISED) | {
    "qwen2moe": {
        "norm_topk_prob": Need(False, "False (top-k probabilities not renormalised)", has_experts),
        "shared_expert_intermediate_size": Need(
            lambda v: v is not None, "a width (its sigmoid-gated shared expert is always there)", has_experts
        ),
    }
}
EITHER = Need(lambda value: True)  # a knob the graph computes for any value (a placeholder that keeps the order)
FULL_ATTENTION = Need(lambda v: set(v) == {"full_attention"}, NO_SLIDING)
# Pre-norm decoder layout; `LAYOUT` gives an architecture's changes
PRE_NORM = {
    "norm_position": "pre",
    "final_norm": True,
    "first_layer_attn_norm": True,
    "embedding_norm": False,
    "parallel_residual": False,
    "qk_norm": False,
    "qk_norm_scope": EITHER,
    "type_vocab_size": 0,
    # An untied model's scale is folded into its token table; a tied one's would scale the output layer too
    "embedding_scale": Need(
        lambda v: v == 1.0,
        "1.0 with tied embeddings (the scale is folded into an untied model's token table)",
        lambda config: config.tie_word_embeddings,
    ),
    "lm_head_bias": False,
    "layer_types": FULL_ATTENTION,
}
QK_NORM = {
    "qk_norm": Need(True, "True (its q/k norms are always there)"),
    "qk_norm_scope": Need("head", "'head' (its q/k norms act per head)", lambda config: config.qk_norm),
}
LAYOUT = {
    "bloom": {"embedding_norm": Need(True, "True (its LayerNorm after the embeddings)")},
    "gptneox": {"parallel_residual": EITHER},  # either residual layout
    "qwen3": QK_NORM,
    "qwen3moe": QK_NORM,
}
# Positions: RoPE (of `ROPE_TYPES[arch]`) where an architecture has no entry here
ABSOLUTE = ("alibi", "learned", "sinusoidal")
POSITIONS = {
    "refact": {"position_embedding_type": "alibi"},  # llama.cpp's fixed max_alibi_bias 8: the paper's slopes
    "gpt2": {"position_embedding_type": "learned"},
    "bloom": {"position_embedding_type": "alibi"},
    "mpt": {"position_embedding_type": Need(lambda v: v in ABSOLUTE, f"one of {list(ABSOLUTE)}")},
}
# The blocks: llama's (RMSNorm, SwiGLU, no biases), with q/k/v biases (qwen2's), or LayerNorm + tanh-GELU MLP
LLAMA_BLOCK = {
    "norm_type": "rmsnorm",
    "ffn_type": "glu",
    "hidden_act": "silu",
    "mlp_bias": False,
    "attention_out_bias": False,
    "attention_bias": False,
}
QKV_BIAS_BLOCK = LLAMA_BLOCK | {"attention_bias": Need(True, "True (q/k/v biases)")}
TANH_GELU = Need(lambda v: v in GELU_TANH, f"a tanh GELU, one of {list(GELU_TANH)}")
MPT_BLOCK = {  # mpt's biases are each optional
    "position_offset": Need(0, when=lambda config: config.position_embedding_type == "learned"),
    "norm_type": "layernorm",
    "ffn_type": "mlp",
    "hidden_act": TANH_GELU,
}
LAYERNORM_BLOCK = MPT_BLOCK | dict.fromkeys(("norm_bias", "mlp_bias", "attention_bias", "attention_out_bias"), True)
BLOCKS = dict.fromkeys(("llama", "qwen3", "qwen3moe", "refact"), LLAMA_BLOCK)
BLOCKS |= dict.fromkeys(("qwen2", "qwen2moe"), QKV_BIAS_BLOCK)
BLOCKS |= dict.fromkeys(("gpt2", "bloom", "gptneox"), LAYERNORM_BLOCK) | {"mpt": MPT_BLOCK}
# BERT's encoder block, llama.cpp's `bert` graph (embeddings; no KV cache, no task head); then `hidden/heads` heads
# and full attention
BERT = {
    "is_causal": Need(False, "False (an encoder)"),
    "add_cross_attention": False,
    **DENSE,
    "position_embedding_type": "learned",
    "position_offset": 0,
    "embedding_norm": Need(True, "True (its LayerNorm after the embeddings)"),
    "norm_position": "post",
    "final_norm": Need(False, "False (no norm after the last layer)"),
    "norm_type": "layernorm",
    "norm_bias": True,
    "parallel_residual": False,
    "qk_norm": False,
    "ffn_type": "mlp",
    "hidden_act": TANH_GELU,
    "embedding_scale": Need(1.0, "1.0 (it scales no embeddings)"),
}


def _blockers(config: TfmConfig, arch: str) -> list[str]:
    """The knobs that keep `config` from the llama.cpp architecture `arch` (empty: it computes the config)."""
    out: list[str] = []
    family = f"{RUNTIME} {arch}"
    if arch == "bert":
        need_all(config, out, family, BERT)
        need_default_head_dim(config, out, family)
        need_all(config, out, family, {"layer_types": FULL_ATTENTION})
        return out
    experts = arch in MOE or (arch == "llama" and config.num_experts is not None)  # llama + experts: Mixtral's
    need_all(config, out, family, DECODER | (EXPERTS | ROUTING[arch] if experts else DENSE))
    need_all(config, out, family, PRE_NORM | LAYOUT.get(arch, {}))
    need_all(config, out, family, POSITIONS.get(arch, {"position_embedding_type": "rope"}))
    if arch in ROPE_TYPES and config.position_embedding_type == "rope":
        need_rope(config, out, family, ROPE_TYPES[arch])
    if arch == "bloom":  # transformers' BLOOM, the loader that checks the file, builds a 4 * hidden MLP
        width = 4 * config.hidden_size
        need(config, out, family, "intermediate_size", width, f"{width} (4 * hidden_size, BLOOM's MLP)")
    need_all(config, out, family, BLOCKS[arch])
    if arch in ("gpt2", "bloom"):
        need_no_gqa(config, out, family)
    if arch in ("qwen2", "qwen2moe", *LAYERNORM):
        need_default_head_dim(config, out, family)
    return out


def gguf_architecture_blockers(config: TfmConfig | TfmSeq2SeqConfig) -> dict[str, list[str]]:
    """For each llama.cpp architecture hf_tfm writes, the knobs that keep `config` from it (empty: it takes it)."""
    if isinstance(config, TfmSeq2SeqConfig):
        why = "an encoder-decoder (TfmSeq2SeqConfig): llama.cpp's decoder architectures have no cross-attention"
        return {arch: [why] for arch in ARCHITECTURES}
    return {arch: _blockers(config, arch) for arch in ARCHITECTURES}


def gguf_blockers(config: TfmConfig | TfmSeq2SeqConfig) -> list[str]:
    """Empty when some llama.cpp architecture computes `config` exactly; else every knob that blocks each one (each
    message names the architecture)."""
    found = gguf_architecture_blockers(config)
    if any(not blockers for blockers in found.values()):
        return []
    return [message for blockers in found.values() for message in blockers]


def gguf_architecture(config: TfmConfig | TfmSeq2SeqConfig) -> str:
    """The llama.cpp architecture `config` is written as, or a `ValueError` naming every blocking knob, the runtime,
    and the routes that do take the config."""
    found = gguf_architecture_blockers(config)
    arch = next((arch for arch, blockers in found.items() if not blockers), None)
    if arch is not None:
        return arch
    ranked = sorted(found.items(), key=lambda item: len(item[1]))
    closest, blockers = ranked[0]
    others = "; ".join(f"{name}: {'; '.join(b)}" for name, b in ranked[1:])
    raise ValueError(
        f"No {RUNTIME} (GGUF) architecture computes this hf_tfm config exactly. Closest: {closest}, blocked by: "
        f"{'; '.join(blockers)}. Also blocked: {others}. {other_routes(config, *ROUTES)}"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Tensors


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotate-half rows (pairs i, i + d/2) -> llama.cpp's adjacent pairs (2i, 2i + 1), per head, as its converter."""
    per_head = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])  # (H, 2, D/2, ...)
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _llama3_rope_factors(config: TfmConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """llama.cpp divides each default frequency by `rope_freqs`: the default over the llama3-scaled frequencies."""
    dim = config.head_dim
    default = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return default / inv_freq.float()


def _bert_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A post-norm encoder's tensors under llama.cpp's BERT names (a base model: no `model.` prefix)."""
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    names = [("embed_tokens", "token_embd"), ("embed_positions", "position_embd"), ("embed_norm", "token_embd_norm")]
    names.append(("token_type_embeddings", "token_types"))
    for i in range(model.config.num_hidden_layers):
        layer, blk = f"layers.{i}.", f"blk.{i}."
        names += [(f"{layer}self_attn.{n}_proj", f"{blk}attn_{n}") for n in "qkv"]
        names += [
            (layer + "self_attn.o_proj", blk + "attn_output"),
            (layer + "attn_norm", blk + "attn_output_norm"),  # post-norm: after the attention's residual add
            (layer + "mlp.up_proj", blk + "ffn_up"),
            (layer + "mlp.down_proj", blk + "ffn_down"),
            (layer + "mlp_norm", blk + "layer_output_norm"),  # after the feed-forward's residual add
        ]
    return {
        f"{theirs}.{kind}": state[f"{ours}.{kind}"]
        for ours, theirs in names
        for kind in ("weight", "bias")
        if f"{ours}.{kind}" in state
    }


def _tensors(model: torch.nn.Module, arch: str) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> tensor in PyTorch's (out, in) layout (the writer reverses the dims)."""
    if arch == "bert":
        return _bert_tensors(model)
    config: TfmConfig = model.config
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    embed = state["model.embed_tokens.weight"]
    if config.embedding_scale != 1.0:  # untied (the blockers say): hf_tfm's `embeddings * scale`, precomputed
        embed = embed * config.embedding_scale
    out = {"token_embd.weight": embed, "output_norm.weight": state["model.norm.weight"]}
    layernorm = arch in LAYERNORM  # one fused q/k/v projection; a bias where the model has one
    if config.position_embedding_type == "learned":
        out["position_embd.weight"] = state["model.embed_positions.weight"]
    elif config.position_embedding_type == "sinusoidal":  # the table hf_tfm computes, one row per position
        positions = torch.arange(config.max_position_embeddings)[None]
        out["position_embd.weight"] = model.model.embed_positions(positions, torch.float32)[0].float()
    if arch == "bloom":
        out["token_embd_norm.weight"] = state["model.embed_norm.weight"]
        out["token_embd_norm.bias"] = state["model.embed_norm.bias"]
    # Tied: llama.cpp and transformers' loader fall back to token_embd, except in qwen2moe and gptneox, whose graphs
    # need output.weight
    if not config.tie_word_embeddings or arch in ("qwen2moe", "gptneox"):
        out["output.weight"] = state["lm_head.weight"]
    if arch == "llama" and config.rope_parameters["rope_type"] == "llama3":
        out["rope_freqs.weight"] = _llama3_rope_factors(config, model.model.rotary_emb.inv_freq)
    biases = [("model.norm", "output_norm")]
    for i in range(config.num_hidden_layers):
        layer, blk = f"model.layers.{i}.", f"blk.{i}."
        q, k = state[layer + "self_attn.q_proj.weight"], state[layer + "self_attn.k_proj.weight"]
        v = state[layer + "self_attn.v_proj.weight"]
        if arch == "llama":
            q, k = _permute(q, config.num_attention_heads), _permute(k, config.num_key_value_heads)
        if layernorm:  # one fused q/k/v projection, all queries first (llama.cpp's converters reorder to this)
            out[blk + "attn_qkv.weight"] = torch.cat([q, k, v])
            if config.attention_bias:
                out[blk + "attn_qkv.bias"] = torch.cat([state[f"{layer}self_attn.{n}_proj.bias"] for n in "qkv"])
        else:
            out.update({blk + "attn_q.weight": q, blk + "attn_k.weight": k, blk + "attn_v.weight": v})
            biases += [(f"{layer}self_attn.{name}_proj", f"{blk}attn_{name}") for name in "qkv"]
        if arch in ("qwen3", "qwen3moe"):  # (head_dim,) RMSNorm weights, shared by the heads
            out[blk + "attn_q_norm.weight"] = state[layer + "self_attn.q_norm.weight"]
            out[blk + "attn_k_norm.weight"] = state[layer + "self_attn.k_norm.weight"]
        out[blk + "attn_output.weight"] = state[layer + "self_attn.o_proj.weight"]
        out[blk + "attn_norm.weight"] = state[layer + "attn_norm.weight"]
        out[blk + "ffn_norm.weight"] = state[layer + "mlp_norm.weight"]
        if config.num_experts is not None:
            out.update(_expert_tensors(state, layer, blk))
        else:
            if not layernorm:
                out[blk + "ffn_gate.weight"] = state[layer + "mlp.gate_proj.weight"]
            out[blk + "ffn_up.weight"] = state[layer + "mlp.up_proj.weight"]
            out[blk + "ffn_down.weight"] = state[layer + "mlp.down_proj.weight"]
        biases += [
            (layer + "self_attn.o_proj", blk + "attn_output"),
            (layer + "attn_norm", blk + "attn_norm"),
            (layer + "mlp_norm", blk + "ffn_norm"),
            (layer + "mlp.up_proj", blk + "ffn_up"),
            (layer + "mlp.down_proj", blk + "ffn_down"),
        ]
    # Every bias the model has (each architecture's blockers keep out those its graph would ignore)
    out.update({f"{theirs}.bias": state[f"{ours}.bias"] for ours, theirs in biases if f"{ours}.bias" in state})
    return out


def _expert_tensors(state: dict[str, torch.Tensor], layer: str, blk: str) -> dict[str, torch.Tensor]:
    """A sparse layer's router, experts (3-D: expert, out, in) and shared expert, under llama.cpp's names."""
    gate, up = state[layer + "mlp.experts.gate_up_proj"].chunk(2, dim=1)  # (E, 2 I, H) -> 2 x (E, I, H)
    out = {
        blk + "ffn_gate_inp.weight": state[layer + "mlp.gate.weight"],  # (E, H)
        blk + "ffn_gate_exps.weight": gate.contiguous(),
        blk + "ffn_up_exps.weight": up.contiguous(),
        blk + "ffn_down_exps.weight": state[layer + "mlp.experts.down_proj"],  # (E, H, I)
    }
    if layer + "mlp.shared_expert_gate.weight" in state:
        out[blk + "ffn_gate_inp_shexp.weight"] = state[layer + "mlp.shared_expert_gate.weight"][0]  # (1, H) -> (H,)
        for ours, theirs in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            out[f"{blk}ffn_{theirs}_shexp.weight"] = state[f"{layer}mlp.shared_expert.{ours}.weight"]
    return out


def _add_tensor(writer, gguf, name: str, tensor: torch.Tensor, qtype: str) -> None:
    """Weights (2-D, and the experts' 3-D) in the requested type (F16 where a row does not split into 32-value blocks,
    as llama.cpp's converter falls back); 1-D tensors (norms, biases, RoPE factors, the shared expert's gate) and
    `F32_WEIGHTS` in F32."""
    data = tensor.numpy().astype("float32")
    full = data.ndim < 2 or name.endswith(F32_WEIGHTS)
    kind = gguf.GGMLQuantizationType.F32 if full else gguf.GGMLQuantizationType[qtype]
    if kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0) and data.shape[-1] % QUANT_BLOCK:
        kind = gguf.GGMLQuantizationType.F16
    if kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data)
    elif kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype("float16"))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)


# ---------------------------------------------------------------------------------------------------------------------
# Export


TAKES = "causal LMs (TfmForCausalLM) and encoders for embeddings (TfmModel)"
# The classes it takes -> the class that loads them (a TfmMoeModel folder is the backbone with experts: a TfmModel)
CLASSES = {"TfmForCausalLM": "TfmForCausalLM", "TfmModel": "TfmModel", "TfmMoeModel": "TfmModel"}


def _class_refusal(architecture: str) -> str | None:
    return None if architecture in CLASSES else f"GGUF export takes {TAKES}, not {architecture}"


def refusal(config: TfmConfig | TfmSeq2SeqConfig, architecture: str) -> str | None:
    """Why a model of this config and class is not written as GGUF (every blocking knob of every architecture), or
    None when one architecture takes it."""
    return _class_refusal(architecture) or "; ".join(gguf_blockers(config)) or None


def _load(model_or_folder: Any) -> tuple[torch.nn.Module, str | None]:
    from .. import modeling

    if isinstance(model_or_folder, (str, os.PathLike)):
        folder = Path(model_or_folder)
        config = TfmConfig.from_pretrained(folder)
        architecture = (getattr(config, "architectures", None) or ["TfmForCausalLM"])[0]
        refused = _class_refusal(architecture)
        if refused:
            raise ValueError(f"{folder}: {refused}.")
        gguf_architecture(config)  # refuse before loading any weight
        return getattr(modeling, CLASSES[architecture]).from_pretrained(folder), str(folder)
    if not isinstance(model_or_folder, (modeling.TfmForCausalLM, modeling.TfmModel)):
        raise ValueError(f"{_class_refusal(type(model_or_folder).__name__)}.")
    return model_or_folder, getattr(model_or_folder, "name_or_path", None) or None


def _write(
    writer, gguf, config: TfmConfig, arch: str, tensors: dict, vocab: Vocabulary, qtype: str, name: str
) -> None:
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType[TYPES[qtype][1]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    # llama's graph sizes its experts by the feed-forward length (the MoE ones by their expert length)
    mixtral = arch == "llama" and config.num_experts is not None
    writer.add_feed_forward_length(config.moe_intermediate_size if mixtral else config.intermediate_size)
    if config.num_experts is not None:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if config.shared_expert_intermediate_size is not None:
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    if arch in (*LAYERNORM, "bert"):
        writer.add_layer_norm_eps(config.norm_eps)
    else:
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch not in ("gpt2", "bloom"):
        writer.add_head_count_kv(config.num_key_value_heads)
    if arch == "bert":  # embeddings of the whole input, averaged (llama.cpp's server and tools can ask for others)
        writer.add_causal_attention(False)
        writer.add_pooling_type(gguf.PoolingType.MEAN)
    if arch == "bert" or vocab.model == "bert":  # the token-type table's size (llama.cpp's bert reads it)
        writer.add_token_type_count(max(config.type_vocab_size, 1))
    if config.position_embedding_type == "rope":
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        if config.rope_parameters["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(config.rope_parameters["factor"])
    if arch == "gptneox":
        writer.add_parallel_residual(config.parallel_residual)
    if arch == "mpt" and config.position_embedding_type == "alibi":  # 0 (the default) is no ALiBi
        writer.add_max_alibi_bias(8.0)
    write_vocabulary(writer, vocab)
    for tensor_name, tensor in tensors.items():
        _add_tensor(writer, gguf, tensor_name, tensor, TYPES[qtype][0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def output_path(out: str | os.PathLike, quantize: str | None = None) -> Path:
    """Where an export to `out` is written: `out`, or `out/model-<type>.gguf` for a folder."""
    out = Path(out)
    return out / f"model-{quantize or 'f32'}.gguf" if out.is_dir() else out


def export_gguf(
    model_or_folder: Any, out: str | os.PathLike, quantize: str | None = None, tokenizer: Any = None
) -> Path:
    """Write an hf_tfm causal LM (model or saved folder) as one GGUF file; see `hf_tfm.exporters.export`."""
    qtype = quantize or "f32"
    if qtype not in TYPES:
        raise ValueError(f"quantize={quantize!r}: GGUF types written here are {list(TYPES)}.")
    gguf = _import_gguf()
    python = llama_cpp_python() if qtype in LLAMA_CPP_QUANTIZED else None
    if qtype in LLAMA_CPP_QUANTIZED and python is None:
        raise ImportError(f"GGUF {qtype} is written by llama.cpp's quantizer: it {LLAMA_CPP_HINT}.")
    model, source = _load(model_or_folder)
    config = model.config
    arch = gguf_architecture(config)
    tokenizer, where = load_tokenizer(source, tokenizer)
    vocab = gguf_vocabulary(tokenizer, config, where)  # refused (ValueError) before anything is written
    out = output_path(out, qtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    name = Path(source).name if source else "hf_tfm"
    with torch.no_grad():
        tensors = _tensors(model, arch)
    # Written beside the output and renamed at the end (`staged_file`): a failed export leaves no file, an old one
    # stays whole. llama.cpp's quantizer reads an F32 file, written first in a scratch folder beside the output.
    with staged_file(out) as tmp, tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as scratch:
        f32 = Path(scratch) / "f32.gguf"
        writer = gguf.GGUFWriter(f32 if python else tmp, arch)
        try:
            _write(writer, gguf, config, arch, tensors, vocab, "f32" if python else qtype, name)
        except BaseException:
            writer.close()
            raise
        if python:  # llama.cpp's quantizer rewrites the F32 file, in a process of its own
            args = {"task": "quantize", "path": str(f32), "out": str(tmp), "ftype": LLAMA_CPP_QUANTIZED[qtype]}
            run_program("llama_cpp_side", {**args, "threads": torch.get_num_threads()}, RUNTIME, python=python)
    return out


def llama_cpp_python() -> str | None:
    """The Python that runs llama.cpp (llama-cpp-python) for K-quants and verification: $HF_TFM_LLAMA_CPP_PYTHON, else
    this one when it can import llama_cpp; None without either."""
    if os.environ.get("HF_TFM_LLAMA_CPP_PYTHON"):
        return os.environ["HF_TFM_LLAMA_CPP_PYTHON"]
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


# ---------------------------------------------------------------------------------------------------------------------
# Verification: in llama.cpp, or through transformers' GGUF loader


def verify_gguf(
    gguf_file: str | os.PathLike,
    model_or_folder: Any,
    prompts: list[list[int]] | list[str] | None = None,
    max_new_tokens: int = 32,
    fresh_process: bool = True,
    runtime: str | None = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Run `gguf_file` and compare it with the hf_tfm model it came from: greedy tokens (`max_new_tokens` per prompt,
    EOS suppressed on both sides) and the logits on hf_tfm's greedy sequences; and llama.cpp's tokenizer with the
    model's (`tokenizer`, else its folder's) on a few kilobytes of varied text (`gguf_vocab.TEXTS`).

    `runtime`: "llama.cpp" (llama-cpp-python, always in a process of its own: `llama_cpp_python()` says which Python)
    or "transformers" (transformers' own GGUF loader, in a fresh process unless `fresh_process=False`); None: the
    loader where it reads the architecture (`TRANSFORMERS_READS`), else llama.cpp. `prompts` are token ids, or texts
    for the folder's tokenizer; None: two texts of different lengths. Returns `tokens_equal`, `agreement` (the share of
    generated positions with equal tokens), `forced_agreement`, `max_logit_diff`, the `runtime`, the `class` that ran
    it (in-tree class or llama.cpp's version) and the file's `architecture` and `file_type`; then
    `tokenizer_agreement` (the share of texts both tokenizers give the same ids), `tokenizer_differs` (the texts that
    differ) and `detokenized_agreement`, or `tokenizer_agreement` None and `tokenizer_skipped` saying why (no
    llama.cpp, no tokenizer).
    """
    gguf = _import_gguf()
    gguf_file = Path(gguf_file).resolve()
    model, source = _load(model_or_folder)
    config = model.config
    prompts = prompt_ids(prompts, source)
    reader = gguf.GGUFReader(gguf_file)
    arch = _arch_of(reader)
    file_type = int(reader.fields["general.file_type"].parts[-1][0])
    runtime = runtime or ("transformers" if arch in TRANSFORMERS_READS else "llama.cpp")
    if runtime not in ("llama.cpp", "transformers"):
        raise ValueError(f"runtime={runtime!r}: GGUF files are verified in 'llama.cpp' or 'transformers'.")
    if runtime == "transformers" and arch not in TRANSFORMERS_READS:
        raise ValueError(f"transformers' GGUF loader does not read {arch!r} files: verify them in llama.cpp.")
    python = llama_cpp_python() if runtime == "llama.cpp" else None
    if runtime == "llama.cpp" and python is None:
        raise ImportError(f"Verifying a GGUF {arch} file {LLAMA_CPP_HINT}.")
    tokenization = _tokenizer_check(gguf_file, source, tokenizer)
    if arch == "bert":  # an encoder: each token's hidden state, in llama.cpp
        report = _verify_embeddings(gguf_file, model, prompts, arch, gguf.LlamaFileType(file_type).name, python)
        return report | tokenization
    references = greedy_references(model, prompts, max_new_tokens)
    with torch.no_grad():
        ours = [model(torch.tensor([ref])).logits[0].float() for ref in references]
    args = {
        "path": str(gguf_file),
        "prompts": [list(map(int, p)) for p in prompts],
        "references": references,
        "max_new_tokens": max_new_tokens,
    }
    if runtime == "llama.cpp":  # always in a process of its own: llama.cpp next to torch segfaulted here
        args |= {"task": "generate", "suppress": eos_ids(config), "threads": torch.get_num_threads()}
        theirs = run_program("llama_cpp_side", args, RUNTIME, python=python)
    else:
        args |= {
            "pad_token_id": config.pad_token_id,
            "overrides": _loader_overrides(reader, config, model),
            "mixtral": arch == "llama" and _number(reader, "llama.expert_count") is not None,
        }
        env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}  # a local file: no Hub
        loader = "transformers' GGUF loader"
        theirs = run_program("transformers_gguf_side", args, loader, fresh_process=fresh_process, env=env)
    return {
        "architecture": arch,
        "file_type": gguf.LlamaFileType(file_type).name,
        "runtime": runtime,
        "class": theirs["class"],
        **agreement_report(ours, theirs, references, prompts, False, max_new_tokens),
        **tokenization,
    }


def _tokenizer_check(path: Path, source: str | None, tokenizer: Any) -> dict[str, Any]:
    """llama.cpp's tokenizer against the model's (`gguf_vocab.tokenizer_agreement`) when both are at hand: it needs
    llama.cpp whichever runtime checks the numbers. Otherwise `tokenizer_agreement` None and why."""
    python = llama_cpp_python()
    if python is None:
        return {"tokenizer_agreement": None, "tokenizer_skipped": f"comparing tokenizers {LLAMA_CPP_HINT}"}
    try:
        loaded, _ = load_tokenizer(source, tokenizer)
    except ValueError as err:  # a model object, or a folder without its tokenizer
        return {"tokenizer_agreement": None, "tokenizer_skipped": str(err)}
    return tokenizer_agreement(path, loaded, python)


def _verify_embeddings(path: Path, model: Any, prompts: list, arch: str, file_type: str, python: str) -> dict:
    """Each prompt's hidden states in llama.cpp (run by `python`) against the encoder's (`max_diff`), as the other
    runtimes' encoder checks report them."""
    args = {"task": "embed", "path": str(path), "prompts": [list(map(int, p)) for p in prompts]}
    theirs = run_program("llama_cpp_side", {**args, "threads": torch.get_num_threads()}, RUNTIME, python=python)
    return {
        "architecture": arch,
        "file_type": file_type,
        "runtime": "llama.cpp",
        "outputs": list(theirs),
        "max_diff": encoder_max_diff(model, args["prompts"], theirs, path),
        "prompts": len(prompts),
    }


def _number(reader, key: str) -> float | None:
    field = reader.fields.get(key)
    return field.parts[-1][0].item() if field is not None else None


def _string(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    return bytes(field.parts[-1]).decode() if field is not None else None


def _loader_overrides(reader, config: TfmConfig, model: torch.nn.Module) -> dict[str, Any]:
    """Config values transformers' GGUF loader does not read from the file (llama.cpp does): given to it from the
    file's own keys, or for llama3 RoPE checked here (`rope_freqs` against the model's frequencies) and passed on."""
    arch = _arch_of(reader)
    if arch == "gpt2":  # it builds GPT-2 with 1024 positions and a 4 * hidden MLP
        return {
            "n_positions": _number(reader, "gpt2.context_length"),
            "n_inner": _number(reader, "gpt2.feed_forward_length"),
        }
    if arch == "bloom":  # its config ties the head by default; an untied file carries output.weight
        return {"tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}
    # Qwen3 builds head_dim 128 (its config's default) whatever the file's key length says
    extra = {"head_dim": int(_number(reader, "qwen3.attention.key_length"))} if arch == "qwen3" else {}
    if arch in MOE:  # the loader reads the expert count and top-k, not the widths, nor how the weights are scaled
        extra = {
            "moe_intermediate_size": int(_number(reader, f"{arch}.expert_feed_forward_length")),
            "norm_topk_prob": arch == "qwen3moe",
            "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        }
        if arch == "qwen2moe":
            extra["shared_expert_intermediate_size"] = int(
                _number(reader, "qwen2moe.expert_shared_feed_forward_length")
            )
    theta = _number(reader, f"{arch}.rope.freq_base")
    if _string(reader, f"{arch}.rope.scaling.type") == "linear":
        return {
            **extra,
            "rope_parameters": {
                "rope_type": "linear",
                "factor": _number(reader, f"{arch}.rope.scaling.factor"),
                "rope_theta": theta,
            },
        }
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return extra
    if config.rope_parameters["rope_type"] != "llama3":
        raise ValueError("the GGUF has rope_freqs, the model has no llama3 RoPE scaling.")
    expected = _llama3_rope_factors(config, model.model.rotary_emb.inv_freq)
    if not torch.allclose(torch.from_numpy(tensor.data.copy()).float(), expected, rtol=1e-6):
        raise ValueError("the GGUF's rope_freqs differ from the model's llama3 RoPE frequencies.")
    return {"rope_parameters": dict(config.rope_parameters)}


def _arch_of(reader) -> str:
    """`general.architecture` of an open `gguf.GGUFReader`."""
    return _string(reader, "general.architecture")


FORMAT = ExportFormat(
    name="gguf",
    title="GGUF (llama.cpp)",
    runtime=RUNTIME,
    takes=tuple(CLASSES),
    quantize=tuple(TYPES),
    requires=("gguf",),
    blockers=gguf_blockers,
    refusal=refusal,
    summary=lambda config, architecture: f"architecture {gguf_architecture(config)}",
    export=export_gguf,
    verify=verify_gguf,
    recognizes=lambda path: path.suffix == ".gguf",
    output_path=output_path,
    notes=dict.fromkeys(LLAMA_CPP_QUANTIZED, "needs llama.cpp"),
)


__all__ = [
    "ARCHITECTURES",
    "FORMAT",
    "LLAMA_CPP_QUANTIZED",
    "TRANSFORMERS_READS",
    "TYPES",
    "export_gguf",
    "gguf_architecture",
    "gguf_architecture_blockers",
    "gguf_blockers",
    "llama_cpp_python",
    "output_path",
    "verify_gguf",
]
