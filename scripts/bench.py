#!/usr/bin/env python
"""Benchmark hf_tfm against transformers' in-tree models on equal work, in one process, interleaved round by round.

Pairs: each in-tree model is built from its config (random weights, no dropout), and the hf_tfm side is
``hf_tfm.from_hf(in_tree_model)``: an equivalent config, the same weights (copied), dtype and attention backend
(sdpa), so the two compute the same function.

- ``llama``: ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU, no biases, untied head)
- ``gpt2``: ``GPT2LMHeadModel`` (learned positions, LayerNorm, gelu_new MLP, biases, tied head)
- ``bert``: ``BertForSequenceClassification`` (post-norm, learned positions, token types, embedding LayerNorm, pooler)
- ``modernbert``: ``ModernBertForSequenceClassification`` (pre-norm, RoPE, bias-free LayerNorm, GeGLU, embedding norm,
  dense+act+norm head), all layers global attention (``layer_types``), as ``train_flops`` counts
- ``bart``: ``BartForConditionalGeneration`` (encoder-decoder: post-norm, learned positions, embedding LayerNorm, GELU
  MLP, biases, tied head; as many decoder as encoder layers)
- ``mixtral``: ``MixtralForCausalLM``, the llama pair's shape with a mixture of 8 SwiGLU experts in every layer, top-2,
  each half the llama FFN's width (the same active FFN FLOPs per token); ``train_flops`` counts the active parameters
  (router + 2 experts per token). Both sides run transformers' default experts kernel; extra rows time hf_tfm's
  train step and prefill on the eager and grouped_mm kernels, and batch-8 decoding on those and batched_mm, each in
  interleaved rounds

Every matmul has the same shape on both sides, so FLOPs match. The one layout difference (GPT-2's Conv1D ``x @ W`` and
fused ``c_attn`` where hf_tfm has ``nn.Linear`` and separate q/k/v) is listed in the JSON ``notes``, with BERT's pooler
and ModernBERT's head, which both sides run and ``train_flops`` leaves out (one row per sequence).

Tasks: ``train`` (causal LM, forward+backward+AdamW step), ``prefill`` (no-grad forward that fills a KV cache, last
logits only, as generate() does), ``decode_b1``/``decode_b8`` (``generate()`` greedy, prompt 32, 64 new tokens, batch
1 and 8, no EOS stop), ``cls_train`` (encoder sequence-classification train step), ``s2s_train`` (seq2seq train step:
source batch x seq, target a quarter as long) and ``s2s_generate_b1``/``s2s_generate_b8`` (greedy ``generate()`` from a
source of half the sequence length, 64 new tokens). Every round runs the two models
back to back (A B, then B A in the next round, so neither always goes first); the table reports medians.

Peak memory (CPU): bytes allocated by torch during one step above what was live when it began, from
``torch.profiler`` memory events (``profile_memory=True``: cumulative sum of the allocation/free events, maximum), on
one extra untimed step. On CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation at the start of the step.

Matmul throughput: ``torch.matmul`` timed in the same run on the model's own linear-layer GEMM shapes (forward
``X @ W.T``, and the two backward GEMMs ``dY @ W`` and ``dY.T @ X``), weighted by FLOPs. The train step's achieved
FLOP/s (6 x tokens x matmul parameters + causal attention, see ``train_flops``) divided by that is the reported
``mm_frac``.

Decode settings (``--decode-settings all`` or a comma list, instead of the pair tasks): the llama pair saved, then
both sides loaded back through each weight setting of ``DECODE_SETTINGS`` (fp32, bf16 weights, and each quantization
backend's transformers config), greedy ``generate()`` at batch 1 and 8. The ms per decode step is timed inside one
generate() of ``new`` tokens, from the prefill's token to the last one (a streamer's stamps), over ``new - 1``. The
bytes of weights one step streams count every parameter and buffer but the embedding tables (one row each per token),
in their quantized form with their scales. Their rate per step, divided by this machine's streaming bandwidth
(``stream_bandwidth``: an fp32 GEMV over ``BANDWIDTH_MIB``, measured in the same run), is the bandwidth fraction. A
setting that fails to load or run here is reported with its error.

Charts (``--charts DIR``): PNGs of the run, ``speedup.png`` (in-tree time / hf_tfm time per pair and task) and, for a
decode-settings run, ``decode_settings.png`` (ms per decode step and fraction of the streaming bandwidth per setting);
``--charts DIR --from-json bench.json`` draws them from a saved ``--json`` output without running anything.

Usage: ``python scripts/bench.py --size small --rounds 5 --json bench.json``. See ``--help``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    ModernBertConfig,
    ModernBertForSequenceClassification,
)

from hf_tfm import from_hf
from hf_tfm.training import cpu_sample, free_cores

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runtime_worker import StepClock  # the one clock both the bench and its worker use

# ---------------------------------------------------------------------------------------------------------------------
# Sizes and task shapes

SIZES = {
    # hidden, layers, heads, vocab
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 512},
    "small": {"hidden": 256, "layers": 4, "heads": 4, "vocab": 8192},
    "base": {"hidden": 768, "layers": 12, "heads": 12, "vocab": 16384},
}
SHAPES = {
    # train/prefill batch x seq; decode prompt / new tokens
    "tiny": {"batch": 2, "seq": 32, "prompt": 8, "new": 4, "decode_batches": (1, 2)},
    "small": {"batch": 8, "seq": 256, "prompt": 32, "new": 64, "decode_batches": (1, 8)},
    "base": {"batch": 8, "seq": 256, "prompt": 32, "new": 64, "decode_batches": (1, 8)},
}
ALL_TASKS = (
    "train",
    "prefill",
    "decode_b1",
    "decode_b8",
    "cls_train",
    "s2s_train",
    "s2s_generate_b1",
    "s2s_generate_b8",
)
PAIR_TASKS = {
    "llama": ("train", "prefill", "decode_b1", "decode_b8"),
    "gpt2": ("train", "prefill", "decode_b1", "decode_b8"),
    "bert": ("cls_train",),
    "modernbert": ("cls_train",),
    "bart": ("s2s_train", "s2s_generate_b1", "s2s_generate_b8"),
    "mixtral": ("train", "prefill", "decode_b1", "decode_b8"),
}
# MiB of fp32 weights in the streaming-bandwidth GEMV: well beyond the caches (the development machine's L3 holds
# 480 MiB), except for the test's tiny size
BANDWIDTH_MIB = {"tiny": 16, "small": 2048, "base": 2048}
TRAIN_TASKS = ("train", "cls_train", "s2s_train")
CAUSAL_PAIRS = ("llama", "gpt2", "mixtral")
NUM_LABELS = 2
NUM_EXPERTS, TOP_K = 8, 2
EXPERTS_KERNELS = ("eager", "batched_mm", "grouped_mm")
# batched_mm gathers each token's top-k expert weights (tokens x k x 3 x H x I floats: 2.9 GB per layer for the small
# train step), so it is timed where few tokens go through the experts at once: decoding.
KERNELS_BY_TASK = {"train": ("eager", "grouped_mm"), "prefill": ("eager", "grouped_mm"), "decode_b8": EXPERTS_KERNELS}


def glu_intermediate(hidden: int) -> int:
    return 64 * ((8 * hidden // 3 + 63) // 64)


# ---------------------------------------------------------------------------------------------------------------------
# Model pairs


@dataclass
class Pair:
    name: str
    ours: nn.Module
    theirs: nn.Module
    theirs_name: str
    kind: str  # "causal", "encoder" or "seq2seq"
    # (in, out) of every matmul weight, per token of the step's sequence; seq2seq: (in, out, rows per step)
    linears: list[tuple[int, ...]] = field(default_factory=list)
    attn: dict = field(default_factory=dict)  # layers, heads, head_dim, causal
    notes: str = ""


def s2s_shapes(shp: dict) -> tuple[int, int]:
    """(source, target) lengths of the seq2seq train step."""
    return shp["seq"], max(2, shp["seq"] // 4)


def in_tree_model(
    name: str, size: str, dtype: torch.dtype, attn: str, shp: dict
) -> tuple[nn.Module, list[tuple[int, ...]]]:
    """The in-tree model of pair `name` (random weights, no dropout) and the (in, out) shape of each of its matmuls."""
    s = SIZES[size]
    h, n_layers, heads, vocab = s["hidden"], s["layers"], s["heads"], s["vocab"]
    dims = {"vocab_size": vocab, "hidden_size": h, "num_hidden_layers": n_layers, "num_attention_heads": heads}
    dims["max_position_embeddings"] = 512
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    glu, mlp = glu_intermediate(h), 4 * h
    if name == "llama":
        cls, inter = LlamaForCausalLM, glu
        cfg = LlamaConfig(**dims, **ids, intermediate_size=inter, rms_norm_eps=1e-6, tie_word_embeddings=False)
    elif name == "gpt2":
        cls, inter = GPT2LMHeadModel, mlp
        dims = {"vocab_size": vocab, "n_embd": h, "n_layer": n_layers, "n_head": heads, "n_positions": 512}
        no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        cfg = GPT2Config(**dims, **ids, **no_dropout, n_inner=inter, activation_function="gelu_new")
    elif name == "bert":
        cls, inter = BertForSequenceClassification, mlp
        no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
        cfg = BertConfig(**dims, **no_dropout, intermediate_size=inter, num_labels=NUM_LABELS, pad_token_id=0)
    elif name == "bart":
        cls, inter = BartForConditionalGeneration, mlp
        sides = {
            f"{side}_{k}": v
            for side in ("encoder", "decoder")
            for k, v in (("layers", n_layers), ("attention_heads", heads), ("ffn_dim", inter))
        }
        no_dropout = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
        cfg = BartConfig(vocab_size=vocab, d_model=h, max_position_embeddings=512, **sides, **no_dropout, **ids)
        cfg.decoder_start_token_id = 1
        src, tgt = shp["batch"] * s2s_shapes(shp)[0], shp["batch"] * s2s_shapes(shp)[1]
        encoder = [(h, h, src)] * 4 + [(h, inter, src), (inter, h, src)]
        # decoder: self-attention and FFN on the target; cross-attention q/o on the target, k/v on the source
        decoder = (
            [(h, h, tgt)] * 4
            + [(h, h, tgt), (h, h, src), (h, h, src), (h, h, tgt)]
            + [(h, inter, tgt), (inter, h, tgt)]
        )
        model = cls._from_config(cfg, attn_implementation=attn, dtype=dtype)
        return model, (encoder + decoder) * n_layers + [(h, vocab, tgt)]
    elif name == "modernbert":
        cls, inter = ModernBertForSequenceClassification, glu
        # All layers global (the default alternates with sliding-window layers), as train_flops counts.
        kwargs = dict(**dims, **ids, cls_token_id=1, sep_token_id=2, intermediate_size=inter, num_labels=NUM_LABELS)
        try:
            cfg = ModernBertConfig(**kwargs, layer_types=["full_attention"] * n_layers)
        except StrictDataclassError:  # transformers < 5.2x rejects all-global layers at init; set them after it
            cfg = ModernBertConfig(**kwargs)
            cfg.layer_types = ["full_attention"] * n_layers
    elif name == "mixtral":
        cls, inter = MixtralForCausalLM, glu // TOP_K
        moe = {"num_local_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K, "num_key_value_heads": heads}
        cfg = MixtralConfig(
            **dims, **ids, **moe, intermediate_size=inter, rms_norm_eps=1e-6, tie_word_embeddings=False
        )
    else:
        raise ValueError(name)
    glu_ffn = name in ("llama", "modernbert", "mixtral")  # gate and up, then down
    ffn = [(h, inter), (h, inter), (inter, h)] if glu_ffn else [(h, inter), (inter, h)]
    if name == "mixtral":  # per token: the router, then top-k experts (GLU: gate, up, down each)
        ffn = [(h, NUM_EXPERTS)] + ffn * TOP_K
    head = [(h, vocab)] if name in CAUSAL_PAIRS else []
    return cls._from_config(cfg, attn_implementation=attn, dtype=dtype), ([(h, h)] * 4 + ffn) * n_layers + head


NOTES = {
    "gpt2": "GPT-2 uses Conv1D (x @ W) and a fused c_attn where hf_tfm uses nn.Linear (x @ W.T) and separate q/k/v "
    "projections: same FLOPs.",
    "bert": "BERT's pooler (hidden x hidden + tanh on the [CLS] row) is hf_tfm's classifier dense: both sides run it; "
    "not counted in train_flops (negligible).",
    "modernbert": "ModernBERT: all layers global attention (layer_types), so attention work matches train_flops; its "
    "head's dense+act+norm on the pooled row runs on both sides (not counted in train_flops, negligible).",
    "mixtral": f"Mixtral: {NUM_EXPERTS} experts, top-{TOP_K}, each half the llama FFN's width; train_flops counts the "
    "active parameters (router + experts each token uses), tokens per expert vary with the routing. Both sides run "
    "transformers' default experts kernel (grouped_mm).",
}


def build_pair(name: str, size: str, dtype: torch.dtype, attn: str, device: str) -> Pair:
    """The in-tree model and `from_hf` of it: equivalent config, same weights, same dtype and attention backend."""
    theirs, linears = in_tree_model(name, size, dtype, attn, SHAPES[size])
    ours = from_hf(theirs)
    kind = "causal" if name in CAUSAL_PAIRS else "seq2seq" if name == "bart" else "encoder"
    pair = Pair(name, ours, theirs, type(theirs).__name__, kind, linears, notes=NOTES.get(name, ""))
    s = SIZES[size]
    pair.attn = {
        "layers": s["layers"],
        "heads": s["heads"],
        "head_dim": s["hidden"] // s["heads"],
        "causal": kind == "causal",
    }
    for model in (pair.ours, pair.theirs):
        model.to(device)
        if pair.kind in ("causal", "seq2seq"):  # decode exactly `new` tokens: no EOS stop, same processors for both
            gc_ = model.generation_config
            gc_.eos_token_id = None
            gc_.pad_token_id = 0
            gc_.do_sample = False
            gc_.forced_eos_token_id = gc_.forced_bos_token_id = None
    return pair


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# Steps: each returns a zero-arg callable that does one unit of work (synchronised)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_step(model: nn.Module, task: str, shp: dict, vocab: int, device: str, autocast: torch.dtype | None):
    g = torch.Generator().manual_seed(0)
    ac = (
        (lambda: torch.autocast(device_type=device, dtype=autocast))
        if autocast is not None
        else contextlib.nullcontext
    )
    if task in TRAIN_TASKS:
        ids = torch.randint(3, vocab, (shp["batch"], shp["seq"]), generator=g).to(device)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        if task == "train":
            kwargs = {"input_ids": ids, "labels": ids}
        elif task == "s2s_train":
            target = torch.randint(3, vocab, (shp["batch"], s2s_shapes(shp)[1]), generator=g).to(device)
            kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": target}
        else:
            labels = torch.randint(0, NUM_LABELS, (shp["batch"],), generator=g).to(device)
            kwargs = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}

        def step():
            with ac():
                loss = model(**kwargs).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)

        return step
    model.eval()
    if task == "prefill":
        ids = torch.randint(3, vocab, (shp["batch"], shp["seq"]), generator=g).to(device)

        def step():
            with torch.inference_mode(), ac():
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
            sync(device)

        return step
    if task.startswith(("decode", "s2s_generate")):
        batch = shp["decode_batches"][0 if "_b1" in task else 1]
        seq2seq = task.startswith("s2s")
        length = shp["seq"] // 2 if seq2seq else shp["prompt"]  # a source to read, or a prompt to continue
        ids = torch.randint(3, vocab, (batch, length), generator=g).to(device)
        expected = 1 + shp["new"] if seq2seq else shp["prompt"] + shp["new"]  # seq2seq: decoder start + new
        mask = torch.ones_like(ids)
        extra = {}
        if task.endswith("_static"):
            from transformers import CompileConfig

            cc = CompileConfig(fullgraph=True, mode="default", dynamic=False)
            cc._compile_all_devices = True  # private flag: generate() only auto-compiles on CUDA/XPU otherwise
            extra = {"cache_implementation": "static", "compile_config": cc}

        def step():
            with torch.inference_mode(), ac():
                out = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=shp["new"], do_sample=False, **extra
                )
            assert out.shape[1] == expected, out.shape
            sync(device)

        return step
    raise ValueError(task)


def task_tokens(task: str, shp: dict) -> int:
    """Tokens processed per step (decode and generate: generated tokens; seq2seq training: source + target)."""
    if task.startswith(("decode", "s2s_generate")):
        return shp["decode_batches"][0 if "_b1" in task else 1] * shp["new"]
    if task == "s2s_train":
        return shp["batch"] * sum(s2s_shapes(shp))
    return shp["batch"] * shp["seq"]


def peak_step_memory(step, device: str) -> int:
    """Peak bytes allocated during one step above what was live at its start (see the module docstring)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs and matmul throughput


def train_flops(pair: Pair, shp: dict) -> float:
    """Training FLOPs per step: 6 x rows x (matmul params) + attention scores/values (causal counts half).

    Seq2seq: encoder self-attention over the source, causal decoder self-attention over the target, and
    cross-attention of every target token over the whole source.
    """
    tokens = shp["batch"] * shp["seq"]
    linear = 6 * sum(i * o * (shape[0] if shape else tokens) for i, o, *shape in pair.linears)
    a = pair.attn
    per_pair = 6 * 2 * shp["batch"] * a["heads"] * a["head_dim"] * a["layers"]  # per (query, key) pair
    if pair.kind == "seq2seq":
        src, tgt = s2s_shapes(shp)
        return float(linear + per_pair * (src**2 + tgt**2 / 2 + tgt * src))
    return float(linear + per_pair * shp["seq"] ** 2 / (2 if a["causal"] else 1))


def matmul_throughput(pair: Pair, shp: dict, dtype: torch.dtype, device: str, reps: int = 3) -> float:
    """FLOP/s of torch.matmul on the model's own GEMMs (forward and both backward GEMMs of each distinct linear)."""
    counts: dict[tuple[int, int, int], int] = {}
    for i, o, *rows in pair.linears:
        shape = (i, o, rows[0] if rows else shp["batch"] * shp["seq"])
        counts[shape] = counts.get(shape, 0) + 1
    total_flops = total_time = 0.0
    for (i, o, m), count in counts.items():
        x = torch.randn(m, i, dtype=dtype, device=device)
        w = torch.randn(o, i, dtype=dtype, device=device)
        dy = torch.randn(m, o, dtype=dtype, device=device)
        wt = w.t()
        dyt = dy.t()
        gemms = [lambda x=x, wt=wt: x @ wt, lambda dy=dy, w=w: dy @ w, lambda dyt=dyt, x=x: dyt @ x]
        for fn in gemms:
            fn()  # warm
            times = []
            for _ in range(reps):
                sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                times.append(time.perf_counter() - t0)
            total_time += min(times) * count
            total_flops += 2.0 * m * i * o * count
    return total_flops / total_time


# ---------------------------------------------------------------------------------------------------------------------
# Running


def interleaved(steps: dict[str, callable], rounds: int) -> dict[str, list[float]]:
    """Run the steps round by round, alternating which one goes first (A B, B A, ...)."""
    names = list(steps)
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            t0 = time.perf_counter()
            steps[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def run_pair_task(
    pair: Pair, task: str, shp: dict, args, device: str, vocab: int, autocast=None, label=None, baseline=None
):
    """Time hf_tfm ("ours") and the in-tree model ("theirs") interleaved. `baseline` = (task, autocast) of a reference
    variant (eager fp32, eager dynamic cache) timed in the same rounds, for `speedup_over_baseline` on each side."""
    label = label or task
    steps = {
        "ours": make_step(pair.ours, task, shp, vocab, device, autocast),
        "theirs": make_step(pair.theirs, task, shp, vocab, device, autocast),
    }
    if baseline is not None:
        steps["ours_baseline"] = make_step(pair.ours, baseline[0], shp, vocab, device, baseline[1])
        steps["theirs_baseline"] = make_step(pair.theirs, baseline[0], shp, vocab, device, baseline[1])
    warm_t = {}
    for n, s in steps.items():  # warm-up (and compile, for the static-cache path)
        t0 = time.perf_counter()
        s()
        warm_t[n] = time.perf_counter() - t0
    times = interleaved(steps, args.rounds)
    tokens = task_tokens(task, shp)
    res = {"pair": pair.name, "task": label, "theirs_name": pair.theirs_name, "tokens_per_step": tokens}
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
        flops = train_flops(pair, shp)
        res["train_flops"] = flops
        if args.mm_tput.get((pair.name, args.cur_size)) is None:
            args.mm_tput[(pair.name, args.cur_size)] = matmul_throughput(pair, shp, args.torch_dtype, device)
        mm = args.mm_tput[(pair.name, args.cur_size)]
        res["matmul_flops_per_s"] = mm
        for n in steps:
            achieved = flops / res[n]["median_s"]
            res[n]["flops_per_s"] = achieved
            res[n]["mm_frac"] = achieved / mm
            if args.peak_flops:
                res[n]["mfu"] = achieved / args.peak_flops
    return res


def fmt_row(r: dict) -> str:
    o, t = r["ours"], r["theirs"]

    def ms(x):
        return f"{x * 1e3:.1f}"

    def mem(d):
        return f"{d['peak_mem_bytes'] / 2**20:.0f}" if "peak_mem_bytes" in d else "-"

    mm = f"{o['mm_frac']:.2f} / {t['mm_frac']:.2f}" if "mm_frac" in o else "-"
    if "mfu" in o:  # GPU: model FLOPs utilisation against the vendor bf16 peak
        mm += f" (MFU {o['mfu']:.2f} / {t['mfu']:.2f})"
    mr = f"{r['mem_ratio']:.2f}" if "mem_ratio" in r else "-"
    return (
        f"| {r['size']} | {r['pair']} | {r['task']} | {r['theirs_name']} | {ms(o['median_s'])} | {ms(t['median_s'])} "
        f"| {o['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | **{r['speedup']:.2f}x** | {mem(o)} | {mem(t)} "
        f"| {mr} | {mm} |"
    )


TABLE_HEAD = (
    "| size | pair | task | in-tree | hf_tfm ms | in-tree ms | hf_tfm tok/s | in-tree tok/s | speedup "
    "| hf_tfm peak MiB | in-tree peak MiB | mem ratio | matmul frac (hf_tfm / in-tree) |\n"
    "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


def markdown(results: list[dict], extra: list[dict]) -> str:
    lines = [TABLE_HEAD, *(fmt_row(r) for r in results)]
    if extra:
        lines += ["", "| size | pair | what | hf_tfm | in-tree |", "|---|---|---|---:|---:|"]
        for e in extra:
            lines.append(f"| {e['size']} | {e['pair']} | {e['what']} | {e['ours']} | {e['theirs']} |")
    return "\n".join(lines)


def idle_free_cores(threads: int, when: str) -> int | None:
    """The cores other processes leave free, sampled for half a second while the bench itself is idle (Linux); warn
    when they are fewer than the bench's threads: torch's threads then wait on each other and every time is slower
    than the CPU share explains (6.6x for a 2-thread train step beside one busy process; docs/training.md)."""
    before = cpu_sample()
    if before is None:
        return None
    time.sleep(0.5)
    free = free_cores(before, cpu_sample())
    if free < threads:
        print(
            f"[bench] {when}: other processes use {before.cores - free} of {before.cores} cores; with {threads} "
            f"threads these timings are not those of a quiet machine (--threads {free}, or wait)",
            file=sys.stderr,
            flush=True,
        )
    return free


def machine_info(device: str) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": device,
    }
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def gpu_peak_bf16_flops(name: str) -> float | None:
    """Vendor dense bf16 peak for common GPUs (no sparsity), for MFU; None when unknown."""
    table = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "L4": 121e12}
    for key, val in table.items():
        if key in name:
            return val
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=[*SIZES, "all"], help="all = small and base")
    p.add_argument("--tasks", default=",".join(ALL_TASKS), help=f"comma list of {ALL_TASKS}")
    p.add_argument("--pairs", default=",".join(PAIR_TASKS), help=f"comma list of {','.join(PAIR_TASKS)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--attn", default="sdpa", help="attention backend for both models")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--markdown", default=None, help="also write the markdown table here")
    p.add_argument("--no-memory", action="store_true", help="skip the (profiler-based) peak-memory step")
    p.add_argument("--bf16-autocast", action="store_true", help="also time the train steps under bf16 autocast")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time static-cache generate() with compile_config, and a torch.compile'd hf_tfm train step",
    )
    p.add_argument(
        "--decode-settings",
        default=None,
        help="instead of the pair tasks: decode hf_tfm and in-tree Llama under each weight setting (comma list of "
        f"{','.join(DECODE_SETTINGS)}, or all) against the measured streaming bandwidth; a setting with "
        f"{COMPILED} appended decodes with a static cache and compiled generate()",
    )
    p.add_argument(
        "--runtimes",
        default=None,
        help="instead of the pair tasks: decode the same hf_tfm weights in hf_tfm and exported to other runtimes, "
        f"each in a process of its own (comma list of {','.join(s.replace(' ', '_') for s in RUNTIME_SETTINGS)}, "
        "or all)",
    )
    p.add_argument("--bandwidth-mib", type=int, default=None, help="size of the bandwidth GEMV (default: by --size)")
    p.add_argument(
        "--compare-modeling",
        metavar="REV",
        default=None,
        help="also time hf_tfm's decoding against hf_tfm/modeling.py at git revision REV (same weights, interleaved)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="CUDA mode: bf16, MFU against the GPU's bf16 peak, and flash-attention vs sdpa (untested here)",
    )
    p.add_argument("--charts", metavar="DIR", default=None, help="write PNG charts of the results into DIR")
    p.add_argument(
        "--from-json",
        metavar="JSON",
        default=None,
        help="with --charts: draw the charts of this saved --json output instead of running the benchmark",
    )
    args = p.parse_args(argv)
    if args.from_json and not args.charts:
        p.error("--from-json needs --charts DIR")
    args.sizes = ["small", "base"] if args.size == "all" else [args.size]
    args.task_list = [t for t in args.tasks.split(",") if t]
    bad = set(args.task_list) - set(ALL_TASKS)
    if bad:
        p.error(f"unknown tasks {sorted(bad)}")
    args.pair_list = [x for x in args.pairs.split(",") if x]
    args.setting_list = []
    if args.decode_settings:
        all_settings = list(DECODE_SETTINGS)
        args.setting_list = all_settings if args.decode_settings == "all" else args.decode_settings.split(",")
        if bad := {x for x in args.setting_list if x.removesuffix(COMPILED) not in all_settings}:
            p.error(f"unknown decode settings {sorted(bad)}")
        if "fp32" not in args.setting_list:  # the reference of every speedup
            args.setting_list.insert(0, "fp32")
    args.runtime_list = []
    if args.runtimes:
        names = {name.replace(" ", "_"): name for name in RUNTIME_SETTINGS}
        chosen = list(names) if args.runtimes == "all" else args.runtimes.split(",")
        if bad := set(chosen) - set(names):
            p.error(f"unknown runtimes {sorted(bad)}")
        args.runtime_list = [names[x] for x in chosen]
        if "hf_tfm fp32" not in args.runtime_list:  # the reference of every speedup
            args.runtime_list.insert(0, "hf_tfm fp32")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.from_json:  # charts of a saved run, nothing timed
        with open(args.from_json) as f:
            out = json.load(f)
        for path in write_charts(out, Path(args.charts)):
            print(path)
        return out
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    device = "cpu"
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu: CUDA is not available on this machine")
        device = "cuda"
        if args.dtype == "float32":
            args.dtype = "bfloat16"
    else:
        torch.set_num_threads(args.threads)
    args.torch_dtype = getattr(torch, args.dtype)
    args.mm_tput = {}
    args.peak_flops = gpu_peak_bf16_flops(torch.cuda.get_device_name()) if device == "cuda" else None
    torch.manual_seed(0)

    results, extra = [], []
    t_start = time.time()
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    free_start = idle_free_cores(torch.get_num_threads(), "at the start") if device == "cpu" else None
    decode_rows, bandwidth = [], None
    if args.setting_list:  # a decode-only run: each weight setting, hf_tfm and in-tree Llama
        mib = args.bandwidth_mib or BANDWIDTH_MIB[args.sizes[0]]
        bandwidth = stream_bandwidth(mib, torch.get_num_threads())
        print(f"[bench] streaming bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
        for size in args.sizes:
            decode_rows += decode_settings(size, args.setting_list, args, bandwidth)
    runtime_rows = []
    if args.runtime_list:  # a runtimes-only run: the same weights in each runtime, each in its own process
        mib = args.bandwidth_mib or BANDWIDTH_MIB[args.sizes[0]]
        bandwidth = stream_bandwidth(mib, torch.get_num_threads())
        for size in args.sizes:
            runtime_rows += runtimes(size, args, bandwidth)
    for size in args.sizes if not (args.setting_list or args.runtime_list) else []:
        args.cur_size = size
        shp = SHAPES[size]
        for pair_name in args.pair_list:
            tasks = [t for t in PAIR_TASKS[pair_name] if t in args.task_list]
            if not tasks:
                continue
            pair = build_pair(pair_name, size, args.torch_dtype, args.attn, device)
            vocab = SIZES[size]["vocab"]
            for task in tasks:
                print(f"[bench] {size} {pair_name} {task} ...", file=sys.stderr, flush=True)
                r = run_pair_task(pair, task, shp, args, device, vocab)
                r["size"] = size
                r["params_ours"], r["params_theirs"] = n_params(pair.ours), n_params(pair.theirs)
                r["notes"] = pair.notes
                results.append(r)
                print(fmt_row(r), file=sys.stderr, flush=True)
                if args.bf16_autocast and task in TRAIN_TASKS and device == "cpu":
                    rb = run_pair_task(
                        pair, task, shp, args, device, vocab, torch.bfloat16, task + "_bf16_autocast", (task, None)
                    )
                    rb["size"] = size
                    for n in ("ours", "theirs"):  # fp32 timed in the same interleaved rounds
                        rb[n]["speedup_over_fp32"] = rb[n]["speedup_over_baseline"]
                    results.append(rb)
                    extra.append(
                        {
                            "size": size,
                            "pair": pair_name,
                            "what": f"{task}: bf16 autocast speedup over fp32",
                            "ours": f"{rb['ours']['speedup_over_fp32']:.2f}x",
                            "theirs": f"{rb['theirs']['speedup_over_fp32']:.2f}x",
                        }
                    )
            if args.compile and pair.kind == "causal" and "decode_b1" in tasks:
                print(f"[bench] {size} {pair_name} decode_b1_static (compile) ...", file=sys.stderr, flush=True)
                rc = run_pair_task(pair, "decode_b1_static", shp, args, device, vocab, baseline=("decode_b1", None))
                rc["size"] = size
                for n in ("ours", "theirs"):  # eager dynamic-cache decode timed in the same interleaved rounds
                    rc[n]["speedup_over_eager_dynamic"] = rc[n]["speedup_over_baseline"]
                results.append(rc)
                extra.append(
                    {
                        "size": size,
                        "pair": pair_name,
                        "what": "decode_b1: static cache + compiled generate() speedup over eager dynamic cache "
                        f"(compile warm-up {rc['ours']['warmup_s']:.0f} s / {rc['theirs']['warmup_s']:.0f} s)",
                        "ours": f"{rc['ours']['speedup_over_eager_dynamic']:.2f}x",
                        "theirs": f"{rc['theirs']['speedup_over_eager_dynamic']:.2f}x",
                    }
                )
            if args.compare_modeling and pair.kind == "causal":
                extra.extend(compare_modeling(pair, tasks, shp, args, vocab, size))
            if args.compile and pair.kind == "causal" and "train" in tasks:
                extra.append(compiled_train(pair, shp, args, device, vocab, size, results))
            if pair_name == "mixtral":
                extra.extend(experts_kernels(pair, tasks, shp, args, device, vocab, size))
            if device == "cuda" and pair.kind == "causal" and "train" in tasks:
                extra.extend(gpu_flash_vs_sdpa(pair_name, size, shp, args, device, vocab))
            del pair
            gc.collect()

    out = {
        "machine": machine_info(device),
        "args": {k: v for k, v in vars(args).items() if k not in ("torch_dtype", "mm_tput")},
        "command": " ".join(
            [os.path.relpath(sys.argv[0]) if sys.argv else "scripts/bench.py", *(argv or sys.argv[1:])]
        ),
        "wall_s": time.time() - t_start,
        "results": results,
        "extra": extra,
    }
    out["machine"]["loadavg_start"] = load_start  # 1/5/15-minute load averages: other work on the machine
    with contextlib.suppress(OSError):
        out["machine"]["loadavg_end"] = os.getloadavg()
    if device == "cpu":  # cores the other processes left free, before and after the bench (its own threads idle)
        out["machine"]["free_cores"] = [free_start, idle_free_cores(torch.get_num_threads(), "at the end")]
    table = markdown(results, extra)
    if args.setting_list:
        out["bandwidth"], out["decode"] = bandwidth, decode_rows
        table = decode_markdown(decode_rows, bandwidth, SHAPES[args.sizes[0]]["decode_batches"])
    if args.runtime_list:
        out["bandwidth"], out["runtimes"] = bandwidth, runtime_rows
        table = runtimes_markdown(runtime_rows, bandwidth, SHAPES[args.sizes[0]]["decode_batches"])
    out["markdown"] = table
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.charts:
        for path in write_charts(out, Path(args.charts)):
            print(f"[bench] wrote {path}", file=sys.stderr, flush=True)
    return out


def experts_kernels(pair: Pair, tasks, shp: dict, args, device: str, vocab: int, size: str) -> list[dict]:
    """hf_tfm's steps on each experts kernel of `KERNELS_BY_TASK`, interleaved round by round (medians, ms)."""
    rows = []
    model = pair.ours
    default = model.config._experts_implementation
    for task in [t for t in KERNELS_BY_TASK if t in tasks]:
        print(f"[bench] {size} {pair.name} {task} per experts kernel ...", file=sys.stderr, flush=True)
        inner = make_step(model, task, shp, vocab, device, None)

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
    """hf_tfm's `modeling.py` and `configuration.py` as they were at git revision `rev`, imported as a package of their
    own (`hf_tfm_at_<rev>`), for A/B timing against the working tree's."""
    import importlib
    import subprocess
    import tempfile

    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    package = f"hf_tfm_at_{''.join(c if c.isalnum() else '_' for c in rev)}"
    root = tempfile.mkdtemp(prefix="hf-tfm-bench-")
    os.mkdir(os.path.join(root, package))
    for name in ("configuration.py", "modeling.py"):
        show = subprocess.run(["git", "show", f"{rev}:hf_tfm/{name}"], cwd=repo, capture_output=True, text=True)
        if show.returncode:
            raise SystemExit(f"--compare-modeling {rev}: {show.stderr.strip()}")
        with open(os.path.join(root, package, name), "w") as f:
            f.write(show.stdout)
    open(os.path.join(root, package, "__init__.py"), "w").close()
    sys.path.insert(0, root)
    return importlib.import_module(f"{package}.modeling")


def compare_modeling(pair: Pair, tasks, shp: dict, args, vocab: int, size: str) -> list[dict]:
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


def compiled_train(pair: Pair, shp: dict, args, device: str, vocab: int, size: str, results: list[dict]) -> dict:
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


def gpu_flash_vs_sdpa(pair_name: str, size: str, shp: dict, args, device: str, vocab: int) -> list[dict]:
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


# ---------------------------------------------------------------------------------------------------------------------
# Decode settings: fp32, bf16 and each quantization backend, hf_tfm against in-tree Llama, against the bandwidth limit


def _torchao(kind: str, **kwargs):
    def make():
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

        if kind == "int8":
            config = Int8WeightOnlyConfig()
        else:  # torchao's default int4 layout needs a CUDA kernel package (mslk); the prototype one is for CPUs
            config = (Int4WeightOnlyConfig if kind == "int4" else PrototypeInt4WeightOnlyConfig)(group_size=128)
        return transformers.TorchAoConfig(config, **kwargs)

    return make


def _bnb(**kwargs):
    return lambda: transformers.BitsAndBytesConfig(**kwargs)


def _quanto(weights: str, **kwargs):
    return lambda: transformers.QuantoConfig(weights=weights, **kwargs)


NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16}
# setting -> (dtype of the unquantized weights, quantization config factory or None, what it is). The settings that
# `hf-tfm generate --quantize` uses are `hf_tfm.quantization.BACKENDS`; "_head" variants quantize `lm_head` too
# (`modules_to_not_convert=[]` replaces transformers' default skip list, which keeps the output embedding).
DECODE_SETTINGS = {
    "fp32": (torch.float32, None, "fp32 weights"),
    "bf16": (torch.bfloat16, None, "bf16 weights"),
    "torchao_int8": (torch.float32, _torchao("int8"), "torchao Int8WeightOnlyConfig"),
    "torchao_int4": (torch.bfloat16, _torchao("int4"), "torchao Int4WeightOnlyConfig(group_size=128)"),
    "torchao_int4_cpu": (torch.bfloat16, _torchao("int4_cpu"), "torchao PrototypeInt4WeightOnlyConfig (CPU tinygemm)"),
    "torchao_int4_cpu_head": (
        torch.bfloat16,
        _torchao("int4_cpu", include_input_output_embeddings=True),
        "torchao PrototypeInt4WeightOnlyConfig, lm_head too",
    ),
    "bnb_int8": (torch.float32, _bnb(load_in_8bit=True), "bitsandbytes LLM.int8()"),
    "bnb_nf4": (torch.bfloat16, _bnb(**NF4), "bitsandbytes NF4, bf16 compute"),
    "bnb_nf4_dq": (torch.bfloat16, _bnb(**NF4, bnb_4bit_use_double_quant=True), "bitsandbytes NF4, double-quantized"),
    "quanto_int8": (torch.float32, _quanto("int8"), "optimum-quanto int8"),
    "quanto_int4": (torch.bfloat16, _quanto("int4"), "optimum-quanto int4"),
    "quanto_int4_head": (
        torch.bfloat16,
        _quanto("int4", modules_to_not_convert=[]),
        "optimum-quanto int4, lm_head too",
    ),
}


COMPILED = "+compile"  # a setting with this suffix decodes with a static cache and compiled generate()


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: the inner tensors of a quantized tensor subclass (torchao, quanto), else its elements;
    bitsandbytes keeps its scales beside the packed weight (`quant_state`, `SCB`)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    total = t.numel() * t.element_size()
    state = getattr(t, "quant_state", None)
    while state is not None:  # bitsandbytes 4-bit: absmax and code, nested once with double quantization
        total += sum(x.numel() * x.element_size() for x in (state.absmax, state.code) if x is not None)
        state = getattr(state, "state2", None)
    scb = getattr(t, "SCB", None)
    return total + (scb.numel() * scb.element_size() if scb is not None else 0)


def streamed_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer except the embedding tables, of which a
    step gathers one row per token (a tied `lm_head` reads the whole table, and counts it as its own weight)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                total += tensor_bytes(t)
    return total


def stream_bandwidth(mib: int, threads: int, reps: int = 5) -> dict:
    """This machine's streaming bandwidth: the best time of one-row products with an fp32 W of `mib` MiB (much larger
    than the caches), as every decode step's GEMVs read their weights: MKL's `F.linear(x, W)`, and Inductor's compiled
    `(x * W).sum(-1)` (`hf_tfm.inference.StreamingLinear`), which read W twice as fast as MKL on an AMD EPYC; the
    faster of the two is the rate (`kernel` names it)."""
    cols = 4096
    weight = torch.randn(mib * 2**20 // (4 * cols), cols)
    x = torch.randn(1, cols)
    kernels = {
        "mkl": lambda: nn.functional.linear(x, weight),
        "inductor": torch.compile(lambda: (x * weight).sum(-1), fullgraph=True),
    }
    best = {}
    with torch.no_grad():
        for name, kernel in kernels.items():
            kernel()  # warm-up (and compile)
            best[name] = min(_timed(kernel) for _ in range(reps))
    kernel = min(best, key=best.get)
    nbytes = weight.numel() * weight.element_size()
    return {
        "bytes": nbytes,
        "best_s": best[kernel],
        "bytes_per_s": nbytes / best[kernel],
        "threads": threads,
        "kernel": kernel,
        "bytes_per_s_by_kernel": {name: nbytes / t for name, t in best.items()},
    }


def _gemv_kernel(bandwidth: dict) -> str:
    """Which GEMV set the bandwidth, for a run that timed more than MKL's."""
    rates = bandwidth.get("bytes_per_s_by_kernel", {})
    if len(rates) < 2:
        return ""
    return ", the faster of " + " and ".join(f"{name} {rate / 1e9:.1f} GB/s" for name, rate in rates.items())


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def load_setting(cls, folder: str, setting: str):
    """`cls.from_pretrained` under the setting. transformers reports a weight that failed to quantize only in its load
    report (then raises "look at the CONVERSION entries"), so the report is captured and its error line re-raised; a
    config that quantized nothing (torchao skips layers it cannot group) is an error too."""
    import logging
    import re

    dtype, make_config, _ = DECODE_SETTINGS[setting]
    kwargs = {"dtype": dtype}
    if make_config is not None:
        kwargs["quantization_config"] = make_config()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    library_logger = logging.getLogger("transformers")
    library_logger.addHandler(handler)
    transformers.logging.set_verbosity_warning()
    try:
        model = cls.from_pretrained(folder, **kwargs).eval()
    except RuntimeError as err:
        causes = re.findall(r"^\s*(\w+(?:Error|Exception): .+)$", "\n".join(records), flags=re.MULTILINE)
        raise RuntimeError(causes[-1] if causes else str(err)) from err
    finally:
        library_logger.removeHandler(handler)
        transformers.logging.set_verbosity_error()
    if make_config is not None and not any(_is_quantized(m) for m in model.model.layers.modules()):
        raise RuntimeError(f"{DECODE_SETTINGS[setting][2]} quantized no layer of this model")
    gc_ = model.generation_config  # exactly `new` tokens: no EOS stop, greedy
    gc_.eos_token_id, gc_.pad_token_id, gc_.do_sample = None, 0, False
    return model


def _is_quantized(module: nn.Module) -> bool:
    """A layer replaced by a quantized class (bitsandbytes, quanto) or holding a quantized tensor (torchao)."""
    if not isinstance(module, nn.Linear) and not hasattr(module, "qweight") and "Linear" not in type(module).__name__:
        return False
    return type(module) is not nn.Linear or type(module.weight) not in (torch.Tensor, nn.Parameter)


def decode_setting_step(model: nn.Module, shp: dict, vocab: int, batch: int, compiled: bool):
    """generate() of `new` tokens, returning the seconds per decode step (timed inside the call, prefill excluded);
    `compiled`: with a static cache, whose decode steps generate() compiles at the first call (the warm-up)."""
    ids = torch.randint(3, vocab, (batch, shp["prompt"]), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    extra = {}
    if compiled:
        cc = transformers.CompileConfig(fullgraph=False)  # bitsandbytes' and quanto's layers break the graph
        cc._compile_all_devices = True  # private flag: generate() only auto-compiles on CUDA/XPU otherwise
        extra = {"cache_implementation": "static", "compile_config": cc}

    new = shp["new"]

    def step() -> float:  # generate()'s own no_grad: optimum-quanto's int4 kernel fails on inference-mode tensors
        clock = StepClock()
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, streamer=clock, **extra
        )
        assert out.shape == (batch, shp["prompt"] + new), out.shape
        return clock.step_seconds(new)

    return step


def decode_settings(size: str, settings: list[str], args, bandwidth: dict) -> list[dict]:
    """Per setting: hf_tfm and in-tree Llama (same weights) loaded through it, ms per decode step at B=1 and B=8,
    bytes of weights per step, achieved GB/s and its fraction of `bandwidth`, interleaved round by round."""
    import tempfile

    shp, vocab = SHAPES[size], SIZES[size]["vocab"]
    pair = build_pair("llama", size, torch.float32, args.attn, "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"ours": os.path.join(tmp, "hf_tfm"), "theirs": os.path.join(tmp, "llama")}
        pair.ours.save_pretrained(folders["ours"])
        pair.theirs.save_pretrained(folders["theirs"])
        classes = {"ours": type(pair.ours), "theirs": type(pair.theirs)}
        del pair
        gc.collect()
        for setting in settings:
            print(f"[bench] {size} decode setting {setting} ...", file=sys.stderr, flush=True)
            weights = setting.removesuffix(COMPILED)
            compiled = weights != setting
            what = DECODE_SETTINGS[weights][2] + (", static cache, compiled generate()" if compiled else "")
            row = {"size": size, "setting": setting, "what": what}
            try:
                models = {side: load_setting(classes[side], folders[side], weights) for side in folders}
                for batch in shp["decode_batches"]:
                    steps = {side: decode_setting_step(m, shp, vocab, batch, compiled) for side, m in models.items()}
                    for s in steps.values():  # warm-up: bitsandbytes repacks its 4-bit weights, generate() compiles
                        s()
                    times = {side: [] for side in steps}
                    for r in range(args.rounds):  # interleaved, alternating which side goes first; each times itself
                        for side in list(steps)[:: 1 if r % 2 == 0 else -1]:
                            times[side].append(steps[side]())
                    for side in models:
                        row.setdefault(side, {})[f"b{batch}_step_s"] = statistics.median(times[side])
            except Exception as err:  # a backend that does not run here is reported, with its error
                row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
                rows.append(row)
                print(f"[bench]   {row['error']}", file=sys.stderr, flush=True)
                continue
            for side, model in models.items():
                nbytes = streamed_weight_bytes(model)
                row[side]["weight_bytes_per_step"] = nbytes
                for batch in shp["decode_batches"]:
                    achieved = nbytes / row[side][f"b{batch}_step_s"]
                    row[side][f"b{batch}_bytes_per_s"] = achieved
                    row[side][f"b{batch}_bandwidth_frac"] = achieved / bandwidth["bytes_per_s"]
            rows.append(row)
            del models
            gc.collect()
    reference = next((r for r in rows if r["setting"] == "fp32" and "error" not in r), None)
    for row in rows:  # speedup over fp32 in-tree generate(), per batch size
        if reference is None or "error" in row:
            continue
        for side in ("ours", "theirs"):
            for batch in shp["decode_batches"]:
                key = f"b{batch}_step_s"
                row[side][f"b{batch}_speedup_vs_fp32_in_tree"] = reference["theirs"][key] / row[side][key]
    return rows


def decode_markdown(rows: list[dict], bandwidth: dict, batches: tuple[int, int]) -> str:
    b1, b8 = batches
    lines = [
        f"Streaming bandwidth (fp32 GEMV over {bandwidth['bytes'] / 2**20:.0f} MiB{_gemv_kernel(bandwidth)}): "
        f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s",
        "",
        f"| size | setting | weights | MB/step | hf_tfm ms B={b1} | in-tree ms B={b1} | hf_tfm ms B={b8} "
        f"| in-tree ms B={b8} | vs fp32 in-tree B={b1} (hf_tfm / in-tree) | vs fp32 in-tree B={b8} "
        f"| GB/s B={b1} (hf_tfm) | bandwidth frac B={b1} (hf_tfm / in-tree) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['setting']} | {r['what']} | fails: {r['error']} ||||||||")
            continue
        o, t = r["ours"], r["theirs"]
        lines.append(
            f"| {r['size']} | {r['setting']} | {r['what']} | {o['weight_bytes_per_step'] / 1e6:.1f} "
            f"| {o[f'b{b1}_step_s'] * 1e3:.1f} | {t[f'b{b1}_step_s'] * 1e3:.1f} "
            f"| {o[f'b{b8}_step_s'] * 1e3:.1f} | {t[f'b{b8}_step_s'] * 1e3:.1f} "
            f"| **{o[f'b{b1}_speedup_vs_fp32_in_tree']:.2f}x** / {t[f'b{b1}_speedup_vs_fp32_in_tree']:.2f}x "
            f"| {o[f'b{b8}_speedup_vs_fp32_in_tree']:.2f}x "
            f"| {o[f'b{b1}_bytes_per_s'] / 1e9:.1f} "
            f"| {o[f'b{b1}_bandwidth_frac']:.2f} / {t[f'b{b1}_bandwidth_frac']:.2f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Runtimes (`--runtimes`): the same weights in hf_tfm and exported to ONNX Runtime and CTranslate2, each decoding in a
# process of its own (scripts/bench_runtime_worker.py), one after another

# A GPTQ / AWQ checkpoint's format (compressed-tensors W4A16), written by `hf_tfm.calibration` in llm-compressor's
# environment as round-to-nearest: the same bytes and kernels as the calibrated ones, without the calibration's time.
CALIBRATED = "w4a16"
LLMCOMPRESSOR_PYTHON = Path(__file__).resolve().parents[1] / ".venv-llmcompressor" / "bin" / "python"


def calibration_python() -> str:
    """The Python that runs llm-compressor for the scripts: $HF_TFM_LLMCOMPRESSOR_PYTHON, else `make
    llmcompressor-env`'s."""
    return os.environ.get("HF_TFM_LLMCOMPRESSOR_PYTHON") or str(LLMCOMPRESSOR_PYTHON)


RUNTIME_SETTINGS = {
    # name: (format, quantize, what)
    "hf_tfm fp32": ("hf_tfm", None, "hf_tfm generate(), float32, eager"),
    "hf_tfm fp32 compiled": ("hf_tfm+compile", None, "hf_tfm load_for_inference(): static cache, compiled step"),
    "hf_tfm int4 compiled": ("hf_tfm+compile", "int4", "load_for_inference(quantize='int4'): torchao CPU int4, bf16"),
    "hf_tfm q8 compiled": ("hf_tfm+compile", "q8", "load_for_inference(quantize='q8'): int8, hf_tfm's VNNI kernel"),
    "hf_tfm q4 compiled": (
        "hf_tfm+compile",
        "q4",
        "load_for_inference(quantize='q4'): int4 (int8 lm_head), hf_tfm's VNNI kernel",
    ),
    "hf_tfm fp32 aot": ("hf_tfm+aot", None, "hf_tfm.aot.AotDecoder: load_for_inference()'s model, AOTInductor step"),
    "hf_tfm q8 aot": ("hf_tfm+aot", "q8", "AotDecoder over load_for_inference(quantize='q8')"),
    "hf_tfm q4 aot": ("hf_tfm+aot", "q4", "AotDecoder over load_for_inference(quantize='q4')"),
    "hf_tfm w4a16 compiled": (
        "hf_tfm+compile",
        CALIBRATED,
        "load_for_inference() of a GPTQ / AWQ checkpoint: int4 in groups of 128 (float lm_head), hf_tfm's VNNI kernel",
    ),
    "onnx float32": ("onnx", None, "ONNX Runtime 1.32, float32 graphs"),
    "onnx int8": ("onnx", "int8", "ONNX Runtime, int8 MatMul weights per channel"),
    "onnx int4": ("onnx", "int4", "ONNX Runtime, int4 MatMulNBits, blocks of 32"),
    "ct2 float32": ("ctranslate2", None, "CTranslate2 4.8 Generator, float32"),
    "ct2 int8": ("ctranslate2", "int8", "CTranslate2 Generator, int8 weights"),
    "llama.cpp f32": ("gguf", "f32", "llama.cpp (llama-cpp-python 0.3.36), F32 weights"),
    "llama.cpp q8_0": ("gguf", "q8_0", "llama.cpp, Q8_0 weights (8-bit blocks of 32)"),
    "llama.cpp q4_0": ("gguf", "q4_0", "llama.cpp, Q4_0 weights (4-bit blocks of 32)"),
    "llama.cpp q4_k_m": ("gguf", "q4_k_m", "llama.cpp, Q4_K_M weights (llama.cpp's quantizer: Q4_K, some Q6_K)"),
}
WORKER = Path(__file__).resolve().parent / "bench_runtime_worker.py"
# llama.cpp runs in its own environment (`make llama-cpp-env`), where neither torch nor hf_tfm is installed
LLAMA_CPP_PYTHON = Path(__file__).resolve().parents[1] / ".venv-llama-cpp" / "bin" / "python"


def _weight_bytes(fmt: str, path: str, model: nn.Module) -> int:
    """Bytes of weights a decode step reads: hf_tfm's streamed parameters; for an export, its weight files (the
    decode graph's for ONNX, model.bin for CTranslate2, the GGUF file), so a stored copy of the token table counts."""
    if fmt.startswith("hf_tfm"):
        return streamed_weight_bytes(model)
    if fmt == "gguf":
        return Path(path).stat().st_size
    files = [Path(path) / "decode.onnx.data"] if fmt == "onnx" else [Path(path) / "model.bin"]
    return sum(f.stat().st_size for f in files)


def _time_in_process(
    fmt: str, path: str, prompts: list[list[int]], new: int, rounds: int, threads: int, quantize: str | None = None
) -> dict:
    import subprocess

    request = {"format": fmt, "path": path, "prompts": prompts, "new": new, "rounds": rounds, "threads": threads}
    if fmt.startswith("hf_tfm"):  # for an export, `quantize` was the export's
        request["quantize"] = quantize
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    python = sys.executable
    if fmt == "gguf":
        if not LLAMA_CPP_PYTHON.is_file():
            raise RuntimeError("llama.cpp's environment is missing: make llama-cpp-env")
        python = str(LLAMA_CPP_PYTHON)
    done = subprocess.run(
        [python, str(WORKER)], input=json.dumps(request), capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "the worker failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def runtimes(size: str, args, bandwidth: dict) -> list[dict]:
    """Per runtime setting: ms per decode step at each batch size, weight bytes per step, its fraction of
    `bandwidth`, and the speedup over hf_tfm fp32; every setting decodes the same random prompts greedily."""
    import tempfile

    from hf_tfm.exporters import export
    from hf_tfm.tokenization import train_bpe_tokenizer

    shp, vocab = SHAPES[size], SIZES[size]["vocab"]
    if LLAMA_CPP_PYTHON.is_file():  # K-quants are written by llama.cpp's quantizer, in its environment
        os.environ.setdefault("HF_TFM_LLAMA_CPP_PYTHON", str(LLAMA_CPP_PYTHON))
    model = build_pair("llama", size, torch.float32, args.attn, "cpu").ours
    tokenizer = train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)  # CTranslate2's strings
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "hf_tfm")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        for name in args.runtime_list:
            fmt, quantize, what = RUNTIME_SETTINGS[name]
            row = {"size": size, "setting": name, "what": what}
            print(f"[bench] {size} runtime {name} ...", file=sys.stderr, flush=True)
            try:
                path, weights = folder, model
                if not fmt.startswith("hf_tfm"):
                    out = os.path.join(tmp, name.replace(" ", "-") + (".gguf" if fmt == "gguf" else ""))
                    path = str(export(folder, out, format=fmt, quantize=quantize))
                elif quantize == CALIBRATED:  # a checkpoint of its own; its layers as the compiled step streams them
                    from hf_tfm import load_for_inference
                    from hf_tfm.calibration import calibrate
                    from hf_tfm.inference import stream_compressed

                    out = os.path.join(tmp, CALIBRATED)
                    path = str(calibrate(folder, out, "rtn", python=calibration_python()))
                    weights = stream_compressed(load_for_inference(path, compile=False))
                elif quantize:  # the weights as that setting loads them, to count their bytes
                    from hf_tfm import load_for_inference

                    weights = load_for_inference(folder, quantize=quantize, compile=False)
                row["weight_bytes_per_step"] = _weight_bytes(fmt, path, weights)
                for batch in shp["decode_batches"]:
                    seed = torch.Generator().manual_seed(0)
                    prompts = torch.randint(3, vocab, (batch, shp["prompt"]), generator=seed)
                    setting = None if quantize == CALIBRATED else quantize  # the checkpoint holds its weights
                    t = _time_in_process(fmt, path, prompts.tolist(), shp["new"], args.rounds, args.threads, setting)
                    row[f"b{batch}_step_s"] = step = t["step"]
                    row[f"b{batch}_bandwidth_frac"] = row["weight_bytes_per_step"] / step / bandwidth["bytes_per_s"]
            except Exception as err:  # a runtime that does not run here is reported, with its error
                row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
                print(f"[bench]   {row['error']}", file=sys.stderr, flush=True)
            rows.append(row)
    reference = next((r for r in rows if r["setting"] == "hf_tfm fp32" and "error" not in r), None)
    for row in rows:
        if reference is not None and "error" not in row:
            for batch in shp["decode_batches"]:
                key = f"b{batch}_step_s"
                row[f"b{batch}_speedup_vs_hf_tfm_fp32"] = reference[key] / row[key]
    return rows


def runtimes_markdown(rows: list[dict], bandwidth: dict, batches: tuple[int, int]) -> str:
    b1, b8 = batches
    lines = [
        f"Streaming bandwidth (fp32 GEMV over {bandwidth['bytes'] / 2**20:.0f} MiB{_gemv_kernel(bandwidth)}): "
        f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s. Each setting decodes in a process of its own.",
        "",
        f"| size | setting | what | weights MB/step | ms/token B={b1} | ms/token B={b8} | vs hf_tfm fp32 B={b1} "
        f"| vs hf_tfm fp32 B={b8} | bandwidth frac B={b1} |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['setting']} | {r['what']} | fails: {r['error']} |||||")
            continue
        lines.append(
            f"| {r['size']} | {r['setting']} | {r['what']} | {r['weight_bytes_per_step'] / 1e6:.1f} "
            f"| {r[f'b{b1}_step_s'] * 1e3:.1f} | {r[f'b{b8}_step_s'] * 1e3:.1f} "
            f"| **{r.get(f'b{b1}_speedup_vs_hf_tfm_fp32', float('nan')):.2f}x** "
            f"| {r.get(f'b{b8}_speedup_vs_hf_tfm_fp32', float('nan')):.2f}x | {r[f'b{b1}_bandwidth_frac']:.2f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Charts of a run's output (`--charts DIR`, or `--charts DIR --from-json bench.json`)

CHART_WIDTH_IN, CHART_DPI = 9.0, 150  # 1350 px, readable shown 900 px wide
SIDES = {"ours": "hf_tfm", "theirs": "in-tree"}


def write_charts(out: dict, directory: Path) -> list[Path]:
    """PNG charts of a run's output (as `--json` writes it): `speedup.png` when it has pair results,
    `decode_settings.png` when it has decode-setting results, `runtimes.png` for a runtimes run. Returns the paths
    written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    title = run_title(out)
    # train_compiled times hf_tfm compiled against hf_tfm eager, not against the in-tree model
    rows = [r for r in out.get("results", []) if r["task"] != "train_compiled"]
    figures = {}
    if rows:
        figures["speedup.png"] = speedup_chart(rows, title)
    if out.get("decode"):
        figures["decode_settings.png"] = decode_chart(out["decode"], out["bandwidth"], title)
    if out.get("runtimes"):  # one series per batch size: each row is one runtime's own numbers
        rows = [{**r, "ours": {k: v for k, v in r.items() if k.startswith("b")}} for r in out["runtimes"]]
        heading = "The same weights decoding in hf_tfm and in other runtimes, each in its own process"
        figures["runtimes.png"] = decode_chart(rows, out["bandwidth"], title, {"ours": "greedy"}, heading)
    paths = []
    for name, fig in figures.items():
        FigureCanvasAgg(fig).print_png(directory / name, metadata={"Software": "hf_tfm scripts/bench.py"})
        paths.append(directory / name)
    return paths


def run_title(out: dict) -> str:
    """Where and how the run measured: size, threads, dtype, machine."""
    args, machine = out.get("args", {}), out.get("machine", {})
    sizes = "/".join(args.get("sizes") or [str(args.get("size"))])
    n = machine.get("torch_threads", args.get("threads"))
    threads = "GPU" if machine.get("device") == "cuda" else f"{n} thread{'' if n == 1 else 's'}"
    where = machine.get("gpu") or machine.get("cpu") or machine.get("processor", "?")
    return f"size {sizes}, {threads}, {args.get('dtype')}, {where}, torch {machine.get('torch')}"


def new_figure(height_in: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(CHART_WIDTH_IN, height_in), dpi=CHART_DPI, layout="constrained")


def speedup_chart(rows: list[dict], title: str):
    """Horizontal bars of in-tree time / hf_tfm time, one group per pair (and size), one bar per task, a line at 1.0
    (equal time) and the values in a column at the right."""
    import matplotlib

    several_sizes = len({r["size"] for r in rows}) > 1
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['size']} {r['pair']}" if several_sizes else r["pair"], []).append(r)
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    colours = dict(zip(tasks, matplotlib.colormaps["tab10" if len(tasks) <= 10 else "tab20"].colors, strict=False))
    slots = len(rows) + len(groups)  # a heading slot above each group's bars
    fig = new_figure(1.4 + 0.3 * slots)
    ax = fig.subplots()
    y, ticks, labels = 0, [], []
    top = max(max(r["speedup"] for r in rows), 1.0) * 1.2  # room for the column of values
    for name, members in groups.items():
        heading = f"{name} ({members[0]['theirs_name']})"
        over_line = {"facecolor": "white", "edgecolor": "none", "pad": 1}  # hides the line at 1.0 behind it
        ax.text(0.005, y, heading, transform=ax.get_yaxis_transform(), va="center", fontweight="bold", bbox=over_line)
        for r in members:
            y += 1
            ax.barh(y, r["speedup"], height=0.75, color=colours[r["task"]])
            ax.text(0.995, y, f"{r['speedup']:.2f}x", transform=ax.get_yaxis_transform(), va="center", ha="right")
            ticks.append(y)
            labels.append(r["task"])
        y += 1
        if y < slots:
            ax.axhline(y - 0.5, color="0.85", linewidth=0.8)
    ax.axvline(1.0, color="0.2", linestyle="--", linewidth=1)
    ax.set_yticks(ticks, labels)
    ax.set_ylim(slots - 0.5, -0.6)
    ax.set_xlim(0, top)
    ax.set_xlabel("in-tree time / hf_tfm time (> 1: hf_tfm faster; dashed: equal time)")
    fig.suptitle(f"hf_tfm speedup over the in-tree transformers model (medians)\n{title}", fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    return fig


def decode_chart(rows: list[dict], bandwidth: dict, title: str, sides: dict = SIDES, heading: str = ""):
    """Per weight setting: ms per decode step and the fraction of the streaming bandwidth, for each of `sides` (hf_tfm
    and in-tree), per batch size; a setting that failed here is named with its error."""
    import matplotlib

    step_keys = {k for r in rows if "error" not in r for k in r["ours"] if k.endswith("_step_s")}  # b1_step_s, ...
    batches = sorted(int(k.removeprefix("b").removesuffix("_step_s")) for k in step_keys)
    series = [(side, batch) for batch in batches for side in sides]
    colours = matplotlib.colormaps["tab20"].colors  # dark/light pairs: hf_tfm/in-tree, one hue per batch
    height = 0.8 / max(len(series), 1)
    fig = new_figure(1.8 + 0.45 * len(rows))
    ax_ms, ax_bw = fig.subplots(1, 2, sharey=True)
    ms_values = []
    for k, (side, batch) in enumerate(series):
        offset = (k - (len(series) - 1) / 2) * height
        ok = [(i + offset, r[side]) for i, r in enumerate(rows) if "error" not in r]
        style = {"height": height, "color": colours[k], "label": f"{sides[side]} B={batch}"}
        ms = [d[f"b{batch}_step_s"] * 1e3 for _, d in ok]
        ms_values += ms
        ax_ms.barh([y for y, _ in ok], ms, **style)
        ax_bw.barh([y for y, _ in ok], [d[f"b{batch}_bandwidth_frac"] for _, d in ok], **style)
    for i, r in enumerate(rows):
        if "error" in r:
            why = f"fails here: {r['error'].split(':')[0]} (see the table)"
            ax_ms.text(0.01, i, why, transform=ax_ms.get_yaxis_transform(), va="center", color="0.4")
    if ms_values and max(ms_values) > 20 * min(ms_values):
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

        ax_ms.set_xscale("log")  # labels at 1, 2, 5 x 10^k as plain numbers (matplotlib's minor labels overlapped)
        ax_ms.xaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax_ms.xaxis.set_major_formatter(ScalarFormatter())
        ax_ms.xaxis.set_minor_formatter(NullFormatter())
    ax_bw.axvline(1.0, color="0.2", linestyle="--", linewidth=1)
    ax_ms.set_yticks(range(len(rows)), [r["setting"] for r in rows])
    ax_ms.set_ylim(len(rows) - 0.5, -0.5)
    ax_ms.set_xlabel("ms per decode step (lower is faster)")
    ax_bw.set_xlabel("bytes per step / step time / bandwidth")
    ax_ms.set_title("one new token per sequence", fontsize=10)
    ax_bw.set_title(f"fraction of {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s streaming (dashed)", fontsize=10)
    for ax in (ax_ms, ax_bw):
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(axis="x", color="0.9")
        ax.set_axisbelow(True)
    if series:
        fig.legend(*ax_ms.get_legend_handles_labels(), loc="outside lower center", ncols=len(series))
    heading = heading or "Decoding under each weight setting, hf_tfm and in-tree Llama"
    fig.suptitle(f"{heading}\n{title}", fontsize=11)
    return fig


if __name__ == "__main__":
    main()
