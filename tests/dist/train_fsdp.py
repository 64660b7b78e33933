"""Sharded training with transformers' native FSDP2 and Trainer, then a save:
`torchrun --nproc_per_node 2 --standalone tests/dist/train_fsdp.py BASE_DIR OUT_DIR [BASE_DIR OUT_DIR ...]`, each pair
in turn in this one process (a launch's start-up, 2 ranks' imports, is most of a model's time).

BASE_DIR holds a saved tiny TfmForCausalLM, tied or untied (hf_tfm's `maybe_distribute_model` keeps a tied
embed/lm_head pair one FSDP2 parameter; transformers alone trains it on stale weights from step 2). The script loads it
with `DistributedConfig(fsdp_size=2)` (parameters become DTensors, each rank holding half), trains with Trainer, saves
to OUT_DIR/final, and asserts (rank 0) that the step losses and the gathered weights equal a single-process run on the
same global batch. Rank 0 writes OUT_DIR/result.json, with the reference model's logits on a fixed input, for a fresh
process to compare against.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from common import examples, single_process_reference, training_arguments
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, DistributedConfig, Trainer
from transformers.training_args import ParallelMode

import hf_tfm  # noqa: F401  (registers the Auto classes)
from hf_tfm.training import PadCollator

STEPS = 3
PROBE = [[5, 17, 42, 8, 91, 33, 3, 60]]


def train(base_dir: str, out_dir: str) -> None:
    """One model: trained sharded, saved, compared (rank 0) with a single-process run; OUT_DIR/result.json."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, distributed_config=DistributedConfig(fsdp_size=2))
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(weight, DTensor) and weight.to_local().shape[0] * 2 == weight.shape[0], "not sharded"
    local_shape = list(weight.to_local().shape)

    args = training_arguments(out_dir, STEPS)
    trainer = Trainer(model=model, args=args, train_dataset=examples(), data_collator=PadCollator())
    trainer.train()
    assert dist.get_world_size() == 2 and args.parallel_mode == ParallelMode.DISTRIBUTED, args.parallel_mode
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in model.named_parameters()}
    trainer.save_model(os.path.join(out_dir, "final"))

    if dist.get_rank() == 0:
        reference = AutoModelForCausalLM.from_pretrained(base_dir)
        ref_losses = single_process_reference(reference, STEPS)
        ref_params = dict(reference.named_parameters())
        weight_diff = max((full[name] - ref_params[name]).abs().max().item() for name in full)
        with torch.no_grad():
            logits = reference.eval()(torch.tensor(PROBE)).logits
        result = {
            "model_class": type(model).__name__,
            "model_module": type(model).__module__,
            "local_q_proj_shape": local_shape,
            "losses": losses,
            "reference_losses": ref_losses,
            "max_weight_diff": weight_diff,
            "probe": PROBE,
            "reference_logits": logits.tolist(),
        }
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
        assert len(losses) == STEPS and max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, result
        assert weight_diff < 1e-5, weight_diff


def main(*dirs: str) -> None:
    for base_dir, out_dir in zip(dirs[::2], dirs[1::2], strict=True):
        train(base_dir, out_dir)
    dist.barrier()
    # Everything is written: leave without C++ teardown. On CPU/gloo, torch 2.13 sometimes aborts at interpreter exit
    # ("terminate called without an active exception"), and destroy_process_group can hang once a peer has gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
