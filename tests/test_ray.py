"""Ray Train on a local cluster of 2 CPU workers, with the in-tree copy and one process as the oracles."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

pytest.importorskip("ray.train", reason="the `ray` extra is not installed (`make env` installs it)")

import transformers

sys.path.insert(0, str(ROOT / "tests" / "dist"))
from common import save_pair, single_process_reference
from ray_train import PROBE

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


def reported_folder(checkpoint: str) -> Path:
    """The HF checkpoint folder inside the directory Ray reported (`RayTrainReportCallback` puts it in a subfolder)."""
    found = [path.parent for path in Path(checkpoint).rglob("config.json")]
    assert len(found) == 1, found
    return found[0]


def test_ray_train_matches_the_in_tree_copy_and_its_checkpoint_reloads(tmp_path):
    """`TorchTrainer` + `prepare_trainer` + `RayTrainReportCallback` on 2 workers: real data parallelism (world size
    2, ParallelMode.DISTRIBUTED); hf_tfm's step losses equal its in-tree copy's (Llama) and one process's on the
    same global batch (rtol 1e-5); the checkpoint Ray reports loads with `from_pretrained` as a TfmForCausalLM whose
    logits equal the trained model's (atol 1e-6) and the copy's reported checkpoint's (atol 1e-5)."""
    save_pair("LlamaForCausalLM", LLAMA, tmp_path / "models")
    runs = [f"{side}={tmp_path / 'models' / side}" for side in ("hf_tfm", "copy")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(ROOT / "tests" / "dist" / "ray_train.py"), str(tmp_path / "out"), *runs]
    (tmp_path / "out").mkdir()
    done = subprocess.run(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    result = json.loads((tmp_path / "out" / "result.json").read_text())

    ours, theirs = result["hf_tfm"], result["copy"]
    assert ours["world_size"] == 2 and ours["parallel_mode"] == "ParallelMode.DISTRIBUTED"
    reference = single_process_reference(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "hf_tfm"), len(ours["losses"])
    )
    for other in (theirs["losses"], reference):
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(other), rtol=1e-5, atol=0)
    assert ours["losses"][-1] < ours["losses"][0]

    logits = {}
    for name in ("hf_tfm", "copy"):
        model = transformers.AutoModelForCausalLM.from_pretrained(reported_folder(result[name]["checkpoint"]))
        with torch.no_grad():
            logits[name] = model.eval()(torch.tensor(PROBE)).logits
        if name == "hf_tfm":
            assert type(model).__name__ == "TfmForCausalLM"
    torch.testing.assert_close(logits["hf_tfm"], torch.tensor(ours["logits"]), rtol=0, atol=1e-6)
    torch.testing.assert_close(logits["hf_tfm"], logits["copy"], rtol=0, atol=1e-5)
