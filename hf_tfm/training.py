"""Small training helpers for `Trainer` and custom loops: a padding collator that needs no tokenizer, and CPU
threads that follow the cores other processes leave free.

Padding-free packing needs nothing from here: use `transformers.DataCollatorWithFlattening`, whose `position_ids`
restart at 0 in every packed sequence; hf_tfm keeps each packed sequence to itself (decoder and encoder).
"""

import math
import os
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)


class PadCollator:
    """Pad a list of `{"input_ids": [...], "labels": ...}` examples into a batch, with no tokenizer.

    - `input_ids` are padded with `pad_token_id` (right padding by default) and an `attention_mask` is added.
    - List `labels` (causal LM, masked LM, token classification, seq2seq targets) are padded to their own longest
      row with `label_pad_token_id` (-100, which the losses ignore); scalar labels (sequence classification) are
      stacked. A seq2seq model builds its decoder inputs from them.
    - Without `labels`, a causal LM gets `labels = input_ids` with padding ignored (`labels_from_inputs=True`).
    - Any other list-valued key of the same length as `input_ids` (`token_type_ids`) is padded with 0.
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        label_pad_token_id: int = -100,
        padding_side: str = "right",
        labels_from_inputs: bool = True,
    ) -> None:
        if padding_side not in ("left", "right"):
            raise ValueError(f"`padding_side` must be 'left' or 'right', got {padding_side!r}.")
        self.pad_token_id = pad_token_id
        self.label_pad_token_id = label_pad_token_id
        self.padding_side = padding_side
        self.labels_from_inputs = labels_from_inputs

    def _pad(self, rows: Sequence[Sequence[int]], length: int, value: int) -> torch.Tensor:
        out = torch.full((len(rows), length), value, dtype=torch.long)
        for i, row in enumerate(rows):
            row = torch.as_tensor(row, dtype=torch.long)
            if self.padding_side == "right":
                out[i, : len(row)] = row
            else:
                out[i, length - len(row) :] = row
        return out

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        ids = [list(e["input_ids"]) for e in examples]
        length = max(len(row) for row in ids)
        batch = {
            "input_ids": self._pad(ids, length, self.pad_token_id),
            "attention_mask": self._pad([[1] * len(row) for row in ids], length, 0),
        }
        for key in examples[0]:
            if key in ("input_ids", "attention_mask", "labels"):
                continue
            batch[key] = self._pad([list(e[key]) for e in examples], length, 0)
        if "labels" in examples[0]:
            labels = [e["labels"] for e in examples]
            if isinstance(labels[0], (int, float)) or torch.as_tensor(labels[0]).ndim == 0:
                batch["labels"] = torch.as_tensor(labels)
            else:
                rows = [list(row) for row in labels]
                batch["labels"] = self._pad(rows, max(len(row) for row in rows), self.label_pad_token_id)
        elif self.labels_from_inputs:
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, self.label_pad_token_id)
        return batch


class CpuSample(NamedTuple):
    """CPU time used on the `cores` this process may run on up to `wall`: by everything (`busy_s`) and by this process
    (`own_s`)."""

    cores: int
    wall: float
    busy_s: float
    own_s: float


def cpu_sample(stat: str | None = None) -> CpuSample | None:
    """Read Linux's /proc/stat (or `stat`, its text) for the cores this process may run on; None elsewhere."""
    if stat is None:
        try:
            stat = open("/proc/stat", encoding="ascii").read()  # noqa: SIM115 (one read of a pseudo-file)
        except OSError:
            return None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    busy, cores = 0, 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (allowed is not None and int(name[3:]) not in allowed):
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])  # guest is inside user
        busy += user + nice + system + irq + softirq + steal  # steal: the hypervisor gave the core to another guest
        cores += 1
    return CpuSample(cores, time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time())


def free_cores(before: CpuSample, after: CpuSample) -> int:
    """The cores other processes left free between two samples, at least 1: a core counts as taken when the others
    used half of one or more."""
    others = (after.busy_s - before.busy_s - (after.own_s - before.own_s)) / max(after.wall - before.wall, 1e-6)
    return max(1, after.cores - math.floor(max(others, 0.0) + 0.5))


class FreeCoreThreads(TrainerCallback):
    """Keep torch's CPU threads to the cores that other processes leave free, so that training on a shared machine
    slows down by about its share of the CPU rather than by 5-10x.

    torch's OpenMP threads meet at a barrier after every parallel region and spin there; when one of them shares its
    core with another busy process, the others spin until the scheduler gives that core back. On 2 cores with one
    other CPU-bound process, `hf-tfm pretrain` ran 6.6x slower with 2 threads, 1.7x slower with 1 (docs/training.md).
    Every `every_s` seconds (of training, evaluation or prediction steps) this measures the CPU the other processes
    used (/proc/stat minus this process's own time) and sets `torch.set_num_threads` to the cores left, between 1 and
    the thread count it found at the start (`OMP_NUM_THREADS` or torch's default); leaving the `with` block restores
    that count. Where /proc/stat does not exist it does nothing.

        with FreeCoreThreads() as threads:
            Trainer(..., callbacks=[threads]).train()
    """

    def __init__(self, every_s: float = 5.0, first_s: float = 0.25) -> None:
        self.every_s, self.first_s = every_s, first_s
        self.max_threads = torch.get_num_threads()
        self._last: CpuSample | None = None
        self._off = False  # one thread to start with (torchrun's ranks, OMP_NUM_THREADS=1), or no /proc/stat

    def __enter__(self) -> "FreeCoreThreads":
        self.max_threads, self._off = torch.get_num_threads(), False
        return self

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.max_threads)

    def adapt(self) -> None:
        """Measure the other processes' CPU use since the last call and set the thread count from it."""
        now = None if self._off or self.max_threads == 1 else cpu_sample()
        if now is None:  # nothing to adapt: stop looking (steps call this every time otherwise)
            self._off = True
            return
        if self._last is not None:
            threads = min(free_cores(self._last, now), self.max_threads)
            if threads != torch.get_num_threads():
                logger.info("%d of %d cores free: %d torch threads", threads, now.cores, threads)
                torch.set_num_threads(threads)
        self._last = now

    def _maybe_adapt(self) -> None:
        if not self._off and (self._last is None or time.monotonic() - self._last.wall >= self.every_s):
            self.adapt()

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = None
        self.adapt()  # a first look before the first step: a short idle window that is all others' time
        if not self._off:
            time.sleep(self.first_s)
            self.adapt()

    def on_step_end(self, args, state, control, **kwargs):
        self._maybe_adapt()

    def on_prediction_step(self, args, state, control, **kwargs):
        self._maybe_adapt()


__all__ = ["CpuSample", "FreeCoreThreads", "PadCollator", "cpu_sample", "free_cores"]
