"""One call for the fastest decoding a saved model gets on this machine: quantized weights, a static KV cache and a
compiled decode step, behind the ordinary `generate()`.

    model = load_for_inference("my-model", quantize="q4")  # or None, "q8", "int8", "int4", "nf4"
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
`nn.Linear` for `StreamingLinear`, the same module with that formula for one token and hf_tfm's float kernel for a
few (a batch decoding together); and `quantize="q8"` / "q4" store int8 / int4 weights with a scale per group of
inputs (`Int8StreamingLinear`), multiplied by hf_tfm's own AVX-512 VNNI kernel: a quarter / an eighth of fp32's
bytes, no dequantized copy. Both kernels are in `hf_tfm.kernels`.
"""

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, CompileConfig, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from .aot import install, step_blockers
from .kernels import GROUP_LIMIT, GROUP_MULTIPLE, native_kernels_available, pack_int4, unpack_int4
from .quantization import NATIVE_SETTINGS, quantization_kwargs

logger = logging.get_logger(__name__)

# Up to this many tokens (batch x length) a linear layer streams its weights with `(x * W).sum(-1)`; past it (a
# prompt's prefill) a matrix product reuses each weight across tokens, which MKL's GEMM does better. Measured on the
# bench's base shape: fp32 streaming beat MKL at one token only (8 tokens: 55 vs 49 ms a step); int8 streaming beat
# dequantize-then-GEMM up to 8 tokens (43 vs 101 ms). "float kernel": up to this many tokens a float32 layer takes
# hf_tfm's native kernel instead of MKL (on the base shape's matrices: 8 tokens 22 vs 41 ms, 32 tokens 52 vs 67).
STREAMING_TOKENS = {"float": 1, "int8": 8, "float kernel": 32}
# oneDNN (torch's MKL-DNN) is built into torch's CPU wheels; its float32 product takes the prompts
ONEDNN = torch.backends.mkldnn.is_available()


def _streams(x: torch.Tensor, limit: int) -> bool:
    # Eagerly `(x * W).sum(-1)` would write a (tokens, out, in) product before summing it: only Inductor fuses the
    # product into the reduction, so only a compiled step takes this branch.
    return torch.compiler.is_compiling() and x.shape[:-1].numel() <= limit


class StreamingLinear(nn.Linear):
    """`nn.Linear` whose product for a few tokens reads the weights at the memory's streaming rate: compiled, a single
    token's `(x * W).sum(-1)`, which Inductor fuses; 2 to `STREAMING_TOKENS["float kernel"]` tokens (a batch
    decoding together, a short prompt), eagerly or compiled, hf_tfm's native kernel (`hf_tfm.kernels`: float32 on
    a CPU with AVX-512) where it is built. More tokens (a prompt) take oneDNN's float32 product on a CPU (the same
    sums in another order; twice MKL's speed on AMD processors, where MKL takes a slower path), else `nn.Linear`'s.

    The same parameters and state dict as `nn.Linear`: `from_linear` swaps the class of a plain one in place."""

    native = False  # whether the kernel is built and takes these inputs (`from_linear` decides it, once)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "StreamingLinear":
        """`linear` itself, its class swapped (its parameters, hooks and name unchanged)."""
        linear.__class__ = cls
        # Decided here, not in forward: a compiled step would graph-break on the kernel's build
        linear.native = linear.in_features % 16 == 0 and native_kernels_available()
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _streams(x, STREAMING_TOKENS["float"]):
            y = (x.unsqueeze(-2) * self.weight).sum(-1)  # (..., 1, in) * (out, in) -> (..., out)
        elif self._takes_kernel(x):
            y = torch.ops.hf_tfm.float_linear(x, self.weight)
        elif self._takes_onednn(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        else:
            return F.linear(x, self.weight, self.bias)
        return y if self.bias is None else y + self.bias

    def _takes_onednn(self, x: torch.Tensor) -> bool:
        # Eager prompts only: oneDNN's op has no gradient, and a compiled graph keeps the product Inductor chooses
        return (
            ONEDNN
            and x.dtype == self.weight.dtype == torch.float32
            and x.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        )

    def _takes_kernel(self, x: torch.Tensor) -> bool:
        # The kernel has no gradient: a product that autograd records keeps F.linear
        return (
            self.native
            and x.shape[:-1].numel() <= STREAMING_TOKENS["float kernel"]
            and x.dtype == self.weight.dtype == torch.float32
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        )


def _group_size(inputs: int, wanted: int) -> int:
    """A scale group of `wanted` inputs, else of 64 (the native kernel's unit), else the whole row."""
    return next((size for size in (wanted, GROUP_MULTIPLE) if inputs % size == 0), inputs)


class Int8StreamingLinear(nn.Module):
    """A linear layer with symmetric integer weights and float scales (`weight ≈ integers * weight_scale`), one scale
    per group of input features (a group may be the whole row): hf_tfm's q8 (`from_linear(bits=8)`: int8, a scale per
    128 inputs, the bytes of llama.cpp's Q8_0) and q4 (`from_linear(bits=4)`), and a GPTQ / AWQ checkpoint's int4 or
    int8 values (`from_compressed`).

    On a CPU with float32 inputs it calls hf_tfm's native kernel (`hf_tfm.kernels`: AVX-512 VNNI integer dot
    products, each token's inputs rounded to int16 per group), eagerly and compiled, for a step and for a prompt alike
    (faster than dequantizing up to 512 tokens at least: 11 vs 14 ms for a 2048 x 768 int4 layer); int4 weights are
    then packed two to a byte (`weight` (out, in / 2) uint8, `bits == 4`). Without that kernel
    (another CPU or device, other inputs, groups that are not multiples of 64), int4 values stay one to a byte
    (`bits == 8`), the compiled step streams up to 8 tokens with a formula Inductor fuses, and more take the
    dequantized matrix product.

    Decoding only: its state dict cannot be saved (a checkpoint keeps the float or compressed-tensors weights, and
    `load_for_inference` converts them while loading)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        """`weight`: the integers (out, in) as int8; `scale`: (out, groups)."""
        super().__init__()
        self.out_features, in_units = weight.shape
        groups = scale.shape[1]
        native = (
            scale.dtype == torch.float32
            and weight.device.type == "cpu"
            and (in_units // groups) % GROUP_MULTIPLE == 0
            and native_kernels_available()
        )
        if native and in_units // groups > GROUP_LIMIT:  # one scale per row of many inputs: the same scale per 64
            scale = scale.repeat_interleave(in_units // groups // GROUP_MULTIPLE, dim=1)
        self.native, self.in_features = native, in_units
        # Storage: int4 values packed two to a byte (without loss) for the kernel, else a byte each
        int4 = bool(weight.min() >= -8) and bool(weight.max() <= 7)
        self.bits = 4 if native and int4 and in_units % 64 == 0 else 8
        self.register_buffer("weight", pack_int4(weight) if self.bits == 4 else weight)  # (out, in * bits / 8)
        self.register_buffer("weight_scale", scale)  # (out, groups) in the activations' dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, bits: int = 8) -> "Int8StreamingLinear":
        """Round `linear`'s weights to the nearest multiple of a scale per group of 128 inputs (64 where 128 does not
        divide them, else the row): int8 in -127..127 (the group's largest magnitude / 127), or int4 in -8..7 (its
        largest magnitude / 7.5, as compressed-tensors' symmetric int4)."""
        weight = linear.weight.float()
        grouped = weight.unflatten(1, (-1, _group_size(linear.in_features, 128)))  # (out, groups, group)
        largest = 2 ** (bits - 1) - 1
        scale = grouped.abs().amax(dim=2).clamp(min=torch.finfo(torch.float32).tiny) / (largest + (bits == 4) / 2)
        quantized = torch.round(grouped / scale[..., None]).clamp(-largest - 1, largest).flatten(1).to(torch.int8)
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

    @classmethod
    def concat(cls, layers: list["Int8StreamingLinear"]) -> "Int8StreamingLinear":
        """One layer whose outputs are `layers`' outputs side by side: their rows stacked, so a product reads them in
        one pass (`fuse_projections`). Each output row is computed as in its own layer, to the bit."""
        bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
        scale = torch.cat([layer.weight_scale for layer in layers])
        return cls(torch.cat([layer.integers() for layer in layers]), scale, bias)

    def integers(self) -> torch.Tensor:
        """The int8 values (out, in), unpacked."""
        return unpack_int4(self.weight) if self.bits == 4 else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == torch.float32 and x.device.type == "cpu":
            y = torch.ops.hf_tfm.int_linear(x, self.weight, self.weight_scale, self.bits)
            return y if self.bias is None else y + self.bias
        scale = self.weight_scale.to(x.dtype)  # (out, groups): each weight times its row's or its group's scale
        weight = (self.integers().unflatten(-1, (scale.shape[1], -1)) * scale[..., None]).flatten(-2)  # (out, in)
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
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            + (f"groups={groups}" if groups > 1 else "scale per row")
            + f", bits={self.bits}"
            + (", native kernel" if self.native else "")
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
    layers with the same integers and scales, fused per block (`fuse_projections`), in place; returns `model`.
    compressed-tensors decompresses its layers to float weights for its own forward, which reads 4 bytes a weight:
    this reads one."""
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
    return fuse_projections(model)


def _fusable(layers: list[nn.Module]) -> bool:
    """Whether `layers` read the same inputs the same way: integer layers with the same inputs, scale groups, storage
    and kernel, all with a bias or none."""
    first = layers[0]
    return all(
        type(layer) is Int8StreamingLinear
        and (layer.in_features, layer.weight_scale.shape[1], layer.weight_scale.dtype, layer.native, layer.bits)
        == (first.in_features, first.weight_scale.shape[1], first.weight_scale.dtype, first.native, first.bits)
        and (layer.bias is None) == (first.bias is None)
        for layer in layers
    )


def fuse_projections(model: nn.Module) -> nn.Module:
    """Give each self-attention block one `qkv_proj` for its q, k and v layers, and each gated feed-forward one
    `gate_up_proj` for gate and up, where they are `Int8StreamingLinear` layers alike (`_fusable`); in place, returns
    `model`. A decode step then reads each block's weights in 4 passes instead of 7 (the bench's base shape, q4: 49
    kernel calls a token instead of 85; timed alone, those calls took 1.45 ms instead of 1.6-1.75). Only for these
    layers, which are never saved: a float model keeps its layers, so checkpoints, PEFT and tensor parallelism see
    the usual names."""
    for module in list(model.modules()):
        # The modeling's attention and MLP declare the fused slots as None; cross-attention has two sources
        if getattr(module, "qkv_proj", False) is None and not module.is_cross_attention:
            layers = [module.q_proj, module.k_proj, module.v_proj]
            if _fusable(layers):
                module.qkv_proj = Int8StreamingLinear.concat(layers)
                module.qkv_sizes = tuple(layer.out_features for layer in layers)
                del module.q_proj, module.k_proj, module.v_proj
        if getattr(module, "gate_up_proj", False) is None and module.gate_proj is not None:
            layers = [module.gate_proj, module.up_proj]
            if _fusable(layers):
                module.gate_up_proj = Int8StreamingLinear.concat(layers)
                del module.gate_proj, module.up_proj
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
    int8 `Int8StreamingLinear` in place; returns `model`. A tied `lm_head` gets an int8 copy, the input embedding
    table stays as it is (a step gathers one row of it), and so do a mixture of experts' experts and router (3-D and
    router parameters, not `nn.Linear` layers; a shared expert and its gate are linear layers and take int8 rows).
    Then each block's q/k/v and gate/up layers are fused (`fuse_projections`)."""
    return _quantize_linears(model, bits=8, head_bits=8)


def quantize_q4(model: PreTrainedModel) -> PreTrainedModel:
    """`quantize_q8`, but int4 (round to nearest, a scale per 128 inputs) for every linear layer but `lm_head`, which
    stays int8: llama.cpp's Q4_0 keeps its output layer at 6 bits for the same reason (its error reaches every logit
    directly). For calibrated int4 (GPTQ, AWQ), see `hf_tfm.calibration`."""
    return _quantize_linears(model, bits=4, head_bits=8)


def _quantize_linears(model: PreTrainedModel, bits: int, head_bits: int) -> PreTrainedModel:
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    for parent, name, linear in _plain_linears(model):
        setattr(parent, name, Int8StreamingLinear.from_linear(linear, head_bits if linear is head else bits))
    model.config.tie_word_embeddings = False  # `lm_head` is no longer the embedding's weight: nothing may re-tie it
    return fuse_projections(model)


# The attention `compile_generation` gives a CPU model that uses sdpa: sdpa for a prompt, the plain formula for a step
DECODE_ATTENTION = "hf_tfm_decode"


def decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' sdpa, except for a single query on a CPU: there sdpa's kernel costs more than its arithmetic
    (57 us a layer on the bench's base shape) and the plain formula, which Inductor fuses into the step, does not (q4
    decoding: 3.6 ms a step instead of 4.7). `attention_mask` is sdpa's (True where a query may attend: a prompt's
    results are sdpa's to the bit); `position_bias` (ALiBi) adds to the scores either way."""
    if query.shape[2] != 1 or query.device.type != "cpu":
        prompt = query.shape[2] > 1 and query.device.type == "cpu" and attention_mask is not None
        if prompt and not torch.compiler.is_compiling():
            key, value, attention_mask, position_bias = _attended_keys(
                query, key, value, attention_mask, position_bias
            )
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            position_bias=position_bias,
            **kwargs,
        )
    # Not modeling's `eager_attention_forward`: its `repeat_kv` copies the whole cache for GQA at every step, where
    # grouping the query heads by their key/value head is a view
    batch, heads, _, dim = query.shape
    query = query.view(batch, key.shape[1], heads // key.shape[1], dim)  # (B, H_kv, H / H_kv, D): GQA's heads per kv
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H_kv, H / H_kv, S)
    if position_bias is not None:
        scores = scores + position_bias.reshape(batch, key.shape[1], -1, scores.shape[-1])
    if attention_mask is not None:  # (B, 1, 1, S), True where the query may attend
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).reshape(batch, heads, 1, dim)  # (B, H, 1, D)
    return out.transpose(1, 2).contiguous(), weights.reshape(batch, heads, 1, -1)  # (B, 1, H, D)


def _attended_keys(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    position_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A prompt's keys, values, mask and bias without the static cache's slots no query attends yet (a prompt of 128
    tokens before 512 new ones would otherwise score all 640 slots); with no mask where the rest is plain causal
    attention over the prompt alone, which sdpa's causal kernel computes without reading a mask. Eager prompts only:
    the cut depends on the mask's values."""
    if mask.dtype != torch.bool:
        return key, value, mask, position_bias
    attended = mask.any(dim=2).flatten(0, -2).any(dim=0)  # (S,): slots some query of some sequence attends
    used = int(attended.nonzero().max()) + 1 if attended.any() else mask.shape[-1]
    key, value, mask = key[:, :, :used], value[:, :, :used], mask[..., :used]
    if position_bias is not None:
        return key, value, mask, position_bias[..., :used]
    queries = query.shape[2]
    causal = torch.ones(queries, used, dtype=torch.bool, device=mask.device).tril(used - queries)
    if used == queries and torch.equal(mask, causal.expand_as(mask)):
        return key, value, None, None  # sdpa then takes is_causal from the module (True for a causal LM)
    return key, value, mask, None


ALL_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, decode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, sdpa_mask)


def compile_generation(model: PreTrainedModel) -> PreTrainedModel:
    """Make `model.generate()` decode with a static cache and a compiled step, on any device; returns `model`.

    A decoder-only causal LM on a CPU gets the step compiled ahead of time (`hf_tfm.aot.install`: one C++ call per
    token, at its first decode step); a model it cannot take (`hf_tfm.aot.step_blockers`: experts, sliding windows,
    an encoder-decoder, a GPU) gets transformers' `torch.compile` of the forward, through the generation config.
    Every plain `nn.Linear` becomes a `StreamingLinear` (same parameters; a faster product for a few tokens), and a
    CPU model on sdpa takes `decode_attention` (sdpa, but the plain formula for a single query). Weights of a
    quantizer that transformers marks as not compileable (bitsandbytes) keep eager decoding, with a warning:
    generate() would skip compiling them anyway."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        logger.warning(
            "%s weights cannot be compiled: generate() decodes them eagerly",
            type(quantizer).__name__.removesuffix("HfQuantizer"),
        )
        return model
    for _, _, linear in _plain_linears(model):
        StreamingLinear.from_linear(linear)
    if model.config._attn_implementation == "sdpa" and model.device.type == "cpu":
        model.set_attn_implementation(DECODE_ATTENTION)
    model.generation_config.cache_implementation = "static"
    if quantizer is None and not step_blockers(model):  # a quantizer's tensor subclasses do not export
        return install(model)
    # fullgraph=False: a layer torch cannot trace (a quantizer's kernel, MoE's data-dependent routing) splits the
    # graph instead of failing; the dense models compile as one graph (tested).
    config = CompileConfig(fullgraph=False)
    if model.device.type == "cpu":
        # Inductor inlines a value read by several kernels unless it reads many inputs, so RoPE's cos and sin were
        # recomputed inside the attention's loop over every cached position; storing such values computes them once
        # (batch 8 on the bench's base shape: 41 -> 37 ms a step, batch 1 unchanged). Options replace the mode, whose
        # "reduce-overhead" means CUDA graphs: nothing on a CPU.
        config.mode, config.options = None, {"realize_reads_threshold": 0}
    config._compile_all_devices = True  # private: generate() compiles on CUDA/XPU/MPS only without it
    model.generation_config.compile_config = config
    return model


def load_for_inference(
    path: str | os.PathLike,
    quantize: str | None = None,
    compile: bool = True,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM or seq2seq LM folder (or Hub id) in eval mode for fast `generate()`.

    `quantize`: "q8" / "q4" (hf_tfm's own int8 / int4 on its native kernel, `quantize_q8` / `quantize_q4`; the
    fastest settings here), "int8", "int4" or "nf4" (`hf_tfm.quantization.BACKENDS`: transformers' torchao or
    bitsandbytes integration, which needs that package), or None for the checkpoint's weights. `compile`: decode
    with a static cache and a compiled step (`compile_generation`); a compressed-tensors checkpoint's int4 / int8
    weights (GPTQ, AWQ: `hf_tfm.calibration`) then become `Int8StreamingLinear` layers (`stream_compressed`).
    `dtype`: of the weights (with `quantize`, of what stays unquantized; default: the setting's or the checkpoint's).
    `trust_remote_code`: run Python code the folder or repository ships (its `auto_map`), as transformers' flag;
    without it such a folder is refused with transformers' `ValueError`. hf_tfm's own folders need no consent here:
    importing hf_tfm registered its classes, which transformers then uses instead of the folder's copy.
    Other keyword arguments go to `from_pretrained`.
    """
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    loading = quantization_kwargs(quantize, config) if quantize else {}
    if dtype is not None:
        loading["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    model = auto.from_pretrained(path, trust_remote_code=trust_remote_code, **loading, **kwargs).eval()
    if quantize in NATIVE_SETTINGS:
        (quantize_q8 if quantize == "q8" else quantize_q4)(model)
        if not compile and not native_kernels_available():
            logger.warning(
                "quantize=%r without hf_tfm's native kernel (hf_tfm.kernels) is made for the compiled step: eagerly, "
                "each layer's integer weights are converted at every step, slower than float32 (pass compile=True)",
                quantize,
            )
    if not compile:
        return model
    return compile_generation(stream_compressed(model))


__all__ = [
    "Int8StreamingLinear",
    "StreamingLinear",
    "compile_generation",
    "decode_attention",
    "fuse_projections",
    "load_for_inference",
    "quantize_q4",
    "quantize_q8",
    "stream_compressed",
]
