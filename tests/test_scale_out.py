"""What runs in one process of the scale-out support (hf_tfm.scale_out, the ZeRO memory of `hf-tfm info`, the
shipped launch configs); the launches themselves are in tests/test_deepspeed.py, test_ray.py and
test_distributed.py."""

import json

import pytest
import torch
import yaml
from conftest import ROOT, build, doc_page, tiny_config

from hf_tfm import TfmForCausalLM
from hf_tfm.cli import main
from hf_tfm.commands.info import format_bytes
from hf_tfm.info import describe, zero_memory
from hf_tfm.presets import load_config
from hf_tfm.scale_out import cpu_only_launch, is_main_process, partitioned


def partition_like_zero3(model: torch.nn.Module) -> None:
    """What DeepSpeed ZeRO-3 leaves of each parameter outside `forward`: an empty tensor, the real shape in
    `ds_shape` (and an id)."""
    for index, param in enumerate(model.parameters()):
        param.ds_shape, param.ds_id = param.shape, index
        param.data = torch.empty(0, dtype=param.dtype)


def test_reprs_show_real_shapes_of_partitioned_parameters():
    """DeepSpeed and Trainer print the model before the first step: under ZeRO-3 the MoE reprs crashed (IndexError,
    ValueError on the empty placeholders) and the norms printed (0,). They show the real shapes."""
    model = build(TfmForCausalLM, tiny_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))
    before = repr(model)
    partition_like_zero3(model)
    assert partitioned(model) and repr(model) == before
    assert "TfmTopKRouter(32 -> 4 experts, top-2)" in before and "4 x (32 -> 2 x 16 -> 32)" in before
    assert "TfmRMSNorm((32,), eps=" in before


def test_launch_environment(monkeypatch):
    """Rank 0 (or no launcher) writes; a multi-process launch without an accelerator is a CPU one."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert is_main_process() and not cpu_only_launch()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not is_main_process() and cpu_only_launch() is not torch.cuda.is_available()


def llama_parameters(preset: str) -> int:
    """The preset's parameter count, by hand: tied embeddings, per layer q/o (H x H), k/v (H x kv heads x head dim),
    a gated MLP (3 x H x I) and two RMSNorms, and the final norm."""
    c = load_config(preset)
    kv = c.num_key_value_heads * c.head_dim
    layer = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
    return c.vocab_size * c.hidden_size + c.num_hidden_layers * (layer + 2 * c.hidden_size) + c.hidden_size


def test_zero_memory_of_a_preset_by_hand():
    """`hf-tfm info llama-style --zero-ranks 8`: the model states per rank that ZeRO counts (2 bytes of weights, 2 of
    gradients, 12 of fp32 AdamW states per parameter), each stage partitioning one more of them over the 8 ranks,
    the offloads moving the optimizer states with their gradients, then the weights too, to the CPU."""
    psi = llama_parameters("llama-style")
    report = describe("llama-style", zero_ranks=8)
    assert report["parameters"] == psi and report["zero_memory"]["ranks"] == 8
    rows = {(row["stage"], row["offload"]): row for row in report["zero_memory"]["rows"]}
    n = 8

    def expect(params, grads, optimizer, cpu):
        return {"params": params, "grads": grads, "optimizer": optimizer, "cpu": cpu}

    expected = {
        (0, "none"): expect(2 * psi, 2 * psi, 12 * psi, 0),
        (1, "none"): expect(2 * psi, 2 * psi, 12 * psi / n, 0),
        (2, "none"): expect(2 * psi, 2 * psi / n, 12 * psi / n, 0),
        (2, "optimizer"): expect(2 * psi, 2 * psi / n, 12 * psi / n, 14 * psi / n),
        (3, "none"): expect(2 * psi / n, 2 * psi / n, 12 * psi / n, 0),
        (3, "optimizer"): expect(2 * psi / n, 2 * psi / n, 12 * psi / n, 14 * psi / n),
        (3, "optimizer+params"): expect(2 * psi / n, 2 * psi / n, 12 * psi / n, 16 * psi / n),
    }
    assert set(rows) == set(expected)
    for key, want in expected.items():
        row = rows[key]
        for field, value in want.items():
            assert row[field] == pytest.approx(value, abs=1), (key, field)
        assert row["device"] + row["cpu"] == pytest.approx(row["params"] + row["grads"] + row["optimizer"], abs=1)
    assert rows[(0, "none")]["device"] == pytest.approx(16 * psi, abs=1)  # the paper's 16 bytes per parameter
    assert rows[(3, "none")]["device"] == pytest.approx(16 * psi / n, abs=3)


def test_info_prints_the_zero_table(capsys):
    """The table's ZeRO-3 row with both offloads: nothing on the device, all 16 bytes per parameter / 8 on the CPU."""
    assert main(["info", "llama-style", "--zero-ranks", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("ZeRO memory per rank on 8 ranks" in line for line in lines)
    row = next(line.split() for line in lines if line.split()[:2] == ["3", "optimizer+params"])
    device, cpu = row[8:10], row[10:12]  # each size is "<number> <unit>"
    assert device == ["0", "B"] and cpu == [f"{16 * llama_parameters('llama-style') / 8 / 1024**2:.2f}", "MiB"]
    assert main(["info", "llama-style", "--json", "--zero-ranks", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["zero_memory"]["ranks"] == 2
    assert main(["info", "llama-style", "--zero-ranks", "0"]) == 1


def test_the_page_memory_table_is_what_info_computes():
    """docs/scale-out.md's ZeRO table (llama-style on 8 ranks, under its marker) is `zero_memory`'s rows, cell for
    cell, as `hf-tfm info --zero-ranks 8` prints them."""
    text = doc_page("scale-out").read_text().split("<!-- zero-memory:", 1)[1].split("\n\n", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()[3:]]
    keys = ("params", "grads", "optimizer", "device", "cpu")
    expected = [
        [str(row["stage"]), row["offload"], *(format_bytes(row[key]) for key in keys)]
        for row in zero_memory(llama_parameters("llama-style"), 8)
    ]
    assert rows == expected


def test_zero_memory_refuses_no_ranks():
    with pytest.raises(ValueError, match="ranks"):
        zero_memory(100, 0)


def test_shipped_launch_configs_are_consistent():
    """The DeepSpeed configs leave batch sizes, clipping and precision to `Trainer` ("auto") and take its torch
    optimizer; the accelerate config launches DeepSpeed with one of them."""
    folder = ROOT / "examples" / "deepspeed"
    stages = {"zero2.json": 2, "zero3.json": 3, "zero3_offload.json": 3}
    for name, stage in stages.items():
        config = json.loads((folder / name).read_text())
        assert config["zero_optimization"]["stage"] == stage and config["zero_allow_untested_optimizer"]
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            assert config[key] == "auto", (name, key)
        assert "optimizer" not in config and "scheduler" not in config, name
    offload = json.loads((folder / "zero3_offload.json").read_text())["zero_optimization"]
    assert offload["offload_optimizer"]["device"] == offload["offload_param"]["device"] == "cpu"
    accelerate = yaml.safe_load((ROOT / "examples" / "accelerate" / "deepspeed.yaml").read_text())
    assert accelerate["distributed_type"] == "DEEPSPEED"
    assert (ROOT / accelerate["deepspeed_config"]["deepspeed_config_file"]).is_file()
