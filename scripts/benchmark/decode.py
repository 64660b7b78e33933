"""Decode settings (``--decode-settings all`` or a comma list, instead of the pair tasks): fp32, bf16 and each
quantization backend, hf_tfm against in-tree Llama, against the bandwidth limit.

The llama pair saved, then both sides loaded back through each weight setting of ``DECODE_SETTINGS`` (fp32, bf16
weights, and each quantization backend's transformers config), greedy ``generate()`` at batch 1 and 8. The ms per
decode step is timed inside one generate() of ``new`` tokens, from the prefill's token to the last one (a streamer's
stamps), over ``new - 1``. The bytes of weights one step streams count every parameter and buffer but the embedding
tables (one row each per token), in their quantized form with their scales. Their rate per step, divided by this
machine's streaming bandwidth (``stream_bandwidth``: an fp32 GEMV over ``BANDWIDTH_MIB``, measured in the same run),
is the bandwidth fraction. A setting that fails to load or run here is reported with its error.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from collections.abc import Callable

import torch
import transformers
from torch import nn

from .measure import alternating
from .models import SHAPES, SIZES, build_pair
from .runtime_worker import StepClock, left_padded
from .steps import random_prompts


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
# `hf-tfm generate --quantize` uses are `hf_tfm.inference.quantize.SETTINGS`; "_head" variants quantize `lm_head` too
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


def load_setting(cls: type, folder: str, setting: str) -> nn.Module:
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


def decode_setting_step(
    model: nn.Module, shp: dict, vocab: int, batch: int, compiled: bool, padded: bool = False
) -> Callable[[], float]:
    """generate() of `new` tokens, returning the seconds per decode step (timed inside the call, prefill excluded);
    `compiled`: with a static cache, whose decode steps generate() compiles at the first call (the warm-up)."""
    ids, mask = left_padded(random_prompts(batch, shp["prompt"], vocab, padded))
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


def decode_settings(size: str, settings: list[str], args: argparse.Namespace, bandwidth: dict) -> list[dict]:
    """Per setting: hf_tfm and in-tree Llama (same weights) loaded through it, ms per decode step at B=1 and B=8,
    bytes of weights per step, achieved GB/s and its fraction of `bandwidth`, interleaved round by round."""
    import tempfile

    pair = build_pair("llama", size, torch.float32, args.attn, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"ours": os.path.join(tmp, "hf_tfm"), "theirs": os.path.join(tmp, "llama")}
        pair.ours.save_pretrained(folders["ours"])
        pair.theirs.save_pretrained(folders["theirs"])
        classes = {"ours": type(pair.ours), "theirs": type(pair.theirs)}
        del pair
        gc.collect()
        rows = [setting_row(size, setting, classes, folders, args, bandwidth) for setting in settings]
    reference = next((r for r in rows if r["setting"] == "fp32" and "error" not in r), None)
    for row in rows:  # speedup over fp32 in-tree generate(), per batch size
        if reference is None or "error" in row:
            continue
        for side in ("ours", "theirs"):
            for batch in SHAPES[size]["decode_batches"]:
                key = f"b{batch}_step_s"
                row[side][f"b{batch}_speedup_vs_fp32_in_tree"] = reference["theirs"][key] / row[side][key]
    return rows


def setting_row(
    size: str, setting: str, classes: dict, folders: dict, args: argparse.Namespace, bandwidth: dict
) -> dict:
    """One setting's row: both sides loaded through it and timed at each batch size, interleaved; its error instead
    when it does not load or run here."""
    shp, vocab = SHAPES[size], SIZES[size]["vocab"]
    print(f"[bench] {size} decode setting {setting} ...", file=sys.stderr, flush=True)
    weights = setting.removesuffix(COMPILED)
    compiled = weights != setting
    what = DECODE_SETTINGS[weights][2] + (", static cache, compiled generate()" if compiled else "")
    row = {"size": size, "setting": setting, "what": what}
    try:
        models = {side: load_setting(classes[side], folders[side], weights) for side in folders}
        for batch in shp["decode_batches"]:
            steps = {
                side: decode_setting_step(m, shp, vocab, batch, compiled, args.padded) for side, m in models.items()
            }
            for s in steps.values():  # warm-up: bitsandbytes repacks its 4-bit weights, generate() compiles
                s()
            # interleaved, alternating which side goes first; each step times itself
            times = alternating(steps, args.rounds)
            for side in models:
                row.setdefault(side, {})[f"b{batch}_step_s"] = statistics.median(times[side])
    except Exception as err:  # a backend that does not run here is reported, with its error
        row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
        print(f"[bench]   {row['error']}", file=sys.stderr, flush=True)
        return row
    for side, model in models.items():
        nbytes = streamed_weight_bytes(model)
        row[side]["weight_bytes_per_step"] = nbytes
        for batch in shp["decode_batches"]:
            achieved = nbytes / row[side][f"b{batch}_step_s"]
            row[side][f"b{batch}_bytes_per_s"] = achieved
            row[side][f"b{batch}_bandwidth_frac"] = achieved / bandwidth["bytes_per_s"]
    del models
    gc.collect()
    return row
