"""ModernBERT import / export against the in-tree model: alternating global / bidirectional sliding-window layers with
their own RoPE theta, fused Wqkv and GeGLU Wi, no attention norm on layer 0, dense+act+norm heads.

Tiny random in-tree models (nothing downloaded); sequences are longer than the local window so the sliding layers
matter, and a negative check shows a wrong window is caught.
"""

import json

import pytest
import torch
import transformers
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

import hf_tfm
from hf_tfm.convert import convert_path, from_hf, in_tree_blockers, to_hf

ATOL = 1e-5
VOCAB = 97
MODERNBERT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "global_attn_every_n_layers": 2,
    "local_attention": 4,  # sliding_window 2: |i - j| <= 2 on layers 1 and 3
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "cls_token_id": 1,
    "sep_token_id": 2,
}
CASES = {
    "base": ("ModernBertModel", {}),
    "mlm": ("ModernBertForMaskedLM", {}),
    "mlm-biases-silu": (
        "ModernBertForMaskedLM",
        {
            "norm_bias": True,
            "attention_bias": True,
            "mlp_bias": True,
            "classifier_bias": True,
            "hidden_activation": "silu",
        },
    ),
    "seqcls-cls": ("ModernBertForSequenceClassification", {"num_labels": 3}),
    "seqcls-mean": (
        "ModernBertForSequenceClassification",
        {
            "num_labels": 3,
            "classifier_pooling": "mean",
            "classifier_activation": "silu",
            "global_attn_every_n_layers": 3,
        },
    ),
}


def build(case: str, attn: str = "sdpa"):
    cls_name, extra = CASES[case]
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(**{**MODERNBERT, **extra})
    config._attn_implementation = attn
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # random non-trivial norms and biases, so a mis-mapped one cannot hide behind 1s and 0s
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                param.add_(torch.randn_like(param) * 0.1)
    return model


def padded_batch():
    """Right-padded batch of 16 tokens (window 2 each side): real-token mask alongside."""
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 16))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    mask[2, -9:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}, mask


def outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def max_diff(got, expected, mask):
    diff = (got - expected).abs()
    if diff.ndim == 3:  # per-token outputs: padded positions are don't-care (ModernBERT numbers them differently)
        diff = diff[mask.bool()]
    return diff.max().item()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_in_tree(case, attn):
    reference = build(case, attn)
    ours = from_hf(reference)
    assert ours.config._attn_implementation == attn
    inputs, mask = padded_batch()
    expected, got = outputs(reference, inputs), outputs(ours, inputs)
    assert got.shape == expected.shape
    diff = max_diff(got, expected, mask)
    assert diff <= ATOL, f"{case}/{attn}: max |diff| = {diff:.2e}"


def test_wrong_local_window_is_caught():
    """The negative check: the same weights with a one-token wider window must differ, so the parity test can fail."""
    reference = build("mlm", "eager")
    ours = from_hf(reference)
    wrong = hf_tfm.TfmConfig(**{**ours.config.to_dict(), "sliding_window": ours.config.sliding_window + 1})
    wrong._attn_implementation = "eager"
    widened = hf_tfm.TfmForMaskedLM(wrong).eval()
    widened.load_state_dict(ours.state_dict())
    inputs, mask = padded_batch()
    assert max_diff(outputs(widened, inputs), outputs(reference, inputs), mask) > 10 * ATOL


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_exact(case):
    reference = build(case, "eager")
    back = to_hf(from_hf(reference))
    assert type(back) is type(reference)
    expected, got = reference.state_dict(), back.state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    # `global_attn_every_n_layers` is ModernBertConfig's legacy spelling of `layer_types` (compared): not written back.
    ignored = {"architectures", "transformers_version", "_name_or_path", "dtype", "global_attn_every_n_layers"}
    want = {k: v for k, v in reference.config.to_dict().items() if k not in ignored}
    have = {k: v for k, v in back.config.to_dict().items() if k not in ignored}
    assert have == want


def test_imported_config_uses_general_knobs():
    config = from_hf(build("seqcls-mean")).config
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert config.sliding_window == 2 and config.rope_per_layer_type
    assert config.rope_parameters["full_attention"]["rope_theta"] == 160_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert (config.first_layer_attn_norm, config.embedding_norm, config.norm_bias) == (False, True, False)
    assert (config.classifier_pooling, config.classifier_dense, config.classifier_norm) == ("mean", True, True)
    assert (config.head_dense_bias, config.classifier_activation) == (False, "silu")


def test_rope_buffers_survive_save_and_load(tmp_path):
    ours = from_hf(build("mlm"))
    ours.save_pretrained(tmp_path)
    loaded = hf_tfm.TfmForMaskedLM.from_pretrained(tmp_path)  # built on meta: buffers come from `_init_weights`
    fresh = hf_tfm.TfmForMaskedLM(ours.config)
    for layer_type in ("full_attention", "sliding_attention"):
        for name in (f"{layer_type}_inv_freq", f"{layer_type}_original_inv_freq"):
            want = getattr(fresh.model.rotary_emb, name)
            assert torch.equal(getattr(loaded.model.rotary_emb, name), want), name
            assert torch.equal(getattr(ours.model.rotary_emb, name), want), name
    assert not torch.equal(
        loaded.model.rotary_emb.full_attention_inv_freq, loaded.model.rotary_emb.sliding_attention_inv_freq
    )
    inputs, _ = padded_batch()
    torch.testing.assert_close(outputs(loaded.eval(), inputs), outputs(ours.eval(), inputs), rtol=0, atol=0)


def test_nested_rope_config_validates():
    kwargs = {"is_causal": False, "sliding_window": 2, "layer_types": ["full_attention", "sliding_attention"]}
    with pytest.raises(ValueError, match="rope_parameters"):
        hf_tfm.TfmConfig(**kwargs, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="first_layer_attn_norm"):
        hf_tfm.TfmConfig(first_layer_attn_norm=False, norm_position="post")


def test_unexportable_modernbert_configs_name_their_knobs():
    config = from_hf(build("mlm")).config
    blockers = in_tree_blockers(config, "masked_lm")
    assert blockers["modernbert"] == []
    assert any("first_layer_attn_norm" in b for b in blockers["bert"])
    assert any("rope_parameters" in b for b in in_tree_blockers(config, "base")["llama"])
    blockers = in_tree_blockers(
        hf_tfm.TfmConfig(**{**config.to_dict(), "classifier_pooling": "last"}), "token_classification"
    )
    assert any("token_classification" in b for b in blockers["modernbert"])


def test_question_answering_is_refused_both_ways():
    """ModernBertForQuestionAnswering runs a dense + act + norm head before its span classifier;
    TfmForQuestionAnswering has a plain qa_outputs, so neither direction claims parity."""
    reference = transformers.ModernBertForQuestionAnswering(transformers.ModernBertConfig(**MODERNBERT))
    with pytest.raises(ValueError, match=r"ModernBertForQuestionAnswering.*dense"):
        from_hf(reference)
    config = from_hf(build("base")).config
    assert any("question_answering" in b for b in in_tree_blockers(config, "question_answering")["modernbert"])
    with pytest.raises(ValueError, match=r"Closest family: modernbert.*dense \+ activation \+ norm"):
        to_hf(hf_tfm.TfmForQuestionAnswering(config))


@pytest.mark.parametrize(
    ("case", "auto_class"), [("mlm", AutoModelForMaskedLM), ("seqcls-cls", AutoModelForSequenceClassification)]
)
def test_convert_path_both_directions(tmp_path, case, auto_class):
    reference = build(case)
    reference.save_pretrained(tmp_path / "in_tree")
    convert_path(tmp_path / "in_tree", tmp_path / "tfm")
    assert json.loads((tmp_path / "tfm" / "config.json").read_text())["model_type"] == "hf_tfm"
    ours = auto_class.from_pretrained(tmp_path / "tfm")
    assert type(ours).__module__ == "hf_tfm.modeling"
    inputs, mask = padded_batch()
    assert max_diff(outputs(ours, inputs), outputs(reference, inputs), mask) <= ATOL

    convert_path(tmp_path / "tfm", tmp_path / "back")
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["model_type"] == "modernbert" and "auto_map" not in saved
    assert not list((tmp_path / "back").glob("*.py"))
    back = auto_class.from_pretrained(tmp_path / "back")  # plain transformers: no remote code involved
    assert type(back) is type(reference)
    torch.testing.assert_close(outputs(back, inputs), outputs(reference, inputs), rtol=0, atol=0)
