"""What `hf-tfm pretrain` and `hf-tfm finetune` (and their `--task seq2seq` path) share: their options, the checks
on them, the held-out split, the training settings, and the choice of tokenizer and model to train.
"""

import argparse
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import CliError, add_trust_remote_code, is_consent_error, load_tokenizer, require_model_dir

if TYPE_CHECKING:
    from ..training import TrainSettings

DEFAULT_VOCAB_SIZE = 2048  # of the byte-level BPE trained when neither --model nor --tokenizer gives a tokenizer
DEFAULT_CONFIGS = {"pretrain": "tiny-decoder", "finetune": "tiny-encoder"}

# What training reads of the tokenizer's special tokens, by task (a given tokenizer may lack any of them).
TOKENIZER_ROLES = {
    "causal-lm": {"eos_token": "packing ends each text with it"},
    "seq2seq": {
        "eos_token": "each target ends with it",
        "pad_token": "batches of sources and targets are padded with it",
        "bos_token": "the decoder starts from it",
    },
}


def add_training_args(p: argparse.ArgumentParser, labelled: bool) -> None:
    """The options of `pretrain` (`labelled=False`) and `finetune` (`labelled=True`: labels and LoRA too): task, data,
    model, output folder, training."""
    tasks = ["classification", "seq2seq"] if labelled else ["causal-lm", "seq2seq"]
    p.add_argument(
        "--task",
        choices=tasks,
        default=tasks[0],
        help=f"what to train (default: {tasks[0]}); seq2seq: an encoder-decoder on source/target pairs",
    )
    data = p.add_argument_group("data")
    data.add_argument("--train-file", required=True, help=".txt (one text per line), .jsonl/.json or .csv")
    data.add_argument("--eval-file", help="held-out file in the same format (default: a split of --train-file)")
    data.add_argument("--text-column", help="column holding the text (default: text)")
    if labelled:
        data.add_argument("--label-column", default="label", help="column holding the label (default: label)")
    data.add_argument("--source-column", help="seq2seq: column holding the source text (default: source)")
    data.add_argument("--target-column", help="seq2seq: column holding the target text (default: target)")
    data.add_argument("--max-target-len", type=int, help="seq2seq: target tokens kept, with </s> (default: 32)")
    _add_model_args(p, labelled)
    p.add_argument("--output-dir", required=True, help="folder to write (refused if it holds a model)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output-dir")
    card = p.add_argument_group("model card and sharing")
    card.add_argument(
        "--base-model",
        metavar="REPO_ID",
        help="the Hub id others load --model from (push it there): the model card's base_model and, with LoRA, the "
        "base the adapter names (default: --model when it is a Hub id; a local --model is named by its path)",
    )
    card.add_argument("--license", help="the model card's license, a Hub identifier such as apache-2.0 or mit")
    train = p.add_argument_group("training")
    train.add_argument("--max-steps", type=int, help="optimizer steps (default 200; wins over --epochs)")
    train.add_argument("--epochs", type=float, help="epochs, when --max-steps is not given")
    train.add_argument("--lr", dest="learning_rate", type=float, help="peak learning rate (cosine schedule)")
    train.add_argument("--batch-size", type=int, help="per-device batch size (default 16)")
    train.add_argument("--seq-len", type=int, help="tokens per training sequence (default 128)")
    train.add_argument("--warmup-steps", type=int, help="linear warm-up steps (default 5%% of the steps)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--deepspeed",
        metavar="CONFIG",
        help="a DeepSpeed config (JSON) for Trainer, e.g. examples/deepspeed/zero3.json: ZeRO sharding, CPU offload; "
        "launch the command with torchrun, accelerate launch or deepspeed (docs/scale-out.md)",
    )


def _add_model_args(p: argparse.ArgumentParser, labelled: bool) -> None:
    """The "model" group: what to start from (a preset or checkpoint), its tokenizer, and LoRA for `finetune`."""
    model = p.add_argument_group("model")
    source = model.add_mutually_exclusive_group()
    default = DEFAULT_CONFIGS["finetune" if labelled else "pretrain"]
    source.add_argument(
        "--config", help=f"preset name or JSON file (default: {default}; tiny-seq2seq for --task seq2seq)"
    )
    source.add_argument("--model", help="start from this checkpoint folder or Hub id (its tokenizer is reused)")
    if not labelled:
        model.add_argument(
            "--tokenizer",
            metavar="PATH",
            help="a new model on this tokenizer (a folder holding one, or a tokenizer.json file) instead of a BPE "
            "trained on the data: vocab_size and the pad/bos/eos ids follow it, and the output folder carries it",
        )
    model.add_argument(
        "--vocab-size",
        type=int,
        help=f"vocabulary of the byte-level BPE trained when training from scratch (default {DEFAULT_VOCAB_SIZE})",
    )
    add_trust_remote_code(model)
    if labelled:
        lora = model.add_mutually_exclusive_group()
        lora.add_argument("--lora", dest="lora", action="store_true", default=None, help="LoRA (default with --model)")
        lora.add_argument("--no-lora", dest="lora", action="store_false", help="full fine-tuning")


def check_options(args: argparse.Namespace) -> None:
    """Fill the task's defaults; refuse options another task would silently ignore, and an output folder that holds
    something without `--overwrite` (before any data is read)."""
    from ..training import check_output_dir

    seq2seq = args.task == "seq2seq"
    for option in ("source_column", "target_column", "max_target_len"):
        if getattr(args, option) is not None and not seq2seq:
            raise CliError(f"--{option.replace('_', '-')} is for --task seq2seq")
    if args.text_column is not None and seq2seq:
        raise CliError("--task seq2seq reads --source-column and --target-column, not --text-column")
    if args.tokenizer and args.model:
        raise CliError("--tokenizer is for a new model: --model trains on with its checkpoint's own tokenizer")
    if args.tokenizer and args.vocab_size is not None:
        raise CliError("--vocab-size sizes a tokenizer trained here; --tokenizer brings its own vocabulary")
    if args.base_model and not args.model:
        raise CliError("--base-model names where --model is published; without --model there is no base")
    if args.config is None and args.model is None:
        args.config = "tiny-seq2seq" if seq2seq else DEFAULT_CONFIGS[args.command]
    args.text_column = args.text_column or "text"
    if seq2seq:
        args.source_column, args.target_column = args.source_column or "source", args.target_column or "target"
        args.max_target_len = args.max_target_len or 32
    check_output_dir(args.output_dir, args.overwrite)


def base_model_id(args: argparse.Namespace) -> str | None:
    """The Hub id of the model `--model` names, as others load it: `--base-model`, else `--model` when it is no local
    path; None for a local `--model` without `--base-model` (a path means nothing on the Hub)."""
    if args.base_model:
        return args.base_model
    return args.model if args.model and not Path(args.model).exists() else None


def card_metadata(args: argparse.Namespace) -> dict[str, str | None]:
    """The model card's `base_model` and `license` (`hf_tfm.training.write_model_card`'s keywords)."""
    return {"base_model": base_model_id(args), "license": args.license}


def license_adapter(adapter: Path, license: str | None) -> None:
    """Add `license` to the metadata of the card PEFT wrote in a saved `adapter` folder (the card names the base)."""
    if license and (adapter / "README.md").is_file():
        from huggingface_hub import ModelCard

        card = ModelCard.load(adapter / "README.md")
        card.data.license = license
        card.save(adapter / "README.md")


def settings_from(args: argparse.Namespace, **defaults: Any) -> "TrainSettings":
    """The `TrainSettings` of the command line's training options, over the command's `defaults`."""
    from ..training import TrainSettings

    values = dict(defaults)
    if getattr(args, "deepspeed", None) is not None and not Path(args.deepspeed).is_file():
        raise CliError(f"--deepspeed {args.deepspeed}: no such file")
    names = ("max_steps", "epochs", "learning_rate", "batch_size", "seq_len", "seed", "warmup_steps", "deepspeed")
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    if getattr(args, "epochs", None) is not None and getattr(args, "max_steps", None) is None:
        values["max_steps"] = -1  # --epochs alone means "train for that many epochs"
    settings = TrainSettings(**values)
    if settings.batch_size <= 0 or settings.seq_len <= 1:
        raise CliError("--batch-size must be positive and --seq-len at least 2")
    return settings


def split_held_out(rows: list, fraction: float, seed: int) -> tuple[list, list]:
    """Hold out about `fraction` of the rows, at least one, chosen by seed."""
    if len(rows) < 2:
        raise CliError("need at least 2 texts to hold some out; pass --eval-file")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(rows) * fraction))
    held = set(order[:n_eval])
    return [t for i, t in enumerate(rows) if i not in held], [t for i, t in enumerate(rows) if i in held]


def held_out_split(
    args: argparse.Namespace, rows: list, load: Callable[[str], list], fraction: float
) -> tuple[list, list]:
    """The training rows and the held-out ones: `load(--eval-file)`, else about `fraction` of `rows` (by --seed)."""
    if args.eval_file:
        return rows, load(args.eval_file)
    return split_held_out(rows, fraction, args.seed)


def _given_tokenizer(args: argparse.Namespace) -> Any:
    """`--tokenizer PATH` (a folder with a tokenizer, or a tokenizer.json file), refused with a one-line reason when
    it is none or lacks a special token the task needs."""
    from ..tokenization import load_tokenizer as load_given

    try:
        tokenizer = load_given(args.tokenizer, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as err:
        if is_consent_error(err):
            raise
        raise CliError(f"--tokenizer {args.tokenizer}: {err}") from err
    if getattr(tokenizer, "backend_tokenizer", None) is None:  # `pack_texts` encodes through the tokenizers library
        raise CliError(f"--tokenizer {args.tokenizer}: {type(tokenizer).__name__} is not a tokenizers-backed one")
    for role, why in TOKENIZER_ROLES.get(args.task, {}).items():
        if getattr(tokenizer, f"{role}_id") is None:
            raise CliError(
                f"--tokenizer {args.tokenizer} has no {role.split('_')[0]} token, which --task {args.task} needs "
                f"({why}): name it in the folder's tokenizer_config.json (tokenizer.{role} = ...; save_pretrained)"
            )
    return tokenizer


def tokenizer_and_model(args: argparse.Namespace, texts: list[str], settings: "TrainSettings") -> tuple[Any, Any]:
    """The tokenizer and what to train: `--model` (its path or Hub id, with its tokenizer), else the `--config` preset
    sized to `--tokenizer` or to a byte-level BPE trained on the texts, with the tokenizer's special ids (a pad, bos or
    eos the tokenizer lacks is None in the config too)."""
    from ..configuration import TfmSeq2SeqConfig
    from ..presets import load_config
    from ..tokenization import train_bpe_tokenizer, vocab_size_of

    if args.model:
        if Path(args.model).exists():  # otherwise a Hub id, resolved by from_pretrained
            require_model_dir(args.model)
        return load_tokenizer(args.model, args.trust_remote_code), args.model
    if args.tokenizer:
        tokenizer = _given_tokenizer(args)
    else:
        tokenizer = train_bpe_tokenizer(texts, vocab_size=args.vocab_size or DEFAULT_VOCAB_SIZE)
    config = load_config(
        args.config,
        vocab_size=vocab_size_of(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    seq2seq = args.task == "seq2seq"
    if isinstance(config, TfmSeq2SeqConfig) != seq2seq:
        kind = "an encoder-decoder" if seq2seq else "an encoder or a decoder"
        raise CliError(f"--config {args.config} is not {kind} config, as --task {args.task} needs")
    # Grow the preset's position range to the training length if needed, never shrink it (learned positions would
    # then refuse longer texts at classify/generate time).
    for side in (config.encoder, config.decoder) if seq2seq else (config,):
        side.max_position_embeddings = max(side.max_position_embeddings, settings.seq_len)
    return tokenizer, config
