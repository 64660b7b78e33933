"""Sequence-to-sequence training (`hf-tfm pretrain|finetune --task seq2seq`, the demo): `Seq2SeqTrainer` on (source,
target) pairs, then the held-out sources answered greedily and scored; and the warm start of an encoder-decoder from a
causal LM.

The decoder inputs are the targets shifted right, built by `DataCollatorForSeq2Seq` from the labels (teacher forcing);
the saved model's generation defaults are greedy, the decoding it was scored with.
"""

import dataclasses
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    DataCollatorForSeq2Seq,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)

from ..configuration import TfmConfig, TfmSeq2SeqConfig
from ..modeling import TfmForConditionalGeneration
from .generation import generate_texts
from .lora import LORA_PROJECTIONS, adapter_base_of, save_adapter, with_lora
from .metrics import generation_scores
from .trainer import Examples, TrainSettings, history_with_final, launch_of, run_trainer


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
) -> Examples:
    """Sources tokenised and cut to `seq_len` tokens; their labels the targets cut to `max_target_len` with `</s>`."""
    enc = tokenizer(sources, truncation=True, max_length=seq_len)
    labels = tokenizer(targets, add_special_tokens=False, truncation=True, max_length=max_target_len - 1)
    return Examples(
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
    adapter_base = adapter_base or adapter_base_of(model)
    torch.manual_seed(settings.seed)
    model = _seq2seq_model(model, trust_remote_code)
    train_set = _seq2seq_examples(tokenizer, *train, settings.seq_len, max_target_len)
    test_set = _seq2seq_examples(tokenizer, *test, settings.seq_len, max_target_len)
    trainable = with_lora(model, "SEQ_2_SEQ_LM", lora_r, list(LORA_PROJECTIONS)) if lora else model
    trainable_params = sum(p.numel() for p in trainable.parameters() if p.requires_grad)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    trainer, final = run_trainer(
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
    history = history_with_final(trainer, final, "eval_loss")
    if lora:
        save_adapter(trainable, out_dir / "adapter", adapter_base, "AutoModelForSeq2SeqLM", {})
        model = trainable.merge_and_unload()
    model.config.use_cache = True  # Trainer turned it off for training; generation wants it back
    predictions = generate_texts(model, tokenizer, test[0], settings.seq_len, max_target_len)
    majority = Counter(train[1]).most_common(1)[0][0]
    model.generation_config = _greedy_generation_config(tokenizer, max_target_len, model.config.decoder_start_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    scores = generation_scores(predictions, test, majority)
    return {
        "eval_loss": final["eval_loss"],
        **scores,
        "train_examples": len(train_set),
        "test_examples": len(test_set),
        "steps": trainer.state.global_step,
        "launch": launch_of(trainer),
        "trainable_parameters": trainable_params,
        "parameters": model.num_parameters(),
        "lora": lora,
        "history": history,
    }


__all__ = ["seq2seq_from_causal_lm", "train_seq2seq"]
