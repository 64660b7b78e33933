"""Figures the documentation states in prose agree with the results files its tables are generated from.

docs/performance.md's tables are written by scripts/gen_perf_page.py from scripts/results/*.json; the sentences around
them, and the speeds other pages quote, are checked here against the same files: each figure is recomputed from the
JSON and must appear as written, and each comparison a page makes in words ("faster", "level with", "the least loss")
must hold in every run. `make demo`'s figures come from its own results: scripts/results/demo_full.json and
demo_quick.json are the demo's metrics.json of a full and a quick run.
"""

import json
import math
import re
from pathlib import Path

import pytest
from conftest import doc_page

RESULTS = Path(__file__).resolve().parents[1] / "scripts" / "results"
Q4, Q8, FP32 = "hf_tfm q4 compiled", "hf_tfm q8 compiled", "hf_tfm fp32"
PROMPTS = ("ttft_p128_s", "ttft_p512_s")


def runtimes(name: str) -> dict[str, dict]:
    """setting -> its row, from scripts/results/runtimes_NAME.json."""
    return {row["setting"]: row for row in json.loads((RESULTS / f"runtimes_{name}.json").read_text())["runtimes"]}


def over(rows: dict, theirs: str, ours: str, key: str) -> float:
    """How many times faster `ours` is than `theirs` (their time over ours), as the tables print it."""
    return rows[theirs][key] / rows[ours][key]


def prose(page: str) -> str:
    """The page's text with line breaks as spaces (a figure may be wrapped with its words)."""
    return re.sub(r"\s+", " ", doc_page(page).read_text())


def assert_states(page: str, *phrases: str) -> None:
    text = prose(page)
    for phrase in phrases:
        assert phrase in text, f"{page} should say {phrase!r}: the results say so"


def span(values: list[float]) -> str:
    return f"{min(values):.2f}x to {max(values):.2f}x"


@pytest.fixture(scope="module")
def tinyllama() -> dict[str, dict]:
    return runtimes("tinyllama")


@pytest.fixture(scope="module")
def base() -> dict[str, dict]:
    return runtimes("base")


def test_performance_summary(tinyllama, base):
    q4_prompts = [over(run, "llama.cpp q4_0", Q4, key) for run in (base, tinyllama) for key in PROMPTS]
    q8_ahead = [over(run, "llama.cpp q8_0", Q8, key) for run in (base, tinyllama) for key in ("b8_step_s", *PROMPTS)]
    assert_states(
        "performance",
        f"TinyLlama-1.1B's shape at {tinyllama[Q4]['b1_step_s'] * 1e3:.1f} ms a token at batch 1",
        f"({over(tinyllama, FP32, Q4, 'b1_step_s'):.1f}x the eager float32 model",
        f"{over(tinyllama, 'llama.cpp q4_k_m', Q4, 'b1_step_s'):.2f}x llama.cpp's Q4_K_M",
        f"{over(tinyllama, 'llama.cpp q4_0', Q4, 'b1_step_s'):.2f}x its Q4_0)",
        f"decoder at {base[Q4]['b1_step_s'] * 1e3:.1f} ms ({over(base, 'llama.cpp q4_0', Q4, 'b1_step_s'):.2f}x Q4_0)",
        f"`q4` is at {span(q4_prompts)} the speed of its Q4_0",
        f"on prompts ({span(q8_ahead)})",
        f"on TinyLlama's shape ({over(tinyllama, 'llama.cpp q8_0', Q8, 'b1_step_s'):.2f}x)",
        f"decoder ({over(base, 'llama.cpp q8_0', Q8, 'b1_step_s'):.2f}x)",
    )
    assert min(q8_ahead) > 1  # the words: q8 ahead at batch 8 and on prompts, behind at batch 1
    assert all(over(run, "llama.cpp q8_0", Q8, "b1_step_s") < 1 for run in (base, tinyllama))
    assert min(q4_prompts) > 1  # q4's prompts: "ahead at both shapes"


def test_performance_avx2_summary():
    """The paragraph on the AVX2 machine: q4 and q8 against the compiled float32 step, from that machine's two runs."""
    base, tinyllama = runtimes("base_avx2"), runtimes("tinyllama_avx2")
    step = "hf_tfm fp32 compiled"
    prompts = [over(run, step, ours, key) for run in (base, tinyllama) for ours in (Q4, Q8) for key in PROMPTS]
    batches = [over(run, step, ours, "b8_step_s") for run in (base, tinyllama) for ours in (Q4, Q8)]
    assert_states(
        "performance",
        f"TinyLlama-1.1B's shape at {tinyllama[Q4]['b1_step_s'] * 1e3:.1f} ms a token at batch 1",
        f"({over(tinyllama, step, Q4, 'b1_step_s'):.1f}x the compiled float32 step)",
        f"the base decoder at {base[Q4]['b1_step_s'] * 1e3:.1f} ms ({over(base, step, Q4, 'b1_step_s'):.1f}x)",
        f"batches of 8 at {span(batches)} its speed",
        f"prompts at {span(prompts)}",
    )
    assert min(batches) > 1 and min(over(run, step, Q4, "b1_step_s") for run in (base, tinyllama)) > 2


def test_fast_inference_summary(tinyllama, base):
    q4_prompts = [
        over(tinyllama, theirs, Q4, key) for theirs in ("llama.cpp q4_0", "llama.cpp q4_k_m") for key in PROMPTS
    ]
    assert_states(
        "fast-inference",
        f"decodes at {tinyllama[Q4]['b1_step_s'] * 1e3:.1f} ms a token with `q4`",
        f"{tinyllama[Q8]['b1_step_s'] * 1e3:.1f} ms with `q8`",
        f"eager float32: {tinyllama[FP32]['b1_step_s'] * 1e3:.1f} ms",
        f"`q4` at {over(tinyllama, 'llama.cpp q4_0', Q4, 'b1_step_s'):.2f}x the speed of llama.cpp's Q4_0",
        f"{over(tinyllama, 'llama.cpp q4_k_m', Q4, 'b1_step_s'):.2f}x its Q4_K_M",
        f"`q8` at {over(tinyllama, 'llama.cpp q8_0', Q8, 'b1_step_s'):.2f}x its Q8_0",
        f"reads them at {span(q4_prompts)} the speed of its 4-bit types",
        f"batches of 8 at {over(tinyllama, 'llama.cpp q4_0', Q4, 'b8_step_s'):.2f}x Q4_0's",
    )
    assert min(q4_prompts) > 1  # "on prompts q4 is ahead"
    # the base decoder: "llama.cpp's Q4_0 decodes one sequence faster (q4 at 0.82x), and q4 reads prompts faster"
    assert_states("fast-inference", f"`q4` at {over(base, 'llama.cpp q4_0', Q4, 'b1_step_s'):.2f}x its speed")
    assert over(base, "llama.cpp q4_0", Q4, "b1_step_s") < 1
    assert all(over(base, "llama.cpp q4_0", Q4, key) > 1 for key in PROMPTS)


def test_llama_cpp_page_comparisons_hold(tinyllama, base):
    """docs/llama-cpp.md compares in words: each comparison holds in every run on Performance."""
    text = prose("llama-cpp")
    assert "its `q4` reads prompts faster than llama.cpp's Q4_0 and Q4_K_M at both shapes measured" in text
    assert "at TinyLlama-1.1B's shape decodes faster too, one sequence or a batch of 8" in text
    assert "on the bench's 110 M-parameter decoder llama.cpp's Q4_0 decodes one sequence faster" in text
    assert over(base, "llama.cpp q4_0", Q4, "b1_step_s") < 1 and over(base, "llama.cpp q4_0", Q4, "b8_step_s") > 1
    for theirs in ("llama.cpp q4_0", "llama.cpp q4_k_m"):
        assert all(over(run, theirs, Q4, key) > 1 for run in (base, tinyllama) for key in PROMPTS), theirs
        assert all(over(tinyllama, theirs, Q4, key) > 1 for key in ("b1_step_s", "b8_step_s")), theirs
    for run in (base, tinyllama):  # the fastest decoding of a batch of 8
        llama_cpp = {setting: row for setting, row in run.items() if setting.startswith("llama.cpp")}
        assert min(llama_cpp, key=lambda setting: llama_cpp[setting]["b8_step_s"]) == "llama.cpp q4_0"
    rows = json.loads((RESULTS / "quality_runtimes_small.json").read_text())["results"]
    gguf = {row["setting"]: row["perplexity"] for row in rows if row["setting"].startswith("gguf")}
    assert gguf["gguf_q4_k_m"] < gguf["gguf_q4_0"]  # q4_k_m: the least perplexity lost of the 4-bit types
    assert max(gguf, key=gguf.get) == "gguf_q4_0"  # the largest loss
    assert "the least perplexity lost of the 4-bit types" in text
    assert "the fastest decoding of batches, at the largest loss" in text


# ---------------------------------------------------------------------------------------------------------------------
# Speculative decoding: scripts/results/speculative_SIZE.json, written by `scripts/bench.py --speculative all`

SPECULATIVE_CALLS = {
    "lookup_copied": "prompt lookup, the output copies the prompt",
    "lookup_new": "prompt lookup, nothing to copy",
    "assisted": "draft, every token accepted",
}
SPECULATIVE_SHAPES = {"base": "base (110M)", "tinyllama": "TinyLlama-1.1B shape"}


def speculative_rows() -> list[dict]:
    rows = []
    for size in SPECULATIVE_SHAPES:
        rows += json.loads((RESULTS / f"speculative_{size}.json").read_text())["speculative"]
    return rows


def test_speculative_table_is_the_bench_results():
    """docs/speculative.md's table: every row of the results files, as measured, in both calls."""
    rows = speculative_rows()
    assert {row["size"] for row in rows} == set(SPECULATIVE_SHAPES)
    text = doc_page("speculative").read_text()
    for row in rows:
        assert "error" not in row, row
        assert row["k"] == 8
        for name, call in SPECULATIVE_CALLS.items():
            cells = [
                call,
                f"{SPECULATIVE_SHAPES[row['size']]}, {row['setting']}",
                f"{row['plain_token_s'] * 1e3:.1f}",
                f"{row[f'{name}_token_s'] * 1e3:.1f}",
                f"**{row[f'{name}_speedup']:.2f}x**",
                f"{row[f'{name}_tokens_per_pass']:.1f}",
            ]
            line = "| " + " | ".join(cells) + " |"
            assert line in text, f"docs/speculative.md should have the row {line!r}"


def verify_cost(row: dict) -> float:
    """A verify pass of the target over the copied text, in one-token steps: its time per token times the tokens a
    pass yielded, over plain decoding's time per token."""
    return row["lookup_copied_token_s"] * row["lookup_copied_tokens_per_pass"] / row["plain_token_s"]


def test_speculative_prose_is_the_bench_results():
    """The sentences under the table: each figure recomputed from the results, each comparison true of every row."""
    rows = speculative_rows()
    by_setting = {setting: [row for row in rows if row["setting"] == setting] for setting in ("fp32", "q8", "q4")}
    costs = {setting: list(map(verify_cost, chosen)) for setting, chosen in by_setting.items()}
    q4 = by_setting["q4"]

    def costs_of(setting: str) -> str:
        low, high = f"{min(costs[setting]):.1f}", f"{max(costs[setting]):.1f}"
        return low if low == high else f"{low} to {high}"

    assert_states(
        "speculative",
        f"prompt lookup on copied text decodes {span([r['lookup_copied_speedup'] for r in rows])} faster",
        f"a well-matched draft {span([r['assisted_speedup'] for r in rows])}",
        f"(`q4`: {span([r['lookup_copied_speedup'] for r in q4])} with lookup, "
        f"{span([r['assisted_speedup'] for r in q4])} with a draft)",
        f"a verify step of 9 tokens costs {costs_of('q8')} one-token steps at `q8`, {costs_of('q4')} at `q4` and "
        f"{costs_of('fp32')} at float32",
        f"at {span([r['lookup_new_speedup'] for r in rows])} plain decoding's speed",
    )
    # "both pay at every setting"; "they gain most at q8", whose verify step costs the fewest one-token steps
    assert all(r["lookup_copied_speedup"] > 1.2 and r["assisted_speedup"] > 1.2 for r in rows)
    for row in by_setting["q8"]:
        others = [r for r in rows if r["size"] == row["size"] and r["setting"] != "q8"]
        for name in ("lookup_copied_speedup", "assisted_speedup"):
            assert row[name] > max(r[name] for r in others), (row["size"], name)
        assert verify_cost(row) < min(map(verify_cost, others)), row["size"]
    assert all(row["lookup_new_tokens_per_pass"] == 1.0 for row in rows)  # nothing proposed


# ---------------------------------------------------------------------------------------------------------------------
# make demo


def demo(profile: str) -> dict:
    return json.loads((RESULTS / f"demo_{profile}.json").read_text())


def minutes(run: dict) -> str:
    """The run's wall time as the docs state it: to the nearest half minute."""
    half_minutes = round(run["wall_seconds"] / 30)
    return f"about {half_minutes / 2:g} minute{'s' if half_minutes != 2 else ''}"


def test_demo_figures():
    full, quick = demo("full"), demo("quick")
    assert full["profile"] == "full" and quick["profile"] == "quick"
    lm, clf, s2s = full["lm"], full["classifier"], full["seq2seq"]
    assert_states(
        "cli",
        f"held-out perplexity {lm['perplexity']:.1f} against {math.exp(lm['baseline_loss']):.1f} for a unigram model",
        f"test accuracy {clf['test_accuracy']:.3f} against a majority-class baseline of "
        f"{clf['baseline_accuracy']:.3f}",
        f"exact match of {s2s['exact_match']:.3f} and word F1 of {s2s['word_f1']:.3f} against "
        f"{s2s['baseline_exact_match']:.3f} and {s2s['baseline_word_f1']:.3f}",
        f"`{s2s['baseline_target'].strip()}`",
        f"{s2s['settings']['max_steps']} steps of {s2s['settings']['batch_size']} pairs",
        f"{lm['settings']['max_steps']} steps of {lm['settings']['batch_size']} x {lm['settings']['seq_len']} tokens",
    )
    # one value for each duration, wherever the docs, the README and the command's help state it
    for page in ("README", "index", "getting-started", "cli"):
        text = prose(page)
        stated = re.findall(r"about [\d.]+ minutes?", text)
        assert stated and set(stated) <= {minutes(full), minutes(quick)}, (page, stated)
    assert minutes(full) in prose("cli") and minutes(quick) in prose("cli")
    from hf_tfm.cli import build_parser

    demo_help = build_parser()._subparsers._group_actions[0].choices["demo"].format_help()
    assert minutes(quick) in " ".join(demo_help.split())


@pytest.mark.parametrize("profile", ["full", "quick"])
def test_demo_results_beat_their_baselines(profile):
    """Each model the demo trains does better than a model that ignores its input, on held-out data."""
    run = demo(profile)
    lm, clf, s2s = run["lm"], run["classifier"], run["seq2seq"]
    assert lm["eval_loss"] < lm["baseline_loss"]
    assert clf["test_accuracy"] > clf["baseline_accuracy"] and clf["test_loss"] < clf["baseline_loss"]
    assert s2s["eval_loss"] < s2s["baseline_loss"]
    assert s2s["exact_match"] > s2s["baseline_exact_match"] and s2s["word_f1"] > s2s["baseline_word_f1"]


# ---------------------------------------------------------------------------------------------------------------------
# Cold starts: scripts/results/cold_SIZE.json, written by `scripts/bench.py --runtimes ... --cold`

COLD_SHAPES = {"base": "base (110M)", "tinyllama": "TinyLlama-1.1B shape"}


def cold_rows() -> dict[tuple[str, str], dict]:
    """(size, setting) -> its row."""
    rows = {}
    for size in COLD_SHAPES:
        for row in json.loads((RESULTS / f"cold_{size}.json").read_text())["cold"]:
            rows[size, row["setting"]] = row
    return rows


def test_cold_start_table_is_the_bench_results():
    """docs/fast-inference.md's table of new processes: every row of the results files, as measured; every hf_tfm step
    of the second process ran through the library the first process compiled."""
    rows = cold_rows()
    text = doc_page("fast-inference").read_text()
    for (size, setting), row in rows.items():
        assert "error" not in row, row
        compiled = setting.endswith("compiled")
        assert row["second_library_steps"] == (row["new"] - 1 if compiled else None), row
        keys = ("first_total_s", "first_longest_gap_s", "compile_s", "second_load_s", "second_first_token_s")
        cells = [f"{COLD_SHAPES[size]}, {setting}"]
        cells += ["" if row.get(key) is None else f"{row[key]:.2f}" for key in keys]
        cells += [f"{row['second_total_s']:.2f}", f"{row['second_warm_s']:.2f}"]
        line = "| " + " | ".join(cells) + " |"
        assert line in text, f"docs/fast-inference.md should have the row {line!r}"


def test_cold_start_prose_is_the_bench_results():
    rows = cold_rows()
    ours, theirs = rows["tinyllama", Q4], rows["tinyllama", "llama.cpp q4_0"]
    waits = [row["first_longest_gap_s"] for (_, setting), row in rows.items() if setting.startswith("hf_tfm")]
    compiles = [row["compile_s"] for row in rows.values() if "compile_s" in row]
    assert_states(
        "fast-inference",
        f"its 16 tokens at TinyLlama's shape {ours['second_total_s']:.2f} s after it starts at `q4`, where "
        f"llama.cpp's Q4_0 takes {theirs['second_total_s']:.2f} s",
        f"its longest wait between two tokens is {max(waits):.2f} s, while its step compiles beside it in "
        f"{min(compiles):.0f} to {max(compiles):.0f} s",
    )
    # "Most of that is Python importing": the process had loaded (imports and weights) before half of its time
    assert ours["second_load_s"] > ours["second_total_s"] / 2
