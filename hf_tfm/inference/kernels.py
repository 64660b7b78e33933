"""hf_tfm's native CPU kernels for decoding, compiled for this machine's CPU on first use (about 10 s, then cached by
torch's extension builder): `torch.ops.hf_tfm.tile_linear` and `int_linear` (inference/csrc/int_linear.cpp) for
integer weights, and `torch.ops.hf_tfm.float_linear` (inference/csrc/float_linear.cpp) for float32 weights and a few
tokens.

`tile_linear(x, weight, scale, out_features, bits)`, where `tiles_available()` (AVX-512 VNNI), multiplies a few tokens
`x` (..., in) in float32 by integer weights in tiles of 16 rows (`pack_tiles`: int4 (tiles, in / 8, 64) uint8, int8
(tiles, in / 4, 64) int8), each with a float32 scale per group of inputs (`tile_scales`: (tiles, groups, 16); a group
is a multiple of 64 inputs, at most 4096, at most 512 for int8). One instruction multiplies a few inputs of a token
by 16 rows' weights at once, so a group's scaling is a few vector instructions for 16 rows, a block of tokens reuses
each loaded weight, and one token reads a single stream of weights at the memory's streaming rate:
- int4 weights (hf_tfm's q4) by each token's inputs rounded to int8 per group, as llama.cpp rounds them for its Q4_0
  (`vpdpbusd`: prompts and verify steps run at 2.5x the products a second of rows of weights);
- int8 weights (q8, q4's `lm_head`, int8 checkpoints) by inputs rounded to int16 per group (a relative error of
  2^-16: the weights' rounding is the only loss, as W8A16 promises; `vpdpwssd`).

`int_linear(x, weight, scale, bits)` takes the weights row by row: int8 (`bits=8`, (out, in)) or int4 packed two to a
byte (`bits=4`, (out, in / 2), `pack_int4`), scales (out, groups), inputs rounded to int16 per group: GPTQ / AWQ int4
checkpoints (W4A16) on AVX-512 VNNI, and every integer layer on AVX2. Both are registered operators with fake
(shape) implementations: `torch.compile` calls them from the compiled step without a graph break.

`float_linear(x, weight)` multiplies a few tokens (a batch decoding together, a short prompt) by float32 weights
(out, in), `in` a multiple of 16, reading each weight from memory once for all of them. MKL's GEMM, made for more
tokens, read the bench's base-shape matrices at half the rate on this project's AMD EPYC (8 tokens: 41 ms, against 22
here; 32 tokens: 67 against 52). `StreamingLinear` calls it for 2 to 32 tokens.

They need a C++ compiler, and `int_linear` AVX2 or AVX-512 VNNI, `tile_linear` and `float_linear` AVX-512 VNNI.
Where one is missing, or `HF_TFM_NATIVE_KERNELS=0`, `native_kernels_available()` (`int_linear`),
`tiles_available()` or `float_kernel_available()` is False:
`Int8StreamingLinear` keeps its compiled float formula and `StreamingLinear` MKL's product.
`HF_TFM_NATIVE_KERNELS=avx2` builds the integer kernel's AVX2 code on a CPU with AVX-512 (the tests compare both).
"""

import functools
import hashlib
import os
from pathlib import Path

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

CSRC = Path(__file__).with_name("csrc")
GROUP_MULTIPLE = 64  # inputs: a scale group of the kernel is a multiple of this
GROUP_LIMIT = 4096  # inputs: and at most this many (its int32 sums would overflow past about 8192)
TILE = 16  # rows: tile_linear's weights are stored in tiles of this many rows
TILE_INT8_GROUP_LIMIT = 512  # inputs: tile_linear's int8 groups (a row's int32 sum of 16-bit products, in one lane)
TILE_INPUTS = {4: 8, 8: 4}  # bits: the inputs of a step of 64 bytes of a tile


def cpu_fingerprint() -> str:
    """The CPU's instruction-set flags: what a build for this CPU (-march=native) depends on, so that a cache shared by
    machines of other CPUs never reuses it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def vector_isa() -> str:
    """The instruction set the native kernels are built for here: "AVX-512 VNNI", "AVX2" (also where
    `HF_TFM_NATIVE_KERNELS=avx2` asks for the AVX2 build on an AVX-512 CPU), or "none" (no AVX2, or
    `HF_TFM_NATIVE_KERNELS=0`)."""
    choice = os.environ.get("HF_TFM_NATIVE_KERNELS", "1")
    if choice == "0":
        return "none"
    if choice != "avx2" and torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported():
        return "AVX-512 VNNI"
    return "AVX2" if torch.cpu._is_avx2_supported() else "none"


_OPERATORS = {"AVX-512 VNNI": ("int_linear", "float_linear"), "AVX2": ("int_linear",), "none": ()}


@functools.cache
def built_operators() -> frozenset[str]:
    """The `torch.ops.hf_tfm` operators there are (`vector_isa`'s), building them on the first call: `int_linear` on a
    CPU with AVX-512 VNNI or AVX2, `float_linear` with AVX-512 VNNI; none (with a warning when the build fails) where
    `HF_TFM_NATIVE_KERNELS=0` or there is no C++ compiler."""
    operators = _OPERATORS[vector_isa()]
    if not operators:
        return frozenset()
    from torch.utils.cpp_extension import load

    sources = [CSRC / f"{name}.cpp" for name in operators]
    # OpenMP: at::parallel_for splits the rows between torch's threads only when compiled with it
    flags = ["-O3", "-march=native", "-fopenmp", *(["-mno-avx512f"] if "float_linear" not in operators else [])]
    code = b"".join(source.read_bytes() for source in sources)
    digest = hashlib.sha256(code + " ".join(flags).encode() + cpu_fingerprint().encode() + torch.__version__.encode())
    try:
        load(
            name=f"hf_tfm_kernels_{digest.hexdigest()[:12]}",
            sources=[str(source) for source in sources],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, no ninja, a failed build
        logger.warning("hf_tfm's CPU kernels could not be built (%s): decoding uses slower formulas", error)
        return frozenset()
    _tag_compile_caches(f"hf_tfm-kernels-{digest.hexdigest()[:12]}")

    @torch.library.register_fake("hf_tfm::int_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    if vector_isa() == "AVX-512 VNNI":  # int_linear.cpp's AVX-512 build defines tile_linear too

        @torch.library.register_fake("hf_tfm::tile_linear")
        def _(
            x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_features: int, bits: int
        ) -> torch.Tensor:
            return x.new_empty(*x.shape[:-1], out_features)

    if "float_linear" in operators:

        @torch.library.register_fake("hf_tfm::float_linear")
        def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return x.new_empty(*x.shape[:-1], weight.shape[0])

    return frozenset(operators)


def _tag_compile_caches(tag: str) -> None:
    """Add this build's `tag` to torch.compile's cache keys (`torch.compiler.config.cache_key_tag`). Inductor's caches
    key a graph by its operators' names, not their argument lists, and its generated code calls them with every
    argument spelled out: after an upgrade that changed an operator's arguments, a graph cached by the older hf_tfm
    would call it with the old ones and fail."""
    tags = torch.compiler.config.cache_key_tag
    if tag not in tags.split("|"):
        torch.compiler.config.cache_key_tag = f"{tags}|{tag}" if tags else tag


def native_kernels_available() -> bool:
    """Whether `torch.ops.hf_tfm.int_linear`, the integer kernel, is there (`built_operators`)."""
    return "int_linear" in built_operators()


def float_kernel_available() -> bool:
    """Whether `torch.ops.hf_tfm.float_linear` is there (`built_operators`: AVX-512 VNNI)."""
    return "float_linear" in built_operators()


def tiles_available() -> bool:
    """Whether `tile_linear` is there (integer weights in tiles of 16 rows): the AVX-512 VNNI build, where it is built
    (`built_operators`)."""
    return vector_isa() == "AVX-512 VNNI" and native_kernels_available()


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values (out, in) in [-8, 7], `in` a multiple of 64, packed two to a byte as `int_linear(bits=4)` reads
    them: in each run of 64 inputs, byte j holds input j + 8 in its low nibble and input j + 32 + 8 in its high one."""
    out, inputs = values.shape
    biased = (values.to(torch.int8) + 8).view(torch.uint8).view(out, inputs // 64, 2, 32)  # 0..15: no overflow
    return (biased[:, :, 0] | (biased[:, :, 1] << 4)).reshape(out, inputs // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The int8 values (out, in) that `pack_int4` packed."""
    out, half = packed.shape
    runs = packed.view(out, half // 32, 1, 32)
    nibbles = torch.cat([runs & 0x0F, runs >> 4], dim=2)  # (out, runs, 2, 32)
    return (nibbles.to(torch.int8) - 8).reshape(out, half * 2)


def pack_tiles(values: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Integer values (out, in) in [-8, 7] (`bits=4`) or [-128, 127] (`bits=8`), `in` a multiple of 8, as
    `tile_linear` reads them: the rows in tiles of 16, the last padded with zeros, each tile a step of 64 bytes for
    the next 8 (int4) or 4 (int8) inputs k.., in two halves. int4: (tiles, in / 8, 64) uint8, byte 4 r + j holds row
    r's input k + j plus 8 in its low nibble and input k + 4 + j plus 8 in its high one. int8: (tiles, in / 4, 64)
    int8, byte 2 r + j holds row r's input k + j, byte 32 + 2 r + j its input k + 2 + j. Written into `out` where it
    is given (a slice of a larger layer's tiles)."""
    rows, inputs = values.shape
    tiles, steps = -(-rows // TILE), inputs // TILE_INPUTS[bits]
    if rows % TILE:  # only a last tile that is not whole needs a padded copy
        values = torch.cat([values, values.new_zeros(tiles * TILE - rows, inputs)])
    if bits == 4:
        # A row's 8 values of a step, plus 8 (0..15), as one int64: its low word or'd with its high one shifted by a
        # nibble is the step's 4 bytes of that row (each byte's high nibble is 0: nothing carries)
        biased = (values.to(torch.int8) + 8).contiguous().view(torch.int64)  # (rows, steps); x86: little-endian
        halves = ((biased & 0xFFFFFFFF) | ((biased >> 32) << 4)).view(torch.int32)[:, 0::2]  # the low words
        halves = halves.view(tiles, TILE, steps, 1)
        order = (0, 2, 1, 3)  # (tiles, rows, steps, 1) -> (tiles, steps, rows, 1)
    else:
        # a row's half of a step: 2 bytes
        halves = values.to(torch.int8).contiguous().view(tiles, TILE, steps, 2, 2).view(torch.int16)
        order = (0, 2, 3, 1, 4)  # (tiles, rows, steps, halves, 1) -> (tiles, steps, halves, rows, 1)
    dtype = torch.uint8 if bits == 4 else torch.int8
    if out is None:
        out = torch.empty(tiles, steps, 64, dtype=dtype, device=values.device)
    # The transposition moves whole 4- or 2-byte units of a row: a copy of a quarter or half as many elements
    out.view(torch.int32 if bits == 4 else torch.int16).view(halves.permute(order).shape).copy_(halves.permute(order))
    return out


def unpack_tiles(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The int8 values (out, in) that `pack_tiles` packed (int4 tiles are uint8, int8 ones int8)."""
    tiles, steps, _ = packed.shape
    if packed.dtype == torch.uint8:
        bytes_ = packed.view(tiles, steps, TILE, 1, 4)
        nibbles = torch.cat([bytes_ & 0x0F, bytes_ >> 4], dim=3)  # (tiles, steps, rows, halves, 4)
        values = (nibbles.to(torch.int8) - 8).transpose(1, 2)
    else:
        values = packed.view(tiles, steps, 2, TILE, 2).permute(0, 3, 1, 2, 4)  # (tiles, rows, steps, halves, 2)
    return values.reshape(tiles * TILE, -1)[:out_features]


def tile_scales(scale: torch.Tensor) -> torch.Tensor:
    """Scales (out, groups) as `tile_linear` reads them: (tiles, groups, 16), the last tile padded with zeros."""
    out, groups = scale.shape
    tiles = -(-out // TILE)
    padded = scale.new_zeros(tiles * TILE, groups)
    padded[:out] = scale
    return padded.view(tiles, TILE, groups).transpose(1, 2).contiguous()


def untile_scales(tiled: torch.Tensor, out_features: int) -> torch.Tensor:
    """The scales (out, groups) that `tile_scales` tiled."""
    return tiled.transpose(1, 2).reshape(-1, tiled.shape[1])[:out_features]


__all__ = [
    "GROUP_LIMIT",
    "GROUP_MULTIPLE",
    "TILE",
    "TILE_INPUTS",
    "TILE_INT8_GROUP_LIMIT",
    "built_operators",
    "cpu_fingerprint",
    "float_kernel_available",
    "native_kernels_available",
    "pack_int4",
    "pack_tiles",
    "tile_scales",
    "tiles_available",
    "unpack_int4",
    "unpack_tiles",
    "untile_scales",
    "vector_isa",
]
