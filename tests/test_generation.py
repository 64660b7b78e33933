"""generate() for every position type: the cache, left padding, sampling, beam search and static caches agree.

The oracle for greedy decoding is `use_cache=False` (every step recomputes the whole sequence), and for a batch it is
each prompt generated alone. `min_new_tokens` keeps EOS out of the picture so lengths always match.
"""

import contextlib

import pytest
import torch
from conftest import build, cache_of, compiled_generate, random_ids, tiny_config
from transformers import DynamicCache, StaticCache

from hf_tfm import TfmForCausalLM, load_for_inference
from hf_tfm.modeling import CACHE_NAME

NEW = 8
VARIANTS = {
    "rope": {"position_embedding_type": "rope", "num_key_value_heads": 2},
    "alibi": {"position_embedding_type": "alibi"},
    "learned": {"position_embedding_type": "learned", "norm_position": "post", "ffn_type": "mlp"},
    "sinusoidal": {"position_embedding_type": "sinusoidal", "norm_type": "layernorm"},
    "rope-swa": {"position_embedding_type": "rope", "sliding_window": 3, "num_key_value_heads": 2},
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def model(request):
    return build(TfmForCausalLM, tiny_config(**VARIANTS[request.param]), attn_implementation="sdpa")


def greedy(model, ids, mask=None, **kwargs):
    return model.generate(
        input_ids=ids,
        attention_mask=mask if mask is not None else torch.ones_like(ids),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        **kwargs,
    )


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def test_greedy_with_and_without_cache(model):
    ids = random_ids(2, 5, seed=4)
    cached = greedy(model, ids)
    assert cached.shape == (2, 5 + NEW)
    assert torch.equal(cached, greedy(model, ids, use_cache=False))
    # and the sequence really is the argmax chain of full forwards
    with torch.no_grad():
        logits = model(input_ids=cached[:, :-1], use_cache=False).logits
    assert torch.equal(logits[:, 4:].argmax(-1), cached[:, 5:])


def test_batched_left_padded_equals_each_prompt(model):
    prompts = [random_ids(1, n, seed=n)[0] for n in (6, 3, 5)]
    ids, mask = left_padded(prompts)
    batched = greedy(model, ids, mask)
    for row, prompt in enumerate(prompts):
        alone = greedy(model, prompt[None])
        assert torch.equal(batched[row, ids.shape[1] :], alone[0, len(prompt) :]), row
    static = greedy(model, ids, mask, cache_implementation="static")
    assert torch.equal(static, batched)


def test_static_cache_equals_dynamic(model):
    ids = random_ids(2, 4, seed=5)
    assert torch.equal(greedy(model, ids, cache_implementation="static"), greedy(model, ids))


def test_user_built_static_cache(model):
    ids = random_ids(1, 4, seed=6)
    cache = StaticCache(config=model.config, max_cache_len=32)
    out = greedy(model, ids, **{CACHE_NAME: cache})  # generate() takes the release's keyword
    assert torch.equal(out, greedy(model, ids))
    assert cache.get_seq_length() == 4 + NEW - 1  # the last token is sampled, never fed back


def legacy_name_warning():
    """`past_key_values` is deprecated where the release calls the cache `cache`, and the current name before that."""
    if CACHE_NAME == "cache":
        return pytest.warns(FutureWarning, match="past_key_values")
    return contextlib.nullcontext()


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_both_cache_keywords_work_on_every_release(model, name):
    """Forward with either name: same logits as a full forward, and the cache is really used (one new token)."""
    ids = random_ids(1, 6, seed=7)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        prefix = model(input_ids=ids[:, :5], use_cache=True)
        with legacy_name_warning() if name == "past_key_values" else contextlib.nullcontext():
            step = model(input_ids=ids[:, 5:], **{name: cache_of(prefix)}, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], atol=1e-5, rtol=0)
    assert cache_of(prefix).get_seq_length() == 6
    assert cache_of(step) is cache_of(prefix)
    if name == "cache" and CACHE_NAME != "cache":
        return  # generate() itself knows only `past_key_values` on these releases (in-tree models alike)
    # generate() with an explicitly passed cache object: the release's name, or the deprecated alias
    cache = DynamicCache(config=model.config)
    with legacy_name_warning() if name == "past_key_values" else contextlib.nullcontext():
        legacy = greedy(model, ids, **{name: cache})
    assert torch.equal(legacy, greedy(model, ids))
    assert cache.get_seq_length() == 6 + NEW - 1  # generate decoded into the cache it was given


def test_beam_search_cache_equals_no_cache(model):
    ids = random_ids(2, 4, seed=8)
    kwargs = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 5, "min_new_tokens": 5}
    cached = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    uncached = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **kwargs)
    assert cached.shape == (4, 9)
    assert torch.equal(cached, uncached)


def test_seeded_sampling_is_reproducible(model):
    ids = random_ids(2, 4, seed=9)
    kwargs = {"do_sample": True, "top_k": 20, "temperature": 1.5, "max_new_tokens": NEW, "min_new_tokens": NEW}
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])  # the seed matters: it really samples
    torch.manual_seed(0)
    no_cache = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **kwargs)
    assert torch.equal(no_cache, runs[0])  # the same draws from the same distributions


@pytest.mark.slow  # inductor compiles on CPU: ~10 s
def test_fullgraph_compile_and_compiled_static_generate():
    """`_can_compile_fullgraph = True` is honest: a padded forward compiles with fullgraph=True and matches eager, and
    generate() with a static cache compiles (CompileConfig) and gives the eager tokens."""
    from transformers import CompileConfig

    model = build(TfmForCausalLM, tiny_config(num_key_value_heads=2), attn_implementation="sdpa")
    ids = random_ids(2, 8)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
        compiled = torch.compile(model, fullgraph=True)(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)

    config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    config._compile_all_devices = True  # generate() compiles only on accelerators unless told (private flag, 5.24)
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False}
    reference = model.generate(ids, **kwargs)
    tokens = model.generate(ids, **kwargs, cache_implementation="static", compile_config=config)
    assert hasattr(model, "_compiled_call")
    assert torch.equal(tokens, reference)


# ---------------------------------------------------------------------------------------------------------------------
# load_for_inference: a static cache and a compiled decode step behind the ordinary generate()


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_load_for_inference_compiled_greedy_equals_eager(kind, tmp_path):
    """The compiled path's greedy tokens are eager generate()'s, on a left-padded batch of prompts of different
    lengths; it compiled (a graph) as one graph per step (no graph breaks). Trained models: every step has a clear
    winner, so float noise between the compiled and eager kernels cannot flip a token."""
    from export_models import NEW_TOKENS, PROMPTS, trained, trained_seq2seq

    eager = trained({}) if kind == "causal" else trained_seq2seq({"is_causal": False}, {})
    eager.save_pretrained(tmp_path)
    fast = load_for_inference(tmp_path)
    assert fast.generation_config.cache_implementation == "static" and not fast.training
    assert type(fast.get_output_embeddings()).__name__ == "StreamingLinear"  # a single-token product Inductor streams
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    options = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
    expected = eager.generate(ids, attention_mask=mask, **options)
    assert torch.equal(compiled_generate(fast, ids, attention_mask=mask, **options), expected)
    assert load_for_inference(tmp_path, compile=False).generation_config.cache_implementation is None
