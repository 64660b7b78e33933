"""hf_tfm's native CPU kernels for decoding, compiled for this machine's CPU on first use (about 10 s, then cached by
torch's extension builder): `torch.ops.hf_tfm.int_linear` (inference/csrc/int_linear.cpp) for integer weights, and
`torch.ops.hf_tfm.float_linear` (inference/csrc/float_linear.cpp) for float32 weights and a few tokens.

`int_linear(x, weight, scale, bits)` multiplies a few tokens `x` (..., in) in float32 by int8 weights (`bits=8`,
(out, in)) or int4 weights packed two to a byte (`bits=4`, (out, in / 2), `pack_int4`), each with a float32 scale per
group of inputs (`scale` (out, groups); a group is a multiple of 64 inputs, at most 4096). Each token's inputs are
rounded to int16 with a scale per group (a relative error of 2^-16: the weights' rounding is the only loss, as GPTQ /
AWQ's "W4A16" promises), integer multiply-adds take the products, and one token's product reads the weights at the
memory's streaming rate.

`int4_linear(x, weight, scale, out_features)`, where `int8_inputs_available()` (AVX-512 VNNI), is hf_tfm's q4: int4
weights in tiles of 16 rows (`pack_int4_tiles`: (tiles, in / 8, 64) uint8, the scales (tiles, groups, 16)
`tile_scales`) by each token's inputs rounded to int8 per group, as llama.cpp rounds them for its Q4_0. A `vpdpbusd`
multiplies 4 inputs by 16 rows' weights at once, so prompts and verify steps run at 2.5x the products a second of
`int_linear`'s rows, and one token reads the weights faster too. Both are registered operators with fake (shape)
implementations: `torch.compile` calls them from the compiled step without a graph break.

`float_linear(x, weight)` multiplies a few tokens (a batch decoding together, a short prompt) by float32 weights
(out, in), `in` a multiple of 16, reading each weight from memory once for all of them. MKL's GEMM, made for more
tokens, read the bench's base-shape matrices at half the rate on this project's AMD EPYC (8 tokens: 41 ms, against 22
here; 32 tokens: 67 against 52). `StreamingLinear` calls it for 2 to 32 tokens.

They need a C++ compiler, and `int_linear` AVX2 or AVX-512 VNNI, `float_linear` AVX-512 VNNI. Where one is missing,
or `HF_TFM_NATIVE_KERNELS=0`, `native_kernels_available()` (`int_linear`) or `float_kernel_available()` is False:
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
TILE = 16  # rows: int4_linear's weights are stored in tiles of this many rows


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

    if vector_isa() == "AVX-512 VNNI":  # int_linear.cpp's AVX-512 build defines int4_linear too

        @torch.library.register_fake("hf_tfm::int4_linear")
        def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_features: int) -> torch.Tensor:
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


def int8_inputs_available() -> bool:
    """Whether `int4_linear` is there (int4 tiles by 8-bit inputs: `vpdpbusd`'s unsigned-by-signed bytes): the
    AVX-512 VNNI build, where it is built (`built_operators`)."""
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


def pack_int4_tiles(values: torch.Tensor) -> torch.Tensor:
    """int4 values (out, in) in [-8, 7], `in` a multiple of 8, as `int4_linear` reads them: (tiles, in / 8, 64)
    uint8, the rows in tiles of 16 (the last padded with zeros). For inputs k..k+7 of a tile, byte 4 r + j holds row
    r's input k + j plus 8 in its low nibble and input k + 4 + j plus 8 in its high one."""
    out, inputs = values.shape
    tiles = -(-out // TILE)
    padded = values.new_zeros(tiles * TILE, inputs)
    padded[:out] = values
    biased = (padded.to(torch.int8) + 8).view(torch.uint8).view(tiles, TILE, inputs // 8, 2, 4)  # 0..15
    packed = biased[:, :, :, 0] | (biased[:, :, :, 1] << 4)  # (tiles, rows, runs of 8, 4)
    return packed.transpose(1, 2).reshape(tiles, inputs // 8, 4 * TILE)


def unpack_int4_tiles(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The int8 values (out, in) that `pack_int4_tiles` packed."""
    tiles, runs, _ = packed.shape
    bytes_ = packed.view(tiles, runs, TILE, 1, 4)
    nibbles = torch.cat([bytes_ & 0x0F, bytes_ >> 4], dim=3)  # (tiles, runs, rows, 2, 4)
    values = (nibbles.to(torch.int8) - 8).transpose(1, 2).reshape(tiles * TILE, runs * 8)
    return values[:out_features]


def tile_scales(scale: torch.Tensor) -> torch.Tensor:
    """Scales (out, groups) as `int4_linear` reads them: (tiles, groups, 16), the last tile padded with zeros."""
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
    "built_operators",
    "cpu_fingerprint",
    "float_kernel_available",
    "int8_inputs_available",
    "native_kernels_available",
    "pack_int4",
    "pack_int4_tiles",
    "tile_scales",
    "unpack_int4",
    "unpack_int4_tiles",
    "untile_scales",
    "vector_isa",
]
