"""Real DDP with Trainer on an MoE model: `torchrun --nproc_per_node 2 --standalone tests/dist/train_ddp_moe.py OUT`.

Asserts, inside the run, that it really is distributed (world size 2, ParallelMode.DISTRIBUTED,
DistributedDataParallel, gloo) and that both replicas end equal. Each rank records the batches it trained on; rank 0
then replays the steps by hand (the oracle): the cross-entropy summed over the step's label tokens of both ranks, plus
each rank's aux loss weighted by its share of those tokens, one SGD step each. It writes OUT/result.json with the
losses and the largest weight difference to that oracle, and to the oracle that sums the ranks' aux losses (what
in-tree MoE models give).
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from common import LR, examples, tiny_config, training_arguments
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.training_args import ParallelMode

from hf_tfm import TfmConfig, TfmForCausalLM
from hf_tfm.training import PadCollator

STEPS = 4
COEF = 1.0  # large: the weighting of the aux loss visibly moves the weights
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}


class RecordingTrainer(Trainer):
    """Trainer that keeps every micro-batch it trains on (the oracle replays them)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append({k: v.detach().clone() for k, v in inputs.items()})
        return super().training_step(model, inputs, num_items_in_batch)


def oracle(model: TfmForCausalLM, steps: list[list[dict]], by_share: bool) -> list[float]:
    """One SGD step per global batch on sum_r CE_r / N + COEF * w_r * aux_r, w_r = n_r / N (or 1)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    losses = []
    for batches in steps:
        num_items = sum(int(b["labels"][:, 1:].ne(-100).sum()) for b in batches)
        total = 0.0
        for b in batches:
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_router_logits=True)
            logits, labels = out.logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten()
            ce = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / num_items
            aux = load_balancing_loss_func(out.router_logits, 4, 2, b["attention_mask"])
            weight = b["labels"][:, 1:].ne(-100).sum() / num_items if by_share else 1.0
            total = total + ce + COEF * weight * aux
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total.item())
    return losses


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    dense = {k: v for k, v in tiny_config().to_diff_dict().items() if k in TfmConfig.__dataclass_fields__}
    model = TfmForCausalLM(TfmConfig(**{**dense, **MOE, "output_router_logits": True, "router_aux_loss_coef": COEF}))
    reference = copy.deepcopy(model)
    args = training_arguments(out_dir, STEPS)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=examples(), data_collator=PadCollator())
    trainer.seen = []
    trainer.train()

    assert dist.is_initialized() and dist.get_world_size() == 2, "not a 2-process run"
    assert args.world_size == 2 and args.parallel_mode == ParallelMode.DISTRIBUTED, args.parallel_mode
    assert dist.get_backend() == "gloo", dist.get_backend()
    assert isinstance(trainer.model_wrapped, DistributedDataParallel), type(trainer.model_wrapped)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    replicas_equal = torch.equal(gathered[0], gathered[1])
    assert replicas_equal, "replicas diverged"
    seen = [None, None]
    dist.all_gather_object(seen, trainer.seen)

    if dist.get_rank() == 0:
        steps = [[seen[0][s], seen[1][s]] for s in range(STEPS)]
        reference_losses = oracle(copy.deepcopy(reference), steps, by_share=True)
        replayed, summed = copy.deepcopy(reference), copy.deepcopy(reference)
        oracle(replayed, steps, by_share=True)
        oracle(summed, steps, by_share=False)

        def weight_diff(other):
            return max((a - b).abs().max().item() for a, b in zip(model.parameters(), other.parameters(), strict=True))

        result = {
            "world_size": dist.get_world_size(),
            "parallel_mode": str(args.parallel_mode),
            "wrapper": type(trainer.model_wrapped).__name__,
            "replicas_equal": replicas_equal,
            "batch_sizes": [[len(b["input_ids"]) for b in step] for step in steps],
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "reference_losses": reference_losses,
            "max_weight_diff": weight_diff(replayed),
            "max_weight_diff_summed_aux": weight_diff(summed),
        }
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # everything is written: no gloo teardown (see train_ddp.py)


if __name__ == "__main__":
    main(sys.argv[1])
