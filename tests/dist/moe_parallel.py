"""Tensor or expert parallelism of an MoE model: `torchrun --nproc_per_node 2 --standalone tests/dist/moe_parallel.py
DIR OUT CASE...`, each CASE `{tp,ep}:IMPLEMENTATION`.

DIR holds a saved tiny hf_tfm causal LM whose layer 1 has experts. For each case in turn, in this one process (a
launch's start-up is most of a case's time), the script loads it sharded (tensor parallel:
`DistributedConfig(tp_size=2)`; expert parallel: the release's form, `ep_size=2` from 5.19 on,
`enable_expert_parallel` before) with the case's experts implementation and, on rank 0, records the largest logit
difference to the same folder loaded in one process, the local shape of layer 1's `gate_up_proj` and its
`num_experts` on this rank. Rank 0 writes OUT (JSON): the records by case.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import hf_tfm  # noqa: F401  (registers the Auto classes)

PROBE = [[5, 17, 42, 8, 91, 33, 3, 60], [7, 7, 12, 64, 2, 88, 40, 9]]


def distributed_config(mode: str) -> DistributedConfig:
    if mode == "tp":
        return DistributedConfig(tp_size=2)
    if "ep_size" in DistributedConfig.__dataclass_fields__:  # token dispatch over the tensor-parallel ranks
        return DistributedConfig(tp_size=2, ep_size=2)
    return DistributedConfig(tp_size=2, enable_expert_parallel=True)


def sharded(folder: str, mode: str, implementation: str, reference: torch.Tensor | None) -> dict | None:
    """One case: the folder loaded sharded; its record on rank 0 (which passes the one-process `reference` logits)."""
    model = AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=distributed_config(mode), experts_implementation=implementation
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor(PROBE)).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    experts = model.model.layers[1].mlp.experts
    weight = experts.gate_up_proj
    if reference is None:
        return None
    return {
        "max_logit_diff": (logits - reference).abs().max().item(),
        "local_gate_up_proj": list(weight.to_local().shape if hasattr(weight, "to_local") else weight.shape),
        "local_num_experts": experts.num_experts,
        "implementation": model.config._experts_implementation,
    }


def main(folder: str, out: str, *cases: str) -> None:
    reference = None
    if int(os.environ["RANK"]) == 0:
        with torch.no_grad():
            reference = AutoModelForCausalLM.from_pretrained(folder).eval()(torch.tensor(PROBE)).logits
    results = {case: sharded(folder, *case.split(":"), reference) for case in cases}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no gloo teardown (see train_fsdp.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
