"""The `hf-tfm` command: the demo end to end (once), bad input, the user-data subcommands, and push to a fake Hub.

The demo and push run as real subprocesses of the console script; everything else calls `hf_tfm.cli.main(argv)`
in-process (each subprocess costs ~5 s of imports). Bad-input tests need no training: they fail before it starts.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build, run_without_hf_tfm, tiny_config
from fake_hub import FakeHub
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from hf_tfm import TfmForCausalLM
from hf_tfm.cli import main
from hf_tfm.presets import load_config

SCRIPT = Path(sys.executable).with_name("hf-tfm")
TINY_TRAIN = ["--max-steps", "4", "--batch-size", "4", "--seq-len", "32", "--vocab-size", "300"]


def hf_tfm_command(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "hf_tfm.cli"]
    return subprocess.run(
        [*command, *args],
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def no_partial_dirs(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


# ---------------------------------------------------------------------------------------------------------------------
# The main job: `hf-tfm demo --quick`, run once for the module


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    result = hf_tfm_command("demo", "--quick", "--output-dir", str(out), timeout=600)
    assert result.returncode == 0, f"demo failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return out, result.stdout


@pytest.mark.slow
def test_demo_prints_summary(demo):
    out, stdout = demo
    summary = stdout[stdout.index("hf-tfm demo finished") :]
    for needle in ("model folder", str(out / "lm"), "perplexity", "sample generations", "test accuracy"):
        assert needle in summary
    assert "majority baseline" in summary and str(out / "loss_curves.png") in summary
    assert "seq2seq" in summary and "word F1" in summary and str(out / "seq2seq") in summary
    assert no_partial_dirs(out.parent)


@pytest.mark.slow
def test_demo_model_folder_is_push_ready(demo):
    lm = demo[0] / "lm"
    for name in ("model.safetensors", "config.json", "configuration.py", "modeling.py", "tokenizer.json"):
        assert (lm / name).is_file(), name
    assert (lm / "generation_config.json").is_file() and (lm / "README.md").is_file()
    config = json.loads((lm / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling.TfmForCausalLM"
    assert config["architectures"] == ["TfmForCausalLM"] and config["use_cache"] is True


@pytest.mark.slow
def test_demo_folders_load_without_hf_tfm(demo, tmp_path):
    out = demo[0]
    stdout = run_without_hf_tfm(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification
        from transformers import AutoTokenizer
        lm = AutoModelForCausalLM.from_pretrained({str(out / "lm")!r}, trust_remote_code=True)
        tok = AutoTokenizer.from_pretrained({str(out / "lm")!r}, trust_remote_code=True)
        ids = lm.generate(**tok("def ", return_tensors="pt"), max_new_tokens=8, do_sample=False)
        clf = AutoModelForSequenceClassification.from_pretrained({str(out / "classifier")!r}, trust_remote_code=True)
        logits = clf(**tok(["Return the event loop."], return_tensors="pt")).logits
        s2s = AutoModelForSeq2SeqLM.from_pretrained({str(out / "seq2seq")!r}, trust_remote_code=True)
        source = tok(["Return the event loop."], return_tensors="pt")
        named = s2s.generate(input_ids=source["input_ids"], attention_mask=source["attention_mask"])
        print(json.dumps({{"lm": type(lm).__module__, "new": ids.shape[1], "labels": logits.shape[-1],
                           "clf": type(clf).__module__, "s2s": type(s2s).__module__, "named": named.shape[1]}}))
        """,
        tmp_path,
    )
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["lm"].startswith("transformers_modules.") and report["clf"].startswith("transformers_modules.")
    assert report["s2s"].startswith("transformers_modules.") and report["named"] > 1
    assert report["new"] > 1 and report["labels"] >= 5


@pytest.mark.slow
def test_demo_adapter_names_its_real_base(demo):
    """The LoRA adapter points at the final lm/ (not the staging folder) and, loaded as its README says, equals
    the merged classifier."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = demo[0]
    adapter = out / "classifier" / "adapter"
    base_path = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_path == str(out / "lm")
    assert "is_causal=False" in (adapter / "README.md").read_text()
    labels = len(json.loads((out / "classifier" / "config.json").read_text())["id2label"])
    base = AutoModelForSequenceClassification.from_pretrained(
        base_path, trust_remote_code=True, num_labels=labels, is_causal=False, classifier_pooling="mean"
    )
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    merged = AutoModelForSequenceClassification.from_pretrained(out / "classifier").eval()
    enc = AutoTokenizer.from_pretrained(out / "classifier")(
        ["Return the event loop.", "Open a file"], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(**enc).logits, merged(**enc).logits, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_demo_metrics_beat_baseline(demo):
    metrics = json.loads((demo[0] / "metrics.json").read_text())
    assert metrics["kind"] == "hf-tfm demo" and metrics["profile"] == "quick"
    clf = metrics["classifier"]
    assert len(clf["labels"]) >= 5
    assert clf["test_accuracy"] > clf["baseline_accuracy"] + 0.05, clf
    assert 1.0 < metrics["lm"]["perplexity"] < metrics["lm"]["parameters"]
    assert metrics["lm"]["history"]["eval"][-1][1] < metrics["lm"]["history"]["eval"][0][1]  # it learned
    assert metrics["reloaded_class"].startswith("transformers_modules.")
    assert len(metrics["generations"]) == 4
    assert metrics["lm"]["eval_loss"] < metrics["lm"]["baseline_loss"]  # the unigram model's
    assert clf["test_loss"] < clf["baseline_loss"]  # the class frequencies
    s2s = metrics["seq2seq"]  # every stage beats its baseline, the quick profile's too
    assert s2s["exact_match"] > s2s["baseline_exact_match"] and s2s["word_f1"] > s2s["baseline_word_f1"], s2s
    assert s2s["eval_loss"] < s2s["baseline_loss"] and s2s["baseline_target"].strip()
    assert s2s["history"]["eval"][-1][1] < s2s["history"]["eval"][0][1]  # it learned
    assert s2s["test_examples"] > 100 and len(s2s["examples"]) == 8


@pytest.mark.slow
def test_demo_plot_is_a_png(demo):
    import matplotlib.image

    plot = demo[0] / "loss_curves.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 1000
    image = matplotlib.image.imread(plot)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.slow
def test_demo_model_cards_name_metrics(demo):
    lm_card = (demo[0] / "lm" / "README.md").read_text()
    assert lm_card.startswith("---\nlibrary_name: transformers")
    for needle in ("## Architecture", "## Data", "## Training settings", "perplexity", "held-out loss"):
        assert needle in lm_card
    clf_card = (demo[0] / "classifier" / "README.md").read_text()
    assert "test accuracy" in clf_card and "majority-class baseline accuracy" in clf_card
    assert (demo[0] / "classifier" / "adapter" / "adapter_config.json").is_file()
    s2s_card = (demo[0] / "seq2seq" / "README.md").read_text()
    assert "encoder-decoder" in s2s_card and "AutoModelForSeq2SeqLM" in s2s_card and "word F1" in s2s_card


def test_demo_baselines_count_no_padding():
    """A baseline is computed on the texts' own tokens, whatever padding an earlier call left on the tokenizer."""
    from hf_tfm.commands.demo import _token_ids, unigram_loss
    from hf_tfm.tokenization import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer([f"open file {i}" for i in range(50)], vocab_size=300)
    texts = [" open", " read file name now"]
    plain = _token_ids(tokenizer, texts, special=False, max_len=32)  # none cut
    assert plain == [[*tokenizer(t, add_special_tokens=False).input_ids, tokenizer.eos_token_id] for t in texts]
    tokenizer(texts, padding=True, truncation=True, max_length=3)  # as a batch for generation leaves the backend
    assert _token_ids(tokenizer, texts, special=False, max_len=32) == plain
    assert unigram_loss(plain, plain, len(tokenizer)) > 0


def test_demo_refuses_a_foreign_output_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["demo", "--quick", "--output-dir", str(tmp_path)]) == 1
    assert "already holds another model" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["config.json"] and no_partial_dirs(tmp_path.parent)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: clear message, exit status 1, no folder that looks complete


@pytest.fixture
def files(tmp_path):
    rows = [{"text": f"the cat number {i} sat on the mat", "label": "cats"} for i in range(12)]
    rows += [{"text": f"stock {i} fell on the market today", "label": "money"} for i in range(12)]
    (tmp_path / "good.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "data.xml").write_text("<a/>")
    (tmp_path / "one_class.csv").write_text("text,label\nhello there,a\ngood bye,a\n")
    (tmp_path / "no_label.csv").write_text("text,tag\nhello there,a\ngood bye,b\n")
    (tmp_path / "other.jsonl").write_text(json.dumps({"text": "x", "label": "unseen"}))
    (tmp_path / "pairs.jsonl").write_text(
        "\n".join(json.dumps({"en": f"cat {i}", "de": f"Katze {i}"}) for i in range(9))
    )
    no_eos = Tokenizer(models.WordLevel({"<s>": 0, "<unk>": 1, "cat": 2}, unk_token="<unk>"))
    no_eos.add_special_tokens(["<s>", "<unk>"])
    no_eos.save(str(tmp_path / "no_eos.json"))
    return tmp_path


BAD_INPUTS = [
    (["pretrain", "--train-file", "missing.txt"], "no such file"),
    (["pretrain", "--train-file", "empty.txt"], "the file is empty"),
    (["pretrain", "--train-file", "blank.jsonl"], "the file is empty"),
    (["pretrain", "--train-file", "data.xml"], "unknown format '.xml'"),
    (["pretrain", "--train-file", "good.jsonl", "--text-column", "body"], "no text column 'body'"),
    (["finetune", "--train-file", "no_label.csv"], "no label column 'label'"),
    (["finetune", "--train-file", "one_class.csv"], "single class 'a'"),
    (["finetune", "--train-file", "good.jsonl", "--eval-file", "other.jsonl"], "do not occur in the training file"),
    (["finetune", "--train-file", "empty.txt"], "the file is empty"),
    (["pretrain", "--train-file", "good.jsonl", "--config", "no-such-preset"], "unknown config 'no-such-preset'"),
    (["pretrain", "--train-file", "good.jsonl", "--config", "tiny-encoder"], "pretrain needs a decoder"),
    (["pretrain", "--train-file", "good.jsonl", "--seq-len", "4096", "--vocab-size", "300"], "shorter than one block"),
    (["generate", "nowhere", "--prompt", "x"], "no such model folder"),
    (["classify", "nowhere", "hi"], "no such model folder"),
    (["push", "nowhere", "--repo-id", "a/b"], "no such model folder"),
    (["info", "nowhere"], "neither a preset"),
    (
        ["pretrain", "--train-file", "good.jsonl", "--tokenizer", "nowhere"],
        "no such tokenizer folder or tokenizer.json",
    ),
    (["pretrain", "--train-file", "good.jsonl", "--tokenizer", "."], "holds no tokenizer"),
    (["pretrain", "--train-file", "good.jsonl", "--tokenizer", "other.jsonl"], "is not a tokenizer.json file"),
    (["pretrain", "--train-file", "good.jsonl", "--tokenizer", "no_eos.json"], "has no eos token, which --task"),
    (["pretrain", "--train-file", "good.jsonl", "--tokenizer", "no_eos.json", "--model", "m"], "is for a new model"),
    (
        ["pretrain", "--train-file", "good.jsonl", "--tokenizer", "no_eos.json", "--vocab-size", "300"],
        "brings its own",
    ),
    (
        [
            "pretrain",
            "--task",
            "seq2seq",
            "--train-file",
            "pairs.jsonl",
            "--source-column",
            "en",
            "--target-column",
            "de",
            "--tokenizer",
            "no_eos.json",
        ],
        "has no eos token, which --task seq2seq needs",
    ),
    (["pretrain", "--task", "seq2seq", "--train-file", "pairs.jsonl"], "no source column 'source'"),
    (["pretrain", "--task", "seq2seq", "--train-file", "empty.txt"], "the file is empty"),
    (["finetune", "--task", "seq2seq", "--train-file", "good.jsonl", "--source-column", "text"], "no target column"),
    (["pretrain", "--task", "seq2seq", "--train-file", "pairs.jsonl", "--text-column", "en"], "not --text-column"),
    (["pretrain", "--train-file", "good.jsonl", "--source-column", "en"], "--source-column is for --task seq2seq"),
    (["finetune", "--train-file", "good.jsonl", "--max-target-len", "8"], "--max-target-len is for --task seq2seq"),
    (
        [
            "pretrain",
            "--task",
            "seq2seq",
            "--train-file",
            "pairs.jsonl",
            "--source-column",
            "en",
            "--target-column",
            "de",
            "--config",
            "tiny-decoder",
            "--vocab-size",
            "300",
        ],
        "--config tiny-decoder is not an encoder-decoder config",
    ),
    (
        ["pretrain", "--train-file", "good.jsonl", "--config", "tiny-seq2seq", "--vocab-size", "300"],
        "--config tiny-seq2seq is not an encoder or a decoder config",
    ),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS, ids=[" ".join(a[:3]) for a, _ in BAD_INPUTS])
def test_bad_input_exits_nonzero_with_message(files, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(files)
    before = set(os.listdir(files))
    needs_output = argv[0] in ("pretrain", "finetune")
    status = main(argv + (["--output-dir", "out", *TINY_TRAIN[:2]] if needs_output else []))
    err = capsys.readouterr().err
    assert status == 1
    assert message in err and err.startswith(f"hf-tfm {argv[0]}: error:"), err
    assert set(os.listdir(files)) == before  # no output folder, no half-written temp folder


@pytest.mark.parametrize("marker", ["config.json", "adapter_config.json", "notes.txt"])
def test_output_dir_with_content_is_refused_unless_overwrite(files, capsys, monkeypatch, marker):
    monkeypatch.chdir(files)
    (files / "out").mkdir()
    (files / "out" / marker).write_text("{}")
    status = main(["finetune", "--train-file", "good.jsonl", "--output-dir", "out", *TINY_TRAIN])
    assert status == 1 and "pass --overwrite" in capsys.readouterr().err
    assert os.listdir(files / "out") == [marker]


def test_missing_required_argument_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["pretrain"])
    assert exit_info.value.code == 2 and "--train-file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# pretrain / finetune / generate / classify / info / convert on small user files


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    """A tiny causal LM pretrained from a .txt file, and a classifier fine-tuned from it with LoRA on a .csv."""
    root = tmp_path_factory.mktemp("user")
    lines = [f"def function_{i}(x):\n    return x + {i}" for i in range(60)] + ["the end of the file"] * 5
    (root / "train.txt").write_text("\n".join(lines))
    csv = ["text,topic"] + [f"the cat {i} sat on the warm mat,cats" for i in range(20)]
    csv += [f"shares of company {i} fell on the market,money" for i in range(20)]
    (root / "labelled.csv").write_text("\n".join(csv))
    lm, clf = root / "lm", root / "clf"
    assert main(["pretrain", "--train-file", str(root / "train.txt"), "--output-dir", str(lm), *TINY_TRAIN]) == 0
    argv = ["finetune", "--train-file", str(root / "labelled.csv"), "--label-column", "topic", "--model", str(lm)]
    assert main([*argv, "--output-dir", str(clf), "--max-steps", "30", "--batch-size", "8", "--lr", "1e-2"]) == 0
    return root, lm, clf


def test_pretrain_writes_a_complete_folder(user_models):
    _, lm, _ = user_models
    names = set(os.listdir(lm))
    assert {"config.json", "model.safetensors", "modeling.py", "tokenizer.json", "README.md", "metrics.json"} <= names
    metrics = json.loads((lm / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["perplexity"] > 1
    assert "perplexity" in (lm / "README.md").read_text()
    assert no_partial_dirs(lm.parent)


def test_pretrain_continues_from_a_checkpoint_on_jsonl(user_models, capsys):
    root, lm, _ = user_models
    (root / "more.jsonl").write_text("\n".join(json.dumps({"body": f"def g_{i}(): return {i}"}) for i in range(40)))
    out = root / "lm2"
    argv = ["pretrain", "--train-file", str(root / "more.jsonl"), "--text-column", "body", "--model", str(lm)]
    assert main([*argv, "--output-dir", str(out), "--max-steps", "2", "--seq-len", "16", "--batch-size", "4"]) == 0
    assert json.loads((out / "tokenizer.json").read_text()) == json.loads((lm / "tokenizer.json").read_text())
    # and --overwrite replaces it
    assert main([*argv, "--output-dir", str(out), "--max-steps", "1", "--seq-len", "16", "--overwrite"]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 1


def stdlib_tokenizer(specials: list[str], first: str | None = None) -> Tokenizer:
    """A byte-level BPE of 300 tokens trained on a few standard-library files, with `specials` added after the
    vocabulary (ids 300, 301, ...: none where TfmConfig's defaults put pad, bos and eos); `first` starts each text."""
    from hf_tfm.data import stdlib_files

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([f.text for f in stdlib_files(100_000, max_file_chars=10_000)], trainer)
    tokenizer.add_special_tokens(specials)
    if first is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{first} $A", special_tokens=[(first, tokenizer.token_to_id(first))]
        )
    return tokenizer


# A folder: its tokenizer_config.json names the roles, whatever the tokens are called. A bare tokenizer.json file: the
# roles go by the tokens' usual names, and one it lacks (pad here) is None in the config too.
GIVEN_TOKENIZERS = {
    "folder": (["<|start|>", "<|end|>", "<|pad|>"], {"bos": "<|start|>", "eos": "<|end|>", "pad": "<|pad|>"}),
    "tokenizer.json": (["</s>", "<s>"], {"bos": "<s>", "eos": "</s>", "pad": None}),
}


@pytest.mark.parametrize("kind", sorted(GIVEN_TOKENIZERS))
def test_pretrain_on_a_given_tokenizer(user_models, tmp_path, capsys, kind):
    """`--tokenizer`: the new model's vocabulary and special ids follow the given tokenizer, the folder carries that
    tokenizer (the same ids on a text), and the model generates with it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    root = user_models[0]
    specials, roles = GIVEN_TOKENIZERS[kind]
    backend = stdlib_tokenizer(specials, first=roles["bos"])
    ids = {role: None if token is None else backend.token_to_id(token) for role, token in roles.items()}
    assert min(i for i in ids.values() if i is not None) >= 300  # not TfmConfig's default ids
    if kind == "folder":
        given = tmp_path / "tokenizer"
        named = {f"{role}_token": token for role, token in roles.items()}
        PreTrainedTokenizerFast(tokenizer_object=backend, **named).save_pretrained(given)
    else:
        given = tmp_path / "tokenizer.json"
        backend.save(str(given))
    out = tmp_path / "lm"
    argv = ["pretrain", "--train-file", str(root / "train.txt"), "--tokenizer", str(given), "--output-dir", str(out)]
    assert main([*argv, "--max-steps", "2", "--batch-size", "4", "--seq-len", "32"]) == 0
    capsys.readouterr()

    saved = AutoTokenizer.from_pretrained(out)
    text = "def read_config(path):\n    return open(path).read()  # ünïcode"
    assert saved(text)["input_ids"] == backend.encode(text).ids and saved(text)["input_ids"][0] == ids["bos"]
    assert len(saved) == backend.get_vocab_size() == 300 + len(specials)
    assert (saved.bos_token_id, saved.eos_token_id, saved.pad_token_id) == (ids["bos"], ids["eos"], ids["pad"])
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 300 + len(specials)
    assert {role: config[f"{role}_token_id"] for role in ids} == ids
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (ids["bos"], ids["eos"])
    assert f"tokenizer `{given}`" in (out / "README.md").read_text()

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = saved("def ", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    new = output[0, prompt["input_ids"].shape[1] :]
    assert len(new) == 6 and int(new.max()) < config["vocab_size"]
    assert main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "6", "--greedy", "--no-stream"]) == 0
    assert capsys.readouterr().out == "def " + saved.decode(new, skip_special_tokens=True) + "\n"  # the same tokens


def test_pretrain_seq2seq_on_a_given_tokenizer(tmp_path):
    """`--task seq2seq --tokenizer`: both sides sized to the tokenizer, its ids the config's, its bos the decoder's
    first token."""
    from transformers import PreTrainedTokenizerFast

    roles = {"bos_token": "<|start|>", "eos_token": "<|end|>", "pad_token": "<|pad|>"}
    backend = stdlib_tokenizer(list(roles.values()))
    PreTrainedTokenizerFast(tokenizer_object=backend, **roles).save_pretrained(tmp_path / "tokenizer")
    pairs = [{"source": f"Return the item number {i}.", "target": f"get item {i}"} for i in range(20)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs))
    argv = ["pretrain", "--task", "seq2seq", "--train-file", str(tmp_path / "pairs.jsonl")]
    argv += ["--tokenizer", str(tmp_path / "tokenizer"), "--output-dir", str(tmp_path / "s2s"), *TINY_TRAIN[:6]]
    assert main(argv) == 0
    config = json.loads((tmp_path / "s2s" / "config.json").read_text())
    ids = {role: backend.token_to_id(token) for role, token in roles.items()}
    assert config["decoder_start_token_id"] == ids["bos_token"] == 300
    for side in (config, config["encoder"], config["decoder"]):
        assert {role: side[f"{role}_id"] for role in roles} == ids
    assert config["encoder"]["vocab_size"] == config["decoder"]["vocab_size"] == 303


def test_finetune_with_lora_saves_merged_model_and_adapter(user_models):
    _, _, clf = user_models
    config = json.loads((clf / "config.json").read_text())
    assert config["id2label"] == {"0": "cats", "1": "money"}
    assert (clf / "adapter" / "adapter_config.json").is_file() and (
        clf / "adapter" / "adapter_model.safetensors"
    ).is_file()
    metrics = json.loads((clf / "metrics.json").read_text())
    assert metrics["lora"] is True and metrics["trainable_parameters"] < metrics["parameters"]
    assert metrics["test_accuracy"] >= metrics["baseline_accuracy"]


def test_finetune_from_scratch_with_a_preset(user_models):
    root, _, _ = user_models
    out = root / "scratch-clf"
    argv = [
        "finetune",
        "--train-file",
        str(root / "labelled.csv"),
        "--label-column",
        "topic",
        "--config",
        "tiny-encoder",
    ]
    assert main([*argv, "--output-dir", str(out), *TINY_TRAIN]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["lora"] is False and metrics["trainable_parameters"] == metrics["parameters"]
    # Training at --seq-len 32 must not shrink the preset's position range (learned positions would refuse more).
    saved = json.loads((out / "config.json").read_text())["max_position_embeddings"]
    assert saved == load_config("tiny-encoder").max_position_embeddings


def test_generate_streams_text(user_models, capsys):
    _, lm, _ = user_models
    assert main(["generate", str(lm), "--prompt", "def ", "--max-new-tokens", "6", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    greedy = ["generate", str(lm), "--prompt", "def ", "--max-new-tokens", "6", "--greedy", "--no-stream"]
    assert main(greedy) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ")
    assert main([*greedy, "--compile"]) == 0  # a static cache and a compiled step: the same tokens
    assert capsys.readouterr().out == text


def test_classify_texts_and_file(user_models, capsys):
    root, _, clf = user_models
    (root / "to_classify.txt").write_text("the cat 99 sat on the warm mat\nshares of company 99 fell on the market\n")
    argv = ["classify", str(clf), "a cat on a mat", "--file", str(root / "to_classify.txt"), "--json", "--top-k", "2"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and all(r["label"] in ("cats", "money") and 0 <= r["score"] <= 1 for r in rows)
    assert [r["label"] for r in rows[1:]] == ["cats", "money"]
    assert len(rows[0]["top"]) == 2


def test_info_on_preset_and_folder(user_models, capsys):
    _, lm, _ = user_models
    assert main(["info", "bert-style", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "encoder" and report["parameters"] > 80_000_000
    assert report["integrations"]["cache types"]["static"][0] is False  # and it says why
    assert "encoder" in report["integrations"]["cache types"]["static"][1]
    assert main(["info", str(lm)]) == 0
    text = capsys.readouterr().out
    assert "attention backends" in text and "sdpa" in text and "flash_attention_2" in text
    assert "export to in-tree transformers" in text


@pytest.fixture(scope="module")
def seq2seq_models(tmp_path_factory):
    """A tiny encoder-decoder pretrained on .jsonl pairs, and a LoRA fine-tune of it on .csv pairs."""
    root = tmp_path_factory.mktemp("s2s")
    pairs = [{"doc": f"Return the item number {i}.", "name": f"get item {i}"} for i in range(40)]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs))
    (root / "pairs.csv").write_text("\n".join(["doc,name", *(f"Close file {i},close {i}" for i in range(30))]))
    columns = ["--source-column", "doc", "--target-column", "name"]
    s2s, tuned = root / "s2s", root / "tuned"
    argv = ["pretrain", "--task", "seq2seq", "--train-file", str(root / "pairs.jsonl"), *columns]
    assert main([*argv, "--output-dir", str(s2s), *TINY_TRAIN]) == 0
    argv = ["finetune", "--task", "seq2seq", "--train-file", str(root / "pairs.csv"), *columns, "--model", str(s2s)]
    assert main([*argv, "--output-dir", str(tuned), "--max-steps", "3", "--max-target-len", "8"]) == 0
    return root, s2s, tuned


def test_seq2seq_pretrain_and_finetune_write_complete_folders(seq2seq_models):
    _, s2s, tuned = seq2seq_models
    for folder in (s2s, tuned):
        names = set(os.listdir(folder))
        assert {
            "config.json",
            "model.safetensors",
            "modeling.py",
            "tokenizer.json",
            "README.md",
            "metrics.json",
        } <= names
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == "hf_tfm_seq2seq" and config["architectures"] == ["TfmForConditionalGeneration"]
        metrics = json.loads((folder / "metrics.json").read_text())
        assert {"eval_loss", "exact_match", "word_f1", "baseline_exact_match", "baseline_word_f1"} <= set(metrics)
        assert "word F1" in (folder / "README.md").read_text()
    metrics = json.loads((tuned / "metrics.json").read_text())
    assert metrics["lora"] is True and metrics["steps"] == 3 and (tuned / "adapter" / "adapter_config.json").is_file()
    vocabulary = [json.loads((folder / "tokenizer.json").read_text())["model"] for folder in (s2s, tuned)]
    assert vocabulary[0] == vocabulary[1]  # the checkpoint's tokenizer, reused


def test_seq2seq_generate_and_info(seq2seq_models, capsys, user_models):
    _, s2s, _ = seq2seq_models
    assert main(["generate", str(s2s), "--prompt", "Return the item number 3.", "--greedy", "--no-stream"]) == 0
    assert capsys.readouterr().out.strip() != "Return the item number 3."  # the decoder's text, not the prompt's
    assert main(["info", str(s2s), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "encoder-decoder" and report["architecture"] == "TfmForConditionalGeneration"
    assert set(report["integrations"]["export to in-tree transformers"]) == {"bart", "mbart", "marian"}
    assert report["integrations"]["serving"]["vLLM (CPU)"][0] is False
    root, lm, clf = user_models
    argv = ["finetune", "--task", "seq2seq", "--train-file", str(seq2seq_models[0] / "pairs.csv")]
    argv += ["--source-column", "doc", "--target-column", "name", *TINY_TRAIN[:2]]
    assert main([*argv, "--model", str(clf), "--output-dir", str(root / "x")]) == 1
    assert "neither an encoder-decoder nor an hf_tfm causal LM" in capsys.readouterr().err
    assert main([*argv, "--model", str(lm), "--lora", "--output-dir", str(root / "x")]) == 1
    assert "new cross-attention must train in full" in capsys.readouterr().err
    # A causal LM warm-starts both sides (seq2seq_from_causal_lm), trained in full
    assert main([*argv, "--model", str(lm), "--output-dir", str(root / "from-lm")]) == 0
    metrics = json.loads((root / "from-lm" / "metrics.json").read_text())
    assert (
        metrics["lora"] is False and "Warm-started from the causal LM" in (root / "from-lm" / "README.md").read_text()
    )


def test_convert_exports_a_trained_folder_to_llama(user_models, capsys):
    pytest.importorskip("hf_tfm.convert")
    root, lm, _ = user_models
    assert main(["convert", str(lm), str(root / "llama")]) == 0
    assert json.loads((root / "llama" / "config.json").read_text())["model_type"] == "llama"
    assert (root / "llama" / "tokenizer.json").is_file() and no_partial_dirs(root)


def test_convert_overwrite_replaces_the_folder_all_at_once(tmp_path, monkeypatch, capsys):
    """`--overwrite` onto a previous output: a run that fails while writing the weights leaves the old folder as it
    was; a completed one replaces it whole (what --overwrite promises: the old folder's other files go too)."""
    pytest.importorskip("hf_tfm.convert")
    from transformers import modeling_utils

    for seed in (0, 1):
        build(TfmForCausalLM, tiny_config(), seed=seed).save_pretrained(tmp_path / f"src{seed}")
    dst, fresh = tmp_path / "llama", tmp_path / "fresh"
    assert main(["convert", str(tmp_path / "src0"), str(dst)]) == 0
    (dst / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in dst.iterdir()}

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(modeling_utils, "safe_save_file", no_space)
        assert main(["convert", str(tmp_path / "src1"), str(dst), "--overwrite"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before and no_partial_dirs(tmp_path)

    assert main(["convert", str(tmp_path / "src1"), str(dst), "--overwrite"]) == 0
    assert main(["convert", str(tmp_path / "src1"), str(fresh)]) == 0
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == {p.name: p.read_bytes() for p in fresh.iterdir()}
    assert no_partial_dirs(tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# push, against a fake Hub on loopback


@pytest.fixture
def fake_hub():
    hub = FakeHub().start()
    yield hub
    hub.stop()


@pytest.mark.slow
def test_push_then_load_from_hub_without_hf_tfm(user_models, fake_hub, tmp_path):
    _, lm, _ = user_models
    env = {
        "HF_ENDPOINT": fake_hub.endpoint,
        "HF_TOKEN": "hf_fake",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
    }
    result = hf_tfm_command("push", str(lm), "--repo-id", "fake-user/tiny-lm", env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    pushed = fake_hub.files("fake-user/tiny-lm")
    assert {
        "config.json",
        "model.safetensors",
        "modeling.py",
        "configuration.py",
        "tokenizer.json",
        "README.md",
    } <= set(pushed)
    assert pushed["model.safetensors"] == (lm / "model.safetensors").read_bytes()

    code = """
        import sys; sys.modules["hf_tfm"] = None
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained("fake-user/tiny-lm", trust_remote_code=True)
        tok = AutoTokenizer.from_pretrained("fake-user/tiny-lm", trust_remote_code=True)
        out = model.generate(**tok("def ", return_tensors="pt"), max_new_tokens=4, do_sample=False)
        print(type(model).__module__, out.shape[1])
    """
    loaded = subprocess.run(
        [sys.executable, "-c", __import__("textwrap").dedent(code)],
        env={**os.environ, **env, "HF_HOME": str(tmp_path / "hf2"), "HF_MODULES_CACHE": str(tmp_path / "mods")},
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    module, length = loaded.stdout.split()
    assert module.startswith("transformers_modules.fake_hyphen_user.tiny_hyphen_lm.") and int(length) > 2


@pytest.mark.slow
def test_push_reports_hub_errors(tmp_path, user_models):
    _, lm, _ = user_models
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_fake", "HF_HOME": str(tmp_path / "hf")}
    result = hf_tfm_command("push", str(lm), "--repo-id", "fake-user/x", env=env, timeout=120)
    assert result.returncode == 1 and "upload to fake-user/x failed" in result.stderr
