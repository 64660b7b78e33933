"""Benchmark hf_tfm against transformers' in-tree models on equal work, in one process, interleaved round by round.

What each run measures is described where it is measured: the pairs and sizes in `bench.models`, the tasks in
`bench.steps`, the pair runs in `bench.pairs`, ``--decode-settings`` in `bench.decode`, ``--runtimes`` (with
``--ttft``) in `bench.runtimes`, ``--speculative`` in `bench.speculative`, ``--charts`` in `bench.charts`. The
report's header gives the load averages at the start and the end (the host is shared).

Usage: ``python scripts/bench.py --size small --rounds 5 --json bench.json``. See ``--help``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

from .charts import write_charts
from .decode import COMPILED, DECODE_SETTINGS, decode_settings
from .measure import gpu_peak_bf16_flops, idle_free_cores, load_average, machine_info, stream_bandwidth
from .models import ALL_TASKS, BANDWIDTH_MIB, PAIR_TASKS, SHAPES, SIZES
from .pairs import run_pairs
from .report import cold_markdown, decode_markdown, header, markdown, runtimes_markdown, speculative_markdown
from .runtimes import COLD_TOKENS, REFERENCE, RUNTIME_SETTINGS, TTFT_PROMPTS, runtimes
from .speculative import LOOKUP_TOKENS, SPECULATIVE_SETTINGS, speculative


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=[*SIZES, "all"], help="all = small and base")
    p.add_argument("--tasks", default=",".join(ALL_TASKS), help=f"comma list of {ALL_TASKS}")
    p.add_argument("--pairs", default=",".join(PAIR_TASKS), help=f"comma list of {','.join(PAIR_TASKS)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--attn", default="sdpa", help="attention backend for both models")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--markdown", default=None, help="also write the markdown table here")
    p.add_argument("--no-memory", action="store_true", help="skip the (profiler-based) peak-memory step")
    p.add_argument("--bf16-autocast", action="store_true", help="also time the train steps under bf16 autocast")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time static-cache generate() with compile_config, and a torch.compile'd hf_tfm train step",
    )
    _add_decoding_arguments(p)
    p.add_argument(
        "--compare-modeling",
        metavar="REV",
        default=None,
        help="also time hf_tfm's decoding against hf_tfm/modeling.py at git revision REV (same weights, interleaved)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="CUDA mode: bf16, MFU against the GPU's bf16 peak, and flash-attention vs sdpa (untested here)",
    )
    p.add_argument("--charts", metavar="DIR", default=None, help="write PNG charts of the results into DIR")
    p.add_argument(
        "--from-json",
        metavar="JSON",
        default=None,
        help="with --charts: draw the charts of this saved --json output instead of running the benchmark",
    )
    return p


def _add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    """The decoding runs instead of the pair tasks (weight settings, runtimes) and how they decode."""
    p.add_argument(
        "--decode-settings",
        default=None,
        help="instead of the pair tasks: decode hf_tfm and in-tree Llama under each weight setting (comma list of "
        f"{','.join(DECODE_SETTINGS)}, or all) against the measured streaming bandwidth; a setting with "
        f"{COMPILED} appended decodes with a static cache and compiled generate()",
    )
    p.add_argument(
        "--runtimes",
        default=None,
        help="instead of the pair tasks: decode the same hf_tfm weights in hf_tfm and exported to other runtimes, "
        f"each in a process of its own (comma list of {','.join(s.replace(' ', '_') for s in RUNTIME_SETTINGS)}, "
        "or all)",
    )
    lengths = " and ".join(map(str, TTFT_PROMPTS))
    p.add_argument(
        "--ttft",
        action="store_true",
        help=f"with --runtimes: also time each runtime's first token after a prompt of {lengths} tokens (batch 1), "
        "each in a process of its own",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help=f"with --runtimes: instead of the warm rows, each setting's first call ({COLD_TOKENS} new tokens, batch "
        "1) in a new process, timed from the process's start: with an empty store of compiled steps, then with the "
        "steps the first process compiled",
    )
    p.add_argument(
        "--padded",
        action="store_true",
        help="decode batches of prompts of different lengths (from the prompt length down to half of it), "
        "left-padded where a runtime takes one tensor (decode_b8, --decode-settings, --runtimes)",
    )
    p.add_argument("--bandwidth-mib", type=int, default=None, help="size of the bandwidth GEMV (default: by --size)")
    p.add_argument(
        "--speculative",
        default=None,
        help="instead of the pair tasks: greedy generate() through load_for_inference under each hf_tfm setting "
        f"(comma list of {','.join(SPECULATIVE_SETTINGS)}, or all), plain against prompt lookup and a draft model, "
        f"{LOOKUP_TOKENS} tokens proposed a round",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.from_json and not args.charts:
        p.error("--from-json needs --charts DIR")
    if args.ttft and not args.runtimes:
        p.error("--ttft times the runtimes: it needs --runtimes")
    if args.cold and (not args.runtimes or args.ttft):
        p.error("--cold times the runtimes' cold starts: it needs --runtimes, and goes without --ttft")
    args.sizes = ["small", "base"] if args.size == "all" else [args.size]
    args.task_list = [t for t in args.tasks.split(",") if t]
    if bad := set(args.task_list) - set(ALL_TASKS):
        p.error(f"unknown tasks {sorted(bad)}")
    args.pair_list = [x for x in args.pairs.split(",") if x]
    args.setting_list = _decode_settings(args.decode_settings, p)
    args.runtime_list = _runtimes(args.runtimes, p)
    args.speculative_list = _speculative(args.speculative, p)
    if sum(map(bool, (args.setting_list, args.runtime_list, args.speculative_list))) > 1:
        p.error("--decode-settings, --runtimes and --speculative are runs of their own: choose one")
    return args


def _speculative(chosen: str | None, p: argparse.ArgumentParser) -> list[str]:
    """The settings `--speculative` names."""
    if not chosen:
        return []
    settings = list(SPECULATIVE_SETTINGS) if chosen == "all" else chosen.split(",")
    if bad := set(settings) - set(SPECULATIVE_SETTINGS):
        p.error(f"unknown speculative settings {sorted(bad)}")
    return settings


def _decode_settings(chosen: str | None, p: argparse.ArgumentParser) -> list[str]:
    """The decode settings `--decode-settings` names, fp32 (the reference of every speedup) first when missing."""
    if not chosen:
        return []
    settings = list(DECODE_SETTINGS) if chosen == "all" else chosen.split(",")
    if bad := {x for x in settings if x.removesuffix(COMPILED) not in DECODE_SETTINGS}:
        p.error(f"unknown decode settings {sorted(bad)}")
    return settings if "fp32" in settings else ["fp32", *settings]


def _runtimes(chosen: str | None, p: argparse.ArgumentParser) -> list[str]:
    """The runtime settings `--runtimes` names (spaces written as underscores), hf_tfm fp32 (the reference of every
    speedup) first when missing."""
    if not chosen:
        return []
    names = {name.replace(" ", "_"): name for name in RUNTIME_SETTINGS}
    settings = list(names) if chosen == "all" else chosen.split(",")
    if bad := set(settings) - set(names):
        p.error(f"unknown runtimes {sorted(bad)}")
    settings = [names[x] for x in settings]
    return settings if REFERENCE in settings else [REFERENCE, *settings]


def main(argv: list[str] | None = None) -> dict:
    """Run what the arguments ask, print its table and write its files (or, with --from-json, only draw a saved run's
    charts); returns the run's output, as --json writes it."""
    args = parse_args(argv)
    if args.from_json:  # charts of a saved run, nothing timed
        with open(args.from_json) as f:
            out = json.load(f)
        for path in write_charts(out, Path(args.charts)):
            print(path)
        return out
    out = run(args, set_up(args), argv)
    write(out, args)
    return out


def set_up(args: argparse.Namespace) -> str:
    """Quiet the libraries, pick the device, its threads and dtype; the device."""
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    device = "cpu"
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu: CUDA is not available on this machine")
        device = "cuda"
        if args.dtype == "float32":
            args.dtype = "bfloat16"
    else:
        torch.set_num_threads(args.threads)
    args.torch_dtype = getattr(torch, args.dtype)
    args.mm_tput = {}
    args.peak_flops = gpu_peak_bf16_flops(torch.cuda.get_device_name()) if device == "cuda" else None
    torch.manual_seed(0)
    return device


def run(args: argparse.Namespace, device: str, argv: list[str] | None) -> dict:
    """The run's output: the machine (with its load before and after), the arguments, what was measured, and the
    markdown report."""
    t_start = time.time()
    load_start = load_average()
    free_start = idle_free_cores(torch.get_num_threads(), "at the start") if device == "cpu" else None
    measured = measure(args, device)
    out = {
        "machine": machine_info(device),
        "args": {k: v for k, v in vars(args).items() if k not in ("torch_dtype", "mm_tput")},
        "command": " ".join(
            [os.path.relpath(sys.argv[0]) if sys.argv else "scripts/bench.py", *(argv or sys.argv[1:])]
        ),
        "wall_s": time.time() - t_start,
        **measured,
    }
    machine = out["machine"]
    machine["loadavg_start"] = load_start  # 1/5/15-minute load averages: other work on the machine
    if (load_end := load_average()) is not None:
        machine["loadavg_end"] = load_end
    if device == "cpu":  # cores the other processes left free, before and after the bench (its own threads idle)
        machine["free_cores"] = [free_start, idle_free_cores(torch.get_num_threads(), "at the end")]
    out["markdown"] = f"{header(machine)}\n\n{table_of(out, args)}"
    return out


def measure(args: argparse.Namespace, device: str) -> dict:
    """What the run measures, as its output's keys: the pairs' results and extra rows; or the streaming bandwidth and
    the decode settings' or the runtimes' rows."""
    if args.speculative_list:  # plain, prompt-lookup and assisted generate() of one model, per setting
        return {"speculative": [row for size in args.sizes for row in speculative(size, args)]}
    if not (args.setting_list or args.runtime_list):
        results, extra = run_pairs(args, device)
        return {"results": results, "extra": extra}
    if args.cold:  # each runtime's first call in a new process, nothing else
        return {"cold": [row for size in args.sizes for row in runtimes(size, args, {})]}
    mib = args.bandwidth_mib or BANDWIDTH_MIB[args.sizes[0]]
    bandwidth = stream_bandwidth(mib, torch.get_num_threads())
    print(f"[bench] streaming bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
    measured = {"results": [], "extra": [], "bandwidth": bandwidth}
    if args.setting_list:  # hf_tfm and in-tree Llama under each weight setting
        settings = args.setting_list
        measured["decode"] = [row for size in args.sizes for row in decode_settings(size, settings, args, bandwidth)]
    if args.runtime_list:  # the same weights in each runtime, each in its own process
        measured["runtimes"] = [row for size in args.sizes for row in runtimes(size, args, bandwidth)]
    return measured


def table_of(out: dict, args: argparse.Namespace) -> str:
    """The markdown table of the run: the speculative calls', the runtimes', the decode settings' or the pairs'."""
    if "speculative" in out:
        return speculative_markdown(out["speculative"])
    if "cold" in out:
        return cold_markdown(out["cold"])
    batches = SHAPES[args.sizes[0]]["decode_batches"]
    if "runtimes" in out:
        ttft = TTFT_PROMPTS if args.ttft else ()
        return runtimes_markdown(out["runtimes"], out["bandwidth"], batches, ttft, args.padded)
    if "decode" in out:
        return decode_markdown(out["decode"], out["bandwidth"], batches)
    return markdown(out["results"], out["extra"])


def write(out: dict, args: argparse.Namespace) -> None:
    """Print the report; write the JSON, the markdown and the charts the arguments ask for."""
    print(out["markdown"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(out["markdown"] + "\n")
    if args.charts:
        for path in write_charts(out, Path(args.charts)):
            print(f"[bench] wrote {path}", file=sys.stderr, flush=True)
