"""Reliability: tied weights sharded together, knobs without effect named, left padding with absolute positions."""

import logging
import re

import pytest
import torch
from conftest import build, random_ids, tiny_config, tiny_seq2seq_config

from hf_tfm import modeling

HEADS = [getattr(modeling, name) for name in modeling.__all__ if not name.endswith("PreTrainedModel")]


def _plan_style(plan: dict[str, str], module_name: str) -> str | None:
    """The TP style a plan gives a module: keys name modules, `*` standing for a layer index (transformers' rule)."""
    for key, style in plan.items():
        if re.fullmatch(re.escape(key).replace(r"\*", r"\d+"), module_name):
            return style
    return None


@pytest.mark.parametrize("cls", HEADS, ids=lambda cls: cls.__name__)
def test_tied_weights_are_sharded_together(cls):
    """Every tied pair is sharded by both ends' TP plan entries or by neither (transformers' common-test rule)."""
    if issubclass(cls, modeling.TfmSeq2SeqPreTrainedModel):
        config = tiny_seq2seq_config()
    else:
        config = tiny_config(tie_word_embeddings=True, is_causal=cls is not modeling.TfmForMaskedLM)
    model = cls(config)
    for target, source in model.all_tied_weights_keys.items():
        styles = [_plan_style(model.tp_plan, name.rpartition(".")[0]) for name in (target, source)]
        assert (styles[0] is None) == (styles[1] is None), (cls.__name__, target, source, styles)
        assert model.get_parameter(target) is model.get_parameter(source)


# --- knobs that do nothing in a configuration: accepted (as in-tree configs accept them) and named in a warning


ROPE = "rope_parameters"
NO_EFFECT = [
    (
        {"position_embedding_type": "alibi", "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
        "rope_parameters",
    ),
    (
        {"position_embedding_type": "learned", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
        "rope_parameters",
    ),
    (
        {
            "position_embedding_type": "sinusoidal",
            "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        },
        "rope_parameters",
    ),
    ({"sliding_window": 4, "layer_types": ["full_attention", "full_attention"]}, "sliding_window"),
    ({"sinusoidal_layout": "halves"}, "sinusoidal_layout"),  # rope: it is not RoPE's layout
    ({"position_offset": 2}, "position_offset"),
    ({"classifier_norm": True}, "classifier_norm"),
    ({"qk_norm_scope": "projection"}, "qk_norm_scope"),
    ({"shared_expert_intermediate_size": 8}, "shared_expert_intermediate_size"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"output_router_logits": True}, "output_router_logits"),
    ({"router_weights_fp32": True}, "router_weights_fp32"),
]


@pytest.mark.parametrize(("overrides", "knob"), NO_EFFECT, ids=[knob for _, knob in NO_EFFECT])
def test_a_knob_without_effect_warns_and_changes_nothing(overrides, knob, caplog):
    with caplog.at_level(logging.WARNING):
        config = tiny_config(**overrides)
    assert any(f"`{knob}`" in r.getMessage() and "has no effect" in r.getMessage() for r in caplog.records)
    plain = tiny_config(position_embedding_type=overrides.get("position_embedding_type", "rope"))
    ids = random_ids(2, 9)
    with torch.no_grad():  # the same weights give the same logits: the knob really changes nothing
        expected = build(modeling.TfmForCausalLM, plain)(input_ids=ids).logits
        assert torch.equal(build(modeling.TfmForCausalLM, config)(input_ids=ids).logits, expected)


def test_a_knob_without_effect_survives_save_and_load(tmp_path):
    """transformers' `test_eager_matches_sdpa_inference` sets `sliding_window` on every config that has it."""
    model = build(modeling.TfmForCausalLM, tiny_config())
    model.config.sliding_window = 2
    model.save_pretrained(tmp_path)
    reloaded = modeling.TfmForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.sliding_window == 2 and reloaded.config.layer_types == ["full_attention"] * 2


@pytest.mark.parametrize(
    ("overrides", "knob"),
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"position_offset": -1, "position_embedding_type": "learned"}, "position_offset"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_window"),  # a window it cannot size
    ],
)
def test_a_value_that_cannot_be_computed_still_raises(overrides, knob):
    with pytest.raises(ValueError, match=knob):
        tiny_config(**overrides)


def test_a_misspelt_knob_warns_with_the_nearest_one(caplog):
    with caplog.at_level(logging.WARNING):
        config = tiny_config(sliding_windw=4)
    assert "`sliding_windw` (did you mean `sliding_window`?)" in caplog.text
    assert config.sliding_windw == 4 and config.sliding_window is None  # kept, as in-tree configs keep it
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        tiny_config(num_labels=3, torch_dtype="float32", architectures=["TfmForCausalLM"], cls_token_id=5)
        # what PreTrainedConfig takes itself: an implementation choice (`transformers serve` passes one), an old
        # config.json's generation parameter
        tiny_config(attn_implementation="sdpa", experts_implementation="eager", max_length=20)
    assert "does not read" not in caplog.text  # transformers' own keys and special-token ids are known


def test_loading_a_saved_folder_names_no_unknown_key(tmp_path, caplog):
    """The keys `from_pretrained` itself passes back into the config (`name_or_path`, a base-class property) are known:
    only a key no knob reads is named, never an ordinary save/load round trip."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
    )

    build(modeling.TfmForCausalLM, tiny_config()).save_pretrained(tmp_path / "lm")
    build(modeling.TfmForConditionalGeneration, tiny_seq2seq_config()).save_pretrained(tmp_path / "s2s")
    with caplog.at_level(logging.WARNING):
        AutoConfig.from_pretrained(tmp_path / "lm")
        AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
        AutoModelForCausalLM.from_pretrained(tmp_path / "lm", trust_remote_code=True)
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=3)
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "s2s")
    assert "does not read" not in caplog.text


def test_backbone_pooler_is_built_by_the_backbone_only(tmp_path):
    """`add_pooling_layer` gives TfmModel a pooler; heads pool for themselves and report its weights as unexpected."""
    config = tiny_config(is_causal=False, position_embedding_type="learned", add_pooling_layer=True)
    backbone = build(modeling.TfmModel, config)
    ids = random_ids(2, 7)
    with torch.no_grad():
        out = backbone(input_ids=ids)
        expected = torch.tanh(backbone.pooler.dense(out.last_hidden_state[:, 0]))
    torch.testing.assert_close(out.pooler_output, expected, rtol=0, atol=0)
    backbone.save_pretrained(tmp_path)
    head, info = modeling.TfmForSequenceClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert head.model.pooler is None
    assert {key.rpartition("pooler.")[2] for key in info["unexpected_keys"]} == {"dense.weight", "dense.bias"}


# --- left padding with absolute positions: hf_tfm numbers real tokens, in-tree GPT-2 numbers every slot


def test_left_padding_with_absolute_positions_gpt2():
    """A left-padded batch equals each row alone in hf_tfm; in-tree GPT-2 agrees only when given the positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_tfm.convert import from_hf

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    ours = from_hf(gpt2)
    ids, pad = random_ids(2, 9), 4
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with torch.no_grad():
        batch = ours(input_ids=ids, attention_mask=mask).logits
        alone = ours(input_ids=ids[1:, pad:]).logits
        in_tree = gpt2(input_ids=ids, attention_mask=mask).logits
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        in_tree_positioned = gpt2(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(batch[1, pad:], alone[0], rtol=0, atol=1e-5)  # padding does not shift positions
    assert (in_tree[1, pad:] - batch[1, pad:]).abs().max() > 1e-2  # GPT-2 numbers the padded slots too
    torch.testing.assert_close(in_tree_positioned[1, pad:], batch[1, pad:], rtol=0, atol=1e-5)
    torch.testing.assert_close(in_tree[0], batch[0], rtol=0, atol=1e-5)  # unpadded rows agree either way
