"""The benchmark `scripts/bench.py` runs: hf_tfm against transformers' in-tree models on equal work, under each
weight setting, and in other runtimes.

- `models`: the sizes and the pairs (an in-tree model and `hf_tfm.from_hf` of it)
- `measure`: clocks, interleaved rounds, peak memory, the streaming bandwidth and the machine's load
- `steps`: one unit of work per pair task, its tokens and FLOPs
- `pairs`: the pair tasks timed interleaved, and their extra rows
- `decode`: the weight settings (``--decode-settings``)
- `runtimes`: the runtimes, each in a process of its own (``--runtimes``, ``--ttft``)
- `report`: the markdown tables; `charts`: the PNG charts
- `cli`: the arguments, and what runs for them

- `runtime_worker`: one runtime's decoding, in a process of its own (run by path through `hf_tfm.programs.run_program`)

It is imported as `benchmark`, with scripts/ on the import path (scripts/bench.py, scripts/gpu_check.py and
scripts/quality.py put it there); the names below are what they and the tests use.
"""

import os
import sys

# hf_tfm from this checkout, installed or not
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from .charts import write_charts
from .cli import main
from .decode import DECODE_SETTINGS, load_setting
from .measure import gpu_peak_bf16_flops, interleaved, machine_info, peak_step_memory, sync
from .models import (
    ALL_TASKS,
    BANDWIDTH_MIB,
    NUM_LABELS,
    PAIR_TASKS,
    SHAPES,
    SIZES,
    Pair,
    build_pair,
    in_tree_model,
    n_params,
)
from .pairs import KERNELS_BY_TASK
from .runtimes import LLMCOMPRESSOR_PYTHON, TTFT_PROMPTS, calibration_python, in_process
from .steps import TRAIN_TASKS, train_flops

__all__ = [
    "ALL_TASKS",
    "BANDWIDTH_MIB",
    "DECODE_SETTINGS",
    "KERNELS_BY_TASK",
    "LLMCOMPRESSOR_PYTHON",
    "NUM_LABELS",
    "PAIR_TASKS",
    "SHAPES",
    "SIZES",
    "TRAIN_TASKS",
    "TTFT_PROMPTS",
    "Pair",
    "build_pair",
    "calibration_python",
    "gpu_peak_bf16_flops",
    "in_process",
    "in_tree_model",
    "interleaved",
    "load_setting",
    "machine_info",
    "main",
    "n_params",
    "peak_step_memory",
    "sync",
    "train_flops",
    "write_charts",
]
