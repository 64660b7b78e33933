"""Calibrated 4-bit weights (GPTQ, AWQ) through llm-compressor, saved as compressed-tensors checkpoints.

    calibrate("my-model", "my-model-gptq", method="gptq")  # or "awq", or "rtn" (the uncalibrated baseline)
    AutoModelForCausalLM.from_pretrained("my-model-gptq")  # transformers' compressed-tensors quantizer; vLLM serves it

Round-to-nearest 4-bit weights lose quality where a few input channels carry large activations. GPTQ (arXiv:2210.17323)
rounds each layer's columns one at a time and corrects the columns not yet rounded for the error, using the layer's
inputs on calibration text; AWQ (arXiv:2306.00978) scales the input channels that carry large activations up before
rounding and folds the inverse scale into the norm or linear layer that feeds them. Both write the same format:
int4 weights, symmetric, one scale per group of 128 input features (`W4A16`), which transformers loads through its
compressed-tensors quantizer and vLLM serves with its 4-bit kernels. `rtn` writes that format with no calibration:
the baseline of the same bits that the quality table (`scripts/quality.py`) compares them with.

llm-compressor pins transformers <= 5.17, so it lives in an environment of its own (`make llmcompressor-env` makes
.venv-llmcompressor with hf_tfm in it). `calibrate` runs there itself, or from any other environment hands the job to
that environment's Python (`$HF_TFM_LLMCOMPRESSOR_PYTHON`, or the `python` argument). The checkpoints load in every
environment that has compressed-tensors. Symmetric weights on purpose: asymmetric (`W4A16_ASYM`) checkpoints store
packed zero points, which transformers 5.25 cannot load (in-tree Llama's neither: a size mismatch on
`weight_zero_point`).
"""

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from transformers.utils import logging

from .programs import run_program

logger = logging.get_logger(__name__)

METHODS = {
    "gptq": "GPTQ: int4 columns rounded in turn, the error corrected on calibration text's inputs",
    "awq": "AWQ: salient input channels scaled up on calibration text's activations, then int4 round-to-nearest",
    "rtn": "int4 round-to-nearest with no calibration (the same format: the baseline)",
}
SCHEME = "W4A16"  # int4 weights, symmetric, groups of input features; activations stay in the model's dtype

# Kept in the model's dtype: the output embedding (as llm-compressor's examples and vLLM's checkpoints keep it) and a
# shared expert's one-row gate (a router, which stays float as the experts' router does).
IGNORE = ["lm_head", "re:.*shared_expert_gate$"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def llmcompressor_python() -> str | None:
    """The Python that runs llm-compressor: $HF_TFM_LLMCOMPRESSOR_PYTHON, else this one when it can import
    llmcompressor; None without either."""
    if os.environ.get("HF_TFM_LLMCOMPRESSOR_PYTHON"):
        return os.environ["HF_TFM_LLMCOMPRESSOR_PYTHON"]
    return sys.executable if importlib.util.find_spec("llmcompressor") is not None else None


def awq_mappings(model: Any) -> list[tuple[str, list[str]]]:
    """AWQ's (smoothed module, balanced linear layers) pairs for an hf_tfm causal LM: the module whose output is
    exactly those layers' input, so that dividing it by a per-channel scale and multiplying their input columns by the
    same scale leaves the model's function unchanged.

    - a pre-norm block's attention norm feeds q/k/v, its feed-forward norm feeds gate/up (a dense feed-forward only:
      in a mixture of experts it also feeds the router and the float experts); a post-norm's norm also feeds the
      residual stream, so it is never smoothed;
    - `v_proj` feeds `o_proj` through the attention's weighted sum, which is linear in the values (one value head per
      query head: with grouped-query attention their widths differ);
    - `up_proj` feeds `down_proj` through the gated product, which is linear in it (not through a plain MLP's
      activation).
    """
    pairs = []
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        pre_norm = model.config.norm_position == "pre"
        if pre_norm and hasattr(layer.attn_norm, "weight"):  # layer 0 may have no attention norm
            pairs.append((f"{prefix}.attn_norm", [f"{prefix}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]))
        if attn.v_proj.out_features == attn.o_proj.in_features:
            pairs.append((f"{prefix}.self_attn.v_proj", [f"{prefix}.self_attn.o_proj"]))
        dense = hasattr(mlp, "up_proj")
        ffn, ffn_name = (mlp, f"{prefix}.mlp") if dense else (mlp.shared_expert, f"{prefix}.mlp.shared_expert")
        if pre_norm and dense:
            pairs.append(
                (f"{prefix}.mlp_norm", [f"{ffn_name}.{p}" for p in ("gate_proj", "up_proj") if getattr(ffn, p)])
            )
        if ffn is not None and ffn.is_glu:
            pairs.append((f"{ffn_name}.up_proj", [f"{ffn_name}.down_proj"]))
    return pairs


def _check(config: Any) -> int:
    """The group size of `config`'s causal LM, or a ValueError saying why it cannot be calibrated."""
    from .inference.quantize import int4_group_size

    if config.model_type != "hf_tfm":
        raise ValueError(
            f"calibrate takes an hf_tfm causal LM (TfmConfig), not a {config.model_type!r} model: llm-compressor's "
            "calibration runs a decoder's layers one after another (an encoder-decoder's are two stacks)"
        )
    if not any(arch.endswith("ForCausalLM") for arch in config.architectures or []):
        raise ValueError(f"calibrate takes a causal LM folder; this one holds {config.architectures}")
    return int4_group_size(config, "calibrate", "quantize it with `load_for_inference(quantize='q8')`")


def calibrate(
    path: str | os.PathLike,
    output_dir: str | os.PathLike,
    method: str = "gptq",
    texts: list[str] | None = None,
    samples: int = 128,
    max_length: int = 512,
    python: str | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """Quantize the causal LM folder `path` to calibrated int4 weights with `method` ("gptq", "awq" or "rtn"), and
    save it with its tokenizer to `output_dir` as a compressed-tensors checkpoint (`from_pretrained` loads it).

    `texts`: the calibration text, cut into `samples` blocks of `max_length` tokens (default: the Python standard
    library's own source, which every machine has; pass text like the model's own for the best result). Runs here when
    llm-compressor is installed, else in `python` (default `$HF_TFM_LLMCOMPRESSOR_PYTHON`). Returns `output_dir`.

    `trust_remote_code`: run code the folder ships (transformers' flag, passed to every load, here and in
    llm-compressor's environment); hf_tfm's own folders load without it, through the classes importing hf_tfm
    registers (hf_tfm is installed in that environment too).
    """
    from transformers import AutoConfig

    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}: choose one of {', '.join(METHODS)}")
    if samples < 1 or max_length < 2:
        raise ValueError(f"calibrate needs samples >= 1 and max_length >= 2, got {samples} and {max_length}")
    _check(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{path} has no tokenizer: calibrate tokenizes its calibration text with the folder's own")
    job = {
        "path": str(path),
        "output_dir": str(output_dir),
        "method": method,
        "texts": texts,
        "samples": samples,
        "max_length": max_length,
        "trust_remote_code": trust_remote_code,
    }
    python = python or llmcompressor_python()
    if python is None:
        raise ImportError(
            "calibrate needs llm-compressor, which pins transformers <= 5.17: make its environment with "
            "`make llmcompressor-env` and set HF_TFM_LLMCOMPRESSOR_PYTHON=.venv-llmcompressor/bin/python "
            "(or run `.venv-llmcompressor/bin/hf-tfm calibrate`)"
        )
    if python == sys.executable and importlib.util.find_spec("llmcompressor") is not None:
        run(job)
    else:  # this module's `run`, in llm-compressor's environment (hf_tfm is installed there too)
        run_program(__name__, job, f"llm-compressor ({python})", python=python)
    return Path(output_dir)


def _calibration_blocks(tokenizer: Any, texts: list[str] | None, samples: int, max_length: int) -> list[list[int]]:
    from .data import stdlib_files
    from .training import pack_texts

    if texts is None:  # about 4 characters a token: enough files for the blocks, with room to spare
        texts = [f.text for f in stdlib_files(max_chars=8 * samples * max_length, max_file_chars=20_000)]
    blocks = pack_texts(tokenizer, texts, max_length)[:samples]
    if not blocks:
        raise ValueError(f"the calibration text holds fewer than max_length={max_length} tokens")
    if len(blocks) < samples:
        logger.warning("the calibration text fills %d blocks of %d tokens, not %d", len(blocks), max_length, samples)
    return blocks


def run(job: dict[str, Any]) -> None:
    """The job `calibrate` describes, where llm-compressor is installed (in this process, or started by
    `calibrate` through `hf_tfm.programs.run_program`)."""
    _calibrate(**job)


def _calibrate(
    path: str,
    output_dir: str,
    method: str,
    texts: list[str] | None,
    samples: int,
    max_length: int,
    trust_remote_code: bool = False,
) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    group = _check(model.config)
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    scheme = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": IGNORE}
    if method == "gptq":
        recipe = [GPTQModifier(**scheme)]
    elif method == "awq":
        mappings = [AWQMapping(smooth, balance) for smooth, balance in awq_mappings(model)]
        recipe = [AWQModifier(mappings=mappings), QuantizationModifier(**scheme)]
    else:
        recipe = [QuantizationModifier(**scheme)]
    data = {}
    if method != "rtn":
        blocks = _calibration_blocks(tokenizer, texts, samples, max_length)
        data = {
            "dataset": Dataset.from_dict({"input_ids": blocks, "attention_mask": [[1] * len(b) for b in blocks]}),
            "max_seq_length": max_length,
            "num_calibration_samples": len(blocks),
        }
    pin_memory = IntermediatesCache.pin_memory
    if not torch.accelerator.is_available():
        # llm-compressor 0.14's AWQ pins its cached activations for host-to-device copies, which raises without an
        # accelerator; on a CPU there is no copy to speed up.
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    try:
        oneshot(model=model, recipe=recipe, processor=tokenizer, **data)
    finally:
        IntermediatesCache.pin_memory = pin_memory
    model.save_pretrained(output_dir, save_compressed=True)
    tokenizer.save_pretrained(output_dir)


__all__ = ["METHODS", "awq_mappings", "calibrate", "llmcompressor_python"]
