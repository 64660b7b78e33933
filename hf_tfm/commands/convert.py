"""`hf-tfm convert`: a folder converted to or from an in-tree transformers family (`hf_tfm.convert`)."""

import argparse
from pathlib import Path

from .common import CliError, refuse_folder_code

DOC_PAGE = "docs/convert.md"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm convert` and its options."""
    p = subparsers.add_parser("convert", help="convert between hf_tfm and an in-tree transformers family")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--overwrite", action="store_true")
    return p


def run(args: argparse.Namespace) -> int:
    """Convert `src` into a staged folder that replaces `dst` once complete."""
    from ..checkpoint import staged_folder
    from ..training import check_output_dir

    try:
        from ..convert import convert_path
    except ImportError as err:
        raise CliError(f"conversion is not available in this installation ({err})") from err
    if not Path(args.src).exists() and "/" not in args.src:
        raise CliError(f"{args.src}: no such model folder")
    refuse_folder_code(args.src)
    check_output_dir(args.dst, args.overwrite)
    with staged_folder(args.dst) as stage:
        result = convert_path(args.src, stage)
    print(f"converted {args.src} -> {args.dst} ({type(result).__name__}, model_type {result.config.model_type})")
    return 0
