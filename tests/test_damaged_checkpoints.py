"""Damaged checkpoints and interrupted saves: a clear error naming the file and the problem, never a model that loads
with random or stale weights unannounced.
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import build, run_without_hf_tfm, tiny_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_tfm import TfmConfig, TfmForCausalLM, TfmForSequenceClassification

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(name="saved")
def saved_fixture(tmp_path) -> Path:
    model = build(TfmForCausalLM, tiny_config())
    model.save_pretrained(tmp_path / "ok")
    return tmp_path / "ok"


def _copy(saved: Path, name: str) -> Path:
    return Path(shutil.copytree(saved, saved.parent / name))


@pytest.mark.parametrize("keep", [0, 7, 60, "half", "all but one"])
def test_truncated_weights_name_the_file(saved, keep):
    folder = _copy(saved, "truncated")
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, {"half": size // 2, "all but one": size - 1}.get(keep, keep))
    with pytest.raises(
        OSError, match=r"truncated.*damaged weights file model\.safetensors|model\.safetensors.*truncated"
    ):
        AutoModelForCausalLM.from_pretrained(folder)


def test_config_sizes_that_do_not_match_the_weights_keep_transformers_error(saved):
    """transformers' contract (`test_load_with_mismatched_shapes`): its `RuntimeError` with its advice."""
    folder = _copy(saved, "resized")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        TfmForSequenceClassification.from_pretrained(saved, num_labels=42, intermediate_size=64)


def test_unknown_config_key_loads_kept_with_a_suggestion(saved, tmp_path, caplog):
    """As in-tree configs: the key is kept and saved back; one warning names it with the nearest knob."""
    folder = _copy(saved, "typo")
    config = json.loads((folder / "config.json").read_text())
    config["sliding_windw"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        model = AutoModelForCausalLM.from_pretrained(folder)
    warnings = [r.getMessage() for r in caplog.records if "sliding_windw" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "`sliding_windw` (did you mean `sliding_window`?)" in warnings[0]
    assert "newer hf_tfm" in warnings[0]  # a checkpoint from a newer release may compute something else
    assert model.config.sliding_windw == 4 and model.config.sliding_window is None
    model.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["sliding_windw"] == 4
    code = f"""
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        print("loaded:", model.config.sliding_windw)
    """
    out = run_without_hf_tfm(code, tmp_path)  # remote code: the folder's own configuration.py keeps it too
    assert "loaded: 4" in out


def test_missing_code_file_names_it(saved, tmp_path):
    folder = _copy(saved, "nocode")
    (folder / "modeling.py").unlink()
    code = f"""
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        except OSError as err:
            print("refused:", err)
    """
    assert f"refused: {folder} does not appear to have a file named modeling.py" in run_without_hf_tfm(code, tmp_path)


def test_missing_and_unexpected_weights_are_reported(saved):
    folder = _copy(saved, "keys")
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.extra.weight"] = state.pop("model.layers.0.mlp.up_proj.weight")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    _, info = TfmForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert set(info["missing_keys"]) == {"model.layers.0.mlp.up_proj.weight"}
    assert set(info["unexpected_keys"]) == {"model.layers.0.extra.weight"}


# --- interrupted saves: SIGKILL while writing, then load what is left

SAVE = """
import sys, torch
from hf_tfm import TfmConfig, TfmForCausalLM
torch.manual_seed(int(sys.argv[2]))
config = TfmConfig(vocab_size=32000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4)
model = TfmForCausalLM(config)
print("ready", flush=True)
model.save_pretrained(sys.argv[1])
"""


def _seeded_model(seed: int) -> TfmForCausalLM:
    """The model SAVE saves with this seed."""
    torch.manual_seed(seed)
    return TfmForCausalLM(TfmConfig(vocab_size=32000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4))


def _kill_while_saving(folder: Path, seed: int, when: str) -> bool:
    """Start a save of a 9M-parameter model into `folder` and SIGKILL it once the save's staging folder (hidden, next
    to `folder`) holds `config.json` or the first bytes of `model.safetensors`; True if it was killed before
    finishing."""
    child = subprocess.Popen(
        [sys.executable, "-c", SAVE, str(folder), str(seed)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert child.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    pattern = f".{folder.name}.partial-*/" + ("config.json" if when == "config" else "model.safetensors")
    while not list(folder.parent.glob(pattern)) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    child.send_signal(signal.SIGKILL)
    return child.wait() == -signal.SIGKILL


def _assert_is(loaded, model) -> None:
    for (name, param), (_, other) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(param, other), name


@pytest.mark.slow
@pytest.mark.parametrize("when", ["config", "weights"])
def test_killed_save_never_loads_as_a_complete_wrong_model(tmp_path, when):
    """Killed mid-write, a save leaves no folder (only its hidden staging folder); finished, the exact model. The
    signal can land after the save's final rename (the child is then still alive, exiting), so whether the folder
    exists, not how the child ended, says which of the two happened."""
    folder = tmp_path / "model"
    killed = _kill_while_saving(folder, seed=1, when=when)
    if folder.exists():
        _assert_is(AutoModelForCausalLM.from_pretrained(folder), _seeded_model(1))
    else:
        assert killed
        with pytest.raises(OSError):
            AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["config", "weights"])
def test_killed_overwrite_leaves_the_old_checkpoint(tmp_path, when):
    """A save over an existing checkpoint, killed before or while writing the weights: the old checkpoint is as it
    was and loads with the same weights."""
    folder = tmp_path / "model"
    _seeded_model(2).save_pretrained(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    _kill_while_saving(folder, seed=1, when=when)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    unchanged = {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # The old checkpoint, whole; or the new one, whole, when the signal landed after the swap (the old one may then
    # be left half deleted under the staging folder's hidden name)
    _assert_is(loaded, _seeded_model(2 if unchanged else 1))


@pytest.mark.slow
def test_killed_cli_leaves_no_model_folder(tmp_path):
    """`hf-tfm pretrain` killed mid-run (here: once its staging folder exists) leaves nothing at the output path."""
    (tmp_path / "train.txt").write_text("\n".join(f"def f_{i}(x): return x + {i}" for i in range(200)))
    argv = [str(Path(sys.executable).with_name("hf-tfm")), "pretrain", "--train-file", str(tmp_path / "train.txt")]
    argv += ["--output-dir", str(tmp_path / "lm"), "--max-steps", "200", "--batch-size", "4", "--seq-len", "32"]
    child = subprocess.Popen([*argv, "--vocab-size", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".lm.partial-*")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)  # training and writing into the staging folder
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    assert not (tmp_path / "lm").exists()
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
