"""Clocks and the machine: interleaved rounds, peak memory, the streaming bandwidth, and what else runs here.

Peak memory (CPU): bytes allocated by torch during one step above what was live when it began, from
``torch.profiler`` memory events (``profile_memory=True``: cumulative sum of the allocation/free events, maximum), on
one extra untimed step. On CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation at the start of the step.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import transformers
from torch import nn

from hf_tfm.inference.kernels import vector_isa
from hf_tfm.training import cpu_sample, free_cores


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternating(steps: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """The seconds each step returns, round by round, alternating which one goes first (A B, B A, ...)."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            times[n].append(steps[n]())
    return times


def interleaved(steps: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Run the steps round by round, alternating which one goes first (A B, B A, ...): each call's wall time."""
    return alternating({n: partial(timed, step) for n, step in steps.items()}, rounds)


def peak_step_memory(step: Callable[[], object], device: str) -> int:
    """Peak bytes allocated during one step above what was live at its start (see the module docstring)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak


def stream_bandwidth(mib: int, threads: int, reps: int = 5) -> dict:
    """This machine's streaming bandwidth: the best time of one-row products with an fp32 W of `mib` MiB (much larger
    than the caches), as every decode step's GEMVs read their weights: MKL's `F.linear(x, W)`, and Inductor's compiled
    `(x * W).sum(-1)` (`hf_tfm.inference.StreamingLinear`), which read W twice as fast as MKL on an AMD EPYC; the
    faster of the two is the rate (`kernel` names it)."""
    cols = 4096
    weight = torch.randn(mib * 2**20 // (4 * cols), cols)
    x = torch.randn(1, cols)
    kernels = {
        "mkl": lambda: nn.functional.linear(x, weight),
        "inductor": torch.compile(lambda: (x * weight).sum(-1), fullgraph=True),
    }
    best = {}
    with torch.no_grad():
        for name, kernel in kernels.items():
            kernel()  # warm-up (and compile)
            best[name] = min(timed(kernel) for _ in range(reps))
    kernel = min(best, key=best.get)
    nbytes = weight.numel() * weight.element_size()
    return {
        "bytes": nbytes,
        "best_s": best[kernel],
        "bytes_per_s": nbytes / best[kernel],
        "threads": threads,
        "kernel": kernel,
        "bytes_per_s_by_kernel": {name: nbytes / t for name, t in best.items()},
    }


def idle_free_cores(threads: int, when: str) -> int | None:
    """The cores other processes leave free, sampled for half a second while the bench itself is idle (Linux); warn
    when they are fewer than the bench's threads: torch's threads then wait on each other and every time is slower
    than the CPU share explains (6.6x for a 2-thread train step beside one busy process; docs/training.md)."""
    before = cpu_sample()
    if before is None:
        return None
    time.sleep(0.5)
    free = free_cores(before, cpu_sample())
    if free < threads:
        print(
            f"[bench] {when}: other processes use {before.cores - free} of {before.cores} cores; with {threads} "
            f"threads these timings are not those of a quiet machine (--threads {free}, or wait)",
            file=sys.stderr,
            flush=True,
        )
    return free


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15-minute load averages (other work on the machine; None where the OS has none)."""
    with contextlib.suppress(OSError, AttributeError):
        return os.getloadavg()
    return None


def machine_info(device: str) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": device,
    }
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    if caches := cpu_caches():
        info["caches"] = caches
    if device == "cpu":
        info["vector_isa"] = vector_isa()
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def cpu_caches() -> dict[str, str]:
    """The first core's cache sizes by level (`{"L1d": "48K", "L2": "1024K", "L3": "32768K"}`), as Linux lists them;
    empty elsewhere."""
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        with contextlib.suppress(OSError):
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
            suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
            caches[f"L{level}{suffix}"] = size
    return caches


def gpu_peak_bf16_flops(name: str) -> float | None:
    """Vendor dense bf16 peak for common GPUs (no sparsity), for MFU; None when unknown."""
    table = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "L4": 121e12}
    for key, val in table.items():
        if key in name:
            return val
    return None
