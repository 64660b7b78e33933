"""Causal-LM pretraining on packed text (`hf-tfm pretrain`, the demo), and the loader the CLI uses for a causal LM.

Texts are joined with `</s>` and cut into equal blocks, so no batch carries padding; the model is saved with sampling
defaults (`generation_config`) that make `generate()` and `hf-tfm generate` produce text without further options.
"""

import math
import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    default_data_collator,
)

from ..configuration import TfmConfig
from ..modeling import TfmForCausalLM
from .trainer import Examples, TrainSettings, history_with_final, launch_of, pack_texts, run_trainer


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
    rows = lambda blocks: Examples([{"input_ids": b, "labels": b} for b in blocks])  # noqa: E731
    # Packed blocks are all seq_len long: the default collator stacks them, no padding to mask
    trainer, final = run_trainer(
        model, settings, rows(train_blocks), rows(eval_blocks), default_data_collator, lambda t: t.evaluate()
    )
    history = history_with_final(trainer, final, "eval_loss")
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
        "launch": launch_of(trainer),
        "train_tokens": len(train_blocks) * settings.seq_len,
        "eval_tokens": len(eval_blocks) * settings.seq_len,
        "parameters": model.num_parameters(),
        "history": history,
    }


def load_causal_lm(path: str | os.PathLike, trust_remote_code: bool = False, **kwargs: Any) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)` (`dtype`, a
    quantization config: `hf_tfm.inference.quantization_kwargs`).

    Code a folder or Hub repository ships runs only with `trust_remote_code=True` (transformers' `ValueError`
    otherwise); hf_tfm's own folders load without it, through the classes importing hf_tfm registered.
    """
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)


__all__ = ["load_causal_lm", "pretrain_causal_lm"]
