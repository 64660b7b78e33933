"""Exports of hf_tfm models to runtimes outside PyTorch, each checked against the model it came from.

`export(model_or_folder, out, format=..., quantize=None)` writes:

* `gguf`: one GGUF file for llama.cpp, written from the config and weights (`gguf.py`);
* `onnx`: ONNX graphs for ONNX Runtime, traced from hf_tfm's own code by `torch.export` (`onnx.py`);
* `ctranslate2`: a CTranslate2 model folder, its spec built from the config (`ctranslate2.py`);
* `executorch`: one XNNPACK `.pte` program for ExecuTorch's runtime, captured from hf_tfm's code (`executorch.py`).

A config a runtime does not compute exactly is refused with a `ValueError` naming every blocking knob.
`verify(exported, model_or_folder)` runs an export in its runtime, in a fresh process, and compares greedy tokens and
logits with the model. `hf_tfm.export` is `export`.
"""

import os
from importlib import import_module
from pathlib import Path
from typing import Any

from .gguf import TYPES as GGUF_TYPES
from .gguf import gguf_architecture, gguf_architecture_blockers, gguf_blockers

# format -> the module that writes it; each has `export_<format>`, `verify_<format>`, `<format>_blockers` and `TYPES`
# (its --quantize values; None is float32).
FORMATS = {"gguf": "gguf", "onnx": "onnx", "ctranslate2": "ctranslate2", "executorch": "executorch"}


def _module(format: str):
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: hf_tfm exports {list(FORMATS)}.")
    return import_module(f".{FORMATS[format]}", __name__)


def quantize_types(format: str) -> list[str]:
    """The `quantize` values `format` takes (None, float32, is always accepted)."""
    return list(_module(format).TYPES)


def blockers(config: Any, format: str) -> list[str]:
    """Empty when `format` takes `config` exactly; else every knob that keeps it out (each message names the
    runtime)."""
    return getattr(_module(format), f"{format}_blockers")(config)


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
    return getattr(_module(format), f"export_{format}")(model_or_folder, out, quantize=quantize, tokenizer=tokenizer)


def output_path(out: str | os.PathLike, format: str = "gguf", quantize: str | None = None) -> Path:
    """Where an export to `out` is written: for gguf `out`, or `out/model-<type>.gguf` when `out` is a folder; for
    the other formats the folder `out`."""
    if format == "gguf":
        from .gguf import output_path as gguf_path

        return gguf_path(out, quantize)
    _module(format)  # an unknown format fails here
    return Path(out)


def format_of(exported: str | os.PathLike) -> str:
    """The format of an export on disk: a .gguf file, or a folder of .onnx graphs, of CTranslate2 or of ExecuTorch."""
    path = Path(exported)
    if path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and any(path.glob("*.onnx")):
        return "onnx"
    if (path / "model.bin").is_file():
        return "ctranslate2"
    if (path / "model.pte").is_file():
        return "executorch"
    raise ValueError(
        f"{path}: not an hf_tfm export (a .gguf file, or a folder of .onnx graphs, of CTranslate2 or of ExecuTorch)."
    )


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
    format = format_of(exported)
    check = getattr(_module(format), f"verify_{format}")
    options = {"prompts": prompts, "max_new_tokens": max_new_tokens, "fresh_process": fresh_process}
    return check(exported, model_or_folder, **options)


__all__ = [
    "FORMATS",
    "GGUF_TYPES",
    "blockers",
    "export",
    "format_of",
    "gguf_architecture",
    "gguf_architecture_blockers",
    "gguf_blockers",
    "output_path",
    "quantize_types",
    "verify",
]
