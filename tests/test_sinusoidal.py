"""Sinusoidal positions: the paper's interleaved table by default, the halves table (Marian) by choice, and configs
saved before the choice existed still load as the halves table they were built with. Token embeddings are scaled by
sqrt(hidden_size) by default (the paper's), and configs saved unscaled still load unscaled."""

import json

import pytest
import torch
from conftest import build, paper_table, random_ids, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

from hf_tfm import TfmConfig, TfmForCausalLM
from hf_tfm.modeling import TfmSinusoidalEmbedding
from hf_tfm.presets import load_config

LENGTH = 64


def table(dim: int, layout: str) -> torch.Tensor:
    module = TfmSinusoidalEmbedding(tiny_config(hidden_size=dim, position_embedding_type="sinusoidal", head_dim=8,
                                                sinusoidal_layout=layout))  # fmt: skip
    return module(torch.arange(LENGTH)[None], torch.float32)[0]


@pytest.mark.parametrize("dim", [32, 33])
def test_interleaved_is_the_papers_formula(dim):
    """sin at even dimensions, cos at odd ones; an odd width drops the last cosine."""
    interleaved, halves = table(dim, "interleaved"), table(dim, "halves")
    # The same numbers, only laid out differently: exactly equal once the columns are permuted.
    sines = (dim + 1) // 2
    assert torch.equal(interleaved[:, 0::2], halves[:, :sines])
    assert torch.equal(interleaved[:, 1::2], halves[:, sines:])
    # And against the formula written out element by element in fp64: hf_tfm's angles are fp32 (as the tutorials'),
    # so they drift by ~1e-7 x position; measured 1.9e-6 at positions < 64.
    torch.testing.assert_close(interleaved.double(), paper_table(LENGTH, dim), rtol=0, atol=3e-6)
    assert torch.equal(interleaved[0, 0::2], torch.zeros(sines)) and torch.equal(
        interleaved[0, 1::2], torch.ones(dim // 2)
    )


@pytest.mark.parametrize("dim", [32, 33])
def test_halves_matches_marian(dim):
    marian = MarianSinusoidalPositionalEmbedding(LENGTH, dim).create_weight()  # fp64 numpy, rounded to fp32
    torch.testing.assert_close(table(dim, "halves"), marian, rtol=0, atol=3e-6)


def test_default_and_knob_validation():
    assert TfmConfig(position_embedding_type="sinusoidal").sinusoidal_layout == "interleaved"
    assert TfmConfig().sinusoidal_layout == "interleaved"  # the default is accepted with any position type
    assert TfmConfig(sinusoidal_layout="halves").sinusoidal_layout == "halves"  # rope: accepted, warned, unused
    with pytest.raises(ValueError, match="sinusoidal_layout"):
        TfmConfig(position_embedding_type="sinusoidal", sinusoidal_layout="paper")


def test_config_saved_before_the_knob_loads_as_halves(tmp_path):
    """A config.json without `sinusoidal_layout` (any sinusoidal checkpoint from before it) is the halves table."""
    model = build(TfmForCausalLM, tiny_config(position_embedding_type="sinusoidal", sinusoidal_layout="halves"))
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    saved = json.loads(config_file.read_text())
    del saved["sinusoidal_layout"]
    config_file.write_text(json.dumps(saved))

    assert AutoConfig.from_pretrained(tmp_path).sinusoidal_layout == "halves"
    assert TfmConfig.from_json_file(config_file).sinusoidal_layout == "halves"
    assert TfmConfig.from_dict(saved).sinusoidal_layout == "halves"
    assert load_config(tmp_path).sinusoidal_layout == "halves"
    # ... while a fresh or hand-written config (no `transformers_version`) gets the paper's layout
    hand_written = {k: v for k, v in saved.items() if k != "transformers_version"}
    assert TfmConfig.from_dict(hand_written).sinusoidal_layout == "interleaved"
    # a saved non-sinusoidal config is untouched (and still valid)
    assert TfmConfig.from_dict({**saved, "position_embedding_type": "rope"}).sinusoidal_layout == "interleaved"

    # from_pretrained builds on meta and rebuilds the table in _init_weights: same logits as the saved model
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = random_ids(2, 9)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
        interleaved = build(TfmForCausalLM, tiny_config(position_embedding_type="sinusoidal"))
        interleaved.load_state_dict(model.state_dict())
        assert not torch.allclose(interleaved(input_ids=ids).logits, model(input_ids=ids).logits)


# --- `embedding_scale`: sqrt(hidden_size) by default with sinusoidal positions, and configs saved before keep theirs


def test_embedding_scale_defaults_to_sqrt_hidden_size_with_sinusoidal_positions():
    config = TfmConfig(hidden_size=64, position_embedding_type="sinusoidal")
    assert config.embedding_scale == 8.0 and config.to_dict()["embedding_scale"] == 8.0  # saved as the number
    assert TfmConfig(hidden_size=64, position_embedding_type="sinusoidal", embedding_scale=1.0).embedding_scale == 1.0
    for position in ("rope", "learned", "alibi"):
        assert TfmConfig(hidden_size=64, position_embedding_type=position).embedding_scale == 1.0
    paper = load_config("transformer-base")
    assert paper.encoder.embedding_scale == paper.decoder.embedding_scale == 512**0.5
    # The token table starts with std 1/sqrt(hidden_size) with the paper's scale, at initializer_range otherwise
    for scale, std in ((None, 64**-0.5), (1.0, 0.2), (2.0, 0.2)):
        model = build(
            TfmForCausalLM, tiny_config(hidden_size=64, position_embedding_type="sinusoidal", embedding_scale=scale)
        )
        assert abs(model.model.embed_tokens.weight.std().item() / std - 1) < 0.05, (scale, std)


def test_config_saved_before_the_default_keeps_its_embedding_scale(tmp_path):
    """A sinusoidal checkpoint saved unscaled (`embedding_scale: 1.0`, or no key: saved before the knob existed) loads
    with 1.0 and computes what it computed; a hand-written config without the key gets the new default."""
    model = build(TfmForCausalLM, tiny_config(position_embedding_type="sinusoidal", embedding_scale=1.0))
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    saved = json.loads(config_file.read_text())
    assert saved["embedding_scale"] == 1.0
    ids = random_ids(2, 9)
    for keep_key in (True, False):
        if not keep_key:
            del saved["embedding_scale"]
            config_file.write_text(json.dumps(saved))
            assert TfmConfig.from_json_file(config_file).embedding_scale == 1.0
            assert TfmConfig.from_dict(saved).embedding_scale == 1.0
            assert load_config(tmp_path).embedding_scale == 1.0
        assert AutoConfig.from_pretrained(tmp_path).embedding_scale == 1.0
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
        assert loaded.config.embedding_scale == 1.0
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    hand_written = {k: v for k, v in saved.items() if k != "transformers_version"}
    assert TfmConfig.from_dict(hand_written).embedding_scale == 32**0.5
