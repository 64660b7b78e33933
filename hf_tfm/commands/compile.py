"""`hf-tfm compile`: compile a causal LM folder's decode steps for this machine now, so that no process decoding with
it later (`hf-tfm generate`, a server, a notebook) compiles on its first call: `hf_tfm.inference.precompile`.
"""

import argparse
import time

from ..inference.quantize import SETTINGS as QUANTIZE_SETTINGS
from .common import CliError, add_trust_remote_code, require_model_dir

DOC_PAGE = "docs/fast-inference.md#compiled-once-per-machine"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm compile` and its options."""
    p = subparsers.add_parser(
        "compile", help="compile a causal LM folder's decode steps for this machine, so that none compiles later"
    )
    p.add_argument("model", help="causal LM folder")
    p.add_argument(
        "--quantize", choices=list(QUANTIZE_SETTINGS), help="the setting the model will be loaded with (as generate)"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="the dtype it will be loaded with (as generate)")
    p.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=[1],
        help="each batch size generate() will decode (one library each; default: 1)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the speculative decoding verify step's library")
    add_trust_remote_code(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Load the folder as `hf-tfm generate` would, compile (or find) every library, and say how long a later process
    takes to load them."""
    from ..inference import load_for_inference, precompile, step_blockers
    from ..inference.quantize import QuantizationUnavailableError
    from ..inference.step_store import steps_folder

    require_model_dir(args.model)
    if any(size < 1 for size in args.batch_size):
        raise CliError(f"--batch-size takes sizes of 1 or more, got {args.batch_size}")
    try:
        model = load_for_inference(
            args.model, quantize=args.quantize, dtype=args.dtype, trust_remote_code=args.trust_remote_code
        )
    except (QuantizationUnavailableError, ValueError) as err:
        raise CliError(str(err)) from err
    if getattr(model, "compiled_decode_step", None) is None:
        reasons = "; ".join(step_blockers(model)) or "its weights' quantizer does not export"
        raise CliError(f"{args.model}: no step to compile ahead of time ({reasons}); generate() compiles it itself")
    compiled = precompile(model, tuple(args.batch_size), verify=not args.no_verify)
    for what, seconds in compiled.items():
        print(f"compiled the decode step ({what}) in {seconds:.1f} s")
    start = time.perf_counter()  # what a later process does: load the folder, find every library in the store
    fresh = load_for_inference(
        args.model, quantize=args.quantize, dtype=args.dtype, trust_remote_code=args.trust_remote_code
    )
    if precompile(fresh, tuple(args.batch_size), verify=not args.no_verify):
        raise CliError(f"the compiled steps did not reach the store ({steps_folder()}): is it writable?")
    print(
        f"stored in {steps_folder()}: a new process loads this model with its steps in "
        f"{time.perf_counter() - start:.1f} s, compiling nothing"
    )
    return 0
