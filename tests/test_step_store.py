"""A compiled decode step is compiled once per machine and model, not once per process (`hf_tfm.inference.step_store`):
a second process loads it without compiling, anything that changes what a library computes is a new key, a damaged
entry is rebuilt, each batch size has its library, and a first call decodes without waiting for its compile.

The oracle for tokens is the same checkpoint decoding eagerly (`load_for_inference(..., compile=False)`). Each test
has a store of its own (`HF_TFM_CACHE`), so what it compiles is what it observes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build, tiny_config

from hf_tfm import TfmForCausalLM, load_for_inference
from hf_tfm.cli import main
from hf_tfm.inference import aot, precompile, step_store

# Each test compiles a decode step (seconds to tens of seconds): CI runs them on the release range's ends only
pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PROMPTS = torch.tensor([[1, 5, 9, 13, 17, 21], [0, 0, 1, 7, 14, 28]])
MASK = (PROMPTS != 0).long()
OPTIONS = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}


def folder_of(tmp_path: Path, name: str = "lm", seed: int = 0, **overrides) -> Path:
    config = tiny_config(**{"intermediate_size": 128, "max_position_embeddings": 64, **overrides})
    build(TfmForCausalLM, config, seed=seed, attn_implementation="sdpa").save_pretrained(tmp_path / name)
    return tmp_path / name


def entries(store: Path) -> list[str]:
    return sorted(path.name for path in (store / "steps").iterdir() if not path.name.startswith("."))


def eager_tokens(folder: Path, batch: int = 2, quantize: str | None = None) -> torch.Tensor:
    eager = load_for_inference(folder, quantize=quantize, compile=False)
    return eager.generate(PROMPTS[-batch:], attention_mask=MASK[-batch:], **OPTIONS)


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_TFM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_second_process_loads_the_stored_step_without_compiling(tmp_path, store):
    folder = folder_of(tmp_path)
    compiled = precompile(load_for_inference(folder), (1,), verify=False)
    assert list(compiled) == ["step, batch 1"] and len(entries(store)) == 1
    record = json.loads((store / "steps" / entries(store)[0] / "entry.json").read_text())
    assert record["kind"] == "step" and record["batch"] == 1 and len(record["sha256"]) == 64
    driver = [sys.executable, str(HERE / "step_store_driver.py"), str(folder), "none", "1"]
    done = subprocess.run(driver, capture_output=True, text=True, check=True, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["compiled"] == {} and result["calls"] == 5  # 6 new tokens: the prompt's pass, then 5 steps
    eager = load_for_inference(folder, compile=False)
    expected = eager.generate(torch.arange(1, 7).view(1, 6), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert result["tokens"] == expected.tolist()


def key(model, kind: str = "step", batch: int = 1, threads: int = 2) -> str:
    return step_store.key_of(step_store.fingerprint(model, kind, batch, threads, aot.OPTIONS))


def test_the_key_holds_what_a_library_depends_on_and_not_the_weights_values(tmp_path, monkeypatch):
    """The layout, the setting, the step's kind and batch, the thread count and torch's version each change the key;
    other values of the same weights do not (a library reads the model's tensors where they are)."""
    base = load_for_inference(folder_of(tmp_path))
    other_values = load_for_inference(folder_of(tmp_path, "reseeded", seed=7))
    reference = key(base)
    assert key(other_values) == reference
    others = [
        key(load_for_inference(folder_of(tmp_path, "wider", intermediate_size=192))),
        key(load_for_inference(folder_of(tmp_path), quantize="q8")),
        key(base, kind="verify"),
        key(base, batch=2),
        key(base, threads=1),
    ]
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    others.append(key(base))
    assert len({reference, *others}) == 1 + len(others)


def test_a_checkpoint_of_the_same_layout_decodes_its_own_tokens_through_the_stored_library(
    tmp_path, store, monkeypatch
):
    """...and loading it skips Inductor's comparison of this machine with the compiling one (a Python spawned per
    vector instruction set: 0.8 s of a process's first step; the key names the CPU's flags)."""
    first, second = folder_of(tmp_path), folder_of(tmp_path, "reseeded", seed=7)
    precompile(load_for_inference(first), (2,), verify=False)

    def probed(device_type):
        raise AssertionError("the store's load probed the machine")

    monkeypatch.setattr("torch._inductor.codecache.get_device_information", probed)
    model = load_for_inference(second)
    assert precompile(model, (2,), verify=False) == {}  # found in the store
    tokens = model.generate(PROMPTS, attention_mask=MASK, **OPTIONS)
    assert torch.equal(tokens, eager_tokens(second)) and model.compiled_decode_step.calls == 7
    assert not torch.equal(tokens, eager_tokens(first))  # the other checkpoint's tokens, not the first one's


def test_a_damaged_entry_is_removed_and_compiled_again(tmp_path, store, caplog):
    folder = folder_of(tmp_path)
    precompile(load_for_inference(folder), (2,), verify=False)
    (package,) = (store / "steps").glob("*/step.pt2")
    package.write_bytes(package.read_bytes()[:-100] + bytes(100))  # a truncated or overwritten file
    model = load_for_inference(folder)
    assert list(precompile(model, (2,), verify=False)) == ["step, batch 2"]  # compiled again
    assert "is damaged (its package does not match its checksum)" in caplog.text
    assert torch.equal(model.generate(PROMPTS, attention_mask=MASK, **OPTIONS), eager_tokens(folder))


def test_each_batch_size_has_its_library_and_a_new_model_finds_them_all(tmp_path, store):
    folder = folder_of(tmp_path)
    assert set(precompile(load_for_inference(folder), (1, 2), verify=False)) == {"step, batch 1", "step, batch 2"}
    model = load_for_inference(folder)
    assert precompile(model, (1, 2), verify=False) == {} and len(entries(store)) == 2
    for batch in (1, 2):
        tokens = model.generate(PROMPTS[-batch:], attention_mask=MASK[-batch:], **OPTIONS)
        assert torch.equal(tokens, eager_tokens(folder, batch))


def test_a_first_call_decodes_while_its_step_compiles_beside_it(tmp_path, store, monkeypatch):
    """In the background, the first generate() answers at once with the uncompiled layers (the same tokens), the
    process keeps one core fewer while the compile runs, and the next call after it is stored takes the library."""
    monkeypatch.setenv("HF_TFM_COMPILE_IN_BACKGROUND", "1")
    folder = folder_of(tmp_path)
    threads = torch.get_num_threads()
    model = load_for_inference(folder)
    step = model.compiled_decode_step
    try:
        tokens = model.generate(PROMPTS, attention_mask=MASK, **OPTIONS)
        assert step.calls == 0 and list(step.compiling) == [("step", 2)]
        assert not step.compiling[("step", 2)].done()  # every token came while the compile ran
        assert torch.get_num_threads() == max(threads - 1, 1)
        assert torch.equal(tokens, eager_tokens(folder))
        precompile(model, (2,), verify=False)  # waits for the compile already running: no second one
        assert torch.get_num_threads() == threads and len(entries(store)) == 1
        assert torch.equal(model.generate(PROMPTS, attention_mask=MASK, **OPTIONS), tokens) and step.calls == 7
    finally:
        step.cancel()


def test_cli_compile_stores_the_steps_a_later_process_loads(tmp_path, store, capsys):
    folder = folder_of(tmp_path)
    assert main(["compile", str(folder), "--batch-size", "1", "2", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "compiled the decode step (step, batch 1)" in out and "compiling nothing" in out
    assert len(entries(store)) == 2
    assert main(["compile", str(folder), "--batch-size", "0"]) == 1
