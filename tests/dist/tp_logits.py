"""Tensor parallelism with a tied head: `torchrun --nproc_per_node 2 --standalone tests/dist/tp_logits.py OUT DIR...`.

Each DIR holds a saved tiny hf_tfm model with `tie_word_embeddings=True` (its architecture picks the Auto class). For
each in turn, in this one process (a launch's start-up is most of a folder's time), the script loads it with
`DistributedConfig(tp_size=2)` and, on rank 0, records the largest logit difference to the same folder loaded in one
process, whether `lm_head` and `embed_tokens` still share one parameter, and both placements. Rank 0 writes OUT
(JSON): the records by DIR.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, DistributedConfig

import hf_tfm  # noqa: F401  (registers the Auto classes)

PROBE = [[5, 17, 42, 8, 91, 33, 3, 60]]


def sharded(folder: str) -> dict | None:
    """One folder loaded with `tp_size=2`: its record on rank 0."""
    architecture = AutoConfig.from_pretrained(folder).architectures[0]
    auto = AutoModelForMaskedLM if architecture.endswith("MaskedLM") else AutoModelForCausalLM
    model = auto.from_pretrained(folder, distributed_config=DistributedConfig(tp_size=2)).eval()
    with torch.no_grad():
        logits = model(torch.tensor(PROBE)).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    if dist.get_rank() != 0:
        return None
    with torch.no_grad():
        reference = auto.from_pretrained(folder).eval()(torch.tensor(PROBE)).logits
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    return {
        "max_logit_diff": (logits - reference).abs().max().item(),
        "shape": list(logits.shape),
        "tied": head is embed,
        "placements": [str(getattr(w, "placements", None)) for w in (embed, head)],
    }


def main(out: str, *folders: str) -> None:
    results = {folder: sharded(folder) for folder in folders}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no gloo teardown (see train_fsdp.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
