"""Speculative decoding on the fast path: `generate(assistant_model=draft)` and `generate(prompt_lookup_num_tokens=k)`
with models from `load_for_inference`, at every hf_tfm quantize setting, give plain greedy decoding's tokens, with
the drafted tokens checked by the compiled verify step (`hf_tfm.inference.aot`) and the draft decoding through its
own compiled step.

The oracle is the same target decoding greedily, one token at a time. The test pair needs no trained weights: the
last layers of both add exactly 0 to the residual stream (zero `o_proj` and `down_proj`: they cost what any layer
costs, and zero stays zero when quantized), and the draft shares the target's first layer, embedding, norm and head,
so the two agree on every greedy token and every drafted token is accepted — the best case a well-matched draft
approaches (docs/speculative.md). The draft's other weights are its own, in the target's layout: the two models run
one library from the step store, each with its own tensors (a test compiles the target's step and verify step; a
draft of fewer layers would add two compiles a setting, and the bench times one)."""

import pytest
import torch
from conftest import build, tiny_config

from hf_tfm import TfmForCausalLM, load_for_inference
from hf_tfm.cli import main
from hf_tfm.inference import precompile
from hf_tfm.inference.kernels import native_kernels_available

# Each test compiles a decode step (seconds to tens of seconds): CI runs them on the release range's ends only
pytestmark = pytest.mark.slow

LAYERS, SHARED_LAYERS = 4, 1
PROMPT = torch.tensor([[1, 12, 7, 33, 12, 7, 33, 12, 7]])  # repeats itself: prompt lookup finds drafts in it
GREEDY = {"max_new_tokens": 24, "min_new_tokens": 24, "do_sample": False}


def pair(folder):
    """(target, draft) folders: the same first layer, embedding, norm and head; the other layers add nothing."""
    # grouped-query attention (2 query heads a key/value head): the verify step's export once failed on its shapes
    config = tiny_config(
        num_hidden_layers=LAYERS, intermediate_size=128, max_position_embeddings=96, num_key_value_heads=2
    )
    target, draft = build(TfmForCausalLM, config), build(TfmForCausalLM, config, seed=1)
    shared = {name: tensor for name, tensor in target.state_dict().items() if not name.startswith("model.layers.")}
    shared |= {f"model.layers.{i}.{name}": tensor for i in range(SHARED_LAYERS) for name, tensor in
               target.model.layers[i].state_dict().items()}  # fmt: skip
    draft.load_state_dict(shared, strict=False)
    for model, name in ((target, "target"), (draft, "draft")):
        with torch.no_grad():
            for layer in model.model.layers[SHARED_LAYERS:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        model.save_pretrained(folder / name)
    return folder / "target", folder / "draft"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return pair(tmp_path_factory.mktemp("speculative"))


def fast(folder, quantize):
    model = load_for_inference(folder, quantize=quantize)
    precompile(model, (1,), verify=True)
    return model


SETTINGS = [None, pytest.param("q8", marks=pytest.mark.skipif(not native_kernels_available(), reason="no kernel"))]
SETTINGS.append(pytest.param("q4", marks=SETTINGS[1].marks))


@pytest.mark.parametrize("quantize", SETTINGS, ids=lambda q: q or "fp32")
def test_assisted_and_prompt_lookup_give_greedy_tokens_through_the_compiled_steps(folders, quantize):
    target, draft = fast(folders[0], quantize), fast(folders[1], quantize)
    # the draft proposes 4 tokens a round however unsure it is (a trained draft stops at its confidence threshold)
    draft.generation_config.assistant_confidence_threshold = 0.0
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    plain = target.generate(PROMPT, **GREEDY)
    steps = target.compiled_decode_step
    before = dict(steps.calls_by_kind)
    assisted = target.generate(PROMPT, assistant_model=draft, **GREEDY)
    assert torch.equal(assisted, plain)
    verified = steps.calls_by_kind["verify"] - before.get("verify", 0)
    # every draft accepted: far fewer target passes than tokens, each a compiled verify step, none eager
    assert 0 < verified < GREEDY["max_new_tokens"] // 2 and steps.calls_by_kind["step"] == before["step"]
    assert draft.compiled_decode_step.calls_by_kind["step"] >= verified  # the draft decodes through its own step
    before = dict(steps.calls_by_kind)
    looked_up = target.generate(PROMPT, prompt_lookup_num_tokens=4, **GREEDY)
    assert torch.equal(looked_up, plain) and steps.calls_by_kind["verify"] > before["verify"]
    assert target.generation_config.cache_implementation == "static"  # the model's own setting is unchanged


def test_the_eager_model_refuses_a_batch_and_so_does_the_fast_one(folders):
    """transformers' assisted generation takes one sequence at a time: the same ValueError either way."""
    batch = PROMPT.repeat(2, 1)
    for load in (lambda f: load_for_inference(f, compile=False), lambda f: fast(f, None)):
        with pytest.raises(ValueError, match="batch_size = 1"):
            load(folders[0]).generate(batch, assistant_model=load(folders[1]), **GREEDY)


def test_cli_generate_with_a_draft_or_prompt_lookup_prints_the_greedy_text(folders, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(tiny_config().vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")
    for folder in folders:
        tokenizer.save_pretrained(folder)
    argv = ["generate", str(folders[0]), "--prompt", "t12 t7 t33 t12 t7", "--greedy", "--no-stream"]
    outputs = []
    for extra in ([], ["--draft", str(folders[1])], ["--prompt-lookup", "3"]):
        assert main([*argv, "--max-new-tokens", "12", *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0].split()) == 17
    assert main([*argv, "--prompt-lookup", "0"]) == 1
