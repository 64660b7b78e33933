"""PEFT LoRA on hf_tfm: target modules, gradients, saving and loading, merging, generate, remote-code base models."""

import json

import pytest
import torch
from conftest import random_ids, run_without_hf_tfm, tiny_config
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from torch import nn

from hf_tfm import TfmForCausalLM, TfmForSequenceClassification
from hf_tfm.training import PadCollator

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def seeded(model_class, seed=0, **config):
    torch.manual_seed(seed)
    return model_class(tiny_config(**config)).eval()


def lora_targets(model):
    return sorted(
        {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if ".lora_A" in name}
    )


def perturb_lora_b(model, seed=1):
    """LoRA starts as a no-op (B = 0); give B random values so adapters visibly change the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def test_documented_default_targets_q_v():
    model = get_peft_model(seeded(TfmForCausalLM), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert lora_targets(model) == ["q_proj", "v_proj"]
    # 2 layers x (q, v) x (A: r x 32, B: out x r)
    assert model.get_nb_trainable_parameters()[0] == 2 * 2 * (4 * 32 + 32 * 4)


def test_all_linear_targets_every_projection_but_not_lm_head():
    model = get_peft_model(seeded(TfmForCausalLM), LoraConfig(r=4, target_modules="all-linear"))
    expected = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert lora_targets(model) == expected
    assert isinstance(model.base_model.model.lm_head, nn.Linear)  # not wrapped in a LoRA layer
    assert not any("lm_head" in name for name, p in model.named_parameters() if p.requires_grad)


def test_adapter_gradients_are_nonzero_and_base_is_frozen():
    model = get_peft_model(seeded(TfmForCausalLM), LoraConfig(r=4, target_modules="all-linear"))
    model.train()
    perturb_lora_b(model)  # with B = 0, lora_A's gradient is exactly 0: make both factors receive signal
    batch = PadCollator()([{"input_ids": random_ids(1, 9, seed=s)[0].tolist()} for s in range(3)])
    model(**batch).loss.backward()
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    for name, p in trainable.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for name, p in model.named_parameters() if not p.requires_grad)


def test_seq_cls_saves_score_head_and_reloads(tmp_path):
    config = {"is_causal": False, "num_labels": 3}
    model = get_peft_model(
        seeded(TfmForSequenceClassification, **config),
        LoraConfig(r=4, task_type=TaskType.SEQ_CLS, target_modules=["q_proj", "v_proj"]),
    )
    perturb_lora_b(model)
    with torch.no_grad():
        model.base_model.model.score.modules_to_save["default"].weight.normal_()  # a trained head differs from init
    assert any("score" in name for name, p in model.named_parameters() if p.requires_grad)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert {"base_model.model.score.weight", "base_model.model.score.bias"} <= set(saved)

    ids = random_ids(2, 8)
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        reloaded = PeftModel.from_pretrained(seeded(TfmForSequenceClassification, **config), tmp_path).eval()
        fresh_base = seeded(TfmForSequenceClassification, **config)(input_ids=ids).logits
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=0, atol=1e-6)
    assert (fresh_base - expected).abs().max() > 1e-2  # the head and adapters really came from the file


def test_causal_lm_adapters_save_load_merge_and_generate(tmp_path):
    model = get_peft_model(seeded(TfmForCausalLM), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    perturb_lora_b(model)
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    ids = random_ids(2, 8)
    with torch.no_grad():
        adapter_logits = model.eval()(input_ids=ids).logits
        base_logits = seeded(TfmForCausalLM)(input_ids=ids).logits
        assert (adapter_logits - base_logits).abs().max() > 1e-3

        reloaded = PeftModel.from_pretrained(seeded(TfmForCausalLM), tmp_path / "adapter").eval()
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapter_logits, rtol=0, atol=1e-6)

        generated = reloaded.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False)
        assert generated.shape == (1, 13)
        # greedy decoding through the PeftModel == greedy decoding of the merged model
        merged = reloaded.merge_and_unload()
        assert type(merged) is TfmForCausalLM and not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=ids).logits, adapter_logits, rtol=0, atol=1e-5)
        assert torch.equal(merged.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False), generated)


def test_remote_code_base_model_takes_adapters(tmp_path):
    """A base model loaded with trust_remote_code where hf_tfm is not importable accepts and applies adapters."""
    base = seeded(TfmForCausalLM)
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    perturb_lora_b(model)
    model.save_pretrained(tmp_path / "adapter")
    ids = random_ids(2, 8)
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
    code = f"""
        import json, torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained({str(tmp_path / "base")!r}, trust_remote_code=True)
        assert type(base).__module__.startswith("transformers_modules."), type(base).__module__
        model = PeftModel.from_pretrained(base, {str(tmp_path / "adapter")!r}).eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor({ids.tolist()})).logits
        print(json.dumps(logits.tolist()))
    """
    logits = json.loads(run_without_hf_tfm(code, tmp_path).strip().splitlines()[-1])
    torch.testing.assert_close(torch.tensor(logits), expected, rtol=0, atol=1e-5)
