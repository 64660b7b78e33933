"""Sequence-classifier fine-tuning (`hf-tfm finetune`, the demo): a new model, a checkpoint (a causal LM gets a fresh
`score` head) or a model given, trained fully or with LoRA adapters, and saved merged, with the adapter beside it.

The examples are left unpadded and padded per batch (`DataCollatorWithPadding`): most batches then need far fewer
positions than the longest text, and the classifier pools the real tokens only.
"""

import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..configuration import TfmConfig
from ..modeling import TfmForSequenceClassification
from .lora import adapter_base_of, lora_targets, save_adapter, with_lora
from .metrics import label_accuracy
from .trainer import Examples, TrainSettings, history_with_final, launch_of, run_trainer

logger = logging.getLogger(__name__)


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
) -> Examples:
    """The texts tokenised (cut to `seq_len` tokens) with their labels, unpadded (the collator pads)."""
    enc = tokenizer(texts, truncation=True, max_length=seq_len)
    return Examples(
        [
            {"input_ids": ids, "attention_mask": mask, "labels": label}
            for ids, mask, label in zip(enc["input_ids"], enc["attention_mask"], labels, strict=True)
        ]
    )


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
    adapter_base = adapter_base or adapter_base_of(model)
    torch.manual_seed(settings.seed)
    model = _classifier_model(model, tokenizer, label_names, config_overrides, trust_remote_code)
    train_set = _classification_examples(tokenizer, *train, settings.seq_len)
    test_set = _classification_examples(tokenizer, *test, settings.seq_len)
    trainable = with_lora(model, "SEQ_CLS", lora_r, lora_targets(model)) if lora else model
    trainable_params, all_params = (
        sum(p.numel() for p in trainable.parameters() if p.requires_grad),
        sum(p.numel() for p in trainable.parameters()),
    )
    logger.info("classifier: %d of %d parameters trainable (lora=%s)", trainable_params, all_params, lora)
    trainer, prediction = run_trainer(
        trainable, settings, train_set, test_set, DataCollatorWithPadding(tokenizer), lambda t: t.predict(test_set)
    )
    history = history_with_final(trainer, prediction.metrics, "test_loss")
    accuracy = label_accuracy(prediction.predictions, test[1])
    if lora:
        kwargs = {"num_labels": len(label_names), **(config_overrides or {})}
        save_adapter(trainable, out_dir / "adapter", adapter_base, "AutoModelForSequenceClassification", kwargs)
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
        "launch": launch_of(trainer),
        "trainable_parameters": trainable_params,
        "parameters": model.num_parameters(),  # after merging LoRA, as saved
        "lora": lora,
        "history": history,
    }


__all__ = ["finetune_classifier"]
