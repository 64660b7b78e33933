"""The export formats hf_tfm writes, one `ExportFormat` record each: the model classes it takes, its `quantize` types,
its blockers, its writer and its verification, and the runtime that runs it.

`FORMATS` names each format's module and loads it the first time the format is asked for, as vLLM's model registry
loads a model's module: listing the formats (`list(FORMATS)`, `--format`'s choices) imports no exporter. A format's
module defines its record as `FORMAT`; `export`, `verify`, `hf-tfm info` and the CLI ask `FORMATS`, so a new runtime
is a new module and its line in `FORMAT_MODULES`.
"""

import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# `hf-tfm info`'s note where a format's writer is not installed
INSTALL_NOTE = '; needs the writer: pip install "hf-tfm[export]"'


def same_path(out: str | os.PathLike, quantize: str | None = None) -> Path:
    """Where a format that writes a folder writes an export to `out`: `out` itself."""
    return Path(out)


@dataclass(frozen=True)
class ExportFormat:
    """One runtime hf_tfm exports to."""

    name: str  # `format=` in `hf_tfm.export`, `--format` of `hf-tfm export`
    title: str  # `hf-tfm info`'s row: the format and its runtime
    runtime: str  # what runs an export
    takes: tuple[str, ...]  # the model classes it exports
    quantize: tuple[str, ...]  # its `quantize=` values; the first is the default (None)
    requires: tuple[str, ...]  # the modules its writer imports
    blockers: Callable[[Any], list[str]]  # config -> every knob the runtime does not compute exactly (empty: none)
    refusal: Callable[[Any, str], str | None]  # (config, model class) -> why it is not exported, or None
    summary: Callable[[Any, str], str]  # (config, model class) -> what an export of it is
    export: Callable[..., Path]  # (model_or_folder, out, quantize=None, tokenizer=None) -> the path written
    verify: Callable[..., dict[str, Any]]  # (exported, model_or_folder, prompts, max_new_tokens, fresh_process)
    recognizes: Callable[[Path], bool]  # whether a path on disk is one of its exports
    output_path: Callable[..., Path] = same_path  # (out, quantize) -> where an export to `out` is written
    notes: dict[str, str] = field(default_factory=dict)  # `quantize` value -> what it needs beyond the writer

    def support(self, config: Any, architecture: str) -> tuple[bool, str]:
        """`hf-tfm info`'s answer: whether a model of this config and class exports, what that writes or why not."""
        reason = self.refusal(config, architecture)
        if reason is not None:
            return False, reason
        note = "" if all(map(_installed, self.requires)) else INSTALL_NOTE
        return True, f"{self.summary(config, architecture)} (`hf-tfm export --format {self.name}`){note}"

    def quantize_help(self) -> str:
        """Its `quantize` values for a help text: `f32 (default), f16, ..., q4_k_m (needs llama.cpp)`."""
        marks = {self.quantize[0]: "default", **self.notes}
        return ", ".join(f"{name} ({marks[name]})" if name in marks else name for name in self.quantize)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails to import, or a module set to None in sys.modules
        return False


# Each format -> the module of `hf_tfm.exporters` that defines it (its `FORMAT`), in the order `FORMATS` lists them and
# `format_of` tries them. Named, not imported: the modules sit above this one (they import `ExportFormat`), and each
# loads its runtime's helpers, so one loads only when its format is asked for.
FORMAT_MODULES = {"gguf": "gguf", "onnx": "onnx", "ctranslate2": "ctranslate2", "executorch": "executorch"}


class Formats(Mapping[str, ExportFormat]):
    """name -> `ExportFormat`: the names from `FORMAT_MODULES`, each record from its module on first use."""

    def __getitem__(self, name: str) -> ExportFormat:
        if name not in FORMAT_MODULES:
            raise KeyError(name)
        module = importlib.import_module(f"{__package__}.{FORMAT_MODULES[name]}")
        return module.FORMAT

    def __iter__(self) -> Iterator[str]:
        return iter(FORMAT_MODULES)

    def __len__(self) -> int:
        return len(FORMAT_MODULES)


FORMATS = Formats()


def get_format(name: str) -> ExportFormat:
    """The registered format `name`, or a `ValueError` naming those there are."""
    if name not in FORMATS:
        raise ValueError(f"format={name!r}: hf_tfm exports {list(FORMATS)}.")
    return FORMATS[name]


__all__ = ["FORMATS", "FORMAT_MODULES", "ExportFormat", "Formats", "get_format"]
