"""Generation after training: a seq2seq model's greedy answers to the held-out sources (scored in `metrics`), and the
check that a folder hf_tfm has just written loads and generates in a process where hf_tfm cannot be imported.
"""

import os
import tempfile
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..programs import run_program


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


__all__ = ["generate_in_fresh_process", "generate_texts"]
