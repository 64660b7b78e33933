"""The check every `hf-tfm` command makes before it writes an output folder: a folder that holds files is refused,
unless the user passed `--overwrite`.

The folder itself is then written all at once (`hf_tfm.checkpoint.staged_folder`); this check is what keeps a run
from replacing another model the user did not mean to lose.
"""

import os
from collections.abc import Callable
from pathlib import Path

# Files that make a folder look like a model: the refusal then says "another model" rather than "other files"
MODEL_MARKERS = ("config.json", "adapter_config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json")


class OutputDirError(ValueError):
    """The output folder cannot be written (it holds another model and --overwrite was not given, ...)."""


def check_output_dir(
    dst: str | os.PathLike, overwrite: bool = False, replaceable: Callable[[Path], bool] | None = None
):
    """Refuse a target that exists with content, unless `overwrite` or `replaceable(dst)` says it may be replaced."""
    dst = Path(dst)
    if not dst.exists():
        return
    if not dst.is_dir():
        raise OutputDirError(f"{dst} exists and is not a directory")
    if not any(dst.iterdir()) or overwrite or (replaceable is not None and replaceable(dst)):
        return
    what = "another model" if any((dst / m).exists() for m in MODEL_MARKERS) else "other files"
    raise OutputDirError(f"{dst} already holds {what}; choose another --output-dir or pass --overwrite to replace it")


__all__ = ["MODEL_MARKERS", "OutputDirError", "check_output_dir"]
