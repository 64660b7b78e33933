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
    assert any("is_causal=False" in b for b in executorch_blockers(encoder))
    with pytest.raises(ValueError, match="is_causal=False"):
        export_executorch(build(hf_tfm.TfmModel, encoder), tmp_path / "et")
    # A causal config under another head: the control for the head check.
    with pytest.raises(ValueError, match="TfmForSequenceClassification"):
        export_executorch(build(hf_tfm.TfmForSequenceClassification, tiny_config(num_labels=2)), tmp_path / "et")
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
    assert not ok and "TfmForConditionalGeneration" in why
