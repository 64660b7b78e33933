"""The steps behind `hf-tfm`: the output-folder check, causal-LM pretraining, classifier fine-tuning (full or LoRA),
fresh-process generation, model cards and loss curves. The CLI strings these together; each is usable on its own.
`training_job` is the string every training command uses: stage the folder, train, write the card and the metrics.

Every folder is written under a hidden temporary name next to its target and renamed into place only when complete
(`hf_tfm.checkpoint.staged_folder`), so an interrupted or failed run never leaves a folder that looks like a finished
model, and one that was to replace a folder leaves that folder as it was.
"""

import dataclasses
import json
import logging
import math
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from . import TfmConfig, TfmForCausalLM, TfmForConditionalGeneration, TfmForSequenceClassification, TfmSeq2SeqConfig
from .checkpoint import staged_folder
from .programs import run_program
from .training import FreeCoreThreads

logger = logging.getLogger(__name__)

MODEL_MARKERS = ("config.json", "adapter_config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json")


class OutputDirError(ValueError):
    """The output folder cannot be written (it holds another model and --overwrite was not given, ...)."""


# ---------------------------------------------------------------------------------------------------------------------
# Output folders


def check_output_dir(
    dst: str | os.PathLike, overwrite: bool = False, replaceable: Callable[[Path], bool] | None = None
):
    """Refuse a target that exists with content, unless `overwrite` or `replaceable(dst)` says it may be replaced."""
    dst = Path(dst)
    if not dst.exists():
        return
    if not dst.is_dir():
        raise OutputDirError(f"{dst} exists and is not a directory")
    if not any(dst.iterdir()) or overwrite or (replaceable is not None and replaceable(dst)):
        return
    what = "another model" if any((dst / m).exists() for m in MODEL_MARKERS) else "other files"
    raise OutputDirError(f"{dst} already holds {what}; choose another --output-dir or pass --overwrite to replace it")


# ---------------------------------------------------------------------------------------------------------------------
# Training settings and data sets


@dataclass
class TrainSettings:
    """The Trainer knobs the CLI exposes. `max_steps > 0` wins over `epochs`."""

    max_steps: int = 200
    epochs: float = 1.0
    learning_rate: float = 1e-3
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    warmup_steps: int | None = None  # None: 5% of the steps
    weight_decay: float = 0.01
    evals: int = 4  # held-out evaluations during training (LM), for the loss curve
    logging_steps: int | None = None  # None: about 25 points per run

    def as_dict(self) -> dict[str, Any]:
        """The settings as they take effect (no `epochs` when `max_steps` wins; the warm-up default spelled out)."""
        values = asdict(self)
        if self.max_steps > 0:
            values.pop("epochs")
        if self.warmup_steps is None:
            values["warmup_steps"] = "5% of the steps"
        if self.logging_steps is None:
            values.pop("logging_steps")
        return values


class _Examples(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


def pack_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str], seq_len: int) -> list[list[int]]:
    """Tokenise `texts` (each starts with `<s>`), join them with `</s>` and cut the stream into `seq_len` blocks."""
    stream: list[int] = []
    eos = tokenizer.eos_token_id
    backend = tokenizer.backend_tokenizer
    for start in range(0, len(texts), 512):
        for encoding in backend.encode_batch(texts[start : start + 512]):
            stream.extend(encoding.ids)
            stream.append(eos)
    return [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


def _training_args(
    settings: TrainSettings,
    scratch: Path,
    total_steps: int,
    eval_steps: int | None,
    args_class: type[TrainingArguments] = TrainingArguments,
) -> TrainingArguments:
    warmup = settings.warmup_steps if settings.warmup_steps is not None else max(1, total_steps // 20)
    logging_steps = settings.logging_steps or max(1, total_steps // 25)
    return args_class(
        output_dir=str(scratch),
        max_steps=settings.max_steps if settings.max_steps > 0 else -1,
        num_train_epochs=settings.epochs,
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=warmup,
        weight_decay=settings.weight_decay,
        logging_steps=logging_steps,
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        save_strategy="no",
        report_to="none",
        seed=settings.seed,
        data_seed=settings.seed,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
        disable_tqdm=False,
    )


def _total_steps(settings: TrainSettings, num_examples: int) -> int:
    if settings.max_steps > 0:
        return settings.max_steps
    return max(1, math.ceil(settings.epochs * math.ceil(num_examples / settings.batch_size)))


def loss_history(trainer: Trainer) -> dict[str, list[list[float]]]:
    """`{"train": [[step, loss], ...], "eval": [[step, eval_loss], ...]}` from the Trainer's log history."""
    history: dict[str, list[list[float]]] = {"train": [], "eval": []}
    for entry in trainer.state.log_history:
        if "loss" in entry:
            history["train"].append([entry["step"], entry["loss"]])
        if "eval_loss" in entry:
            history["eval"].append([entry["step"], entry["eval_loss"]])
    return history


# The attention (self- and cross-) and MLP projections of hf_tfm's blocks: what LoRA adapts.
_LORA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _with_lora(model: PreTrainedModel, task_type: str, lora_r: int, target_modules: list[str] | str) -> Any:
    """`model` wrapped with LoRA adapters of rank `lora_r` (alpha 2r, dropout 0.05) on `target_modules`.

    `task_type` names a `peft.TaskType` member ("SEQ_CLS", "SEQ_2_SEQ_LM").
    """
    from peft import LoraConfig, TaskType, get_peft_model

    lora_config = LoraConfig(
        task_type=TaskType[task_type],
        r=lora_r,
        lora_alpha=2 * lora_r,
        lora_dropout=0.05,
        target_modules=target_modules,
    )
    return get_peft_model(model, lora_config)


def _run_trainer(
    model: Any,
    settings: TrainSettings,
    train_set: _Examples,
    test_set: _Examples,
    data_collator: Callable[[list[dict[str, Any]]], dict[str, Any]],
    finish: Callable[[Trainer], Any],
    trainer_class: type[Trainer] = Trainer,
    args_class: type[TrainingArguments] = TrainingArguments,
    label_smoothing: float = 0.0,
) -> tuple[Trainer, Any]:
    """Train `model` on `train_set` in a scratch folder, then run `finish(trainer)` (the final evaluation) while the
    scratch folder and the thread settings still hold. Returns the trainer and what `finish` returned.

    `label_smoothing` becomes the arguments' `label_smoothing_factor` (0.0, their default: none).
    """
    total = _total_steps(settings, len(train_set))
    with tempfile.TemporaryDirectory(prefix="hf-tfm-trainer-") as scratch, FreeCoreThreads() as threads:
        # the test set's loss `settings.evals` times during training, for the held-out curve (nothing is chosen on it)
        eval_steps = max(1, total // max(settings.evals, 1))
        args = _training_args(settings, Path(scratch), total, eval_steps, args_class)
        args.label_smoothing_factor = label_smoothing
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=train_set,
            eval_dataset=test_set,
            data_collator=data_collator,
            callbacks=[threads],
        )
        trainer.train()
        final = finish(trainer)
    return trainer, final


def _history_with_final(
    trainer: Trainer, final_metrics: dict[str, float], loss_key: str
) -> dict[str, list[list[float]]]:
    """`loss_history(trainer)`, ending with the final evaluation's loss (`final_metrics[loss_key]`) unless the last
    evaluation during training was at the last step."""
    history = loss_history(trainer)
    if not history["eval"] or history["eval"][-1][0] != trainer.state.global_step:
        history["eval"].append([trainer.state.global_step, final_metrics[loss_key]])
    return history


# ---------------------------------------------------------------------------------------------------------------------
# Causal LM


def pretrain_causal_lm(
    model: PreTrainedModel | TfmConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_texts: list[str],
    eval_texts: list[str],
    settings: TrainSettings,
    out_dir: str | os.PathLike,
) -> dict[str, Any]:
    """Train a causal LM (a new `TfmForCausalLM` when given a config) on packed blocks, save it to `out_dir`.

    Saves weights (safetensors), config with `auto_map`, code, tokenizer and generation config. Returns the metrics:
    held-out loss and perplexity, token counts, the loss history and the parameter count.
    """
    out_dir = Path(out_dir)
    train_blocks = pack_texts(tokenizer, train_texts, settings.seq_len)
    eval_blocks = pack_texts(tokenizer, eval_texts, settings.seq_len)
    if not train_blocks:
        raise ValueError(f"the training text is shorter than one block of --seq-len {settings.seq_len} tokens")
    if not eval_blocks:
        raise ValueError(f"the held-out text is shorter than one block of --seq-len {settings.seq_len} tokens")
    torch.manual_seed(settings.seed)
    if isinstance(model, TfmConfig):
        model = TfmForCausalLM(model)
    total = _total_steps(settings, len(train_blocks))
    eval_steps = max(1, total // max(settings.evals, 1))
    rows = lambda blocks: _Examples([{"input_ids": b, "labels": b} for b in blocks])  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="hf-tfm-trainer-") as scratch, FreeCoreThreads() as threads:
        trainer = Trainer(
            model=model,
            args=_training_args(settings, Path(scratch), total, eval_steps),
            train_dataset=rows(train_blocks),
            eval_dataset=rows(eval_blocks),
            data_collator=default_data_collator,
            callbacks=[threads],
        )
        trainer.train()
        final = trainer.evaluate()
    history = loss_history(trainer)
    if not history["eval"] or history["eval"][-1][0] != trainer.state.global_step:
        history["eval"].append([trainer.state.global_step, final["eval_loss"]])
    model.config.use_cache = True  # Trainer turned it off for training; generation wants it back
    model.generation_config = GenerationConfig(
        do_sample=True,
        temperature=0.8,
        top_k=50,
        top_p=0.95,
        max_new_tokens=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {
        "eval_loss": final["eval_loss"],
        "perplexity": math.exp(min(final["eval_loss"], 50.0)),
        "train_loss": history["train"][-1][1] if history["train"] else None,
        "steps": trainer.state.global_step,
        "train_tokens": len(train_blocks) * settings.seq_len,
        "eval_tokens": len(eval_blocks) * settings.seq_len,
        "parameters": model.num_parameters(),
        "history": history,
    }


def generate_in_fresh_process(
    folder: str | os.PathLike, prompts: list[str], max_new_tokens: int = 40, seed: int = 0, timeout: float = 300.0
) -> dict[str, Any]:
    """Load `folder` with `AutoModelForCausalLM(trust_remote_code=True)` in a new Python where `hf_tfm` cannot be
    imported, and sample a continuation of each prompt. Returns `{"class": ..., "generations": [...]}`.

    It runs the folder's own code (`configuration.py`, `modeling.py`): it is the check that a folder hf_tfm has just
    written stands alone (`hf_tfm/programs/standalone_generate.py`). Pass only such a folder, never one from elsewhere:
    hf_tfm passes trust_remote_code=True itself only here; every other load leaves the choice to the caller.
    """
    args = {"path": str(folder), "prompts": prompts, "max_new_tokens": max_new_tokens, "seed": seed}
    with tempfile.TemporaryDirectory(prefix="hf-tfm-modules-") as modules:
        env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": modules, "TOKENIZERS_PARALLELISM": "false"}
        where = "reloading in a fresh process without hf_tfm"
        return run_program("standalone_generate", args, where, blocked=("hf_tfm",), env=env, timeout=timeout)


# ---------------------------------------------------------------------------------------------------------------------
# Sequence classification


def _model_name(model: PreTrainedModel | TfmConfig | str | os.PathLike) -> str | None:
    """What an adapter should name as its base: a checkpoint folder (absolute) or Hub id, else nothing."""
    if isinstance(model, (str, os.PathLike)):
        return str(Path(model).resolve()) if Path(model).exists() else str(model)
    return None


def _save_adapter(peft_model: Any, folder: Path, base: str | None, auto_class: str, kwargs: dict[str, Any]) -> None:
    """Save the adapter naming its real base, and say in its README how to rebuild the base it was trained on."""
    if base is not None:
        for adapter_config in peft_model.peft_config.values():
            adapter_config.base_model_name_or_path = base
    peft_model.save_pretrained(folder)
    call = "".join(f", {key}={value!r}" for key, value in kwargs.items())
    # The README's snippet is for readers who may not have hf_tfm installed: there the base loads from its own code,
    # which only trust_remote_code=True runs (with hf_tfm installed, its registered classes are used either way).
    with (folder / "README.md").open("a", encoding="utf-8") as readme:
        readme.write(
            "\n## Loading this adapter with hf-tfm\n\n"
            "It was trained on the base loaded as\n\n```python\n"
            f"base = {auto_class}.from_pretrained({base!r}, trust_remote_code=True{call})\n"
            'model = PeftModel.from_pretrained(base, "<this folder>")\n```\n'
        )


def _classifier_model(
    model: PreTrainedModel | TfmConfig | str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    label_names: list[str],
    config_overrides: dict[str, Any] | None,
    trust_remote_code: bool,
) -> PreTrainedModel:
    """The classifier to train, labelled with `label_names`: a new one from a config, the model given, or a
    checkpoint loaded (a causal-LM one gets a fresh `score` head); its `pad_token_id` the tokenizer's when unset."""
    label_kwargs = {
        "num_labels": len(label_names),
        "id2label": dict(enumerate(label_names)),
        "label2id": {name: i for i, name in enumerate(label_names)},
    }
    if isinstance(model, TfmConfig):
        for key, value in label_kwargs.items():
            setattr(model, key, value)
        model = TfmForSequenceClassification(model)
    elif not isinstance(model, PreTrainedModel):
        model = AutoModelForSequenceClassification.from_pretrained(
            model, trust_remote_code=trust_remote_code, **label_kwargs, **(config_overrides or {})
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def _classification_examples(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], labels: list[int], seq_len: int
) -> _Examples:
    """The texts tokenised (cut to `seq_len` tokens) with their labels, unpadded (the collator pads)."""
    enc = tokenizer(texts, truncation=True, max_length=seq_len)
    return _Examples(
        [
            {"input_ids": ids, "attention_mask": mask, "labels": label}
            for ids, mask, label in zip(enc["input_ids"], enc["attention_mask"], labels, strict=True)
        ]
    )


def _lora_targets(model: PreTrainedModel) -> list[str] | str:
    """The `_LORA_PROJECTIONS` the model's linear layers are named after, or "all-linear" when it has none."""
    names = set(_LORA_PROJECTIONS)
    present = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return [n for n in present if n in names] or "all-linear"


def _accuracy(logits: Any, labels: list[int]) -> float:
    """The share of examples whose highest logit is their label (`logits` may come as the first of a tuple)."""
    logits = logits[0] if isinstance(logits, tuple) else logits
    predicted = logits.argmax(-1).tolist()
    return sum(p == t for p, t in zip(predicted, labels, strict=True)) / max(len(labels), 1)


def finetune_classifier(
    model: PreTrainedModel | TfmConfig | str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    train: tuple[list[str], list[int]],
    test: tuple[list[str], list[int]],
    label_names: list[str],
    settings: TrainSettings,
    out_dir: str | os.PathLike,
    lora: bool = False,
    lora_r: int = 8,
    config_overrides: dict[str, Any] | None = None,
    adapter_base: str | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Fine-tune a sequence classifier (fully, or with LoRA adapters plus a trained `score` head) and save it.

    `model` is a config (new model), a model, or a checkpoint path/id; a causal-LM checkpoint gets a fresh `score`
    head. With LoRA the folder holds the merged model (loadable by `AutoModelForSequenceClassification`) and the
    adapter alone in `adapter/`, whose `base_model_name_or_path` is `adapter_base` (default: `model` when it is a
    path or Hub id; pass the final location when `model` sits in a staging folder). `trust_remote_code`: run code a
    checkpoint `model` ships (transformers' flag; hf_tfm's own checkpoints load without it). Returns test accuracy,
    loss history and sizes.
    """
    out_dir = Path(out_dir)
    adapter_base = adapter_base or _model_name(model)
    torch.manual_seed(settings.seed)
    model = _classifier_model(model, tokenizer, label_names, config_overrides, trust_remote_code)
    train_set = _classification_examples(tokenizer, *train, settings.seq_len)
    test_set = _classification_examples(tokenizer, *test, settings.seq_len)
    trainable = _with_lora(model, "SEQ_CLS", lora_r, _lora_targets(model)) if lora else model
    trainable_params, all_params = (
        sum(p.numel() for p in trainable.parameters() if p.requires_grad),
        sum(p.numel() for p in trainable.parameters()),
    )
    logger.info("classifier: %d of %d parameters trainable (lora=%s)", trainable_params, all_params, lora)
    trainer, prediction = _run_trainer(
        trainable, settings, train_set, test_set, DataCollatorWithPadding(tokenizer), lambda t: t.predict(test_set)
    )
    history = _history_with_final(trainer, prediction.metrics, "test_loss")
    accuracy = _accuracy(prediction.predictions, test[1])
    if lora:
        kwargs = {"num_labels": len(label_names), **(config_overrides or {})}
        _save_adapter(trainable, out_dir / "adapter", adapter_base, "AutoModelForSequenceClassification", kwargs)
        model = trainable.merge_and_unload()
    model.config.use_cache = True
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {
        "test_accuracy": accuracy,
        "test_loss": prediction.metrics.get("test_loss"),
        "train_examples": len(train_set),
        "test_examples": len(test_set),
        "steps": trainer.state.global_step,
        "trainable_parameters": trainable_params,
        "parameters": model.num_parameters(),  # after merging LoRA, as saved
        "lora": lora,
        "history": history,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Sequence to sequence


def word_f1(prediction: str, target: str) -> float:
    """F1 of the lower-cased words (split at anything not a letter or digit, `_` too) two texts have in common.

    Partial credit where exact match gives none: `show_list` for `show_window` scores 0.5.
    """
    predicted, wanted = (Counter(w for w in re.split(r"[\W_]+", t.lower()) if w) for t in (prediction, target))
    common = sum((predicted & wanted).values())
    if not common:
        return float(predicted == wanted)  # both empty: a match
    precision, recall = common / sum(predicted.values()), common / sum(wanted.values())
    return 2 * precision * recall / (precision + recall)


def score_texts(predictions: list[str], targets: list[str]) -> dict[str, float]:
    """Exact match (after stripping whitespace) and mean word F1 of predicted texts against the targets."""
    pairs = list(zip(predictions, targets, strict=True))
    return {
        "exact_match": sum(p.strip() == t.strip() for p, t in pairs) / max(len(pairs), 1),
        "word_f1": sum(word_f1(p, t) for p, t in pairs) / max(len(pairs), 1),
    }


def generate_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sources: list[str],
    max_source_len: int,
    max_new_tokens: int,
    batch_size: int = 64,
) -> list[str]:
    """Greedy generations of a seq2seq model for each source, decoded without special tokens."""
    model.eval()
    texts = []
    with torch.no_grad():
        for start in range(0, len(sources), batch_size):
            enc = tokenizer(
                sources[start : start + batch_size],
                truncation=True,
                max_length=max_source_len,
                padding=True,
                return_tensors="pt",
            ).to(model.device)
            enc.pop("token_type_ids", None)
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
            texts += tokenizer.batch_decode(ids, skip_special_tokens=True)
    return texts


def seq2seq_from_causal_lm(
    model: PreTrainedModel | str | os.PathLike,
    trust_remote_code: bool = False,
    overrides: dict[str, Any] | None = None,
) -> TfmForConditionalGeneration:
    """An encoder-decoder warm-started from an hf_tfm causal LM (Rothe et al., arXiv:1907.12461): both sides get the
    LM's blocks and embeddings (the encoder with bidirectional attention), the LM head stays the head, and only the
    decoder's cross-attention (and its norms) start untrained. The two sides share one token table.

    `trust_remote_code`: run code a checkpoint path or Hub id ships (transformers' flag; hf_tfm's own load without).
    `overrides`: knobs that change nothing in the weights, set on both sides (`hidden_dropout`, `attention_dropout`).
    """
    if not isinstance(model, PreTrainedModel):
        model = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=trust_remote_code)
    if not isinstance(model.config, TfmConfig) or not model.config.is_causal:
        raise ValueError(f"{type(model).__name__} is not an hf_tfm causal LM: nothing to warm-start from")
    config = model.config
    # The LM's own knobs (not the base config's bookkeeping), with what makes each side an encoder or a decoder.
    knobs = {f.name: getattr(config, f.name) for f in dataclasses.fields(TfmConfig) if f.name in TfmConfig.__dict__}
    for derived in ("is_causal", "add_cross_attention", "classifier_pooling"):
        knobs.pop(derived)
    knobs.update(overrides or {})
    seq2seq_config = TfmSeq2SeqConfig(
        encoder={**knobs, "is_causal": False}, decoder=knobs, tie_word_embeddings=config.tie_word_embeddings
    )
    seq2seq_config._attn_implementation = config._attn_implementation  # the LM's kernel, on both sides
    seq2seq = TfmForConditionalGeneration(seq2seq_config)
    backbone = model.model.state_dict()
    seq2seq.model.encoder.load_state_dict(backbone)
    untrained = seq2seq.model.decoder.load_state_dict(backbone, strict=False).missing_keys
    if any(".encoder_attn." not in key and ".cross_attn_norm." not in key for key in untrained):
        raise RuntimeError(f"the LM's blocks did not fill the decoder's: missing {untrained}")
    seq2seq.lm_head.load_state_dict(model.lm_head.state_dict())  # tied: the same values; untied: the LM's own
    return seq2seq.to(model.dtype)


class _Seq2SeqTrainer(Seq2SeqTrainer):
    """`Seq2SeqTrainer` whose evaluation loss is plain cross-entropy also when training smooths its labels, so a
    held-out loss compares with other runs and baselines."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training or self.label_smoother is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        smoother, self.label_smoother = self.label_smoother, None
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.label_smoother = smoother


def _seq2seq_model(
    model: PreTrainedModel | TfmSeq2SeqConfig | str | os.PathLike, trust_remote_code: bool
) -> PreTrainedModel:
    """The encoder-decoder to train: a new `TfmForConditionalGeneration` from a config, the model given, or a
    checkpoint loaded; a `ValueError` when it is not an encoder-decoder."""
    if isinstance(model, TfmSeq2SeqConfig):
        model = TfmForConditionalGeneration(model)
    elif not isinstance(model, PreTrainedModel):
        model = AutoModelForSeq2SeqLM.from_pretrained(model, trust_remote_code=trust_remote_code)
    if not model.config.is_encoder_decoder:
        raise ValueError(f"{type(model).__name__} is not an encoder-decoder model: seq2seq training needs one")
    return model


def _seq2seq_examples(
    tokenizer: PreTrainedTokenizerBase, sources: list[str], targets: list[str], seq_len: int, max_target_len: int
) -> _Examples:
    """Sources tokenised and cut to `seq_len` tokens; their labels the targets cut to `max_target_len` with `</s>`."""
    enc = tokenizer(sources, truncation=True, max_length=seq_len)
    labels = tokenizer(targets, add_special_tokens=False, truncation=True, max_length=max_target_len - 1)
    return _Examples(
        [
            {"input_ids": ids, "attention_mask": mask, "labels": [*target, tokenizer.eos_token_id]}
            for ids, mask, target in zip(enc["input_ids"], enc["attention_mask"], labels["input_ids"], strict=True)
        ]
    )


def _greedy_generation_config(
    tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, decoder_start_token_id: int | None
) -> GenerationConfig:
    """The generation defaults a trained seq2seq model is saved with: greedy, the tokenizer's special tokens."""
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=decoder_start_token_id,
    )


def _generation_scores(predictions: list[str], test: tuple[list[str], list[str]], majority: str) -> dict[str, Any]:
    """Exact match and word F1 of the predictions, the same for always answering `majority` (the baseline), and the
    first 8 examples (sources cut to 200 characters)."""
    scores, baseline = score_texts(predictions, test[1]), score_texts([majority] * len(test[1]), test[1])
    return {
        **scores,
        "baseline_target": majority,
        "baseline_exact_match": baseline["exact_match"],
        "baseline_word_f1": baseline["word_f1"],
        "examples": [
            {"source": source[:200], "target": target, "prediction": prediction}
            for source, target, prediction in list(zip(*test, predictions, strict=True))[:8]
        ],
    }


def train_seq2seq(
    model: PreTrainedModel | TfmSeq2SeqConfig | str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    train: tuple[list[str], list[str]],
    test: tuple[list[str], list[str]],
    settings: TrainSettings,
    out_dir: str | os.PathLike,
    lora: bool = False,
    lora_r: int = 8,
    max_target_len: int = 32,
    adapter_base: str | None = None,
    trust_remote_code: bool = False,
    label_smoothing: float = 0.0,
) -> dict[str, Any]:
    """Train a sequence-to-sequence model on (source, target) pairs with `Seq2SeqTrainer` and save it.

    `model` is a `TfmSeq2SeqConfig` (a new `TfmForConditionalGeneration`), a model, or a seq2seq checkpoint path/id.
    Sources are cut to `settings.seq_len` tokens, targets to `max_target_len` (with their `</s>`); the decoder
    inputs are the targets shifted right behind `decoder_start_token_id`, built by `DataCollatorForSeq2Seq`. With
    LoRA (self- and cross-attention and MLP projections) the folder holds the merged model and `adapter/` the
    adapter alone. `trust_remote_code`: run code a checkpoint `model` ships (transformers' flag; hf_tfm's own
    checkpoints load without it). `label_smoothing`: of the training loss (`label_smoothing_factor`); the held-out
    loss stays plain cross-entropy. Returns the held-out loss, the held-out greedy generations' exact match and word
    F1 next to the majority-target baseline, a few examples, the loss history and sizes.
    """
    out_dir = Path(out_dir)
    adapter_base = adapter_base or _model_name(model)
    torch.manual_seed(settings.seed)
    model = _seq2seq_model(model, trust_remote_code)
    train_set = _seq2seq_examples(tokenizer, *train, settings.seq_len, max_target_len)
    test_set = _seq2seq_examples(tokenizer, *test, settings.seq_len, max_target_len)
    trainable = _with_lora(model, "SEQ_2_SEQ_LM", lora_r, list(_LORA_PROJECTIONS)) if lora else model
    trainable_params = sum(p.numel() for p in trainable.parameters() if p.requires_grad)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    trainer, final = _run_trainer(
        trainable,
        settings,
        train_set,
        test_set,
        collator,
        lambda t: t.evaluate(),
        trainer_class=_Seq2SeqTrainer,
        args_class=Seq2SeqTrainingArguments,
        label_smoothing=label_smoothing,
    )
    history = _history_with_final(trainer, final, "eval_loss")
    if lora:
        _save_adapter(trainable, out_dir / "adapter", adapter_base, "AutoModelForSeq2SeqLM", {})
        model = trainable.merge_and_unload()
    model.config.use_cache = True  # Trainer turned it off for training; generation wants it back
    predictions = generate_texts(model, tokenizer, test[0], settings.seq_len, max_target_len)
    majority = Counter(train[1]).most_common(1)[0][0]
    model.generation_config = _greedy_generation_config(tokenizer, max_target_len, model.config.decoder_start_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    scores = _generation_scores(predictions, test, majority)
    return {
        "eval_loss": final["eval_loss"],
        **scores,
        "train_examples": len(train_set),
        "test_examples": len(test_set),
        "steps": trainer.state.global_step,
        "trainable_parameters": trainable_params,
        "parameters": model.num_parameters(),
        "lora": lora,
        "history": history,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Reports


def plot_loss_curves(
    panels: dict[str, dict[str, list[list[float]]]],
    path: str | os.PathLike,
    baselines: dict[str, tuple[float, str]] | None = None,
) -> Path:
    """One panel per run: train loss and held-out loss against step, and the run's baseline (`baselines[title]`: a
    loss and what it is, e.g. a unigram model's) as a dotted line, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, history) in zip(axes[0], panels.items(), strict=True):
        for kind, style, label in (("train", "-", "train loss"), ("eval", "o--", "held-out loss")):
            points = history.get(kind) or []
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        if baselines and title in baselines:
            loss, what = baselines[title]
            ax.axhline(loss, color="0.4", linestyle=":", label=f"{what} ({loss:.2f})")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy loss")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def architecture_summary(config: TfmConfig | TfmSeq2SeqConfig) -> list[tuple[str, Any]]:
    """The config fields a reader of a model card wants, as (name, value) rows; an encoder-decoder's per side."""
    if isinstance(config, TfmSeq2SeqConfig):
        top = [(k, getattr(config, k)) for k in ("share_encoder_decoder_embeddings", "tie_word_embeddings")]
        sides = [
            (f"{side}.{k}", v)
            for side in ("encoder", "decoder")
            for k, v in architecture_summary(getattr(config, side))
            if k not in ("is_causal", "tie_word_embeddings", "classifier_pooling")
        ]
        return [*top, ("decoder_start_token_id", config.decoder_start_token_id), *sides]
    keys = [
        "is_causal",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "max_position_embeddings",
        "position_embedding_type",
        "norm_type",
        "norm_position",
        "ffn_type",
        "hidden_act",
        "tie_word_embeddings",
        "classifier_pooling",
        "sliding_window",
    ]
    if getattr(config, "num_experts", None) is not None:  # a mixture of experts: which, how wide, where
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
        keys += ["mlp_only_layers", "decoder_sparse_step"]
    return [(k, getattr(config, k)) for k in keys if hasattr(config, k)]


def write_model_card(
    folder: str | os.PathLike,
    *,
    title: str,
    summary: str,
    config: TfmConfig,
    parameters: int,
    data: list[str],
    settings: dict[str, Any],
    metrics: dict[str, Any],
    pipeline_tag: str,
    auto_class: str,
    extra: str = "",
) -> Path:
    """Write `README.md`: YAML metadata, architecture, data, training settings, metrics and how to load it.

    The usage snippet passes `trust_remote_code=True`: it is for readers without hf_tfm, where the folder loads from
    the code it carries (our own folder, as hf_tfm wrote it); with hf_tfm installed its registered classes are used.
    """
    metric_rows = "\n".join(f"| {k} | {_fmt(v)} |" for k, v in metrics.items())
    arch_rows = "\n".join(f"| `{k}` | {v} |" for k, v in architecture_summary(config))
    setting_rows = "\n".join(f"| {k} | {v} |" for k, v in settings.items())
    data_lines = "\n".join(f"- {line}" for line in data)
    text = f"""---
library_name: transformers
pipeline_tag: {pipeline_tag}
tags:
- hf_tfm
- custom_code
---

# {title}

{summary}

## Architecture

An `hf_tfm` transformer ({_kind(config)}), {parameters:,} parameters. The modelling
code ships in this folder (`configuration.py`, `modeling.py`), so it loads without installing `hf_tfm`.

| field | value |
|---|---|
{arch_rows}

## Data

{data_lines}

## Training settings

| setting | value |
|---|---|
{setting_rows}

## Metrics

| metric | value |
|---|---|
{metric_rows}

## Usage

```python
from transformers import {auto_class}, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("path/or/repo-id", trust_remote_code=True)
model = {auto_class}.from_pretrained("path/or/repo-id", trust_remote_code=True)
```
{extra}
"""
    path = Path(folder) / "README.md"
    path.write_text(text, encoding="utf-8")
    return path


def _kind(config: TfmConfig | TfmSeq2SeqConfig) -> str:
    if isinstance(config, TfmSeq2SeqConfig):
        return "encoder-decoder"
    return "decoder" if config.is_causal else "encoder"


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------------------------------
# A training job: what every `hf-tfm` training command does with its output folder


def training_job(
    output_dir: str | os.PathLike,
    train: Callable[[Path], dict[str, Any]],
    card: Callable[[dict[str, Any]], dict[str, Any]],
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train one model into `output_dir`, all or nothing: stage the folder, train, write the model card and metrics.

    `train(folder)` trains, saves the model into the staged `folder` and returns its metrics (with `parameters`);
    `card(metrics)` gives the model card's text, `write_model_card`'s arguments but `config` (read back from the
    saved folder) and `parameters`. The metrics also go to `metrics.json`. The folder replaces `output_dir` only once
    all of it is written (`staged_folder`); an `output_dir` that holds files is refused without `overwrite`
    (`check_output_dir`). Returns the metrics.
    """
    check_output_dir(output_dir, overwrite)
    with staged_folder(output_dir) as folder:
        metrics = train(folder)
        config = AutoConfig.from_pretrained(folder)  # hf_tfm's registered classes: no code of the folder runs
        write_model_card(folder, config=config, parameters=metrics["parameters"], **card(metrics))
        (folder / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    return metrics


def load_causal_lm(path: str | os.PathLike, trust_remote_code: bool = False, **kwargs: Any) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)` (`dtype`, a
    quantization config: `hf_tfm.inference.quantization_kwargs`).

    Code a folder or Hub repository ships runs only with `trust_remote_code=True` (transformers' `ValueError`
    otherwise); hf_tfm's own folders load without it, through the classes importing hf_tfm registered.
    """
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)


__all__ = [
    "OutputDirError",
    "TrainSettings",
    "check_output_dir",
    "finetune_classifier",
    "generate_in_fresh_process",
    "generate_texts",
    "loss_history",
    "pack_texts",
    "plot_loss_curves",
    "pretrain_causal_lm",
    "score_texts",
    "seq2seq_from_causal_lm",
    "train_seq2seq",
    "training_job",
    "word_f1",
    "write_model_card",
]
