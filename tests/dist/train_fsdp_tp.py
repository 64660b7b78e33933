"""FSDP2 and tensor parallelism together, then a distributed checkpoint:
`torchrun --nproc_per_node 4 --standalone tests/dist/train_fsdp_tp.py BASE_DIR OUT_DIR STEPS`.

BASE_DIR holds a saved tiny TfmForCausalLM (tied, an even vocabulary: each tensor-parallel rank holds half). The
script loads it with `DistributedConfig(fsdp_size=2, tp_size=2)`: 2 data-parallel groups of 2 tensor-parallel ranks.
Each group trains on its half of the global batch (common.py), the ranks of a group on the same half, in a plain SGD
loop whose loss is the group's token sum over the global token count (FSDP2 averages the groups' gradients, so each
group scales by their number). Then, where the release has it, `save_pretrained(distributed_checkpoint=True)` writes
each rank's shards and `from_pretrained(distributed_config=...)` loads them back into a freshly sharded model.
Rank 0 writes OUT_DIR/result.json: the step losses beside one process's (common.py's reference), the largest weight
differences to that process and between the reloaded and the trained model, and the placements.
"""

import inspect
import json
import os
import sys

import torch
import torch.distributed as dist
from common import LR, examples, single_process_reference
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, DistributedConfig, PreTrainedModel

import hf_tfm  # noqa: F401  (registers the Auto classes)
from hf_tfm.training import PadCollator

CONFIG = DistributedConfig(fsdp_size=2, tp_size=2)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train(model, steps: int) -> list[float]:
    """SGD on this data-parallel group's half of the global batch; the step losses of the whole batch."""
    weight = model.model.layers[0].self_attn.q_proj.weight
    group = weight.device_mesh.get_local_rank("fsdp")  # which half: the ranks of a tensor-parallel group share it
    data = examples()
    total = sum(len(e["input_ids"]) - 1 for e in data)  # label tokens of the global batch
    half = len(data) // 2
    batch = PadCollator()(data[group * half : (group + 1) * half])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    losses = []
    for _ in range(steps):
        loss = full(model(**batch, num_items_in_batch=total).loss)  # this group's token sum / global count
        (loss * 2).backward()  # FSDP2 averages the 2 groups' gradients
        optimizer.step()
        optimizer.zero_grad()
        summed = loss.detach().clone()
        dist.all_reduce(summed)  # every rank of both groups: 2 copies of each group's share
        losses.append(summed.item() / 2)
    return losses


def main(base_dir: str, out_dir: str, steps: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(base_dir, distributed_config=CONFIG)
    placements = {
        name: str(model.get_parameter(name).placements)
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight")
    }
    losses = train(model, int(steps))
    trained = {name: full(p.detach()) for name, p in model.named_parameters()}
    reload_diff = None
    if "distributed_checkpoint" in inspect.signature(PreTrainedModel.save_pretrained).parameters:
        folder = os.path.join(out_dir, "dcp")
        model.save_pretrained(folder, distributed_checkpoint=True)
        reloaded = AutoModelForCausalLM.from_pretrained(folder, distributed_config=CONFIG)
        pairs = [(trained[name], full(p.detach())) for name, p in reloaded.named_parameters()]
        reload_diff = max((a - b).abs().max().item() for a, b in pairs)
    if dist.get_rank() == 0:
        reference = AutoModelForCausalLM.from_pretrained(base_dir)
        reference_losses = single_process_reference(reference, int(steps))
        weights = dict(reference.named_parameters())
        result = {
            "world_size": dist.get_world_size(),
            "placements": placements,
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "losses": losses,
            "reference_losses": reference_losses,
            "max_weight_diff": max((trained[name] - weights[name]).abs().max().item() for name in trained),
            "reload_diff": reload_diff,
        }
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no gloo teardown (see train_fsdp.py)


if __name__ == "__main__":
    main(*sys.argv[1:4])
