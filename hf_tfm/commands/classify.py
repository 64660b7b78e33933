"""`hf-tfm classify`: labels and scores from a classifier folder, for texts given as arguments or in a file."""

import argparse
import json

from .common import CliError, add_trust_remote_code, load_tokenizer, require_model_dir

DOC_PAGE = "docs/cli.md#subcommands"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm classify` and its options."""
    p = subparsers.add_parser("classify", help="labels and scores from a classifier folder")
    p.add_argument("model", help="classifier folder (with tokenizer)")
    p.add_argument("texts", nargs="*", help="texts to classify")
    p.add_argument("--file", help="also classify the texts of this .txt/.jsonl/.csv file")
    p.add_argument("--text-column", default="text")
    p.add_argument("--top-k", type=int, default=1, help="labels to report per text (with --json)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    add_trust_remote_code(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Classify the texts in batches; print a line per text: label, score, text (or JSON with the top k)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from ..data import load_texts

    require_model_dir(args.model)
    texts = list(args.texts)
    if args.file:
        texts += load_texts(args.file, args.text_column)
    if not texts:
        raise CliError("give texts to classify as arguments or with --file")
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, trust_remote_code=args.trust_remote_code
    ).eval()
    id2label = model.config.id2label
    max_length = min(args.max_length, model.config.max_position_embeddings)  # learned positions stop there
    results = []
    with torch.no_grad():
        for start in range(0, len(texts), args.batch_size):
            batch = texts[start : start + args.batch_size]
            enc = tokenizer(batch, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
            probs = model(**enc).logits.softmax(-1)
            for text, row in zip(batch, probs, strict=True):
                top = row.topk(min(args.top_k, row.numel()))
                labels = [
                    {"label": id2label[i.item()], "score": round(s.item(), 4)}
                    for s, i in zip(top.values, top.indices, strict=True)
                ]
                results.append({"text": text, "label": labels[0]["label"], "score": labels[0]["score"], "top": labels})
    for r in results:
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{r['label']}\t{r['score']:.4f}\t{r['text'][:80]!r}")
    return 0
