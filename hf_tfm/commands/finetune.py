"""`hf-tfm finetune`: a sequence classifier on the user's labelled texts, from a preset (in full) or from a checkpoint
(LoRA by default; `--task seq2seq` is `seq2seq.py`'s).
"""

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from ..scale_out import is_main_process
from .training_options import (
    add_training_args,
    card_metadata,
    check_options,
    held_out_split,
    license_adapter,
    settings_from,
    tokenizer_and_model,
)

DOC_PAGE = "docs/cli.md#subcommands (training: docs/training.md, seq2seq: docs/seq2seq.md)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm finetune` and its options."""
    p = subparsers.add_parser(
        "finetune", help="train a sequence classifier on labelled data (or --task seq2seq on pairs)"
    )
    add_training_args(p, labelled=True)
    p.set_defaults(tokenizer=None)  # finetune takes no --tokenizer; the checks it shares with pretrain read it
    return p


def run(args: argparse.Namespace) -> int:
    """Train and save a sequence classifier; print its held-out accuracy next to the majority-class baseline."""
    from ..training import finetune_classifier, training_job

    check_options(args)
    (texts, train_ids), (eval_texts, eval_ids), label_names = _load_labelled(args)
    lora = args.lora if args.lora is not None else args.model is not None
    settings = settings_from(args, max_steps=200, learning_rate=2e-3 if lora else 1e-3, seq_len=128)
    tokenizer, model = tokenizer_and_model(args, texts, settings)
    majority = Counter(train_ids).most_common(1)[0][0]
    baseline = sum(x == majority for x in eval_ids) / len(eval_ids)

    def train(folder: Path) -> dict[str, Any]:
        result = finetune_classifier(
            model,
            tokenizer,
            (texts, train_ids),
            (eval_texts, eval_ids),
            label_names,
            settings,
            folder,
            lora=lora,
            adapter_base=args.base_model,
            trust_remote_code=args.trust_remote_code,
        )
        license_adapter(folder / "adapter", args.license)
        return result | {"baseline_accuracy": baseline}  # metrics.json holds it beside the accuracy

    sizes = (len(texts), len(eval_texts))
    result = training_job(
        args.output_dir,
        train,
        lambda result: _card(args, settings.as_dict(), result, lora=lora, labels=label_names, sizes=sizes),
        overwrite=args.overwrite,
    )
    if not is_main_process():  # another rank of a multi-process launch: rank 0 wrote the folder and reports
        return 0
    print(
        f"saved {args.output_dir}: eval accuracy {result['test_accuracy']:.3f} "
        f"(majority-class baseline {baseline:.3f}, {len(label_names)} classes)"
    )
    return 0


def _load_labelled(
    args: argparse.Namespace,
) -> tuple[tuple[list[str], list[int]], tuple[list[str], list[int]], list[str]]:
    """The (texts, label ids) to train on and the held-out ones (`--eval-file`'s, else a 20% split of
    `--train-file`'s), and the label names: those of `--train-file`, sorted, each one's index its id."""
    from ..data import load_labelled

    texts, labels = load_labelled(args.train_file, args.text_column, args.label_column)
    label_names = sorted(set(labels))

    def labelled(path: str) -> list[tuple[str, str]]:  # only the training file's labels may occur
        return list(zip(*load_labelled(path, args.text_column, args.label_column, label_names), strict=True))

    train, held = held_out_split(args, list(zip(texts, labels, strict=True)), labelled, 0.2)
    to_id = {name: i for i, name in enumerate(label_names)}
    as_ids = lambda rows: ([t for t, _ in rows], [to_id[label] for _, label in rows])  # noqa: E731
    return as_ids(train), as_ids(held), label_names


def _card(
    args: argparse.Namespace,
    settings: dict[str, Any],
    result: dict[str, Any],
    *,
    lora: bool,
    labels: list[str],
    sizes: tuple[int, int],
) -> dict[str, Any]:
    """The model card's text (`hf_tfm.training.write_model_card`): where the model started, its data and accuracy."""
    source = f"fine-tuned from `{args.model}`" if args.model else f"trained from scratch, config `{args.config}`"
    return {
        "title": f"Sequence classifier trained with hf-tfm on {Path(args.train_file).name}",
        "summary": f"{source.capitalize()} with `hf-tfm finetune`{' (LoRA)' if lora else ''}.",
        "data": [
            f"train: `{args.train_file}` ({sizes[0]} examples), labels: {', '.join(labels)}",
            f"eval: `{args.eval_file or 'a 20% split of the train file'}` ({sizes[1]} examples)",
        ],
        "settings": settings | {"lora": lora},
        "metrics": {
            "eval accuracy": result["test_accuracy"],
            "majority-class baseline accuracy": result["baseline_accuracy"],
        },
        "pipeline_tag": "text-classification",
        "auto_class": "AutoModelForSequenceClassification",
        **card_metadata(args),
    }
