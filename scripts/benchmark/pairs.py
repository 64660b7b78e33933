"""The pair tasks: hf_tfm and the in-tree model on equal work, in one process, interleaved round by round.

Every round runs the two models back to back (A B, then B A in the next round, so neither always goes first); the
table reports medians. Extra rows: bf16 autocast over fp32 (``--bf16-autocast``), static-cache compiled decoding and
a compiled train step (``--compile``), hf_tfm against its own ``modeling.py`` at a git revision
(``--compare-modeling``), Mixtral's experts kernels, and flash-attention against sdpa on CUDA.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .measure import interleaved, peak_step_memory, timed
from .models import PAIR_TASKS, SHAPES, SIZES, Pair, build_pair, builds, n_params
from .report import fmt_row
from .steps import TRAIN_TASKS, make_step, matmul_throughput, task_tokens, train_flops

EXPERTS_KERNELS = ("eager", "batched_mm", "grouped_mm")
# batched_mm gathers each token's top-k expert weights (tokens x k x 3 x H x I floats: 2.9 GB per layer for the small
# train step), so it is timed where few tokens go through the experts at once: decoding.
KERNELS_BY_TASK = {"train": ("eager", "grouped_mm"), "prefill": ("eager", "grouped_mm"), "decode_b8": EXPERTS_KERNELS}


def run_pairs(args: argparse.Namespace, device: str) -> tuple[list[dict], list[dict]]:
    """Every pair's tasks at every size (the pair built once per size), each followed by its extra rows: the results
    and the extra rows."""
    results: list[dict] = []
    extra: list[dict] = []
    for size in args.sizes:
        args.cur_size = size
        for pair_name in args.pair_list:
            tasks = [t for t in PAIR_TASKS[pair_name] if t in args.task_list]
            if not tasks:
                continue
            if not builds(size, pair_name):
                print(f"[bench] {size}: no {pair_name} pair at this size (skipped)", file=sys.stderr, flush=True)
                continue
            pair = build_pair(pair_name, size, args.torch_dtype, args.attn, device)
            for task in tasks:
                time_task(pair, task, size, args, device, results, extra)
            extra.extend(pair_extras(pair, tasks, size, args, device, results))
            del pair
            gc.collect()
    return results, extra


def time_task(
    pair: Pair, task: str, size: str, args: argparse.Namespace, device: str, results: list[dict], extra: list[dict]
) -> None:
    """One task of the pair (and, with --bf16-autocast, a train task again under autocast against fp32)."""
    shp, vocab = SHAPES[size], SIZES[size]["vocab"]
    print(f"[bench] {size} {pair.name} {task} ...", file=sys.stderr, flush=True)
    r = run_pair_task(pair, task, shp, args, device, vocab)
    r["size"] = size
    r["params_ours"], r["params_theirs"] = n_params(pair.ours), n_params(pair.theirs)
    r["notes"] = pair.notes
    results.append(r)
    print(fmt_row(r), file=sys.stderr, flush=True)
    if args.bf16_autocast and task in TRAIN_TASKS and device == "cpu":
        rb = run_pair_task(pair, task, shp, args, device, vocab, torch.bfloat16, task + "_bf16_autocast", (task, None))
        results.append(rb)
        # fp32 timed in the same interleaved rounds
        extra.append(baseline_row(rb, size, f"{task}: bf16 autocast speedup over fp32", "speedup_over_fp32"))


def pair_extras(
    pair: Pair, tasks: list[str], size: str, args: argparse.Namespace, device: str, results: list[dict]
) -> list[dict]:
    """The extra rows the arguments ask for, of a pair whose tasks were just timed."""
    shp, vocab = SHAPES[size], SIZES[size]["vocab"]
    rows = []
    if args.compile and pair.kind == "causal" and "decode_b1" in tasks:
        print(f"[bench] {size} {pair.name} decode_b1_static (compile) ...", file=sys.stderr, flush=True)
        rc = run_pair_task(pair, "decode_b1_static", shp, args, device, vocab, baseline=("decode_b1", None))
        results.append(rc)
        what = (
            "decode_b1: static cache + compiled generate() speedup over eager dynamic cache "
            f"(compile warm-up {rc['ours']['warmup_s']:.0f} s / {rc['theirs']['warmup_s']:.0f} s)"
        )
        # eager dynamic-cache decode timed in the same interleaved rounds
        rows.append(baseline_row(rc, size, what, "speedup_over_eager_dynamic"))
    if args.compare_modeling and pair.kind == "causal":
        rows.extend(compare_modeling(pair, tasks, shp, args, vocab, size))
    if args.compile and pair.kind == "causal" and "train" in tasks:
        rows.append(compiled_train(pair, shp, args, device, vocab, size, results))
    if pair.name == "mixtral":
        rows.extend(experts_kernels(pair, tasks, shp, args, device, vocab, size))
    if device == "cuda" and pair.kind == "causal" and "train" in tasks:
        rows.extend(gpu_flash_vs_sdpa(pair.name, size, shp, args, device, vocab))
    return rows


def baseline_row(r: dict, size: str, what: str, key: str) -> dict:
    """The extra row of a result timed with a baseline in the same rounds: its speedup over the baseline, kept in
    each side under `key` too."""
    r["size"] = size
    for n in ("ours", "theirs"):
        r[n][key] = r[n]["speedup_over_baseline"]
    ours, theirs = f"{r['ours'][key]:.2f}x", f"{r['theirs'][key]:.2f}x"
    return {"size": size, "pair": r["pair"], "what": what, "ours": ours, "theirs": theirs}


def run_pair_task(
    pair: Pair,
    task: str,
    shp: dict,
    args: argparse.Namespace,
    device: str,
    vocab: int,
    autocast: torch.dtype | None = None,
    label: str | None = None,
    baseline: tuple[str, torch.dtype | None] | None = None,
) -> dict:
    """Time hf_tfm ("ours") and the in-tree model ("theirs") interleaved. `baseline` = (task, autocast) of a reference
    variant (eager fp32, eager dynamic cache) timed in the same rounds, for `speedup_over_baseline` on each side."""
    steps = {
        "ours": make_step(pair.ours, task, shp, vocab, device, autocast, args.padded),
        "theirs": make_step(pair.theirs, task, shp, vocab, device, autocast, args.padded),
    }
    if baseline is not None:
        steps["ours_baseline"] = make_step(pair.ours, baseline[0], shp, vocab, device, baseline[1], args.padded)
        steps["theirs_baseline"] = make_step(pair.theirs, baseline[0], shp, vocab, device, baseline[1], args.padded)
    warm_t = {n: timed(s) for n, s in steps.items()}  # warm-up (and compile, for the static-cache path)
    times = interleaved(steps, args.rounds)
    tokens = task_tokens(task, shp)
    res = {"pair": pair.name, "task": label or task, "theirs_name": pair.theirs_name, "tokens_per_step": tokens}
    for n in steps:
        med = statistics.median(times[n])
        res[n] = {"median_s": med, "times_s": times[n], "tokens_per_s": tokens / med, "warmup_s": warm_t[n]}
    if baseline is not None:
        for n in ("ours", "theirs"):
            res[n]["speedup_over_baseline"] = res[n + "_baseline"]["median_s"] / res[n]["median_s"]
        steps = {n: steps[n] for n in ("ours", "theirs")}
    # speedup of hf_tfm over the in-tree model (> 1: hf_tfm is faster)
    res["speedup"] = res["theirs"]["median_s"] / res["ours"]["median_s"]
    if not args.no_memory and task in (*TRAIN_TASKS, "prefill") and autocast is None:
        for n, s in steps.items():
            res[n]["peak_mem_bytes"] = peak_step_memory(s, device)
        res["mem_ratio"] = res["ours"]["peak_mem_bytes"] / max(res["theirs"]["peak_mem_bytes"], 1)
    if task in TRAIN_TASKS and autocast is None:
        add_flops(res, pair, shp, args, device)
    return res


def add_flops(res: dict, pair: Pair, shp: dict, args: argparse.Namespace, device: str) -> None:
    """A train step's FLOPs, and its achieved FLOP/s on each side as a fraction of torch.matmul's on the same GEMMs
    (and of the GPU's peak, for MFU)."""
    flops = train_flops(pair, shp)
    res["train_flops"] = flops
    if args.mm_tput.get((pair.name, args.cur_size)) is None:
        args.mm_tput[(pair.name, args.cur_size)] = matmul_throughput(pair, shp, args.torch_dtype, device)
    mm = args.mm_tput[(pair.name, args.cur_size)]
    res["matmul_flops_per_s"] = mm
    for n in ("ours", "theirs"):
        achieved = flops / res[n]["median_s"]
        res[n]["flops_per_s"] = achieved
        res[n]["mm_frac"] = achieved / mm
        if args.peak_flops:
            res[n]["mfu"] = achieved / args.peak_flops


def experts_kernels(
    pair: Pair, tasks: list[str], shp: dict, args: argparse.Namespace, device: str, vocab: int, size: str
) -> list[dict]:
    """hf_tfm's steps on each experts kernel of `KERNELS_BY_TASK`, interleaved round by round (medians, ms)."""
    rows = []
    model = pair.ours
    default = model.config._experts_implementation
    for task in [t for t in KERNELS_BY_TASK if t in tasks]:
        print(f"[bench] {size} {pair.name} {task} per experts kernel ...", file=sys.stderr, flush=True)
        inner = make_step(model, task, shp, vocab, device, None, args.padded)

        def on(kernel: str, inner=inner):
            def step():
                model.set_experts_implementation(kernel)
                inner()

            return step

        steps = {kernel: on(kernel) for kernel in KERNELS_BY_TASK[task]}
        for s in steps.values():
            s()
        times = interleaved(steps, args.rounds)
        medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        ranked = " / ".join(f"{k} {v:.1f}" for k, v in medians.items())
        rows.append(
            {
                "size": size,
                "pair": pair.name,
                "what": f"{task}: ms per step by experts kernel (hf_tfm)",
                "ours": ranked,
                "theirs": "-",
                "medians_ms": medians,
            }
        )
    model.set_experts_implementation(default)
    return rows


def modeling_at(rev: str):
    """hf_tfm's `modeling.py` and the modules it imports as they were at git revision `rev`, imported as a package of
    their own (`hf_tfm_at_<rev>`), for A/B timing against the working tree's."""
    import importlib
    import subprocess
    import tempfile

    repo = Path(__file__).resolve().parents[2]
    package = f"hf_tfm_at_{''.join(c if c.isalnum() else '_' for c in rev)}"
    root = tempfile.mkdtemp(prefix="hf-tfm-bench-")
    os.mkdir(os.path.join(root, package))
    # the modules a saved folder carries; revisions before checkpoint.py and distributed.py had the first two only
    for name in ("configuration.py", "modeling.py", "checkpoint.py", "distributed.py"):
        show = subprocess.run(["git", "show", f"{rev}:hf_tfm/{name}"], cwd=repo, capture_output=True, text=True)
        if show.returncode and name in ("checkpoint.py", "distributed.py"):
            continue
        if show.returncode:
            raise SystemExit(f"--compare-modeling {rev}: {show.stderr.strip()}")
        with open(os.path.join(root, package, name), "w") as f:
            f.write(show.stdout)
    open(os.path.join(root, package, "__init__.py"), "w").close()
    sys.path.insert(0, root)
    return importlib.import_module(f"{package}.modeling")


def compare_modeling(
    pair: Pair, tasks: list[str], shp: dict, args: argparse.Namespace, vocab: int, size: str
) -> list[dict]:
    """hf_tfm's decode steps against the same weights in `modeling.py` at `--compare-modeling REV`, interleaved; the
    greedy tokens must be identical (the comparison is of overhead, not of results)."""
    old_modeling = modeling_at(args.compare_modeling)
    old = old_modeling.TfmForCausalLM(old_modeling.TfmConfig.from_dict(pair.ours.config.to_dict()))
    old.load_state_dict(pair.ours.state_dict())
    old.generation_config = pair.ours.generation_config
    old.eval()
    rows = []
    for task in [t for t in ("decode_b1", "decode_b8") if t in tasks]:
        print(f"[bench] {size} {pair.name} {task}: hf_tfm vs modeling.py@{args.compare_modeling} ...", file=sys.stderr)
        batch = shp["decode_batches"][0 if task == "decode_b1" else 1]
        ids = torch.randint(3, vocab, (batch, shp["prompt"]), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": shp["new"]}
            if not torch.equal(pair.ours.generate(**kwargs), old.generate(**kwargs)):
                raise AssertionError(f"{task}: modeling.py@{args.compare_modeling} generates other tokens")
        steps = {
            "new": make_step(pair.ours, task, shp, vocab, "cpu", None),
            "old": make_step(old, task, shp, vocab, "cpu", None),
        }
        for step in steps.values():
            step()
        times = interleaved(steps, args.rounds)
        medians = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        rows.append(
            {
                "size": size,
                "pair": pair.name,
                "what": f"{task}: hf_tfm speedup over modeling.py@{args.compare_modeling} (identical tokens; "
                f"median {medians['old'] * 1e3:.1f} -> {medians['new'] * 1e3:.1f} ms, best "
                f"{best['old'] * 1e3:.1f} -> {best['new'] * 1e3:.1f} ms)",
                "ours": f"{medians['old'] / medians['new']:.3f}x",
                "theirs": "-",
                "times_s": times,
            }
        )
    return rows


def compiled_train(
    pair: Pair, shp: dict, args: argparse.Namespace, device: str, vocab: int, size: str, results: list[dict]
) -> dict:
    """torch.compile'd hf_tfm train step vs the eager one (same process; in-tree model left eager)."""
    print(f"[bench] {size} {pair.name} train (torch.compile) ...", file=sys.stderr, flush=True)
    eager = make_step(pair.ours, "train", shp, vocab, device, None)
    compiled_model = torch.compile(pair.ours)
    compiled = make_step(compiled_model, "train", shp, vocab, device, None)
    t0 = time.perf_counter()
    compiled()
    warm = time.perf_counter() - t0
    eager()
    times = interleaved({"eager": eager, "compiled": compiled}, args.rounds)
    speed = statistics.median(times["eager"]) / statistics.median(times["compiled"])
    results.append(
        {
            "size": size,
            "pair": pair.name,
            "task": "train_compiled",
            "theirs_name": "hf_tfm eager",
            "tokens_per_step": task_tokens("train", shp),
            "ours": {"median_s": statistics.median(times["compiled"]), "times_s": times["compiled"]},
            "theirs": {"median_s": statistics.median(times["eager"]), "times_s": times["eager"]},
            "note": "ours = hf_tfm torch.compile'd, theirs = hf_tfm eager",
            "speedup": speed,
            "compile_warmup_s": warm,
        }
    )
    for side in ("ours", "theirs"):
        results[-1][side]["tokens_per_s"] = task_tokens("train", shp) / results[-1][side]["median_s"]
    return {
        "size": size,
        "pair": pair.name,
        "what": f"train: torch.compile speedup over eager (hf_tfm only; compile warm-up {warm:.0f} s)",
        "ours": f"{speed:.2f}x",
        "theirs": "-",
    }


def gpu_flash_vs_sdpa(
    pair_name: str, size: str, shp: dict, args: argparse.Namespace, device: str, vocab: int
) -> list[dict]:
    """CUDA only (untested on the CPU development machine): hf_tfm train step with flash-attention vs sdpa."""
    rows = []
    try:
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            return [
                {"size": size, "pair": pair_name, "what": "flash_attention_2", "ours": "not installed", "theirs": "-"}
            ]
        fa = build_pair(pair_name, size, args.torch_dtype, "flash_attention_2", device).ours
        sd = build_pair(pair_name, size, args.torch_dtype, "sdpa", device).ours
        steps = {
            "flash": make_step(fa, "train", shp, vocab, device, None),
            "sdpa": make_step(sd, "train", shp, vocab, device, None),
        }
        for s in steps.values():
            s()
        times = interleaved(steps, args.rounds)
        speed = statistics.median(times["sdpa"]) / statistics.median(times["flash"])
        rows.append(
            {
                "size": size,
                "pair": pair_name,
                "what": "train: flash_attention_2 speedup over sdpa (hf_tfm)",
                "ours": f"{speed:.2f}x",
                "theirs": "-",
            }
        )
    except Exception as err:  # report, don't crash the whole GPU run
        rows.append(
            {"size": size, "pair": pair_name, "what": "flash_attention_2", "ours": f"error: {err}", "theirs": "-"}
        )
    return rows
