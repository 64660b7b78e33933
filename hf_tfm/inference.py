"""One call for the fastest decoding a saved model gets on this machine: quantized weights, a static KV cache and a
compiled decode step, behind the ordinary `generate()`.

    model = load_for_inference("my-model", quantize="q8")  # or None, "int8", "int4", "nf4"
    model.generate(**tokenizer("def ", return_tensors="pt"), max_new_tokens=64)

transformers' `generate()` compiles the model's forward for the decode steps when the cache is a static one and the
generation config holds a `CompileConfig`; on a CPU it does so only when that config's private `_compile_all_devices`
flag is set (it assumes compilation pays on accelerators only). Both are set here, in `model.generation_config`, so
every later `generate()` call takes that path; a call can still pass `disable_compile=True`. The first call compiles
(seconds to a minute on a CPU), each new cache length recompiles once before shapes turn dynamic, and tokens
unquantized are the eager ones (tests/test_generation.py).

A decode step multiplies one token's vector by every weight matrix, so its speed is the rate at which the weights
stream from memory. `nn.Linear` on a CPU hands that product to MKL, whose GEMV with one row read the weights at 10
GB/s on this project's 2-core machines, where Inductor's own code for the same product written as `(x * W).sum(-1)`
read them at 22-27 GB/s (scripts/bench.py, docs/fast-inference.md). So the compiled step swaps every plain
`nn.Linear` for `StreamingLinear`, the same module with that formula for a few tokens; and `quantize="q8"` stores
int8 weights with a scale per output row (`Int8StreamingLinear`), which Inductor converts inside the same loop: a
quarter of fp32's bytes, no dequantized copy.
"""

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, CompileConfig, PreTrainedModel
from transformers.utils import logging

from .quantization import NATIVE_SETTINGS, quantization_kwargs

logger = logging.get_logger(__name__)

# Up to this many tokens (batch x length) a linear layer streams its weights with `(x * W).sum(-1)`; past it (a
# prompt's prefill) a matrix product reuses each weight across tokens, which MKL's GEMM does better. Measured on the
# bench's base shape: fp32 streaming beat MKL at one token only (8 tokens: 55 vs 49 ms a step); int8 streaming beat
# dequantize-then-GEMM up to 8 tokens (43 vs 101 ms).
STREAMING_TOKENS = {"float": 1, "int8": 8}


def _streams(x: torch.Tensor, limit: int) -> bool:
    # Eagerly `(x * W).sum(-1)` would write a (tokens, out, in) product before summing it: only Inductor fuses the
    # product into the reduction, so only a compiled step takes this branch.
    return torch.compiler.is_compiling() and x.shape[:-1].numel() <= limit


class StreamingLinear(nn.Linear):
    """`nn.Linear` whose compiled product for a single token reads the weights at the memory's streaming rate.

    The same parameters and state dict as `nn.Linear` (`compile_generation` swaps the class of a plain one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _streams(x, STREAMING_TOKENS["float"]):
            return F.linear(x, self.weight, self.bias)
        y = (x.unsqueeze(-2) * self.weight).sum(-1)  # (..., 1, in) * (out, in) -> (..., out)
        return y if self.bias is None else y + self.bias


class Int8StreamingLinear(nn.Module):
    """A linear layer with int8 weights and float scales (`weight ≈ weight_int8 * weight_scale`), symmetric: one scale
    per output feature (`from_linear`, hf_tfm's q8: the bytes of llama.cpp's Q8_0 with one scale per row instead of
    per 32 weights), or per group of input features (`from_compressed`: a GPTQ / AWQ checkpoint's int4 values, kept
    one to a byte, which Inductor widens in its loop faster than it unpacks two to a byte).

    Decoding only: its state dict cannot be saved (a checkpoint keeps the float or compressed-tensors weights, and
    `load_for_inference` converts them while loading)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)  # (out, in) int8
        self.register_buffer("weight_scale", scale)  # (out, groups) in the activations' dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Int8StreamingLinear":
        weight = linear.weight.float()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
        quantized = torch.round(weight / scale).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(quantized, scale.to(linear.weight.dtype), bias)

    @classmethod
    @torch.no_grad()
    def from_compressed(cls, linear: nn.Linear) -> "Int8StreamingLinear":
        """From a compressed-tensors layer once decompressed: its float weights are its integers times its scales,
        exactly, so dividing them back gives the integers."""
        scale = linear.weight_scale.detach()  # (out, groups)
        units = scale.repeat_interleave(linear.in_features // scale.shape[1], dim=1)
        quantized = torch.round(linear.weight.float() / units.float()).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(quantized, scale.to(linear.weight.dtype).clone(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight_scale.to(x.dtype)  # (out, groups): each weight times its row's or its group's scale
        weight = (self.weight.unflatten(-1, (scale.shape[1], -1)) * scale[..., None]).flatten(-2)  # (out, in)
        # Streamed, Inductor fuses the scaling into its loop and reads 1 byte a weight; else a dequantized product
        streams = _streams(x, STREAMING_TOKENS["int8"])
        y = (x.unsqueeze(-2) * weight).sum(-1) if streams else F.linear(x, weight)  # (..., 1, in) * (out, in)
        return y if self.bias is None else y + self.bias

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:  # torch.save, save_pretrained, PEFT
        raise NotImplementedError(
            "hf_tfm's int8 streaming weights are for decoding only and cannot be saved: save the float model, and "
            "load it with hf_tfm.load_for_inference(folder, quantize='q8') (quantized while loading, in seconds)"
        )

    def extra_repr(self) -> str:
        groups = self.weight_scale.shape[1]
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " + (
            f"groups={groups}" if groups > 1 else "scale per row"
        )


def _compressed_int_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, module) of every compressed-tensors layer with symmetric integer weights of up to 8 bits, a
    scale per row or per contiguous group, and float activations: what GPTQ / AWQ / round-to-nearest W4A16 and W8A16
    checkpoints hold (`hf_tfm.calibration`). Asymmetric weights (a zero point) and activation-ordered groups
    (`weight_g_idx`) keep compressed-tensors' own layers."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            scheme = getattr(child, "quantization_scheme", None)
            weights = scheme.weights if scheme is not None else None
            if (
                isinstance(child, nn.Linear)
                and weights is not None
                and scheme.input_activations is None
                and (weights.type, weights.symmetric, weights.strategy)
                in {("int", True, "group"), ("int", True, "channel")}
                and weights.num_bits <= 8
                and not hasattr(child, "weight_g_idx")
            ):
                found.append((parent, name, child))
    return found


def stream_compressed(model: PreTrainedModel) -> PreTrainedModel:
    """Replace the compressed-tensors integer layers of `model` (`_compressed_int_linears`) by `Int8StreamingLinear`
    layers with the same integers and scales, in place; returns `model`. compressed-tensors decompresses its layers to
    float weights for its own forward, which reads 4 bytes a weight: this reads one."""
    layers = _compressed_int_linears(model)
    if layers and any(getattr(linear, "weight", None) is None for _, _, linear in layers):
        # compressed-tensors unpacks the weights on the model's first forward: one token does it
        one = torch.tensor([[model.config.bos_token_id or 0]], device=model.device)
        extra = {"decoder_input_ids": one} if model.config.is_encoder_decoder else {}
        with torch.no_grad():
            model(input_ids=one, **extra)
    for parent, name, linear in layers:
        setattr(parent, name, Int8StreamingLinear.from_compressed(linear))
    if layers:
        from compressed_tensors.offload import remove_dispatch

        # Decompressing wrapped every module's forward in one that moves its inputs to its weights' device, a graph
        # break each (31 ms a step on the bench's base shape instead of 10): on one device there is nothing to move.
        remove_dispatch(model, onload_tensors=True)
    return model


def _plain_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, module) of every `nn.Linear` whose weight is an ordinary tensor: a quantizer's layers (their own
    classes, tensor subclasses such as torchao's, or compressed-tensors' scheme) keep their own kernels."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            plain = type(child) in (nn.Linear, StreamingLinear) and not hasattr(child, "quantization_scheme")
            if plain and type(child.weight.data) is torch.Tensor:
                found.append((parent, name, child))
    return found


def quantize_q8(model: PreTrainedModel) -> PreTrainedModel:
    """Replace every plain `nn.Linear` of `model` (the output embedding `lm_head` too, as llama.cpp's Q8_0 does) by an
    `Int8StreamingLinear` in place; returns `model`. A tied `lm_head` gets an int8 copy, the input embedding table
    stays as it is (a step gathers one row of it), and so do a mixture of experts' experts and router (3-D and router
    parameters, not `nn.Linear` layers; a shared expert and its gate are linear layers and take int8 rows)."""
    for parent, name, linear in _plain_linears(model):
        setattr(parent, name, Int8StreamingLinear.from_linear(linear))
    model.config.tie_word_embeddings = False  # `lm_head` is no longer the embedding's weight: nothing may re-tie it
    return model


def compile_generation(model: PreTrainedModel) -> PreTrainedModel:
    """Make `model.generate()` decode with a static cache and a compiled step, on any device; returns `model`.

    Every plain `nn.Linear` becomes a `StreamingLinear` (same parameters; a faster single-token product once
    compiled). Weights of a quantizer that transformers marks as not compileable (bitsandbytes) keep eager
    decoding, with a warning: generate() would skip compiling them anyway."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        logger.warning(
            "%s weights cannot be compiled: generate() decodes them eagerly",
            type(quantizer).__name__.removesuffix("HfQuantizer"),
        )
        return model
    for _, _, linear in _plain_linears(model):
        linear.__class__ = StreamingLinear
    # fullgraph=False: a layer torch cannot trace (a quantizer's kernel, MoE's data-dependent routing) splits the
    # graph instead of failing; the dense models compile as one graph (tested).
    config = CompileConfig(fullgraph=False)
    config._compile_all_devices = True  # private: generate() compiles on CUDA/XPU/MPS only without it
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = config
    return model


def load_for_inference(
    path: str | os.PathLike,
    quantize: str | None = None,
    compile: bool = True,
    dtype: torch.dtype | str | None = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM or seq2seq LM folder (or Hub id) in eval mode for fast `generate()`.

    `quantize`: "q8" (hf_tfm's own int8, `quantize_q8`; the fastest compiled setting here), "int8", "int4" or
    "nf4" (`hf_tfm.quantization.BACKENDS`: transformers' torchao or bitsandbytes integration, which needs that
    package), or None for the checkpoint's weights. `compile`: decode with a static cache and a compiled step
    (`compile_generation`); a compressed-tensors checkpoint's int4 / int8 weights (GPTQ, AWQ: `hf_tfm.calibration`)
    then stream as `Int8StreamingLinear` layers (`stream_compressed`). `dtype`: of the weights (with `quantize`, of
    what stays unquantized; default: the setting's or the checkpoint's). Other keyword arguments go to
    `from_pretrained`.
    """
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    loading = quantization_kwargs(quantize, config) if quantize else {}
    if dtype is not None:
        loading["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    model = auto.from_pretrained(path, trust_remote_code=True, **loading, **kwargs).eval()
    if quantize in NATIVE_SETTINGS:
        quantize_q8(model)
        if not compile:
            logger.warning(
                "quantize=%r is made for the compiled step: eagerly, each layer's int8 weights are converted at every "
                "step, slower than float32 (pass compile=True)",
                quantize,
            )
    if not compile:
        return model
    return compile_generation(stream_compressed(model))


__all__ = [
    "Int8StreamingLinear",
    "StreamingLinear",
    "compile_generation",
    "load_for_inference",
    "quantize_q8",
    "stream_compressed",
]
