"""Shared pieces of the multi-process launch scripts: a tiny config, fixed variable-length data, a reference loop."""

from collections.abc import Callable
from pathlib import Path

import torch

from hf_tfm import TfmConfig, TfmForCausalLM
from hf_tfm.training import PadCollator

LENGTHS = [5, 12, 7, 9, 16, 4, 11, 8]  # global batch 8: 4 per rank, padded per rank to different lengths
LR = 0.5


def tiny_config() -> TfmConfig:
    return TfmConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
    )


def examples() -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, 99, (n,), generator=generator).tolist()} for n in LENGTHS]


def classification_examples() -> list[dict]:
    """`examples()` with a label each (0 or 1), for a sequence classifier."""
    return [{**e, "labels": i % 2} for i, e in enumerate(examples())]


def seq2seq_examples() -> list[dict]:
    """`examples()` as sources, each with a target of its own length (labels; the model shifts them right)."""
    generator = torch.Generator().manual_seed(1)
    targets = [torch.randint(3, 99, (n,), generator=generator).tolist() for n in (3, 6, 4, 8, 5, 2, 7, 4)]
    return [{**e, "labels": t} for e, t in zip(examples(), targets, strict=True)]


def training_arguments(output_dir: str, steps: int, **overrides):
    """SGD with a constant rate and no clipping: one step is w - lr * grad, so runs compare to a plain loop."""
    from transformers import TrainingArguments

    kwargs = {
        "output_dir": output_dir,
        "use_cpu": True,  # without it, torchrun on a GPU-less machine trains each rank alone (NOT_PARALLEL)
        "per_device_train_batch_size": 4,
        "max_steps": steps,
        "optim": "sgd",
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
        "disable_tqdm": True,
    }
    return TrainingArguments(**{**kwargs, **overrides})


def single_process_reference(
    model: TfmForCausalLM, steps: int, data: Callable[[], list[dict]] = examples
) -> list[float]:
    """The oracle: one process, the whole global batch (`data()`) in one padded batch, plain SGD. Returns the step
    losses."""
    batch = PadCollator()(data())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def save_pair(class_name: str, config: dict, folder: Path) -> None:
    """A seeded in-tree model (`transformers.<class_name>(config)`) saved as hf_tfm (`from_hf`) in folder/hf_tfm and
    back as its in-tree copy (`to_hf`) in folder/copy: the same weights in both, the copy the oracle."""
    import transformers

    import hf_tfm

    torch.manual_seed(0)
    model_class = getattr(transformers, class_name)
    ours = hf_tfm.from_hf(model_class(model_class.config_class(**config)))
    ours.save_pretrained(folder / "hf_tfm")
    hf_tfm.to_hf(ours).save_pretrained(folder / "copy")
