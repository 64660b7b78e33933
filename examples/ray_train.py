"""Fine-tune an hf_tfm causal LM with Trainer on a Ray cluster (Ray Train's transformers recipe):

    python examples/ray_train.py --workers 2 --output_dir out/ray                # a local cluster on this machine
    python examples/ray_train.py --workers 8 --gpu --output_dir /shared/out/ray  # a running cluster (`ray start`)

Each worker runs `train_func`: an ordinary Trainer with `RayTrainReportCallback`, wrapped by `prepare_trainer`; Ray
starts the workers and their process group (gloo on CPUs, nccl on GPUs) and keeps the checkpoint each save reports.
It trains on synthetic token ids (examples/train.py's); replace `examples()` with your tokenized dataset and `--model`
with your folder. OUTPUT_DIR (on storage every node sees, on a cluster) gets run.json: the step losses and the
checkpoint Ray reported, which `from_pretrained` loads.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import examples


def training_arguments(output_dir: str, max_steps: int, batch_size: int, use_cpu: bool) -> TrainingArguments:
    """The arguments of every worker (and of a one-process run of the same training)."""
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        max_steps=max_steps,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=max_steps,  # one checkpoint, at the end: RayTrainReportCallback reports it to Ray
        report_to="none",
        seed=0,
        use_cpu=use_cpu,
    )


def new_model(path: str | None):
    """`--model`'s folder, or a tiny new model."""
    from transformers import AutoModelForCausalLM

    from hf_tfm import TfmConfig, TfmForCausalLM

    if path:
        return AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    return TfmForCausalLM(TfmConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))


class WaitForTheCheckpoint(TrainerCallback):
    """Holds every worker at a save until all have reached it, rank 0's checkpoint folder written.

    Each worker's `RayTrainReportCallback` copies the newest checkpoint folder under `output_dir`, and Ray merges the
    workers' copies into the one checkpoint it keeps. Where workers share `output_dir` (one machine, or shared
    storage), a worker that copied the folder while rank 0 was still writing it would put a truncated file there.
    """

    def on_save(self, args, state, control, **kwargs):
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


def train_func(config: dict) -> None:
    """What each Ray worker runs."""
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    from hf_tfm.training import PadCollator

    args = training_arguments(config["scratch"], config["max_steps"], config["batch_size"], not config["gpu"])
    trainer = Trainer(
        model=new_model(config["model"]),
        args=args,
        train_dataset=examples(),
        data_collator=PadCollator(),
        callbacks=[WaitForTheCheckpoint(), RayTrainReportCallback()],  # in this order
    )
    trainer = prepare_trainer(trainer)
    trainer.train()
    if ray.train.get_context().get_world_rank() == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        summary = {"world_size": args.world_size, "parallel_mode": str(args.parallel_mode), "losses": losses}
        Path(config["scratch"], "worker0.json").write_text(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--model", help="an hf_tfm (or any causal LM) folder to fine-tune (default: a tiny new one)")
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=4, help="per worker")
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    output_dir = os.path.abspath(args.output_dir)
    # The workers import hf_tfm and examples/train.py: they inherit the environment Ray starts with.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init()  # joins the running cluster, or starts one on this machine
    config = vars(args) | {"scratch": os.path.join(output_dir, "trainer")}
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(storage_path=output_dir, name="ray"),
    )
    result = trainer.fit()
    summary = json.loads(Path(config["scratch"], "worker0.json").read_text())
    with result.checkpoint.as_directory() as checkpoint:  # a local path here; a copy from remote storage elsewhere
        folder = next(str(path.parent) for path in Path(checkpoint).rglob("config.json"))
    Path(output_dir, "run.json").write_text(json.dumps(summary | {"checkpoint": folder}, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
