"""The compiled decode step (`hf_tfm.inference.aot`): `generate()`'s one-token steps through an AOTInductor library
give the model's own tokens, for every `generate()` feature.

The oracle is the same checkpoint loaded without the step (`load_for_inference(..., compile=False)`, the model's eager
forward): greedy tokens equal, and sampled ones with the same seed (the step's logits equal the eager ones within
float tolerance, 1e-5 here, so a seeded draw picks the same tokens). Each test also counts the library's calls, so a
step that silently fell back to the model's forward fails. The models are tests/export_models.py's, trained on a token
cycle so each greedy step has a clear winner; one library (batch and cache length dynamic) serves every test of a
model.
"""

import inspect

import pytest
import torch
from conftest import tiny_seq2seq_config
from export_models import CYCLE, NEW_TOKENS, saved, train_tokenizer, trained
from test_inference import FUSABLE
from transformers import AutoTokenizer, TextIteratorStreamer, pipeline

from hf_tfm import TfmForConditionalGeneration, load_for_inference
from hf_tfm.inference.aot import CompiledDecodeStep, install, step_blockers
from hf_tfm.inference.kernels import native_kernels_available

# Each test compiles a decode step (seconds to tens of seconds): CI runs them on the release range's ends only
pytestmark = pytest.mark.slow

PROMPTS = torch.tensor([[1, *CYCLE[3:12]], [1, *CYCLE[30:39]]])  # two prompts of one length
# a left-padded batch of three prompts of different lengths (pad id 0)
PADDED = torch.tensor([[0, 0, 0, 0, 1, *CYCLE[3:8]], [1, *CYCLE[20:29]], [0, 0, 1, *CYCLE[40:47]]])
PADDED_MASK = (PADDED != 0).long()


def loaded(folder, quantize=None):
    """(the model with the compiled step, the same checkpoint decoding eagerly)."""
    fast = load_for_inference(folder, quantize=quantize)
    assert isinstance(fast.compiled_decode_step, CompiledDecodeStep)
    return fast, load_for_inference(folder, quantize=quantize, compile=False)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """The cycle model saved with a tokenizer (for stop strings, streamers, pipelines), fast and eager."""
    folder = saved(FUSABLE, tmp_path_factory.mktemp("lm") / "lm", train_tokenizer())
    return loaded(folder)


def steps(model) -> int:
    return model.compiled_decode_step.calls


def generate_both(pair, seed: int | None = None, **options):
    """The fast model's output and the eager one's, each drawn from the same seed, and the fast model's step count."""
    outputs, before = [], steps(pair[0])
    for model in pair:
        if seed is not None:
            torch.manual_seed(seed)
        outputs.append(model.generate(**options))
    return *outputs, steps(pair[0]) - before


def test_greedy_left_padded_batch_equals_eager(lm):
    fast, eager, calls = generate_both(
        lm,
        input_ids=PADDED,
        attention_mask=PADDED_MASK,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    assert torch.equal(fast, eager)
    assert calls == NEW_TOKENS - 1  # every token but the one the prompt gives


def test_step_logits_equal_the_forward_s(lm):
    fast, eager, _ = generate_both(
        lm,
        input_ids=PADDED,
        attention_mask=PADDED_MASK,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    # float32 sums in another order: a few units in the last place of the larger logits
    torch.testing.assert_close(torch.stack(fast.logits), torch.stack(eager.logits), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7},
        {"top_k": 5},
        {"top_p": 0.8, "temperature": 1.3},
        {"repetition_penalty": 1.5, "top_k": 20},
        {"num_return_sequences": 3, "top_p": 0.9},
    ],
    ids=["temperature", "top-k", "top-p", "repetition-penalty", "num-return-sequences"],
)
def test_seeded_sampling_equals_eager(lm, sampling):
    fast, eager, calls = generate_both(
        lm,
        seed=7,
        input_ids=PADDED,
        attention_mask=PADDED_MASK,
        max_new_tokens=12,
        do_sample=True,
        pad_token_id=0,
        **sampling,
    )
    assert torch.equal(fast, eager) and calls > 0


def test_beam_search_equals_eager(lm):
    # 3 beams of 3 prompts: the batch of 9 rows that num_return_sequences=3 compiled its library for
    fast, eager, calls = generate_both(
        lm,
        input_ids=PADDED,
        attention_mask=PADDED_MASK,
        max_new_tokens=10,
        num_beams=3,
        do_sample=False,
        pad_token_id=0,
    )
    assert torch.equal(fast, eager) and calls > 0


def test_stop_strings_and_streamer(lm):
    tokenizer = AutoTokenizer.from_pretrained(lm[0].name_or_path)
    prompt = torch.tensor([[1, *CYCLE[3:12]]])
    full = lm[1].generate(prompt, max_new_tokens=20, do_sample=False)
    stop = tokenizer.decode(full[0, prompt.shape[1] + 6 : prompt.shape[1] + 7])  # a piece the 7th new token decodes to
    fast, eager, _ = generate_both(
        lm, input_ids=prompt, max_new_tokens=20, do_sample=False, stop_strings=[stop], tokenizer=tokenizer
    )
    assert torch.equal(fast, eager) and fast.shape[1] < full.shape[1]
    streamer = TextIteratorStreamer(tokenizer)
    out = lm[0].generate(prompt, max_new_tokens=12, do_sample=False, streamer=streamer)
    assert "".join(streamer) == tokenizer.decode(out[0])


def test_text_generation_pipeline_takes_the_step(lm):
    fast, eager = lm
    before = steps(fast)
    texts = [
        pipeline("text-generation", model=model, tokenizer=model.name_or_path)(
            "def f", max_new_tokens=8, do_sample=False
        )
        for model in (fast, eager)
    ]
    assert texts[0] == texts[1] and steps(fast) > before


@pytest.mark.skipif(not native_kernels_available(), reason="no native kernel")
def test_q4_greedy_equals_eager(tmp_path):
    trained(FUSABLE).save_pretrained(tmp_path)
    pair = loaded(tmp_path, quantize="q4")
    fast, eager, calls = generate_both(
        pair,
        input_ids=PADDED,
        attention_mask=PADDED_MASK,
        max_new_tokens=16,
        min_new_tokens=16,
        do_sample=False,
        pad_token_id=0,
    )
    assert torch.equal(fast, eager) and calls == 15


@pytest.mark.parametrize(
    "overrides",
    [{"position_embedding_type": "alibi"}, {"position_embedding_type": "learned", "norm_position": "post"}],
    ids=["alibi", "learned-post-norm"],
)
def test_other_positions_equal_eager(tmp_path, overrides):
    trained(overrides).save_pretrained(tmp_path)
    fast, eager, calls = generate_both(
        loaded(tmp_path),
        input_ids=PADDED,
        attention_mask=PADDED_MASK,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
    )
    assert torch.equal(fast, eager) and calls == 11


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"num_experts": 4, "num_experts_per_tok": 2}, "mixture-of-experts"),
        ({"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
    ],
)
def test_what_the_step_does_not_take_keeps_the_compiled_generate(tmp_path, overrides, why):
    """Experts and sliding windows keep torch.compile's step (a compile config), and generate() their tokens."""
    trained(overrides).save_pretrained(tmp_path)
    model = load_for_inference(tmp_path)
    assert any(why in blocker for blocker in step_blockers(model))
    assert getattr(model, "compiled_decode_step", None) is None and model.generation_config.compile_config
    expected = load_for_inference(tmp_path, compile=False).generate(PROMPTS, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(PROMPTS, max_new_tokens=8, do_sample=False), expected)
    with pytest.raises(ValueError, match=why):
        install(model)
    with pytest.raises(ValueError, match="decoder-only"):
        install(TfmForConditionalGeneration(tiny_seq2seq_config()))


def test_installed_forward_looks_as_the_model_s_and_generate_passes_its_2d_mask(lm):
    """Tools read `inspect.signature(model.forward)` (generate() on every call): the installed forward's is the bound
    method's, without `self`. generate()'s mask for the static cache stays 2-D (the step and the model's forward
    build what they need from it), and the greedy tokens of a left-padded batch equal the eager model's, whose
    generate() builds the 4-D masks."""
    fast, eager = lm
    assert inspect.signature(fast.forward) == inspect.signature(eager.forward)
    assert "self" not in inspect.signature(fast.forward).parameters
    seen = []
    original = fast.compiled_decode_step._inputs
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast.compiled_decode_step, "_inputs", lambda kwargs: seen.append(kwargs) or original(kwargs))
        ours, theirs, stepped = generate_both(
            (fast, eager), input_ids=PADDED, attention_mask=PADDED_MASK, max_new_tokens=6, do_sample=False
        )
    assert stepped == 5 and all(call["attention_mask"].ndim == 2 for call in seen)
    assert torch.equal(ours, theirs)


def test_calls_the_step_does_not_take_run_the_model(lm):
    """A prompt, a call with gradients, a dynamic cache: the model's own forward, the library untouched."""
    fast, eager = lm
    before = steps(fast)
    with torch.no_grad():
        torch.testing.assert_close(fast(input_ids=PROMPTS).logits, eager(input_ids=PROMPTS).logits)
        out = fast(input_ids=PROMPTS, use_cache=True)
        fast(input_ids=PROMPTS[:, :1], cache=out.cache if hasattr(out, "cache") else out.past_key_values)
    fast(input_ids=PROMPTS).logits.sum().backward()
    fast.zero_grad()
    assert steps(fast) == before
