"""Ray Train on a local cluster of 2 CPU workers (the docs' examples/ray_train.py), with the in-tree copy and one
process as the oracles."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, doc_blocks

pytest.importorskip("ray.train", reason="the `ray` extra is not installed (`make env` installs it)")

import transformers
from transformers import Trainer

sys.path.insert(0, str(ROOT / "tests" / "dist"))
sys.path.insert(0, str(ROOT / "examples"))
from common import save_pair
from ray_train import training_arguments
from train import examples

from hf_tfm.training import PadCollator

pytestmark = [pytest.mark.slow, pytest.mark.solo]

LLAMA = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
STEPS = 3
PROBE = [[5, 17, 42, 8, 91, 33, 3, 60]]


def ray_command() -> list[str]:
    """The docs' command (docs/scale-out.md), run as written."""
    lines = [line for block in doc_blocks("scale-out", "bash") for line in block.splitlines()]
    line = next(line for line in lines if "ray_train" in line)
    argv = line.split("#")[0].split()
    assert argv[:2] == ["python", "examples/ray_train.py"] and "--output_dir" in argv, argv
    return [sys.executable, *argv[1 : argv.index("--output_dir")]]


def test_ray_train_matches_the_in_tree_copy_and_one_process(tmp_path):
    """examples/ray_train.py (`TorchTrainer` + `prepare_trainer` + `RayTrainReportCallback`, 2 workers of batch 4) on
    hf_tfm and on its in-tree copy (Llama): real data parallelism (world size 2, ParallelMode.DISTRIBUTED), step
    losses equal the copy's and one process's `Trainer` on batch 8 (rtol 1e-5), and the checkpoint Ray reports
    loads with `from_pretrained` as a TfmForCausalLM whose logits equal that process's model's (atol 1e-5)."""
    save_pair("LlamaForCausalLM", LLAMA, tmp_path / "models")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    runs = {}
    for side in ("hf_tfm", "copy"):
        out = tmp_path / side
        options = ["--model", str(tmp_path / "models" / side), "--max_steps", str(STEPS), "--output_dir", str(out)]
        done = subprocess.run(
            [*ray_command(), *options], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
        runs[side] = json.loads((out / "run.json").read_text())
    ours, theirs = runs["hf_tfm"], runs["copy"]
    assert ours["world_size"] == 2 and ours["parallel_mode"] == "ParallelMode.DISTRIBUTED"

    single = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "hf_tfm")
    args = training_arguments(str(tmp_path / "single"), STEPS, 8, use_cpu=True)
    trainer = Trainer(model=single, args=args, train_dataset=examples(), data_collator=PadCollator())
    trainer.train()
    reference = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    for other in (theirs["losses"], reference):
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(other), rtol=1e-5, atol=0)

    with torch.no_grad():
        expected = single.eval()(torch.tensor(PROBE)).logits
        for side, run in runs.items():
            model = transformers.AutoModelForCausalLM.from_pretrained(run["checkpoint"]).eval()
            assert side != "hf_tfm" or type(model).__name__ == "TfmForCausalLM"
            torch.testing.assert_close(model(torch.tensor(PROBE)).logits, expected, rtol=0, atol=1e-5)
