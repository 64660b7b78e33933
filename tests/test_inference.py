"""hf_tfm's own decode kernels (hf_tfm.inference): the streaming single-token product of `StreamingLinear` and the int8
rows of `quantize="q8"`, against `nn.Linear` and against the float model. Speed lives in scripts/bench.py."""

import copy
import logging

import pytest
import torch
from conftest import build, compiled_generate, eager_generate, tiny_config, tiny_seq2seq_config
from export_models import NEW_TOKENS, PROMPTS, trained, trained_seq2seq
from torch import nn

from hf_tfm import TfmForCausalLM, TfmForConditionalGeneration, load_for_inference
from hf_tfm.inference import Int8StreamingLinear, StreamingLinear, quantize_q4, quantize_q8
from hf_tfm.inference.aot import CompiledDecodeStep
from hf_tfm.inference.kernels import native_kernels_available
from hf_tfm.inference.layers import QUANTIZE_ROWS
from hf_tfm.modeling import CACHE_NAME

OPTIONS = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}


def left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    return ids, mask


def linear(bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(48, 80, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [(1, 1, 48), (1, 48), (3, 1, 48), (2, 5, 48)])
def test_streaming_linear_computes_the_linear_layer(bias, tokens):
    """Without the native kernel (tests/test_kernels.py has it): eager it is oneDNN's product (nn.Linear's without
    oneDNN); compiled, one token takes the streaming product and more tokens the matrix product, each equal to
    nn.Linear up to float rounding."""
    reference = linear(bias)
    streaming = StreamingLinear.from_linear(linear(bias))
    streaming.native = False
    x = torch.randn(tokens)
    with torch.no_grad():
        expected = reference(x)
        torch.testing.assert_close(streaming(x), expected, atol=1e-5, rtol=1e-5)
        compiled = torch.compile(streaming, fullgraph=True)(x)
    assert compiled.shape == expected.shape
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [(1, 1, 48), (8, 1, 48), (4, 9, 48)])
def test_int8_rows_round_to_nearest_and_compile_to_the_same_product(tokens):
    """Each weight is within half a step of its row's scale, the row's largest weight exactly representable; eager
    (dequantized) and compiled (streamed for up to 8 tokens, dequantized past them) agree, and both stay within the
    quantization error of the float layer."""
    float_layer = linear(bias=True)
    q8 = Int8StreamingLinear.from_linear(float_layer)
    assert q8.weight.dtype == torch.int8 and q8.weight_scale.shape == (80, 1)
    dequantized = q8.weight.float() * q8.weight_scale
    step = q8.weight_scale.expand_as(dequantized)
    assert ((dequantized - float_layer.weight).abs() <= step / 2 + 1e-7).all()
    assert (q8.weight.abs().amax(dim=1) == 127).all()
    x = torch.randn(tokens)
    with torch.no_grad():
        eager = q8(x)
        compiled = torch.compile(q8, fullgraph=True)(x)
        exact = float_layer(x)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    error_bound = (x.abs().sum(-1, keepdim=True) * q8.weight_scale[:, 0] / 2).expand_as(exact)  # sum |x| * step / 2
    assert ((eager - exact).abs() <= error_bound + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_rounding_a_block_of_rows_at_a_time_is_the_whole_matrix_formula(bits):
    """`from_linear` rounds `QUANTIZE_ROWS` rows at a time: the integers and scales are the whole matrix's formula's
    (a scale per 128 inputs: the group's largest magnitude over 127, or over 7.5 for int4), the last block short,
    an all-zero row included; the float layer is left as it was."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 2 * QUANTIZE_ROWS + 5)
    with torch.no_grad():
        layer.weight[7] = 0
    before = layer.weight.detach().clone()
    q = Int8StreamingLinear.from_linear(layer, bits=bits)
    grouped = before.unflatten(1, (2, 128))
    scale = grouped.abs().amax(dim=2).clamp(min=torch.finfo(torch.float32).tiny) / (127 if bits == 8 else 7.5)
    largest = 127 if bits == 8 else 7
    integers = torch.round(grouped / scale[..., None]).clamp(-largest - 1, largest).flatten(1).to(torch.int8)
    assert torch.equal(q.integers(), integers) and torch.equal(q.scales(), scale)
    assert torch.equal(layer.weight, before)


@pytest.mark.parametrize("tokens", [(1, 1, 64), (2, 3, 64)])
def test_int4_groups_from_a_compressed_layer_stream_the_same_product(tokens):
    """A compressed-tensors layer once decompressed (float weights = int4 values x the scale of their group of 32
    input features, as GPTQ / AWQ checkpoints hold them): `from_compressed` recovers the integers exactly, and eager
    and compiled products (streamed per group for up to 8 tokens) equal the float layer's."""
    torch.manual_seed(0)
    integers = torch.randint(-8, 8, (40, 64)).float()
    scale = torch.rand(40, 2) * 0.1 + 0.01  # (out, groups)
    layer = nn.Linear(64, 40)
    with torch.no_grad():
        layer.weight.copy_(integers * scale.repeat_interleave(32, dim=1))
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    streamed = Int8StreamingLinear.from_compressed(layer)
    assert torch.equal(streamed.weight, integers.to(torch.int8)) and torch.equal(streamed.weight_scale, scale)
    assert "groups=2" in repr(streamed)
    x = torch.randn(tokens)
    with torch.no_grad():
        exact = layer(x)
        torch.testing.assert_close(streamed(x), exact, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.compile(streamed, fullgraph=True)(x), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_q8_compiled_greedy_equals_eager_q8_and_tracks_the_float_model(kind, tmp_path):
    """`load_for_inference(quantize="q8")`: every linear layer (lm_head too) holds int8 rows; its compiled greedy
    tokens equal the same weights decoded eagerly (one graph per step). Against the float model, along the float
    model's greedy sequences: logits within 5% of their spread (measured: 1.7-3.1%), and the same argmax wherever the
    float model's choice is clear of that error; the causal LM's greedy tokens are the float model's."""
    model = trained({}) if kind == "causal" else trained_seq2seq({"is_causal": False}, {})
    model.save_pretrained(tmp_path)
    fast = load_for_inference(tmp_path, quantize="q8")
    linears = [m for m in fast.modules() if isinstance(m, (nn.Linear, Int8StreamingLinear))]
    assert linears and all(type(m) is Int8StreamingLinear for m in linears)
    assert type(fast.get_output_embeddings()) is Int8StreamingLinear
    ids, mask = left_padded_prompts()
    expected = model.generate(ids, attention_mask=mask, **OPTIONS)
    compiled = compiled_generate(fast, ids, attention_mask=mask, **OPTIONS)
    assert torch.equal(compiled, eager_generate(fast, ids, attention_mask=mask, **OPTIONS))
    if kind == "causal":
        assert torch.equal(compiled, expected)
        inputs = {"input_ids": expected, "attention_mask": torch.cat([mask, torch.ones(len(mask), NEW_TOKENS)], 1)}
    else:
        inputs = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": expected}
    with torch.no_grad():
        reference, quantized = model(**inputs).logits, fast(**inputs).logits
    error = (quantized - reference).abs().max()
    assert error <= 0.05 * reference.std()
    # where the float model's top two logits are more than twice the error apart, no error can swap them
    top2 = reference.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 2 * error
    assert clear.float().mean() >= 0.5  # most positions (so the check below is not vacuous)
    assert torch.equal(quantized.argmax(-1)[clear], reference.argmax(-1)[clear])


# Widths the native kernel takes (groups of 64 inputs); grouped-query attention, so q and k/v widths differ
FUSABLE = {"hidden_size": 128, "intermediate_size": 256, "num_key_value_heads": 2}


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "formula"])
@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("causal", {"qk_norm": True, "attention_bias": True, "mlp_bias": True}),
        ("causal", {"qk_norm": True, "qk_norm_scope": "projection", "ffn_type": "mlp"}),
        ("seq2seq", {}),
    ],
    ids=["glu-head-norm-bias", "mlp-projection-norm", "seq2seq"],
)
def test_fused_projections_compute_the_separate_layers(kind, overrides, native, monkeypatch):
    """q8 / q4 give each self-attention one `qkv_proj` and each gated feed-forward one `gate_up_proj`: the logits of a
    prompt and of a cached step are the separate layers' (to the bit on the kernel, which computes each output row
    alone); a plain MLP and the decoder's cross-attention (two sources) keep their layers."""
    if native and not native_kernels_available():
        pytest.skip("needs hf_tfm's native kernel")
    if not native:
        monkeypatch.setattr("hf_tfm.inference.kernels.native_kernels_available", lambda: False)
    if kind == "causal":
        model = build(TfmForCausalLM, tiny_config(**FUSABLE, **overrides))
    else:
        model = build(TfmForConditionalGeneration, tiny_seq2seq_config(FUSABLE, FUSABLE))
    for quantize in (quantize_q8, quantize_q4):
        with monkeypatch.context() as m:
            m.setattr("hf_tfm.inference.layers.fuse_projections", lambda model: model)
            separate = quantize(copy.deepcopy(model))
        fused = quantize(copy.deepcopy(model))
        attention = [m for m in fused.modules() if hasattr(m, "qkv_proj")]
        assert all((m.qkv_proj is None) == m.is_cross_attention for m in attention) and len(attention) >= 2
        assert all(not hasattr(m, "q_proj") for m in attention if not m.is_cross_attention)
        mlps = [m for m in fused.modules() if hasattr(m, "gate_up_proj")]
        assert mlps and all((m.gate_up_proj is not None) == m.is_glu for m in mlps)
        assert all(getattr(m.qkv_proj, "native", native) == native for m in attention)
        ids = torch.tensor([[1, 5, 12, 19, 26, 33, 40]])
        inputs = (
            {"input_ids": ids[:, :-1]} if kind == "causal" else {"input_ids": ids, "decoder_input_ids": ids[:, :-1]}
        )
        step = {"input_ids": ids[:, -1:]} if kind == "causal" else {"decoder_input_ids": ids[:, -1:]}
        with torch.no_grad():
            logits = []
            for each in (separate, fused):
                prompt = each(**inputs, use_cache=True)
                extra = {"encoder_outputs": (prompt.encoder_last_hidden_state,)} if kind == "seq2seq" else {}
                cache = {CACHE_NAME: getattr(prompt, CACHE_NAME)}
                logits.append(torch.cat([prompt.logits, each(**step, **extra, **cache).logits], dim=1))
        tolerance = {"atol": 0, "rtol": 0} if native else {}
        torch.testing.assert_close(logits[1], logits[0], **tolerance, msg=quantize.__name__)


def test_q8_quantizes_a_tied_head_apart_from_the_input_embedding(tmp_path):
    """A tied `lm_head` gets int8 rows of its own; the input embedding stays float, and re-tying (which transformers
    does after loading) cannot put the float table back under the int8 scales."""
    model = trained({"tie_word_embeddings": True})
    model.save_pretrained(tmp_path)
    fast = load_for_inference(tmp_path, quantize="q8", compile=False)
    embedding = fast.get_input_embeddings().weight
    assert embedding.dtype == torch.float32 and torch.equal(embedding, model.get_input_embeddings().weight)
    fast.tie_weights()
    assert fast.lm_head.weight.dtype == torch.int8
    ids, mask = left_padded_prompts()
    assert torch.equal(
        fast.generate(ids, attention_mask=mask, **OPTIONS), model.generate(ids, attention_mask=mask, **OPTIONS)
    )


def test_q8_refuses_to_save_and_warns_when_eager_without_the_kernel(tmp_path, caplog, monkeypatch):
    """The int8 rows are a decoding format: saving one says how to get it back instead of writing weights that would
    load as something else; loading it for eager decoding warns that it is slow there when hf_tfm's native kernel
    (fast eagerly too) is missing."""
    trained({}).save_pretrained(tmp_path / "float")
    with caplog.at_level(logging.WARNING, logger="hf_tfm.inference"):
        load_for_inference(tmp_path / "float", quantize="q8", compile=False)
    assert ("made for the compiled step" in caplog.text) is not native_kernels_available()
    caplog.clear()
    monkeypatch.setattr("hf_tfm.inference.kernels.native_kernels_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="hf_tfm.inference"):
        fast = load_for_inference(tmp_path / "float", quantize="q8", compile=False)
    assert "made for the compiled step" in caplog.text
    with pytest.raises(NotImplementedError, match=r"load_for_inference\(folder, quantize='q8'\)"):
        fast.save_pretrained(tmp_path / "q8")
    with pytest.raises(NotImplementedError, match="cannot be saved"):
        torch.save(fast.state_dict(), tmp_path / "q8.pt")


def test_quantize_q8_leaves_a_quantizer_s_layers_alone():
    """Only plain float `nn.Linear` layers take the int8 rows or the streaming class: a layer whose weight is a tensor
    subclass (a quantizer's) or another class keeps its own kernel."""

    class Subclass(torch.Tensor):
        pass

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Conv1d(4, 4, 1))
    model[1].weight = nn.Parameter(model[1].weight.detach().as_subclass(Subclass))
    model.config = type("Config", (), {"tie_word_embeddings": True})()
    quantize_q8(model)
    assert type(model[0]) is Int8StreamingLinear and type(model[1]) is nn.Linear and type(model[2]) is nn.Conv1d
    assert model.config.tie_word_embeddings is False


def test_unknown_setting_names_every_setting(tmp_path):
    trained({}).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"unknown quantization setting 'int3': choose one of q8, q4, int8, int4, nf4"
    ):
        load_for_inference(tmp_path, quantize="int3")


def test_cli_generate_q8(tmp_path, capsys, monkeypatch):
    """`hf-tfm generate --quantize q8` decodes compiled (the setting's own step) and prints the prompt's
    continuation."""
    from export_models import saved, train_tokenizer

    from hf_tfm.cli import main

    folder = saved({}, tmp_path / "lm", train_tokenizer())
    argv = ["generate", str(folder), "--prompt", "def ", "--max-new-tokens", "4", "--greedy", "--no-stream"]
    steps = []
    call = CompiledDecodeStep.__call__
    monkeypatch.setattr(CompiledDecodeStep, "__call__", lambda self, **kw: steps.append(1) or call(self, **kw))
    assert main([*argv, "--quantize", "q8"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert steps  # the compiled decode step
