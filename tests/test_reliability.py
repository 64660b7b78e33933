"""Reliability: tied weights sharded together, no silently ignored knobs, left padding with absolute positions."""

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


# --- knobs that would do nothing are refused


@pytest.mark.parametrize("position_embedding_type", ["learned", "sinusoidal", "alibi"])
@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 2.0},
        {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
    ],
    ids=["linear", "dynamic", "yarn", "nested-linear"],
)
def test_rope_scaling_without_rope_is_refused(position_embedding_type, rope_parameters):
    with pytest.raises(ValueError, match=r"`rope_parameters`.*`position_embedding_type`"):
        tiny_config(position_embedding_type=position_embedding_type, rope_parameters=rope_parameters)


@pytest.mark.parametrize("position_embedding_type", ["learned", "sinusoidal", "alibi"])
def test_default_rope_parameters_stay_allowed_without_rope(position_embedding_type):
    config = tiny_config(
        position_embedding_type=position_embedding_type, rope_parameters={"rope_type": "default", "rope_theta": 1e4}
    )
    assert config.rope_parameters["rope_type"] == "default"
    assert (
        tiny_config(position_embedding_type=position_embedding_type).position_embedding_type == position_embedding_type
    )


def test_sliding_window_without_sliding_layers_is_refused():
    with pytest.raises(ValueError, match=r"`sliding_window`.*`layer_types`"):
        tiny_config(sliding_window=4, layer_types=["full_attention", "full_attention"])
    assert tiny_config(sliding_window=4).layer_types == ["sliding_attention"] * 2  # None: every layer windowed


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
