"""`hf-tfm generate`: a prompt continued by a causal LM folder (a seq2seq folder: its output), streamed as it decodes,
optionally quantized and compiled (`hf_tfm.load_for_inference`).
"""

import argparse
import logging
from typing import Any

from ..inference.quantize import SETTINGS as QUANTIZE_SETTINGS
from .common import CliError, add_trust_remote_code, load_tokenizer, require_model_dir

DOC_PAGE = "docs/cli.md#subcommands (--quantize: docs/fast-inference.md)"

# `--quantize` settings, from the one table of them (`hf_tfm.inference.quantize.SETTINGS`)
QUANTIZE_HELP = {
    name: setting.summary if setting.native else f"{setting.summary} (needs {setting.pip_spec})"
    for name, setting in QUANTIZE_SETTINGS.items()
}
NATIVE_QUANTIZATION = [name for name, setting in QUANTIZE_SETTINGS.items() if setting.native]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm generate` and its options."""
    p = subparsers.add_parser(
        "generate", help="continue a prompt with a causal LM folder (seq2seq: its output), streaming"
    )
    p.add_argument("model", help="model folder (with tokenizer)")
    p.add_argument("--prompt", required=True)
    add_trust_remote_code(p)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--no-stream", action="store_true", help="print the text once at the end")
    p.add_argument(
        "--draft",
        metavar="FOLDER",
        help="speculative decoding: a smaller causal LM folder on the same tokenizer drafts tokens that the model "
        "checks several at a time (loaded with the same --quantize and --dtype; docs/speculative.md)",
    )
    p.add_argument(
        "--prompt-lookup",
        type=int,
        metavar="K",
        help="speculative decoding without a draft model: up to K tokens copied from where the text repeats itself",
    )
    p.add_argument(
        "--quantize",
        choices=list(QUANTIZE_HELP),
        help="quantize the weights while loading, for faster CPU decoding (docs/fast-inference.md): "
        + "; ".join(f"{k} = {v}" for k, v in QUANTIZE_HELP.items()),
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="dtype of the weights (default: the checkpoint's; with --quantize, of the unquantized ones)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode with a static cache and a compiled step (hf_tfm.load_for_inference: on a CPU, a causal LM's step "
        "compiled ahead of time, once per machine and model, beside the first run's decoding; `hf-tfm compile` does "
        f"it beforehand); always on with --quantize {'/'.join(NATIVE_QUANTIZATION)}",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Load the folder as asked, decode the prompt's continuation, stream it (or print it at the end)."""
    import torch
    from transformers import TextStreamer

    require_model_dir(args.model)
    if args.prompt_lookup is not None and args.prompt_lookup < 1:
        raise CliError(f"--prompt-lookup takes a number of tokens of 1 or more, got {args.prompt_lookup}")
    if args.draft and args.prompt_lookup:
        raise CliError("--draft and --prompt-lookup are two ways to draft tokens: pick one")
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    model = _load_model(args, args.model)
    options = _generation_options(args)
    if args.draft:
        options["assistant_model"] = _load_model(args, require_model_dir(args.draft))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    inputs.pop("token_type_ids", None)
    streamer = None if args.no_stream else TextStreamer(tokenizer, skip_special_tokens=True)
    with torch.no_grad():
        output = model.generate(**inputs, streamer=streamer, **options)
    if args.no_stream:
        print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0


def _load_model(args: argparse.Namespace, folder: str) -> Any:
    """The model in `folder`, quantized and compiled as `--quantize`, `--compile` and `--dtype` ask."""
    from ..inference import load_for_inference
    from ..inference.quantize import QuantizationUnavailableError

    if args.quantize:  # bitsandbytes logs a line per matmul (input casts) and one for an optional Hub kernel
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        # hf_tfm's own int8 is made for the compiled step
        compile = args.compile or args.quantize in NATIVE_QUANTIZATION
        return load_for_inference(
            folder,
            quantize=args.quantize,
            compile=compile,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
        )
    except (QuantizationUnavailableError, ValueError) as err:
        raise CliError(str(err)) from err


def _generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """`generate()`'s options: greedy, or sampling at the temperature, top-k and top-p given; a repetition penalty."""
    options: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    if args.greedy:
        options["do_sample"] = False
    else:
        options.update(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.repetition_penalty is not None:
        options["repetition_penalty"] = args.repetition_penalty
    if args.prompt_lookup is not None:
        options["prompt_lookup_num_tokens"] = args.prompt_lookup
    return options
