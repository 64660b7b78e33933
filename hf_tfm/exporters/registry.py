"""The export formats hf_tfm writes, one `ExportFormat` record each: the model classes it takes, its `quantize` types,
its blockers, its writer and its verification, and the runtime that runs it.

A format's module builds its record and `register`s it on import (`hf_tfm/exporters/__init__.py` imports them, in the
order `FORMATS` lists them); `export`, `verify`, `hf-tfm info` and the CLI's `--format` / `--quantize` ask `FORMATS`,
so a new runtime is a new module and its import line.
"""

import importlib.util
import os
from collections.abc import Callable
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


FORMATS: dict[str, ExportFormat] = {}


def register(export_format: ExportFormat) -> ExportFormat:
    """Add a format to `FORMATS` (its module calls this on import)."""
    if export_format.name in FORMATS:
        raise ValueError(f"An export format `{export_format.name}` is already registered.")
    FORMATS[export_format.name] = export_format
    return export_format


def get_format(name: str) -> ExportFormat:
    """The registered format `name`, or a `ValueError` naming those there are."""
    if name not in FORMATS:
        raise ValueError(f"format={name!r}: hf_tfm exports {list(FORMATS)}.")
    return FORMATS[name]


__all__ = ["FORMATS", "ExportFormat", "get_format", "register"]
