"""Speculative decoding (``--speculative fp32,q8,q4``, instead of the pair tasks): the llama pair's hf_tfm model
through ``hf_tfm.load_for_inference`` under each quantize setting, greedy ``generate()`` of ``new`` tokens at batch 1,
plain against prompt lookup (``prompt_lookup_num_tokens=LOOKUP_TOKENS``) and against a draft model
(``assistant_model=``), in one process, interleaved round by round.

Random weights predict nothing, so the target is built to decode a known text: every layer adds exactly 0 to the
residual stream (zero ``o_proj`` and ``down_proj``: each still costs what any layer costs) and the output layer's row
of token ``successor[x]`` is the embedding of ``x``, so greedy decoding follows a fixed permutation of the vocabulary.
The permutation has one short cycle, the prompt that repeats (``copied``: its continuation is the prompt again, as in
code being edited), and one long cycle through every other token (``new``: a prompt whose continuation repeats
nothing). The draft is the target's first ``draft_layers(size)`` layers (a tenth) with the same embedding, norm and
head, so it agrees with the target on every token, proposing ``LOOKUP_TOKENS`` a round.

Calls, each checked equal to plain greedy decoding's tokens: ``plain`` (the ``new`` prompt), ``lookup_copied`` (the
best case of prompt lookup: every proposal accepted), ``lookup_new`` (its worst: nothing to propose), ``assisted``
(the ``new`` prompt, every drafted token accepted: the best case a well-matched draft approaches). Each row reports
the tokens each pass of the target yielded. Times are of the whole ``generate()`` call over its new tokens (the prompt
pass included); both models' compiled steps are built (or loaded from the store) before any call is timed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

import hf_tfm
from hf_tfm.inference import precompile

from .measure import alternating
from .models import SHAPES, SIZES, build_pair

SPECULATIVE_SETTINGS = ("fp32", "q8", "q4")  # hf_tfm's own settings: the ones the compiled steps serve
LOOKUP_TOKENS = 8  # tokens proposed a round, by prompt lookup and by the draft
CALLS = ("plain", "lookup_copied", "lookup_new", "assisted")
SPECIAL = 3  # ids 0-2 (pad, BOS, EOS) are left out of the prompts and map to themselves


def draft_layers(size: str) -> int:
    """The draft's layers: a tenth of the target's, at least one."""
    return max(1, SIZES[size]["layers"] // 10)


def prompts(size: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(successor, copied, new): the permutation greedy decoding follows, and the two prompts (1, prompt length)."""
    vocab, length = SIZES[size]["vocab"], SHAPES[size]["prompt"]
    order = torch.randperm(vocab - SPECIAL, generator=torch.Generator().manual_seed(0)) + SPECIAL
    cycle, rest = order[:length], order[length:]
    successor = torch.arange(vocab)
    successor[cycle], successor[rest] = cycle.roll(-1), rest.roll(-1)
    return successor, cycle[None], rest[None, :length]


def save_pair(size: str, folder: str) -> tuple[str, str]:
    """The target and draft folders (see the module's docstring)."""
    target = build_pair("llama", size, torch.float32, "sdpa", "cpu").ours
    successor, _, _ = prompts(size)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # nearly orthogonal random embeddings: the largest logit after x is the row holding x's own embedding
        target.lm_head.weight[successor] = target.model.embed_tokens.weight
    paths = os.path.join(folder, "target"), os.path.join(folder, "draft")
    target.save_pretrained(paths[0])
    keep = draft_layers(size)
    config = target.config.to_dict() | {"num_hidden_layers": keep}
    config["layer_types"] = config["layer_types"][:keep]
    draft = type(target)(type(target.config)(**config))
    draft.load_state_dict(target.state_dict(), strict=False)  # the layers it has, the embedding, norm and head
    draft.save_pretrained(paths[1])
    return paths


def load(folder: str, setting: str) -> nn.Module:
    """`load_for_inference` under `setting`, its one-token and verify steps built before anything is timed (a draft
    takes its verify step too: after a round, it reads the tokens it did not propose in one pass); greedy, exactly
    `new` tokens (no EOS stop)."""
    model = hf_tfm.load_for_inference(folder, quantize=None if setting == "fp32" else setting)
    precompile(model, (1,), verify=True)
    gc_ = model.generation_config
    gc_.eos_token_id, gc_.pad_token_id, gc_.do_sample = None, 0, False
    gc_.num_assistant_tokens, gc_.num_assistant_tokens_schedule = LOOKUP_TOKENS, "constant"
    gc_.assistant_confidence_threshold = 0.0  # as a draft: propose every round's tokens however unsure
    return model


def target_passes(model: nn.Module) -> int:
    """The target's compiled calls so far (one-token and verify steps; the prompt pass is not one)."""
    return sum(model.compiled_decode_step.calls_by_kind.values())


def generate_call(target: nn.Module, ids: torch.Tensor, new: int, extra: dict, out: dict) -> Callable[[], float]:
    """One timed generate(); its output (checked against plain greedy's by the caller) and the target passes it made
    are kept in `out`."""

    def step() -> float:
        before = target_passes(target)
        start = time.perf_counter()
        tokens = target.generate(ids, max_new_tokens=new, min_new_tokens=new, **extra)
        seconds = time.perf_counter() - start
        out["tokens"], out["passes"] = tokens, 1 + target_passes(target) - before  # with the prompt pass
        return seconds

    return step


def greedy(successor: torch.Tensor, ids: torch.Tensor, new: int) -> torch.Tensor:
    """The tokens the target's greedy decoding gives by construction: the prompt, then `new` successors."""
    tokens = ids[0].tolist()
    for _ in range(new):
        tokens.append(int(successor[tokens[-1]]))
    return torch.tensor([tokens])


def speculative_row(size: str, setting: str, folders: tuple[str, str], rounds: int) -> dict:
    """One setting's row: seconds per new token of each call, its speed-up over plain, and the tokens each target
    pass yielded; its error instead when the setting does not run here."""
    print(f"[bench] {size} speculative {setting} ...", file=sys.stderr, flush=True)
    new = SHAPES[size]["new"]
    row = {"size": size, "setting": setting, "draft_layers": draft_layers(size), "k": LOOKUP_TOKENS}
    successor, copied, fresh = prompts(size)
    try:
        target, draft = load(folders[0], setting), load(folders[1], setting)
        lookup = {"prompt_lookup_num_tokens": LOOKUP_TOKENS}
        calls = {
            "plain": (fresh, {}),
            "lookup_copied": (copied, lookup),
            "lookup_new": (fresh, lookup),
            "assisted": (fresh, {"assistant_model": draft}),
        }
        outs: dict[str, dict] = {name: {} for name in CALLS}
        steps = {name: generate_call(target, ids, new, extra, outs[name]) for name, (ids, extra) in calls.items()}
        for name in CALLS:  # warm-up
            steps[name]()
        times = alternating(steps, rounds)
    except Exception as err:  # a setting whose kernel does not run here is reported, with its error
        row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
        print(f"[bench]   {row['error']}", file=sys.stderr, flush=True)
        return row
    for name, (ids, _) in calls.items():
        if not torch.equal(outs[name]["tokens"], greedy(successor, ids, new)):
            raise AssertionError(f"{size} {setting}: {name} decoding differs from greedy decoding")
        row[f"{name}_token_s"] = statistics.median(times[name]) / new
        row[f"{name}_tokens_per_pass"] = new / outs[name]["passes"]
        row[f"{name}_speedup"] = row["plain_token_s"] / row[f"{name}_token_s"]
    del target, draft
    gc.collect()
    return row


def speculative(size: str, args: argparse.Namespace) -> list[dict]:
    """A row per setting of `args.speculative_list` at `size`."""
    with tempfile.TemporaryDirectory() as tmp:
        folders = save_pair(size, tmp)
        gc.collect()
        return [speculative_row(size, setting, folders, args.rounds) for setting in args.speculative_list]
