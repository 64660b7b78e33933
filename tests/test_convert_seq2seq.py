"""Exact-parity import from / export to transformers' encoder-decoder families: BART, mBART (pre-norm) and Marian.

Tiny random in-tree models with different encoder and decoder depths and head counts (nothing downloaded), random
non-trivial norms, biases and `final_logits_bias`, so a mis-mapped weight cannot hide behind 1s and 0s. Sources and
targets are right-padded, as these families' tokenizers pad: logits within 1e-5 in fp32 on real target tokens under
eager and sdpa, identical greedy and beam generations, round trips with identical weights and config.
"""

import json
import math

import pytest
import torch
import transformers
from transformers import AutoModelForSeq2SeqLM

import hf_tfm
from hf_tfm.convert import convert_path, from_hf, in_tree_blockers, to_hf
from hf_tfm.modeling import CACHE_NAME

ATOL = 1e-5
VOCAB = 64
SIZES = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "encoder_layers": 3,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 40,
    "max_position_embeddings": 64,
    "init_std": 0.2,  # clearly token-dependent logits: 1e-5 is a real check
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
MARIAN = {**SIZES, "decoder_start_token_id": 1, "scale_embedding": True, "activation_function": "swish"}
CASES = {
    "bart-lm": ("BartForConditionalGeneration", "BartConfig", SIZES),
    "bart-base": ("BartModel", "BartConfig", SIZES),
    "bart-lm-scaled-untied": (
        "BartForConditionalGeneration",
        "BartConfig",
        {**SIZES, "scale_embedding": True, "tie_word_embeddings": False},
    ),
    "mbart-lm": ("MBartForConditionalGeneration", "MBartConfig", {**SIZES, "scale_embedding": True}),
    "marian-lm": ("MarianMTModel", "MarianConfig", MARIAN),
    "marian-base": ("MarianModel", "MarianConfig", MARIAN),
    "marian-lm-own-decoder-vocab": (
        "MarianMTModel",
        "MarianConfig",
        {**MARIAN, "share_encoder_decoder_embeddings": False, "decoder_vocab_size": 50},
    ),
}
LMS = [name for name, (cls, _, _) in CASES.items() if not cls.endswith("Model") or cls == "MarianMTModel"]


def build(case: str, attn: str = "sdpa"):
    cls_name, config_name, kwargs = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = attn
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("bias", "final_logits_bias")) or "norm" in name:
                tensor.add_(torch.randn_like(tensor) * 0.1)
    return model


def batch(model) -> dict:
    """Right-padded sources and targets of different lengths (the targets within the decoder's vocabulary)."""
    torch.manual_seed(1)
    decoder_vocab = getattr(model.config, "decoder_vocab_size", None) or VOCAB
    src, tgt = torch.randint(3, VOCAB, (3, 9)), torch.randint(3, decoder_vocab, (3, 6))
    mask, tgt_mask = torch.ones_like(src), torch.ones_like(tgt)
    mask[1, 6:], mask[2, 3:], tgt_mask[2, 4:] = 0, 0, 0
    pad = model.config.pad_token_id
    return {
        "input_ids": src.masked_fill(mask == 0, pad),
        "attention_mask": mask,
        "decoder_input_ids": tgt.masked_fill(tgt_mask == 0, pad),
        "decoder_attention_mask": tgt_mask,
    }


def outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_in_tree(case, attn):
    reference = build(case, attn)
    ours = from_hf(reference)
    assert type(ours).__name__ == ("TfmSeq2SeqModel" if case.endswith("base") else "TfmForConditionalGeneration")
    assert ours.config._attn_implementation == attn
    inputs = batch(reference)
    expected, got = outputs(reference, inputs), outputs(ours, inputs)
    assert got.shape == expected.shape
    diff = (got - expected).abs()[inputs["decoder_attention_mask"].bool()]  # padded targets are don't-care
    assert diff.max().item() <= ATOL, f"{case}/{attn}: max |diff| = {diff.max().item():.2e}"


@pytest.mark.parametrize("case", LMS)
def test_greedy_and_beam_generations_match_in_tree(case):
    reference = build(case)
    ours = from_hf(reference)
    inputs = {k: v for k, v in batch(reference).items() if not k.startswith("decoder")}
    for kwargs in ({"num_beams": 1}, {"num_beams": 3, "num_return_sequences": 2}):
        kwargs |= {"max_new_tokens": 12, "do_sample": False}
        try:
            expected = reference.generate(**inputs, **kwargs)
        except RuntimeError:  # before 5.2x, beam search sizes Marian's scores by the *source* vocabulary (upstream)
            assert case == "marian-lm-own-decoder-vocab" and CACHE_NAME == "past_key_values"
            assert ours.generate(**inputs, **kwargs).shape[0] == 6  # ours runs: it reads the decoder's vocabulary
            continue
        assert torch.equal(ours.generate(**inputs, **kwargs), expected), kwargs


IGNORED_CONFIG_KEYS = {"architectures", "transformers_version", "_name_or_path", "dtype"}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_exact(case):
    reference = build(case, "eager")
    back = to_hf(from_hf(reference))
    assert type(back) is type(reference)
    expected, got = reference.state_dict(), back.state_dict()
    assert got.keys() == expected.keys()
    if not reference.config.tie_word_embeddings and "model.shared.weight" in expected:
        # Untied, BART's `shared` table feeds nothing (each side reads its own): it comes back as the encoder's.
        expected["model.shared.weight"] = expected["model.encoder.embed_tokens.weight"]
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    want = {k: v for k, v in reference.config.to_dict().items() if k not in IGNORED_CONFIG_KEYS}
    have = {k: v for k, v in back.config.to_dict().items() if k not in IGNORED_CONFIG_KEYS}
    if want["decoder_start_token_id"] is None:  # mBART's default: generate() starts from bos; hf_tfm says so
        want["decoder_start_token_id"] = want["bos_token_id"]
    assert have == want
    if reference.can_generate():  # forced_eos_token_id and the like survive the trip
        assert back.generation_config.to_diff_dict() == reference.generation_config.to_diff_dict()


def test_imported_configs_use_general_knobs():
    bart = from_hf(build("bart-lm")).config
    assert (bart.encoder.num_hidden_layers, bart.decoder.num_hidden_layers) == (3, 2)
    assert (bart.encoder.num_attention_heads, bart.decoder.num_attention_heads) == (4, 2)
    assert (bart.encoder.position_offset, bart.decoder.embedding_norm, bart.decoder.lm_head_bias) == (2, True, True)
    assert (bart.decoder.norm_position, bart.decoder.final_norm, bart.decoder_start_token_id) == ("post", False, 2)
    mbart = from_hf(build("mbart-lm")).config
    assert (mbart.encoder.norm_position, mbart.encoder.final_norm) == ("pre", True)
    assert mbart.encoder.embedding_scale == math.sqrt(32)
    marian = from_hf(build("marian-lm-own-decoder-vocab")).config
    assert (marian.encoder.position_embedding_type, marian.encoder.sinusoidal_layout) == ("sinusoidal", "halves")
    assert (marian.encoder.vocab_size, marian.decoder.vocab_size) == (VOCAB, 50)
    assert not marian.share_encoder_decoder_embeddings and marian.decoder.hidden_act == "swish"


def test_unexportable_config_names_every_blocking_knob():
    side = {"hidden_size": 32, "num_attention_heads": 4, "vocab_size": VOCAB}
    config = hf_tfm.TfmSeq2SeqConfig(encoder=side, decoder={**side, "num_key_value_heads": 2})
    with pytest.raises(ValueError) as err:
        to_hf(hf_tfm.TfmForConditionalGeneration(config))
    message = str(err.value)
    for knob in ("encoder.position_embedding_type", "decoder.num_key_value_heads", "decoder.norm_type"):
        assert f"`{knob}`" in message, knob
    blockers = in_tree_blockers(config, "seq2seq_lm")
    assert set(blockers) == {"bart", "mbart", "marian"}  # decoder-only and encoder families are not candidates
    ours = from_hf(build("bart-lm")).config
    ours.decoder.hidden_act = "relu"  # BART has one activation for both sides
    assert any(b.startswith("`decoder.hidden_act`") for b in in_tree_blockers(ours, "seq2seq_lm")["bart"])


def test_a_trained_marian_position_table_is_refused():
    reference = build("marian-lm")
    with torch.no_grad():
        reference.model.encoder.embed_positions.weight.mul_(1.5)
    with pytest.raises(ValueError, match=r"embed_positions.weight` is not the sinusoid"):
        from_hf(reference)


@pytest.mark.parametrize("case", ["bart-lm", "mbart-lm", "marian-lm-own-decoder-vocab"])
def test_convert_path_both_directions(tmp_path, case):
    reference = build(case)
    reference.save_pretrained(tmp_path / "in_tree")
    convert_path(tmp_path / "in_tree", tmp_path / "tfm")
    assert json.loads((tmp_path / "tfm" / "config.json").read_text())["model_type"] == "hf_tfm_seq2seq"
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "tfm")
    assert type(ours).__name__ == "TfmForConditionalGeneration"
    convert_path(tmp_path / "tfm", tmp_path / "back")
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["model_type"] == reference.config.model_type and "auto_map" not in saved
    assert not list((tmp_path / "back").glob("*.py"))
    back = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "back")  # plain transformers: no remote code involved
    assert type(back) is type(reference)
    inputs = batch(reference)
    torch.testing.assert_close(outputs(back, inputs), outputs(reference, inputs), rtol=0, atol=0)
