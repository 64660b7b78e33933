"""TRL's trainers run on a saved model folder, each recording what it computed, for tests/test_client_trl.py.

The test imports this module in-process, and runs it in a subprocess where hf_tfm cannot be imported (the folder's own
copied code trains there): so it imports nothing from hf_tfm or conftest. `run_all` returns plain JSON-able data: per
step the loss the trainer computed (before the optimizer step) and the batch it computed it on, its logged metrics, and
whether and how the weights moved.

The data are lines of the standard library's `json` module source (the tokenizer of the test's folders was trained on
the same lines), so every process builds identical data sets without a download.
"""

import inspect
import json
import math
import tempfile

import torch

# Per scenario: the trainer, its config's knobs beyond the plumbing in `COMMON`, and whether LoRA wraps the model.
# "*_defaults" leave every training knob at TRL's default: bf16 autocast (on CPU too), activation checkpointing,
# TRL's learning rate and batch size. The others compare numbers in float32 (`bf16=False`); where a second step is
# compared, the learning rate is raised so that the first update visibly moves it.
SCENARIOS = {
    "sft": ("sft", {"bf16": False, "per_device_train_batch_size": 4, "max_length": 32}, False),
    "sft_defaults": ("sft", {}, False),
    "packing": ("sft", {"bf16": False, "per_device_train_batch_size": 4, "max_length": 32, "packing": True}, False),
    "lora": ("sft", {"bf16": False, "per_device_train_batch_size": 4, "max_length": 32, "learning_rate": 1e-2}, True),
    "dpo": ("dpo", {"bf16": False, "per_device_train_batch_size": 4, "max_length": 48, "learning_rate": 1e-3}, False),
    "dpo_defaults": ("dpo", {}, False),
    # 4 completions of 6 tokens for 1 prompt a step; the reward is the completion's length in characters.
    "grpo": (
        "grpo",
        {
            "bf16": False,
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 6,
            "learning_rate": 1e-2,
        },
        False,
    ),
}
COMMON = {
    "use_cpu": True,  # TRL's bf16 default is refused on a machine without an accelerator unless the CPU is asked for
    "max_steps": 2,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
    "model_init_kwargs": {"trust_remote_code": True},  # the trainers load the model from the folder's name
}
LORA_TARGETS = "all-linear"
# The metrics compared between runs, where a trainer logs them.
METRICS = ("loss", "grad_norm", "aux_loss", "entropy", "logps/chosen", "logps/rejected", "rewards/margins", "reward")


def lines() -> list[str]:
    """The non-empty lines of `json`'s source: the tokenizer's training text and the trainers' data."""
    return [line for line in inspect.getsource(json).splitlines() if line.strip()]


def datasets_for(kind: str):
    from datasets import Dataset

    text = lines()
    if kind == "sft":
        return Dataset.from_dict({"text": text[10:26]})
    if kind == "dpo":
        return Dataset.from_dict({"prompt": text[30:38], "chosen": text[40:48], "rejected": text[50:58]})
    return Dataset.from_dict({"prompt": text[30:38]})


def completion_length(completions, **kwargs) -> list[float]:
    """GRPO's reward: a plain Python function of the decoded completions."""
    return [float(len(completion)) for completion in completions]


def recording(trainer_class):
    """`trainer_class` that records each step's loss (before the optimizer step) and the tensors of its batch."""

    class Recording(trainer_class):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            batch = {name: value.tolist() for name, value in inputs.items() if torch.is_tensor(value)}
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.steps.append({"loss": loss.item(), "batch": batch})
            return loss

    Recording.__name__ = f"Recording{trainer_class.__name__}"
    return Recording


def run(folder: str, scenario: str, lora_targets=LORA_TARGETS) -> dict:
    """Train on `folder` as `scenario` says (`SCENARIOS`) for 2 steps and return what happened."""
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    kind, knobs, lora = SCENARIOS[scenario]
    trainer_class, config_class = {
        "sft": (SFTTrainer, SFTConfig),
        "dpo": (DPOTrainer, DPOConfig),
        "grpo": (GRPOTrainer, GRPOConfig),
    }[kind]
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    with tempfile.TemporaryDirectory() as output_dir:
        args = config_class(output_dir=output_dir, **COMMON, **knobs)
        extra = {"reward_funcs": completion_length} if kind == "grpo" else {}
        if lora:
            extra["peft_config"] = LoraConfig(task_type="CAUSAL_LM", target_modules=lora_targets)
        trainer = recording(trainer_class)(
            model=folder, args=args, train_dataset=datasets_for(kind), processing_class=tokenizer, **extra
        )
        trainer.steps = []
        trainable = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.train()
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    after = dict(model.named_parameters())
    logs = [{k: v for k, v in entry.items() if k in METRICS} for entry in trainer.state.log_history if "loss" in entry]
    return {
        "model_class": f"{type(base).__module__}.{type(base).__qualname__}",
        "args": {"bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing, "lr": args.learning_rate},
        "steps": trainer.steps,
        "logs": logs,
        # LoRA: the module names the adapters wrap (their last component); else the count of trainable tensors
        "lora_targets": sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable if ".lora_" in n}),
        "trainable": sum(p.numel() for p in trainable.values()),
        "max_change": max((after[n] - p).abs().max().item() for n, p in trainable.items()),
        "finite": all(math.isfinite(step["loss"]) for step in trainer.steps)
        and all(torch.isfinite(after[n]).all().item() for n in trainable),
        "dtype": str(next(iter(after.values())).dtype),
    }


def run_all(folders: dict[str, str], scenarios=tuple(SCENARIOS), lora_targets: dict | None = None) -> dict:
    """`run` for every folder and scenario: {folder key: {scenario: result}}."""
    lora_targets = lora_targets or {}
    return {
        key: {name: run(folder, name, lora_targets.get(key, LORA_TARGETS)) for name in scenarios}
        for key, folder in folders.items()
    }
