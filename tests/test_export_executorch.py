"""ExecuTorch export (hf_tfm.exporters.executorch): one XNNPACK program traced from hf_tfm's own code, run in
executorch's runtime.

The oracle is the model itself: executorch's runtime, in a process that cannot import transformers or hf_tfm, decodes
each prompt (prefill, then one token per call through the program's static KV cache) and must give the greedy tokens
of `generate()`, with logits (every decoding step's and the prefill of the greedy sequences) within 1e-4 (measured:
2e-6 to 6e-6, summation order). The causal LMs are tests/export_models.py's, trained on a token cycle so each greedy
step has a clear winner.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build, tiny_config, tiny_seq2seq_config
from export_models import NEW_TOKENS, POST_NORM_LEARNED, PROMPTS, config_of, saved, train_tokenizer, trained

import hf_tfm

pytest.importorskip("executorch")

from hf_tfm.exporters import executorch as et_export
from hf_tfm.exporters.executorch import executorch_blockers, export_executorch, verify_executorch

F32_ATOL = 1e-4
GQA = {"num_key_value_heads": 2}
DECODERS = {
    "llama-gqa": GQA,
    "alibi": {"position_embedding_type": "alibi"},
    "gpt2-post-norm": POST_NORM_LEARNED,
    # Sliding layers here too (one export less): the prompts and their 32 new tokens run far past the window of 8.
    "sinusoidal-parallel-qk-norm-sliding": {
        "position_embedding_type": "sinusoidal",
        "parallel_residual": True,
        "qk_norm": True,
        "embedding_norm": True,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "moe": {"num_experts": 4, "num_experts_per_tok": 2},
}


@pytest.fixture(scope="module")
def gqa_folder(tmp_path_factory):
    """The llama-gqa model saved with a tokenizer, and its export from that folder (exporting takes ~12 s)."""
    root = tmp_path_factory.mktemp("gqa")
    folder = saved(GQA, root / "lm", train_tokenizer())
    return folder, export_executorch(folder, root / "et")


@pytest.mark.parametrize("case", list(DECODERS))
def test_export_generates_as_generate(case, tmp_path, gqa_folder):
    model = trained(DECODERS[case])
    path = gqa_folder[1] if case == "llama-gqa" else export_executorch(model, tmp_path / "et")
    report = verify_executorch(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS)
    print(f"{case}: {report}")
    assert report["tokens_equal"] and report["agreement"] == 1.0, report
    assert report["max_logit_diff"] < F32_ATOL
    assert report["weights"] == "float32" and report["prompts"] == 2 and report["max_new_tokens"] == NEW_TOKENS


def test_folder_export_carries_config_tokenizer_and_runs_without_transformers(tmp_path, gqa_folder):
    folder, path = gqa_folder
    assert sorted(p.name for p in path.glob("*.pte")) == [et_export.PROGRAM]
    for name in ("config.json", "tokenizer.json", et_export.MANIFEST, et_export.RUNNER):
        assert (path / name).is_file(), name
    manifest = json.loads((path / et_export.MANIFEST).read_text())
    assert manifest["architecture"] == "TfmForCausalLM" and manifest["weights"] == "float32"
    assert manifest["max_cache_len"] == 128 == et_export.max_cache_length(config_of())  # max_position_embeddings
    assert et_export.max_cache_length(config_of(max_position_embeddings=4096)) == et_export.MAX_CACHE_LEN
    # Text prompts, the folder's tokenizer; and in-process (no fresh interpreter) gives the same answer.
    report = verify_executorch(path, folder, prompts=["def f3(x):\n", "def f12(x):\n    return x"], max_new_tokens=16)
    assert report["tokens_equal"] and report["prompts"] == 2
    one = verify_executorch(path, folder, prompts=[PROMPTS[1]], max_new_tokens=8, fresh_process=False)
    assert one["tokens_equal"] and one["max_logit_diff"] < F32_ATOL
    # The folder's own runner, as a deployment uses it: executorch, torch and the folder, no transformers or hf_tfm.
    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['hf_tfm'] = None\n"
        f"sys.path.insert(0, {str(path)!r})\n"
        f"from et_generate import ExecutorchGenerator\n"
        f"g = ExecutorchGenerator({str(path)!r})\n"
        f"print([g.generate(p, 8, suppress=[2]) for p in {PROMPTS!r}])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    expected = [
        trained(GQA).generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p) :]
        for p in PROMPTS
    ]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [e.tolist() for e in expected]


def test_prompt_past_the_cache_is_refused(gqa_folder):
    folder, path = gqa_folder
    with pytest.raises(ValueError, match="max_cache_len=128"):
        verify_executorch(path, folder, prompts=[[1] * 100], max_new_tokens=29)


def test_refusals_name_the_reason_with_controls(tmp_path):
    assert not executorch_blockers(config_of())  # the control: a causal decoder
    seq2seq = tiny_seq2seq_config()
    assert any("encoder-decoder" in b for b in executorch_blockers(seq2seq))
    with pytest.raises(ValueError, match="encoder-decoder"):
        export_executorch(build(hf_tfm.TfmForConditionalGeneration, seq2seq), tmp_path / "et")
    encoder = tiny_config(is_causal=False)
    assert not executorch_blockers(encoder)  # an encoder exports as its one forward (test_encoder_* below)
    with pytest.raises(ValueError, match=r"TfmForCausalLM with `is_causal=False` generates nothing"):
        export_executorch(build(hf_tfm.TfmForCausalLM, encoder), tmp_path / "et")
    with pytest.raises(ValueError, match="not TfmForConditionalGeneration"):  # the class check, config aside
        et_export._check_class("TfmForConditionalGeneration", encoder)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert any("'dynamic'" in b for b in executorch_blockers(config_of(rope_parameters=dynamic)))
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert not executorch_blockers(config_of(rope_parameters=linear))  # the control: a length-independent scaling
    with pytest.raises(ValueError, match="quantize='q4_0'"):
        export_executorch(trained({}), tmp_path / "et", quantize="q4_0")
    assert not (tmp_path / "et").exists() and not list(tmp_path.iterdir())


def test_failed_export_leaves_nothing_and_keeps_the_old_folder(tmp_path, monkeypatch, gqa_folder):
    import shutil

    out = Path(shutil.copytree(gqa_folder[1], tmp_path / "et"))
    before = sorted(p.name for p in out.iterdir())

    class Broken:
        def write_to_file(self, file):
            file.write(b"half a program")
            raise OSError("disk full")

    monkeypatch.setattr(et_export, "_lower", lambda model, max_cache_len: Broken())
    with pytest.raises(OSError, match="disk full"):
        export_executorch(trained({}), out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["et"]  # no temporary folder left behind


def test_missing_executorch_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "executorch.exir", None)
    with pytest.raises(ImportError) as err:
        export_executorch(trained({}), tmp_path / "et")
    assert str(err.value) == et_export.INSTALL_HINT and "pip install" in str(err.value)
    assert not (tmp_path / "et").exists()


def test_cli_export_executorch_verify_and_info(tmp_path, gqa_folder, capsys):
    from hf_tfm.cli import main
    from hf_tfm.exporters import format_of
    from hf_tfm.info import describe

    folder, exported = gqa_folder
    assert format_of(exported) == "executorch"
    ok, why = describe(str(folder))["integrations"]["export to runtimes"]["ExecuTorch (XNNPACK)"]
    assert ok and "static cache of 128 positions" in why
    dst = tmp_path / "et"
    argv = ["export", str(folder), str(dst), "--format", "executorch", "--verify", "--max-new-tokens", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ExecuTorch" in out and "greedy tokens equal: yes" in out
    assert main(argv) == 1 and "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--quantize", "int8", "--overwrite"]) == 1 and "int8" in capsys.readouterr().err
    tiny_seq2seq_config().save_pretrained(tmp_path / "s2s")
    ok, why = describe(str(tmp_path / "s2s"))["integrations"]["export to runtimes"]["ExecuTorch (XNNPACK)"]
    assert not ok and "encoder-decoder (TfmSeq2SeqConfig)" in why
    tiny_config(is_causal=False).save_pretrained(tmp_path / "enc")  # an encoder config: TfmModel
    ok, why = describe(str(tmp_path / "enc"))["integrations"]["export to runtimes"]["ExecuTorch (XNNPACK)"]
    assert ok and "padded batch" in why


# ---------------------------------------------------------------------------------------------------------------------
# Encoders: one forward of a padded batch, batch and length dynamic

BERT = {**POST_NORM_LEARNED, "is_causal": False, "embedding_norm": True, "type_vocab_size": 2}
ENCODERS = {
    "bert-features-pooler": (hf_tfm.TfmModel, {**BERT, "add_pooling_layer": True}),
    "rope-gqa-sequence-classification": (
        hf_tfm.TfmForSequenceClassification,
        {"is_causal": False, "num_key_value_heads": 2, "num_labels": 3},
    ),
    "alibi-token-classification": (
        hf_tfm.TfmForTokenClassification,
        {"is_causal": False, "position_embedding_type": "alibi", "num_labels": 5},
    ),
    "sinusoidal-question-answering": (
        hf_tfm.TfmForQuestionAnswering,
        {"is_causal": False, "position_embedding_type": "sinusoidal", "qk_norm": True},
    ),
    "masked-lm-experts": (hf_tfm.TfmForMaskedLM, {"is_causal": False, "num_experts": 4, "num_experts_per_tok": 2}),
}


def encoder(cls, overrides: dict):
    torch.manual_seed(0)
    model = cls(config_of(**overrides)).eval()
    with torch.no_grad():  # weights of a trained model's scale, not initializer_range's (whose outputs are ~0)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return model


@pytest.mark.parametrize("case", list(ENCODERS))
def test_encoder_export_matches_on_a_padded_batch(case, tmp_path):
    """Each encoder class's outputs in executorch's runtime (a process without transformers or hf_tfm), the prompts
    as one right-padded batch, against the model on each prompt alone."""
    cls, overrides = ENCODERS[case]
    model = encoder(cls, overrides)
    path = export_executorch(model, tmp_path / "et")
    manifest = json.loads((path / et_export.MANIFEST).read_text())
    report = verify_executorch(path, model, prompts=PROMPTS)
    print(f"{case}: {report}")
    expected = {
        hf_tfm.TfmModel: ["last_hidden_state", "pooler_output"],
        hf_tfm.TfmForQuestionAnswering: ["end_logits", "start_logits"],
    }.get(cls, ["logits"])
    assert report["outputs"] == expected and report["prompts"] == len(PROMPTS)
    assert report["max_diff"] < F32_ATOL
    assert manifest["inputs"][:2] == ["input_ids", "attention_mask"]
    assert ("token_type_ids" in manifest["inputs"]) == bool(model.config.type_vocab_size)
    assert (path / et_export.ENCODER_RUNNER).is_file() and not (path / et_export.RUNNER).exists()


def test_encoder_runner_takes_token_types(tmp_path):
    """The folder's own encoder runner, as a deployment uses it (executorch and torch only): segment ids change the
    features as they do in hf_tfm, and batch sizes other than the capture's run."""
    model = encoder(hf_tfm.TfmModel, BERT)
    path = export_executorch(model, tmp_path / "et")
    ids, types = [[1, 7, 9, 11, 2], [1, 8, 8, 2, 0]], [[0, 0, 1, 1, 1], [0, 1, 1, 1, 0]]
    mask = [[1] * 5, [1, 1, 1, 1, 0]]
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(path)!r})\n"
        "from et_encode import ExecutorchEncoder\n"
        f"out = ExecutorchEncoder({str(path)!r})({ids!r}, {mask!r}, {types!r})\n"
        "print(json.dumps(out['last_hidden_state'].tolist()))\n"
    )
    blocked = "import sys; sys.modules['transformers'] = None; sys.modules['hf_tfm'] = None\n"
    done = subprocess.run([sys.executable, "-c", blocked + code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = torch.tensor(json.loads(done.stdout.strip().splitlines()[-1]))
    with torch.no_grad():
        ours = model(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types)
        ).last_hidden_state
    torch.testing.assert_close(theirs[0], ours[0], atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(theirs[1, :4], ours[1, :4], atol=F32_ATOL, rtol=0)
    with torch.no_grad():
        untyped = model(input_ids=torch.tensor(ids[:1])).last_hidden_state
    assert (untyped[0] - ours[0]).abs().max() > 1e-3  # the types were used
