"""Real multi-process training on CPU (gloo): DDP under torchrun and accelerate launch, native FSDP2, and saving.

Each test launches 2 processes (about 10-20 s on 2 cores). The launch scripts in tests/dist/ assert inside the run;
the tests check their summaries and the saved folders.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import doc_blocks, free_port, run_without_hf_tfm
from safetensors import safe_open
from test_training import EXPECTED_AUTO_MAP

from hf_tfm import TfmConfig, TfmForCausalLM, TfmForMaskedLM
from hf_tfm.distributed import TRAINER_TAKES_SHARDED_MODELS

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "tests" / "dist"
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.slow, pytest.mark.solo]


def launch(command: list[str], tmp_path: Path, timeout: float = 600.0) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )
    return result.stdout


def torchrun(script: str, *args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--nproc_per_node", "2", "--standalone", str(DIST / script), *args]


def assert_loadable_folder(folder: Path) -> None:
    for code in ("configuration.py", "modeling.py", "checkpoint.py", "distributed.py"):
        assert (folder / code).is_file(), code
    assert not list(folder.glob("_fsdp*.py"))
    assert json.loads((folder / "config.json").read_text())["auto_map"] == EXPECTED_AUTO_MAP


def test_torchrun_ddp_matches_single_process(tmp_path):
    """2-process DDP with Trainer == one process on the same global batch (losses and weights), replicas equal."""
    launch(torchrun("train_ddp.py", str(tmp_path)), tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2 and result["parallel_mode"] == "ParallelMode.DISTRIBUTED"
    assert result["wrapper"] == "DistributedDataParallel" and result["replicas_equal"]
    assert len(result["losses"]) == 4 and result["losses"][-1] < result["losses"][0] - 0.5
    for loss, reference in zip(result["losses"], result["reference_losses"], strict=True):
        assert abs(loss - reference) < 1e-5
    assert result["max_weight_diff"] < 1e-5
    assert_loadable_folder(tmp_path / "final")


@pytest.mark.skipif(
    not TRAINER_TAKES_SHARDED_MODELS,
    reason="this transformers release's Trainer wraps a natively sharded model in DDP; 5.19 and newer take it",
)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_native_fsdp2_trains_sharded_and_saves_a_loadable_checkpoint(tmp_path, tied):
    """DistributedConfig(fsdp_size=2): sharded params, Trainer == single process, saved folder loads without hf_tfm.

    Tied: transformers shards `lm_head` apart from `embed_tokens` and ties only after sharding, so without hf_tfm's
    fix step 2 already differs (4.297 vs 4.195); the saved model must still be tied (one stored matrix).
    """
    torch.manual_seed(0)
    config = TfmConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    TfmForCausalLM(config).save_pretrained(tmp_path / "base")
    launch(torchrun("train_fsdp.py", str(tmp_path / "base"), str(tmp_path / "out")), tmp_path)
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["model_class"] == "FSDPTfmForCausalLM" and result["local_q_proj_shape"] == [16, 32]
    for loss, reference in zip(result["losses"], result["reference_losses"], strict=True):
        assert abs(loss - reference) < 1e-5
    assert result["max_weight_diff"] < 1e-5

    final = tmp_path / "out" / "final"
    assert_loadable_folder(final)  # the FSDP2 save bug: auto_map -> "_fsdp_init.FSDP...", no modeling.py
    with safe_open(final / "model.safetensors", "pt") as weights:
        assert ("lm_head.weight" in set(weights.keys())) is not tied
    code = f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(final)!r}, trust_remote_code=True).eval()
        assert type(model).__name__ == "TfmForCausalLM", type(model)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) is {tied}
        with torch.no_grad():
            print(json.dumps(model(torch.tensor({result["probe"]})).logits.tolist()))
    """
    logits = json.loads(run_without_hf_tfm(code, tmp_path).strip().splitlines()[-1])
    torch.testing.assert_close(torch.tensor(logits), torch.tensor(result["reference_logits"]), rtol=0, atol=1e-5)


def test_readme_accelerate_ddp_launch(tmp_path):
    """The docs' `accelerate launch --config_file examples/accelerate/ddp.yaml` command: real 2-process DDP."""
    commands = [line for block in doc_blocks("training", "bash") for line in block.splitlines()]
    ddp = next(line for line in commands if "ddp.yaml" in line)
    argv = ddp.replace("out/ddp", str(tmp_path / "ddp")).split()
    assert argv[:2] == ["accelerate", "launch"]
    # The docs' command with one addition: a free rendezvous port (accelerate's default, 29500, may be taken by a
    # suite running beside this one).
    launch([str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port()), *argv[2:]], tmp_path)
    run = json.loads((tmp_path / "ddp" / "run.json").read_text())
    assert run["world_size"] == 2 and run["parallel_mode"] == "ParallelMode.DISTRIBUTED"
    assert run["model_wrapped"] == "DistributedDataParallel" and len(run["losses"]) == 8
    assert_loadable_folder(tmp_path / "ddp")


@pytest.mark.parametrize("head", ["causal_lm", "masked_lm"])
def test_tensor_parallel_shards_tied_head_with_its_embedding(tmp_path, head):
    """DistributedConfig(tp_size=2) on a tied head: one parameter, sharded on the vocabulary, logits == one process.

    Before the masked LM had a plan entry for `lm_head`, 5.24 sharded `embed_tokens` alone and the tied head failed
    ("aten.addmm.default got mixed torch.Tensor and DTensor").
    """
    cls = TfmForCausalLM if head == "causal_lm" else TfmForMaskedLM
    torch.manual_seed(0)
    config = TfmConfig(
        vocab_size=98,  # even: each rank holds half the vocabulary
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        is_causal=head == "causal_lm",
        initializer_range=0.2,
    )
    cls(config).save_pretrained(tmp_path / "model")
    launch(torchrun("tp_logits.py", str(tmp_path / "model"), str(tmp_path / "result.json")), tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["shape"] == [1, 8, 98] and result["tied"]
    assert result["placements"] == ["(Shard(dim=0),)", "(Shard(dim=0),)"]
    assert result["max_logit_diff"] < 1e-5
