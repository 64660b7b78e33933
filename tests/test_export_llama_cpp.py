"""GGUF exports run in llama.cpp itself: logits and greedy tokens against hf_tfm's (opt-in, `-m llama_cpp`).

llama.cpp is llama-cpp-python in an environment of its own (`make llama-cpp-env` builds .venv-llama-cpp); without it
these tests skip. It runs in a process of its own through tests/llama_cpp_driver.py (loaded next to torch, llama.cpp
segfaulted on this kind of machine), with an f32 KV cache. The models are tests/export_models.py's: tiny, trained on a
token cycle, so greedy steps have clear winners.
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from export_models import NEW_TOKENS, PROMPTS, train_tokenizer, trained
from test_export_gguf import BLOOM, GPT2, LLAMA, LLAMA_GQA_UNTIED, MIXTRAL, MOE, QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE

from hf_tfm.exporters import export

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-llama-cpp" / "bin" / "python"
pytestmark = [
    pytest.mark.llama_cpp,
    pytest.mark.skipif(not PYTHON.is_file(), reason="llama.cpp's environment is missing: make llama-cpp-env"),
]

# Largest |logit difference| allowed for f32 files, logits up to ~14. SwiGLU architectures differ from PyTorch only
# in summation order (measured 2.9e-6 to 5.3e-6, qwen3's qk-norm included); ggml's GELU rounds its input to fp16 and
# reads a table of the tanh form (gpt2: measured 1.4e-4; bloom, whose MLP is twice as wide: 1.4e-3). llama-cpp-python
# 0.3.36, transformers 5.24 and 5.16.1.
F32_ATOL = {"llama": 1e-4, "llama-gqa-untied": 1e-4, "qwen2": 1e-4, "qwen3": 1e-4, "gpt2": 2e-3, "bloom": 5e-3}
F32_ATOL |= dict.fromkeys(("mixtral", "mixtral-tied", "qwen2moe", "qwen3moe"), 1e-4)
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
}


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
def test_f32_export_runs_in_llama_cpp_as_in_pytorch(case, tmp_path, tokenizer):
    model = trained(CASES[case])
    path = export(model, tmp_path / "model.gguf", tokenizer=tokenizer)
    for prompt, ours in zip(PROMPTS, run_llama_cpp(path, PROMPTS, NEW_TOKENS)["results"], strict=True):
        logits, tokens = reference(model, prompt, NEW_TOKENS)
        diff = (torch.tensor(ours["logits"]) - logits).abs().max().item()
        print(f"{case}: prompt of {len(prompt)}, max logit difference {diff:.2e}")
        assert diff < F32_ATOL[case]
        assert ours["tokens"] == tokens


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
