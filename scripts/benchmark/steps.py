"""One unit of work per pair task, its tokens and its FLOPs.

Tasks: ``train`` (causal LM, forward+backward+AdamW step), ``prefill`` (no-grad forward that fills a KV cache, last
logits only, as generate() does), ``decode_b1``/``decode_b8`` (``generate()`` greedy, prompt 32, 64 new tokens, batch
1 and 8, no EOS stop), ``cls_train`` (encoder sequence-classification train step), ``s2s_train`` (seq2seq train step:
source batch x seq, target a quarter as long) and ``s2s_generate_b1``/``s2s_generate_b8`` (greedy ``generate()`` from a
source of half the sequence length, 64 new tokens). With ``--padded`` a causal batch's prompts have different lengths,
left-padded (see `prompt_lengths`).

Matmul throughput: ``torch.matmul`` timed in the same run on the model's own linear-layer GEMM shapes (forward
``X @ W.T``, and the two backward GEMMs ``dY @ W`` and ``dY.T @ X``), weighted by FLOPs. The train step's achieved
FLOP/s (6 x tokens x matmul parameters + causal attention, see ``train_flops``) divided by that is the reported
``mm_frac``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from .measure import sync, timed
from .models import NUM_LABELS, Pair, s2s_shapes
from .runtime_worker import left_padded

TRAIN_TASKS = ("train", "cls_train", "s2s_train")


def prompt_lengths(batch: int, length: int, padded: bool) -> list[int]:
    """Each prompt's length: `length`; with `padded`, from `length` down to half of it (the first the longest), so
    every prompt of a batch but the first is left-padded, as requests of different lengths are."""
    if not padded:
        return [length] * batch
    return [length - (length // 2) * i // max(batch - 1, 1) for i in range(batch)]


def random_prompts(
    batch: int, length: int, vocab: int, padded: bool = False, generator: torch.Generator | None = None
) -> list[list[int]]:
    """Random token ids (none of the pad, BOS and EOS ids 0-2) of `prompt_lengths(batch, length, padded)`."""
    generator = generator or torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, length), generator=generator).tolist()
    return [row[:n] for row, n in zip(ids, prompt_lengths(batch, length, padded), strict=True)]


def make_step(
    model: nn.Module, task: str, shp: dict, vocab: int, device: str, autocast: torch.dtype | None, padded: bool = False
) -> Callable[[], None]:
    """A zero-argument callable that does one unit of `task` (synchronised)."""
    g = torch.Generator().manual_seed(0)
    ac = (
        (lambda: torch.autocast(device_type=device, dtype=autocast))
        if autocast is not None
        else contextlib.nullcontext
    )
    if task in TRAIN_TASKS:
        return _train_step(model, task, shp, vocab, device, ac, g)
    model.eval()
    if task == "prefill":
        ids = torch.randint(3, vocab, (shp["batch"], shp["seq"]), generator=g).to(device)

        def step():
            with torch.inference_mode(), ac():
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
            sync(device)

        return step
    if task.startswith(("decode", "s2s_generate")):
        return _generate_step(model, task, shp, vocab, device, ac, g, padded)
    raise ValueError(task)


def _train_step(model, task: str, shp: dict, vocab: int, device: str, ac, g: torch.Generator) -> Callable[[], None]:
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


def _generate_step(
    model, task: str, shp: dict, vocab: int, device: str, ac, g: torch.Generator, padded: bool
) -> Callable[[], None]:
    """generate() of `new` tokens after a prompt (causal), or after the start token from a source (seq2seq, whose
    sources are never padded)."""
    batch = shp["decode_batches"][0 if "_b1" in task else 1]
    seq2seq = task.startswith("s2s")
    length = shp["seq"] // 2 if seq2seq else shp["prompt"]  # a source to read, or a prompt to continue
    ids, mask = left_padded(random_prompts(batch, length, vocab, padded and not seq2seq, g))
    ids, mask = ids.to(device), mask.to(device)
    expected = 1 + shp["new"] if seq2seq else shp["prompt"] + shp["new"]  # seq2seq: decoder start + new
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


def task_tokens(task: str, shp: dict) -> int:
    """Tokens processed per step (decode and generate: generated tokens; seq2seq training: source + target)."""
    if task.startswith(("decode", "s2s_generate")):
        return shp["decode_batches"][0 if "_b1" in task else 1] * shp["new"]
    if task == "s2s_train":
        return shp["batch"] * sum(s2s_shapes(shp))
    return shp["batch"] * shp["seq"]


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
            total_time += min(_synced(fn, device) for _ in range(reps)) * count
            total_flops += 2.0 * m * i * o * count
    return total_flops / total_time


def _synced(fn: Callable[[], object], device: str) -> float:
    sync(device)
    return timed(lambda: (fn(), sync(device)))
