"""`hf-tfm export`: a model for llama.cpp (GGUF), ONNX Runtime, CTranslate2 or ExecuTorch (`hf_tfm.exporters`),
checked in that runtime with `--verify`.
"""

import argparse
import sys
from typing import Any

from .common import CliError, refuse_folder_code, require_model_dir

DOC_PAGE = "docs/deployment.md"

RUNTIMES = {"gguf": "llama.cpp", "onnx": "ONNX Runtime", "ctranslate2": "CTranslate2", "executorch": "ExecuTorch"}
# float32 encoder outputs: ONNX Runtime and CTranslate2 differ from PyTorch by ~1e-6 (summation order); llama.cpp's
# GELU rounds its input to fp16 and reads a table of the tanh form (its BERT graph: ~2e-3). Indexed by "is it GGUF".
ENCODER_TOLERANCE = (1e-4, 1e-2)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm export` and its options."""
    p = subparsers.add_parser(
        "export", help="a model for llama.cpp (GGUF), ONNX Runtime, CTranslate2 or ExecuTorch (hf_tfm.export)"
    )
    p.add_argument("src", help="hf_tfm model folder (with its tokenizer)")
    p.add_argument("dst", help="gguf: the .gguf file (a folder gets model-<type>.gguf); the other formats: a folder")
    from ..exporters import FORMATS  # the registry: each format's name and quantize types

    p.add_argument("--format", choices=list(FORMATS), default="gguf", help="default: gguf")
    p.add_argument(
        "--quantize",
        choices=sorted({qtype for export_format in FORMATS.values() for qtype in export_format.quantize}),
        metavar="TYPE",
        help="weight type; " + "; ".join(f"{name}: {f.quantize_help()}" for name, f in FORMATS.items()),
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="run the export in a fresh process (gguf: through transformers' GGUF loader where it reads the "
        "architecture, else in llama.cpp; the others: in the runtime) and compare greedy tokens and logits with "
        "hf_tfm's (exit 1 when a float32 export's differ)",
    )
    p.add_argument("--prompt", action="append", help="--verify prompt (repeatable; default: two code prompts)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="--verify: greedy tokens per prompt (default 32)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    return p


def run(args: argparse.Namespace) -> int:
    """Export `src`, print what was written; with `--verify`, run it in its runtime and report the agreement."""
    from ..exporters import export, output_path, verify

    src = require_model_dir(args.src)
    refuse_folder_code(src)
    dst = output_path(args.dst, args.format, args.quantize)
    if dst.exists() and not args.overwrite:
        raise CliError(f"{dst} exists; pass --overwrite to replace it")
    try:
        path = export(src, dst, format=args.format, quantize=args.quantize)
    except ImportError as err:  # the runtime's writer: one line naming what to install
        raise CliError(str(err)) from err
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files) / 2**20
    print(f"exported {args.src} -> {path} ({args.format}, {args.quantize or 'float32'}, {size:.1f} MiB)")
    if not args.verify:
        return 0
    report = verify(path, src, prompts=args.prompt, max_new_tokens=args.max_new_tokens)
    exact = args.quantize in (None, "f32", "float32")
    if "tokens_equal" not in report:  # an encoder: its outputs on a padded batch
        return _report_encoder(args, report, exact)
    return _report_decoder(args, report, exact)


def _report_encoder(args: argparse.Namespace, report: dict[str, Any], exact: bool) -> int:
    """Print how far the runtime's outputs are from hf_tfm's; 1 when a float32 export's are beyond the tolerance."""
    print(f"verified in {RUNTIMES[args.format]}: outputs {', '.join(report['outputs'])} on {report['prompts']}")
    print(f"  largest difference: {report['max_diff']:.3g}")
    _print_tokenizer_check(report)
    tolerance = ENCODER_TOLERANCE[args.format == "gguf"]
    if exact and report["max_diff"] > tolerance:
        error = f"hf-tfm export: error: the float32 export differs by more than {tolerance}"
        print(error, file=sys.stderr)
        return 1
    return 0


def _report_decoder(args: argparse.Namespace, report: dict[str, Any], exact: bool) -> int:
    """Print whether the runtime's greedy tokens are hf_tfm's, and the largest logit difference; 1 when a float32
    export's tokens differ."""
    agreement = f"{report['agreement']:.1%} of {report['prompts']} x {report['max_new_tokens']}"
    how = RUNTIMES[args.format]
    if args.format == "gguf" and report["runtime"] == "transformers":
        how = f"transformers' GGUF loader ({report['architecture']} -> {report['class']})"
    elif args.format == "gguf":
        how = f"{report['class']} ({report['architecture']})"
    print(f"verified with {how}:")
    print(f"  greedy tokens equal: {'yes' if report['tokens_equal'] else 'no'} ({agreement} positions agree)")
    print(f"  largest logit difference: {report['max_logit_diff']:.3g}")
    _print_tokenizer_check(report)
    if exact and not report["tokens_equal"]:
        print("hf-tfm export: error: the float32 export's greedy tokens differ from hf_tfm's", file=sys.stderr)
        return 1
    return 0


def _print_tokenizer_check(report: dict) -> None:
    """A GGUF's verify also tokenizes varied text in llama.cpp and with the folder's tokenizer (other formats run the
    folder's own tokenizer, so they have nothing to compare)."""
    if "tokenizer_agreement" not in report:
        return
    if report["tokenizer_agreement"] is None:
        print(f"  tokenizer: not compared ({report['tokenizer_skipped']})")
        return
    texts, differs = report["tokenizer_texts"], len(report["tokenizer_differs"])
    print(f"  tokenizer: the same ids on {texts - differs} of {texts} texts ({report['tokenizer_chars']} characters)")
