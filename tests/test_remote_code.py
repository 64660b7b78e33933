"""Remote code only by consent, as in transformers: each hf_tfm loader and command that takes a folder or Hub id passes
`trust_remote_code` (default False; `--trust-remote-code` on the command line) to transformers.

The oracle is a folder whose code would run: its `config.json` and `tokenizer_config.json` map the Auto classes to
modules of its own that write a marker file when imported (and the model module then stops the load). Without consent
transformers refuses it (its own `ValueError`, asking for `trust_remote_code=True`) and no marker is written; with
consent the markers are written, which proves the flag reached each `AutoConfig` / `AutoTokenizer` / `AutoModel*` call.
hf_tfm's own folders load without the flag: importing hf_tfm registered its classes, which transformers uses instead of
the folder's copy of the code (a marker planted in that copy stays unwritten).
"""

import json
import sys
from pathlib import Path

import pytest
from conftest import build, run_without_hf_tfm, tiny_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import hf_tfm
from hf_tfm import TfmForCausalLM, load_for_inference
from hf_tfm.calibration import calibrate
from hf_tfm.cli import main
from hf_tfm.commands.serve import SERVE_NAMES_ENV
from hf_tfm.tokenization import load_tokenizer
from hf_tfm.training import (
    TrainSettings,
    finetune_classifier,
    load_causal_lm,
    seq2seq_from_causal_lm,
    train_seq2seq,
)

MODEL_STOPS = "remote model code ran"  # what the folder's model module raises once it has written its marker
AUTO_MODELS = (
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForSequenceClassification",
    "AutoModelForSeq2SeqLM",
)
REMOTE_MODULES = {
    "remote_config": "from transformers import PretrainedConfig\n\n\n"
    "class RemoteConfig(PretrainedConfig):\n    model_type = 'remote_only'\n",
    "remote_tokenizer": "from transformers import PreTrainedTokenizerFast\n\n\n"
    "class RemoteTokenizer(PreTrainedTokenizerFast):\n    pass\n",
    "remote_model": f"raise RuntimeError({MODEL_STOPS!r})\n",
}


@pytest.fixture(autouse=True)
def modules_cache(tmp_path, monkeypatch):
    """The code transformers copies out of a folder goes under this test's tmp_path, not the user's modules cache."""
    from transformers import dynamic_module_utils

    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))  # transformers appends the cache to it


@pytest.fixture
def remote(tmp_path) -> tuple[Path, Path]:
    """(folder, markers): a folder whose config, tokenizer and model load only through modules of its own, each of
    which writes `markers/<module>` when imported."""
    folder, markers = tmp_path / f"remote_{tmp_path.name}", tmp_path / "markers"  # its own name: its own modules
    folder.mkdir()
    markers.mkdir()
    auto_map = {"AutoConfig": "remote_config.RemoteConfig", **dict.fromkeys(AUTO_MODELS, "remote_model.RemoteModel")}
    config = {"model_type": "remote_only", "architectures": ["RemoteModel"], "auto_map": auto_map}
    (folder / "config.json").write_text(json.dumps(config))
    for module, body in REMOTE_MODULES.items():
        (folder / f"{module}.py").write_text(
            f"from pathlib import Path\n\nPath({str(markers / module)!r}).touch()\n{body}"
        )
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "a": 4, "b": 5, "c": 6, "d": 7}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "RemoteTokenizer"
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "remote_tokenizer.RemoteTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder, markers


def ran(markers: Path) -> set[str]:
    """The folder's modules that were imported."""
    return {p.name for p in markers.iterdir()}


FILES = {"texts": "texts.txt", "labelled": "labelled.jsonl", "pairs": "pairs.jsonl"}


@pytest.fixture
def data(tmp_path) -> dict[str, Path]:
    """Small text, labelled and pair files for the training commands (they never get to train here)."""
    (tmp_path / "texts.txt").write_text("\n".join(f"a b c d {i}" for i in range(20)))
    rows = [{"text": f"{words} {i}", "label": words} for words in ("a b", "c d") for i in range(6)]
    (tmp_path / "labelled.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pairs = [{"source": f"a {i}", "target": "b"} for i in range(9)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(pair) for pair in pairs))
    return {name: tmp_path / file for name, file in FILES.items()}


# ---------------------------------------------------------------------------------------------------------------------
# The library's loaders


def _settings() -> TrainSettings:
    return TrainSettings(max_steps=1, batch_size=2, seq_len=8)


LOADERS = {
    "load_for_inference": lambda folder, trust, tmp: load_for_inference(
        folder, compile=False, trust_remote_code=trust
    ),
    "load_causal_lm": lambda folder, trust, tmp: load_causal_lm(folder, trust_remote_code=trust),
    "finetune_classifier": lambda folder, trust, tmp: finetune_classifier(
        folder, None, (["a"], [0]), (["b"], [1]), ["x", "y"], _settings(), tmp / "out", trust_remote_code=trust
    ),
    "train_seq2seq": lambda folder, trust, tmp: train_seq2seq(
        folder, None, (["a"], ["b"]), (["c"], ["d"]), _settings(), tmp / "out", trust_remote_code=trust
    ),
    "seq2seq_from_causal_lm": lambda folder, trust, tmp: seq2seq_from_causal_lm(folder, trust_remote_code=trust),
    "calibrate": lambda folder, trust, tmp: calibrate(folder, tmp / "out", "rtn", trust_remote_code=trust),
    "load_tokenizer": lambda folder, trust, tmp: load_tokenizer(folder, trust_remote_code=trust),
}
# What each loader's consent runs: the config's code, the tokenizer's, the model's (whose module then stops the load).
CONSENTED = {
    "calibrate": ({"remote_config"}, ValueError, "calibrate takes an hf_tfm causal LM"),  # refused after the config
    "load_tokenizer": ({"remote_config", "remote_tokenizer"}, None, None),  # the folder's own tokenizer class loads
}
MODEL_CONSENT = ({"remote_config", "remote_model"}, RuntimeError, MODEL_STOPS)


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_loader_refuses_a_folders_code_without_consent(loader, remote, tmp_path):
    folder, markers = remote
    with pytest.raises(ValueError, match=r"(?s)contains custom code.*trust_remote_code=True"):  # transformers' own
        LOADERS[loader](folder, False, tmp_path)
    assert ran(markers) == set()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_loader_runs_a_folders_code_with_consent(loader, remote, tmp_path):
    folder, markers = remote
    modules, error, message = CONSENTED.get(loader, MODEL_CONSENT)
    if error is None:
        assert type(LOADERS[loader](folder, True, tmp_path)).__name__ == "RemoteTokenizer"
    else:
        with pytest.raises(error, match=message):
            LOADERS[loader](folder, True, tmp_path)
    assert ran(markers) == modules


# ---------------------------------------------------------------------------------------------------------------------
# The commands


def commands(folder: Path, data: dict[str, Path], out: Path) -> dict[str, list[str]]:
    """Each `hf-tfm` command that loads a model folder, pointed at `folder`."""
    training = ["--output-dir", str(out), "--max-steps", "1", "--batch-size", "2", "--seq-len", "8"]
    pairs = ["--train-file", str(data["pairs"])]
    return {
        "generate": ["generate", str(folder), "--prompt", "a b", "--max-new-tokens", "2"],
        "classify": ["classify", str(folder), "a b"],
        "pretrain": ["pretrain", "--train-file", str(data["texts"]), "--model", str(folder), *training],
        "finetune": ["finetune", "--train-file", str(data["labelled"]), "--model", str(folder), *training],
        "pretrain-seq2seq": ["pretrain", "--task", "seq2seq", *pairs, "--model", str(folder), *training],
        "finetune-seq2seq": ["finetune", "--task", "seq2seq", *pairs, "--model", str(folder), *training],
        "calibrate": ["calibrate", str(folder), str(out), "--method", "rtn"],
    }


# The folder's modules each command's consent runs: the tokenizer first, then the model (whose module stops it); the
# seq2seq tasks read the config first and refuse a model that is neither an encoder-decoder nor an hf_tfm causal LM.
COMMAND_CONSENT = {
    "generate": {"remote_config", "remote_tokenizer", "remote_model"},
    "classify": {"remote_config", "remote_tokenizer", "remote_model"},
    "pretrain": {"remote_config", "remote_tokenizer", "remote_model"},
    "finetune": {"remote_config", "remote_tokenizer", "remote_model"},
    "pretrain-seq2seq": {"remote_config"},
    "finetune-seq2seq": {"remote_config"},
    "calibrate": {"remote_config"},
}


@pytest.mark.parametrize("command", sorted(COMMAND_CONSENT))
def test_command_refuses_a_folders_code_without_consent(command, remote, data, tmp_path, capsys):
    folder, markers = remote
    assert main(commands(folder, data, tmp_path / "out")[command]) == 1
    err = capsys.readouterr().err
    assert "contains custom code" in err and "trust_remote_code=True" in err, err  # transformers' words
    assert "add --trust-remote-code" in err
    assert ran(markers) == set() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", sorted(COMMAND_CONSENT))
def test_command_runs_a_folders_code_with_consent(command, remote, data, tmp_path, capsys):
    folder, markers = remote
    assert main([*commands(folder, data, tmp_path / "out")[command], "--trust-remote-code"]) == 1
    err = capsys.readouterr().err
    assert "contains custom code" not in err, err
    assert ran(markers) == COMMAND_CONSENT[command]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["convert", "export", "info"])
def test_commands_on_installed_code_never_run_a_folders(command, remote, tmp_path, capsys):
    """convert, export and info work on hf_tfm's and transformers' installed classes: no flag, and a folder that only
    its own code loads is refused (convert and export with transformers' error, which would otherwise prompt)."""
    if command == "convert":
        pytest.importorskip("hf_tfm.convert")
    folder, markers = remote
    argv = {"convert": [str(folder), str(tmp_path / "out")], "export": [str(folder), str(tmp_path / "out.gguf")]}
    assert main([command, *argv.get(command, [str(folder)])]) == 1
    err = capsys.readouterr().err
    if command == "info":
        assert "model_type 'remote_only' is not 'hf_tfm'" in err, err
    else:
        assert "trust_remote_code=True" in err and "runs only installed code" in err, err
    assert ran(markers) == set()
    with pytest.raises(SystemExit):  # and there is no flag to give it
        main([command, *argv.get(command, [str(folder)]), "--trust-remote-code"])


@pytest.fixture
def served(monkeypatch) -> list[list[str]]:
    """The server command `hf-tfm serve` would start (vLLM's, or transformers serve's argv), recorded instead."""
    import importlib.util

    from transformers.cli import transformers as transformers_cli

    started: list[list[str]] = []
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: name == "vllm" or find_spec(name, *a))

    def execv(path: str, argv: list[str]) -> None:  # the server would replace this process: nothing runs after it
        started.append(list(argv))
        raise SystemExit(0)

    monkeypatch.setattr("os.execv", execv)
    monkeypatch.setattr(transformers_cli, "main", lambda: started.append(list(sys.argv)) or 0)
    monkeypatch.setattr("hf_tfm.commands.serve._name_classes_in_transformers", lambda: None)
    monkeypatch.setenv(SERVE_NAMES_ENV, "0")  # restored after the test: serve sets it for its own processes
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return started


def test_serve_passes_the_flag_to_the_engine_only_when_given(served, tmp_path, capsys):
    build(TfmForCausalLM, tiny_config()).save_pretrained(tmp_path / "lm")
    lm = str(tmp_path / "lm")
    # transformers serve runs in a process where hf_tfm is imported: its classes load the folder, no flag needed
    assert main(["serve", lm, "--engine", "transformers"]) == 0
    assert main(["serve", lm, "--engine", "transformers", "--trust-remote-code"]) == 0
    assert "--trust-remote-code" not in served[0] and "--trust-remote-code" in served[1]
    # vLLM never imports hf_tfm: an hf_tfm folder loads there from its own code, which needs the flag
    assert main(["serve", lm, "--engine", "vllm"]) == 1
    assert "pass --trust-remote-code to run that code" in capsys.readouterr().err and len(served) == 2
    with pytest.raises(SystemExit):
        main(["serve", lm, "--engine", "vllm", "--trust-remote-code"])
    assert served[2][served[2].index("--model") + 1] == lm and "--trust-remote-code" in served[2]


# ---------------------------------------------------------------------------------------------------------------------
# hf_tfm's own folders


@pytest.fixture
def own_folder(tmp_path) -> tuple[Path, Path]:
    """(folder, marker): an hf_tfm causal LM folder with a tokenizer, whose copy of modeling.py writes `marker` when
    it runs (it never should where hf_tfm is imported)."""
    folder, marker = tmp_path / "lm", tmp_path / "copied_code_ran"
    build(TfmForCausalLM, tiny_config()).save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 99)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    code = (folder / "modeling.py").read_text()
    (folder / "modeling.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n{code}")
    return folder, marker


def test_own_folder_loads_through_hf_tfms_classes_without_the_flag(own_folder, capsys):
    folder, marker = own_folder
    assert "auto_map" in json.loads((folder / "config.json").read_text())
    assert type(AutoConfig.from_pretrained(folder, trust_remote_code=False)) is hf_tfm.TfmConfig
    assert type(AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)) is TfmForCausalLM
    AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    assert type(load_for_inference(folder, compile=False)) is TfmForCausalLM
    assert type(load_causal_lm(folder)) is TfmForCausalLM
    assert main(["generate", str(folder), "--prompt", "w5 w6", "--max-new-tokens", "3", "--greedy"]) == 0
    assert capsys.readouterr().out.startswith("w5 w6")
    assert not marker.exists()


@pytest.mark.slow
def test_own_folder_needs_the_flag_where_hf_tfm_is_not_installed(own_folder, tmp_path):
    """In a fresh Python where hf_tfm cannot be imported the folder's own code is all there is: transformers refuses
    it without the flag and runs it with (the planted marker is written)."""
    folder, marker = own_folder
    stdout = run_without_hf_tfm(
        f"""
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(folder)!r})
        except ValueError as err:
            print("refused", "trust_remote_code=True" in str(err))
        import os
        print("marker", os.path.exists({str(marker)!r}))
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        print("loaded", type(model).__module__.startswith("transformers_modules."))
        """,
        tmp_path,
    )
    # after the consent prompt transformers printed on stdout (stdin is /dev/null: no answer, so it refused)
    assert stdout.split()[-6:] == ["refused", "True", "marker", "False", "loaded", "True"]
    assert marker.exists()
