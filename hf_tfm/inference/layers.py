"""The linear layers a decode step multiplies with: `StreamingLinear` (float weights) and `Int8StreamingLinear`
(integer weights and float scales), and `fuse_projections`, which gives a block's q/k/v and gate/up one product each.

A decode step multiplies one token's vector by every weight matrix, so its speed is the rate at which the weights
stream from memory. `nn.Linear` on a CPU hands that product to MKL, whose GEMV with one row read the weights at 10
GB/s on this project's 2-core machines, where Inductor's own code for the same product written as `(x * W).sum(-1)`
read them at 22-27 GB/s (docs/performance.md). So the compiled step swaps every plain `nn.Linear` for
`StreamingLinear`, the same module with that formula for one token and hf_tfm's float kernel for a few (a batch
decoding together); and `quantize="q8"` / "q4" store int8 / int4 weights with a scale per group of inputs
(`Int8StreamingLinear`), multiplied by hf_tfm's own integer kernel: a quarter / an eighth of fp32's bytes, no
dequantized copy. Both kernels are in `hf_tfm.inference.kernels`.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .kernels import (
    GROUP_LIMIT,
    GROUP_MULTIPLE,
    TILE,
    TILE_INT8_GROUP_LIMIT,
    pack_int4,
    pack_tiles,
    tile_scales,
    unpack_int4,
    unpack_tiles,
    untile_scales,
)

# Up to this many tokens (batch x length) a linear layer streams its weights with `(x * W).sum(-1)`; past it (a
# prompt's prefill) a matrix product reuses each weight across tokens, which MKL's GEMM does better. Measured on the
# bench's base shape: fp32 streaming beat MKL at one token only (8 tokens: 55 vs 49 ms a step); int8 streaming beat
# dequantize-then-GEMM up to 8 tokens (43 vs 101 ms). "float kernel": up to this many tokens a float32 layer takes
# hf_tfm's native kernel instead of MKL (on the base shape's matrices: 8 tokens 22 vs 41 ms, 32 tokens 52 vs 67).
# "int kernel, AVX2": up to this many tokens an integer layer takes the integer kernel's AVX2 build; past it, the
# dequantized weights and oneDNN's float32 product, whose FMAs outrun AVX2's int16 multiply-adds on a long prompt (a
# 2304 x 768 int8 layer, 2 threads of an AVX2 EPYC: 128 tokens 10.6 vs 9.8 ms, 512 tokens 28.5 vs 20.6). The
# AVX-512 VNNI build stays ahead to 512 tokens at least, so it takes every prompt.
STREAMING_TOKENS = {"float": 1, "int8": 8, "float kernel": 32, "int kernel, AVX2": 256}
# oneDNN (torch's MKL-DNN) is built into torch's CPU wheels; its float32 product takes the prompts
ONEDNN = torch.backends.mkldnn.is_available()
QUANTIZE_ROWS = 256  # rows `Int8StreamingLinear.from_linear` rounds at a time


def _tokens(x: torch.Tensor) -> int:
    # math.prod keeps a dynamic size symbolic, where torch.Size.numel() would fix it to the traced value
    return math.prod(x.shape[:-1])


def _streams(x: torch.Tensor, limit: int) -> bool:
    # Eagerly `(x * W).sum(-1)` would write a (tokens, out, in) product before summing it: only Inductor fuses the
    # product into the reduction, so only a compiled step takes this branch. A step compiled for a range of token
    # counts (the verify step's) keeps the product: one branch serves the whole range.
    tokens = _tokens(x)
    return torch.compiler.is_compiling() and isinstance(tokens, int) and tokens <= limit


class StreamingLinear(nn.Linear):
    """`nn.Linear` whose product for a few tokens reads the weights at the memory's streaming rate: compiled, a single
    token's `(x * W).sum(-1)`, which Inductor fuses; 2 to `STREAMING_TOKENS["float kernel"]` tokens (a batch
    decoding together, a short prompt), eagerly or compiled, hf_tfm's native kernel (`hf_tfm.inference.kernels`:
    float32 on a CPU with AVX-512) where it is built. More tokens (a prompt) take oneDNN's float32 product on a CPU
    (the same sums in another order; twice MKL's speed on AMD processors, where MKL takes a slower path), else
    `nn.Linear`'s.

    The same parameters and state dict as `nn.Linear`: `from_linear` swaps the class of a plain one in place."""

    native = False  # whether the kernel is built and takes these inputs (`from_linear` decides it, once)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "StreamingLinear":
        """`linear` itself, its class swapped (its parameters, hooks and name unchanged)."""
        linear.__class__ = cls
        # Decided here, not in forward: a compiled step would graph-break on the kernel's build
        linear.native = linear.in_features % 16 == 0 and kernels.float_kernel_available()
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
            and _tokens(x) <= STREAMING_TOKENS["float kernel"]
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

    On a CPU with float32 inputs it calls hf_tfm's native kernels (`hf_tfm.inference.kernels`), eagerly and compiled,
    for a step and a prompt alike, each token's inputs rounded per group to `input_bits`: with AVX-512 VNNI,
    `tile_linear` on the weights in tiles of 16 rows (`tiled`), int8 weights by 16-bit inputs and q4's int4 weights by
    8-bit inputs, as llama.cpp's Q4_0 takes them; else `int_linear` on the weights row by row, by 16-bit inputs (a
    GPTQ / AWQ int4 checkpoint's W4A16, and every layer on AVX2, whose build hands prompts past
    `STREAMING_TOKENS["int kernel, AVX2"]` to oneDNN). int4 weights are then packed two to a byte. Without a kernel
    (another CPU or device, other inputs, groups that are not multiples of 64), the values stay one to a byte
    (`bits == 8`), the compiled step streams up to 8 tokens with a formula Inductor fuses, and more take the
    dequantized matrix product.

    Decoding only: its state dict cannot be saved (a checkpoint keeps the float or compressed-tensors weights, and
    `load_for_inference` converts them while loading)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        int8_inputs: bool = False,
        out_features: int | None = None,
    ) -> None:
        """`weight`: the integers (out, in) as int8; or as `from_linear` and `concat` store them: int4 packed two to a
        byte ((out, in / 2) uint8, `pack_int4`), or in tiles of 16 rows (`pack_tiles`: int4 (tiles, in / 8, 64) uint8,
        int8 (tiles, in / 4, 64) int8) with `scale` tiled too ((tiles, groups, 16), `tile_scales`) and `out_features`
        given. `scale`: (out, groups). `int8_inputs`: int4 weights' inputs rounded to 8 bits where the kernel takes
        them (`tile_linear`), as hf_tfm's q4 asks; else 16 bits, as a W4A16 checkpoint promises."""
        super().__init__()
        if weight.dim() == 3:  # tiles: kept where tile_linear takes them, else the values
            bits = 4 if weight.dtype == torch.uint8 else 8
            inputs = weight.shape[1] * kernels.TILE_INPUTS[bits]
            if self._takes_tiles(bits, int8_inputs, inputs, scale.shape[1], scale.dtype, weight.device):
                self._store(weight, scale, bias, out_features, bits=bits, tiled=True)
                return
            weight, scale = unpack_tiles(weight, out_features), untile_scales(scale, out_features)
        packed = weight.dtype == torch.uint8
        out_features, in_units = weight.shape[0], weight.shape[1] * (2 if packed else 1)
        groups = scale.shape[1]
        native = self._takes_kernel(in_units, groups, scale.dtype, weight.device)
        if packed and not (native and in_units % 64 == 0):
            weight, packed = unpack_int4(weight), False
        if packed:
            bits = 4
        else:
            low, high = torch.aminmax(weight)
            int4 = bool(low >= -8) and bool(high <= 7)
            bits = 4 if native and int4 and in_units % 64 == 0 else 8
        tiled = self._takes_tiles(bits, int8_inputs, in_units, groups, scale.dtype, weight.device)
        # A group past the kernel's limit (one scale per row of many inputs): the same scale per 64 inputs
        if native and in_units // groups > (TILE_INT8_GROUP_LIMIT if tiled and bits == 8 else GROUP_LIMIT):
            scale = scale.repeat_interleave(in_units // groups // GROUP_MULTIPLE, dim=1)
        if tiled:
            values = unpack_int4(weight) if packed else weight
            self._store(pack_tiles(values, bits), tile_scales(scale), bias, out_features, bits=bits, tiled=True)
            return
        # Storage: int4 values packed two to a byte (without loss) for the kernel, else a byte each
        weight = pack_int4(weight) if bits == 4 and not packed else weight
        self._store(weight, scale, bias, out_features, bits=bits, tiled=False, native=native)

    def _store(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
        bits: int,
        tiled: bool,
        native: bool = True,
    ) -> None:
        """Keep the stored weights and scales: rows (out, in * bits / 8) and (out, groups), or tiles (`pack_tiles`)
        and (tiles, groups, 16)."""
        self.out_features, self.bits, self.tiled, self.native = out_features, bits, tiled, native
        self.input_bits = 8 if tiled and bits == 4 else 16
        self.in_features = weight.shape[1] * (kernels.TILE_INPUTS[bits] if tiled else 8 // bits)
        # Long prompts take oneDNN's float32 product (see STREAMING_TOKENS) where the kernel is the AVX2 build
        self.prompts_dequantized = native and ONEDNN and not kernels.float_kernel_available()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)  # in the activations' dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def _takes_tiles(
        cls, bits: int, int8_inputs: bool, inputs: int, groups: int, dtype: torch.dtype, device: torch.device
    ) -> bool:
        """Whether weights of `bits` and `inputs` in `groups` scale groups run on `tile_linear`: int8 weights, and
        int4 ones whose inputs may be rounded to 8 bits (`int8_inputs`)."""
        takes = (bits == 8 or int8_inputs) and (bits == 8 or inputs // groups <= GROUP_LIMIT)
        return takes and cls._takes_kernel(inputs, groups, dtype, device) and kernels.tiles_available()

    @staticmethod
    def _takes_kernel(inputs: int, groups: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a layer of `inputs` in `groups` scale groups of `dtype` scales on `device` runs on the native
        kernel."""
        native = dtype == torch.float32 and device.type == "cpu" and (inputs // groups) % GROUP_MULTIPLE == 0
        return native and kernels.native_kernels_available()

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, bits: int = 8) -> "Int8StreamingLinear":
        """Round `linear`'s weights to the nearest multiple of a scale per group of 128 inputs (64 where 128 does not
        divide them, else the row): int8 in -127..127 (the group's largest magnitude / 127), or int4 in -8..7 (its
        largest magnitude / 7.5, as compressed-tensors' symmetric int4; its inputs rounded to 8 bits where the kernel
        takes them, as llama.cpp's Q4_0 rounds them)."""
        weight, group = linear.weight, _group_size(linear.in_features, 128)
        largest = 2 ** (bits - 1) - 1
        unit = largest + (bits == 4) / 2  # a group's largest magnitude over this is its scale
        rows, inputs = weight.shape
        groups = inputs // group
        # Stored block by block as the constructor would store them, while each block is in the cache: in tiles of 16
        # rows for tile_linear, int4 else two to a byte in each row where the kernel takes them
        tiles = cls._takes_tiles(bits, True, inputs, groups, weight.dtype, weight.device)  # groups of 64 or 128
        packs = not tiles and bits == 4 and inputs % 64 == 0
        packs = packs and cls._takes_kernel(inputs, groups, weight.dtype, weight.device)
        if tiles:
            dtype = torch.uint8 if bits == 4 else torch.int8
            quantized = torch.empty(-(-rows // TILE), inputs // kernels.TILE_INPUTS[bits], 64, dtype=dtype)  # CPU
        else:
            shape, dtype = (rows, inputs // 2) if packs else (rows, inputs), torch.uint8 if packs else torch.int8
            quantized = torch.empty(shape, dtype=dtype, device=weight.device)
        scale = torch.empty(rows, groups, device=weight.device, dtype=torch.float32)
        # A block of rows at a time: its temporaries stay in the cache (whole-matrix ones took 4 of the 6 s that
        # loading a 1.1B model as q4 took)
        for start in range(0, rows, QUANTIZE_ROWS):
            block_rows = slice(start, start + QUANTIZE_ROWS)
            block = weight[block_rows].float().unflatten(1, (-1, group))  # (rows, groups, group)
            block_scale = block.abs().amax(dim=2).clamp(min=torch.finfo(torch.float32).tiny) / unit
            integers = (block / block_scale[..., None]).round_().clamp_(-largest - 1, largest).flatten(1)
            if tiles:  # QUANTIZE_ROWS is a multiple of TILE: the block's tiles are whole but for the last one
                pack_tiles(integers, bits, out=quantized[start // TILE : -(-(start + QUANTIZE_ROWS) // TILE)])
            else:
                quantized[block_rows] = pack_int4(integers) if packs else integers
            scale[block_rows] = block_scale
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if tiles:
            return cls(quantized, tile_scales(scale), bias, int8_inputs=True, out_features=rows)
        return cls(quantized, scale.to(linear.weight.dtype), bias, int8_inputs=bits == 4)

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
        one pass (`fuse_projections`). Each output row is computed as in its own layer, to the bit. Their stored rows
        are stacked as they are (int4 rows stay packed), and their tiles too unless a layer's padded tile would lie
        between two layers' rows."""
        bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
        int8_inputs = all(layer.input_bits == 8 for layer in layers)
        out_features = sum(layer.out_features for layer in layers)
        tiled = all(layer.tiled for layer in layers)
        if tiled and all(layer.out_features % TILE == 0 for layer in layers[:-1]):  # whole tiles
            stored = torch.cat([layer.weight for layer in layers])  # (tiles, steps, 64)
            scale = torch.cat([layer.weight_scale for layer in layers])
            return cls(stored, scale, bias, int8_inputs, out_features=out_features)
        if tiled:  # tiled again from the values
            stored = torch.cat([layer.integers() for layer in layers])
        else:
            stored = torch.cat([layer.weight for layer in layers])  # (out, in * bits / 8): packed int4 as uint8
        scale = torch.cat([layer.scales() for layer in layers])
        return cls(stored, scale, bias, int8_inputs=int8_inputs)

    def integers(self) -> torch.Tensor:
        """The int8 values (out, in), unpacked."""
        if self.tiled:
            return unpack_tiles(self.weight, self.out_features)
        return unpack_int4(self.weight) if self.bits == 4 else self.weight

    def scales(self) -> torch.Tensor:
        """The scales (out, groups)."""
        return untile_scales(self.weight_scale, self.out_features) if self.tiled else self.weight_scale

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weights (out, in): each integer times its row's or its group's scale."""
        scale = self.scales().to(dtype)  # (out, groups)
        return (self.integers().unflatten(-1, (scale.shape[1], -1)) * scale[..., None]).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == torch.float32 and x.device.type == "cpu":
            if self.prompts_dequantized and self._long_prompt(x):
                return torch.ops.mkldnn._linear_pointwise(x, self.dequantized(x.dtype), self.bias, "none", [], "")
            if self.tiled:
                y = torch.ops.hf_tfm.tile_linear(x, self.weight, self.weight_scale, self.out_features, self.bits)
            else:
                y = torch.ops.hf_tfm.int_linear(x, self.weight, self.weight_scale, self.bits)
            return y if self.bias is None else y + self.bias
        weight = self.dequantized(x.dtype)
        # Streamed, Inductor fuses the scaling into its loop and reads 1 byte a weight; else a dequantized product
        streams = _streams(x, STREAMING_TOKENS["int8"])
        y = (x.unsqueeze(-2) * weight).sum(-1) if streams else F.linear(x, weight)  # (..., 1, in) * (out, in)
        return y if self.bias is None else y + self.bias

    def _long_prompt(self, x: torch.Tensor) -> bool:
        # Eager and without gradient only: oneDNN's op has none, and a compiled step keeps the kernel for every token
        # count it was traced for
        return (
            not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and x.requires_grad)
            and _tokens(x) > STREAMING_TOKENS["int kernel, AVX2"]
        )

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
            + (f", native kernel, {self.input_bits}-bit inputs" if self.native else "")
            + (", tiles of 16 rows" if self.tiled else "")
        )


def _fusable(layers: list[nn.Module]) -> bool:
    """Whether `layers` read the same inputs the same way: integer layers with the same inputs, scale groups, storage,
    kernel and input rounding, all with a bias or none."""
    first = layers[0]
    return all(
        type(layer) is Int8StreamingLinear
        and (layer.in_features, layer.weight_scale.shape[1], layer.weight_scale.dtype, layer.native, layer.bits)
        == (first.in_features, first.weight_scale.shape[1], first.weight_scale.dtype, first.native, first.bits)
        and (layer.input_bits, layer.tiled) == (first.input_bits, first.tiled)
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


def plain_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, module) of every `nn.Linear` whose weight is an ordinary tensor: a quantizer's layers (their own
    classes, tensor subclasses such as torchao's, or compressed-tensors' scheme) keep their own kernels."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            plain = type(child) in (nn.Linear, StreamingLinear) and not hasattr(child, "quantization_scheme")
            if plain and type(child.weight.data) is torch.Tensor:
                found.append((parent, name, child))
    return found


__all__ = ["STREAMING_TOKENS", "Int8StreamingLinear", "StreamingLinear", "fuse_projections", "plain_linears"]
