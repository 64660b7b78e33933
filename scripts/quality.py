#!/usr/bin/env python
"""What each weight setting costs in quality: perplexity and greedy agreement with fp32 on held-out text.

A small hf_tfm causal LM is trained briefly on the demo's corpus (the Python standard library's own source, split by
file; every 20th file is held out) with a byte-level BPE tokenizer trained on the training files, then saved in fp32.
hf_tfm's own q8 (`load_for_inference(quantize="q8")`), each setting of `scripts/bench.py`'s `DECODE_SETTINGS` (bf16
weights and every quantization backend) and the calibrated int4 checkpoints (`hf_tfm.calibration`: GPTQ and AWQ on 128
training blocks, and round-to-nearest in the same format, written in .venv-llmcompressor) load that folder and are
scored on the held-out blocks against the fp32 model:

- perplexity: exp of the mean next-token loss over every held-out position;
- greedy agreement: the share of positions whose most likely next token is fp32's.

Nothing is downloaded. Usage: `python scripts/quality.py --size small --steps 600 --json quality.json`.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transformers
from benchmark import DECODE_SETTINGS, calibration_python, in_process, load_setting, machine_info

from hf_tfm import TfmConfig, TfmForCausalLM, load_for_inference
from hf_tfm.calibration import METHODS, calibrate
from hf_tfm.data import stdlib_files
from hf_tfm.inference.quantize import SETTINGS as QUANTIZE_SETTINGS
from hf_tfm.tokenization import train_bpe_tokenizer
from hf_tfm.training import TrainSettings, pack_texts, pretrain_causal_lm

# The model: the bench's `small` width and depth (the 4-bit kernels need whole blocks: bitsandbytes' output sizes
# divisible by 32, quanto's int4 groups of 128 input features, hence an intermediate size of 3 x hidden).
SIZES = {
    "tiny": {"hidden": 128, "layers": 2, "heads": 4, "vocab": 512, "corpus_chars": 300_000, "eval_blocks": 4},
    "small": {"hidden": 256, "layers": 4, "heads": 4, "vocab": 2048, "corpus_chars": 4_000_000, "eval_blocks": 128},
}


def corpus(max_chars: int) -> tuple[list[str], list[str]]:
    files = stdlib_files(max_chars, max_file_chars=20_000)
    return [f.text for i, f in enumerate(files) if i % 20], [f.text for f in files[::20]]


def train_model(size: str, steps: int, seq_len: int, folder: str) -> dict:
    s = SIZES[size]
    train_texts, eval_texts = corpus(s["corpus_chars"])
    tokenizer = train_bpe_tokenizer(train_texts, vocab_size=s["vocab"])
    config = TfmConfig(
        vocab_size=len(tokenizer),
        hidden_size=s["hidden"],
        intermediate_size=3 * s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,  # as the bench's llama pair: lm_head is a weight of its own
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    settings = TrainSettings(max_steps=steps, batch_size=16, seq_len=seq_len, learning_rate=2e-3, evals=1)
    metrics = pretrain_causal_lm(config, tokenizer, train_texts, eval_texts, settings, folder)
    blocks = pack_texts(tokenizer, eval_texts, seq_len)[: s["eval_blocks"]]
    return {"blocks": blocks, "train_eval_loss": metrics.get("eval_loss"), "parameters": metrics.get("parameters")}


@torch.no_grad()  # not inference mode: optimum-quanto's int4 kernel fails on inference-mode tensors
def score(model, blocks: list[list[int]], reference: list[torch.Tensor] | None, batch: int = 8) -> dict:
    """Perplexity over every next-token prediction, and (given fp32's argmax per batch) greedy agreement."""
    nll, count, agree, argmaxes = 0.0, 0, 0, []
    for i in range(0, len(blocks), batch):
        ids = torch.tensor(blocks[i : i + batch])
        logits = model(input_ids=ids).logits[:, :-1].float()
        targets = ids[:, 1:]
        nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        count += targets.numel()
        top = logits.argmax(-1)
        argmaxes.append(top)
        if reference is not None:
            agree += (top == reference[i // batch]).sum().item()
    result = {"perplexity": math.exp(nll / count), "tokens": count, "argmax": argmaxes}
    if reference is not None:
        result["greedy_agreement"] = agree / count
    return result


# `--runtimes`: the same fp32 folder exported to each runtime and scored there (ONNX Runtime and CTranslate2 in a
# process of their own, through the benchmark's runtime worker); GGUF files read back by transformers' GGUF loader,
# which dequantizes them: the cost of llama.cpp's weight rounding, computed in PyTorch.
RUNTIME_SETTINGS = {
    "onnx_float32": ("onnx", None, "ONNX Runtime, float32 graphs"),
    "onnx_int8": ("onnx", "int8", "ONNX Runtime, int8 MatMul weights per channel"),
    "onnx_int4": ("onnx", "int4", "ONNX Runtime, int4 MatMulNBits, blocks of 32"),
    "ct2_float32": ("ctranslate2", None, "CTranslate2, float32"),
    "ct2_int8": ("ctranslate2", "int8", "CTranslate2, int8 weights"),
    "gguf_q8_0": ("gguf", "q8_0", "GGUF Q8_0 weights (dequantized by transformers' GGUF loader)"),
    "gguf_q4_0": ("gguf", "q4_0", "GGUF Q4_0 weights (dequantized by transformers' GGUF loader)"),
    "gguf_q4_k_m": ("gguf", "q4_k_m", "GGUF Q4_K_M weights (llama.cpp's quantizer; dequantized by transformers)"),
}
# llama.cpp's environment (`make llama-cpp-env`), whose quantizer writes the K-quants
LLAMA_CPP_PYTHON = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-llama-cpp/bin/python"
)


# hf_tfm's own settings (`load_for_inference(quantize=...)`), every setting of the bench's decode table, and the
# calibrated int4 checkpoints of `hf_tfm.calibration` (GPTQ, AWQ, and round-to-nearest in the same format)
SETTINGS = {
    **{name: setting.summary for name, setting in QUANTIZE_SETTINGS.items() if setting.native},
    **{name: what for name, (_, _, what) in DECODE_SETTINGS.items()},
    **{f"{method}_int4": what for method, what in METHODS.items()},
}


def load_calibrated(folder: str, method: str, seq_len: int, size: str) -> torch.nn.Module:
    """`folder` calibrated with `method` on 128 blocks of the training text, loaded through transformers'
    compressed-tensors quantizer (the weights it decompresses are the checkpoint's int4 values times their scales)."""
    from transformers import AutoModelForCausalLM

    train_texts, _ = corpus(SIZES[size]["corpus_chars"])
    out = os.path.join(folder, f"calibrated-{method}")
    calibrate(folder, out, method, texts=train_texts, samples=128, max_length=seq_len, python=calibration_python())
    return AutoModelForCausalLM.from_pretrained(out).eval()


def score_runtime(setting: str, folder: str, blocks: list[list[int]], fp32: dict, threads: int) -> dict:
    """Perplexity and greedy agreement of `setting`'s export of `folder`, as `score` reports them."""
    from transformers import AutoModelForCausalLM

    from hf_tfm.exporters import export

    fmt, quantize, _ = RUNTIME_SETTINGS[setting]
    if os.path.isfile(LLAMA_CPP_PYTHON):
        os.environ.setdefault("HF_TFM_LLAMA_CPP_PYTHON", LLAMA_CPP_PYTHON)
    out = export(folder, os.path.join(folder, f"export-{setting}"), format=fmt, quantize=quantize)
    if fmt == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32)
        return score(model.eval(), blocks, fp32["argmax"])
    reference = [row for batch in fp32["argmax"] for row in batch.tolist()]
    request = {"mode": "score", "format": fmt, "path": str(out), "blocks": blocks, "reference": reference}
    result = in_process(request, threads)
    perplexity = math.exp(result["nll"] / result["count"])
    return {"perplexity": perplexity, "greedy_agreement": result["agree"] / result["count"]}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[str]]:
    """The arguments, and the settings and runtimes they name (every one for `all`)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--steps", type=int, default=600, help="training steps (batch 16 x --seq-len)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--settings", default="all", help=f"comma list of {','.join(SETTINGS)}, or all")
    p.add_argument(
        "--runtimes",
        default=None,
        help=f"also score exports to other runtimes (comma list of {','.join(RUNTIME_SETTINGS)}, or all)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    settings = list(SETTINGS) if args.settings == "all" else [x for x in args.settings.split(",") if x]
    if bad := set(settings) - set(SETTINGS):
        p.error(f"unknown settings {sorted(bad)}")
    runtimes = list(RUNTIME_SETTINGS) if args.runtimes == "all" else [x for x in (args.runtimes or "").split(",") if x]
    if bad := set(runtimes) - set(RUNTIME_SETTINGS):
        p.error(f"unknown runtimes {sorted(bad)}")
    return args, settings, runtimes


def scored_row(setting: str, what: str, scored: Callable[[], dict], fp32: dict) -> dict:
    """A table row: `scored()`'s perplexity (and against fp32's) and greedy agreement, or its error, reported as the
    bench reports one."""
    print(f"[quality] {setting} ...", file=sys.stderr, flush=True)
    row = {"setting": setting, "what": what}
    try:
        result = scored()
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
        return row
    row["perplexity"] = result["perplexity"]
    row["perplexity_vs_fp32"] = result["perplexity"] / fp32["perplexity"] - 1
    row["greedy_agreement"] = result["greedy_agreement"]
    return row


def load_weights(folder: str, setting: str, args: argparse.Namespace) -> torch.nn.Module:
    """The fp32 folder as `setting` loads it: hf_tfm's own quantizers (eager: the compiled step computes the same
    products), a calibrated int4 checkpoint, or a bench decode setting."""
    if setting in QUANTIZE_SETTINGS and QUANTIZE_SETTINGS[setting].native:
        return load_for_inference(folder, quantize=setting, compile=False)
    if setting.removesuffix("_int4") in METHODS:
        return load_calibrated(folder, setting.removesuffix("_int4"), args.seq_len, args.size)
    return load_setting(TfmForCausalLM, folder, setting)


def markdown(fp32: dict, rows: list[dict]) -> str:
    lines = [
        f"fp32 held-out perplexity {fp32['perplexity']:.3f} over {fp32['tokens']} next-token predictions",
        "",
        "| setting | weights | perplexity | vs fp32 | greedy agreement with fp32 |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setting']} | {r['what']} | fails: {r['error']} |||")
        else:
            lines.append(
                f"| {r['setting']} | {r['what']} | {r['perplexity']:.3f} | {100 * r['perplexity_vs_fp32']:+.2f}% "
                f"| {r['greedy_agreement']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args, settings, runtimes = parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    start, load_start = time.time(), os.getloadavg()

    with tempfile.TemporaryDirectory() as folder:
        trained = train_model(args.size, args.steps, args.seq_len, folder)
        blocks = trained["blocks"]
        fp32 = score(TfmForCausalLM.from_pretrained(folder).eval(), blocks, None)
        rows = [
            scored_row(s, SETTINGS[s], lambda s=s: score(load_weights(folder, s, args), blocks, fp32["argmax"]), fp32)
            for s in settings
        ]
        rows += [
            scored_row(
                s, RUNTIME_SETTINGS[s][2], lambda s=s: score_runtime(s, folder, blocks, fp32, args.threads), fp32
            )
            for s in runtimes
        ]
    table = markdown(fp32, rows)
    print(table)
    out = {
        "machine": {**machine_info("cpu"), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "command": " ".join(["scripts/quality.py", *(argv if argv is not None else sys.argv[1:])]),
        "args": vars(args),
        "model": dict(SIZES[args.size]),
        "parameters": trained["parameters"],
        "fp32": {"perplexity": fp32["perplexity"], "tokens": fp32["tokens"]},
        "results": rows,
        "wall_s": time.time() - start,
        "markdown": table,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
