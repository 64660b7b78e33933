"""`hf-tfm info`: a folder's, config file's or preset's config, parameter count and supported integrations."""

import argparse
import json

DOC_PAGE = "docs/cli.md#subcommands"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm info` and its options."""
    p = subparsers.add_parser("info", help="config, parameter count and supported integrations of a folder or preset")
    p.add_argument("target", help="model folder, config JSON or preset name")
    p.add_argument("--json", action="store_true")
    return p


def run(args: argparse.Namespace) -> int:
    """Print `hf_tfm.info.describe`'s report, as text or as JSON."""
    from ..info import describe

    report = describe(args.target)
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
    return 0
