"""`scripts/gpu_check.py` (the one command for a CUDA machine): its `--dry-run` runs every section at tiny sizes on the
CPU and writes the report a GPU run would; without CUDA and without `--dry-run` it refuses in one line.

No GPU has run it yet: these tests are what keeps its code paths working until one does.
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def load_gpu_check():
    return load_script(SCRIPT, "hf_tfm_gpu_check")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow  # ~25 s with a warm inductor cache, ~100 s cold: it compiles train steps, decoding and flex
def test_dry_run_reports_every_section(tmp_path):
    out_path = tmp_path / "results" / "gpu_check.json"  # the folder does not exist yet: the script makes it
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out_path.read_text())
    gpu_check = load_gpu_check()
    assert report["dry_run"] is True and report["machine"]["device"] == "cpu"
    assert list(report["sections"]) == list(gpu_check.SECTIONS)
    assert report["problems"] == []
    assert all(section["status"] == "ok" for section in report["sections"].values())

    # training: 4 variants, each with the losses of every step on both sides, close, and timed
    variants = report["sections"]["training"]["variants"]
    assert [(v["compiled"], v["checkpointing"]) for v in variants] == [(c, k) for c in (0, 1) for k in (0, 1)]
    for v in variants:
        assert v["losses_close"] is True and v["max_loss_rel_diff"] <= gpu_check.LOSS_RTOL
        assert all(len(v["losses"][side]) == 10 for side in ("ours", "theirs"))
        assert positive(v["speedup"]) and positive(v["flops_per_step"])
        for side in ("ours", "theirs"):
            for key in ("median_s", "tokens_per_s", "mfu", "peak_step_bytes", "first_step_s"):
                assert positive(v[side][key]), (v["variant"], side, key)

    # attention: every backend matches eager in every case (flash is not installed here), ALiBi on flash is refused
    cases = report["sections"]["attention"]["cases"]
    assert set(cases) == {"padded", "sliding_window", "alibi"}
    for name, case in cases.items():
        for backend in ("eager", "sdpa", "flex_attention"):
            rec = case["backends"][backend]
            assert rec["close"] is True and positive(rec["median_ms"]), (name, backend)
    assert cases["alibi"]["backends"]["flash_attention_2"]["status"] == "refused"

    # decoding: both batch sizes, hf_tfm's tokens agree with the in-tree model's (bf16 ties aside), eager and
    # compiled, and compiled with eager
    decoding = report["sections"]["decoding"]["cases"]
    assert [(c["model"], c["batch"]) for c in decoding] == [(m, b) for b in (1, 4) for m in ("llama", "bart")]
    for case in decoding:
        for mode in ("eager", "compiled"):
            assert case[mode]["agree"] is True, (case["model"], case["batch"], mode, case[mode]["ties"])
            assert positive(case[mode]["ours"]["ms_per_token"]) and positive(case[mode]["theirs"]["ms_per_token"])
        assert case["compiled"]["repeatable"] is True
        assert all(agreement["agree"] for agreement in case["compiled_vs_eager"].values())

    # the encoder classifier and the MoE model: finite loss and gradients, and timed against the in-tree models
    models = report["sections"]["encoder_moe"]["models"]
    assert models["classifier"]["is_causal"] is False and models["classifier"]["in_tree"].startswith("Bert")
    assert models["moe"]["num_experts"] > 1 and models["moe"]["in_tree"] == "MixtralForCausalLM"
    for model in models.values():
        assert model["finite"] is True and model["first_loss_close"] is True and positive(model["speedup"])

    assert report["all_verdicts_true"] is True and len(report["verdicts"]) >= 30
    assert "| decoding | BartForConditionalGeneration b4 compiled: ms/token |" in result.stdout
    assert "verdicts: " in result.stdout


def test_refuses_without_cuda_in_one_line(tmp_path):
    out_path = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # no GPU, even on a machine that has one
    )
    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "gpu_check.py: CUDA is not available on this machine; run it on the GPU machine, or pass --dry-run for the "
        "tiny CPU run."
    ]
    assert not out_path.exists()


def test_a_failing_section_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    gpu_check = load_gpu_check()

    def broken(args, device, deadline):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(gpu_check, "section_attention", broken)
    threads = torch.get_num_threads()
    try:
        args = ["--dry-run", "--sections", "attention,encoder_moe", "--rounds", "1", "--out", str(tmp_path / "r.json")]
        report = gpu_check.main(args)
    finally:
        torch.set_num_threads(threads)
    attention, encoder_moe = report["sections"]["attention"], report["sections"]["encoder_moe"]
    assert attention["status"] == "error" and attention["error"] == "RuntimeError: broken on purpose"
    assert report["problems"] == [".attention: RuntimeError: broken on purpose"]
    assert "Traceback" in attention["traceback"]
    assert encoder_moe["status"] == "ok" and report["verdicts"]["encoder_moe.moe.finite"] is True
    assert json.loads((tmp_path / "r.json").read_text())["sections"]["attention"]["status"] == "error"
    assert "| attention | (whole section) |" in report["table"]


def test_time_budget_skips_cases_and_cuts_off_a_stuck_section():
    gpu_check = load_gpu_check()
    spent = gpu_check.Deadline(0.0)
    time.sleep(0.01)
    assert gpu_check.attempt({}, spent, lambda: {"ran": True}, "case") == {"skipped": "time budget"}
    record = gpu_check.attempt({}, gpu_check.Deadline(60.0), lambda: 1 / 0, "case")
    assert record["error"] == "ZeroDivisionError: division by zero" and "wall_s" in record
    with pytest.raises(TimeoutError, match="hard limit"), gpu_check.hard_limit(1):
        time.sleep(5)


def test_out_of_memory_halves_the_batch():
    """The GPU-only retry: a step that runs out of CUDA memory is tried again at half the batch."""
    gpu_check = load_gpu_check()
    tried = []

    def run_at(batch: int) -> dict:
        tried.append(batch)
        if batch > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return {"batch": batch}

    assert gpu_check.halving(run_at, 8, [], "cpu") == {"batch": 2, "out_of_memory_at_batch": [8, 4]}
    assert tried == [8, 4, 2]
    with pytest.raises(torch.OutOfMemoryError):
        gpu_check.halving(lambda batch: run_at(batch * 8), 2, [], "cpu")
