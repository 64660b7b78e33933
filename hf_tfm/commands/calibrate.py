"""`hf-tfm calibrate`: calibrated int4 weights (GPTQ, AWQ; or uncalibrated RTN) through llm-compressor, written as a
compressed-tensors folder.
"""

import argparse
from pathlib import Path

from ..calibration import METHODS as CALIBRATION_METHODS
from .common import CliError, add_trust_remote_code, require_model_dir

DOC_PAGE = "docs/fast-inference.md#calibrated-4-bit-gptq-and-awq"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm calibrate` and its options."""
    p = subparsers.add_parser(
        "calibrate", help="calibrated int4 weights (GPTQ, AWQ) through llm-compressor, as a compressed-tensors folder"
    )
    p.add_argument("src", help="hf_tfm causal LM folder (with its tokenizer)")
    p.add_argument("dst", help="the quantized folder (transformers and vLLM load it)")
    p.add_argument(
        "--method", choices=list(CALIBRATION_METHODS), default="gptq", help="default: gptq; rtn: no calibration"
    )
    p.add_argument(
        "--text", action="append", help="calibration text file (repeatable; default: the Python standard library)"
    )
    p.add_argument("--samples", type=int, default=128, help="calibration blocks (default 128)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per block (default 512)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    add_trust_remote_code(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Quantize `src` into a staged folder that replaces `dst` once complete."""
    from ..calibration import calibrate
    from ..checkpoint import staged_folder
    from ..training import check_output_dir

    src = require_model_dir(args.src)
    texts = [Path(f).read_text(encoding="utf-8") for f in args.text] if args.text else None
    try:
        check_output_dir(args.dst, args.overwrite)
        with staged_folder(args.dst) as stage:
            calibrate(
                src,
                stage,
                args.method,
                texts=texts,
                samples=args.samples,
                max_length=args.max_length,
                trust_remote_code=args.trust_remote_code,
            )
    except (ImportError, ValueError) as err:  # no llm-compressor, or a model it cannot take: one line
        raise CliError(str(err)) from err
    print(f"calibrated {args.src} -> {args.dst} ({args.method}, int4 weights, compressed-tensors)")
    return 0
