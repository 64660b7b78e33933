"""`hf-tfm pretrain|finetune --task seq2seq`: an encoder-decoder on source/target pairs, from a preset, a seq2seq
checkpoint (LoRA by default) or an hf_tfm causal LM that both sides are warm-started from.
"""

import argparse
from pathlib import Path
from typing import Any

from ..scale_out import is_main_process
from .common import CliError
from .training_options import (
    card_metadata,
    check_options,
    held_out_split,
    license_adapter,
    settings_from,
    tokenizer_and_model,
)

Columns = tuple[list[str], list[str]]  # (sources, targets)


def run(args: argparse.Namespace) -> int:
    """Train and save the encoder-decoder `pretrain|finetune --task seq2seq` asks for; print its held-out metrics."""
    from ..training import seq2seq_from_causal_lm, train_seq2seq, training_job

    check_options(args)
    train, held = _load_pairs(args)
    from_lm, lora = _starting_point(args)
    settings = settings_from(args, max_steps=200, learning_rate=2e-3 if lora else 1e-3)
    tokenizer, model = tokenizer_and_model(args, train[0] + train[1], settings)
    if from_lm:  # both sides from the LM's blocks and embeddings, a new cross-attention
        model = seq2seq_from_causal_lm(args.model, trust_remote_code=args.trust_remote_code)

    def train_and_save(folder: Path) -> dict[str, Any]:
        result = train_seq2seq(
            model,
            tokenizer,
            train,
            held,
            settings,
            folder,
            lora=lora,
            max_target_len=args.max_target_len,
            adapter_base=args.base_model,
            trust_remote_code=args.trust_remote_code,
        )
        license_adapter(folder / "adapter", args.license)
        return result

    result = training_job(
        args.output_dir,
        train_and_save,
        lambda result: _card(
            args, settings.as_dict(), result, from_lm=from_lm, lora=lora, pairs=(len(train[0]), len(held[0]))
        ),
        overwrite=args.overwrite,
    )
    if not is_main_process():  # another rank of a multi-process launch: rank 0 wrote the folder and reports
        return 0
    print(
        f"saved {args.output_dir}: held-out loss {result['eval_loss']:.3f}, exact match {result['exact_match']:.3f}, "
        f"word F1 {result['word_f1']:.3f} (majority-target baseline {result['baseline_exact_match']:.3f} / "
        f"{result['baseline_word_f1']:.3f})"
    )
    return 0


def _load_pairs(args: argparse.Namespace) -> tuple[Columns, Columns]:
    """The pairs to train on and the held-out ones: `--eval-file`'s, else a 10% split of `--train-file`'s."""
    from ..data import load_pairs

    def pairs(path: str) -> list[tuple[str, str]]:
        return list(zip(*load_pairs(path, args.source_column, args.target_column), strict=True))

    train, held = held_out_split(args, pairs(args.train_file), pairs, 0.1)
    return ([s for s, _ in train], [t for _, t in train]), ([s for s, _ in held], [t for _, t in held])


def _starting_point(args: argparse.Namespace) -> tuple[bool, bool]:
    """Whether `--model` is an hf_tfm causal LM that both sides start from, and whether to train with LoRA (the
    default on a seq2seq `--model`; refused on a causal LM, whose seq2seq model's cross-attention is new)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code) if args.model else None
    from_lm = getattr(config, "model_type", None) == "hf_tfm" and "TfmForCausalLM" in (config.architectures or [])
    if config is not None and not (from_lm or getattr(config, "is_encoder_decoder", False)):
        raise CliError(f"--model {args.model} is neither an encoder-decoder nor an hf_tfm causal LM to start one from")
    if from_lm and args.lora:
        raise CliError(
            f"--model {args.model} is a causal LM: its seq2seq model's new cross-attention must train in full"
        )
    return from_lm, args.lora if args.lora is not None else args.model is not None and not from_lm


def _card(
    args: argparse.Namespace,
    settings: dict[str, Any],
    result: dict[str, Any],
    *,
    from_lm: bool,
    lora: bool,
    pairs: tuple[int, int],
) -> dict[str, Any]:
    """The model card's text (`hf_tfm.training.write_model_card`): where the model started, its data and metrics."""
    source = f"fine-tuned from `{args.model}`" if args.model else f"trained from scratch, config `{args.config}`"
    source = f"warm-started from the causal LM `{args.model}`" if from_lm else source
    source += f", tokenizer `{args.tokenizer}`" if args.tokenizer else ""
    return {
        "title": f"Sequence-to-sequence model trained with hf-tfm on {Path(args.train_file).name}",
        "summary": f"{source[0].upper() + source[1:]} with `hf-tfm {args.command} --task seq2seq`"
        + (" (LoRA)." if lora else "."),
        "data": [
            f"train: `{args.train_file}` ({pairs[0]} pairs; columns {args.source_column!r} -> {args.target_column!r})",
            f"eval: `{args.eval_file or 'a 10% split of the train file'}` ({pairs[1]} pairs)",
        ],
        "settings": settings | {"lora": lora, "max target tokens": args.max_target_len},
        "metrics": {
            "held-out loss": result["eval_loss"],
            "exact match (greedy)": result["exact_match"],
            "word F1 (greedy)": result["word_f1"],
            "majority-target baseline exact match": result["baseline_exact_match"],
            "majority-target baseline word F1": result["baseline_word_f1"],
        },
        "pipeline_tag": "text2text-generation",
        "auto_class": "AutoModelForSeq2SeqLM",
        **card_metadata(args),
    }
