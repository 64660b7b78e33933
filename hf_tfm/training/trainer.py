"""What every hf_tfm trainer shares: the settings the CLI exposes, packed text blocks, transformers' `Trainer` run in a
scratch folder with CPU threads that follow the free cores, and the loss history the model card and plots read.

hf_tfm saves the model itself (into a staged folder, `training_job`), so the Trainer's own folder is a temporary one
and it saves nothing (`save_strategy="no"`): a checkpoint there would be deleted with it.
"""

import math
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, Trainer, TrainingArguments

from ..scale_out import cpu_only_launch, release_zero3
from .threads import FreeCoreThreads


@dataclass
class TrainSettings:
    """The Trainer knobs the CLI exposes. `max_steps > 0` wins over `epochs`."""

    max_steps: int = 200
    epochs: float = 1.0
    learning_rate: float = 1e-3
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    warmup_steps: int | None = None  # None: 5% of the steps
    weight_decay: float = 0.01
    evals: int = 4  # held-out evaluations during training (LM), for the loss curve
    logging_steps: int | None = None  # None: about 25 points per run
    deepspeed: str | None = None  # a DeepSpeed config file, as `TrainingArguments(deepspeed=...)` takes it

    def as_dict(self) -> dict[str, Any]:
        """The settings as they take effect (no `epochs` when `max_steps` wins; the warm-up default spelled out)."""
        values = asdict(self)
        if self.max_steps > 0:
            values.pop("epochs")
        if self.warmup_steps is None:
            values["warmup_steps"] = "5% of the steps"
        if self.logging_steps is None:
            values.pop("logging_steps")
        if self.deepspeed is None:
            values.pop("deepspeed")
        return values


class Examples(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


def pack_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str], seq_len: int) -> list[list[int]]:
    """Tokenise `texts` (each starts with `<s>`), join them with `</s>` and cut the stream into `seq_len` blocks."""
    stream: list[int] = []
    eos = tokenizer.eos_token_id
    backend = tokenizer.backend_tokenizer
    for start in range(0, len(texts), 512):
        for encoding in backend.encode_batch(texts[start : start + 512]):
            stream.extend(encoding.ids)
            stream.append(eos)
    return [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


def training_args(
    settings: TrainSettings,
    scratch: Path,
    total_steps: int,
    eval_steps: int | None,
    args_class: type[TrainingArguments] = TrainingArguments,
) -> TrainingArguments:
    warmup = settings.warmup_steps if settings.warmup_steps is not None else max(1, total_steps // 20)
    logging_steps = settings.logging_steps or max(1, total_steps // 25)
    return args_class(
        output_dir=str(scratch),
        max_steps=settings.max_steps if settings.max_steps > 0 else -1,
        num_train_epochs=settings.epochs,
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=warmup,
        weight_decay=settings.weight_decay,
        logging_steps=logging_steps,
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        save_strategy="no",
        report_to="none",
        seed=settings.seed,
        data_seed=settings.seed,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
        disable_tqdm=False,
        deepspeed=settings.deepspeed,
        use_cpu=cpu_only_launch(),  # torchrun / accelerate launch without GPUs: data parallel over gloo
    )


def total_steps(settings: TrainSettings, num_examples: int) -> int:
    if settings.max_steps > 0:
        return settings.max_steps
    return max(1, math.ceil(settings.epochs * math.ceil(num_examples / settings.batch_size)))


def loss_history(trainer: Trainer) -> dict[str, list[list[float]]]:
    """`{"train": [[step, loss], ...], "eval": [[step, eval_loss], ...]}` from the Trainer's log history."""
    history: dict[str, list[list[float]]] = {"train": [], "eval": []}
    for entry in trainer.state.log_history:
        if "loss" in entry:
            history["train"].append([entry["step"], entry["loss"]])
        if "eval_loss" in entry:
            history["eval"].append([entry["step"], entry["eval_loss"]])
    return history


def run_trainer(
    model: Any,
    settings: TrainSettings,
    train_set: Examples,
    test_set: Examples,
    data_collator: Callable[[list[dict[str, Any]]], dict[str, Any]],
    finish: Callable[[Trainer], Any],
    trainer_class: type[Trainer] = Trainer,
    args_class: type[TrainingArguments] = TrainingArguments,
    label_smoothing: float = 0.0,
) -> tuple[Trainer, Any]:
    """Train `model` on `train_set` in a scratch folder, then run `finish(trainer)` (the final evaluation) while the
    scratch folder and the thread settings still hold. Returns the trainer and what `finish` returned.

    `label_smoothing` becomes the arguments' `label_smoothing_factor` (0.0, their default: none).
    """
    total = total_steps(settings, len(train_set))
    with tempfile.TemporaryDirectory(prefix="hf-tfm-trainer-") as scratch, FreeCoreThreads() as threads:
        # the test set's loss `settings.evals` times during training, for the held-out curve (nothing is chosen on it)
        eval_steps = max(1, total // max(settings.evals, 1))
        args = training_args(settings, Path(scratch), total, eval_steps, args_class)
        args.label_smoothing_factor = label_smoothing
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=train_set,
            eval_dataset=test_set,
            data_collator=data_collator,
            callbacks=[threads],
        )
        trainer.train()
        final = finish(trainer)
    release_zero3(trainer)  # ZeRO-3: whole parameters again, for the merge, generation and save that follow
    return trainer, final


def launch_of(trainer: Trainer) -> dict[str, Any]:
    """How the run trained, for metrics.json: its processes, the engine that wrapped the model (the model's own class
    in one process, `DistributedDataParallel`, `DeepSpeedEngine`, ...) and the ZeRO stage where DeepSpeed ran."""
    engine = trainer.model_wrapped
    stage = getattr(engine, "zero_optimization_stage", None)  # a DeepSpeedEngine's, from the config it runs
    return {
        "processes": trainer.args.world_size,
        "engine": type(engine).__name__,
        "zero_stage": stage() if stage is not None else None,
    }


def history_with_final(
    trainer: Trainer, final_metrics: dict[str, float], loss_key: str
) -> dict[str, list[list[float]]]:
    """`loss_history(trainer)`, ending with the final evaluation's loss (`final_metrics[loss_key]`) unless the last
    evaluation during training was at the last step."""
    history = loss_history(trainer)
    if not history["eval"] or history["eval"][-1][0] != trainer.state.global_step:
        history["eval"].append([trainer.state.global_step, final_metrics[loss_key]])
    return history


__all__ = ["Examples", "TrainSettings", "history_with_final", "launch_of", "loss_history", "pack_texts", "run_trainer"]
