"""GGUF exports run in llama.cpp itself: logits and greedy tokens against hf_tfm's (opt-in, `-m llama_cpp`).

llama.cpp is llama-cpp-python in an environment of its own (`make llama-cpp-env` builds .venv-llama-cpp); without it
these tests skip. It runs in a process of its own through tests/llama_cpp_driver.py (loaded next to torch, llama.cpp
segfaulted on this kind of machine), with an f32 KV cache. The models are tests/export_models.py's: tiny, trained on a
token cycle, so greedy steps have clear winners.
"""

import json
import subprocess
import unicodedata
from pathlib import Path

import pytest
import tokenizer_shapes
import torch
from export_models import NEW_TOKENS, PROMPTS, config_of, train_tokenizer, trained
from test_export_gguf import (
    BLOOM,
    GPT2,
    GPTNEOX,
    GPTNEOX_SEQUENTIAL,
    LLAMA,
    LLAMA_GQA_UNTIED,
    MIXTRAL,
    MOE,
    MPT,
    MPT_LEARNED,
    MPT_SINUSOIDAL,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    REFACT,
    bert_encoder,
    export_with_tokenizer,
    gguf,
)

from hf_tfm import TfmForCausalLM
from hf_tfm.exporters import export
from hf_tfm.exporters import gguf as gguf_export
from hf_tfm.exporters.gguf import verify_gguf
from hf_tfm.exporters.gguf_vocab import TEXTS, tokenizer_agreement

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-llama-cpp" / "bin" / "python"
pytestmark = [
    pytest.mark.llama_cpp,
    pytest.mark.skipif(not PYTHON.is_file(), reason="llama.cpp's environment is missing: make llama-cpp-env"),
]

# Largest |logit difference| allowed for f32 files, logits up to ~14. SwiGLU architectures differ from PyTorch only
# in summation order (measured 2.9e-6 to 5.7e-6: qwen3's qk-norm, the experts and refact's ALiBi included); ggml's GELU
# rounds its input to fp16 and reads a table of the tanh form (measured 1.4e-4 to 3.1e-3 on the LayerNorm + GELU
# blocks: gpt2, bloom, gptneox, mpt). llama-cpp-python 0.3.36, transformers 5.25 and 5.16.1.
GELU_BLOCKS = ("gpt2", "bloom", "gptneox", "gptneox-sequential", "mpt", "mpt-learned", "mpt-sinusoidal")
CASES = {
    "llama": LLAMA,
    "llama-gqa-untied": LLAMA_GQA_UNTIED,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "gpt2": GPT2,
    "bloom": BLOOM,  # ALiBi: llama.cpp adds slope * j, hf_tfm -slope * |i - j| (equal after the causal softmax)
    "mixtral": MIXTRAL,  # experts: llama.cpp's own routing (softmax, top-k, renormalised; qwen2moe not renormalised)
    "mixtral-tied": MOE,
    "qwen2moe": QWEN2_MOE,
    "qwen3moe": QWEN3_MOE,
    # transformers' GGUF loader reads none of these: llama.cpp is their only check
    "refact": REFACT,  # the default block with ALiBi
    "gptneox": GPTNEOX,  # parallel residual
    "gptneox-sequential": GPTNEOX_SEQUENTIAL,
    "mpt": MPT,  # ALiBi, no biases, GQA
    "mpt-learned": MPT_LEARNED,  # a learned position table, LayerNorm without biases
    "mpt-sinusoidal": MPT_SINUSOIDAL,  # hf_tfm's sinusoidal table written out; the paper's embedding scale folded in
}


@pytest.fixture
def llama_cpp(monkeypatch):
    """hf_tfm's llama.cpp calls (verification, K-quants) run in .venv-llama-cpp's Python."""
    monkeypatch.setenv("HF_TFM_LLAMA_CPP_PYTHON", str(PYTHON))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def run_llama_cpp(path: Path, prompts: list[list[int]], new_tokens: int, texts: tuple[str, ...] = ()) -> dict:
    request = {"gguf": str(path), "prompts": prompts, "max_new_tokens": new_tokens, "texts": list(texts)}
    driver = ROOT / "tests" / "llama_cpp_driver.py"
    done = subprocess.run(
        [str(PYTHON), str(driver)], input=json.dumps(request), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def reference(model, prompt: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
        out = model.generate(input_ids=ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    return logits, out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_f32_export_runs_in_llama_cpp_as_in_pytorch(case, tmp_path, tokenizer, llama_cpp):
    """`hf_tfm.exporters.verify` in llama.cpp: the logits of every position of hf_tfm's greedy sequences, and
    llama.cpp's own greedy tokens (32 per prompt), for each architecture hf_tfm writes."""
    model = trained(CASES[case])
    path = export(model, tmp_path / "model.gguf", tokenizer=tokenizer)
    report = verify_gguf(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, runtime="llama.cpp")
    print(f"{case}: {report}")
    assert report["runtime"] == "llama.cpp" and report["file_type"] == "ALL_F32"
    assert report["max_logit_diff"] < (5e-3 if case in GELU_BLOCKS else 1e-4)
    assert report["tokens_equal"]


def test_prefill_logits_in_llama_cpp(tmp_path, tokenizer):
    """The prompt's logits from one prefill call (llama.cpp's batched path, which `verify` uses too) equal hf_tfm's,
    through a driver of llama.cpp's own generator (its greedy sampler)."""
    model = trained(LLAMA_GQA_UNTIED)
    path = export(model, tmp_path / "model.gguf", tokenizer=tokenizer)
    for prompt, ours in zip(PROMPTS, run_llama_cpp(path, PROMPTS, NEW_TOKENS)["results"], strict=True):
        logits, tokens = reference(model, prompt, NEW_TOKENS)
        assert (torch.tensor(ours["logits"]) - logits).abs().max().item() < 1e-4
        assert ours["tokens"] == tokens


def test_q4_k_m_through_llama_cpps_quantizer(tmp_path, tokenizer, llama_cpp):
    """Q4_K_M: written in F32, rewritten by llama.cpp's quantizer (Q4_K, Q6_K for some v/down rows; rows that do not
    split into 256-value super-blocks fall back, as llama-quantize does). Checked in llama.cpp and through
    transformers' loader (which dequantizes K-quants). Measured on a 256-wide model: greedy tokens equal in both."""
    model = trained({"hidden_size": 256, "intermediate_size": 512, "num_key_value_heads": 2})
    path = export(model, tmp_path, quantize="q4_k_m", tokenizer=tokenizer)
    assert path.name == "model-q4_k_m.gguf" and [p.name for p in tmp_path.iterdir()] == [path.name]
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kinds["blk.0.attn_q.weight"] == "Q4_K" and "Q6_K" in kinds.values()
    assert kinds["blk.0.attn_norm.weight"] == "F32"
    for runtime in ("llama.cpp", "transformers"):
        report = verify_gguf(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, runtime=runtime)
        print(f"q4_k_m in {runtime}: {report}")
        assert report["file_type"] == "MOSTLY_Q4_K_M"
        assert report["forced_agreement"] >= 0.9 and report["max_logit_diff"] < 4.0


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantized_export_decodes_in_llama_cpp(qtype, tmp_path, tokenizer):
    """Quantized files: the greedy tokens agree with PyTorch's fp32 ones on most positions (not exactness)."""
    model = trained(LLAMA_GQA_UNTIED)
    path = export(model, tmp_path, quantize=qtype, tokenizer=tokenizer)
    same = total = 0
    for prompt, ours in zip(PROMPTS, run_llama_cpp(path, PROMPTS, NEW_TOKENS)["results"], strict=True):
        _, tokens = reference(model, prompt, NEW_TOKENS)
        same += sum(a == b for a, b in zip(ours["tokens"], tokens, strict=True))
        total += len(tokens)
    print(f"{qtype}: greedy agreement {same}/{total}")
    assert same / total >= 0.9


def test_llama_cpp_tokenizes_as_the_hf_tfm_tokenizer(tmp_path, tokenizer):
    """The embedded vocabulary (byte-level BPE, GPT-2 pre-tokenizer) gives llama.cpp the tokenizer's ids, BOS included:
    code, spaces and newlines, digits, non-ASCII text."""
    texts = ("def f12(x):\n    return x * 12 + 5\n", "  two  spaces, tabs\tand 3.14159", "naïve café \u2013 ünïcödé ✓")
    path = export(trained(LLAMA), tmp_path / "model.gguf", tokenizer=tokenizer)
    tokenized = run_llama_cpp(path, [], 0, texts)["tokenized"]
    assert tokenized == [tokenizer(text)["input_ids"] for text in texts]


def test_bench_times_llama_cpp_in_its_own_environment(tmp_path):
    """`scripts/bench.py --runtimes` with llama.cpp: the GGUF exports decode in .venv-llama-cpp's Python, batch 1 and a
    batch of sequences, with ratios to hf_tfm's fp32 decoding."""
    from test_bench import load_bench

    bench = load_bench()
    threads = torch.get_num_threads()
    out_path = tmp_path / "runtimes.json"
    argv = ["--size", "tiny", "--runtimes", "llama.cpp_f32,llama.cpp_q8_0", "--rounds", "1", "--threads", "1"]
    try:
        bench.main([*argv, "--json", str(out_path)])
    finally:
        torch.set_num_threads(threads)
    rows = {r["setting"]: r for r in json.loads(out_path.read_text())["runtimes"]}
    assert list(rows) == ["hf_tfm fp32", "llama.cpp f32", "llama.cpp q8_0"]
    for name, r in rows.items():
        assert "error" not in r, r
        for batch in bench.SHAPES["tiny"]["decode_batches"]:
            assert r[f"b{batch}_step_s"] > 0 and r[f"b{batch}_speedup_vs_hf_tfm_fp32"] > 0, name
    assert rows["llama.cpp q8_0"]["weight_bytes_per_step"] < rows["llama.cpp f32"]["weight_bytes_per_step"]


def test_cli_verifies_in_llama_cpp_what_transformers_cannot_read(tmp_path, tokenizer, llama_cpp, capsys):
    """`hf-tfm export --verify` on a refact file: transformers' loader does not read it, so llama.cpp runs it."""
    from export_models import saved

    from hf_tfm.cli import main

    folder = saved(REFACT, tmp_path / "lm", tokenizer)
    capsys.readouterr()
    assert main(["export", str(folder), str(tmp_path / "lm.gguf"), "--verify", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "verified with llama.cpp (llama-cpp-python" in out and "(refact)" in out, out
    assert "greedy tokens equal: yes" in out


@pytest.mark.parametrize("overrides", [{}, {"type_vocab_size": 2, "add_pooling_layer": True}], ids=["bert", "types"])
def test_encoder_embeddings_in_llama_cpp(overrides, tmp_path, tokenizer, llama_cpp):
    """An encoder's GGUF (llama.cpp's bert) gives every token's hidden state as hf_tfm's TfmModel does, within
    ggml's fp16 GELU table (measured 1.5e-3 and 2.4e-3 on states of LayerNorm scale)."""
    model = bert_encoder(overrides)
    path = export(model, tmp_path / "enc.gguf", tokenizer=tokenizer)
    report = verify_gguf(path, model, prompts=PROMPTS)
    print(report)
    assert report["runtime"] == "llama.cpp" and report["outputs"] == ["last_hidden_state"]
    assert report["max_diff"] < 5e-3


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers: each shape's GGUF tokenized by llama.cpp itself against the folder's tokenizer
# (tests/tokenizer_shapes.py: small tokenizers trained as Llama 2/3, Qwen2, GPT-2, StarCoder, BERT, ... build theirs).


def _nfc(text: str) -> bool:
    return unicodedata.normalize("NFC", text) == text


# The texts llama.cpp tokenizes differently, by design, per shape (every other text must agree): Qwen2's NFC normalizer
# is not applied by llama.cpp; llama.cpp's SentencePiece tokenizer puts its space before text that already starts with
# one, where Metaspace does not.
KNOWN_DIFFERENCES = {
    "bpe-qwen2": lambda text: not _nfc(text),
    "bpe-qwen35": lambda text: not _nfc(text),
    "spm-metaspace": lambda text: text.startswith(" "),
}


@pytest.mark.parametrize("shape", list(tokenizer_shapes.SHAPES))
def test_llama_cpp_tokenizes_as_the_folders_tokenizer(shape, tmp_path, llama_cpp):
    """`verify` of each shape's export compares llama.cpp's tokenizer with the folder's on `gguf_vocab.TEXTS` (code,
    whitespace runs, digits, several scripts, emoji; special tokens added as each adds them); held-out standard-library
    code is compared the same way. Equal ids on every text but the shape's known differences, and those do differ."""
    tokenizer, path = export_with_tokenizer(shape, tokenizer_shapes.build(shape), tmp_path)
    report = verify_gguf(path, tmp_path / "model", max_new_tokens=2, runtime="llama.cpp")
    held_out = tokenizer_shapes.held_out_texts()
    more = tokenizer_agreement(path, tokenizer, str(PYTHON), held_out)
    known = KNOWN_DIFFERENCES.get(shape, lambda text: False)
    texts = len(TEXTS) + len(held_out)
    equal = texts - len(report["tokenizer_differs"]) - len(more["tokenizer_differs"])
    chars = report["tokenizer_chars"] + more["tokenizer_chars"]
    back = report["detokenized_agreement"]
    print(f"{shape}: ids equal on {equal}/{texts} texts ({chars} characters); round trip {back:.0%}")
    assert report["tokenizer_runtime"].startswith("llama.cpp") and report["tokenizer_texts"] == len(TEXTS)
    assert report["tokenizer_differs"] == [text for text in TEXTS if known(text)]
    assert more["tokenizer_differs"] == [text for text in held_out if known(text)]
    if shape.startswith("spm"):  # byte tokens typed BYTE come back as bytes (llama_detokenize, no 32-byte cut)
        assert report["detokenized_agreement"] == 1.0


def _with(**changes):
    def mutate(vocab):
        for name, value in changes.items():
            setattr(vocab, name, value(vocab) if callable(value) else value)

    return mutate


# Controls: the metadata the export writes, each changed to a plausible wrong value, makes llama.cpp disagree on the
# same texts: the comparison above can tell a right vocabulary from a wrong one.
CONTROLS = {
    "bpe-gpt-2 as pre 'default'": ("bpe-gpt-2", _with(pre="default")),
    "bpe-starcoder as pre 'gpt-2'": ("bpe-starcoder", _with(pre="gpt-2")),
    "bpe-llama-bpe as pre 'gpt-2'": ("bpe-llama-bpe", _with(pre="gpt-2")),
    "bpe-qwen2 as pre 'smaug-bpe'": ("bpe-qwen2", _with(pre="smaug-bpe")),
    "bpe-gpt-4o as pre 'gpt-2'": ("bpe-gpt-4o", _with(pre="gpt-2")),
    "bpe-tekken as pre 'gpt-2'": ("bpe-tekken", _with(pre="gpt-2")),
    "spm-legacy with flat scores": ("spm-legacy", _with(scores=lambda v: [-1000.0] * len(v.scores))),
    "spm-legacy without the space prefix": ("spm-legacy", _with(add_space_prefix=False)),
    "spm-gemma with the space prefix": ("spm-gemma", _with(add_space_prefix=True)),
    "bert-cased lowercased": ("bert-cased", _with(lowercase=True, strip_accents=True)),
}


@pytest.mark.parametrize("case", list(CONTROLS))
def test_wrong_tokenizer_metadata_is_caught(case, tmp_path, monkeypatch):
    shape, mutate = CONTROLS[case]
    written = gguf_export.gguf_vocabulary

    def wrong(*args, **kwargs):
        vocab = written(*args, **kwargs)
        mutate(vocab)
        return vocab

    monkeypatch.setattr(gguf_export, "gguf_vocabulary", wrong)
    tokenizer, path = export_with_tokenizer(shape, tokenizer_shapes.build(shape), tmp_path)
    report = tokenizer_agreement(path, tokenizer, str(PYTHON))
    print(f"{case}: ids equal on {report['tokenizer_agreement']:.0%} of {report['tokenizer_texts']} texts")
    assert report["tokenizer_differs"] and report["tokenizer_agreement"] < 1.0


def test_real_mistral_tokenizer_in_llama_cpp(tmp_path, llama_cpp):
    """A real vocabulary: Mistral 7B v0.1's tokenizer.model (32000 pieces; mistral-common's wheel, fetched once), in a
    folder as transformers loads it (its conversion to Metaspace BPE with byte fallback), exported as llama.cpp's llama
    vocabulary with merge-rank scores: llama.cpp gives transformers' ids on every text that does not start with a
    space (Metaspace's known difference)."""
    from transformers import AutoTokenizer

    try:
        model_file = tokenizer_shapes.mistral_tokenizer_model()
    except RuntimeError as err:
        pytest.skip(str(err))
    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.model").write_bytes(model_file.read_bytes())
    (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    tokenizer = AutoTokenizer.from_pretrained(source)
    assert len(tokenizer) == 32000
    folder = tmp_path / "model"
    config = {"vocab_size": 32000, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    trained_like = TfmForCausalLM(config_of(**config)).eval()  # the vocabulary is what is checked
    trained_like.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    path = export(folder, tmp_path / "mistral.gguf")
    report = verify_gguf(path, folder, max_new_tokens=2, runtime="llama.cpp")
    held_out = tokenizer_shapes.held_out_texts()
    more = tokenizer_agreement(path, tokenizer, str(PYTHON), held_out)
    texts = len(TEXTS) + len(held_out)
    equal = texts - len(report["tokenizer_differs"]) - len(more["tokenizer_differs"])
    print(f"mistral 7B v0.1: ids equal on {equal}/{texts} texts; round trip {report['detokenized_agreement']:.0%}")
    assert report["tokenizer_differs"] == [text for text in TEXTS if text.startswith(" ")]
    assert more["tokenizer_differs"] == [text for text in held_out if text.startswith(" ")]
    assert report["detokenized_agreement"] == 1.0
