"""`hf-tfm demo`: the main job, from raw text to trained, shareable models, on the Python standard library's source.

Seven stages, each a function that runs on what the earlier ones returned; `run` strings them together in one staged
output folder and prints the summary. One stage alone, e.g. the tokenizer on the quick profile's corpus:

    corpus = collect_corpus(PROFILES["quick"]["corpus_chars"], seed=0)      # [1/7]
    tokenizer = train_tokenizer(corpus, vocab_size=1024)                   # [2/7]
"""

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..configuration import TfmConfig, TfmSeq2SeqConfig
from ..data import LabelledSplit, PairSplit, SourceFile, docstring_name_task, docstring_task, stdlib_files, stdlib_root
from ..presets import load_config
from ..tokenization import train_bpe_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from ..training import TrainSettings

DOC_PAGE = "docs/cli.md#the-demo-make-demo"

PROMPTS = ["def ", "import os\n", "class Queue:\n    ", '"""Return the']

MAX_NAME_TOKENS = 12  # a name's tokens with its `</s>`

# Two sizes of the demo: the default (about 13.5 minutes on 2 CPU cores) and `--quick` (1.5), whose every model also
# beats its baseline. `evals`: held-out evaluations during training, the points of each held-out curve.
# `s2s_regularisation`: how the seq2seq model trains so that it generalises instead of memorising its 1,500 training
# pairs, dropout on both sides and smoothed labels. Measured on the full profile (held-out loss / exact match / word
# F1): without them 300 steps gave 3.32 / 0.208 / 0.328 and training loss 0.15; with them 600 steps give 3.25 / 0.236 /
# 0.372. The quick profile's 200 steps are too few to memorise: there they only slow learning (exact match 0.068 with
# them, 0.089 without, on the quick LM of 300 steps), as its 150-step LM did (0.012 against the baseline's 0.028).
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "corpus_chars": 1_200_000,
        "vocab_size": 1024,
        "lm_config": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
        "lm": {"max_steps": 300, "batch_size": 16, "seq_len": 128, "learning_rate": 2e-3},
        "clf": {"max_steps": 150, "batch_size": 16, "seq_len": 96, "learning_rate": 3e-3, "evals": 6},
        "s2s": {"max_steps": 200, "batch_size": 32, "seq_len": 48, "learning_rate": 2e-3, "evals": 6},
        "s2s_regularisation": {"dropout": 0.0, "label_smoothing": 0.0},
        "max_new_tokens": 24,
    },
    "full": {
        "corpus_chars": 8_000_000,
        "vocab_size": 2048,
        "lm_config": {"hidden_size": 192, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2},
        "lm": {"max_steps": 2400, "batch_size": 16, "seq_len": 128, "learning_rate": 2e-3},
        "clf": {"max_steps": 400, "batch_size": 16, "seq_len": 128, "learning_rate": 2e-3, "evals": 10},
        "s2s": {"max_steps": 600, "batch_size": 32, "seq_len": 48, "learning_rate": 1e-3, "evals": 12},
        "s2s_regularisation": {"dropout": 0.1, "label_smoothing": 0.1},
        "max_new_tokens": 48,
    },
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm demo` and its options."""
    p = subparsers.add_parser(
        "demo", help="raw text to trained, shareable models, on the Python standard library's source (no downloads)"
    )
    p.add_argument("--quick", action="store_true", help="the same stages, smaller: about 1.5 minutes on 2 CPU cores")
    p.add_argument("--output-dir", default="hf-tfm-demo", help="default: ./hf-tfm-demo (a previous demo is replaced)")
    p.add_argument("--overwrite", action="store_true", help="replace an --output-dir that is not a previous demo")
    p.add_argument("--seed", type=int, default=0)
    return p


def run(args: argparse.Namespace) -> int:
    """The seven stages, written into `--output-dir` all at once when the last is done; then the summary."""
    from ..checkpoint import staged_folder
    from ..training import TrainSettings, check_output_dir

    profile_name = "quick" if args.quick else "full"
    profile = PROFILES[profile_name]
    lm_settings, clf_settings, s2s_settings = (
        TrainSettings(seed=args.seed, **profile[k]) for k in ("lm", "clf", "s2s")
    )
    start = time.perf_counter()
    out = Path(args.output_dir).resolve()
    check_output_dir(out, args.overwrite, replaceable=is_demo_output)
    with staged_folder(out) as stage:
        corpus = collect_corpus(profile["corpus_chars"], args.seed)
        tokenizer = train_tokenizer(corpus, profile["vocab_size"])
        lm = pretrain_lm(corpus, tokenizer, lm_settings, profile["lm_config"], stage / "lm")
        reloaded = reload_in_fresh_process(stage / "lm", profile["max_new_tokens"], args.seed)
        # The adapter names lm/ where it will be once the staged folder is renamed.
        clf = finetune_lora_classifier(corpus, tokenizer, stage / "lm", clf_settings, stage / "classifier", out / "lm")
        s2s = train_name_seq2seq(
            corpus, tokenizer, stage / "lm", s2s_settings, stage / "seq2seq", **profile["s2s_regularisation"]
        )
        runs = {"lm": lm, "classifier": clf, "seq2seq": s2s}
        write_report(stage, runs, reloaded, profile=profile_name, seed=args.seed, start=start)
    print_summary(out, runs, reloaded, wall=time.perf_counter() - start)
    return 0


def is_demo_output(folder: Path) -> bool:
    """Whether `folder` holds a previous demo's output (which a new demo replaces without `--overwrite`)."""
    try:
        return json.loads((folder / "metrics.json").read_text())["kind"] == "hf-tfm demo"
    except (OSError, ValueError, KeyError, TypeError):
        return False


# ---------------------------------------------------------------------------------------------------------------------
# What each model's loss is worth: the loss of a model that ignores its input


def unigram_loss(train: list[list[int]], held_out: list[list[int]], vocab_size: int) -> float:
    """Cross-entropy (nats per token) on `held_out` of the token frequencies in `train`, add-one smoothed: the loss of
    a model that predicts every token without looking at anything before it."""
    counts = Counter(token for ids in train for token in ids)
    total = sum(counts.values()) + vocab_size
    tokens = [token for ids in held_out for token in ids]
    return -sum(math.log((counts[token] + 1) / total) for token in tokens) / max(len(tokens), 1)


def prior_loss(train_labels: list[int], test_labels: list[int], classes: int) -> float:
    """Cross-entropy on `test_labels` of the training labels' frequencies (add-one smoothed): the loss of a classifier
    that ignores the text."""
    counts = Counter(train_labels)
    total = len(train_labels) + classes
    return -sum(math.log((counts[label] + 1) / total) for label in test_labels) / max(len(test_labels), 1)


def _token_ids(
    tokenizer: "PreTrainedTokenizerFast", texts: list[str], special: bool = True, max_len: int | None = None
) -> list[list[int]]:
    """Each text's ids as training sees them, `</s>` after each: the LM's texts (with `<s>`: `special`) and the
    seq2seq targets (without, cut to `max_len` with their `</s>`). Encoded without padding or truncation, whatever
    an earlier call (a padded batch for generation) left set on the tokenizer's backend: a baseline counts no pads."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    backend.no_truncation()
    encodings = backend.encode_batch(texts, add_special_tokens=special)
    keep = None if max_len is None else max_len - 1
    return [[*e.ids[:keep], tokenizer.eos_token_id] for e in encodings]


# ---------------------------------------------------------------------------------------------------------------------
# [1/7] corpus and [2/7] tokenizer


@dataclass
class Corpus:
    """The demo's data, all from the standard library and split by file: the LM's text and the two labelled tasks."""

    lm_train: list[SourceFile]
    lm_held: list[SourceFile]
    packages: LabelledSplit  # which package a docstring is from (the classifier)
    names: PairSplit  # a function's docstring in, its name out (the seq2seq model)

    @property
    def train_texts(self) -> list[str]:
        return [f.text for f in self.lm_train]

    @property
    def eval_texts(self) -> list[str]:
        return [f.text for f in self.lm_held]


def collect_corpus(corpus_chars: int, seed: int) -> Corpus:
    """[1/7] The standard library's files: about `corpus_chars` of source for the LM, every 20th file (in path order)
    held out, and the classifier's and the seq2seq model's tasks, each split by file by `seed`."""
    print(f"[1/7] corpus: the Python standard library at {stdlib_root()}")
    files = stdlib_files()
    packages = docstring_task(files, seed=seed)
    # The LM never sees a file whose docstrings are classifier test inputs: no transductive leak.
    pool = [f for f in stdlib_files(corpus_chars, max_file_chars=20_000) if f.path not in packages.test_files]
    lm_train, lm_held = [f for i, f in enumerate(pool) if i % 20], pool[::20]
    corpus = Corpus(lm_train, lm_held, packages, names=docstring_name_task(files, seed=seed))
    print(
        f"      LM: {len(lm_train)} train files ({sum(map(len, corpus.train_texts)) / 1e6:.1f} MB), "
        f"{len(lm_held)} held-out files; classifier: {len(packages.label_names)} packages, "
        f"{len(packages.train_texts)} train / {len(packages.test_texts)} test docstrings, split by file"
    )
    return corpus


def train_tokenizer(corpus: Corpus, vocab_size: int) -> "PreTrainedTokenizerFast":
    """[2/7] A byte-level BPE of `vocab_size` tokens, trained on the LM's training files."""
    print(f"[2/7] tokenizer: byte-level BPE, vocabulary {vocab_size}")
    return train_bpe_tokenizer(corpus.train_texts, vocab_size=vocab_size)


# ---------------------------------------------------------------------------------------------------------------------
# [3/7] the causal LM and [4/7] its folder in a fresh process


def pretrain_lm(
    corpus: Corpus,
    tokenizer: "PreTrainedTokenizerFast",
    settings: "TrainSettings",
    sizes: dict[str, int],
    folder: Path,
) -> dict[str, Any]:
    """[3/7] The `tiny-decoder` preset at `sizes`, pretrained on the corpus and saved to `folder` with its model card.
    Returns its metrics, as the demo's metrics.json holds them."""
    from ..training import pretrain_causal_lm

    config = load_config(
        "tiny-decoder",
        **sizes,
        vocab_size=len(tokenizer),
        max_position_embeddings=settings.seq_len * 4,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    print(f"[3/7] pretraining a causal LM ({settings.max_steps} steps, sequence length {settings.seq_len})")
    lm = pretrain_causal_lm(config, tokenizer, corpus.train_texts, corpus.eval_texts, settings, folder)
    train_ids, held_ids = (_token_ids(tokenizer, texts) for texts in (corpus.train_texts, corpus.eval_texts))
    lm["baseline_loss"] = unigram_loss(train_ids, held_ids, len(tokenizer))
    print(
        f"      held-out loss {lm['eval_loss']:.3f}, perplexity {lm['perplexity']:.1f} vs a unigram model's "
        f"{lm['baseline_loss']:.3f} / {math.exp(lm['baseline_loss']):.1f}"
    )
    _write_lm_card(folder, config, corpus, tokenizer, settings, lm)
    return lm | {"folder": folder.name, "settings": settings.as_dict()}


def _write_lm_card(
    folder: Path,
    config: TfmConfig,
    corpus: Corpus,
    tokenizer: "PreTrainedTokenizerFast",
    settings: "TrainSettings",
    lm: dict[str, Any],
) -> None:
    """The LM folder's README.md: its data (the split by file, the tokenizer), settings and held-out metrics."""
    from ..training import write_model_card

    write_model_card(
        folder,
        title="hf_tfm demo causal LM (Python standard library)",
        summary="A small causal language model pretrained from scratch by `hf-tfm demo` on Python source code.",
        config=config,
        parameters=lm["parameters"],
        data=[
            f"Python {sys.version.split()[0]} standard library source files (found at run time under "
            f"`{stdlib_root()}`), tests and site-packages excluded.",
            f"{len(corpus.lm_train)} training files, {lm['train_tokens']:,} tokens; {len(corpus.lm_held)} held-out "
            f"files, {lm['eval_tokens']:,} tokens (the split is by file).",
            "Files whose docstrings are test inputs of the demo classifier are left out of pretraining.",
            f"Tokenizer: byte-level BPE trained on the training files, {len(tokenizer)} tokens.",
        ],
        settings={**settings.as_dict(), "optimizer": "AdamW", "lr schedule": "cosine"},
        metrics={
            "held-out loss": lm["eval_loss"],
            "perplexity": lm["perplexity"],
            "final train loss": lm["train_loss"],
            "unigram baseline held-out loss (token frequencies, no context)": lm["baseline_loss"],
        },
        pipeline_tag="text-generation",
        auto_class="AutoModelForCausalLM",
    )


def reload_in_fresh_process(folder: Path, max_new_tokens: int, seed: int) -> dict[str, Any]:
    """[4/7] The LM's folder loaded where hf_tfm cannot be imported, from the code it carries, and a sampled
    continuation of each of `PROMPTS`. Returns the class that loaded it and the generations."""
    from ..training import generate_in_fresh_process

    print("[4/7] reloading the folder in a fresh process (AutoModelForCausalLM, trust_remote_code, no hf_tfm)")
    reloaded = generate_in_fresh_process(folder, PROMPTS, max_new_tokens, seed)
    for prompt, text in zip(PROMPTS, reloaded["generations"], strict=True):
        print(f"      {prompt!r} -> {text!r}")
    return reloaded


# ---------------------------------------------------------------------------------------------------------------------
# [5/7] the LoRA classifier and [6/7] the seq2seq model, both from the LM


def finetune_lora_classifier(
    corpus: Corpus,
    tokenizer: "PreTrainedTokenizerFast",
    lm_folder: Path,
    settings: "TrainSettings",
    folder: Path,
    adapter_base: Path,
) -> dict[str, Any]:
    """[5/7] The LM's weights as a bidirectional encoder with mean pooling, LoRA fine-tuned on which package a
    docstring is from, saved to `folder` (merged, and the adapter alone in `adapter/`, naming `adapter_base` as its
    base) with its model card. Returns its metrics, with the majority-class baseline."""
    from ..training import finetune_classifier

    task = corpus.packages
    print(
        f"[5/7] LoRA fine-tuning an encoder classifier from the LM's weights "
        f"({settings.max_steps} steps, {len(task.label_names)} classes)"
    )
    clf = finetune_classifier(
        lm_folder,
        tokenizer,
        (task.train_texts, task.train_labels),
        (task.test_texts, task.test_labels),
        task.label_names,
        settings,
        folder,
        lora=True,
        config_overrides={"is_causal": False, "classifier_pooling": "mean"},  # bidirectional attention on the LM
        adapter_base=str(adapter_base),
    )
    majority, baseline = task.majority_baseline()
    clf["baseline_loss"] = prior_loss(task.train_labels, task.test_labels, len(task.label_names))
    print(
        f"      test accuracy {clf['test_accuracy']:.3f} vs majority-class baseline {baseline:.3f} ({majority}); "
        f"test loss {clf['test_loss']:.3f} vs {clf['baseline_loss']:.3f} for the class frequencies alone"
    )
    _write_classifier_card(folder, task, settings, clf, baseline)
    return clf | {
        "folder": folder.name,
        "labels": task.label_names,
        "baseline_accuracy": baseline,
        "baseline_label": majority,
        "train_files": len(task.train_files),
        "test_files": len(task.test_files),
        "settings": settings.as_dict(),
    }


def _write_classifier_card(
    folder: Path, task: LabelledSplit, settings: "TrainSettings", clf: dict[str, Any], baseline: float
) -> None:
    """The classifier folder's README.md: the packages, the split by file, LoRA's settings, accuracy vs baseline."""
    from transformers import AutoConfig

    from ..training import write_model_card

    write_model_card(
        folder,
        title="hf_tfm demo classifier: which standard-library package is this docstring from?",
        summary=(
            "The demo causal LM's weights turned into a bidirectional encoder (`is_causal=False`, mean pooling) "
            "and fine-tuned with LoRA adapters (q/k/v/o and MLP projections) plus a trained `score` head. "
            "The folder holds the merged model; `adapter/` holds the PEFT adapter alone."
        ),
        config=AutoConfig.from_pretrained(folder),  # hf_tfm's registered class: no code of the folder runs
        parameters=clf["parameters"],
        data=[
            f"Docstrings of {len(task.label_names)} standard-library packages: {', '.join(task.label_names)}.",
            f"{len(task.train_texts)} train docstrings from {len(task.train_files)} files, "
            f"{len(task.test_texts)} test docstrings from {len(task.test_files)} other files "
            "(split by file: no file is on both sides).",
        ],
        settings={**settings.as_dict(), "lora r": 8, "lora alpha": 16},
        metrics={
            "test accuracy": clf["test_accuracy"],
            "majority-class baseline accuracy": baseline,
            "test loss": clf["test_loss"],
        },
        pipeline_tag="text-classification",
        auto_class="AutoModelForSequenceClassification",
    )


def train_name_seq2seq(
    corpus: Corpus,
    tokenizer: "PreTrainedTokenizerFast",
    lm_folder: Path,
    settings: "TrainSettings",
    folder: Path,
    dropout: float = 0.1,
    label_smoothing: float = 0.1,
) -> dict[str, Any]:
    """[6/7] An encoder-decoder warm-started from the LM (both sides its blocks; a new cross-attention), trained on a
    function's docstring in, its name out (with `dropout` on both sides and `label_smoothing`), and saved to `folder`
    with its model card. Returns its metrics."""
    from ..training import seq2seq_from_causal_lm, train_seq2seq

    names = corpus.names
    print(
        f"[6/7] seq2seq: an encoder-decoder warm-started from the LM learns a function's name from its docstring "
        f"({settings.max_steps} steps, {len(names.train_sources)} train / {len(names.test_sources)} test "
        "functions, split by file)"
    )
    regularisation = {"hidden_dropout": dropout, "attention_dropout": dropout}
    model = seq2seq_from_causal_lm(lm_folder, overrides=regularisation)
    # A leading space makes the name's words the tokens they are inside the docstring (byte-level BPE).
    targets = lambda texts: [" " + text for text in texts]  # noqa: E731
    s2s = train_seq2seq(
        model,
        tokenizer,
        (names.train_sources, targets(names.train_targets)),
        (names.test_sources, targets(names.test_targets)),
        settings,
        folder,
        max_target_len=MAX_NAME_TOKENS,
        label_smoothing=label_smoothing,
    )
    train_ids, test_ids = (
        _token_ids(tokenizer, targets(texts), special=False, max_len=MAX_NAME_TOKENS)
        for texts in (names.train_targets, names.test_targets)
    )
    s2s["baseline_loss"] = unigram_loss(train_ids, test_ids, len(tokenizer))
    print(
        f"      test exact match {s2s['exact_match']:.3f}, word F1 {s2s['word_f1']:.3f} vs majority-name "
        f"baseline {s2s['baseline_exact_match']:.3f} / {s2s['baseline_word_f1']:.3f} "
        f"(always {s2s['baseline_target'].strip()!r}); held-out loss {s2s['eval_loss']:.3f} vs "
        f"{s2s['baseline_loss']:.3f} for a unigram model of names"
    )
    for example in s2s["examples"][:3]:
        source, prediction, target = (example[k].strip() for k in ("source", "prediction", "target"))
        print(f"      {source[:60]!r} -> {prediction!r} (is {target!r})")
    regularisation["label_smoothing"] = label_smoothing
    _write_seq2seq_card(folder, model.config, names, settings.as_dict() | regularisation, s2s)
    return s2s | {"folder": folder.name, "settings": settings.as_dict() | regularisation}


def _write_seq2seq_card(
    folder: Path, config: TfmSeq2SeqConfig, names: PairSplit, settings: dict[str, Any], s2s: dict[str, Any]
) -> None:
    """The seq2seq folder's README.md: how it was warm-started, the functions it saw, its settings (regularisation
    included), its scores vs baseline."""
    from ..training import write_model_card

    write_model_card(
        folder,
        title="hf_tfm demo encoder-decoder: a function's name from its docstring",
        summary=(
            "An encoder-decoder (`TfmForConditionalGeneration`) warm-started by `hf-tfm demo` from its causal "
            "LM: both sides start from the LM's blocks and embeddings (the encoder with bidirectional attention), "
            "the decoder's cross-attention from scratch; fine-tuned on the first paragraph of a function's "
            "docstring in, the words of its name out."
        ),
        config=config,
        parameters=s2s["parameters"],
        data=[
            "Standard-library functions and methods whose name is made of words of their docstring's first "
            "paragraph (dunder methods left out).",
            f"{s2s['train_examples']} train functions from {len(names.train_files)} files, "
            f"{s2s['test_examples']} test functions from {len(names.test_files)} other files.",
        ],
        settings=settings,
        metrics={
            "test exact match (greedy)": s2s["exact_match"],
            "test word F1 (greedy)": s2s["word_f1"],
            "majority-name baseline exact match": s2s["baseline_exact_match"],
            "majority-name baseline word F1": s2s["baseline_word_f1"],
            "held-out loss": s2s["eval_loss"],
            "unigram baseline held-out loss (name token frequencies, no source)": s2s["baseline_loss"],
        },
        pipeline_tag="text2text-generation",
        auto_class="AutoModelForSeq2SeqLM",
    )


# ---------------------------------------------------------------------------------------------------------------------
# [7/7] the report, and the summary


def write_report(
    folder: Path,
    runs: dict[str, dict[str, Any]],
    reloaded: dict[str, Any],
    *,
    profile: str,
    seed: int,
    start: float,
) -> None:
    """[7/7] `loss_curves.png` (one panel per training run) and `metrics.json` (every run's metrics, the fresh
    process's generations, the wall time since `start`) in `folder`."""
    import torch

    from ..training import plot_loss_curves

    print("[7/7] writing the loss curves and metrics")
    titles = {
        "lm": "causal LM pretraining",
        "classifier": "LoRA classifier fine-tuning",
        "seq2seq": "seq2seq: docstring -> name",
    }
    baselines = {"lm": "unigram model", "classifier": "class frequencies", "seq2seq": "unigram model of names"}
    panels = {title: runs[run]["history"] for run, title in titles.items()}
    lines = {titles[run]: (runs[run]["baseline_loss"], what) for run, what in baselines.items()}
    plot = plot_loss_curves(panels, folder / "loss_curves.png", lines)
    metrics = {
        "kind": "hf-tfm demo",
        "profile": profile,
        "seed": seed,
        "lm": runs["lm"],
        "generations": dict(zip(PROMPTS, reloaded["generations"], strict=True)),
        "reloaded_class": reloaded["class"],
        "classifier": runs["classifier"],
        "seq2seq": runs["seq2seq"],
        "plot": plot.name,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")


def print_summary(out: Path, runs: dict[str, dict[str, Any]], reloaded: dict[str, Any], wall: float) -> None:
    """What the demo made and where, each model's result next to what a model that ignores its input scores (the
    LM's and the seq2seq model's held-out loss against a unigram model's, the classifier's accuracy against always
    answering the most frequent class), the plot, the metrics, and the commands to try next."""
    lm, clf, s2s = runs["lm"], runs["classifier"], runs["seq2seq"]
    print("\n" + "=" * 78)
    print(f"hf-tfm demo finished in {wall / 60:.1f} min. Output: {out}")
    print(f"  model folder (push-ready): {out / 'lm'}")
    print(
        f"  held-out perplexity:       {lm['perplexity']:.2f} (loss {lm['eval_loss']:.3f}) against "
        f"{math.exp(lm['baseline_loss']):.1f} for a unigram model (token frequencies, no context): the LM predicts "
        f"code from what precedes it"
    )
    print("  sample generations (fresh process, trust_remote_code):")
    for prompt, text in zip(PROMPTS, reloaded["generations"], strict=True):
        print(f"    {prompt!r} -> {(prompt + text)!r}")
    print(
        f"  classifier ({out / 'classifier'}): test accuracy {clf['test_accuracy']:.3f} "
        f"vs majority baseline {clf['baseline_accuracy']:.3f} on {len(clf['labels'])} classes, on files it never saw"
    )
    print(
        f"  seq2seq ({out / 'seq2seq'}): docstring -> name, test exact match {s2s['exact_match']:.3f}, word F1 "
        f"{s2s['word_f1']:.3f} vs majority-name baseline {s2s['baseline_exact_match']:.3f} / "
        f"{s2s['baseline_word_f1']:.3f}; held-out loss {s2s['eval_loss']:.2f} vs {s2s['baseline_loss']:.2f} for "
        "a unigram model of names"
    )
    print(f"  loss curves: {out / 'loss_curves.png'} (train and held-out loss, each baseline dotted)")
    print(f"  metrics:     {out / 'metrics.json'}")
    print(f"Next: hf-tfm generate {out / 'lm'} --prompt 'def '   |   hf-tfm push {out / 'lm'} --repo-id you/name")
