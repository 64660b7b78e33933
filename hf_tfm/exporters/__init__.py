"""Exports of hf_tfm causal LMs to runtimes outside PyTorch, written from the config and weights themselves.

`export(model_or_folder, out, format="gguf", quantize=None)` writes a GGUF file for llama.cpp (`gguf.py`); a config no
runtime architecture computes exactly is refused with a `ValueError` naming every blocking knob. `verify` loads a
written file back through transformers' own loader and compares it with the model. `hf_tfm.export` is `export`.
"""

import os
from pathlib import Path
from typing import Any

from .gguf import TYPES as GGUF_TYPES
from .gguf import gguf_architecture, gguf_architecture_blockers, gguf_blockers, output_path, verify

FORMATS = ("gguf",)


def export(
    model_or_folder: Any,
    out: str | os.PathLike,
    format: str = "gguf",
    quantize: str | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write an hf_tfm causal LM (a `TfmForCausalLM` or its saved folder) in a runtime's format; returns the path.

    gguf: one file for llama.cpp (an `out` folder gets `model-<type>.gguf`), 2-D weights in `quantize` (f32 when
    None; f16, bf16, q8_0, q4_0), norms and biases in F32, and the tokenizer embedded: the folder's tokenizer.json, or
    `tokenizer` (a fast tokenizer, its folder or its tokenizer.json). It is written beside `out` and renamed at the
    end, so a failed export leaves no file. Needs the `gguf` package (`pip install "hf-tfm[export]"`).
    """
    if format != "gguf":
        raise ValueError(f"format={format!r}: hf_tfm exports {list(FORMATS)}.")
    from .gguf import export_gguf

    return export_gguf(model_or_folder, out, quantize=quantize, tokenizer=tokenizer)


__all__ = [
    "FORMATS",
    "GGUF_TYPES",
    "export",
    "gguf_architecture",
    "gguf_architecture_blockers",
    "gguf_blockers",
    "output_path",
    "verify",
]
