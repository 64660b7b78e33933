"""Real DDP with Trainer: `torchrun --nproc_per_node 2 --standalone tests/dist/train_ddp.py OUT_DIR`.

Asserts, inside the run, that it really is distributed (world size 2, ParallelMode.DISTRIBUTED, the model wrapped in
DistributedDataParallel), that both replicas end with identical weights, and (rank 0) that the step losses and final
weights equal a single-process run on the same global batch. Rank 0 writes a summary to OUT_DIR/result.json.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from common import examples, single_process_reference, tiny_config, training_arguments
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer
from transformers.training_args import ParallelMode

from hf_tfm import TfmForCausalLM
from hf_tfm.training import PadCollator

STEPS = 4


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model = TfmForCausalLM(tiny_config())
    reference = copy.deepcopy(model)
    args = training_arguments(out_dir, STEPS)
    trainer = Trainer(model=model, args=args, train_dataset=examples(), data_collator=PadCollator())
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

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trainer.save_model(os.path.join(out_dir, "final"))
    if dist.get_rank() == 0:
        ref_losses = single_process_reference(reference, STEPS)
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        weight_diff = max((a - b).abs().max().item() for a, b in pairs)
        result = {
            "world_size": dist.get_world_size(),
            "parallel_mode": str(args.parallel_mode),
            "wrapper": type(trainer.model_wrapped).__name__,
            "replicas_equal": replicas_equal,
            "losses": losses,
            "reference_losses": ref_losses,
            "max_weight_diff": weight_diff,
        }
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
        assert len(losses) == STEPS and max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, result
        assert weight_diff < 1e-5, result
    dist.barrier()
    # Everything is written: leave without C++ teardown. On CPU/gloo, torch 2.13 sometimes aborts at interpreter exit
    # ("terminate called without an active exception"), and destroy_process_group can hang once a peer has gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
