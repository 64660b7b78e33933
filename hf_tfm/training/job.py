"""`training_job`, what every `hf-tfm` training command does with its output folder: refuse a folder that holds files
(without `--overwrite`), train into a staged copy, write the model card and `metrics.json`, then swap it into place.

A run that fails or is interrupted leaves the old folder as it was, and never a half-written model.
"""

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from ..checkpoint import staged_folder
from ..scale_out import is_main_process
from .model_card import write_model_card
from .output_dir import check_output_dir


def training_job(
    output_dir: str | os.PathLike,
    train: Callable[[Path], dict[str, Any]],
    card: Callable[[dict[str, Any]], dict[str, Any]],
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train one model into `output_dir`, all or nothing: stage the folder, train, write the model card and metrics.

    `train(folder)` trains, saves the model into the staged `folder` and returns its metrics (with `parameters`);
    `card(metrics)` gives the model card's text, `write_model_card`'s arguments but `config` (read back from the
    saved folder) and `parameters`. The metrics also go to `metrics.json`. The folder replaces `output_dir` only once
    all of it is written (`staged_folder`); an `output_dir` that holds files is refused without `overwrite`
    (`check_output_dir`). Returns the metrics.
    """
    check_output_dir(output_dir, overwrite)
    if not is_main_process():  # another rank of a multi-process launch trains beside rank 0, which writes the folder
        with tempfile.TemporaryDirectory(prefix="hf-tfm-rank-") as scratch:
            return train(Path(scratch))
    with staged_folder(output_dir) as folder:
        metrics = train(folder)
        config = AutoConfig.from_pretrained(folder)  # hf_tfm's registered classes: no code of the folder runs
        write_model_card(folder, config=config, parameters=metrics["parameters"], **card(metrics))
        (folder / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    return metrics


__all__ = ["training_job"]
