"""DeepSpeed ZeRO on 2 CPU ranks (gloo, `DS_ACCELERATOR=cpu`), with the in-tree copy as the oracle.

Every model kind (dense causal LM tied and untied, MoE causal LM, encoder classifier with LoRA, seq2seq) trains under
`Trainer(deepspeed=...)` beside its in-tree copy (Llama, Mixtral, BERT, BART on the same weights, `hf_tfm.to_hf`), each
ZeRO config in turn in one launch (tests/dist/train_deepspeed.py); the tests read each config's record. The configs
are the shipped ones (examples/deepspeed/), so they cannot rot.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, doc_blocks, free_port

pytest.importorskip("deepspeed", reason="the `deepspeed` extra is not installed (`make env` installs it)")

import transformers
from safetensors import safe_open

sys.path.insert(0, str(ROOT / "tests" / "dist"))
from common import save_pair, single_process_reference
from train_deepspeed import TASKS, with_lora

DIST = ROOT / "tests" / "dist"
CONFIGS = ROOT / "examples" / "deepspeed"
BIN = Path(sys.executable).parent
RTOL = 1e-5  # float32 on both sides; what differs is the order of a few reductions
STEPS = 3
PROBE = [[5, 17, 42, 8, 91, 33, 3, 60]]

pytestmark = [pytest.mark.slow, pytest.mark.solo]

SIZES = {"vocab_size": 99, "num_attention_heads": 4, "max_position_embeddings": 64, "pad_token_id": 0}
LLAMA = {**SIZES, "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 48, "num_key_value_heads": 2}
# Each kind: the in-tree class and config that seed it, its task, and the LoRA targets (hf_tfm's, the copy's).
KINDS = {
    "dense-tied": ("LlamaForCausalLM", {**LLAMA, "tie_word_embeddings": True}, "causal_lm", None),
    "dense-untied": ("LlamaForCausalLM", {**LLAMA, "tie_word_embeddings": False}, "causal_lm", None),
    "moe": (
        "MixtralForCausalLM",
        {**LLAMA, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
        "causal_lm",
        None,
    ),
    "encoder-lora": (
        "BertForSequenceClassification",
        {
            **SIZES,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "intermediate_size": 48,
            "type_vocab_size": 2,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            "num_labels": 2,
        },
        "classifier",
        (["q_proj", "v_proj"], ["query", "value"]),
    ),
    "seq2seq": (
        "BartForConditionalGeneration",
        {
            **SIZES,
            "d_model": 32,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 48,
            "decoder_ffn_dim": 48,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "decoder_start_token_id": 2,
            "forced_eos_token_id": None,
        },
        "seq2seq",
        None,
    ),
}


# BART's `final_logits_bias` is a buffer, which it never trains; hf_tfm imports it as `lm_head.bias`, a parameter. The
# forward is the same, training is not: hf_tfm's is frozen where it trains beside the copy.
FROZEN = {"seq2seq": ["lm_head.bias"]}


def zero_config(name: str) -> dict:
    """A shipped config by file name; "zero2_offload" is ZeRO-2 with the optimizer on the CPU."""
    if name == "zero2_offload":
        config = zero_config("zero2")
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        return config | {"zero_force_ds_cpu_optimizer": False}
    return json.loads((CONFIGS / f"{name}.json").read_text())


def launch(command: list[str], timeout: float = 600.0, env: dict | None = None) -> str:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
        **(env or {}),
    }
    result = subprocess.run(
        command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )
    return result.stdout


def torchrun(*args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--nproc_per_node", "2", "--standalone", *args]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, dict]:
    """Each kind saved twice: as hf_tfm (`from_hf` of a seeded in-tree model) and as its in-tree copy (`to_hf`)."""
    root = tmp_path_factory.mktemp("models")
    found = {}
    for name, (class_name, config, task, lora) in KINDS.items():
        save_pair(class_name, config, root / name)
        found[name] = {"task": task, "lora": lora, "root": root / name, "frozen_in_copy": FROZEN.get(name, [])}
    return found


# In-tree BERT's and BART's forwards take **kwargs, so Trainer passes them the step's label count and multiplies
# their loss by the world size (`average_tokens_across_devices`, on by default), but their losses are plain means
# that ignore the count: on 2 ranks they log, and train on, twice the loss of one process. hf_tfm's heads equal one
# process (its classifier sets `accepts_loss_kwargs = False`, its seq2seq loss divides by the count). Their copies
# run where Trainer leaves their mean alone (the mean of the ranks' means), beside hf_tfm run so too.
UNSCALED = {"average_tokens_across_devices": False}


def concrete(config: dict) -> dict:
    """A Trainer config's "auto" values filled in as `Trainer` would for these runs (what `HfDeepSpeedConfig` alone,
    without `Trainer`, needs)."""
    fills = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    fills |= {"gradient_clipping": 1.0, "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    return config | fills


def plan_runs(models: dict, out: Path) -> list[dict]:
    """The launch's runs: every kind as hf_tfm and as its copy (and hf_tfm as the copy runs, where that differs)."""
    runs = []
    for kind, spec in models.items():
        sides = [("hf_tfm", "hf_tfm", {}), ("copy", "copy", {})]
        if spec["task"] != "causal_lm":
            sides[1:] = [("copy", "copy", UNSCALED), ("hf_tfm-unscaled", "hf_tfm", UNSCALED)]
        for label, side, args in sides:
            lora = spec["lora"][side == "copy"] if spec["lora"] else None
            run = {"name": f"{kind}/{label}", "folder": str(spec["root"] / side), "task": spec["task"], "lora": lora}
            if label == "hf_tfm-unscaled":
                run["freeze"] = spec["frozen_in_copy"]
            runs.append(run | {"args": args, "save": str(out / "saved" / kind / label)})
    return runs


# The configs in the order one launch trains them: ZeRO-2's first, so that they load and train as in a process of their
# own, before ZeRO-3 has partitioned models there (its `zero.Init` wraps their construction while they load).
ZERO_CONFIGS = ["zero2", "zero2_offload", "zero3", "zero3_offload"]


def plan_config(name: str, deepspeed: dict | None, models: dict, out: Path) -> dict:
    """One config's part of a launch's plan: every kind as hf_tfm and as its copy, writing under `out`."""
    return {"name": name, "deepspeed": deepspeed, "runs": plan_runs(models, out), "out": str(out)}


def launch_plan(command: list[str], configs: list[dict], out: Path) -> dict[str, dict]:
    """Launch tests/dist/train_deepspeed.py (`command` ends with it) once for `configs`, in turn; each config's record
    by name, with the launch's world size and the config's output folder."""
    plan = {"configs": configs, "steps": STEPS, "result": str(out / "result.json")}
    (out / "plan.json").write_text(json.dumps(plan))
    launch([*command, str(out / "plan.json")])
    result = json.loads((out / "result.json").read_text())
    outs = {config["name"]: config["out"] for config in configs}
    return {
        name: record | {"world_size": result["world_size"], "out": outs[name]}
        for name, record in result["configs"].items()
    }


@pytest.fixture(scope="module")
def zero_runs(models, tmp_path_factory, request) -> dict[str, dict]:
    """One launch over every config the session's tests of this file read (a test parametrized by `config` reads its
    own, the others ZeRO-3's, which also resumes a checkpoint and builds models with `from_config`): each config's
    record by name. One launch, not one per config: each launch pays 2 ranks' start-up and imports."""
    wanted = {
        item.callspec.params["config"] if hasattr(item, "callspec") else "zero3"
        for item in request.session.items
        if item.path == request.path and "zero_runs" in item.fixturenames
    }
    root = tmp_path_factory.mktemp("zero")
    configs = []
    for name in (name for name in ZERO_CONFIGS if name in wanted):
        config = plan_config(name, zero_config(name), models, root / name)
        if name == "zero3":
            config["resume"] = {"folder": str(models["dense-tied"]["root"] / "hf_tfm"), "task": "causal_lm"}
            config["from_config"] = {
                "folders": {kind: str(models[kind]["root"] / "hf_tfm") for kind in ("dense-tied", "moe")},
                "deepspeed": concrete(zero_config(name)),
            }
        configs.append(config)
    return launch_plan(torchrun(str(DIST / "train_deepspeed.py")), configs, root)


REFERENCES: dict[str, list[float]] = {}


def reference(spec: dict) -> list[float]:
    """One process, plain SGD on the whole global batch: the hf_tfm model's step losses (LoRA seeded as in the run)."""
    key = str(spec["root"])
    if key not in REFERENCES:
        auto, data = TASKS[spec["task"]]
        model = auto.from_pretrained(spec["root"] / "hf_tfm")
        model = with_lora(model, spec["lora"][0]) if spec["lora"] else model
        REFERENCES[key] = single_process_reference(model, STEPS, data)
    return REFERENCES[key]


def assert_close_lists(ours: list[float], theirs: list[float], rtol: float = RTOL) -> None:
    assert len(ours) == len(theirs) == STEPS, (ours, theirs)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=rtol, atol=0)


@pytest.mark.parametrize("config", ZERO_CONFIGS)
def test_trainer_zero_matches_the_in_tree_copy(config, models, zero_runs):
    """Every kind under `Trainer(deepspeed=...)`: step losses and gradient norms equal the in-tree copy's (rtol 1e-5),
    on 2 ranks of a real ZeRO engine, and hf_tfm's losses equal one process's on the same global batch."""
    assert_matches_copy(zero_runs[config], models, config)


def assert_matches_copy(record: dict, models: dict, config: str) -> None:
    assert record["world_size"] == 2
    for kind in models:
        ours, theirs = record["runs"][f"{kind}/hf_tfm"], record["runs"][f"{kind}/copy"]
        assert_close_lists(ours["losses"], reference(models[kind]))  # the default arguments: one process's losses
        ours = record["runs"].get(f"{kind}/hf_tfm-unscaled", ours)  # the copy's arguments
        assert ours["engine"] == theirs["engine"] == "DeepSpeedEngine", kind
        assert ours["stage"] == int(config[4]) and ours["zero3"] is ours["partitioned"] is (ours["stage"] == 3), kind
        assert ours["offload_optimizer"] is config.endswith("offload"), kind
        assert ours["offload_param"].endswith("cpu") is (config == "zero3_offload"), kind
        assert_close_lists(ours["losses"], theirs["losses"])
        assert_close_lists(ours["grad_norms"], theirs["grad_norms"])
        assert ours["losses"][-1] < ours["losses"][0], kind
    moe = record["runs"]["moe/hf_tfm"]["repr"]  # the real shapes, also from ZeRO-3's empty placeholders
    assert "TfmTopKRouter(32 -> 4 experts, top-2)" in moe and "4 x (32 -> 2 x 16 -> 32)" in moe, moe


def probe_logits(folder: Path, spec: dict, base: Path) -> torch.Tensor:
    """The logits a saved folder gives on a fixed input, loaded without DeepSpeed (a LoRA run saved its adapter:
    loaded onto `base`)."""
    auto, _ = TASKS[spec["task"]]
    if spec["lora"]:
        from peft import PeftModel

        model = PeftModel.from_pretrained(auto.from_pretrained(base), folder)
    else:
        model = auto.from_pretrained(folder)
    inputs = {"input_ids": torch.tensor(PROBE)}
    if spec["task"] == "seq2seq":
        inputs["decoder_input_ids"] = torch.tensor([PROBE[0][:4]])
    with torch.no_grad():
        return model.eval()(**inputs).logits


@pytest.mark.parametrize("config", ZERO_CONFIGS)
def test_saved_folders_load_without_deepspeed(config, models, zero_runs):
    """`trainer.save_model()` (ZeRO-3: the 16-bit gather) writes folders that load without DeepSpeed with the logits
    of the in-tree copy's (atol 1e-5); a tied model stays tied and stores one matrix."""
    saved = Path(zero_runs[config]["out"]) / "saved"
    for kind, spec in models.items():
        ours = saved / kind / ("hf_tfm-unscaled" if spec["task"] != "causal_lm" else "hf_tfm")
        logits = probe_logits(ours, spec, spec["root"] / "hf_tfm")
        reference = probe_logits(saved / kind / "copy", spec, spec["root"] / "copy")
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    tied = saved / "dense-tied" / "hf_tfm"
    model = transformers.AutoModelForCausalLM.from_pretrained(tied)
    assert type(model).__name__ == "TfmForCausalLM" and model.lm_head.weight is model.model.embed_tokens.weight
    with safe_open(tied / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in set(weights.keys())


def test_zero3_checkpoint_resumes_onto_the_same_curve(zero_runs):
    """A ZeRO-3 checkpoint of step 2, resumed by a fresh process's model to step 4: the losses of steps 3 and 4 equal
    the uninterrupted run's (rtol 1e-5)."""
    record = zero_runs["zero3"]["resume"]
    assert "global_step4" in record["checkpoint_files"]  # DeepSpeed's own partitioned checkpoint
    full, resumed = record["full"]["losses"], record["resumed"]["losses"]
    assert len(full) == len(resumed) == 4, (full, resumed)  # the resumed run's history starts with the checkpoint's
    torch.testing.assert_close(torch.tensor(resumed[2:]), torch.tensor(full[2:]), rtol=RTOL, atol=0)


def test_zero_to_fp32_consolidation_loads_as_an_hf_tfm_folder(models, zero_runs):
    """DeepSpeed's `zero_to_fp32.py` (the copy a ZeRO checkpoint carries) on the step-4 ZeRO-3 checkpoint, beside the
    checkpoint's config and code: the folder loads as a tied TfmForCausalLM whose logits equal the uninterrupted run's
    final model (atol 1e-6). (Its `--safe_serialization` refuses a tied model's shared table: the default writes
    pytorch_model.bin.)"""
    out = Path(zero_runs["zero3"]["out"]) / "resume"
    checkpoint, consolidated = out / "full" / "checkpoint-4", out / "fp32"
    launch([sys.executable, str(checkpoint / "zero_to_fp32.py"), str(checkpoint), str(consolidated)])
    for file in checkpoint.iterdir():
        if file.name.endswith("config.json") or (file.suffix == ".py" and file.name != "zero_to_fp32.py"):
            shutil.copy(file, consolidated)
    model = transformers.AutoModelForCausalLM.from_pretrained(consolidated)
    assert type(model).__name__ == "TfmForCausalLM" and model.lm_head.weight is model.model.embed_tokens.weight
    final = transformers.AutoModelForCausalLM.from_pretrained(out / "full" / "final")
    with torch.no_grad():
        logits, reference = (m.eval()(torch.tensor(PROBE)).logits for m in (model, final))
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-6)
    start = transformers.AutoModelForCausalLM.from_pretrained(models["dense-tied"]["root"] / "hf_tfm")
    with torch.no_grad():
        assert (start.eval()(torch.tensor(PROBE)).logits - reference).abs().max() > 1e-2  # it trained


def test_from_config_under_zero3_initialises_and_ties_as_one_process(models, zero_runs):
    """`from_config` under `HfDeepSpeedConfig` (ZeRO-3 `zero.Init`): partitioned, tied as configured, converted whole
    by `to_hf` (its `from_hf` equals the gathered model exactly), and every
    parameter, gathered, has the plain model's scale: its mean and std within 4 standard errors (4 / sqrt(numel)
    relative on the std), which tells `initializer_range` from the scaled residual projections (1/2 of it here)."""
    found = zero_runs["zero3"]["from_config"]
    for kind, record in found.items():
        config = transformers.AutoConfig.from_pretrained(models[kind]["root"] / "hf_tfm")
        assert record["partitioned"] and record["tied"] is config.tie_word_embeddings, kind
        assert record["round_trip_diff"] == 0.0, kind  # to_hf of a partitioned model converts its whole weights
        torch.manual_seed(0)
        plain = transformers.AutoModelForCausalLM.from_config(config)
        assert set(record["stats"]) == {name for name, _ in plain.named_parameters()}, kind
        for name, param in plain.named_parameters():
            mean, std, shape = record["stats"][name]
            assert shape == list(param.shape), name
            error = 4 / param.numel() ** 0.5
            assert abs(std - param.std().item()) <= error * param.std().item() + 1e-7, (kind, name, std)
            assert abs(mean - param.mean().item()) <= error * max(param.std().item(), 1e-7) + 1e-7, (kind, name)


def test_accelerate_launch_with_a_deepspeed_plugin(models, tmp_path):
    """`accelerate launch --config_file examples/accelerate/deepspeed.yaml` (its DeepSpeed plugin: ZeRO-3 from
    examples/deepspeed/zero3.json), the script's `TrainingArguments` naming no DeepSpeed config: the same record as
    `Trainer(deepspeed=...)`, equal to the in-tree copy's and to one process's (rtol 1e-5)."""
    chosen = {kind: models[kind] for kind in ("dense-tied", "moe", "encoder-lora")}
    config = ROOT / "examples" / "accelerate" / "deepspeed.yaml"
    accelerate = [str(BIN / "accelerate"), "launch", "--config_file", str(config), "--main_process_port"]
    command = [*accelerate, str(free_port()), str(DIST / "train_deepspeed.py")]
    records = launch_plan(command, [plan_config("zero3", None, chosen, tmp_path)], tmp_path)
    assert_matches_copy(records["zero3"], chosen, "zero3")


# The page's one-line `hf-tfm` commands (docs/scale-out.md), shrunk to seconds: 4 steps of the tiny presets.
CLI_TRAINING = ["--max-steps", "4", "--seq-len", "32", "--vocab-size", "300", "--lr", "3e-3", "--warmup-steps", "1"]
ON_PATH = {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # `--no-python hf-tfm`: this environment's


def page_command(launcher: str, out: Path, files: dict[str, Path], deepspeed: bool = True) -> list[str]:
    """The page's command that starts with `launcher` (torchrun, accelerate), writing `out`, its file names replaced
    by `files`, on a free port, with the tiny training; `deepspeed=False` leaves its `--deepspeed CONFIG` out."""
    lines = [line for block in doc_blocks("scale-out", "bash") for line in block.splitlines()]
    argv = next(line for line in lines if line.startswith(f"{launcher} ")).split()
    argv[argv.index("--output-dir") + 1] = str(out)
    if not deepspeed:
        at = argv.index("--deepspeed")
        argv[at : at + 2] = []
    argv = [str(files.get(arg, arg)) for arg in argv]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--master_port", str(free_port()), *argv[1:], *CLI_TRAINING]
    assert argv[1] == "launch", argv
    return [str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port()), *argv[2:], *CLI_TRAINING]


def cli_result(folder: Path, auto: type) -> tuple[dict, torch.Tensor]:
    """A CLI output folder's metrics, and the logits of its model loaded without DeepSpeed on a fixed input."""
    model = auto.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(torch.tensor(PROBE)).logits
    return json.loads((folder / "metrics.json").read_text()), logits


def assert_same_training(ours: dict, theirs: dict) -> None:
    """Two CLI runs' step losses and held-out losses equal (rtol 1e-5), and training lowered the loss."""
    assert len(ours["history"]["train"]) == 4 and ours["steps"] == theirs["steps"] == 4, ours["history"]
    assert ours["history"]["train"][-1][1] < ours["history"]["train"][0][1], ours["history"]
    for key in ("train", "eval"):
        torch.testing.assert_close(
            torch.tensor(ours["history"][key]), torch.tensor(theirs["history"][key]), rtol=1e-5, atol=0
        )


def test_pretrain_command_under_zero3_trains_as_ddp(tmp_path):
    """The page's `torchrun ... hf-tfm pretrain ... --deepspeed examples/deepspeed/zero3.json` on 2 ranks against the
    same command without `--deepspeed` (DDP: the same data on each rank; tests/test_distributed.py checks DDP
    against one process): equal step and held-out losses (rtol 1e-5), and rank 0's folder loads without DeepSpeed
    with equal logits (atol 1e-5)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("\n".join(stdlib_lines()))
    files = {"notes.txt": notes, "examples/deepspeed/zero3.json": CONFIGS / "zero3.json"}
    for name, deepspeed in (("zero3", True), ("ddp", False)):
        launch([*page_command("torchrun", tmp_path / name, files, deepspeed), "--batch-size", "2"], env=ON_PATH)
    causal_lm = transformers.AutoModelForCausalLM
    (ours, our_logits), (theirs, their_logits) = (cli_result(tmp_path / n, causal_lm) for n in ("zero3", "ddp"))
    assert ours["launch"] == {"processes": 2, "engine": "DeepSpeedEngine", "zero_stage": 3}, ours["launch"]
    assert theirs["launch"] == {"processes": 2, "engine": "DistributedDataParallel", "zero_stage": None}
    assert_same_training(ours, theirs)
    torch.testing.assert_close(our_logits, their_logits, rtol=0, atol=1e-5)


def test_finetune_command_under_accelerate_deepspeed_trains_as_one_process(tmp_path):
    """The page's `accelerate launch --config_file examples/accelerate/deepspeed.yaml --no_python hf-tfm finetune ...`
    (ZeRO-3 through accelerate's DeepSpeed plugin) on 2 ranks of batch 4, against `hf-tfm finetune` in one process of
    batch 8 on the same 8 training rows (each step sees all of them): equal step and held-out losses (rtol 1e-5) and
    equal logits of the saved classifiers (atol 1e-5)."""
    lines = stdlib_lines()
    for name, part in (("reviews.csv", lines[:8]), ("held_out.csv", lines[8:12])):
        cells = [f'"{text.replace(chr(34), "")}",{"ab"[i % 2]}' for i, text in enumerate(part)]
        (tmp_path / name).write_text("\n".join(["text,label", *cells]) + "\n")
    files = {"reviews.csv": tmp_path / "reviews.csv"}
    options = ["--eval-file", str(tmp_path / "held_out.csv")]
    launch([*page_command("accelerate", tmp_path / "zero3", files), *options, "--batch-size", "4"], env=ON_PATH)
    command = page_command("accelerate", tmp_path / "one", files)
    single = [str(BIN / "hf-tfm"), *command[command.index("hf-tfm") + 1 :]]
    launch([*single, *options, "--batch-size", "8"])
    classifier = transformers.AutoModelForSequenceClassification
    (ours, our_logits), (theirs, their_logits) = (cli_result(tmp_path / n, classifier) for n in ("zero3", "one"))
    assert ours["launch"] == {"processes": 2, "engine": "DeepSpeedEngine", "zero_stage": 3}, ours["launch"]
    assert theirs["launch"] == {"processes": 1, "engine": "TfmForSequenceClassification", "zero_stage": None}
    assert_same_training(ours, theirs)
    torch.testing.assert_close(our_logits, their_logits, rtol=0, atol=1e-5)


def stdlib_lines() -> list[str]:
    """Text on every machine: the standard library's json/decoder.py, the lines of over 20 characters."""
    return [line.strip() for line in Path(json.decoder.__file__).read_text().splitlines() if len(line.strip()) > 20]
