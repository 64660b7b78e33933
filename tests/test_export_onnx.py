"""ONNX export (hf_tfm.export(..., format="onnx")): graphs traced from hf_tfm's own code, run in ONNX Runtime.

The oracle is the model itself: ONNX Runtime decodes the prompts as one left-padded batch, in a process that cannot
import torch, and must give the greedy tokens `generate()` gives on each prompt alone, with logits within 1e-4
(measured: 3e-6 to 5e-6, summation order). The causal LMs are tests/export_models.py's, trained on a token cycle so
each greedy step has a clear winner.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build, tiny_config, tiny_seq2seq_config
from export_models import (
    NEW_TOKENS,
    POST_NORM_LEARNED,
    PROMPTS,
    config_of,
    saved,
    train_tokenizer,
    trained,
    trained_seq2seq,
)

import hf_tfm
from hf_tfm.cli import main
from hf_tfm.exporters import blockers, export, format_of, verify
from hf_tfm.exporters import onnx as onnx_export

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

F32_ATOL = 1e-4
SLIDING = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
DECODERS = {
    "llama-gqa": {"num_key_value_heads": 2},
    "untied-biases": {"tie_word_embeddings": False, "attention_bias": True, "lm_head_bias": True},
    "alibi": {"position_embedding_type": "alibi"},
    "gpt2-post-norm": POST_NORM_LEARNED,
    "sinusoidal-parallel-qk-norm": {
        "position_embedding_type": "sinusoidal",
        "parallel_residual": True,
        "qk_norm": True,
        "embedding_norm": True,
    },
    "moe": {"num_experts": 4, "num_experts_per_tok": 2},
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def gqa_export(tmp_path_factory):
    """The llama-gqa model's float32 export, shared by the tests that only read it (tracing takes ~8 s)."""
    return export(trained(DECODERS["llama-gqa"]), tmp_path_factory.mktemp("gqa") / "onnx", format="onnx")


@pytest.mark.parametrize("case", list(DECODERS))
def test_f32_export_decodes_a_padded_batch_as_generate(case, tmp_path, gqa_export):
    model = trained(DECODERS[case])
    path = gqa_export if case == "llama-gqa" else export(model, tmp_path / "onnx", format="onnx")
    assert format_of(path) == "onnx" and sorted(p.name for p in path.glob("*.onnx")) == ["decode.onnx", "prefill.onnx"]
    report = verify(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS)
    print(f"{case}: {report}")
    assert report["tokens_equal"], report
    assert report["max_logit_diff"] < F32_ATOL


def test_sliding_layers_decode_past_the_window_or_are_refused(tmp_path):
    """The prompts and their 32 new tokens run far past the window of 8. transformers' exporter traces sliding cache
    layers as full ones (the mask applies the window) from some release on; before, the export is refused."""
    model = trained(SLIDING)
    if not onnx_export._traces_sliding_layers():
        assert any("layer_types" in b for b in blockers(model.config, "onnx"))
        with pytest.raises(ValueError, match="layer_types"):
            export(model, tmp_path / "onnx", format="onnx")
        assert not blockers(config_of(), "onnx")  # the control: no sliding layers
        return
    report = verify(export(model, tmp_path / "onnx", format="onnx"), model, prompts=PROMPTS)
    assert report["tokens_equal"] and report["max_logit_diff"] < F32_ATOL, report


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_weights_keep_the_greedy_tokens(quantize, tmp_path, gqa_export):
    model, f32 = trained(DECODERS["llama-gqa"]), gqa_export
    path = export(model, tmp_path / quantize, format="onnx", quantize=quantize)
    report = verify(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS)
    print(f"{quantize}: {report}")
    assert report["weights"] == quantize
    assert report["forced_agreement"] >= 0.9  # measured: 1.0 for both (the cycle's winners are far ahead)
    assert report["max_logit_diff"] > 1e-3  # the weights really changed
    size = {p: sum(f.stat().st_size for f in p.iterdir()) for p in (f32, path)}
    assert size[path] < 0.7 * size[f32]


@pytest.mark.parametrize(
    ("head", "overrides"),
    [
        ("TfmModel", {}),
        ("TfmForSequenceClassification", {"num_labels": 3}),
        ("TfmForTokenClassification", {"type_vocab_size": 2}),
        ("TfmForMaskedLM", {"position_embedding_type": "learned", "norm_position": "post", "norm_type": "layernorm"}),
        ("TfmForQuestionAnswering", {"position_embedding_type": "alibi"}),
    ],
)
def test_encoder_heads_on_a_padded_batch(head, overrides, tmp_path):
    model = build(getattr(hf_tfm, head), tiny_config(is_causal=False, **overrides)).eval()
    path = export(model, tmp_path / "onnx", format="onnx")
    report = verify(path, model, prompts=[[1, 5, 6, 7, 2], [1, *range(9, 20), 2]])
    print(f"{head}: {report}")
    assert report["max_diff"] < F32_ATOL
    expected = {"TfmModel": ["last_hidden_state"], "TfmForQuestionAnswering": ["end_logits", "start_logits"]}
    assert report["outputs"] == expected.get(head, ["logits"])


SEQ2SEQ = {
    "paper-post-norm-sinusoidal": (
        {"position_embedding_type": "sinusoidal", "norm_position": "post", "norm_type": "layernorm"},
        {"position_embedding_type": "sinusoidal", "norm_position": "post", "norm_type": "layernorm"},
        {},
    ),
    "llama-gqa-untied-alibi-decoder": (
        {"num_key_value_heads": 2},
        {"num_key_value_heads": 2, "position_embedding_type": "alibi"},
        {"tie_word_embeddings": False},
    ),
}


@pytest.mark.parametrize("case", list(SEQ2SEQ))
def test_encoder_decoder_decodes_a_padded_batch_as_generate(case, tmp_path):
    """encoder.onnx once per batch, then the decoder's prefill and decode graphs over its states with both caches:
    measured 2.9e-6 to 7.6e-6 (paper, BART-like, Llama-like with GQA, ALiBi decoder) on 5.24 and 5.16.1."""
    model = trained_seq2seq(*SEQ2SEQ[case][:2], **SEQ2SEQ[case][2])
    path = export(model, tmp_path / "onnx", format="onnx")
    assert sorted(p.name for p in path.glob("*.onnx")) == ["decode.onnx", "encoder.onnx", "prefill.onnx"]
    report = verify(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS)
    print(f"{case}: {report}")
    assert report["tokens_equal"] and report["max_logit_diff"] < F32_ATOL, report


def test_folder_export_carries_config_tokenizer_and_runs_without_torch(tmp_path, tokenizer):
    folder = saved({"num_key_value_heads": 2}, tmp_path / "lm", tokenizer)
    path = export(folder, tmp_path / "onnx", format="onnx")
    for name in ("config.json", "tokenizer.json", onnx_export.MANIFEST, onnx_export.RUNNER):
        assert (path / name).is_file(), name
    manifest = json.loads((path / onnx_export.MANIFEST).read_text())
    assert manifest["architecture"] == "TfmForCausalLM" and manifest["weights"] == "float32"
    # The runner's process has torch blocked: ONNX Runtime and numpy alone decode the export.
    report = verify(path, folder, prompts=["def f3(x):\n", "def f12(x):\n    return x"], max_new_tokens=16)
    assert report["tokens_equal"] and report["prompts"] == 2
    one = verify(path, folder, prompts=[PROMPTS[1]], max_new_tokens=8)  # a batch of one: the batch axis is dynamic
    assert one["tokens_equal"]
    # The folder's own runner, as a deployment uses it: onnxruntime, numpy and the folder, nothing else.
    code = (
        f"import sys; sys.modules['torch'] = None; sys.path.insert(0, {str(path)!r})\n"
        f"from ort_generate import OnnxGenerator\n"
        f"steps = []\n"
        f"tokens = OnnxGenerator({str(path)!r}).generate({PROMPTS!r}, 8, suppress=[2], on_token=steps.append)\n"
        f"assert [list(t) for t in zip(*steps)] == tokens, (steps, tokens)  # streamed step by step, the same ids\n"
        f"print(tokens)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    expected = [
        trained(DECODERS["llama-gqa"])
        .generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p) :]
        .tolist()
        for p in PROMPTS
    ]
    assert json.loads(done.stdout) == expected


def test_refusals_name_the_reason_with_controls(tmp_path):
    assert not blockers(tiny_seq2seq_config(), "onnx") and not blockers(tiny_config(), "onnx")
    model = build(hf_tfm.TfmSeq2SeqModel, tiny_seq2seq_config())  # no head: nothing to decode, no outputs of a head
    with pytest.raises(ValueError, match="TfmSeq2SeqModel"):
        export(model, tmp_path / "onnx", format="onnx")
    with pytest.raises(ValueError, match="quantize='q4_0'"):
        export(trained({}), tmp_path / "onnx", format="onnx", quantize="q4_0")
    with pytest.raises(ValueError, match="format='tflite'"):
        export(trained({}), tmp_path / "x", format="tflite")
    assert not (tmp_path / "onnx").exists()


def test_failed_export_leaves_nothing_and_keeps_the_old_folder(tmp_path, monkeypatch, gqa_export):
    out = Path(shutil.copytree(gqa_export, tmp_path / "onnx"))
    before = sorted(p.name for p in out.iterdir())

    def broken(program, path):
        raise OSError("disk full")

    monkeypatch.setattr(onnx_export, "_save", broken)
    with pytest.raises(OSError, match="disk full"):
        export(trained({}), out, format="onnx", quantize="int8")
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["onnx"]  # no temporary folder left behind


def test_missing_onnxruntime_is_one_line(tmp_path, tokenizer, monkeypatch, capsys):
    folder = saved({}, tmp_path / "lm", tokenizer)
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert main(["export", str(folder), str(tmp_path / "onnx"), "--format", "onnx"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "hf-tfm[export]"' in err
    assert not (tmp_path / "onnx").exists()


def test_cli_export_onnx_verify(tmp_path, tokenizer, capsys):
    folder = saved({"num_key_value_heads": 2}, tmp_path / "lm", tokenizer)
    dst = tmp_path / "onnx"
    argv = ["export", str(folder), str(dst), "--format", "onnx", "--verify", "--max-new-tokens", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ONNX Runtime" in out and "greedy tokens equal: yes" in out
    assert main(argv) == 1 and "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--quantize", "int8", "--overwrite"]) == 0
    assert json.loads((dst / onnx_export.MANIFEST).read_text())["weights"] == "int8"
    assert main([*argv, "--quantize", "q8_0", "--overwrite"]) == 1  # a GGUF type
    assert "quantize='q8_0'" in capsys.readouterr().err


def test_info_reports_onnx(tmp_path):
    from hf_tfm.info import describe

    config_of(num_experts=4).save_pretrained(tmp_path)
    ok, why = describe(str(tmp_path))["integrations"]["export to runtimes"]["ONNX (ONNX Runtime)"]
    assert ok and "prefill + decode" in why
    tiny_seq2seq_config().save_pretrained(tmp_path)
    ok, why = describe(str(tmp_path))["integrations"]["export to runtimes"]["ONNX (ONNX Runtime)"]
    assert ok and "encoder" in why
    config_of(is_causal=False).save_pretrained(tmp_path)
    ok, why = describe(str(tmp_path))["integrations"]["export to runtimes"]["ONNX (ONNX Runtime)"]
    assert ok and "one graph" in why
