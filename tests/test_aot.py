"""`hf_tfm.aot.AotDecoder`: greedy decoding through an AOTInductor-compiled step gives `generate()`'s tokens."""

import pytest
import torch
from conftest import tiny_seq2seq_config
from export_models import CYCLE, NEW_TOKENS, trained
from test_inference import FUSABLE

from hf_tfm import TfmForConditionalGeneration, load_for_inference
from hf_tfm.aot import AotDecoder
from hf_tfm.kernels import native_kernels_available

# two prompts of one length, taken at different places of the cycle the tiny model learnt
PROMPTS = torch.tensor([[1, *CYCLE[3:12]], [1, *CYCLE[30:39]]])
MAX_LENGTH = PROMPTS.shape[1] + NEW_TOKENS


@pytest.mark.parametrize(
    "quantize",
    [None, pytest.param("q4", marks=pytest.mark.skipif(not native_kernels_available(), reason="no native kernel"))],
)
def test_aot_greedy_equals_generate_and_stops_where_generate_stops(quantize, tmp_path):
    """The compiled step's tokens are `generate()`'s, for one prompt and for two decoded together; with an end token
    that one sequence makes early and the other later, both stop and pad as `generate()` does."""
    trained(FUSABLE).save_pretrained(tmp_path)  # widths the int4 kernel takes
    model = load_for_inference(tmp_path, quantize=quantize)
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(PROMPTS, attention_mask=torch.ones_like(PROMPTS), eos_token_id=[], **options)
    assert expected.shape[1] == MAX_LENGTH
    single = AotDecoder(model, MAX_LENGTH)
    assert torch.equal(single.generate(PROMPTS[:1], NEW_TOKENS, eos_token_id=[]), expected[:1])
    # again: a new prompt restarts the cache the last call filled
    assert torch.equal(single.generate(PROMPTS[1:], NEW_TOKENS, eos_token_id=[]), expected[1:])

    pair = AotDecoder(model, MAX_LENGTH, batch_size=2)
    assert torch.equal(pair.generate(PROMPTS, NEW_TOKENS, eos_token_id=[]), expected)
    new = expected[:, PROMPTS.shape[1] :].tolist()
    # end tokens that row 0 makes at its 4th step and row 1 at its 11th: row 0 stops and pads, then row 1 stops
    end = [new[0][3], new[1][10]]
    assert end[0] not in new[1][:10] and end[1] not in new[0][:4]
    stopped = model.generate(PROMPTS, attention_mask=torch.ones_like(PROMPTS), eos_token_id=end, **options)
    assert stopped.shape[1] < MAX_LENGTH
    assert torch.equal(pair.generate(PROMPTS, NEW_TOKENS, eos_token_id=end), stopped)


def test_aot_mixture_of_experts_decodes_generate_s_tokens(tmp_path):
    """A mixture-of-experts step exports with every expert run and weighted by its routing weight (zero where not
    chosen, as the ExecuTorch export does): the same greedy tokens as `generate()`'s routed experts."""
    trained({"num_experts": 4, "num_experts_per_tok": 2}).save_pretrained(tmp_path)
    model = load_for_inference(tmp_path, compile=False)
    expected = model.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    assert torch.equal(AotDecoder(model, MAX_LENGTH).generate(PROMPTS[:1], NEW_TOKENS, eos_token_id=[]), expected)


def test_aot_decoder_refuses_what_it_was_not_compiled_for(tmp_path):
    trained({}).save_pretrained(tmp_path)
    model = load_for_inference(tmp_path, compile=False)
    with pytest.raises(ValueError, match="max_length"):
        AotDecoder(model, model.config.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="decoder-only"):
        AotDecoder(TfmForConditionalGeneration(tiny_seq2seq_config()), MAX_LENGTH)
    decoder = AotDecoder(model, MAX_LENGTH)
    with pytest.raises(ValueError, match="batch_size=1"):
        decoder.generate(PROMPTS, NEW_TOKENS)
    with pytest.raises(ValueError, match="max_length"):
        decoder.generate(PROMPTS[:1], NEW_TOKENS + 1)


def test_cli_generate_aot_prints_the_greedy_continuation(tmp_path, capsys):
    """`hf-tfm generate --greedy --aot` prints what `--greedy` prints; without --greedy it refuses."""
    from export_models import saved, train_tokenizer

    from hf_tfm.cli import main

    folder = saved({}, tmp_path / "lm", train_tokenizer())
    argv = ["generate", str(folder), "--prompt", "def f", "--max-new-tokens", "6", "--no-stream"]
    assert main([*argv, "--greedy"]) == 0
    expected = capsys.readouterr().out
    assert main([*argv, "--greedy", "--aot"]) == 0
    assert capsys.readouterr().out == expected
    assert main([*argv, "--aot"]) != 0
    assert "--aot decodes greedily" in capsys.readouterr().err


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_aot_step_computes_attention_in_its_own_loops(attention, tmp_path, monkeypatch):
    """Whatever the model's attention, the step is exported with eager attention, which Inductor fuses into a loop of
    its own per layer: SDPA is never traced, so no SDPA library call runs in a step (one costs about 50 us on CPU, a
    fifth of a q4 step on the bench's base shape). The model keeps its own implementation, and decodes as before."""
    trained({}).save_pretrained(tmp_path)
    model = load_for_inference(tmp_path, compile=False)
    model.set_attn_implementation(attention)
    expected = model.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    traced = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: traced.append(1) or sdpa(*a, **k)
    )
    decoder = AotDecoder(model, MAX_LENGTH)
    assert not traced
    assert model.config._attn_implementation == attention
    assert torch.equal(decoder.generate(PROMPTS[:1], NEW_TOKENS, eos_token_id=[]), expected)
    assert traced or attention == "eager"  # the prompt ran through the model's own attention
