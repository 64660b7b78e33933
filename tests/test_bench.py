"""The benchmark runs end to end at the `tiny` size (1 round) and reports every task and ratio.

Performance is never asserted here: the numbers are measured by `scripts/bench.py` itself, not by timed tests.
"""

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


def load_bench():
    """The `benchmark` package (scripts/benchmark/), imported as scripts/bench.py imports it: from scripts/."""
    if str(BENCH.parent) not in sys.path:
        sys.path.insert(0, str(BENCH.parent))
    return importlib.import_module("benchmark")


@pytest.fixture
def tinyllama_standin(monkeypatch) -> str:
    """A size of TinyLlama's kind (grouped-query attention, its own SwiGLU width, a Llama only) at the tiny size's
    scale, registered as the bench's sizes are."""
    bench = load_bench()
    name = "tinyllama_standin"
    small = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512}
    monkeypatch.setitem(bench.SIZES, name, {**bench.SIZES["tinyllama"], **small})
    monkeypatch.setitem(bench.SHAPES, name, bench.SHAPES["tiny"])
    monkeypatch.setitem(bench.BANDWIDTH_MIB, name, bench.BANDWIDTH_MIB["tiny"])
    return name


def run_bench(argv: list[str]) -> dict:
    """`bench.main(argv)` on one thread, the test process's threads restored after it."""
    threads = torch.get_num_threads()
    try:
        return load_bench().main([*argv, "--threads", "1"])
    finally:
        torch.set_num_threads(threads)


def assert_charts(paths: list[Path]) -> None:
    """Each is a non-empty PNG that matplotlib reads back, wide enough to read at 900 px."""
    from matplotlib.image import imread

    for path in paths:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, path
        height, width, _ = imread(path).shape
        assert height > 0 and width >= 900, (path, height, width)


def test_bench_tiny_end_to_end(tmp_path):
    bench = load_bench()
    out_path = tmp_path / "bench.json"
    run_bench(["--size", "tiny", "--rounds", "1", "--json", str(out_path)])
    out = json.loads(out_path.read_text())

    rows = {(r["pair"], r["task"]): r for r in out["results"]}
    expected = {(pair, task) for pair, tasks in bench.PAIR_TASKS.items() for task in tasks}
    assert expected <= set(rows), expected - set(rows)
    assert {task for _, task in rows} == set(bench.ALL_TASKS)

    for (pair, task), r in rows.items():
        assert r["size"] == "tiny"
        assert math.isfinite(r["speedup"]) and r["speedup"] > 0, (pair, task)
        for side in ("ours", "theirs"):
            assert r[side]["median_s"] > 0 and r[side]["tokens_per_s"] > 0
        if task in (*bench.TRAIN_TASKS, "prefill"):
            assert r["mem_ratio"] > 0 and r["ours"]["peak_mem_bytes"] > 0, (pair, task)
        if task in bench.TRAIN_TASKS:
            assert r["matmul_flops_per_s"] > 0
            assert r["ours"]["mm_frac"] > 0 and r["theirs"]["mm_frac"] > 0
    assert "| tiny | llama | decode_b1 |" in out["markdown"]
    assert "| tiny | bart | s2s_generate_b8 | BartForConditionalGeneration |" in out["markdown"]
    # The Mixtral pair counts active parameters only (the router and top-k experts per token), and times hf_tfm's
    # steps on the experts kernels.
    assert rows[("mixtral", "train")]["train_flops"] < rows[("llama", "train")]["train_flops"] * 1.1
    kernels = [e for e in out["extra"] if e["pair"] == "mixtral" and "experts kernel" in e["what"]]
    assert [set(e["medians_ms"]) for e in kernels] == [set(k) for k in bench.KERNELS_BY_TASK.values()]
    assert out["machine"]["torch"] == torch.__version__

    # `--charts`: the run's speedup chart, and the same from the saved JSON without running anything
    charts = bench.write_charts(out, tmp_path / "charts")
    assert [path.name for path in charts] == ["speedup.png"]
    assert_charts(charts)
    again = bench.main(["--charts", str(tmp_path / "again"), "--from-json", str(out_path)])
    assert again == out
    assert_charts([tmp_path / "again" / "speedup.png"])


def test_bench_decode_settings_tiny(tmp_path):
    """`--decode-settings`: every weight setting on both sides, bytes per step, bandwidth fractions, and the failures
    reported with their error rather than skipped."""
    bench = load_bench()
    out_path = tmp_path / "decode.json"
    args = ["--size", "tiny", "--rounds", "1", "--decode-settings", "all"]
    run_bench([*args, "--json", str(out_path), "--charts", str(tmp_path / "charts")])
    out = json.loads(out_path.read_text())
    assert out["bandwidth"]["bytes_per_s"] > 0
    # a decode-settings run has no pair results: its one chart is the settings'
    assert sorted(path.name for path in (tmp_path / "charts").iterdir()) == ["decode_settings.png"]
    assert_charts([tmp_path / "charts" / "decode_settings.png"])
    rows = {r["setting"]: r for r in out["decode"]}
    assert list(rows) == list(bench.DECODE_SETTINGS)
    fp32_bytes = rows["fp32"]["ours"]["weight_bytes_per_step"]
    for setting, row in rows.items():
        if "error" in row:
            assert row["error"] and f"| {setting} |" in out["markdown"]
            continue
        for side in ("ours", "theirs"):
            for batch in bench.SHAPES["tiny"]["decode_batches"]:
                assert row[side][f"b{batch}_step_s"] > 0 and row[side][f"b{batch}_bandwidth_frac"] > 0
                assert math.isfinite(row[side][f"b{batch}_speedup_vs_fp32_in_tree"])
        # the same weights on both sides, and quantization streams fewer bytes than fp32
        assert row["ours"]["weight_bytes_per_step"] == row["theirs"]["weight_bytes_per_step"]
        if setting != "fp32":
            assert row["ours"]["weight_bytes_per_step"] < fp32_bytes, setting
    assert "error" not in rows["fp32"] and "error" not in rows["bf16"]
    # half the bytes, up to the rotary buffers (kept in fp32)
    assert rows["bf16"]["ours"]["weight_bytes_per_step"] * 2 == pytest.approx(fp32_bytes, rel=1e-3)


def test_quality_script_tiny(tmp_path):
    """`scripts/quality.py` trains its LM on the demo's corpus, then scores every setting against fp32: hf_tfm's own
    (q8), every setting of the bench's decode table, and the calibrated int4 checkpoints (where llm-compressor's
    environment is made, as in CI)."""
    quality = load_script(BENCH.parent / "quality.py", "hf_tfm_quality")
    threads = torch.get_num_threads()
    try:
        out = quality.main(["--size", "tiny", "--steps", "3", "--threads", "1", "--json", str(tmp_path / "q.json")])
    finally:
        torch.set_num_threads(threads)
    rows = {r["setting"]: r for r in out["results"]}
    assert set(rows) == {"q8", "q4", *load_bench().DECODE_SETTINGS, "gptq_int4", "awq_int4", "rtn_int4"}
    assert "error" not in rows["q8"] and rows["q8"]["greedy_agreement"] > 0.9
    if load_bench().LLMCOMPRESSOR_PYTHON.exists():
        assert all("error" not in rows[f"{method}_int4"] for method in ("gptq", "awq", "rtn")), rows
    assert rows["fp32"]["perplexity"] == pytest.approx(out["fp32"]["perplexity"])
    assert rows["fp32"]["greedy_agreement"] == 1
    for row in rows.values():
        if "error" not in row:
            assert math.isfinite(row["perplexity"]) and 0 < row["greedy_agreement"] <= 1
    assert json.loads((tmp_path / "q.json").read_text())["markdown"] == out["markdown"]


def test_quality_script_scores_runtime_exports_tiny(tmp_path):
    """`--runtimes`: the same fp32 folder exported and scored in ONNX Runtime, CTranslate2 and (dequantized) GGUF;
    a float32 export scores as fp32 does, a quantized one differs."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("ctranslate2")
    quality = load_script(BENCH.parent / "quality.py", "hf_tfm_quality")
    threads = torch.get_num_threads()
    argv = ["--size", "tiny", "--steps", "3", "--threads", "1", "--settings", "fp32"]
    try:
        out = quality.main([*argv, "--runtimes", "ct2_float32,onnx_int8,gguf_q8_0"])
    finally:
        torch.set_num_threads(threads)
    rows = {r["setting"]: r for r in out["results"]}
    assert list(rows) == ["fp32", "ct2_float32", "onnx_int8", "gguf_q8_0"]
    assert all("error" not in r for r in rows.values()), rows
    assert rows["ct2_float32"]["perplexity"] == pytest.approx(out["fp32"]["perplexity"], rel=1e-4)
    assert rows["ct2_float32"]["greedy_agreement"] == 1
    for name in ("onnx_int8", "gguf_q8_0"):
        assert rows[name]["perplexity"] != out["fp32"]["perplexity"] and 0.5 < rows[name]["greedy_agreement"] <= 1


@pytest.mark.slow
def test_bench_decode_settings_compiled_tiny(tmp_path):
    """A `+compile` setting decodes with a static cache and compiled generate() on both sides; fp32 (the reference
    of every speedup) is measured even when not asked for."""
    args = ["--size", "tiny", "--rounds", "1", "--decode-settings", "bf16+compile"]
    out = run_bench([*args, "--json", str(tmp_path / "decode.json")])
    rows = {r["setting"]: r for r in out["decode"]}
    assert list(rows) == ["fp32", "bf16+compile"] and "compiled generate()" in rows["bf16+compile"]["what"]
    for side in ("ours", "theirs"):
        assert math.isfinite(rows["bf16+compile"][side]["b1_speedup_vs_fp32_in_tree"])


def test_bench_runtimes_tiny(tmp_path):
    """`--runtimes`: the same weights exported and decoded by each runtime in a process of its own, with ratios to
    hf_tfm's fp32 decoding and a chart."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("ctranslate2")
    bench = load_bench()
    out_path, charts = tmp_path / "runtimes.json", tmp_path / "charts"
    settings = "onnx_int8,ct2_float32,hf_tfm_int4_compiled,hf_tfm_q4_compiled"
    pytest.importorskip("torchao")
    argv = ["--size", "tiny", "--runtimes", settings, "--rounds", "1"]
    run_bench([*argv, "--json", str(out_path), "--charts", str(charts)])
    out = json.loads(out_path.read_text())
    rows = {r["setting"]: r for r in out["runtimes"]}
    # the reference first
    assert list(rows) == ["hf_tfm fp32", "onnx int8", "ct2 float32", "hf_tfm int4 compiled", "hf_tfm q4 compiled"]
    for name, r in rows.items():
        assert "error" not in r, r
        assert r["weight_bytes_per_step"] > 0
        for batch in bench.SHAPES["tiny"]["decode_batches"]:
            assert r[f"b{batch}_step_s"] > 0 and math.isfinite(r[f"b{batch}_speedup_vs_hf_tfm_fp32"]), name
    assert rows["hf_tfm fp32"]["b1_speedup_vs_hf_tfm_fp32"] == 1.0
    assert rows["onnx int8"]["weight_bytes_per_step"] < rows["ct2 float32"]["weight_bytes_per_step"]
    # int4 weights with bf16 around them: fewer bytes than fp32 (the tiny model's embeddings dominate both)
    assert rows["hf_tfm int4 compiled"]["weight_bytes_per_step"] < rows["hf_tfm fp32"]["weight_bytes_per_step"]
    assert rows["hf_tfm q4 compiled"]["weight_bytes_per_step"] < rows["hf_tfm fp32"]["weight_bytes_per_step"]
    assert "| tiny | onnx int8 |" in out["markdown"]
    assert_charts([charts / "runtimes.png"])


def test_bench_runtimes_w4a16_tiny(tmp_path):
    """`--runtimes hf_tfm_w4a16_compiled`: a GPTQ / AWQ-format checkpoint (written in llm-compressor's environment)
    decoded by the compiled step, beside hf_tfm's own q4 (the same int4 layers, an int8 lm_head)."""
    bench = load_bench()
    if not bench.LLMCOMPRESSOR_PYTHON.exists():
        pytest.skip("needs llm-compressor's environment: make llmcompressor-env")
    argv = ["--size", "tiny", "--runtimes", "hf_tfm_q4_compiled,hf_tfm_w4a16_compiled", "--rounds", "1"]
    out = run_bench([*argv, "--json", str(tmp_path / "w4a16.json")])
    rows = {r["setting"]: r for r in out["runtimes"]}
    assert "error" not in rows["hf_tfm w4a16 compiled"], rows["hf_tfm w4a16 compiled"]
    assert rows["hf_tfm w4a16 compiled"]["b1_step_s"] > 0
    # the same int4 layers; lm_head stays float where q4 makes it int8
    assert rows["hf_tfm q4 compiled"]["weight_bytes_per_step"] < rows["hf_tfm w4a16 compiled"]["weight_bytes_per_step"]
    assert rows["hf_tfm w4a16 compiled"]["weight_bytes_per_step"] < rows["hf_tfm fp32"]["weight_bytes_per_step"]


def test_bench_script_runs_as_documented():
    """`python scripts/bench.py` (the entry point of the package beside it) takes the documented flags."""
    done = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    flags = ("--size", "--runtimes", "--decode-settings", "--speculative", "--ttft", "--cold", "--padded", "tinyllama")
    for flag in flags:
        assert flag in done.stdout, flag


def test_tinyllama_size_is_tinyllama_shape():
    """`--size tinyllama` builds TinyLlama-1.1B's shape (built here on the meta device: no weights made): its
    1,100,048,384 parameters, grouped-query k/v projections in the FLOPs' matmul shapes, and the llama pair only."""
    bench = load_bench()
    with torch.device("meta"):
        model, linears = bench.in_tree_model("llama", "tinyllama", torch.float32, "sdpa", bench.SHAPES["tinyllama"])
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (2048, 22, 5632)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (32, 4, 32000)
    assert bench.n_params(model) == 1_100_048_384
    # every matmul weight: all parameters but the token table and the norms
    norms = (2 * 22 + 1) * 2048
    assert sum(i * o for i, o in linears) == bench.n_params(model) - 32000 * 2048 - norms
    assert (2048, 256) in linears  # k and v: 4 heads of 64
    assert [p for p in bench.PAIR_TASKS if bench.models.builds("tinyllama", p)] == ["llama"]


def test_bench_size_builds_its_pairs_only(tinyllama_standin):
    """A size of TinyLlama's kind times the llama pair alone (the GPT-2 pair is skipped), here decoding a padded
    batch: prompts of different lengths, left-padded, on both sides."""
    bench = load_bench()
    argv = ["--size", tinyllama_standin, "--pairs", "llama,gpt2", "--tasks", "decode_b8", "--rounds", "1"]
    out = run_bench([*argv, "--padded", "--no-memory"])
    assert [(r["pair"], r["task"]) for r in out["results"]] == [("llama", "decode_b8")]
    assert out["results"][0]["ours"]["median_s"] > 0 and out["args"]["padded"] is True
    assert bench.steps.prompt_lengths(8, 32, padded=True) == [32, 30, 28, 26, 23, 21, 19, 16]
    assert out["markdown"].startswith("Load average (1 / 5 / 15 min): ")


def test_bench_runtimes_ttft_padded_tiny(tmp_path, tinyllama_standin):
    """`--runtimes ... --ttft --padded` on a size of TinyLlama's kind: each runtime decodes a batch of prompts of
    different lengths, and times its first token after prompts of `TTFT_PROMPTS` tokens, each in a process of its
    own, with ratios to hf_tfm fp32's, beside the ms per token in the JSON and the table."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("ctranslate2")
    bench = load_bench()
    settings = ["onnx_int8", "ct2_float32"]
    if bench.runtimes.LLAMA_CPP_PYTHON.is_file():
        settings.append("llama.cpp_q8_0")
    argv = ["--size", tinyllama_standin, "--runtimes", ",".join(settings), "--ttft", "--padded", "--rounds", "1"]
    out = run_bench([*argv, "--json", str(tmp_path / "runtimes.json")])
    assert json.loads((tmp_path / "runtimes.json").read_text())["markdown"] == out["markdown"]
    rows = {r["setting"]: r for r in out["runtimes"]}
    assert list(rows) == ["hf_tfm fp32", *(s.replace("_", " ", 1) for s in settings)]
    for name, r in rows.items():
        assert "error" not in r, r
        for key in [f"b{batch}" for batch in bench.SHAPES["tiny"]["decode_batches"]]:
            assert r[f"{key}_step_s"] > 0 and math.isfinite(r[f"{key}_speedup_vs_hf_tfm_fp32"]), name
        for length in bench.TTFT_PROMPTS:
            assert r[f"ttft_p{length}_s"] > 0, (name, r)
            assert math.isfinite(r[f"ttft_p{length}_speedup_vs_hf_tfm_fp32"]), name
    assert rows["hf_tfm fp32"]["ttft_p512_speedup_vs_hf_tfm_fp32"] == 1.0
    table = out["markdown"]
    assert table.startswith("Load average (1 / 5 / 15 min): ") and "ms/token B=2 padded" in table
    assert "| first token ms P=128 | first token ms P=512 |" in table
    assert f"| {tinyllama_standin} | onnx int8 |" in table


@pytest.mark.slow
def test_bench_cold_starts_tiny(tmp_path):
    """`--runtimes ... --cold`: each setting's first call in a new process, timed from the process's start, twice on
    one store: the first process compiles its step beside the decoding (stored `compile_s` after its start), the second
    decodes every step through the stored library."""
    argv = ["--size", "tiny", "--runtimes", "hf_tfm_q4_compiled", "--cold", "--rounds", "1"]
    out = run_bench([*argv, "--json", str(tmp_path / "cold.json")])
    assert json.loads((tmp_path / "cold.json").read_text())["cold"] == out["cold"]
    rows = {r["setting"]: r for r in out["cold"]}
    assert list(rows) == ["hf_tfm fp32", "hf_tfm q4 compiled"]
    for name, r in rows.items():
        assert "error" not in r, r
        for process in ("first", "second"):
            times = [r[f"{process}_{key}"] for key in ("load_s", "first_token_s", "total_s")]
            assert 0 < times[0] <= times[1] <= times[2], (name, process, times)
            assert 0 <= r[f"{process}_longest_gap_s"] <= times[2] - times[1], (name, process)
        assert r["second_warm_s"] > 0
    q4, eager = rows["hf_tfm q4 compiled"], rows["hf_tfm fp32"]
    assert q4["second_library_steps"] == r["new"] - 1 == 15  # every step after the prompt's pass
    assert q4["compile_s"] > q4["first_load_s"]
    assert eager["second_library_steps"] is None and "compile_s" not in eager  # no compiled step
    assert "| tiny | hf_tfm q4 compiled |" in out["markdown"] and "first: 16 tokens s" in out["markdown"]


@pytest.mark.slow
def test_bench_speculative_tiny(tmp_path):
    """`--speculative`: plain, prompt-lookup and assisted generate() of one model through load_for_inference, each
    output checked by the bench against the tokens the model is built to decode, the speed-ups over plain and the
    tokens each target pass yielded: plain one, prompt lookup on copied text more (none proposed on the first pass,
    every one accepted after it), on new text one (nothing to copy), the draft of the target's own first layer every
    proposal accepted (at this size's few new tokens, the target's first pass over the prompt and the draft's
    proposals yields them all)."""
    bench = load_bench()
    out = run_bench(["--size", "tiny", "--rounds", "1", "--speculative", "q4", "--json", str(tmp_path / "spec.json")])
    assert json.loads((tmp_path / "spec.json").read_text())["speculative"] == out["speculative"]
    (row,) = out["speculative"]
    assert "error" not in row, row
    new = bench.SHAPES["tiny"]["new"]
    assert row["plain_tokens_per_pass"] == row["lookup_new_tokens_per_pass"] == 1.0
    assert row["lookup_copied_tokens_per_pass"] > 1 and row["assisted_tokens_per_pass"] == new
    for name in ("lookup_copied", "lookup_new", "assisted"):
        assert row[f"{name}_token_s"] > 0 and math.isfinite(row[f"{name}_speedup"])
    assert "| tiny | q4 | 1 |" in out["markdown"]


def test_bench_speculative_target_decodes_its_permutation():
    """The speculative target's construction: the prompt that repeats is one cycle of the permutation greedy decoding
    follows, the other prompt's continuation copies nothing of it, and no special id is in either."""
    load_bench()
    speculative = importlib.import_module("benchmark.speculative")
    successor, copied, new = speculative.prompts("tiny")
    assert sorted(successor.tolist()) == list(range(speculative.SIZES["tiny"]["vocab"]))  # a permutation
    cycle = speculative.greedy(successor, copied, copied.shape[1])[0, copied.shape[1] :]
    assert torch.equal(cycle, copied[0])  # its continuation is the prompt again
    continuation = speculative.greedy(successor, new, 64)[0, new.shape[1] :]
    assert not set(continuation.tolist()) & set(new[0].tolist()) and min(copied.min(), new.min()) >= 3
