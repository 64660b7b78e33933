"""Calibrated 4-bit weights (hf_tfm.calibration): GPTQ and AWQ through llm-compressor, compressed-tensors checkpoints.

llm-compressor pins transformers <= 5.17, so it runs in an environment of its own (`make llmcompressor-env` makes
.venv-llmcompressor); the tests that calibrate (`-m llmcompressor`) skip without it, and load what it writes in this
environment, on whichever transformers release runs the suite. AWQ's mappings and the refusals need no llm-compressor.

The oracles: the weights of every quantized layer lie on its int4 grid (integers in [-8, 7] times the group's scale),
round-to-nearest's are the fp32 weights rounded on that grid, GPTQ's first layer reproduces its calibration inputs'
products better than round-to-nearest's, GPTQ and AWQ lose less on the calibration text than round-to-nearest, and
AWQ's mappings leave a model's function unchanged when their scales are folded in without rounding.
"""

import json

import pytest
import torch
from conftest import ROOT, tiny_config, tiny_seq2seq_config
from transformers import AutoModelForCausalLM

from hf_tfm import TfmForCausalLM, TfmForConditionalGeneration, TfmForSequenceClassification, load_for_inference
from hf_tfm.calibration import METHODS, awq_mappings, calibrate
from hf_tfm.data import stdlib_files
from hf_tfm.inference import Int8StreamingLinear, StreamingLinear
from hf_tfm.tokenization import train_bpe_tokenizer
from hf_tfm.training import pack_texts

PYTHON = ROOT / ".venv-llmcompressor" / "bin" / "python"
needs_llmcompressor = pytest.mark.skipif(
    not PYTHON.exists(), reason="needs llm-compressor's environment: make llmcompressor-env"
)
SEQ_LEN = 64


# ---------------------------------------------------------------------------------------------------------------------
# AWQ's mappings: folding a scale into each pair leaves the model's function unchanged


def fold(model: TfmForCausalLM, smooth: str, balance: list[str], scale: torch.Tensor) -> None:
    """What AWQ does before rounding: the smoothed module's output channels divided by `scale`, the balanced layers'
    input columns multiplied by it."""
    module = model.get_submodule(smooth)
    if isinstance(module, torch.nn.Linear):  # a linear layer's output channels are its weight's rows
        module.weight.div_(scale[:, None])
    else:  # a norm's output channels are its weight's entries
        module.weight.div_(scale)
    if getattr(module, "bias", None) is not None:
        module.bias.div_(scale)
    for name in balance:
        model.get_submodule(name).weight.mul_(scale)


BLOCKS = {
    "pre-norm, SwiGLU": {},
    "grouped-query": {"num_key_value_heads": 2},
    "post-norm, GELU MLP, LayerNorm": {"norm_position": "post", "ffn_type": "mlp", "norm_type": "layernorm"},
    "parallel, no first attention norm": {"parallel_residual": True, "first_layer_attn_norm": False},
    "mixture of experts with a shared expert": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 32,
    },
    "LayerNorm with biases": {"norm_type": "layernorm", "attention_bias": True, "mlp_bias": True},
}


@pytest.mark.parametrize("overrides", list(BLOCKS.values()), ids=list(BLOCKS))
def test_awq_mappings_fold_exactly(overrides):
    torch.manual_seed(0)
    model = TfmForCausalLM(tiny_config(**overrides)).eval()
    pairs = awq_mappings(model)
    assert pairs, "every block has a pair (v_proj -> o_proj at least)"
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
        for smooth, balance in pairs:
            fold(model, smooth, balance, torch.rand(model.get_submodule(balance[0]).in_features) * 3 + 0.25)
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_awq_mappings_name_what_feeds_what():
    names = lambda **overrides: awq_mappings(TfmForCausalLM(tiny_config(num_hidden_layers=1, **overrides)))  # noqa: E731
    attn = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    assert names() == [
        ("model.layers.0.attn_norm", attn),
        ("model.layers.0.self_attn.v_proj", ["model.layers.0.self_attn.o_proj"]),
        ("model.layers.0.mlp_norm", ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]),
        ("model.layers.0.mlp.up_proj", ["model.layers.0.mlp.down_proj"]),
    ]
    # Post-norm: a norm also feeds the residual stream; a plain MLP's activation is not linear in up_proj.
    assert names(norm_position="post", ffn_type="mlp") == [
        ("model.layers.0.self_attn.v_proj", ["model.layers.0.self_attn.o_proj"])
    ]
    # Grouped-query attention: a value head serves several query heads, so v_proj and o_proj widths differ.
    assert all("v_proj" not in smooth for smooth, _ in names(num_key_value_heads=2))
    # Experts: the feed-forward norm also feeds the router and the float experts; the shared expert's gate is linear.
    moe = names(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32)
    assert ("model.layers.0.mlp.shared_expert.up_proj", ["model.layers.0.mlp.shared_expert.down_proj"]) in moe
    assert all(smooth != "model.layers.0.mlp_norm" for smooth, _ in moe)


# ---------------------------------------------------------------------------------------------------------------------
# Refusals (no llm-compressor needed)


def test_calibrate_refuses_what_it_cannot_quantize(tmp_path, monkeypatch):
    causal = tmp_path / "causal"
    TfmForCausalLM(tiny_config(intermediate_size=64)).save_pretrained(causal)
    with pytest.raises(ValueError, match="unknown calibration method 'int3': choose one of gptq, awq, rtn"):
        calibrate(causal, tmp_path / "out", method="int3")
    with pytest.raises(ValueError, match="samples >= 1"):
        calibrate(causal, tmp_path / "out", samples=0)
    with pytest.raises(ValueError, match="has no tokenizer"):
        calibrate(causal, tmp_path / "out")
    train_bpe_tokenizer(["def f(x):\n    return x\n"] * 20, vocab_size=280).save_pretrained(causal)
    seq2seq = tmp_path / "seq2seq"
    TfmForConditionalGeneration(tiny_seq2seq_config()).save_pretrained(seq2seq)
    with pytest.raises(ValueError, match=r"hf_tfm causal LM .* not a 'hf_tfm_seq2seq' model"):
        calibrate(seq2seq, tmp_path / "out")
    classifier = tmp_path / "classifier"
    TfmForSequenceClassification(tiny_config(num_labels=2)).save_pretrained(classifier)
    with pytest.raises(ValueError, match="causal LM folder; this one holds \\['TfmForSequenceClassification'\\]"):
        calibrate(classifier, tmp_path / "out")
    odd = tmp_path / "odd"
    TfmForCausalLM(tiny_config()).save_pretrained(odd)  # an intermediate size of 48
    with pytest.raises(ValueError, match=r"calibrate groups input features by 32, 64 or 128, .* \[32, 48\]"):
        calibrate(odd, tmp_path / "out")
    # No llm-compressor here and none named: the error says how to get it.
    monkeypatch.delenv("HF_TFM_LLMCOMPRESSOR_PYTHON", raising=False)
    monkeypatch.setattr("hf_tfm.calibration.importlib.util.find_spec", lambda name: None)
    with pytest.raises(ImportError, match="make llmcompressor-env"):
        calibrate(causal, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Calibrated checkpoints, written in llm-compressor's environment and loaded in this one


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny causal LM trained briefly on standard-library source, and its gptq / awq / rtn checkpoints."""
    root = tmp_path_factory.mktemp("calibration")
    texts = [f.text for f in stdlib_files(400_000, max_file_chars=20_000)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=384)
    blocks = torch.tensor(pack_texts(tokenizer, texts, SEQ_LEN))
    torch.manual_seed(0)
    config = tiny_config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        max_position_embeddings=SEQ_LEN,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = TfmForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        batch = blocks[torch.randint(0, len(blocks) - 16, (16,))]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().save_pretrained(root / "fp32")
    tokenizer.save_pretrained(root / "fp32")
    calibration = texts[:40]
    for method in METHODS:
        calibrate(
            root / "fp32", root / method, method, texts=calibration, samples=16, max_length=SEQ_LEN, python=str(PYTHON)
        )
    return {"root": root, "model": model, "blocks": torch.tensor(pack_texts(tokenizer, calibration, SEQ_LEN)[:16])}


def load(folder) -> TfmForCausalLM:
    """A calibrated checkpoint through transformers' compressed-tensors quantizer, with its weights decompressed (the
    layers hold packed int4 until the first forward)."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    return model


def quantized_linears(model) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}


def grid(linear: torch.nn.Linear) -> torch.Tensor:
    """The layer's weights in units of its group's scale (int4 values when it is quantized)."""
    scale = linear.weight_scale  # (out, groups)
    return linear.weight / scale.repeat_interleave(linear.in_features // scale.shape[1], dim=1)


@needs_llmcompressor
@pytest.mark.slow
@pytest.mark.llmcompressor
def test_calibrated_weights_lie_on_the_int4_grid(calibrated):
    fp32 = calibrated["model"]
    for method in METHODS:
        model = load(calibrated["root"] / method)
        saved = json.loads((calibrated["root"] / method / "config.json").read_text())["quantization_config"]
        weights = saved["config_groups"]["group_0"]["weights"]
        assert (saved["format"], weights["num_bits"], weights["symmetric"], weights["group_size"]) == (
            "pack-quantized",
            4,
            True,
            64,  # the largest group that divides the hidden size, 64
        )
        linears = quantized_linears(model)
        assert len(linears) == 2 * 7
        for name, linear in linears.items():
            q = grid(linear)
            torch.testing.assert_close(q, q.round(), atol=1e-4, rtol=0, msg=f"{method} {name}")
            assert q.round().min() >= -8 and q.round().max() <= 7, (method, name)
            if method == "rtn":  # round-to-nearest: the fp32 weights rounded on the checkpoint's own grid
                units = linear.weight_scale.repeat_interleave(linear.in_features // linear.weight_scale.shape[1], 1)
                rounded = (fp32.get_submodule(name).weight / units).round().clamp(-8, 7)
                torch.testing.assert_close(q.round(), rounded, atol=0, rtol=0, msg=name)
        # What is not quantized is fp32's: the output embedding and the norms (but AWQ's, which fold its scales).
        torch.testing.assert_close(model.lm_head.weight, fp32.lm_head.weight)
        if method != "awq":
            torch.testing.assert_close(model.model.norm.weight, fp32.model.norm.weight)
            torch.testing.assert_close(model.model.layers[1].mlp_norm.weight, fp32.model.layers[1].mlp_norm.weight)


@needs_llmcompressor
@pytest.mark.slow
@pytest.mark.llmcompressor
def test_gptq_and_awq_beat_round_to_nearest(calibrated):
    fp32, blocks = calibrated["model"], calibrated["blocks"]
    models = {m: load(calibrated["root"] / m) for m in METHODS}
    with torch.no_grad():
        # GPTQ's objective, on a layer whose inputs are the same in every model: the first q_proj's products.
        inputs = fp32.model.layers[0].attn_norm(fp32.model.embed_tokens(blocks))
        exact = fp32.model.layers[0].self_attn.q_proj(inputs)
        error = {
            m: (models[m].model.layers[0].self_attn.q_proj(inputs) - exact).norm().item() for m in ("gptq", "rtn")
        }
        assert error["gptq"] < 0.9 * error["rtn"], error
        loss = {m: model(input_ids=blocks, labels=blocks).loss.item() for m, model in models.items()}
        base = fp32(input_ids=blocks, labels=blocks).loss.item()
    assert loss["gptq"] - base < loss["rtn"] - base, (base, loss)
    assert loss["awq"] - base < loss["rtn"] - base, (base, loss)


@needs_llmcompressor
@pytest.mark.slow
@pytest.mark.llmcompressor
def test_calibrated_checkpoints_generate(calibrated, run_without_hf_tfm):
    prompt = calibrated["blocks"][:1, :12]
    for method in ("gptq", "awq"):
        folder = calibrated["root"] / method
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        # Cached decoding picks what a full forward over the same tokens picks at every new position.
        with torch.no_grad():
            full = model(out).logits[0, prompt.shape[1] - 1 : -1].argmax(-1)
        assert out[0, prompt.shape[1] :].tolist() == full.tolist(), method
        # The compiled step streams the int4 values one to a byte, and decodes the same tokens.
        compiled = load_for_inference(folder, compile=True)
        layers = [m for m in compiled.modules() if isinstance(m, Int8StreamingLinear)]
        # q/k/v and gate/up fused (fuse_projections): 4 layers a block
        assert len(layers) == 2 * 4 and all(m.weight_scale.shape[1] == m.in_features // 64 for m in layers)
        assert isinstance(compiled.lm_head, StreamingLinear)  # float, as the checkpoint keeps it
        fast = compiled.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert fast.tolist() == out.tolist(), method
    # Remote code: the checkpoint loads and decodes the same where hf_tfm is not installed.
    code = f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        prompt = torch.tensor({prompt.tolist()})
        print(model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12).tolist())
    """
    assert run_without_hf_tfm(code).strip().splitlines()[-1] == str(out.tolist())


@needs_llmcompressor
@pytest.mark.slow
@pytest.mark.llmcompressor
def test_cli_calibrate(calibrated, tmp_path, monkeypatch, capsys):
    """`hf-tfm calibrate` from this environment hands the job to llm-compressor's, named by the environment."""
    from hf_tfm.cli import main

    monkeypatch.setenv("HF_TFM_LLMCOMPRESSOR_PYTHON", str(PYTHON))
    assert main(["calibrate", str(calibrated["root"] / "fp32"), str(tmp_path / "out"), "--method", "rtn"]) == 0
    assert "(rtn, int4 weights, compressed-tensors)" in capsys.readouterr().out
    rtn = AutoModelForCausalLM.from_pretrained(calibrated["root"] / "rtn")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(again.state_dict(), rtn.state_dict(), atol=0, rtol=0)
    assert main(["calibrate", str(calibrated["root"] / "fp32"), str(tmp_path / "out"), "--method", "rtn"]) == 1
    assert "already holds another model" in capsys.readouterr().err
