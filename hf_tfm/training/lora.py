"""LoRA for the fine-tuning trainers (PEFT): which layers get adapters, and the adapter folder saved beside the merged
model, with the base it was trained on named so that `PeftModel.from_pretrained` finds it.
"""

import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ..configuration import TfmConfig

# The attention (self- and cross-) and MLP projections of hf_tfm's blocks: what LoRA adapts.
LORA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(model: PreTrainedModel, task_type: str, lora_r: int, target_modules: list[str] | str) -> Any:
    """`model` wrapped with LoRA adapters of rank `lora_r` (alpha 2r, dropout 0.05) on `target_modules`.

    `task_type` names a `peft.TaskType` member ("SEQ_CLS", "SEQ_2_SEQ_LM").
    """
    from peft import LoraConfig, TaskType, get_peft_model

    lora_config = LoraConfig(
        task_type=TaskType[task_type],
        r=lora_r,
        lora_alpha=2 * lora_r,
        lora_dropout=0.05,
        target_modules=target_modules,
    )
    return get_peft_model(model, lora_config)


def lora_targets(model: PreTrainedModel) -> list[str] | str:
    """The `LORA_PROJECTIONS` the model's linear layers are named after, or "all-linear" when it has none."""
    names = set(LORA_PROJECTIONS)
    present = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return [n for n in present if n in names] or "all-linear"


def adapter_base_of(model: PreTrainedModel | TfmConfig | str | os.PathLike) -> str | None:
    """What an adapter should name as its base: a checkpoint folder (absolute) or Hub id, else nothing."""
    if isinstance(model, (str, os.PathLike)):
        return str(Path(model).resolve()) if Path(model).exists() else str(model)
    return None


def save_adapter(peft_model: Any, folder: Path, base: str | None, auto_class: str, kwargs: dict[str, Any]) -> None:
    """Save the adapter naming its real base, and say in its README how to rebuild the base it was trained on."""
    if base is not None:
        for adapter_config in peft_model.peft_config.values():
            adapter_config.base_model_name_or_path = base
    peft_model.save_pretrained(folder)
    call = "".join(f", {key}={value!r}" for key, value in kwargs.items())
    # The README's snippet is for readers who may not have hf_tfm installed: there the base loads from its own code,
    # which only trust_remote_code=True runs (with hf_tfm installed, its registered classes are used either way).
    with (folder / "README.md").open("a", encoding="utf-8") as readme:
        readme.write(
            "\n## Loading this adapter with hf-tfm\n\n"
            "It was trained on the base loaded as\n\n```python\n"
            f"base = {auto_class}.from_pretrained({base!r}, trust_remote_code=True{call})\n"
            'model = PeftModel.from_pretrained(base, "<this folder>")\n```\n'
        )


__all__ = ["LORA_PROJECTIONS", "adapter_base_of", "lora_targets", "save_adapter", "with_lora"]
