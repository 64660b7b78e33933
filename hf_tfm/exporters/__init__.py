"""Exports of hf_tfm models to runtimes outside PyTorch, each checked against the model it came from.

`export(model_or_folder, out, format=..., quantize=None)` writes:

* `gguf`: one GGUF file for llama.cpp, written from the config and weights (`gguf.py`);
* `onnx`: ONNX graphs for ONNX Runtime, traced from hf_tfm's own code by `torch.export` (`onnx.py`);
* `ctranslate2`: a CTranslate2 model folder, its spec built from the config (`ctranslate2.py`);
* `executorch`: one XNNPACK `.pte` program for ExecuTorch's runtime, captured from hf_tfm's code (`executorch.py`).

A config a runtime does not compute exactly is refused with a `ValueError` naming every blocking knob. Each format is
one `ExportFormat` record in `FORMATS` (`registry.py`, which imports a format's module when it is first asked for),
which `export`, `verify`, `hf-tfm info` and the CLI ask; a format's own names (gguf's `gguf_architecture`, ...) come
from its module. The runtime's side of each verification is a program of `hf_tfm.programs`, in a process of its own.
`verify(exported, model_or_folder)` runs an export in its runtime, in a fresh process, and compares greedy tokens and
logits with the model. `hf_tfm.export` is `export`.
"""

import os
from pathlib import Path
from typing import Any

from .registry import FORMATS, ExportFormat, get_format


def quantize_types(format: str) -> list[str]:
    """The `quantize` values `format` takes (None, its first, is always accepted)."""
    return list(get_format(format).quantize)


def blockers(config: Any, format: str) -> list[str]:
    """Empty when `format` takes `config` exactly; else every knob that keeps it out (each message names the
    runtime)."""
    return get_format(format).blockers(config)


def export(
    model_or_folder: Any,
    out: str | os.PathLike,
    format: str = "gguf",
    quantize: str | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write an hf_tfm model (a model or its saved folder) in a runtime's format; returns the path written.

    gguf: one file for llama.cpp (an existing `out` folder gets `model-<type>.gguf`), weights in `quantize` (f32
    when None; f16, bf16, q8_0, q4_0; q4_k_m through llama.cpp's quantizer), the tokenizer embedded. onnx,
    ctranslate2 and executorch: a folder `out` with the model and the tokenizer's files. The tokenizer is the
    folder's, or `tokenizer` (a fast tokenizer, its folder or its tokenizer.json). Each is written beside `out` and
    renamed at the end, so a failed export leaves nothing.
    The runtime's writer is an optional dependency: `pip install "hf-tfm[export]"` (`"hf-tfm[executorch]"`).
    """
    return get_format(format).export(model_or_folder, out, quantize=quantize, tokenizer=tokenizer)


def output_path(out: str | os.PathLike, format: str = "gguf", quantize: str | None = None) -> Path:
    """Where an export to `out` is written: for gguf `out`, or `out/model-<type>.gguf` when `out` is a folder; for
    the other formats the folder `out`."""
    return get_format(format).output_path(out, quantize)


def format_of(exported: str | os.PathLike) -> str:
    """The format of an export on disk: a .gguf file, or a folder of .onnx graphs, of CTranslate2 or of ExecuTorch."""
    path = Path(exported)
    found = next((name for name, export_format in FORMATS.items() if export_format.recognizes(path)), None)
    if found is None:
        raise ValueError(
            f"{path}: not an hf_tfm export (a .gguf file, or a folder of .onnx graphs, of CTranslate2 or of "
            "ExecuTorch)."
        )
    return found


def verify(
    exported: str | os.PathLike,
    model_or_folder: Any,
    prompts: list[list[int]] | list[str] | None = None,
    max_new_tokens: int = 32,
    fresh_process: bool = True,
) -> dict[str, Any]:
    """Run `exported` in its runtime (in a fresh process unless `fresh_process=False`) and compare it with the hf_tfm
    model it came from: greedy tokens (`max_new_tokens` per prompt) and logits.

    `prompts` are token ids, or texts for the folder's tokenizer; None: two texts of different lengths. Returns at
    least `tokens_equal`, `agreement` (the share of generated positions with equal tokens) and `max_logit_diff`.
    """
    options = {"prompts": prompts, "max_new_tokens": max_new_tokens, "fresh_process": fresh_process}
    return FORMATS[format_of(exported)].verify(exported, model_or_folder, **options)


__all__ = ["FORMATS", "ExportFormat", "blockers", "export", "format_of", "output_path", "quantize_types", "verify"]
