"""save_pretrained / from_pretrained: bit-identical heads, tying, computed buffers, auto_map and remote code, and
overwriting a checkpoint all at once."""

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from conftest import build, random_ids, run_without_hf_tfm, tiny_config
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    modeling_utils,
)
from transformers.testing_utils import CaptureLogger

from hf_tfm import (
    TfmForCausalLM,
    TfmForMaskedLM,
    TfmForQuestionAnswering,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmModel,
    checkpoint,
)
from hf_tfm.modeling import AUTO_MAP

HEADS = [
    (TfmForCausalLM, AutoModelForCausalLM, {}),
    (TfmForSequenceClassification, AutoModelForSequenceClassification, {"is_causal": False, "num_labels": 3}),
    (TfmForTokenClassification, AutoModelForTokenClassification, {"is_causal": False, "num_labels": 4}),
    (TfmForMaskedLM, AutoModelForMaskedLM, {"is_causal": False, "position_embedding_type": "learned"}),
    (TfmForQuestionAnswering, AutoModelForQuestionAnswering, {"is_causal": False}),
    (TfmModel, AutoModel, {"position_embedding_type": "alibi"}),
]


def stored_keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def outputs(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    if hasattr(out, "start_logits"):
        return torch.stack((out.start_logits, out.end_logits))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize(("model_class", "auto_class", "overrides"), HEADS, ids=lambda v: getattr(v, "__name__", ""))
def test_round_trip_is_bit_identical(tmp_path, model_class, auto_class, overrides):
    model = build(model_class, tiny_config(**overrides))
    model.save_pretrained(tmp_path)
    loaded = auto_class.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is model_class
    ids = random_ids(2, 7)
    assert torch.equal(outputs(loaded, ids), outputs(model, ids))
    volatile = {"_name_or_path", "dtype"}
    saved = {k: v for k, v in loaded.config.to_dict().items() if k not in volatile}
    assert saved == {k: v for k, v in model.config.to_dict().items() if k not in volatile}


def test_tied_model_stores_one_copy_and_stays_tied(tmp_path):
    model = build(TfmForCausalLM, tiny_config())
    model.save_pretrained(tmp_path)
    keys = stored_keys(tmp_path)
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)

    mlm = build(TfmForMaskedLM, tiny_config(is_causal=False))
    mlm.save_pretrained(tmp_path / "mlm")
    assert "lm_head.weight" not in stored_keys(tmp_path / "mlm") and "lm_head.bias" in stored_keys(tmp_path / "mlm")
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "mlm")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("device_map", ["auto", "cpu"])
def test_device_map_loading_keeps_ties_and_logits(tmp_path, device_map):
    """Big-model loading (`device_map`, accelerate dispatch) gives the same logits and keeps the tie."""
    model = build(TfmForCausalLM, tiny_config())
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map, attn_implementation="eager").eval()
    ids = random_ids(2, 6)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_untied_model_stores_both(tmp_path):
    model = build(TfmForCausalLM, tiny_config(tie_word_embeddings=False))
    model.save_pretrained(tmp_path)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= stored_keys(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)


@pytest.mark.parametrize(
    "overrides",
    [
        {"position_embedding_type": "rope"},
        {"position_embedding_type": "rope", "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
        {"position_embedding_type": "sinusoidal"},
        {"position_embedding_type": "alibi", "num_attention_heads": 8, "hidden_size": 64},  # and 6 heads below
        {"position_embedding_type": "alibi", "num_attention_heads": 6, "hidden_size": 48},
    ],
    ids=["rope", "rope-linear", "sinusoidal", "alibi8", "alibi6"],
)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_computed_buffers_after_loading(tmp_path, overrides, dtype):
    """Non-persistent buffers are rebuilt after the meta-device load; they stay fp32 even with dtype=bfloat16
    (transformers casts parameters and persistent buffers only), so positions keep full precision."""
    config = tiny_config(**overrides)
    model = build(TfmForCausalLM, config)
    model.save_pretrained(tmp_path)
    assert all("inv_freq" not in k and "slopes" not in k for k in stored_keys(tmp_path))  # computed, not stored
    fresh = dict(build(TfmForCausalLM, tiny_config(**overrides)).named_buffers())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, attn_implementation="eager")
    buffers = dict(loaded.named_buffers())
    assert buffers.keys() == fresh.keys() and buffers
    for name, buffer in buffers.items():
        assert buffer.dtype == torch.float32, name
        assert torch.equal(buffer, fresh[name]), name
    if dtype is None:
        ids = random_ids(1, 6)
        assert torch.equal(outputs(loaded, ids), outputs(model, ids))
    else:
        assert loaded.lm_head.weight.dtype == torch.bfloat16
        assert torch.isfinite(outputs(loaded, random_ids(1, 6))).all()


def test_alibi_slopes_match_the_paper():
    from hf_tfm.modeling import TfmAlibi

    torch.testing.assert_close(TfmAlibi.compute_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 6 heads: the 4-head slopes, then every other one of the 8-head slopes (arXiv:2108.12409, appendix)
    expected = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    torch.testing.assert_close(TfmAlibi.compute_slopes(6), torch.tensor(expected))


def test_config_json_lists_every_head(tmp_path):
    build(TfmForSequenceClassification, tiny_config(is_causal=False)).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == AUTO_MAP
    assert set(AUTO_MAP) == {
        "AutoConfig",
        "AutoModel",
        "AutoModelForCausalLM",
        "AutoModelForSequenceClassification",
        "AutoModelForMaskedLM",
        "AutoModelForTokenClassification",
        "AutoModelForQuestionAnswering",
    }
    assert saved["model_type"] == "hf_tfm"
    # the code of a remote-code load: modeling.py and every module it imports relatively
    code = {"configuration.py", "modeling.py", "checkpoint.py", "distributed.py"}
    assert {p.name for p in tmp_path.iterdir()} >= code | {"config.json"}
    assert type(AutoConfig.from_pretrained(tmp_path)).__name__ == "TfmConfig"


@pytest.mark.slow
def test_remote_code_round_trip_without_hf_tfm(tmp_path):
    """In a process where hf_tfm cannot be imported: both checkpoints load from their own code with
    trust_remote_code, give bit-identical logits and generate; without trust_remote_code loading fails."""
    lm = build(TfmForCausalLM, tiny_config(num_key_value_heads=2))
    clf = build(TfmForSequenceClassification, tiny_config(is_causal=False, num_labels=3))
    lm.save_pretrained(tmp_path / "lm")
    clf.save_pretrained(tmp_path / "clf")
    ids = random_ids(2, 5)
    torch.save(ids, tmp_path / "ids.pt")
    code = """
    import json, torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    try:
        import hf_tfm
        raise SystemExit("hf_tfm must not be importable here")
    except ImportError:
        pass
    ids = torch.load("ids.pt")
    kwargs = {"trust_remote_code": True, "attn_implementation": "eager"}
    lm = AutoModelForCausalLM.from_pretrained("lm", **kwargs).eval()
    clf = AutoModelForSequenceClassification.from_pretrained("clf", **kwargs).eval()
    with torch.no_grad():
        torch.save({"lm": lm(input_ids=ids).logits, "clf": clf(input_ids=ids).logits}, "logits.pt")
    gen = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                      do_sample=False)
    refused = False
    try:
        AutoModelForCausalLM.from_pretrained("lm")
    except ValueError as err:
        refused = "trust_remote_code" in str(err)
    print("RESULT:" + json.dumps({
        "modules": [type(lm).__module__, type(clf).__module__],
        "tied": lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr(),
        "generated": gen.tolist(),
        "refused": refused,
    }))
    """
    stdout = run_without_hf_tfm(code, tmp_path)
    result = json.loads(stdout.split("RESULT:")[-1])  # the refused load's prompt also writes to stdout
    assert all(m.startswith("transformers_modules.") for m in result["modules"]), result["modules"]
    assert result["tied"] and result["refused"]
    logits = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        assert torch.equal(logits["lm"], lm(input_ids=ids).logits)
        assert torch.equal(logits["clf"], clf(input_ids=ids).logits)
    expected = lm.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False
    )
    assert result["generated"] == expected.tolist()


def test_run_without_hf_tfm_blocks_the_package(tmp_path):
    """The helper itself: hf_tfm really is unimportable there, and failures surface with the child's stderr."""
    assert run_without_hf_tfm("import json; print(json.dumps(1 + 1))", tmp_path).strip() == "2"
    with pytest.raises(RuntimeError, match=r"ModuleNotFoundError|ImportError"):
        run_without_hf_tfm("import hf_tfm", tmp_path)


# --- overwriting a checkpoint: written to a hidden folder next to it and swapped in whole; other files are kept

SHARDS = "20KB"  # five shards of a tiny model


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(folder: Path) -> list[str]:
    """Staging or backup folders of `folder` (`.NAME.partial-*`, `.NAME.old-*`)."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def assert_loads_as(folder: Path, model) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    expected = model.state_dict()
    assert loaded.config.intermediate_size == model.config.intermediate_size
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.fixture
def checkpoints(tmp_path):
    """An old and a new causal LM of different sizes and seeds, and a folder where the user keeps other files."""
    old = build(TfmForCausalLM, tiny_config(), seed=0)
    new = build(TfmForCausalLM, tiny_config(intermediate_size=64), seed=1)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "README.md").write_text("# my model\n")
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "runs").mkdir()
    (folder / "runs" / "events.log").write_text("step 1\n")
    return old, new, folder


@pytest.mark.parametrize("shards", [None, SHARDS], ids=["one-file", "sharded"])
def test_overwrite_that_fails_midway_leaves_the_old_checkpoint(checkpoints, monkeypatch, shards):
    """Failing before the first weight byte (one file) or after the first shard: the folder is byte for byte what it
    was, loads as the old model, and no staging folder is left."""
    old, new, folder = checkpoints
    size = {"max_shard_size": shards} if shards else {}
    old.save_pretrained(folder, **size)
    before = snapshot(folder)
    assert len([name for name in before if name.endswith(".safetensors")]) == (5 if shards else 1)
    written, save_file = [], modeling_utils.safe_save_file

    def write_then_fail(tensors, filename, **kwargs):  # the safetensors writer transformers calls for each file
        if len(written) == (1 if shards else 0):
            raise OSError(28, "No space left on device")
        written.append(filename)
        return save_file(tensors, filename, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_save_file", write_then_fail)
    with pytest.raises(OSError, match="No space left on device"):
        new.save_pretrained(folder, **size)
    assert len(written) == (1 if shards else 0)
    assert snapshot(folder) == before and leftovers(folder) == []
    assert_loads_as(folder, old)


@pytest.mark.parametrize(("old_shards", "new_shards"), [(None, SHARDS), (SHARDS, None), (SHARDS, SHARDS)])
def test_completed_overwrite_loads_the_new_weights_and_keeps_other_files(
    checkpoints, tmp_path, old_shards, new_shards
):
    """The new checkpoint replaces the old one's weight files (stale shards or a stale unsharded file, which
    transformers would load in preference to new shards, are dropped); files the save does not write stay."""
    old, new, folder = checkpoints
    user_files = snapshot(folder)
    old.save_pretrained(folder, **({"max_shard_size": old_shards} if old_shards else {}))
    new.save_pretrained(folder, **({"max_shard_size": new_shards} if new_shards else {}))
    new.save_pretrained(tmp_path / "fresh", **({"max_shard_size": new_shards} if new_shards else {}))
    assert set(snapshot(folder)) == set(snapshot(tmp_path / "fresh")) | set(user_files)
    assert {name: snapshot(folder)[name] for name in user_files} == user_files
    assert leftovers(folder) == []
    assert_loads_as(folder, new)


def test_save_from_a_process_that_does_not_save_leaves_the_folder_alone(checkpoints):
    """Distributed saves call save_pretrained on every rank; only the main process writes (and stages)."""
    old, new, folder = checkpoints
    old.save_pretrained(folder)
    before = snapshot(folder)
    new.save_pretrained(folder, is_main_process=False)
    assert snapshot(folder) == before and leftovers(folder) == []


def test_save_into_the_working_directory(checkpoints, monkeypatch):
    """`save_pretrained(".")`: the process stays in the folder, which now holds the new checkpoint."""
    old, new, folder = checkpoints
    old.save_pretrained(folder)
    monkeypatch.chdir(folder)
    new.save_pretrained(".")
    assert Path.cwd() == folder.resolve() and Path("README.md").is_file()
    assert_loads_as(folder, new)
    assert leftovers(folder) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2(RENAME_EXCHANGE) is Linux's")
def test_a_reader_never_finds_the_folder_missing_during_an_overwrite(tmp_path):
    """On Linux the new folder and the old swap in one step: a reader polling during 300 overwrites always finds
    one (with two renames it finds none hundreds of times)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("0")
    stop, misses = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            if not (folder / "config.json").is_file():
                misses.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(300):
            with checkpoint.staged_folder(folder) as staging:
                (staging / "config.json").write_text(str(i + 1))
    finally:
        stop.set()
        reader.join()
    assert (folder / "config.json").read_text() == "300" and len(misses) == 0 and leftovers(folder) == []


def test_overwrite_by_two_renames_where_the_system_cannot_swap(checkpoints, monkeypatch):
    """Without an atomic swap (another system, a file system without RENAME_EXCHANGE) the old folder steps aside
    under a hidden name, the new one takes its place, and the old one is deleted."""
    old, new, folder = checkpoints
    old.save_pretrained(folder)
    monkeypatch.setattr(checkpoint, "_exchange", lambda first, second: False)
    new.save_pretrained(folder)
    assert_loads_as(folder, new)
    assert (folder / "README.md").read_text() == "# my model\n" and leftovers(folder) == []


def test_a_folder_that_cannot_be_swapped_is_saved_in_place(checkpoints, monkeypatch):
    """A mount point cannot be renamed: the save goes in place, as transformers' does, and says so."""
    old, new, folder = checkpoints
    old.save_pretrained(folder)
    is_mount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == folder.resolve() or is_mount(path))
    with CaptureLogger(checkpoint.logger) as captured:
        new.save_pretrained(folder)
    assert "in place, not all at once" in captured.out and "mount point" in captured.out
    assert_loads_as(folder, new)
    assert (folder / "README.md").read_text() == "# my model\n" and leftovers(folder) == []


def test_staged_file_replaces_the_file_only_when_complete(tmp_path):
    """`checkpoint.staged_file` (a GGUF export's write): the new file takes the target's place when the block ends,
    with the old file's permissions; a block that raises leaves the old file and no staging file behind."""
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old")
    target.chmod(0o640)
    with pytest.raises(RuntimeError, match="killed"), checkpoint.staged_file(target) as staging:
        staging.write_bytes(b"half")
        raise RuntimeError("killed")
    assert target.read_bytes() == b"old" and leftovers(target) == []
    with checkpoint.staged_file(target) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".model.gguf.partial-")
        staging.write_bytes(b"new")
        assert target.read_bytes() == b"old"
    assert target.read_bytes() == b"new" and leftovers(target) == []
    assert target.stat().st_mode & 0o777 == 0o640
    umask = os.umask(0)
    os.umask(umask)
    with checkpoint.staged_file(tmp_path / "sub" / "new.bin") as staging:
        staging.write_bytes(b"x")
    assert (tmp_path / "sub" / "new.bin").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.slow
def test_push_to_hub_from_an_overwritten_folder(checkpoints, tmp_path):
    """`save_pretrained(push_to_hub=True)` names the repository after the folder (not its staging name) and uploads
    what the save wrote; the user's other files stay local."""
    from fake_hub import FakeHub

    old, new, folder = checkpoints
    old.save_pretrained(folder)
    new.save_pretrained(tmp_path / "new")
    hub = FakeHub().start()
    try:
        code = f"""
            from transformers import AutoModelForCausalLM
            from hf_tfm import TfmForCausalLM
            model = TfmForCausalLM.from_pretrained({str(tmp_path / "new")!r})
            model.save_pretrained({str(folder)!r}, push_to_hub=True)
        """
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_fake", "HF_HOME": str(tmp_path / "hf")}
        env.pop("HF_HUB_OFFLINE", None)
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=180
        )
        assert result.returncode == 0, result.stderr[-3000:]
        pushed = hub.files("fake-user/model")
    finally:
        hub.stop()
    assert set(pushed) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "modeling.py",
        "configuration.py",
        "checkpoint.py",
        "distributed.py",
        "README.md",
    }
    assert pushed["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert (folder / "tokenizer.json").is_file() and (folder / "runs" / "events.log").is_file()
    assert_loads_as(folder, new)
