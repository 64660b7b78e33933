"""CPU threads that follow the cores other processes leave free (`FreeCoreThreads`, a Trainer callback every `hf-tfm`
training command uses), and the /proc/stat samples it reads.
"""

import math
import os
import time
from typing import NamedTuple

import torch
from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)


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


__all__ = ["CpuSample", "FreeCoreThreads", "cpu_sample", "free_cores"]
