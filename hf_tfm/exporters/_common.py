"""What the runtime exporters share: the tokenizer's files, the verifying prompts, hf_tfm's greedy references, the
greedy-token and logit comparisons, and the in-tree route a refusal names. The runtime's side of a verification is a
program of `hf_tfm.programs`, run in a process of its own."""

import os
import shutil
from pathlib import Path
from typing import Any

from ..configuration import TfmConfig, TfmSeq2SeqConfig

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
# The encoder classes an export runs as one forward of a padded batch (features or a task head's outputs)
ENCODER_CLASSES = (
    "TfmModel",
    "TfmMoeModel",  # the backbone with experts (`TfmModel(config)` builds one)
    "TfmForSequenceClassification",
    "TfmForTokenClassification",
    "TfmForQuestionAnswering",
    "TfmForMaskedLM",
)
# Two texts of different lengths: `verify`'s prompts when none are given
DEFAULT_PROMPTS = ("def main():\n    ", 'import os\nimport sys\n\n\nclass Config:\n    """Return the')


def copy_tokenizer(source: str | None, tokenizer: Any, folder: Path) -> None:
    """Put the tokenizer's files in `folder`: `tokenizer` (a tokenizer, its folder or its tokenizer.json), else the
    model folder `source`'s; nothing when there is neither."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        tokenizer.save_pretrained(folder)
        return
    where = Path(tokenizer) if tokenizer is not None else (Path(source) if source else None)
    if where is None:
        return
    if where.is_file():  # a tokenizer.json
        shutil.copy(where, folder / "tokenizer.json")
        return
    for name in TOKENIZER_FILES:
        if (where / name).is_file():
            shutil.copy(where / name, folder / name)


def prompt_ids(prompts: list[list[int]] | list[str] | None, tokenizer_folder: str | os.PathLike | None) -> list:
    """`prompts` as token ids: ids as given, texts (None: `DEFAULT_PROMPTS`) through the folder's tokenizer."""
    if prompts and not isinstance(prompts[0], str):
        return [list(map(int, prompt)) for prompt in prompts]
    if tokenizer_folder is None:
        raise ValueError("text prompts need the model's folder (its tokenizer): pass token ids.")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, trust_remote_code=False)  # runs no folder code
    return [tokenizer(text)["input_ids"] for text in prompts or DEFAULT_PROMPTS]


def token_agreement(reference: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """`tokens_equal` (every sequence) and `agreement` (the share of the reference's positions with equal tokens; a
    runtime's sequence that stopped early counts its missing tokens as unequal)."""
    total = sum(len(r) for r in reference)
    equal = sum(a == b for r, t in zip(reference, theirs, strict=True) for a, b in zip(r, t, strict=False))
    return {"tokens_equal": reference == theirs, "agreement": equal / total if total else 1.0}


def eos_ids(config: Any) -> list[int]:
    """The config's end-of-sequence ids as a list (empty when it has none): what verification suppresses."""
    eos = config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def greedy_references(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_tfm's greedy `generate()` on each prompt alone, exactly `max_new_tokens` new tokens (EOS suppressed until
    then): the sequences a runtime's tokens and logits are checked against. A causal LM's start with the prompt, an
    encoder-decoder's with the decoder's start token."""
    import torch

    references = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=model.config.pad_token_id,
            )
            references.append(out[0].tolist())
    return references


def new_tokens(references: list[list[int]], prompts: list[list[int]], seq2seq: bool) -> list[list[int]]:
    """The generated part of each reference: after the prompt, or (encoder-decoder) after the decoder's start."""
    return [ref[1 if seq2seq else len(prompt) :] for ref, prompt in zip(references, prompts, strict=True)]


def other_routes(config: TfmConfig | TfmSeq2SeqConfig, then: str, runtimes: str, otherwise: str) -> str:
    """The sentence a runtime's refusal ends with: the first in-tree family `hf_tfm.to_hf` exports the config to
    exactly (`then`: what runs that family next) and the `runtimes` that take it too, or `otherwise` when no family
    does."""
    from ..convert import in_tree_blockers  # the in-tree families: the one thing exporters read of the converter

    head = "seq2seq_lm" if isinstance(config, TfmSeq2SeqConfig) else "causal_lm" if config.is_causal else "base"
    try:
        found = in_tree_blockers(config, head)
    except Exception:  # the converter's contract: a config it cannot judge has no route to report
        return otherwise
    family = next((name for name, blockers in found.items() if not blockers), None)
    if family is None:
        return otherwise
    return f"Exact routes that take it: `hf_tfm.to_hf` / `hf-tfm convert` to in-tree {family} ({then}), or {runtimes}."


def forced_agreement(ours: list, theirs: list, prompts: list[list[int]], seq2seq: bool, max_new_tokens: int) -> float:
    """The share of the generated positions where the runtime's most likely token is hf_tfm's, both reading hf_tfm's
    greedy sequence (teacher-forced): unlike the greedy `agreement`, one flipped near-tie does not also count every
    later token of its sequence as unequal. `ours` / `theirs`: each reference's logits (T, V), from its first row
    (a causal LM's start with the prompt's, an encoder-decoder's with the decoder start token's)."""
    import torch

    equal = total = 0
    for mine, other, prompt in zip(ours, theirs, prompts, strict=True):
        start = 0 if seq2seq else len(prompt) - 1  # the row that chose the first new token
        rows = slice(start, start + max_new_tokens)
        equal += int((mine[rows].argmax(-1) == torch.as_tensor(other)[rows].argmax(-1)).sum())
        total += max_new_tokens
    return equal / total if total else 1.0


def agreement_report(
    ours: list, theirs: dict, references: list[list[int]], prompts: list[list[int]], seq2seq: bool, max_new_tokens: int
) -> dict[str, Any]:
    """What every `verify_*` reports of the runtime's side `theirs` (its "tokens" and "logits") against hf_tfm's
    greedy `references` and their logits `ours`: greedy and teacher-forced agreement and the largest logit
    difference."""
    import torch

    logits = theirs["logits"]
    return {
        **token_agreement(new_tokens(references, prompts, seq2seq), theirs["tokens"]),
        "forced_agreement": forced_agreement(ours, logits, prompts, seq2seq, max_new_tokens),
        "max_logit_diff": max(float((a - torch.as_tensor(b)).abs().max()) for a, b in zip(ours, logits, strict=True)),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
    }


def encoder_max_diff(model: Any, prompts: list[list[int]], theirs: dict[str, list], where: Any) -> float:
    """The largest difference between a runtime's encoder outputs (`theirs`: name -> one row per prompt, run as one
    padded batch) and the model's on each prompt alone; per-token outputs compared on the prompt's own positions."""
    import torch

    diff = 0.0
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            ours = model(input_ids=ids, attention_mask=torch.ones_like(ids))
            for name, values in theirs.items():
                if name not in ours:
                    raise RuntimeError(f"{where}: the export returns {name!r}, the model does not.")
                mine, other = ours[name][0].float(), torch.tensor(values[row])
                if mine.dim() and mine.shape[0] == len(prompt):  # per token: the prompt's own positions
                    other = other[: len(prompt)]
                diff = max(diff, float((mine - other).abs().max()))
    return diff
