"""hf_tfm's native CPU kernels (hf_tfm.inference.kernels: int8/int4 in csrc/int_linear.cpp, float32 in
csrc/float_linear.cpp) against a reference of their arithmetic written in torch, the layers that call them against
their fallback formula, and the decode step's attention against sdpa. Speed lives in scripts/bench.py."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from conftest import compiled_generate, eager_generate
from export_models import NEW_TOKENS, trained
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from hf_tfm import load_for_inference
from hf_tfm.inference.attention import _attended_keys, decode_attention
from hf_tfm.inference.kernels import (
    built_operators,
    float_kernel_available,
    native_kernels_available,
    pack_int4,
    pack_tiles,
    tile_scales,
    tiles_available,
    unpack_int4,
    unpack_tiles,
    untile_scales,
    vector_isa,
)
from hf_tfm.inference.layers import ONEDNN, STREAMING_TOKENS, Int8StreamingLinear, StreamingLinear

native = pytest.mark.skipif(not native_kernels_available(), reason="needs AVX2 or AVX-512 VNNI, and a C++ compiler")
float_native = pytest.mark.skipif(not float_kernel_available(), reason="needs AVX-512 VNNI and a C++ compiler")


def reference(x: torch.Tensor, integers: torch.Tensor, scale: torch.Tensor, input_bits: int = 16) -> torch.Tensor:
    """The kernel's arithmetic in float64: each token's inputs rounded to integers of `input_bits` with a scale per
    group (the inputs times largest / their largest magnitude, in float32, to the nearest, ties to even), integer
    products summed per group, times both scales."""
    groups, largest = scale.shape[1], 2 ** (input_bits - 1) - 1
    xg = x.float().unflatten(-1, (groups, -1))  # (T, G, group)
    amax = xg.abs().amax(-1, keepdim=True)
    xq = torch.round(xg * torch.where(amax > 0, largest / amax, 0)).double()
    wg = integers.double().unflatten(-1, (groups, -1))  # (N, G, group)
    sums = torch.einsum("tgk,ngk->tng", xq, wg)
    return (sums * (amax.double() / largest)[..., 0][:, None, :] * scale.double()[None]).sum(-1)


tiled = pytest.mark.skipif(not tiles_available(), reason="weights in tiles need AVX-512 VNNI")


def product(x: torch.Tensor, integers: torch.Tensor, scale: torch.Tensor, bits: int, tiles: bool) -> torch.Tensor:
    """The kernel's product for weights stored as the layers store them, in rows or in tiles."""
    if tiles:
        return torch.ops.hf_tfm.tile_linear(x, pack_tiles(integers, bits), tile_scales(scale), len(integers), bits)
    return torch.ops.hf_tfm.int_linear(x, pack_int4(integers) if bits == 4 else integers, scale, bits)


@native
@pytest.mark.parametrize(
    "bits, tiles",
    [
        pytest.param(8, False, id="int8"),
        pytest.param(4, False, id="int4"),
        pytest.param(8, True, marks=tiled, id="int8_tiles"),
        pytest.param(4, True, marks=tiled, id="int4_tiles"),
    ],
)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 9, 13])
@pytest.mark.parametrize("groups", [1, 3])
def test_kernel_computes_its_arithmetic(bits, tiles, tokens, groups):
    """Every row count (70: a remainder past the blocks of 4 rows, and of 2 tiles of 16, the last tile 6 rows),
    token count (pairs and a last one; for tiles up to 9 in one block, more in blocks of 4 and 1 to 3 left) and group
    layout gives the reference's sums to
    float32 rounding, whatever the inputs' scale (a zero token included): inputs rounded to 16 bits, 8 for int4
    tiles (q4's)."""
    torch.manual_seed(bits * 100 + tokens)
    inputs, largest = 192, 127 if bits == 8 else 7
    integers = torch.randint(-largest - 1, largest + 1, (70, inputs), dtype=torch.int8)
    scale = torch.rand(70, groups) + 0.01
    x = torch.randn(tokens, inputs) * torch.logspace(-3, 3, tokens)[:, None]
    x[0, :64] = 0  # a group of zeros: its scale is 0 and nothing may divide by it
    y = product(x, integers, scale, bits, tiles)
    expected = reference(x, integers, scale, 8 if tiles and bits == 4 else 16)
    assert y.dtype == torch.float32 and y.shape == (tokens, 70)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@native
@pytest.mark.parametrize("inputs", [8192, 1024])
def test_a_long_row_with_one_scale_takes_groups_the_sums_cannot_overflow(inputs):
    """A scale per row of many inputs (a channel-wise compressed-tensors layer): past the kernel's group limit (4096
    inputs in rows, 512 for int8 tiles, whose sums of a row lie in one lane) the layer repeats it per 64 inputs, so
    no int32 sum of the largest weights by the largest inputs overflows."""
    integers = torch.full((8, inputs), -128, dtype=torch.int8)
    layer = Int8StreamingLinear(integers, torch.full((8, 1), 0.01), None)
    split = inputs > 4096 or layer.tiled
    assert layer.native and layer.scales().shape == (8, inputs // 64 if split else 1)
    x = torch.ones(1, inputs)
    torch.testing.assert_close(layer(x), torch.full((1, 8), -128 * 0.01 * inputs))
    if layer.tiled:  # the largest sum a group of 512 may hold: 512 products of -128 by 32767
        weight, scale = pack_tiles(integers[:, :512], 8), tile_scales(torch.full((8, 1), 0.01))
        y = torch.ops.hf_tfm.tile_linear(torch.ones(1, 512), weight, scale, 8, 8)
        torch.testing.assert_close(y, torch.full((1, 8), -128 * 0.01 * 512))


@native
def test_kernel_refuses_what_it_cannot_compute():
    x, scale = torch.randn(2, 128), torch.rand(4, 2)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        torch.ops.hf_tfm.int_linear(x, torch.zeros(4, 128, dtype=torch.int8), scale, 2)
    with pytest.raises(RuntimeError, match="128 inputs need weight rows of 64 bytes"):
        torch.ops.hf_tfm.int_linear(x, torch.zeros(4, 128, dtype=torch.uint8), scale, 4)
    with pytest.raises(RuntimeError, match="groups of a multiple of 64 inputs"):
        torch.ops.hf_tfm.int_linear(x, torch.zeros(4, 128, dtype=torch.int8), torch.rand(4, 4), 8)
    with pytest.raises(RuntimeError, match="at most 4096 inputs"):
        torch.ops.hf_tfm.int_linear(torch.randn(1, 8192), torch.zeros(4, 8192, dtype=torch.int8), scale[:, :1], 8)
    with pytest.raises(RuntimeError, match="float32 inputs"):
        torch.ops.hf_tfm.int_linear(x.double(), torch.zeros(4, 128, dtype=torch.int8), scale, 8)


@native
@tiled
def test_tiles_kernel_refuses_what_it_cannot_compute():
    x, weight, scale = torch.randn(2, 128), torch.zeros(2, 16, 64, dtype=torch.uint8), torch.rand(2, 2, 16)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        torch.ops.hf_tfm.tile_linear(x, weight, scale, 32, 2)
    with pytest.raises(RuntimeError, match=r"128 inputs need int4 weight tiles \(tiles, 16, 64\) of uint8"):
        torch.ops.hf_tfm.tile_linear(x, weight[:, :8], scale, 32, 4)
    with pytest.raises(RuntimeError, match=r"128 inputs need int8 weight tiles \(tiles, 32, 64\) of int8"):
        torch.ops.hf_tfm.tile_linear(x, weight, scale, 32, 8)  # int4's tiles
    with pytest.raises(RuntimeError, match=r"scale \(tiles, groups, 16\)"):
        torch.ops.hf_tfm.tile_linear(x, weight, scale[:, :, :8], 32, 4)
    with pytest.raises(RuntimeError, match="2 tiles hold 17 to 32 outputs, not 16"):  # a whole tile of padding
        torch.ops.hf_tfm.tile_linear(x, weight, scale, 16, 4)
    with pytest.raises(RuntimeError, match="groups of a multiple of 64 inputs"):
        torch.ops.hf_tfm.tile_linear(x, weight, torch.rand(2, 4, 16), 32, 4)
    with pytest.raises(RuntimeError, match="float32 inputs"):
        torch.ops.hf_tfm.tile_linear(x.double(), weight, scale, 32, 4)
    x, weight = torch.randn(1, 1024), torch.zeros(1, 256, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="int8 weights take groups of at most 512 inputs"):
        torch.ops.hf_tfm.tile_linear(x, weight, torch.rand(1, 1, 16), 16, 8)


def compiled_in_one_graph(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` compiled afresh, in one graph."""
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(module, fullgraph=True)(x)
    assert not counters["graph_break"]
    return out


class CalledOps(TorchDispatchMode):
    """The operators a block of code runs, as the dispatcher sees them."""

    def __enter__(self) -> set:
        self.called = set()
        super().__enter__()
        return self.called

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.called.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@float_native
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 13])
def test_float_kernel_computes_the_product(tokens):
    """Every row count (70: a remainder past the blocks of 4 rows) and token count (blocks of 4, of 2 and a last one)
    gives the float64 product to float32 rounding, for inputs a multiple of 16 but not of 64."""
    torch.manual_seed(tokens)
    weight, x = torch.randn(70, 208), torch.randn(tokens, 208) * torch.logspace(-3, 3, tokens)[:, None]
    y = torch.ops.hf_tfm.float_linear(x, weight)
    expected = x.double() @ weight.double().T
    assert y.dtype == torch.float32 and y.shape == (tokens, 70)
    error = (y.double() - expected).abs() / expected.abs().amax(1, keepdim=True)  # each token at its own scale
    assert error.max() < 1e-5
    assert torch.equal(torch.ops.hf_tfm.float_linear(x.view(1, tokens, 1, 208), weight), y.view(1, tokens, 1, 70))


@float_native
def test_float_kernel_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="a multiple of 16 inputs, got 40"):
        torch.ops.hf_tfm.float_linear(torch.randn(2, 40), torch.randn(4, 40))
    with pytest.raises(RuntimeError, match="weight \\(out, in\\) for 48 inputs"):
        torch.ops.hf_tfm.float_linear(torch.randn(2, 48), torch.randn(4, 32))
    with pytest.raises(RuntimeError, match="float32 inputs and weights"):
        torch.ops.hf_tfm.float_linear(torch.randn(2, 48, dtype=torch.float64), torch.randn(4, 48))


@float_native
@pytest.mark.parametrize("bias", [False, True])
def test_streaming_linear_calls_the_float_kernel_for_a_few_tokens(bias):
    """2 to STREAMING_TOKENS["float kernel"] tokens take the kernel, eagerly and compiled (one graph, the same
    floats); one token compiled takes the streaming formula; more tokens, or a product autograd records, another."""
    torch.manual_seed(0)
    reference = nn.Linear(48, 80, bias=bias)
    layer = StreamingLinear.from_linear(copy.deepcopy(reference))
    assert type(layer) is StreamingLinear and layer.native
    limit = STREAMING_TOKENS["float kernel"]
    for shape, kernel in [((2, 48), True), ((4, 2, 48), True), ((limit, 48), True), ((limit + 1, 48), False)]:
        x = torch.randn(shape)
        with torch.no_grad(), CalledOps() as called:
            eager = layer(x)
        assert ("hf_tfm.float_linear" in called) is kernel, (shape, called)
        with torch.no_grad():
            expected = reference(x)
            compiled = compiled_in_one_graph(layer, x)
        torch.testing.assert_close(eager, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(compiled, eager) if kernel else torch.allclose(compiled, expected, rtol=1e-5, atol=1e-5)
    x = torch.randn(3, 48, requires_grad=True)
    with CalledOps() as called:
        layer(x).sum().backward()
    assert "hf_tfm.float_linear" not in called and x.grad is not None


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_streaming_linear_takes_onednn_for_a_prompt(bias):
    """A prompt's product (more tokens than the kernel takes) is oneDNN's, eagerly and without gradient: nn.Linear's
    floats within rounding, for strided inputs too; with autograd recording, nn.Linear's own, gradient included."""
    torch.manual_seed(0)
    reference = nn.Linear(48, 80, bias=bias)
    layer = StreamingLinear.from_linear(copy.deepcopy(reference))
    tokens = STREAMING_TOKENS["float kernel"] + 1
    for x in (torch.randn(2, tokens, 48), torch.randn(tokens, 2, 48).transpose(0, 1)):
        with torch.no_grad(), CalledOps() as called:
            out = layer(x)
        assert "mkldnn._linear_pointwise" in called, called
        torch.testing.assert_close(out, reference(x).detach(), rtol=1e-5, atol=1e-5)
    x = torch.randn(tokens, 48, requires_grad=True)
    with CalledOps() as called:
        layer(x).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).sum().backward()
    assert "mkldnn._linear_pointwise" not in called and torch.equal(x.grad, x_ref.grad)


@native
def test_compile_caches_are_keyed_by_the_kernels_build():
    """torch.compile's cache keys carry the build's digest (of the kernels' source): a graph cached against another
    hf_tfm's operators (int_linear had 5 arguments before it had 4) is never reused, where Inductor alone keyed it by
    the operators' names and then called the new one with the old arguments."""
    tags = torch.compiler.config.cache_key_tag.split("|")
    assert sum(tag.startswith("hf_tfm-kernels-") for tag in tags) == 1, tags
    built_operators.cache_clear()
    built_operators()  # built again (cached by torch's extension builder): the tag is not repeated
    assert torch.compiler.config.cache_key_tag.split("|") == tags


def test_int4_packing_round_trips():
    values = torch.randint(-8, 8, (5, 192), dtype=torch.int8)
    packed = pack_int4(values)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 96)
    assert torch.equal(unpack_int4(packed), values)
    # the layout the kernel reads: byte j of a run of 64 holds input j (low nibble) and input j + 32 (high), + 8
    assert packed[0, 0].item() == (values[0, 0].item() + 8) | ((values[0, 32].item() + 8) << 4)


@pytest.mark.parametrize("rows", [21, 32])
def test_tiles_round_trip(rows):
    """Both layouts of `pack_tiles`, with a padded last tile and without, written into a larger layer's slice too."""
    int4, int8 = (
        torch.randint(-8, 8, (rows, 64), dtype=torch.int8),
        torch.randint(-128, 128, (rows, 64)).to(torch.int8),
    )
    scale = torch.rand(rows, 2)
    tiles4, tiles8 = pack_tiles(int4, 4), pack_tiles(int8, 8)
    assert tiles4.dtype == torch.uint8 and tiles4.shape == (2, 8, 64)
    assert tiles8.dtype == torch.int8 and tiles8.shape == (2, 16, 64)
    assert torch.equal(unpack_tiles(tiles4, rows), int4) and torch.equal(unpack_tiles(tiles8, rows), int8)
    assert tile_scales(scale).shape == (2, 2, 16) and torch.equal(untile_scales(tile_scales(scale), rows), scale)
    # int4: in tile 1, inputs 8..15, byte 4 r + j holds row 16 + r's input 8 + j (low nibble) and 12 + j (high), + 8
    assert tiles4[1, 1, 4 * 3 + 2].item() == (int4[19, 10].item() + 8) | ((int4[19, 14].item() + 8) << 4)
    # int8: in tile 1, inputs 8..11, byte 2 r + j holds row 16 + r's input 8 + j, byte 32 + 2 r + j its input 10 + j
    assert tiles8[1, 2, 2 * 3 + 1].item() == int8[19, 9].item() and tiles8[1, 2, 32 + 6].item() == int8[19, 10]
    if rows == 21:  # the padding rows hold 0 (+ 8 for int4)
        assert tiles4[1, :, 4 * 5 :].eq(0x88).all() and tiles8[1, :, 2 * 5 : 32].eq(0).all()
    larger = torch.zeros(3, 16, 64, dtype=torch.int8)
    pack_tiles(int8, 8, out=larger[1:])
    assert torch.equal(larger[1:], tiles8) and larger[0].eq(0).all()


@native
@pytest.mark.parametrize("bits", [8, 4])
def test_layers_call_the_kernel_eagerly_and_compiled(bits):
    """A layer calls the kernel for any number of tokens, eagerly and compiled (one graph, the same floats): the
    kernel's arithmetic, within the inputs' rounding (half a step a weight) of the dequantized product."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 96)
    q = Int8StreamingLinear.from_linear(layer, bits=bits)
    # The weights in tiles where the kernel takes them, q4's by inputs rounded to 8 bits; a W4A16 checkpoint's int4
    # layers keep 16, and rows
    tiles = tiles_available()
    assert q.native and q.bits == bits and q.tiled is tiles and q.scales().shape == (96, 2)
    assert q.input_bits == (8 if tiles and bits == 4 else 16)
    shapes = {(True, 4): (6, 32, 64), (True, 8): (6, 64, 64), (False, 4): (96, 128), (False, 8): (96, 256)}
    assert q.weight.shape == shapes[tiles, bits]
    assert q.integers().abs().max() == (127 if bits == 8 else 8)
    assert Int8StreamingLinear(q.integers(), q.scales(), None).input_bits == 16
    x = torch.randn(3, 256)
    dequantized = q.integers().float().unflatten(1, (2, 128)).mul(q.scales()[..., None]).flatten(1)
    with torch.no_grad():
        eager = q(x)
        compiled = compiled_in_one_graph(q, x)
        many = q(torch.cat([x, torch.randn(30, 256)]))[:3]  # a prompt's worth: each token on its own
        exact = nn.functional.linear(x, dequantized, layer.bias)
    assert torch.equal(eager, compiled) and torch.equal(eager, many)
    expected = reference(x, q.integers(), q.scales(), q.input_bits) + layer.bias.double()
    torch.testing.assert_close(eager.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    step = x.abs().amax(1, keepdim=True) / (2 ** (q.input_bits - 1) - 1)  # the coarsest group's
    assert ((eager - exact).abs() <= step / 2 * dequantized.abs().sum(1) + 1e-5).all()


@native
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [(32, 16, 48), (70, 32, 6)], ids=["whole-tiles", "padded-tiles"])
def test_concat_computes_each_layer_s_rows_to_the_bit(rows, bits):
    """`concat` (fuse_projections) gives each layer's outputs exactly: tiles are stacked as they are, or tiled again
    where a layer's last tile is padded (70 rows: 6 of padding would lie between two layers' rows)."""
    torch.manual_seed(0)
    layers = [Int8StreamingLinear.from_linear(nn.Linear(128, n), bits=bits) for n in rows]
    fused = Int8StreamingLinear.concat(layers)
    assert fused.out_features == sum(rows) and (fused.input_bits, fused.tiled) == (
        layers[0].input_bits,
        layers[0].tiled,
    )
    assert torch.equal(fused.integers(), torch.cat([layer.integers() for layer in layers]))
    x = torch.randn(5, 128)
    with torch.no_grad():
        assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], dim=-1))


@native
def test_q4_compiled_greedy_equals_eager_and_tracks_the_float_model(tmp_path):
    """`load_for_inference(quantize="q4")`: int4 layers on the kernel and an int8 lm_head; compiled greedy tokens equal
    eager ones with the same weights, and the tiny trained model's greedy tokens survive int4."""
    model = trained({})
    model.save_pretrained(tmp_path)
    fast = load_for_inference(tmp_path, quantize="q4")
    layers = [m for m in fast.modules() if isinstance(m, Int8StreamingLinear)]
    assert all(m.native for m in layers) and fast.lm_head.bits == 8
    assert {m.bits for m in layers if m is not fast.lm_head} == {4}
    ids = torch.tensor([[1, 5, 12, 19, 26, 33, 40]])
    options = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
    compiled = compiled_generate(fast, ids, **options)
    assert torch.equal(compiled, eager_generate(fast, ids, **options))
    assert torch.equal(compiled, model.generate(ids, **options))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_decode_attention_is_sdpa_for_one_query(kv_heads):
    """The compiled step's attention for a single query: sdpa's result (GQA, a padding mask, an ALiBi-like bias),
    by the plain formula; more queries go to sdpa itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 4 // kv_heads, True
    module.eval()
    query, key, value = torch.randn(2, 4, 1, 16), torch.randn(2, kv_heads, 9, 16), torch.randn(2, kv_heads, 9, 16)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding
    bias = -torch.rand(2, 4, 1, 9)
    options = {"scaling": 0.25, "position_bias": bias}
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, **options)
    out, weights = decode_attention(module, query, key, value, mask, **options)
    torch.testing.assert_close(out, expected)
    assert weights.shape == (2, 4, 1, 9) and (weights[0, ..., :3] == 0).all()


@pytest.mark.parametrize("case", ["causal", "left-padded", "cached-prefix", "bias"])
def test_decode_attention_leaves_out_the_static_cache_slots_a_prompt_does_not_attend(case):
    """A prompt over a static cache (its empty slots masked): sdpa's result over every slot, from the slots some query
    attends; for a plain causal prompt from sdpa's causal kernel, without the mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    module.eval()
    queries, slots, start = 5, 12, 3 if case == "cached-prefix" else 0  # the prompt fills slots start..start+4
    query, key, value = torch.randn(2, 4, queries, 16), torch.randn(2, 2, slots, 16), torch.randn(2, 2, slots, 16)
    mask = torch.ones(queries, slots, dtype=torch.bool).tril(start)[None, None].repeat(2, 1, 1, 1)  # (B, 1, q, S)
    if case == "left-padded":
        mask[1, ..., :2] = False
    options = {"scaling": 0.25, "position_bias": -torch.rand(2, 4, queries, slots) if case == "bias" else None}
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, **options)
    with CalledOps() as called:
        out, _ = decode_attention(module, query, key, value, mask, **options)
    torch.testing.assert_close(out, expected)
    kept = _attended_keys(query, key, value, mask, options["position_bias"])
    assert kept[0].shape[2] == start + queries and (kept[2] is None) is (case == "causal"), case
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in called or case != "causal", called


AVX512_VNNI = torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported()


@native
def test_the_build_has_the_operators_of_the_cpus_instruction_set():
    """AVX-512 VNNI builds both kernels; AVX2 (or HF_TFM_NATIVE_KERNELS=avx2) the integer one alone, and the float
    layers keep oneDNN's and Inductor's products."""
    avx2 = os.environ.get("HF_TFM_NATIVE_KERNELS") == "avx2" or not AVX512_VNNI
    assert built_operators() == ({"int_linear"} if avx2 else {"int_linear", "float_linear"})
    assert vector_isa() == ("AVX2" if avx2 else "AVX-512 VNNI") and tiles_available() is not avx2
    assert StreamingLinear.from_linear(nn.Linear(64, 8)).native is not avx2


@native
@pytest.mark.skipif(float_kernel_available(), reason="the AVX-512 VNNI build takes every prompt")
@pytest.mark.parametrize("bits", [8, 4])
def test_the_avx2_build_hands_a_long_prompt_to_onednn(bits):
    """Past STREAMING_TOKENS["int kernel, AVX2"] tokens an integer layer multiplies eagerly with its dequantized
    weights on oneDNN (the dequantized product's floats, bias included); up to it, and compiled, with the kernel."""
    torch.manual_seed(0)
    q = Int8StreamingLinear.from_linear(nn.Linear(128, 48), bits=bits)
    assert q.prompts_dequantized
    limit = STREAMING_TOKENS["int kernel, AVX2"]
    for tokens, onednn in [(limit, False), (limit + 1, True)]:
        x = torch.randn(tokens, 128)
        with torch.no_grad(), CalledOps() as called:
            y = q(x)
        assert ("mkldnn._linear_pointwise" in called) is onednn and ("hf_tfm.int_linear" in called) is not onednn
        expected = x.double() @ q.dequantized(torch.float64).T + q.bias.double()
        torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    x = torch.randn(limit + 1, 128)
    with torch.no_grad():  # compiled: the kernel's floats
        assert torch.equal(
            compiled_in_one_graph(q, x),
            torch.ops.hf_tfm.int_linear(x, q.weight, q.weight_scale, bits) + q.bias,
        )


@pytest.mark.skipif(not AVX512_VNNI, reason="without AVX-512 VNNI the default build is the AVX2 one: the tests above")
def test_the_avx2_build_computes_the_same_arithmetic():
    """The integer kernel's AVX2 build, forced where AVX-512 VNNI is there: this file's integer tests pass on it."""
    tests = (
        "(computes_its_arithmetic or overflow or refuses or layers_call or q4_compiled or operators or long_prompt)"
        " and not float and not tiles"  # AVX-512 VNNI's alone
    )
    env = {**os.environ, "HF_TFM_NATIVE_KERNELS": "avx2"}
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", tests]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and " skipped" not in done.stdout, done.stdout[-4000:]


def test_kernel_can_be_turned_off():
    """HF_TFM_NATIVE_KERNELS=0: no kernels; integer layers keep the compiled formula, float ones MKL's product."""
    code = (
        "import torch; from hf_tfm.inference.kernels import native_kernels_available, vector_isa; "
        "from hf_tfm.inference import Int8StreamingLinear, StreamingLinear; "
        "q = Int8StreamingLinear.from_linear(torch.nn.Linear(128, 8), bits=4); "
        "f = StreamingLinear.from_linear(torch.nn.Linear(128, 8)); "
        "print(native_kernels_available(), q.native, q.bits, q.input_bits, f.native, vector_isa())"
    )
    env = {**os.environ, "HF_TFM_NATIVE_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "8", "16", "False", "none"]
