"""The encoder-decoder model against its invariants, over variants that differ per side.

Oracles: a full forward for cached decoding (every step), each source run alone for a padded batch, eager for sdpa,
`use_cache=False` for `generate()`, and a perturbed input for what each attention may and may not see.
"""

import logging
import math

import pytest
import torch
from conftest import build, cache_of, random_ids, tiny_seq2seq_config

from hf_tfm import TfmForConditionalGeneration, TfmSeq2SeqConfig, TfmSeq2SeqModel
from hf_tfm.configuration import TfmConfig
from hf_tfm.modeling import CACHE_NAME

ATOL = 1e-5
NEW = 8
LEARNED_POST = {"position_embedding_type": "learned", "norm_type": "layernorm", "norm_position": "post"}
VARIANTS = {
    # modern pre-norm on both sides; GQA and qk-norm in the decoder only
    "rope-gqa": ({}, {"num_key_value_heads": 2, "qk_norm": True}),
    # BART's block: learned positions behind an offset, post-norm, embedding norm, GELU MLP, biases everywhere
    "bart-like": (
        b := {
            **LEARNED_POST,
            "position_offset": 2,
            "embedding_norm": True,
            "ffn_type": "mlp",
            "hidden_act": "gelu",
            "attention_bias": True,
            "mlp_bias": True,
        },
        b,
    ),
    # Marian's: sinusoidal halves, post-norm, scaled embeddings, SiLU MLP
    "marian-like": (
        m := {
            "position_embedding_type": "sinusoidal",
            "sinusoidal_layout": "halves",
            "norm_type": "layernorm",
            "norm_position": "post",
            "embedding_scale": math.sqrt(32),
            "ffn_type": "mlp",
            "hidden_act": "swish",
        },
        m,
    ),
    # the two sides built differently, and a decoder with sliding-window self-attention (past the window below)
    "mixed-sides-swa": (
        {"position_embedding_type": "sinusoidal", "norm_position": "post", "norm_type": "layernorm"},
        {
            "position_embedding_type": "alibi",
            "sliding_window": 3,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "pre-norm-final-norm": (
        {**LEARNED_POST, "norm_position": "pre"},
        {"position_embedding_type": "rope", "num_hidden_layers": 3},
    ),
}


def make(variant: str, attn: str = "eager") -> TfmForConditionalGeneration:
    encoder, decoder = VARIANTS[variant]
    return build(TfmForConditionalGeneration, tiny_seq2seq_config(encoder, decoder), attn_implementation=attn)


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def model(request):
    return make(request.param)


def padded(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        ids[i, span], mask[i, span] = row, 1
    return ids, mask


def greedy(model, ids, mask, **kwargs):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs
    )


# --- the config


def test_each_side_is_a_full_tfm_config():
    config = tiny_seq2seq_config({"norm_position": "post"}, {"num_hidden_layers": 1, "num_key_value_heads": 1})
    assert (config.encoder.is_causal, config.encoder.add_cross_attention) == (False, False)
    assert (config.decoder.is_causal, config.decoder.add_cross_attention) == (True, True)
    assert (config.encoder.num_hidden_layers, config.decoder.num_hidden_layers) == (3, 1)
    assert config.decoder_start_token_id == config.decoder.bos_token_id == config.bos_token_id
    assert config.get_text_config(decoder=True) is config.decoder  # generate() sizes caches from it
    mirrored = TfmSeq2SeqConfig(encoder={"hidden_size": 64, "norm_position": "post", "num_hidden_layers": 3})
    assert (mirrored.decoder.hidden_size, mirrored.decoder.norm_position, mirrored.decoder.num_hidden_layers) == (
        64,
        "post",
        3,
    )
    assert mirrored.decoder.classifier_pooling == "last"  # re-derived for a decoder, not copied


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"encoder": {"hidden_size": 64}, "decoder": {"hidden_size": 32}}, r"`encoder.hidden_size`"),
        ({"encoder": {"is_causal": True}}, r"`encoder.is_causal`"),
        ({"encoder": TfmConfig()}, r"`encoder.is_causal`"),
        ({"decoder": TfmConfig()}, r"`decoder.add_cross_attention`"),
        ({"decoder": {"vocab_size": 50}}, r"`share_encoder_decoder_embeddings=True`"),
        ({"decoder_start_token_id": 5000}, r"`decoder_start_token_id`"),
        ({"decoder": {"parallel_residual": True}}, r"`add_cross_attention`.*`parallel_residual`"),
        ({"encoder": {"position_offset": -2, "position_embedding_type": "learned"}}, r"`position_offset`"),
    ],
)
def test_invalid_configs_name_the_knob(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TfmSeq2SeqConfig(**kwargs)


def test_unknown_keys_in_a_saved_config_are_kept_and_named(tmp_path, caplog):
    tiny_seq2seq_config().save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace('"sliding_window"', '"sliding_windw"', 1))
    with caplog.at_level(logging.WARNING):
        config = TfmSeq2SeqConfig.from_pretrained(tmp_path)
    assert "`sliding_windw` (did you mean `sliding_window`?)" in caplog.text
    assert any("sliding_windw" in side.to_dict() for side in (config.encoder, config.decoder))  # kept, saved back


# --- invariants over the variants


def test_cached_decoding_equals_full_forward_at_every_step(model):
    src = random_ids(2, 7, seed=1)
    mask = torch.ones_like(src)
    mask[1, 5:] = 0
    encoder_outputs = model.get_encoder()(input_ids=src, attention_mask=mask)
    target = random_ids(2, NEW, seed=2)
    with torch.no_grad():
        full = model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=target).logits
        cache, steps = None, []
        for t in range(NEW):
            out = model(
                encoder_outputs=encoder_outputs,
                attention_mask=mask,
                decoder_input_ids=target[:, t : t + 1],
                use_cache=True,
                **{CACHE_NAME: cache},
            )
            cache = cache_of(out)
            steps.append(out.logits[:, 0])
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=ATOL, rtol=0)
    assert cache.cross_attention_cache.get_seq_length() == src.shape[1]  # the source's keys, projected once


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_of_sources_equals_each_source_alone(model, side):
    sources = [random_ids(1, n, seed=n)[0] for n in (7, 3, 5)]
    ids, mask = padded(sources, side)
    target = random_ids(3, 4, seed=9)
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        for row, source in enumerate(sources):
            alone = model(input_ids=source[None], decoder_input_ids=target[row : row + 1]).logits
            torch.testing.assert_close(batched[row], alone[0], atol=ATOL, rtol=0)
    generated = greedy(model, ids, mask)
    for row, source in enumerate(sources):
        assert torch.equal(generated[row], greedy(model, source[None], torch.ones(1, len(source)))[0]), row


def test_padded_targets_equal_each_target_alone(model):
    src = random_ids(2, 6, seed=3)
    targets = [random_ids(1, n, seed=10 + n)[0] for n in (5, 2)]
    target, target_mask = padded(targets, "right")
    with torch.no_grad():
        batched = model(input_ids=src, decoder_input_ids=target, decoder_attention_mask=target_mask).logits
        for row, tokens in enumerate(targets):
            alone = model(input_ids=src[row : row + 1], decoder_input_ids=tokens[None]).logits
            torch.testing.assert_close(batched[row, : len(tokens)], alone[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sdpa_equals_eager(variant):
    src, target = random_ids(2, 7, seed=4), random_ids(2, 5, seed=5)
    mask = torch.ones_like(src)
    mask[0, 4:] = 0
    with torch.no_grad():
        logits = [
            make(variant, attn)(input_ids=src, attention_mask=mask, decoder_input_ids=target).logits
            for attn in ("eager", "sdpa")
        ]
    torch.testing.assert_close(logits[1], logits[0], atol=ATOL, rtol=0)


def test_what_each_attention_sees(model):
    """The encoder is bidirectional, decoder self-attention causal, cross-attention sees every real source token."""
    src, target = random_ids(1, 6, seed=6), random_ids(1, 5, seed=7)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])

    def run(source, tokens):
        with torch.no_grad():
            out = model(input_ids=source, attention_mask=mask, decoder_input_ids=tokens)
        return out.encoder_last_hidden_state[0], out.logits[0]

    encoder_states, logits = run(src, target)
    last_real = src.clone()
    last_real[0, 3] = (src[0, 3] + 1) % 99
    changed_encoder, changed_logits = run(last_real, target)
    assert not torch.allclose(changed_encoder[0], encoder_states[0])  # position 0 sees position 3: bidirectional
    assert (changed_logits - logits).abs().amax(-1).min() > 1e-4  # every target position sees every real source token
    pad = src.clone()
    pad[0, 5] = (src[0, 5] + 1) % 99
    torch.testing.assert_close(run(pad, target)[1], logits, atol=0, rtol=0)  # and no padded one
    later = target.clone()
    later[0, 3] = (target[0, 3] + 1) % 99
    _, later_logits = run(src, later)
    torch.testing.assert_close(later_logits[:3], logits[:3], atol=0, rtol=0)  # causal: no position sees the future
    assert not torch.allclose(later_logits[3:], logits[3:])


# --- generate()


def test_greedy_generate_with_and_without_cache(model):
    src = random_ids(2, 6, seed=8)
    mask = torch.ones_like(src)
    cached = greedy(model, src, mask)
    assert cached.shape == (2, 1 + NEW) and (cached[:, 0] == model.config.decoder_start_token_id).all()
    assert torch.equal(cached, greedy(model, src, mask, use_cache=False))
    with torch.no_grad():  # the sequence is the argmax chain of full forwards (EOS barred by min_new_tokens)
        logits = model(input_ids=src, attention_mask=mask, decoder_input_ids=cached[:, :-1]).logits
    logits[..., model.config.eos_token_id] = -torch.inf
    assert torch.equal(logits.argmax(-1), cached[:, 1:])


def test_static_cache_and_caller_encoder_outputs_equal_dynamic(model):
    src = random_ids(2, 6, seed=11)
    mask = torch.ones_like(src)
    mask[1, 4:] = 0
    dynamic = greedy(model, src, mask)
    assert torch.equal(greedy(model, src, mask, cache_implementation="static"), dynamic)
    encoder_outputs = model.get_encoder()(input_ids=src, attention_mask=mask)
    from_outputs = model.generate(
        encoder_outputs=encoder_outputs, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
    )
    assert torch.equal(from_outputs, dynamic)


def test_beam_search_and_sampling(model):
    src = random_ids(2, 6, seed=12)
    mask = torch.ones_like(src)
    beams = model.generate(
        input_ids=src, attention_mask=mask, max_new_tokens=NEW, num_beams=3, num_return_sequences=2, do_sample=False
    )
    assert beams.shape[0] == 4
    beams_no_cache = model.generate(
        input_ids=src,
        attention_mask=mask,
        max_new_tokens=NEW,
        num_beams=3,
        num_return_sequences=2,
        do_sample=False,
        use_cache=False,
    )
    assert torch.equal(beams, beams_no_cache)  # reordering the cache (both sub-caches) follows the beams
    sampled = []
    for use_cache in (True, False):  # the same draws with and without the cache
        torch.manual_seed(0)
        sampled.append(
            model.generate(
                input_ids=src, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=5, use_cache=use_cache
            )
        )
    assert torch.equal(*sampled)


# --- outputs and embeddings


def test_outputs_have_per_side_attentions_and_hidden_states():
    model = make("rope-gqa")
    src, target = random_ids(2, 7, seed=13), random_ids(2, 5, seed=14)
    out = model(input_ids=src, decoder_input_ids=target, output_attentions=True, output_hidden_states=True)
    assert len(out.encoder_attentions) == 3 and out.encoder_attentions[0].shape == (2, 4, 7, 7)
    assert len(out.decoder_attentions) == 2 and out.decoder_attentions[0].shape == (2, 4, 5, 5)
    assert len(out.cross_attentions) == 2 and out.cross_attentions[0].shape == (2, 4, 5, 7)
    assert len(out.encoder_hidden_states) == 4 and len(out.decoder_hidden_states) == 3
    base = build(TfmSeq2SeqModel, model.config)
    base.load_state_dict(model.model.state_dict())
    torch.testing.assert_close(
        base(input_ids=src, decoder_input_ids=target).last_hidden_state, out.decoder_hidden_states[-1], atol=0, rtol=0
    )


@pytest.mark.parametrize("variant", ["rope-gqa", "marian-like"])
def test_inputs_embeds_equal_ids(variant):
    model = make(variant)
    src, target = random_ids(2, 7, seed=15), random_ids(2, 5, seed=16)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        by_ids = model(input_ids=src, decoder_input_ids=target).logits
        by_embeds = model(inputs_embeds=embed(src), decoder_inputs_embeds=embed(target)).logits
    torch.testing.assert_close(by_embeds, by_ids, atol=0, rtol=0)


def test_embeddings_are_shared_and_tied_as_configured():
    model = build(TfmForConditionalGeneration, tiny_seq2seq_config())
    tokens = model.model.encoder.embed_tokens.weight
    assert model.model.decoder.embed_tokens.weight is tokens and model.lm_head.weight is tokens
    separate = build(
        TfmForConditionalGeneration,
        tiny_seq2seq_config(decoder={"vocab_size": 50}, share_encoder_decoder_embeddings=False),
    )
    assert separate.model.decoder.embed_tokens.weight.shape == (50, 32)
    assert separate.lm_head.weight is separate.model.decoder.embed_tokens.weight  # tied to the decoder's table
    assert separate.model.encoder.embed_tokens.weight.shape == (99, 32)
    untied = build(TfmForConditionalGeneration, tiny_seq2seq_config(tie_word_embeddings=False))
    assert untied.model.decoder.embed_tokens.weight is untied.model.encoder.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.encoder.embed_tokens.weight


# --- training contract


def test_loss_is_computed_on_aligned_logits():
    """The decoder inputs are the shifted labels: the loss must not shift again (transformers' double-shift test)."""
    model = make("bart-like")
    src, labels = random_ids(2, 6, seed=17), random_ids(2, 5, seed=18)
    labels[1, 3:] = -100
    out = model(input_ids=src, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 99), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    assert decoder_input_ids[:, 0].eq(model.config.decoder_start_token_id).all()
    assert torch.equal(decoder_input_ids[0, 1:], labels[0, :-1])
    assert decoder_input_ids[1, 4] == model.config.pad_token_id  # -100 became padding
    explicit = model(input_ids=src, decoder_input_ids=decoder_input_ids, labels=labels)
    torch.testing.assert_close(explicit.logits, out.logits, atol=0, rtol=0)


# --- bad input


def test_bad_inputs_raise_clear_errors():
    model = make("bart-like")
    src = random_ids(2, 6, seed=19)
    with pytest.raises(ValueError, match=r"`decoder_input_ids` or `decoder_inputs_embeds`.*`labels`"):
        model(input_ids=src)
    with pytest.raises(ValueError, match=r"`decoder_input_ids` must lie in \[0, 99\)"):
        model(input_ids=src, decoder_input_ids=torch.tensor([[1, 120], [1, 2]]))
    with pytest.raises(ValueError, match=r"decoder's learned positions: max_position_embeddings=64"):
        model(input_ids=src, decoder_input_ids=random_ids(2, 65, seed=20))
    with pytest.raises(ValueError, match=r"`attention_mask` has shape \(2, 5\) but the inputs need \(2, 6\)"):
        model(input_ids=src, attention_mask=torch.ones(2, 5, dtype=torch.long), decoder_input_ids=src)
    encoder_outputs = model.get_encoder()(input_ids=src)
    with pytest.raises(ValueError, match=r"source's `attention_mask` has shape \(2, 4\)"):
        model(encoder_outputs=encoder_outputs, attention_mask=torch.ones(2, 4), decoder_input_ids=src)
    with pytest.raises(ValueError, match=r"`decoder_attention_mask` has shape"):
        model(input_ids=src, decoder_input_ids=src, decoder_attention_mask=torch.ones(2, 3))


def test_resizing_the_shared_token_table_resizes_both_sides():
    model = make("rope-gqa")
    model.resize_token_embeddings(120)
    assert (model.config.encoder.vocab_size, model.config.decoder.vocab_size) == (120, 120)
    tokens = model.model.encoder.embed_tokens.weight
    assert (
        tokens.shape == (120, 32)
        and model.model.decoder.embed_tokens.weight is tokens
        and model.lm_head.weight is tokens
    )
    assert model(input_ids=torch.tensor([[110, 5]]), decoder_input_ids=torch.tensor([[1, 115]])).logits.shape == (
        1,
        2,
        120,
    )
    separate = build(
        TfmForConditionalGeneration,
        tiny_seq2seq_config(decoder={"vocab_size": 50}, share_encoder_decoder_embeddings=False),
    )
    with pytest.raises(ValueError, match="resize them one by one"):
        separate.resize_token_embeddings(120)


# --- what generic transformers code expects of an encoder-decoder (its generation tests check these)


def test_top_level_sizes_read_like_barts():
    config = tiny_seq2seq_config({"num_attention_heads": 2}, {"vocab_size": 99, "num_hidden_layers": 1})
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers, config.vocab_size) == (
        32,
        2,
        3,
        99,
    )
    assert config.get_text_config(decoder=True) is config.decoder  # cache sizing reads the decoder's depth
    config.vocab_size = 120  # one shared table: both sides follow
    assert config.encoder.vocab_size == config.decoder.vocab_size == 120


def test_the_decoder_alone_is_a_causal_lm():
    """Without `encoder_hidden_states` the decoder skips cross-attention, as BART's does: it equals a decoder built
    without cross-attention holding the same weights."""
    model = make("rope-gqa")
    decoder = model.get_decoder()
    plain_config = TfmConfig(**{**decoder.config.to_dict(), "add_cross_attention": False})
    plain = build(type(decoder), plain_config)
    missing, unexpected = plain.load_state_dict(decoder.state_dict(), strict=False)
    assert not missing and all("encoder_attn" in k or "cross_attn_norm" in k for k in unexpected)
    ids = random_ids(2, 7, seed=21)
    with torch.no_grad():
        torch.testing.assert_close(decoder(input_ids=ids).last_hidden_state, plain(input_ids=ids).last_hidden_state)
        step = decoder(input_ids=ids[:, :-1], use_cache=True)  # and it decodes with a cache
        last = decoder(input_ids=ids[:, -1:], **{CACHE_NAME: cache_of(step)}).last_hidden_state
    torch.testing.assert_close(last, plain(input_ids=ids).last_hidden_state[:, -1:], atol=ATOL, rtol=0)


@pytest.mark.slow  # inductor compiles on CPU
@pytest.mark.parametrize("variant", ["bart-like", "rope-gqa"])
def test_compiled_static_generate_is_fullgraph_and_equals_eager(variant):
    """generate() with a static cache compiles the forward with fullgraph=True (no decoder mask: positions come from
    the cache length, a tensor under compile) and gives eager's tokens."""
    from transformers import CompileConfig

    model = make(variant, attn="sdpa")
    src = random_ids(2, 6, seed=22)
    mask = torch.ones_like(src)
    mask[1, 4:] = 0
    compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    compile_config._compile_all_devices = True  # generate() compiles only on accelerators unless told (private flag)
    compiled = greedy(model, src, mask, cache_implementation="static", compile_config=compile_config)
    assert torch.equal(compiled, greedy(model, src, mask))


def test_router_logits_of_both_sides():
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    model = build(TfmForConditionalGeneration, tiny_seq2seq_config(moe, moe))
    src, tgt = random_ids(2, 6, seed=23), random_ids(2, 5, seed=24)
    out = model(input_ids=src, decoder_input_ids=tgt, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (2 * 5, 4)  # the decoder's layers
    assert len(out.encoder_router_logits) == 3 and out.encoder_router_logits[0].shape == (2 * 6, 4)
    assert not model(input_ids=src, decoder_input_ids=tgt).router_logits  # off by default, as the config says
    assert type(make("rope-gqa")(input_ids=src, decoder_input_ids=tgt)).__name__ == "Seq2SeqLMOutput"  # dense
