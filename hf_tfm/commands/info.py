"""`hf-tfm info`: a folder's, config file's or preset's config, parameter count and supported integrations."""

import argparse
import json

from .common import CliError

DOC_PAGE = "docs/cli.md#subcommands"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm info` and its options."""
    p = subparsers.add_parser("info", help="config, parameter count and supported integrations of a folder or preset")
    p.add_argument("target", help="model folder, config JSON or preset name")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--zero-ranks",
        type=int,
        metavar="N",
        help="also the memory per rank of each DeepSpeed ZeRO stage on N data-parallel ranks (model states: "
        "16-bit weights and gradients, fp32 AdamW states), with and without CPU offload",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Print `hf_tfm.info.describe`'s report, as text or as JSON."""
    from ..info import describe

    if args.zero_ranks is not None and args.zero_ranks < 1:
        raise CliError(f"--zero-ranks must be at least 1, got {args.zero_ranks}")
    report = describe(args.target, zero_ranks=args.zero_ranks)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(f"{report['source']}")
    print(f"  parameters: {report['parameters']:,} ({report['kind']})")
    sides = report["experts"] if report["kind"] == "encoder-decoder" else {"": report["experts"]}
    where = [
        f"top-{e['num_experts_per_tok']} of {e['num_experts']} experts in {side + ' ' if side else ''}layers "
        f"{e['sparse_layers']}"
        for side, e in sides.items()
        if e
    ]
    if where:
        print(f"  active parameters per token: {report['active_parameters']:,} ({'; '.join(where)})")
    print("  config:")
    for key, value in report["config"].items():
        print(f"    {key}: {value}")
    print("  integrations:")
    for group, entries in report["integrations"].items():
        print(f"    {group}:")
        for name, (ok, why) in entries.items():
            print(f"      {'yes' if ok else 'no ':3} {name}{': ' + why if why else ''}")
    if "zero_memory" in report:
        _print_zero_memory(report["zero_memory"])
    return 0


def _print_zero_memory(memory: dict) -> None:
    """The ZeRO table: one row per stage and offload, bytes per rank."""
    print(f"  DeepSpeed ZeRO memory per rank on {memory['ranks']} ranks (model states; activations come on top):")
    print(f"    {'stage':<6}{'offload':<18}{'weights':>11}{'gradients':>11}{'optimizer':>11}{'device':>11}{'CPU':>11}")
    for row in memory["rows"]:
        sizes = [format_bytes(row[key]) for key in ("params", "grads", "optimizer", "device", "cpu")]
        print(f"    {row['stage']:<6}{row['offload']:<18}" + "".join(f"{size:>11}" for size in sizes))


def format_bytes(size: int) -> str:
    """`size` bytes in the largest binary unit that keeps it at 1 or more (`1.50 GiB`, `512 B`)."""
    for unit in ("GiB", "MiB", "KiB"):
        scale = 1024 ** ("KMG".index(unit[0]) + 1)
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"
