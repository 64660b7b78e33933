"""`hf-tfm`: from raw text to a trained, shareable model, and the same steps on your own data.

    hf-tfm demo [--quick]                      the main job, on the Python standard library's own text
    hf-tfm pretrain --train-file F ...         a causal LM on your text (from a preset or an existing checkpoint)
    hf-tfm finetune --train-file F ...         a sequence classifier on your labelled data (full or LoRA)
    hf-tfm pretrain|finetune --task seq2seq    an encoder-decoder on your source/target pairs
    hf-tfm generate DIR --prompt TEXT          streamed sampling from a causal LM folder (or a seq2seq one's output)
    hf-tfm compile DIR                         compile a causal LM folder's decode steps for this machine, once
    hf-tfm classify DIR TEXT... | --file F     labels and scores from a classifier folder
    hf-tfm push DIR --repo-id ID               upload a folder to the Hugging Face Hub (HF_ENDPOINT is honoured)
    hf-tfm serve DIR [-- ENGINE_ARGS]          an OpenAI-compatible server (vLLM or transformers serve)
    hf-tfm info PATH_OR_PRESET                 config, parameter count, supported integrations
    hf-tfm convert SRC DST                     to/from an in-tree transformers family (hf_tfm.convert)
    hf-tfm calibrate SRC DST --method METHOD   calibrated int4 weights (GPTQ, AWQ) through llm-compressor
    hf-tfm export SRC DST --format FORMAT      a model for llama.cpp, ONNX Runtime, CTranslate2, ExecuTorch

This module parses the options every command shares and dispatches; each command is one module of
`hf_tfm.commands`, with its options (`add_parser`), its body (`run`) and its documentation page (`DOC_PAGE`).
Errors in the user's input exit with status 1 and a one-line message; argparse usage errors exit with status 2.
Training, data and Hub imports happen inside the commands that need them.
"""

import argparse
import logging
import os
import signal
import sys
import threading
import warnings
from typing import Any

from .commands import (
    calibrate,
    classify,
    compile,
    convert,
    demo,
    export,
    finetune,
    generate,
    info,
    pretrain,
    push,
    seq2seq,
    serve,
)
from .commands.common import CliError

# The commands, in the order `hf-tfm --help` lists them.
COMMANDS = {
    "demo": demo,
    "pretrain": pretrain,
    "finetune": finetune,
    "generate": generate,
    "compile": compile,
    "classify": classify,
    "push": push,
    "serve": serve,
    "info": info,
    "convert": convert,
    "calibrate": calibrate,
    "export": export,
}

# `pretrain|finetune --task seq2seq`: an encoder-decoder, trained by its own module whichever command asked.
TASKS = {"seq2seq": seq2seq}

# The documentation page of each command (docs/ in the repository; `make docs` builds it into a site).
DOC_PAGES = {name: module.DOC_PAGE for name, module in COMMANDS.items()}


def build_parser() -> argparse.ArgumentParser:
    """The `hf-tfm` argument parser with all subcommands."""
    parser = argparse.ArgumentParser(
        prog="hf-tfm",
        description="Train, use and share hf_tfm transformers.",
        epilog="Documentation: docs/index.md (docs/cli.md for the commands); `COMMAND --help` names its page.",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="more logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        command = module.add_parser(sub)
        command.epilog = "\n".join(filter(None, [command.epilog, f"Documentation: {DOC_PAGES[name]}"]))
    return parser


def _error_text(err: BaseException, args: argparse.Namespace) -> str:
    """The error as printed; transformers' refusal to run a folder's code also says what to do on the command line."""
    text = str(err)
    if "trust_remote_code=True" not in text:
        return text
    if hasattr(args, "trust_remote_code"):
        return f"{text}\n(on the command line: add --trust-remote-code to run that code, if you trust it)"
    return f"{text}\n(hf-tfm {args.command} runs only installed code, hf_tfm's and transformers', never a folder's)"


def _configure_logging(verbose: bool) -> None:
    """hf_tfm's INFO with `-v`; otherwise warnings, and of transformers and the noisy imports, errors only."""
    # PEFT calls a transformers API that 5.x renamed; the warning is not actionable for users of the CLI.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hf_tfm").setLevel(logging.INFO if verbose else logging.WARNING)
    # Where torchao is installed, transformers imports it with every model: its CUDA-only extensions fail to load
    # on a CPU and torch warns about its enum registrations. Neither is actionable here.
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_info() if verbose else hf_logging.set_verbosity_error()
    hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hf-tfm` console script; returns the exit status."""
    argv, passthrough = sys.argv[1:] if argv is None else list(argv), []
    if "--" in argv:  # `serve`: what follows goes to the engine's server
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if passthrough and args.command != "serve":
        build_parser().error(f"`--` passes arguments to a server: only `hf-tfm serve` takes them, not {args.command}")
    args.passthrough = passthrough
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _configure_logging(args.verbose)

    from .data import DataError
    from .training import OutputDirError

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds through the staged output folder, which deletes the half-written folder

    # SIGTERM unwinds as Ctrl-C does, so that a command writing a folder deletes its half-written one. Python installs
    # a handler from the main thread only (a caller may run `main` on another: it keeps its process's handling). A
    # server writes no folder and keeps its engine's own handling, as `transformers serve` has it: with continuous
    # batching on 5.16-5.19, its threads outlive the KeyboardInterrupt, and the process never exited.
    handles_sigterm = threading.current_thread() is threading.main_thread() and args.command != "serve"
    previous = signal.signal(signal.SIGTERM, _terminate) if handles_sigterm else None
    module = TASKS.get(getattr(args, "task", None), COMMANDS[args.command])
    try:
        return module.run(args) or 0
    except (CliError, DataError, OutputDirError) as err:
        print(f"hf-tfm {args.command}: error: {_error_text(err, args)}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError, OSError) as err:  # bad configs (ValueError), unloadable checkpoints (OSError)
        print(f"hf-tfm {args.command}: error: {_error_text(err, args)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hf-tfm {args.command}: interrupted; no output folder was left behind", file=sys.stderr)
        return 130
    finally:
        if handles_sigterm:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
