"""Runtimes (``--runtimes``): the same weights in hf_tfm and exported to ONNX Runtime, CTranslate2 and llama.cpp, each
decoding in a process of its own (`runtime_worker.py`, through `hf_tfm.programs.run_program`), one after another.

Per setting: ms per decode step at each batch size, the weight bytes a step reads and their fraction of the
streaming bandwidth, and the speedup over hf_tfm fp32 (the reference, always measured). With ``--ttft``, the time to
the first token of a prompt of each of ``TTFT_PROMPTS`` tokens (batch 1): the prompt's processing and the choice of
its next token, again in a process of its own per prompt length, with its speedup over hf_tfm fp32's.

With ``--cold`` instead (`cold_row`): a user's first call in a new process, twice per setting, from the process's
start to each of `COLD_TOKENS` tokens, with an empty store of compiled steps and then with the steps the first process
compiled.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from .decode import streamed_weight_bytes
from .models import SHAPES, SIZES, build_pair
from .steps import random_prompts

# A GPTQ / AWQ checkpoint's format (compressed-tensors W4A16), written by `hf_tfm.calibration` in llm-compressor's
# environment as round-to-nearest: the same bytes and kernels as the calibrated ones, without the calibration's time.
CALIBRATED = "w4a16"
SCRIPTS = Path(__file__).resolve().parents[1]
LLMCOMPRESSOR_PYTHON = SCRIPTS.parent / ".venv-llmcompressor" / "bin" / "python"


def calibration_python() -> str:
    """The Python that runs llm-compressor for the scripts: $HF_TFM_LLMCOMPRESSOR_PYTHON, else `make
    llmcompressor-env`'s."""
    return os.environ.get("HF_TFM_LLMCOMPRESSOR_PYTHON") or str(LLMCOMPRESSOR_PYTHON)


RUNTIME_SETTINGS = {
    # name: (format, quantize, what)
    "hf_tfm fp32": ("hf_tfm", None, "hf_tfm generate(), float32, eager"),
    "hf_tfm fp32 compiled": ("hf_tfm+compile", None, "hf_tfm load_for_inference(): static cache, compiled step"),
    "hf_tfm int4 compiled": ("hf_tfm+compile", "int4", "load_for_inference(quantize='int4'): torchao CPU int4, bf16"),
    "hf_tfm q8 compiled": ("hf_tfm+compile", "q8", "load_for_inference(quantize='q8'): int8, hf_tfm's integer kernel"),
    "hf_tfm q4 compiled": (
        "hf_tfm+compile",
        "q4",
        "load_for_inference(quantize='q4'): int4 (int8 lm_head), hf_tfm's integer kernel",
    ),
    "hf_tfm w4a16 compiled": (
        "hf_tfm+compile",
        CALIBRATED,
        "load_for_inference() of a GPTQ / AWQ checkpoint: int4 in groups of 128 (float lm_head), hf_tfm's kernel",
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
REFERENCE = "hf_tfm fp32"  # the runtime every speedup is over
WORKER = Path(__file__).resolve().parent / "runtime_worker.py"
# llama.cpp runs in its own environment (`make llama-cpp-env`), where neither torch nor hf_tfm is installed
LLAMA_CPP_PYTHON = SCRIPTS.parent / ".venv-llama-cpp" / "bin" / "python"
# prompt lengths of the time to the first token (`--ttft`): a short and a long request
TTFT_PROMPTS = (128, 512)
COLD_TOKENS = 16  # new tokens of a cold start's call
COMPILE_TIMEOUT = 900  # seconds a first process's compile, left running beside it, may take to store its step


def _weight_bytes(fmt: str, path: str, model: nn.Module) -> int:
    """Bytes of weights a decode step reads: hf_tfm's streamed parameters; for an export, its weight files (the
    decode graph's for ONNX, model.bin for CTranslate2, the GGUF file), so a stored copy of the token table counts."""
    if fmt.startswith("hf_tfm"):
        return streamed_weight_bytes(model)
    if fmt == "gguf":
        return Path(path).stat().st_size
    files = [Path(path) / "decode.onnx.data"] if fmt == "onnx" else [Path(path) / "model.bin"]
    return sum(f.stat().st_size for f in files)


def in_process(request: dict, threads: int, env: dict[str, str] | None = None) -> dict:
    """The worker's answer to `request` (its `format`'s runtime, in a process of its own: llama.cpp's in its own
    environment, `env` added to this one); a `RuntimeError` with the worker's last line of error output where it
    fails."""
    from hf_tfm.programs import run_program

    python = sys.executable
    if request["format"] == "gguf":
        if not LLAMA_CPP_PYTHON.is_file():
            raise RuntimeError("llama.cpp's environment is missing: make llama-cpp-env")
        python = str(LLAMA_CPP_PYTHON)
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    try:
        return run_program(WORKER, {**request, "threads": threads}, request["format"], python=python, env=env)
    except RuntimeError as err:  # the table's cell: the worker's own error, not the launch around it
        raise RuntimeError(str(err).strip().splitlines()[-1]) from err


def runtimes(size: str, args: argparse.Namespace, bandwidth: dict) -> list[dict]:
    """Per runtime setting: ms per decode step at each batch size, weight bytes per step, its fraction of
    `bandwidth`, and the speedup over hf_tfm fp32 (with `--ttft`, the time to the first token too); every setting
    decodes the same random prompts greedily."""
    from hf_tfm.tokenization import train_bpe_tokenizer

    if LLAMA_CPP_PYTHON.is_file():  # K-quants are written by llama.cpp's quantizer, in its environment
        os.environ.setdefault("HF_TFM_LLAMA_CPP_PYTHON", str(LLAMA_CPP_PYTHON))
    model = build_pair("llama", size, torch.float32, args.attn, "cpu").ours
    tokenizer = train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)  # CTranslate2's strings
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "hf_tfm")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if args.cold:
            return [cold_row(size, name, folder, tmp, args) for name in args.runtime_list]
        rows = [runtime_row(size, name, folder, model, tmp, args, bandwidth) for name in args.runtime_list]
    timings = {f"b{batch}": f"b{batch}_step_s" for batch in SHAPES[size]["decode_batches"]}
    add_speedups(rows, {**timings, **{f"ttft_p{length}": f"ttft_p{length}_s" for length in TTFT_PROMPTS}})
    return rows


def runtime_row(
    size: str, name: str, folder: str, model: nn.Module, tmp: str, args: argparse.Namespace, bandwidth: dict
) -> dict:
    """One runtime's row: its weights' bytes, ms per decode step at each batch size (and the time to the first token);
    its error instead when it does not run here."""
    shp, vocab = SHAPES[size], SIZES[size]["vocab"]
    fmt, _, what = RUNTIME_SETTINGS[name]
    row = {"size": size, "setting": name, "what": what}
    print(f"[bench] {size} runtime {name} ...", file=sys.stderr, flush=True)
    try:
        path = prepared(name, folder, tmp)
        row["weight_bytes_per_step"] = _weight_bytes(fmt, path, loaded_weights(name, path, model))
        request = _request(name, path)
        for batch in shp["decode_batches"]:
            prompts = random_prompts(batch, shp["prompt"], vocab, args.padded)
            decode = {**request, "prompts": prompts, "new": shp["new"], "rounds": args.rounds}
            row[f"b{batch}_step_s"] = step = in_process(decode, args.threads)["step"]
            row[f"b{batch}_bandwidth_frac"] = row["weight_bytes_per_step"] / step / bandwidth["bytes_per_s"]
    except Exception as err:  # a runtime that does not run here is reported, with its error
        row["error"] = failure(err)
        return row
    for length in TTFT_PROMPTS if args.ttft else ():
        first = {**request, "mode": "ttft", "prompts": random_prompts(1, length, vocab), "rounds": args.rounds}
        try:
            row[f"ttft_p{length}_s"] = in_process(first, args.threads)["ttft"]
        except Exception as err:  # the decode row stands (a prompt longer than the model's positions is refused)
            row[f"ttft_p{length}_error"] = failure(err)
    return row


def cold_row(size: str, name: str, folder: str, tmp: str, args: argparse.Namespace) -> dict:
    """One runtime's cold starts (`runtime_worker.cold_start`), batch 1: a first process with an empty store of
    compiled steps (`first_*`; hf_tfm's `compile_s`: from its start until the step it compiles beside the decoding is
    stored), then a second process on the same store (`second_*`)."""
    shp, vocab = SHAPES[size], SIZES[size]["vocab"]
    fmt, _, what = RUNTIME_SETTINGS[name]
    row = {"size": size, "setting": name, "what": what, "new": COLD_TOKENS}
    print(f"[bench] {size} cold starts of {name} ...", file=sys.stderr, flush=True)
    try:
        path = prepared(name, folder, tmp)
        if fmt == "hf_tfm+compile":
            # hf_tfm's kernels (the compiled step calls them) are built once per machine and kernel source, as an
            # install is: built here, so that neither process's time holds the C++ compiler's
            from hf_tfm.inference.kernels import built_operators

            built_operators()
        prompts = random_prompts(1, shp["prompt"], vocab)
        request = _request(name, path, mode="cold", prompts=prompts, new=COLD_TOKENS)
        with tempfile.TemporaryDirectory() as store:
            for process in ("first", "second"):
                spawned = time.time()
                result = in_process({**request, "spawned_at": spawned}, args.threads, {"HF_TFM_CACHE": store})
                row |= {f"{process}_{key}": value for key, value in result.items()}
                if process == "first" and fmt == "hf_tfm+compile":
                    row["compile_s"] = _stored(Path(store), spawned)
    except Exception as err:  # a runtime that does not run here is reported, with its error
        row["error"] = failure(err)
    return row


def _stored(store: Path, since: float) -> float:
    """Seconds from `since` until the store holds a compiled step (a whole entry: it appears by a rename)."""
    deadline = time.monotonic() + COMPILE_TIMEOUT
    while not any((store / "steps").glob("*/entry.json")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no compiled step stored within {COMPILE_TIMEOUT} s")
        time.sleep(0.2)
    return time.time() - since


def failure(err: Exception) -> str:
    """What failed, in one line of the table (and on stderr)."""
    message = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
    print(f"[bench]   {message}", file=sys.stderr, flush=True)
    return message


def prepared(name: str, folder: str, tmp: str) -> str:
    """What setting `name` runs: the saved `folder`, its export or its calibrated checkpoint (written under `tmp`)."""
    fmt, quantize, _ = RUNTIME_SETTINGS[name]
    if not fmt.startswith("hf_tfm"):
        from hf_tfm.exporters import export

        out = os.path.join(tmp, name.replace(" ", "-") + (".gguf" if fmt == "gguf" else ""))
        return str(export(folder, out, format=fmt, quantize=quantize))
    if quantize == CALIBRATED:
        from hf_tfm.calibration import calibrate

        return str(calibrate(folder, os.path.join(tmp, CALIBRATED), "rtn", python=calibration_python()))
    return folder


def loaded_weights(name: str, path: str, model: nn.Module) -> nn.Module:
    """The model whose weights a step of setting `name` reads, as that setting loads `path` (`prepared`'s): `model`
    (the float one) unless hf_tfm quantizes it or it is a calibrated checkpoint. An export's bytes are its files'."""
    fmt, quantize, _ = RUNTIME_SETTINGS[name]
    if not fmt.startswith("hf_tfm") or not quantize:
        return model
    from hf_tfm import load_for_inference

    if quantize == CALIBRATED:  # its layers as the compiled step streams them
        from hf_tfm.inference import stream_compressed

        return stream_compressed(load_for_inference(path, compile=False))
    return load_for_inference(path, quantize=quantize, compile=False)


def _request(name: str, path: str, **fields) -> dict:
    """The worker's request for setting `name` on `path` (`prepared`'s), with `fields`: for hf_tfm, how to load the
    folder; an export holds its weights, and so does a calibrated checkpoint."""
    fmt, quantize, _ = RUNTIME_SETTINGS[name]
    request = {"format": fmt, "path": path, **fields}
    if fmt.startswith("hf_tfm"):
        request["quantize"] = None if quantize == CALIBRATED else quantize
    return request


def add_speedups(rows: list[dict], timings: dict[str, str]) -> None:
    """Per `name: key` of `timings`, each row's `<name>_speedup_vs_hf_tfm_fp32`: hf_tfm fp32's seconds `key` over the
    row's, where both have them."""
    reference = next((r for r in rows if r["setting"] == REFERENCE and "error" not in r), None)
    for row in rows:
        if reference is None or "error" in row:
            continue
        for name, key in timings.items():
            if key in row and key in reference:
                row[f"{name}_speedup_vs_hf_tfm_fp32"] = reference[key] / row[key]
