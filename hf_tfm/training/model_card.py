"""The `README.md` hf_tfm writes into a trained model's folder: Hub metadata, the architecture, data, settings, metrics
and how to load it. The Hub reads `library_name` and `pipeline_tag` from its YAML header for the model page's widget.
"""

import os
from pathlib import Path
from typing import Any

from ..configuration import TfmConfig, TfmSeq2SeqConfig


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
    base_model: str | None = None,
    license: str | None = None,
) -> Path:
    """Write `README.md`: YAML metadata, architecture, data, training settings, metrics and how to load it.

    The usage snippet passes `trust_remote_code=True`: it is for readers without hf_tfm, where the folder loads from
    the code it carries (our own folder, as hf_tfm wrote it); with hf_tfm installed its registered classes are used.
    `base_model` (the Hub id the model was fine-tuned from) and `license` (a Hub license identifier) go into the
    metadata when given.
    """
    metric_rows = "\n".join(f"| {k} | {_fmt(v)} |" for k, v in metrics.items())
    arch_rows = "\n".join(f"| `{k}` | {v} |" for k, v in architecture_summary(config))
    setting_rows = "\n".join(f"| {k} | {v} |" for k, v in settings.items())
    data_lines = "\n".join(f"- {line}" for line in data)
    metadata = "".join(f"{k}: {v}\n" for k, v in (("base_model", base_model), ("license", license)) if v)
    text = f"""---
library_name: transformers
pipeline_tag: {pipeline_tag}
{metadata}tags:
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


__all__ = ["architecture_summary", "write_model_card"]
