"""DeepSpeed ZeRO through `Trainer`, on saved hf_tfm models and their in-tree copies:
`DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 --standalone tests/dist/train_deepspeed.py PLAN.json`, or the same
under `accelerate launch` with a DeepSpeed plugin (a config's "deepspeed" is then null: the plugin's config is used).

PLAN (JSON) lists DeepSpeed configs, run in turn in this one process (a launch's 2 ranks each import torch,
transformers and DeepSpeed: seconds the configs share), and names where rank 0 writes its RESULT (JSON). Each config
has a name, the DeepSpeed config (a file or a dict), its runs and its output folder. Every `TrainingArguments` sets its
config up afresh (transformers resets accelerate's state and points its `HfDeepSpeedConfig` reference at the new
config); the test checks each run's engine, stage and offload.

Each run loads a folder after its `TrainingArguments` exist (so ZeRO-3 partitions it while loading, as
`from_pretrained` does under `Trainer`), prints it (DeepSpeed and `Trainer` do, before the first step), optionally
freezes parameters and adds LoRA, trains `steps` SGD steps on a fixed global batch (common.py) and saves with
`trainer.save_model` (ZeRO-3: the 16-bit gather). A config's optional parts: "resume" (a ZeRO checkpoint at step 2,
resumed to step 4 beside an uninterrupted run) and "from_config" (`from_config` under `HfDeepSpeedConfig`: the
model's own initialisation and ties, gathered). The test compares the numbers; this script only records them.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from common import classification_examples, examples, seq2seq_examples, training_arguments
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    Trainer,
)
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.integrations.deepspeed import HfDeepSpeedConfig

import hf_tfm
from hf_tfm.training import PadCollator

TASKS = {
    "causal_lm": (AutoModelForCausalLM, examples),
    "classifier": (AutoModelForSequenceClassification, classification_examples),
    "seq2seq": (AutoModelForSeq2SeqLM, seq2seq_examples),
}


def step_logs(trainer: Trainer) -> dict[str, list[float]]:
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": [e["loss"] for e in logs], "grad_norms": [e.get("grad_norm") for e in logs]}


def with_lora(model, targets: list[str]):
    """LoRA on `targets` (r 4, no dropout), seeded: the in-tree copy's adapters start from the same numbers."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    return get_peft_model(model, config)


def train(run: dict, deepspeed, steps: int, out_dir: str) -> dict:
    """One run: load under the engine's arguments, print, (LoRA,) train, save; its step losses and gradient norms."""
    auto, data = TASKS[run["task"]]
    args = training_arguments(out_dir, steps, deepspeed=deepspeed, **run.get("args", {}))
    model = auto.from_pretrained(run["folder"])
    text = repr(model)  # ZeRO-3: every parameter is an empty placeholder here
    first = next(model.parameters())
    record = {"repr": text, "partitioned": first.numel() == 0 and hasattr(first, "ds_shape")}
    for name in run.get("freeze", []):
        model.get_parameter(name).requires_grad_(False)
    if run.get("lora"):
        model = with_lora(model, run["lora"])
    trainer = Trainer(model=model, args=args, train_dataset=data(), data_collator=PadCollator())
    trainer.train()
    engine = trainer.model_wrapped
    record["engine"], record["zero3"] = type(engine).__name__, is_deepspeed_zero3_enabled()
    record["stage"], record["offload_optimizer"] = engine.zero_optimization_stage(), engine.zero_cpu_offload()
    record["offload_param"] = str(getattr(engine.zero_offload_param(), "device", None))  # "OffloadDeviceEnum.cpu"
    trainer.save_model(run["save"])
    return record | step_logs(trainer)


def resume(run: dict, deepspeed, out_dir: str) -> dict:
    """4 steps with a ZeRO checkpoint every 2, then a fresh model resumed from step 2's (the test consolidates step
    4's checkpoint with DeepSpeed's `zero_to_fp32.py`)."""
    auto, data = TASKS[run["task"]]
    full_dir, resumed_dir = os.path.join(out_dir, "full"), os.path.join(out_dir, "resumed")
    logs = {}
    for name, folder, start in (("full", full_dir, None), ("resumed", resumed_dir, "checkpoint-2")):
        args = training_arguments(folder, 4, deepspeed=deepspeed, save_strategy="steps", save_steps=2)
        trainer = Trainer(
            model=auto.from_pretrained(run["folder"]), args=args, train_dataset=data(), data_collator=PadCollator()
        )
        trainer.train(resume_from_checkpoint=start and os.path.join(full_dir, start))
        logs[name] = step_logs(trainer)
        trainer.save_model(os.path.join(folder, "final"))
    if dist.get_rank() == 0:
        logs["checkpoint_files"] = sorted(os.listdir(os.path.join(full_dir, "checkpoint-4")))
    return logs


def from_config(folders: dict[str, str], deepspeed: dict) -> dict:
    """`AutoModelForCausalLM.from_config` under ZeRO-3 (`HfDeepSpeedConfig` alive): each parameter's mean and std,
    gathered, whether tied weights are one parameter, and how far `from_hf(to_hf(model))` of the partitioned model
    (every rank converts: it gathers) is from the gathered model."""
    import deepspeed as ds

    keep = HfDeepSpeedConfig(deepspeed)  # noqa: F841  (transformers holds it by weak reference)
    found = {}
    for name, folder in folders.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        embed = model.get_input_embeddings().weight
        record = {"partitioned": embed.numel() == 0, "tied": model.get_output_embeddings().weight is embed}
        back = dict(hf_tfm.from_hf(hf_tfm.to_hf(model)).named_parameters())
        with ds.zero.GatheredParameters(list(model.parameters())):
            record["stats"] = {
                n: [p.mean().item(), p.std().item() if p.numel() > 1 else 0.0, list(p.shape)]
                for n, p in model.named_parameters()
            }
            record["round_trip_diff"] = max((back[n] - p).abs().max().item() for n, p in model.named_parameters())
        found[name] = record
    return found


def run_config(config: dict, steps: int) -> dict:
    """One DeepSpeed config's runs, and its optional parts; their records."""
    deepspeed, out_dir = config["deepspeed"], config["out"]
    record = {"runs": {run["name"]: train(run, deepspeed, steps, out_dir) for run in config["runs"]}}
    if config.get("resume"):
        record["resume"] = resume(config["resume"], deepspeed, os.path.join(out_dir, "resume"))
    if config.get("from_config"):
        record["from_config"] = from_config(config["from_config"]["folders"], config["from_config"]["deepspeed"])
    return record


def main(plan_file: str) -> None:
    import deepspeed

    # Before any model is built: ZeRO-3's `zero.Init` in `from_pretrained` reads the world size from this group (on
    # CPU, without it, DeepSpeed's own choice, oneCCL, is absent and it reads 1). GPUs take nccl, the default.
    deepspeed.init_distributed(dist_backend="gloo")
    with open(plan_file) as f:
        plan = json.load(f)
    result = {"world_size": int(os.environ["WORLD_SIZE"])}
    result["configs"] = {config["name"]: run_config(config, plan["steps"]) for config in plan["configs"]}
    if dist.get_rank() == 0:
        with open(plan["result"], "w") as f:
            json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # everything is written: no gloo teardown (see train_fsdp.py)


if __name__ == "__main__":
    main(sys.argv[1])
