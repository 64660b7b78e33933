"""resize_token_embeddings: the output head follows the input embeddings, old rows survive, the model round-trips."""

import pytest
import torch
from conftest import TINY, build, random_ids, tiny_config
from safetensors import safe_open

from hf_tfm import TfmForCausalLM, TfmForMaskedLM

OLD, ASKED, PADDED = TINY["vocab_size"], 103, 104  # 103 rounded up to a multiple of 8

CASES = [
    (TfmForCausalLM, {}),
    (TfmForCausalLM, {"tie_word_embeddings": False}),
    (TfmForMaskedLM, {"is_causal": False}),  # tied, and its lm_head has a bias that must grow too
]


@pytest.mark.parametrize(("model_class", "overrides"), CASES, ids=["causal-tied", "causal-untied", "masked"])
def test_resize_token_embeddings(tmp_path, model_class, overrides):
    model = build(model_class, tiny_config(**overrides))
    tied = model.config.tie_word_embeddings
    ids = random_ids(2, 6)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    old_embed = model.model.embed_tokens.weight.detach().clone()
    old_head = model.lm_head.weight.detach().clone()
    old_bias = None if model.lm_head.bias is None else model.lm_head.bias.detach().clone()

    embed = model.resize_token_embeddings(ASKED, pad_to_multiple_of=8)

    assert embed is model.get_input_embeddings() and embed.weight.shape == (PADDED, 32)
    assert model.lm_head.weight.shape == (PADDED, 32) and model.lm_head.out_features == PADDED
    assert model.config.vocab_size == PADDED
    assert torch.equal(embed.weight[:OLD], old_embed) and torch.equal(model.lm_head.weight[:OLD], old_head)
    if old_bias is not None:
        assert model.lm_head.bias.shape == (PADDED,) and torch.equal(model.lm_head.bias[:OLD], old_bias)
    assert (model.lm_head.weight is embed.weight) == tied
    with torch.no_grad():
        after = model(input_ids=ids).logits
        new_ids = torch.tensor([[OLD, PADDED - 1, 5]])  # ids of the new rows pass the vocab_size check
        assert model(input_ids=new_ids).logits.shape == (1, 3, PADDED)
    assert after.shape == (2, 6, PADDED) and torch.equal(after[..., :OLD], before)  # old tokens: same logits

    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in set(f.keys())) != tied  # a tied model still stores one copy
    loaded = model_class.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert loaded.config.vocab_size == PADDED
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) == tied
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, after)
