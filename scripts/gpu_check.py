#!/usr/bin/env python
"""One command for a CUDA machine: hf_tfm against transformers' in-tree models in bf16, in four independent sections.

- ``training``: a train step (forward, backward, AdamW) of ``TfmForCausalLM`` and of in-tree ``LlamaForCausalLM`` with
  the same weights (``benchmark.build_pair``: the Llama built from its config, hf_tfm from ``from_hf`` of it), at
  a shape that fills the GPU (24 layers of width 2048, sequence 2048, batch 8 by default; the batch halves after an
  out-of-memory error). Four variants: eager and compiled, activation checkpointing off and on. In each, both models
  start from the same weights and take ``--steps`` steps on the same batches, interleaved (A B, then B A): the losses
  must agree within bf16 tolerance at every step. Reported: step time ratio, tokens/s, MFU against the chip's dense
  bf16 peak, peak memory.
- ``attention``: ``TfmForCausalLM`` on each attention backend (eager, sdpa, flex_attention, and flash_attention_2 when
  ``flash_attn`` imports) gives eager's logits within bf16 tolerance for a left-padded batch, sliding-window layers
  and ALiBi, with each backend's forward time. ALiBi on flash is refused by hf_tfm (flash kernels take no additive
  bias): the check is that it is refused.
- ``encoder_moe``: one train step of ``TfmForSequenceClassification`` (an encoder, ``is_causal=False``, converted
  from ``BertForSequenceClassification``) and of an MoE ``TfmForCausalLM`` (``num_experts``, converted from
  ``MixtralForCausalLM``): finite loss and gradients, and the step time beside the in-tree model's.
- ``decoding``: greedy ``generate()`` eager (dynamic cache) and compiled (static cache, ``compile_config``; CUDA graphs
  on the GPU) at batch 1 and 32, hf_tfm against in-tree Llama, and ``TfmForConditionalGeneration`` against in-tree
  BART: ms per generated token, and hf_tfm's tokens equal to the in-tree model's in each mode, and compiled to eager,
  up to bf16 ties broken the other way (see ``greedy_agreement``).

A section that fails is recorded with its error and traceback, and the next one runs; so is a case within a section.
The run has a time budget (``--budget-s``): each section gets a share of what is left when it starts, skips the cases
that would start after it ("skipped": "time budget"), and is cut off (SIGALRM) well past it. The JSON report is
rewritten after every section, so a run that is killed keeps what it measured.

``--dry-run`` runs every path at tiny sizes on the CPU, in bf16 and with torch.compile (inductor) too; the test suite
runs it (tests/test_gpu_check.py). Without it and without CUDA the script refuses in one line.

Usage: ``python scripts/gpu_check.py --out scripts/results/gpu_check.json``. See ``--help``.
"""

# Only the standard library and torch are imported here. The benchmark package, transformers and hf_tfm are imported
# inside the functions that use them, after `main` has checked for CUDA: their imports print warnings (torchao's,
# where it is installed) that would bury the one-line refusal.
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmark package sits next to this script

if TYPE_CHECKING:
    from benchmark import Pair
    from transformers import CompileConfig
    from transformers.generation.utils import GenerateOutput

DEFAULT_OUT = os.path.join("scripts", "results", "gpu_check.json")
DTYPE = torch.bfloat16
# Each section's share of the time left when it starts; they run in this order. Training has the most work (4
# variants x 2 models x steps, 2 compiles). Decoding, whose 8 compiles take what they take, goes last: it gets the
# rest.
SECTIONS = {"training": 0.45, "attention": 0.12, "encoder_moe": 0.10, "decoding": 0.33}
# Shapes: the GPU run (the training shape fills an H200; the other sections use `aux_layers` layers of the same width
# so their compiles fit the budget) and the dry run (the benchmark's `tiny` widths).
SHAPES = {
    "gpu": {
        "layers": 24,
        "hidden": 2048,
        "heads": 16,
        "vocab": 32000,
        "seq": 2048,
        "batch": 8,
        "aux_layers": 4,
        "prompt": 128,
        "new": 128,
        "decode_batches": "1,32",
        "rounds": 5,
        "budget_s": 320.0,  # with the start-up and a last case that overruns: under 6 minutes
    },
    "dry_run": {
        "layers": 2,
        "hidden": 64,
        "heads": 4,
        "vocab": 512,
        "seq": 64,
        "batch": 2,
        "aux_layers": 2,
        "prompt": 8,
        "new": 8,
        "decode_batches": "1,4",
        "rounds": 2,
        "budget_s": 600.0,  # not meant to bind: the dry run's job is to run every path
    },
}
# benchmark.in_tree_model gives every model max_position_embeddings=512: BERT's and BART's learned positions end there
# (RoPE models read it only for dynamic RoPE scaling, which these configs do not use).
LEARNED_POSITIONS = 512
# The loss is an fp32 mean over thousands of tokens of bf16 logits: their roundings (2^-8 relative) average out, and
# the two models' losses differ by ~1e-5 relative (the dry run), drifting a little over the steps. 1e-3 leaves room
# for that. It is a weak check on its own: near initialisation any model of the same size has a loss near ln(vocab),
# so the first step's logits are compared too, token by token (LOGITS_RTOL).
LOSS_RTOL = 1e-3
# Logits of two models or attention backends that sum in other orders: over several bf16 layers they differ by some
# ulps of their largest value; a real bug (a mask, a position or a weight wrong) differs by their scale.
LOGITS_RTOL = 5e-2
H200_PEAK = 989e12  # dense bf16 FLOP/s; the dry run's nominal peak, so that its MFU path runs too


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"the JSON report (default {DEFAULT_OUT})")
    p.add_argument("--dry-run", action="store_true", help="every path at tiny sizes on the CPU (what the tests run)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)}")
    gpu = SHAPES["gpu"]
    shape = p.add_argument_group("shapes (defaults: the GPU run's; --dry-run's are tiny)")
    shape.add_argument("--layers", type=int, help=f"training model's layers ({gpu['layers']})")
    shape.add_argument("--hidden", type=int, help=f"hidden size of every model ({gpu['hidden']})")
    shape.add_argument("--heads", type=int, help=f"attention heads ({gpu['heads']})")
    shape.add_argument("--vocab", type=int, help=f"vocabulary ({gpu['vocab']})")
    shape.add_argument("--seq", type=int, help=f"training sequence length ({gpu['seq']})")
    shape.add_argument(
        "--batch", type=int, help=f"training batch; halved after an out-of-memory error ({gpu['batch']})"
    )
    shape.add_argument(
        "--aux-layers",
        type=int,
        help=f"layers of the attention, decoding and encoder/MoE models ({gpu['aux_layers']})",
    )
    shape.add_argument("--prompt", type=int, help=f"decoding prompt (or seq2seq source) length ({gpu['prompt']})")
    shape.add_argument("--new", type=int, help=f"tokens generated per generate() call ({gpu['new']})")
    shape.add_argument("--decode-batches", help=f"comma list of decoding batch sizes ({gpu['decode_batches']})")
    p.add_argument("--steps", type=int, default=10, help="train steps per model and variant (losses compared)")
    p.add_argument("--rounds", type=int, help=f"timing rounds of the other sections ({gpu['rounds']})")
    p.add_argument("--budget-s", type=float, help=f"overall time budget in seconds ({gpu['budget_s']:.0f})")
    p.add_argument("--peak-tflops", type=float, help="the chip's dense bf16 peak for MFU (default: by GPU name)")
    args = p.parse_args(argv)
    for key, value in SHAPES["dry_run" if args.dry_run else "gpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.decode_batch_list = [int(b) for b in args.decode_batches.split(",")]
    args.section_list = [s for s in args.sections.split(",") if s]
    if bad := set(args.section_list) - set(SECTIONS):
        p.error(f"unknown sections {sorted(bad)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check.py: CUDA is not available on this machine; run it on the GPU machine, or pass --dry-run for "
            "the tiny CPU run."
        )
    return run(args, "cpu" if args.dry_run else "cuda", sys.argv[1:] if argv is None else argv)


# ---------------------------------------------------------------------------------------------------------------------
# Running: the budget, sections and cases that fail on their own, the report


class Deadline:
    """A section's soft end: its cases check it before they start (a running compile cannot be stopped softly)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() > self.end


@contextlib.contextmanager
def hard_limit(seconds: float) -> Iterator[None]:
    """SIGALRM raises TimeoutError in the main thread after `seconds`: a section stuck far past its share (a compile
    that does not end) is cut off and recorded, and the sections after it still run."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"cut off after {seconds:.0f} s (the section's hard limit)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def failure(err: BaseException) -> dict:
    """An error as the report records it: one line to read and the traceback to debug from (call inside `except`)."""
    lines = str(err).strip().splitlines()
    return {"error": f"{type(err).__name__}: {lines[0][:500] if lines else ''}", "traceback": traceback.format_exc()}


def attempt(record: dict, deadline: Deadline, fn: Callable[[], dict], label: str) -> dict:
    """One case of a section: its result merged into `record`, or its error, or "skipped" once the section's time is
    up."""
    if deadline.expired():
        record["skipped"] = "time budget"
        log(f"  {label}: skipped (time budget)")
        return record
    t0 = time.perf_counter()
    try:
        record.update(fn())
    except Exception as err:  # recorded; the section's other cases still run
        record.update(failure(err))
    record["wall_s"] = time.perf_counter() - t0
    log(f"  {label}: {record.get('error', 'done')} ({record['wall_s']:.1f} s)")
    return record


def problems(node: object, path: str = "") -> list[str]:
    """Every error and skipped case anywhere in a report, by its path: what the verdicts cannot say."""
    if isinstance(node, dict):
        found = [f"{path}: {node[k]}" for k in ("error", "skipped") if k in node]
        return found + [p for k, v in node.items() if k != "traceback" for p in problems(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in problems(v, f"{path}[{i}]")]
    return []


def log(message: str) -> None:
    print(f"[gpu_check] {message}", flush=True)


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def release(device: str) -> None:
    """After a section: its compiled graphs (and their CUDA graph pools) and cached blocks go back."""
    torch._dynamo.reset()
    free_memory(device)


def write_report(path: str, report: dict) -> None:
    """Write `path` whole or not at all (a killed run leaves the previous section's report, never half a file)."""
    from hf_tfm.checkpoint import staged_file  # after `main`'s CUDA check, as every hf_tfm import here

    with staged_file(path) as tmp, open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)


def run(args: argparse.Namespace, device: str, argv: list[str]) -> dict:
    import benchmark
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    if device == "cpu":
        # The dry run's figures mean nothing; one thread keeps its steps from stalling in OpenMP barriers when the
        # cores are shared (2 threads on 2 busy cores made tiny steps 100x slower).
        torch.set_num_threads(1)
    # Every compiled model and batch size recompiles transformers' shared forward wrappers, whose code objects dynamo
    # counts together (8 recompiles by default, then it silently runs them eagerly).
    torch._dynamo.config.recompile_limit = 64
    args.peak_flops, args.peak_source = peak_flops(args, device)
    report = {
        "machine": benchmark.machine_info(device),
        "command": " ".join(["scripts/gpu_check.py", *argv]),
        "dry_run": args.dry_run,
        "dtype": str(DTYPE),
        "args": {k: v for k, v in vars(args).items() if k not in ("decode_batch_list", "section_list")},
        "sections": {},
        "verdicts": {},
    }
    report["machine"]["cuda"] = torch.version.cuda
    if device == "cuda":
        report["machine"]["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    start = time.monotonic()
    budget_end = start + args.budget_s
    functions = {
        "training": section_training,
        "attention": section_attention,
        "encoder_moe": section_encoder_moe,
        "decoding": section_decoding,
    }
    for i, name in enumerate(args.section_list):
        left = budget_end - time.monotonic()
        weights = [SECTIONS[s] for s in args.section_list[i:]]
        share = max(left, 0.0) * weights[0] / sum(weights)
        log(f"{name}: start, {share:.0f} s of the {max(left, 0):.0f} s left")
        t0 = time.perf_counter()
        try:
            # Cut off at 1.5x its share, or 20 s after the whole budget is spent, whichever is sooner.
            with hard_limit(min(1.5 * share, left + 20)):
                section = functions[name](args, device, Deadline(share))
            section["status"] = "ok"
        except Exception as err:
            section = {"status": "error", **failure(err)}
        section["wall_s"] = time.perf_counter() - t0
        release(device)
        report["sections"][name] = section
        report["verdicts"].update({f"{name}.{k}": v for k, v in section.get("verdicts", {}).items()})
        report["wall_s"] = time.monotonic() - start
        write_report(args.out, report)
        log(f"{name}: {section['status']} in {section['wall_s']:.1f} s ({section.get('error', 'no error')})")
    report["all_verdicts_true"] = bool(report["verdicts"]) and all(report["verdicts"].values())
    report["problems"] = problems(report["sections"])
    try:
        report["table"] = summary_table(report)
    except Exception as err:  # a table that cannot be drawn must not cost the report
        report["table"] = f"(no table: {failure(err)['error']})"
    report["wall_s"] = time.monotonic() - start
    write_report(args.out, report)
    print(report["table"], flush=True)
    log(f"{report['wall_s']:.1f} s in all; report in {args.out}")
    return report


def peak_flops(args: argparse.Namespace, device: str) -> tuple[float | None, str]:
    import benchmark

    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if device == "cuda":
        name = torch.cuda.get_device_name()
        peak = benchmark.gpu_peak_bf16_flops(name)
        return peak, f"{name} dense bf16" if peak else f"{name}: unknown peak, no MFU"
    return H200_PEAK, "H200 dense bf16, nominal (dry run on a CPU: the MFU figure is meaningless)"


# ---------------------------------------------------------------------------------------------------------------------
# Models and steps


def build_pair(name: str, layers: int, args: argparse.Namespace, device: str) -> Pair:
    """The benchmark's pair `name` (the in-tree model and `from_hf` of it, same weights, sdpa) at this run's width,
    built on `device` (initialising 1B parameters on the CPU first would take most of a section's time)."""
    import benchmark

    # bench's pairs are keyed by size name: this script's sizes are registered under names of their own.
    size = f"gpu_check_{layers}x{args.hidden}"
    benchmark.SIZES[size] = {"hidden": args.hidden, "layers": layers, "heads": args.heads, "vocab": args.vocab}
    benchmark.SHAPES[size] = {"batch": args.batch, "seq": args.seq, "prompt": args.prompt, "new": args.new}
    torch.manual_seed(0)
    with torch.device(device):
        return benchmark.build_pair(name, size, DTYPE, "sdpa", device)


def optimizer(model: nn.Module, device: str) -> torch.optim.Optimizer:
    # fused: one kernel per step on CUDA, as a GPU run would use; foreach on the CPU, as the benchmark's steps
    fused = {"fused": True} if device == "cuda" else {"foreach": True}
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)


def train_step(
    model: nn.Module,
    device: str,
    batches: list[dict],
    losses: list[float],
    grads: dict | None = None,
    logits: list | None = None,
) -> Callable[[], None]:
    """A zero-argument train step over `batches` in turn, appending each loss; `grads` (if given) gets the first
    step's gradient check: every parameter has a gradient and all are finite; `logits` (if given) the first step's."""
    opt = optimizer(model, device)

    def step() -> None:
        out = model(**batches[len(losses) % len(batches)])
        if logits is not None and not logits:
            logits.append(out.logits.detach())
        loss = out.loss
        del out  # its logits (a GB at the GPU shape) are freed during backward, as with `model(...).loss`
        loss.backward()
        if grads is not None and not grads:
            params = [p for p in model.parameters() if p.requires_grad]
            with_grad = [p.grad for p in params if p.grad is not None]
            grads["with_grad"] = f"{len(with_grad)}/{len(params)}"
            grads["finite"] = len(with_grad) == len(params) and all(bool(g.isfinite().all()) for g in with_grad)
            grads["norm"] = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in with_grad])))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the device: the step's time is all of its work

    return step


def logits_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """max |a - b| against max |b|, and whether that is within LOGITS_RTOL; one batch row at a time (fp32 copies of a
    whole batch of logits would take gigabytes)."""
    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))
    scale = max(y.float().abs().max().item() for y in b)
    return {"max_abs_diff": diff, "scale": scale, "close": diff <= LOGITS_RTOL * scale}


def random_ids(batch: int, length: int, vocab: int, device: str, seed: int) -> torch.Tensor:
    """Ids above the special ones (pad 0, bos 1, eos 2), from a CPU generator so every device draws the same."""
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def set_checkpointing(model: nn.Module, on: bool) -> None:
    # transformers 5.2x renamed gradient checkpointing to activation checkpointing (the old name warns); 5.16 has the
    # old one only. Non-reentrant on every release (the older default was reentrant), as torch recommends.
    if on:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    else:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each transformer block in place, as torchtitan does: the blocks share their code, so dynamo
    traces one block's forward and backward for all of them instead of one graph of every layer unrolled, which would
    not compile within the budget at 24 layers. Embeddings, the head and the loss stay eager."""
    for block in model.model.layers:
        block.compile()


def halving(run_at: Callable[[int], dict], batch: int, models: list[nn.Module], device: str) -> dict:
    """`run_at(batch)`, halving the batch after each CUDA out-of-memory error; the result names the batches that did
    not fit. The retry happens outside the `except` block, so the failed step's activations are freed first."""
    too_big = []
    while True:
        try:
            result = run_at(batch)
            break
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
            too_big.append(batch)
        for model in models:
            model.zero_grad(set_to_none=True)  # a backward cut short leaves gradients behind
        free_memory(device)
        batch //= 2
        log(f"  out of memory at batch {too_big[-1]}: retrying at {batch}")
    if too_big:
        result["out_of_memory_at_batch"] = too_big
    return result


def timed_sides(result: dict, times: dict[str, list[float]], tokens: int, skip_first: bool = False) -> None:
    """Median time and tokens/s of each side into `result`, and in-tree time / hf_tfm time (> 1: hf_tfm faster)."""
    for side, ts in times.items():
        ts = ts[1:] if skip_first and len(ts) > 1 else ts
        result.setdefault(side, {}).update({"median_s": statistics.median(ts), "times_s": ts})
        result[side]["tokens_per_s"] = tokens / result[side]["median_s"]
    result["speedup"] = result["theirs"]["median_s"] / result["ours"]["median_s"]


def losses_agree(result: dict, losses: dict[str, list[float]], steps: int) -> bool:
    """Per-step losses of both sides into `result`, and whether they agree within LOSS_RTOL at every step."""
    ours, theirs = losses["ours"][:steps], losses["theirs"][:steps]
    diffs = [abs(a - b) / max(abs(b), 1e-6) for a, b in zip(ours, theirs, strict=True)]
    finite = all(math.isfinite(x) for x in ours + theirs)
    result["losses"] = {"ours": ours, "theirs": theirs}
    result["max_loss_rel_diff"] = max(diffs) if finite else None
    result["losses_close"] = finite and max(diffs) <= LOSS_RTOL
    return result["losses_close"]


# ---------------------------------------------------------------------------------------------------------------------
# Sections


def section_training(args: argparse.Namespace, device: str, deadline: Deadline) -> dict:
    """hf_tfm and in-tree Llama train steps, interleaved, in 4 variants; see the module docstring."""
    import benchmark

    log(f"  building the Llama pair ({args.layers} x {args.hidden}) ...")
    pair = build_pair("llama", args.layers, args, device)
    sides = {"ours": pair.ours, "theirs": pair.theirs}
    initial = {side: {k: v.detach().clone() for k, v in m.state_dict().items()} for side, m in sides.items()}
    out = {
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab},
        "in_tree": pair.theirs_name,
        "params": benchmark.n_params(pair.ours),
        "peak_flops": args.peak_flops,
        "peak_flops_source": args.peak_source,
        "variants": [],
        "verdicts": {},
    }
    batch = args.batch

    def variant(compiled: bool, checkpointing: bool, batch: int) -> dict:
        batches = [
            {"input_ids": ids, "labels": ids, "use_cache": False}  # no KV cache: Llama would build one in training
            for ids in (random_ids(batch, args.seq, args.vocab, device, seed) for seed in range(args.steps))
        ]
        losses = {side: [] for side in sides}
        logits = {side: [] for side in sides}
        steps = {}
        for side, model in sides.items():
            model.load_state_dict(initial[side])  # every variant starts from the same weights and a fresh AdamW
            set_checkpointing(model, checkpointing)
            model.train()
            steps[side] = train_step(model, device, batches, losses[side], logits=logits[side])
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = benchmark.interleaved(steps, args.steps)
        first_logits = logits_diff(logits["ours"].pop(), logits["theirs"].pop())
        shp = {"batch": batch, "seq": args.seq}
        # Model FLOPs per step (benchmark.train_flops): 6 x tokens x N, N the matmul parameters (every linear and the
        # LM head; not the embedding lookup), plus attention's two GEMMs (scores and values) at 6 x 2 x batch x heads x
        # head_dim x layers per (query, key) pair, over seq^2 / 2 pairs (causal). MFU = that / step time / peak.
        flops = benchmark.train_flops(pair, shp)
        result = {"batch": batch, "seq": args.seq, "tokens_per_step": batch * args.seq, "flops_per_step": flops}
        result["device_peak_bytes"] = torch.cuda.max_memory_allocated() if device == "cuda" else None
        timed_sides(result, times, batch * args.seq, skip_first=True)  # the first step compiles / warms up
        for side in sides:
            r = result[side]
            r["first_step_s"] = times[side][0]
            r["flops_per_s"] = flops / r["median_s"]
            r["mfu"] = r["flops_per_s"] / args.peak_flops if args.peak_flops else None
            # above what was live at the step's start (weights, AdamW state): activations, gradients, temporaries
            r["peak_step_bytes"] = benchmark.peak_step_memory(steps[side], device)
        losses_agree(result, losses, args.steps)
        result["first_step_logits"] = first_logits
        return result

    for compiled in (False, True):  # eager first: compiling is in place and has no undo
        if compiled and not deadline.expired():
            for model in sides.values():
                compile_blocks(model)
        for checkpointing in (False, True):
            name = f"{'compiled' if compiled else 'eager'}, checkpointing {'on' if checkpointing else 'off'}"
            record = {"variant": name, "compiled": compiled, "checkpointing": checkpointing}

            def measure(c: bool = compiled, k: bool = checkpointing, b: int = batch) -> dict:
                return halving(lambda size: variant(c, k, size), b, list(sides.values()), device)

            attempt(record, deadline, measure, f"training: {name}")
            batch = record.get("batch", batch)  # a batch that did not fit is not tried again
            out["variants"].append(record)
            if "losses_close" in record:
                out["verdicts"][f"losses_close[{name}]"] = record["losses_close"]
                out["verdicts"][f"first_step_logits_close[{name}]"] = record["first_step_logits"]["close"]
    out["dynamo_unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return out


ATTENTION_BACKENDS = ["eager", "sdpa", "flex_attention", "flash_attention_2"]


def section_attention(args: argparse.Namespace, device: str, deadline: Deadline) -> dict:
    """Each attention backend against eager on the same bf16 model, per case; see the module docstring."""
    try:
        import flash_attn  # noqa: F401

        no_flash = None
    except Exception as err:  # ImportError, or a build that does not match this torch
        no_flash = f"flash_attn does not import: {type(err).__name__}: {err}"
    batch = max(2, args.batch // 2)
    cases = {
        "padded": ({}, True),  # RoPE, full attention, a left-padded batch
        "sliding_window": ({"sliding_window": max(4, args.seq // 4)}, False),
        "alibi": ({"position_embedding_type": "alibi"}, False),
    }
    out = {"batch": batch, "seq": args.seq, "layers": args.aux_layers, "cases": {}, "verdicts": {}}
    out["flash_attn"] = no_flash or "imports"
    for name, (overrides, padded) in cases.items():
        case = lambda o=overrides, p=padded: attention_case(args, device, batch, o, p, no_flash)  # noqa: E731
        record = attempt({}, deadline, case, f"attention: {name}")
        out["cases"][name] = record
        for backend, rec in record.get("backends", {}).items():
            if "close" in rec:
                out["verdicts"][f"close[{name}/{backend}]"] = rec["close"]
            if rec.get("expected") == "refused":
                out["verdicts"][f"refused[{name}/{backend}]"] = rec["status"] == "refused"
    return out


def attention_case(
    args: argparse.Namespace, device: str, batch: int, overrides: dict, padded: bool, no_flash: str | None
) -> dict:
    """One case: the same bf16 model on each backend, its logits against eager's (padding positions aside) and its
    forward's median time; ALiBi on a flash kernel must be refused."""
    import benchmark

    from hf_tfm import TfmConfig, TfmForCausalLM

    kv_heads = args.heads // 4 if args.heads % 4 == 0 else args.heads  # grouped-query attention, as most models
    config = TfmConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.aux_layers,
        num_attention_heads=args.heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=args.seq,
        pad_token_id=0,
        **overrides,
    )
    torch.manual_seed(0)
    with torch.device(device):
        reference = TfmForCausalLM(config).to(DTYPE).eval()
    ids = random_ids(batch, args.seq, args.vocab, device, seed=0)
    mask = torch.ones_like(ids)
    if padded:  # row r starts with r/(2 batch) of the sequence as padding: row 0 none, the last almost half
        for r in range(batch):
            mask[r, : r * args.seq // (2 * batch)] = 0
        ids = ids.masked_fill(mask == 0, 0)
    real = mask.bool()  # padding positions' outputs are undefined (they see no key): zeroed before comparing

    def forward(model: nn.Module) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with torch.inference_mode():
                logits = model(input_ids=ids, attention_mask=mask).logits
            benchmark.sync(device)
            return logits

        return call

    results, steps, expected = {}, {}, None
    for backend in ATTENTION_BACKENDS:
        results[backend], model, logits = backend_logits(reference, backend, forward, no_flash)
        if logits is None:
            continue
        got = logits.masked_fill(~real[..., None], 0)
        if expected is None:
            expected = got  # eager, the first backend
        results[backend].update(status="ran", **logits_diff(got, expected))
        steps[backend] = forward(model)
    times = benchmark.interleaved(steps, args.rounds)
    for backend, ts in times.items():
        results[backend]["median_ms"] = statistics.median(ts) * 1e3
        results[backend]["speedup_vs_eager"] = statistics.median(times["eager"]) / statistics.median(ts)
    return {"backends": results}


def backend_logits(
    reference: nn.Module,
    backend: str,
    forward: Callable[[nn.Module], Callable[[], torch.Tensor]],
    no_flash: str | None,
) -> tuple[dict, nn.Module | None, torch.Tensor | None]:
    """`reference` (or a copy) on `backend`, and its logits; without logits, the record says why (not installed, an
    error, or ALiBi on flash: refused, as expected, or ran, which it must not)."""
    alibi_on_flash = backend.startswith("flash") and reference.config.position_embedding_type == "alibi"
    if no_flash and backend.startswith("flash") and not alibi_on_flash:
        return {"status": "not installed"}, None, None
    try:
        model = reference if backend == "eager" else copy.deepcopy(reference)
        if alibi_on_flash:
            # hf_tfm refuses in forward, before any kernel runs, so the refusal is checked with or without flash_attn
            # installed: the config is set directly (set_attn_implementation would stop at a missing package first).
            model.config._attn_implementation = backend
        else:
            model.set_attn_implementation(backend)
        logits = forward(model)()
    except Exception as err:
        if alibi_on_flash and isinstance(err, ValueError) and "alibi" in str(err):
            return {"status": "refused", "expected": "refused", "message": str(err)}, None, None
        return {"status": "error", **failure(err), **({"expected": "refused"} if alibi_on_flash else {})}, None, None
    if alibi_on_flash:
        return {"status": "ran", "expected": "refused"}, None, None
    return {}, model, logits


def section_encoder_moe(args: argparse.Namespace, device: str, deadline: Deadline) -> dict:
    """One bf16 train step of the encoder classifier and of the MoE model, then their speed against the in-tree
    models'; see the module docstring."""
    import benchmark

    out = {"models": {}, "verdicts": {}}
    seq_cls = min(args.seq, LEARNED_POSITIONS)
    shapes = {
        "classifier": ("bert", seq_cls, max(1, args.batch * args.seq // seq_cls)),  # the training run's tokens
        "moe": ("mixtral", args.seq, args.batch),
    }

    def one(family: str, seq: int, batch: int) -> dict:
        pair = build_pair(family, args.aux_layers, args, device)
        sides = {"ours": pair.ours, "theirs": pair.theirs}

        def at(batch: int) -> dict:
            ids = random_ids(batch, seq, args.vocab, device, seed=0)
            if family == "bert":
                labels = torch.randint(0, benchmark.NUM_LABELS, (batch,), generator=torch.Generator().manual_seed(1))
                data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels.to(device)}
            else:
                data = {"input_ids": ids, "labels": ids, "use_cache": False}
            result = {"batch": batch, "seq": seq, "grads": {}}
            losses, steps = {}, {}
            for side, model in sides.items():
                model.train()
                losses[side] = []
                result["grads"][side] = {}
                steps[side] = train_step(model, device, [data], losses[side], result["grads"][side])
            for step in steps.values():  # the checked step, also the warm-up
                step()
            ours, theirs = losses["ours"][0], losses["theirs"][0]
            result["first_loss"] = {"ours": ours, "theirs": theirs}
            result["finite"] = all(
                math.isfinite(x) and result["grads"][side]["finite"] for side, x in result["first_loss"].items()
            )
            result["first_loss_close"] = abs(ours - theirs) <= LOSS_RTOL * abs(theirs)
            timed_sides(result, benchmark.interleaved(steps, args.rounds), batch * seq)
            return result

        result = halving(at, batch, list(sides.values()), device)
        result.update(
            hf_tfm=type(pair.ours).__name__,
            in_tree=pair.theirs_name,
            is_causal=pair.ours.config.is_causal,
            num_experts=pair.ours.config.num_experts,
            params=benchmark.n_params(pair.ours),
        )
        return result

    for name, (family, seq, batch) in shapes.items():
        record = attempt({}, deadline, lambda f=family, s=seq, b=batch: one(f, s, b), f"encoder_moe: {name}")
        out["models"][name] = record
        release(device)
        if "finite" in record:
            out["verdicts"][f"{name}.finite"] = record["finite"]
            out["verdicts"][f"{name}.first_loss_close"] = record["first_loss_close"]
    if "is_causal" in out["models"].get("classifier", {}):
        out["verdicts"]["classifier.is_encoder"] = out["models"]["classifier"]["is_causal"] is False
    if "num_experts" in out["models"].get("moe", {}):
        out["verdicts"]["moe.has_experts"] = bool(out["models"]["moe"]["num_experts"])
    return out


def generate(
    model: nn.Module, ids: torch.Tensor, new: int, compile_config: CompileConfig | None, logits: bool = False
) -> torch.Tensor | GenerateOutput:
    """Greedy generate() of exactly `new` tokens (benchmark.build_pair removed EOS); with `compile_config`: a static
    cache and compiled decode steps; with `logits`: the output with each step's logits, else the tokens."""
    extra = {} if compile_config is None else {"cache_implementation": "static", "compile_config": compile_config}
    if logits:
        extra |= {"output_logits": True, "return_dict_in_generate": True}
    return model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **extra
    )


def greedy_agreement(a: GenerateOutput, b: GenerateOutput) -> dict:
    """Whether two greedy generate() outputs (with their logits) agree: the same tokens, or, in each row that parts,
    a bf16 tie broken two ways at the first differing step.

    Two models that round differently pick different tokens where the top two logits are within a rounding of each
    other, and from there continue two different texts. So at that step (same context on both sides until then) the
    two logits must be close (LOGITS_RTOL), and each side's pick must lead the other's by no more than twice the
    largest difference between the two sides' logits.
    """
    start = a.sequences.shape[1] - len(a.logits)  # the first generated position (after the prompt, or decoder start)
    differ = (a.sequences != b.sequences).any(dim=0).nonzero()
    result = {"tokens_equal": not len(differ), "first_differing_index": int(differ[0]) if len(differ) else None}
    result["ties"] = []
    for row in (a.sequences != b.sequences).any(dim=1).nonzero().flatten().tolist():
        t = int((a.sequences[row] != b.sequences[row]).nonzero()[0]) - start
        la, lb = a.logits[t][row].float(), b.logits[t][row].float()
        x, y = int(a.sequences[row, start + t]), int(b.sequences[row, start + t])
        tie = {"row": row, "step": t, **logits_diff(la[None], lb[None])}
        tie["gaps"] = [(la[x] - la[y]).item(), (lb[y] - lb[x]).item()]  # each side's lead of its pick, >= 0
        tie["tie"] = tie["close"] and max(tie["gaps"]) <= 2 * tie["max_abs_diff"]
        result["ties"].append(tie)
    result["agree"] = all(tie["tie"] for tie in result["ties"])
    return result


def section_decoding(args: argparse.Namespace, device: str, deadline: Deadline) -> dict:
    """Eager and compiled greedy decoding, hf_tfm against in-tree Llama and BART; see the module docstring."""
    out = {"prompt": args.prompt, "new": args.new, "layers": args.aux_layers, "cases": [], "verdicts": {}}
    pairs = {}
    for family in ("llama", "bart"):
        try:
            pairs[family] = build_pair(family, args.aux_layers, args, device)
        except Exception as err:
            out["cases"].append({"model": family, **failure(err)})
            continue
        pairs[family].ours.eval()  # built in training mode, as `_from_config` leaves a model
        pairs[family].theirs.eval()
    # Batch 1 of both models first: if time runs out, the larger batches' speed is lost rather than a model's check.
    for batch in args.decode_batch_list:
        for family, pair in pairs.items():
            label = f"{pair.theirs_name} b{batch}"
            record = attempt(
                {"model": family, "in_tree": pair.theirs_name, "batch": batch},
                deadline,
                lambda p=pair, b=batch: decode_case(args, device, p, b),
                f"decoding: {label}",
            )
            out["cases"].append(record)
            for mode in ("eager", "compiled"):
                if mode in record:
                    out["verdicts"][f"agree[{family} b{batch} {mode}]"] = record[mode]["agree"]
            if "compiled" in record:
                out["verdicts"][f"repeatable[{family} b{batch} compiled]"] = record["compiled"]["repeatable"]
                for side, agreement in record["compiled_vs_eager"].items():
                    out["verdicts"][f"compiled_agrees_with_eager[{family} b{batch} {side}]"] = agreement["agree"]
    return out


def decode_case(args: argparse.Namespace, device: str, pair: Pair, batch: int) -> dict:
    """One batch size: both models' greedy generate(), eager and compiled, timed interleaved; whether they agree,
    whether each call repeats the first, and each model compiled against itself eager."""
    import benchmark
    from transformers import CompileConfig

    ids = random_ids(batch, args.prompt, args.vocab, device, seed=batch)
    # One CompileConfig per model, reused: generate() recompiles when it is handed a different one. CUDA graphs
    # (reduce-overhead) on the GPU; the CPU has none, and compiles there only with the private flag.
    configs = {}
    for side in ("ours", "theirs"):
        configs[side] = CompileConfig(fullgraph=True, dynamic=False)
        if device != "cuda":
            configs[side].mode = "default"
            configs[side]._compile_all_devices = True
    models = {"ours": pair.ours, "theirs": pair.theirs}
    runs = {f"{side}_{mode}": (side, mode) for side in models for mode in ("eager", "compiled")}
    first, tokens, steps = {}, {}, {}
    result = {"batch": batch, "warmup_s": {}}
    for key, (side, mode) in runs.items():  # the first call compiles (and records the CUDA graphs)
        config = configs[side] if mode == "compiled" else None
        t0 = time.perf_counter()
        first[key] = generate(models[side], ids, args.new, config, logits=True)
        benchmark.sync(device)
        result["warmup_s"][key] = time.perf_counter() - t0

        def step(model=models[side], key=key, config=config):
            tokens[key] = generate(model, ids, args.new, config)
            benchmark.sync(device)

        steps[key] = step
    times = benchmark.interleaved(steps, args.rounds)
    for mode in ("eager", "compiled"):
        result[mode] = {
            side: {"ms_per_token": statistics.median(times[f"{side}_{mode}"]) / args.new * 1e3} for side in models
        }
        result[mode]["speedup"] = result[mode]["theirs"]["ms_per_token"] / result[mode]["ours"]["ms_per_token"]
        result[mode] |= greedy_agreement(first[f"ours_{mode}"], first[f"theirs_{mode}"])
        # every call gives the tokens of the first (a static cache and CUDA graphs are replayed call after call)
        result[mode]["repeatable"] = all(
            bool(torch.equal(tokens[f"{side}_{mode}"], first[f"{side}_{mode}"].sequences)) for side in models
        )
    # each model compiled against itself eager: the static cache and compiled steps compute what eager does
    result["compiled_vs_eager"] = {
        side: greedy_agreement(first[f"{side}_compiled"], first[f"{side}_eager"]) for side in models
    }
    result["ms_per_token_note"] = f"whole generate() call / {args.new} new tokens (prefill of {args.prompt} included)"
    return result


# ---------------------------------------------------------------------------------------------------------------------
# The printed table


def number(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summary_table(report: dict) -> str:
    """The headline figures, one row per case: hf_tfm, in-tree, their ratio (> 1: hf_tfm faster) and the verdict."""
    sections = report["sections"]
    rows = [
        row("(whole section)", verdict=f"error: {section['error']}", section=name)
        for name, section in sections.items()
        if section.get("status") == "error"
    ]
    rows += training_rows(sections.get("training", {}).get("variants", []))
    rows += attention_rows(sections.get("attention", {}).get("cases", {}))
    rows += encoder_moe_rows(sections.get("encoder_moe", {}).get("models", {}))
    rows += decoding_rows(sections.get("decoding", {}).get("cases", []))
    head = "| section | case | hf_tfm | in-tree | in-tree / hf_tfm time | verdict |\n|---|---|---:|---:|---:|---|"
    verdicts = report["verdicts"]
    failed = [k for k, v in verdicts.items() if not v]
    tail = f"\n\nverdicts: {len(verdicts) - len(failed)}/{len(verdicts)} true" + (
        f"; false: {failed}" if failed else ""
    )
    tail += f"\nerrors and skipped cases: {len(report['problems'])}"
    return head + "\n" + "\n".join(rows) + tail


def row(case: str, ours: str = "-", theirs: str = "-", ratio: str = "-", verdict: str = "-", *, section: str) -> str:
    return f"| {section} | {case} | {ours} | {theirs} | {ratio} | {verdict} |"


def problem(record: dict) -> str | None:
    """A case's verdict when it did not run: skipped (the time budget) or its error."""
    if "skipped" in record:
        return f"skipped: {record['skipped']}"
    return f"error: {record['error']}" if "error" in record else None


def training_rows(variants: list[dict]) -> list[str]:
    rows = []
    for v in variants:
        case = f"{v['variant']}, batch {v.get('batch', '?')}"
        if bad := problem(v):
            rows.append(row(case, verdict=bad, section="training"))
            continue
        o, t = v["ours"], v["theirs"]
        mfu = f", MFU {o['mfu']:.2f}/{t['mfu']:.2f}" if o["mfu"] is not None else ""
        rows.append(
            row(
                f"{case}: ms/step, tok/s{mfu}, peak GiB",
                f"{o['median_s'] * 1e3:.1f}, {o['tokens_per_s']:.0f}, {o['peak_step_bytes'] / 2**30:.2f}",
                f"{t['median_s'] * 1e3:.1f}, {t['tokens_per_s']:.0f}, {t['peak_step_bytes'] / 2**30:.2f}",
                f"{v['speedup']:.2f}x",
                f"losses close: {v['losses_close']} (max rel diff {number(v['max_loss_rel_diff'], '.1e')}), "
                f"first step's logits close: {v['first_step_logits']['close']}",
                section="training",
            )
        )
    return rows


def attention_rows(cases: dict[str, dict]) -> list[str]:
    rows = []
    for case, record in cases.items():
        if bad := problem(record):
            rows.append(row(case, verdict=bad, section="attention"))
            continue
        for backend, rec in record["backends"].items():
            if "median_ms" in rec:
                verdict = f"close: {rec['close']} (max diff {rec['max_abs_diff']:.1e} of {rec['scale']:.1e})"
                rows.append(
                    row(
                        f"{case}/{backend}: forward ms",
                        f"{rec['median_ms']:.2f}",
                        verdict=verdict,
                        section="attention",
                    )
                )
            else:
                verdict = rec["status"] + (f" (expected {rec['expected']})" if "expected" in rec else "")
                verdict += f": {rec['error']}" if "error" in rec else ""
                rows.append(row(f"{case}/{backend}", verdict=verdict, section="attention"))
    return rows


def encoder_moe_rows(models: dict[str, dict]) -> list[str]:
    rows = []
    for name, record in models.items():
        if bad := problem(record):
            rows.append(row(name, verdict=bad, section="encoder_moe"))
            continue
        o, t = record["ours"], record["theirs"]
        rows.append(
            row(
                f"{name} ({record['in_tree']}, batch {record['batch']} x {record['seq']}): ms/step",
                f"{o['median_s'] * 1e3:.1f}",
                f"{t['median_s'] * 1e3:.1f}",
                f"{record['speedup']:.2f}x",
                f"finite loss and grads: {record['finite']}",
                section="encoder_moe",
            )
        )
    return rows


def decoding_rows(cases: list[dict]) -> list[str]:
    rows = []
    for record in cases:
        case = f"{record.get('in_tree', record['model'])} b{record.get('batch', '?')}"
        if bad := problem(record):
            rows.append(row(case, verdict=bad, section="decoding"))
            continue
        for mode in ("eager", "compiled"):
            r = record[mode]
            rows.append(
                row(
                    f"{case} {mode}: ms/token",
                    f"{r['ours']['ms_per_token']:.2f}",
                    f"{r['theirs']['ms_per_token']:.2f}",
                    f"{r['speedup']:.2f}x",
                    f"tokens equal: {r['tokens_equal']}, agree (bf16 ties aside): {r['agree']}",
                    section="decoding",
                )
            )
    return rows


if __name__ == "__main__":
    main()
