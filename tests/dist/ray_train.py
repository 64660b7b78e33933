"""Ray Train on 2 CPU workers, as Ray's transformers guide has it: `python tests/dist/ray_train.py OUT_DIR NAME=FOLDER...`.

For each saved causal LM (hf_tfm's and its in-tree copy), a `TorchTrainer` runs `loop` on 2 workers: `Trainer` with
`RayTrainReportCallback`, wrapped by `prepare_trainer`, SGD steps on the fixed global batch of common.py, a checkpoint
at the last step. Rank 0 of each run writes its step losses and the trained model's logits on a fixed input; this
script adds the path of the checkpoint Ray reported, and writes OUT_DIR/result.json.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

STEPS = 3
PROBE = [[5, 17, 42, 8, 91, 33, 3, 60]]


def loop(config: dict) -> None:
    """One worker's training: what a user's `train_func` holds."""
    import ray.train
    import torch
    from common import examples, training_arguments
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
    from transformers import AutoModelForCausalLM, Trainer

    import hf_tfm  # noqa: F401  (registers the Auto classes)
    from hf_tfm.training import PadCollator

    model = AutoModelForCausalLM.from_pretrained(config["folder"])
    args = training_arguments(config["scratch"], STEPS, save_strategy="steps", save_steps=STEPS)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=examples(),
        data_collator=PadCollator(),
        callbacks=[RayTrainReportCallback()],
    )
    trainer = prepare_trainer(trainer)
    trainer.train()
    if ray.train.get_context().get_world_rank() == 0:
        with torch.no_grad():
            logits = model.eval()(torch.tensor(PROBE)).logits
        record = {
            "world_size": ray.train.get_context().get_world_size(),
            "parallel_mode": str(args.parallel_mode),
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "logits": logits.tolist(),
        }
        Path(config["record"]).write_text(json.dumps(record))


def main(out_dir: str, runs: list[str]) -> None:
    # the workers import common.py (this folder) and this tree's hf_tfm: they inherit the environment Ray starts with
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # a short folder of its own: Ray's sockets live in it (a path over 107 bytes fails), and no other Ray is shared
    temp = tempfile.mkdtemp(prefix="ray-")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp)
    result = {}
    for name, folder in (run.split("=", 1) for run in runs):
        record = os.path.join(out_dir, f"{name}.json")
        trainer = TorchTrainer(
            loop,
            train_loop_config={"folder": folder, "scratch": os.path.join(out_dir, name, "scratch"), "record": record},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=os.path.join(out_dir, "ray"), name=name),
        )
        reported = trainer.fit()
        result[name] = json.loads(Path(record).read_text()) | {"checkpoint": reported.checkpoint.path}
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
    Path(out_dir, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
