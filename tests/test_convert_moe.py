"""Exact-parity import from / export to in-tree Mixtral, Qwen2-MoE and OLMoE, with the in-tree model as the oracle.

Tiny random in-tree models (nothing downloaded): logits within 1e-5 in fp32 on a left-padded batch for every attention
backend and experts kernel, identical router logits, aux loss and loss, identical greedy generations, bit-identical
bf16 logits, in-tree -> hf_tfm -> in-tree with identical weights and config, and saved folders converted both ways in
the per-expert layout each family publishes, loading in the in-tree classes without remote code.
"""

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import hf_tfm
from hf_tfm.convert import convert_path, from_hf, in_tree_blockers, to_hf

ATOL = 1e-5
VOCAB = 97
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
# Init 10x the default: routing then clearly depends on the token, so a mis-mapped router changes the top-k.
COMMON = {**SMALL, "num_key_value_heads": 2, "pad_token_id": 0, "num_experts_per_tok": 2, "initializer_range": 0.2}
MIXTRAL = {**COMMON, "intermediate_size": 16, "num_local_experts": 4}
QWEN2_MOE = {**COMMON, "intermediate_size": 48, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}
QWEN2_MOE |= {"num_experts": 4}
OLMOE = {**COMMON, "intermediate_size": 16, "num_experts": 4, "bos_token_id": 1, "eos_token_id": 2}

# id -> (in-tree class name, config class name, config kwargs)
CASES = {
    "mixtral-lm": ("MixtralForCausalLM", "MixtralConfig", MIXTRAL),
    "mixtral-lm-sliding": ("MixtralForCausalLM", "MixtralConfig", {**MIXTRAL, "sliding_window": 4}),
    "mixtral-base": ("MixtralModel", "MixtralConfig", MIXTRAL),
    "mixtral-seqcls": ("MixtralForSequenceClassification", "MixtralConfig", {**MIXTRAL, "num_labels": 3}),
    "mixtral-tokcls": ("MixtralForTokenClassification", "MixtralConfig", MIXTRAL),
    "mixtral-qa": ("MixtralForQuestionAnswering", "MixtralConfig", MIXTRAL),
    # The shared expert everywhere; dense and sparse layers mixed by mlp_only_layers and by decoder_sparse_step.
    "qwen2_moe-lm": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", QWEN2_MOE),
    "qwen2_moe-lm-mlp-only-layers": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {**QWEN2_MOE, "mlp_only_layers": [0]}),
    "qwen2_moe-lm-sparse-step-norm-topk": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {
            **QWEN2_MOE,
            "num_hidden_layers": 4,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "norm_topk_prob": True,
        },
    ),
    "qwen2_moe-lm-sliding-no-qkv-bias": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {**QWEN2_MOE, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, "qkv_bias": False},
    ),
    "qwen2_moe-base": ("Qwen2MoeModel", "Qwen2MoeConfig", QWEN2_MOE),
    "qwen2_moe-seqcls": ("Qwen2MoeForSequenceClassification", "Qwen2MoeConfig", {**QWEN2_MOE, "num_labels": 3}),
    "qwen2_moe-tokcls": ("Qwen2MoeForTokenClassification", "Qwen2MoeConfig", QWEN2_MOE),
    "qwen2_moe-qa": ("Qwen2MoeForQuestionAnswering", "Qwen2MoeConfig", QWEN2_MOE),
    # q/k norms over the full projection width (not per head)
    "olmoe-lm": ("OlmoeForCausalLM", "OlmoeConfig", OLMOE),
    "olmoe-lm-norm-topk-bias": (
        "OlmoeForCausalLM",
        "OlmoeConfig",
        {**OLMOE, "norm_topk_prob": True, "attention_bias": True},
    ),
    "olmoe-base": ("OlmoeModel", "OlmoeConfig", OLMOE),
}
DECODER_LMS = [name for name, (cls, _, _) in CASES.items() if cls.endswith("ForCausalLM")]


def build(case: str, attn: str = "sdpa", experts: str = "eager", dtype: torch.dtype = torch.float32, **overrides):
    cls_name, config_name, kwargs = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**kwargs, **overrides}, experts_implementation=experts)
    config._attn_implementation = attn
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # random non-trivial norms and biases, so a mis-mapped one cannot hide behind 1s and 0s
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                param.add_(torch.randn_like(param) * 0.1)
    return model.to(dtype)


def padded_batch(seed: int = 1):
    """(inputs, real-token mask): left padding with generate()'s positions."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 12), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 3), (2, 7)):
        mask[row, :pad] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "position_ids": positions}, mask


def outputs(model, inputs, **kwargs):
    with torch.no_grad():
        out = model(**inputs, **kwargs)
    if hasattr(out, "start_logits"):  # question answering: (B, T, 2) start / end logits
        return torch.stack((out.start_logits, out.end_logits), dim=-1), out
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state), out


@pytest.mark.parametrize("experts", ["eager", "grouped_mm"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_router_logits_match_in_tree(case, attn, experts):
    reference = build(case, attn, experts)
    ours = from_hf(reference)
    assert ours.config._attn_implementation == attn and ours.config._experts_implementation == experts
    inputs, mask = padded_batch()
    kwargs = {"output_router_logits": True}
    if CASES[case][0].endswith("ForCausalLM"):
        kwargs["labels"] = inputs["input_ids"].masked_fill(mask == 0, -100)
    (expected, theirs), (got, mine) = outputs(reference, inputs, **kwargs), outputs(ours, inputs, **kwargs)
    assert got.shape == expected.shape
    diff = (got - expected).abs()
    diff = diff[mask.bool()] if diff.ndim == 3 else diff  # per-token outputs: padded positions are don't-care
    assert diff.max().item() <= ATOL, f"{case}/{attn}/{experts}: max |diff| = {diff.max().item():.2e}"
    if getattr(theirs, "router_logits", None) is None:  # the in-tree classifiers do not return them
        return
    assert len(mine.router_logits) == len(theirs.router_logits) > 0
    real = mask.flatten().bool()
    for layer_theirs, layer_mine in zip(theirs.router_logits, mine.router_logits, strict=True):
        assert (layer_mine[real] - layer_theirs[real]).abs().max() <= ATOL
    if "labels" in kwargs:
        torch.testing.assert_close(mine.aux_loss, theirs.aux_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(mine.loss, theirs.loss, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", DECODER_LMS)
def test_greedy_generation_matches_in_tree(case):
    reference = build(case, experts="grouped_mm")
    ours = from_hf(reference)
    inputs, _ = padded_batch()
    inputs.pop("position_ids")
    kwargs = {"max_new_tokens": 20, "min_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    expected = reference.generate(**inputs, **kwargs)
    assert expected.shape[1] == inputs["input_ids"].shape[1] + 20
    assert torch.equal(ours.generate(**inputs, **kwargs), expected)


@pytest.mark.parametrize("case", ["mixtral-lm", "qwen2_moe-lm-mlp-only-layers", "olmoe-lm"])
@pytest.mark.parametrize("experts", ["eager", "batched_mm", "grouped_mm"])
def test_bf16_logits_are_bit_identical(case, experts):
    """The same operations in the same order: Mixtral's fp32 routing weights are `router_weights_fp32`."""
    reference = build(case, experts=experts, dtype=torch.bfloat16)
    ours = from_hf(reference)
    inputs, _ = padded_batch()
    assert torch.equal(outputs(ours, inputs)[0], outputs(reference, inputs)[0])
    if case == "mixtral-lm":  # the knob matters: routing weights in bf16 change Mixtral's logits
        ours.config.router_weights_fp32 = False
        for layer in ours.model.layers:
            layer.mlp.gate.weights_fp32 = False
        assert not torch.equal(outputs(ours, inputs)[0], outputs(reference, inputs)[0])


def test_mixtral_router_jitter_matches_in_training_mode():
    """Mixtral's training-time jitter multiplies the block's input by U(1 - eps, 1 + eps): the same draws, the same
    losses and gradients, and none in eval mode."""
    reference = build("mixtral-lm", router_jitter_noise=0.2)
    ours = from_hf(reference)
    assert ours.config.router_jitter_noise == 0.2
    inputs, mask = padded_batch()
    labels = inputs["input_ids"].masked_fill(mask == 0, -100)
    losses = []
    for model in (reference, ours):
        model.train()
        torch.manual_seed(3)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], atol=ATOL, rtol=0)
    grad_theirs = reference.model.layers[0].mlp.gate.weight.grad
    torch.testing.assert_close(ours.model.layers[0].mlp.gate.weight.grad, grad_theirs, atol=1e-6, rtol=0)
    torch.manual_seed(4)
    assert not torch.equal(ours(**inputs, labels=labels).loss, losses[1])  # the noise really is drawn
    ours.eval()
    assert torch.equal(outputs(ours, inputs)[0], outputs(ours, inputs)[0])


IGNORED_CONFIG_KEYS = {"architectures", "transformers_version", "_name_or_path", "dtype"}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_exact(case):
    reference = build(case, "eager")
    back = to_hf(from_hf(reference))
    assert type(back) is type(reference)
    expected, got = reference.state_dict(), back.state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    want = {k: v for k, v in reference.config.to_dict().items() if k not in IGNORED_CONFIG_KEYS}
    have = {k: v for k, v in back.config.to_dict().items() if k not in IGNORED_CONFIG_KEYS}
    assert have == want


def test_imported_configs_use_general_knobs():
    config = from_hf(build("mixtral-lm")).config
    assert (config.num_experts, config.moe_intermediate_size, config.norm_topk_prob) == (4, 16, True)
    assert config.router_weights_fp32 and config.shared_expert_intermediate_size is None
    config = from_hf(build("qwen2_moe-lm-sparse-step-norm-topk")).config
    assert (config.shared_expert_intermediate_size, config.mlp_only_layers, config.decoder_sparse_step) == (24, [3], 2)
    assert [config.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]
    assert (config.attention_bias, config.attention_out_bias, config.router_weights_fp32) == (True, False, False)
    config = from_hf(build("olmoe-lm")).config
    assert (config.qk_norm, config.qk_norm_scope, config.norm_topk_prob) == (True, "projection", False)


# Keys each family's published checkpoints hold for layer 1, expert 0 (transformers converts them when loading).
PUBLISHED_EXPERT_KEYS = {
    "mixtral": ["model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.0.w1.weight"],
    "qwen2_moe": ["model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight"],
    "olmoe": ["model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.1.self_attn.q_norm.weight"],
}


def stored_keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize(
    ("case", "auto_class"),
    [
        ("mixtral-lm", AutoModelForCausalLM),
        ("qwen2_moe-lm-mlp-only-layers", AutoModelForCausalLM),
        ("qwen2_moe-seqcls", AutoModelForSequenceClassification),
        ("olmoe-lm", AutoModelForCausalLM),
    ],
)
def test_convert_path_both_directions_in_the_published_layout(tmp_path, case, auto_class):
    reference = build(case)
    family = reference.config.model_type
    reference.save_pretrained(tmp_path / "in_tree")
    assert set(PUBLISHED_EXPERT_KEYS[family]) <= stored_keys(tmp_path / "in_tree")
    (tmp_path / "in_tree" / "tokenizer_config.json").write_text("{}")  # other files travel along unchanged

    convert_path(tmp_path / "in_tree", tmp_path / "tfm")
    assert json.loads((tmp_path / "tfm" / "config.json").read_text())["model_type"] == "hf_tfm"
    assert (tmp_path / "tfm" / "tokenizer_config.json").is_file()
    tfm_keys = stored_keys(tmp_path / "tfm")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in tfm_keys  # hf_tfm saves per expert (Qwen2-MoE's)
    assert not any(key.endswith("gate_up_proj") for key in tfm_keys)
    ours = auto_class.from_pretrained(tmp_path / "tfm")
    assert type(ours).__module__ == "hf_tfm.modeling"

    convert_path(tmp_path / "tfm", tmp_path / "back")
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["model_type"] == family and "auto_map" not in saved
    assert not list((tmp_path / "back").glob("*.py"))
    assert stored_keys(tmp_path / "back") == stored_keys(tmp_path / "in_tree")  # the family's own layout again
    # plain transformers, no remote code; the experts kernel the reference ran (sums in another order differ in ulps)
    back = auto_class.from_pretrained(tmp_path / "back", experts_implementation="eager")
    assert type(back) is type(reference)
    inputs, _ = padded_batch()
    torch.testing.assert_close(outputs(back, inputs)[0], outputs(reference, inputs)[0], rtol=0, atol=0)
    torch.testing.assert_close(outputs(ours, inputs)[0], outputs(reference, inputs)[0], rtol=0, atol=ATOL)


def test_moe_configs_export_to_moe_families_only():
    moe = from_hf(build("mixtral-lm")).config
    blockers = in_tree_blockers(moe, "causal_lm")
    assert blockers["mixtral"] == []
    assert any("`num_experts`" in b for b in blockers["llama"])  # dense families name the knob
    dense = hf_tfm.TfmConfig(**SMALL)
    assert any("`num_experts`" in b for b in in_tree_blockers(dense, "causal_lm")["mixtral"])

    no_shared = hf_tfm.TfmConfig(**SMALL, num_experts=4, norm_topk_prob=False)
    found = in_tree_blockers(no_shared, "causal_lm")
    assert any("shared_expert_intermediate_size" in b for b in found["qwen2_moe"])
    assert any("router_weights_fp32" in b for b in found["mixtral"])
    assert any("`qk_norm`" in b for b in found["olmoe"])
    with pytest.raises(ValueError, match="Closest family: qwen2_moe, blocked by: `shared_expert_intermediate_size`"):
        to_hf(hf_tfm.TfmForCausalLM(no_shared))  # the closest family is one with experts

    per_head = hf_tfm.TfmConfig(**SMALL, num_experts=4, norm_topk_prob=False, qk_norm=True)
    assert any("qk_norm_scope" in b for b in in_tree_blockers(per_head, "causal_lm")["olmoe"])
    assert any("sequence_classification" in b for b in in_tree_blockers(moe, "sequence_classification")["olmoe"])


def test_in_tree_variants_without_an_equivalent_are_refused():
    with pytest.raises(ValueError, match="clip_qkv"):
        from_hf(build("olmoe-lm", clip_qkv=2.0))
    with pytest.raises(ValueError, match="num_experts=0"):
        from_hf(build("qwen2_moe-lm", num_experts=0))
