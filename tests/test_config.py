"""TfmConfig: defaults, validation (a ValueError naming the knob), JSON round trip and AutoConfig."""

import json

import pytest
import torch
from conftest import tiny_config
from transformers import AutoConfig

from hf_tfm import TfmConfig, TfmForCausalLM


def test_defaults_build_a_small_valid_decoder():
    config = TfmConfig()
    assert config.model_type == "hf_tfm"
    assert (config.is_causal, config.position_embedding_type, config.norm_type, config.ffn_type) == (
        True,
        "rope",
        "rmsnorm",
        "glu",
    )
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.head_dim * config.num_attention_heads == config.hidden_size
    assert config.intermediate_size % 64 == 0
    assert config.layer_types == ["full_attention"] * config.num_hidden_layers
    assert config.classifier_pooling == "last"
    assert config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "default"}
    model = TfmForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    out = model(input_ids=torch.tensor([[1, 5, 7]]))
    assert out.logits.shape == (1, 3, config.vocab_size) and torch.isfinite(out.logits).all()


def test_derived_defaults():
    assert TfmConfig(ffn_type="mlp", hidden_size=64).intermediate_size == 256
    assert TfmConfig(is_causal=False).classifier_pooling == "first"
    assert TfmConfig(sliding_window=8, num_hidden_layers=3).layer_types == ["sliding_attention"] * 3
    assert TfmConfig(attention_bias=True).attention_out_bias is True
    assert TfmConfig(hidden_size=30, num_attention_heads=4, head_dim=8).head_dim == 8  # explicit head_dim


@pytest.mark.parametrize(
    ("kwargs", "knob"),
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "head_dim"),
        ({"position_embedding_type": "relative"}, "position_embedding_type"),
        ({"norm_type": "batchnorm"}, "norm_type"),
        ({"norm_position": "sandwich"}, "norm_position"),
        ({"ffn_type": "moe"}, "ffn_type"),
        ({"classifier_pooling": "max"}, "classifier_pooling"),
        ({"position_embedding_type": "alibi", "attn_implementation": "flash_attention_2"}, "alibi"),
        ({"norm_position": "post", "parallel_residual": True}, "parallel_residual"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": -4}, "sliding_window"),
        ({"layer_types": ["full_attention"]}, "layer_types"),  # 2 layers
        ({"layer_types": ["full_attention", "global"]}, "layer_types"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_window"),
        ({"position_embedding_type": "rope", "hidden_size": 36, "num_attention_heads": 4}, "head_dim"),  # odd
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"max_position_embeddings": -1}, "max_position_embeddings"),
        ({"hidden_dropout": 1.0}, "hidden_dropout"),
        ({"attention_dropout": -0.1}, "attention_dropout"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"type_vocab_size": -1}, "type_vocab_size"),
        ({"is_causal": True, "classifier_pooling": "first"}, "classifier_pooling"),
        ({"hidden_size": "64"}, "hidden_size"),  # wrong type
    ],
)
def test_invalid_configs_raise_value_error_naming_the_knob(kwargs, knob):
    with pytest.raises(ValueError, match=knob):
        tiny_config(**kwargs)


def test_alibi_with_flash_is_refused_when_set_later():
    model = TfmForCausalLM(tiny_config(position_embedding_type="alibi"))
    model.config._attn_implementation = "flash_attention_2"  # bypassing set_attn_implementation's checks
    with pytest.raises(ValueError, match="alibi"):
        model(input_ids=torch.tensor([[3, 4]]))


def test_valid_edge_combinations():
    tiny_config(num_key_value_heads=1)  # MQA
    tiny_config(norm_position="post", is_causal=False, classifier_pooling="mean")
    tiny_config(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    tiny_config(position_embedding_type="alibi", attn_implementation="sdpa")


def test_json_round_trip_is_lossless(tmp_path):
    config = tiny_config(
        position_embedding_type="rope",  # a scaled `rope_parameters` needs RoPE (refused with alibi)
        norm_type="layernorm",
        norm_position="post",
        ffn_type="mlp",
        hidden_act="gelu",
        num_key_value_heads=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        qk_norm=True,
        is_causal=False,
        classifier_pooling="mean",
        num_labels=5,
        type_vocab_size=2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    )
    config.save_pretrained(tmp_path)
    loaded = TfmConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert TfmConfig.from_dict(json.loads(config.to_json_string())).to_dict() == config.to_dict()
    assert loaded.layer_types == ["sliding_attention", "full_attention"]
    assert loaded.rope_parameters["factor"] == 2.0 and loaded.num_labels == 5


def test_auto_config(tmp_path):
    config = AutoConfig.for_model("hf_tfm", hidden_size=64, num_attention_heads=8)
    assert isinstance(config, TfmConfig) and config.head_dim == 8
    tiny_config(ffn_type="mlp").save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, TfmConfig) and loaded.ffn_type == "mlp"


def test_registration_is_idempotent():
    """Registering again (a re-import, or a second `_register()` call) is harmless and keeps the same classes."""
    import importlib

    from transformers import AutoModelForCausalLM

    import hf_tfm

    hf_tfm._register()
    importlib.reload(hf_tfm)
    config = AutoConfig.for_model("hf_tfm", vocab_size=99, hidden_size=32, num_attention_heads=4)
    assert type(AutoModelForCausalLM.from_config(config)).__name__ == "TfmForCausalLM"
