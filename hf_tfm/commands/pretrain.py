"""`hf-tfm pretrain`: a causal LM on the user's text, from a preset (with a byte-level BPE trained on the text, or
`--tokenizer`) or continued from a checkpoint (`--task seq2seq` is `seq2seq.py`'s).
"""

import argparse
from pathlib import Path
from typing import Any

from ..scale_out import is_main_process
from .common import CliError
from .training_options import (
    add_training_args,
    card_metadata,
    check_options,
    held_out_split,
    settings_from,
    tokenizer_and_model,
)

DOC_PAGE = "docs/cli.md#subcommands (training: docs/training.md, seq2seq: docs/seq2seq.md)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm pretrain` and its options."""
    p = subparsers.add_parser(
        "pretrain", help="train a causal LM on your text (or --task seq2seq on source/target pairs)"
    )
    add_training_args(p, labelled=False)
    p.set_defaults(lora=False)  # pretraining trains every weight
    return p


def run(args: argparse.Namespace) -> int:
    """Train and save a causal LM; print its held-out loss and perplexity."""
    from ..data import load_texts
    from ..training import load_causal_lm, pretrain_causal_lm, training_job

    check_options(args)
    texts, eval_texts = held_out_split(
        args, load_texts(args.train_file, args.text_column), lambda path: load_texts(path, args.text_column), 0.1
    )
    settings = settings_from(args, max_steps=200, learning_rate=1e-3 if args.model is None else 3e-4)
    tokenizer, model = tokenizer_and_model(args, texts, settings)
    if args.model:
        model = load_causal_lm(args.model, trust_remote_code=args.trust_remote_code)
        source = f"continued from `{args.model}`"
    else:
        if not model.is_causal:
            raise CliError(f"--config {args.config} is an encoder (is_causal=False); pretrain needs a decoder")
        source = f"from scratch, config `{args.config}`"
        source += f", tokenizer `{args.tokenizer}`" if args.tokenizer else ""
    result = training_job(
        args.output_dir,
        lambda folder: pretrain_causal_lm(model, tokenizer, texts, eval_texts, settings, folder),
        lambda result: _card(args, settings.as_dict(), result, source=source, texts=len(texts)),
        overwrite=args.overwrite,
    )
    if not is_main_process():  # another rank of a multi-process launch: rank 0 wrote the folder and reports
        return 0
    print(f"saved {args.output_dir}: held-out loss {result['eval_loss']:.3f}, perplexity {result['perplexity']:.2f}")
    return 0


def _card(
    args: argparse.Namespace, settings: dict[str, Any], result: dict[str, Any], *, source: str, texts: int
) -> dict[str, Any]:
    """The model card's text (`hf_tfm.training.write_model_card`): where the model started, its data and metrics."""
    return {
        "title": f"Causal LM trained with hf-tfm on {Path(args.train_file).name}",
        "summary": f"Trained {source} with `hf-tfm pretrain`.",
        "data": [
            f"train: `{args.train_file}` ({texts} texts, {result['train_tokens']:,} tokens)",
            f"held out: `{args.eval_file or 'a 10% split of the train file'}` ({result['eval_tokens']:,} tokens)",
        ],
        "settings": settings,
        "metrics": {"held-out loss": result["eval_loss"], "perplexity": result["perplexity"]},
        "pipeline_tag": "text-generation",
        "auto_class": "AutoModelForCausalLM",
        **card_metadata(args),
    }
