"""Half precision: bf16 and fp16 forward and backward over the config grid, with the fp32 model as the oracle.

Every position type, pre- and post-norm, decoder and encoder, on a right-padded batch whose last row is fully
padded: no NaN or Inf anywhere (padded rows and gradients included), and real tokens' logits within `TOLERANCE` of
fp32 (relative to the largest fp32 logit; the largest difference measured on this grid, rounded up). Two
configurations run 2,048 tokens. `dtype` survives save/load.
"""

import itertools

import pytest
import torch
from conftest import build, random_ids, tiny_config

from hf_tfm import TfmForCausalLM, TfmForMaskedLM

# Max |half - fp32| over real tokens' logits, relative to the largest |fp32 logit| (bf16 keeps 8 mantissa bits, fp16
# 11). Measured (torch 2.13 CPU, sdpa): 16 tokens bf16 <= 0.037, fp16 <= 0.0031; 2,048 tokens bf16 0.137 (RoPE
# decoder), 0.049 (ALiBi encoder), fp16 <= 0.028. The tolerances are those, rounded up.
TOLERANCE = {(torch.bfloat16, 16): 0.05, (torch.float16, 16): 0.005}
TOLERANCE |= {(torch.bfloat16, 2048): 0.2, (torch.float16, 2048): 0.05}
GRID = list(itertools.product(["rope", "alibi", "learned", "sinusoidal"], ["pre", "post"], [True, False]))


def _config(position: str, norm_position: str, causal: bool, length: int):
    return tiny_config(
        position_embedding_type=position,
        norm_position=norm_position,
        is_causal=causal,
        max_position_embeddings=max(64, length),
        norm_type="layernorm" if norm_position == "post" else "rmsnorm",
    )


def _check(position: str, norm_position: str, causal: bool, dtype: torch.dtype, length: int, attn: str) -> float:
    cls = TfmForCausalLM if causal else TfmForMaskedLM
    reference = build(cls, _config(position, norm_position, causal, length), attn_implementation=attn)
    half = build(cls, _config(position, norm_position, causal, length), attn_implementation=attn).to(dtype)
    ids = random_ids(3, length)
    mask = torch.ones_like(ids)
    mask[1, length // 2 :] = 0  # right-padded row
    mask[2] = 0  # fully padded row
    labels = ids.masked_fill(mask == 0, -100)
    labels[2] = -100
    half.train()
    out = half(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert torch.isfinite(out.logits).all(), "NaN/Inf in half-precision logits"
    assert torch.isfinite(out.loss)
    for name, param in half.named_parameters():
        assert param.grad is None or torch.isfinite(param.grad).all(), f"NaN/Inf gradient in {name}"
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        got = half.eval()(input_ids=ids, attention_mask=mask).logits.float()
    assert torch.isfinite(got).all()
    real = mask.bool()
    return ((got[real] - expected[real]).abs().max() / expected[real].abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("position", "norm_position", "causal"), GRID)
def test_half_precision_grid(position, norm_position, causal, dtype):
    diff = _check(position, norm_position, causal, dtype, length=16, attn="sdpa")
    assert diff <= TOLERANCE[dtype, 16], f"max |half - fp32| = {diff:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("position", "causal"), [("rope", True), ("alibi", False)], ids=["rope-decoder", "alibi-encoder"]
)
def test_half_precision_long_sequences(position, causal, dtype):
    """2,048 tokens: RoPE angles and ALiBi distances are largest here, where half precision loses the most."""
    diff = _check(position, "pre", causal, dtype, length=2048, attn="sdpa")
    assert diff <= TOLERANCE[dtype, 2048], f"max |half - fp32| = {diff:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dtype_round_trips_through_save_and_load(tmp_path, dtype):
    model = build(TfmForCausalLM, tiny_config()).to(dtype)
    model.save_pretrained(tmp_path)
    loaded = TfmForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == dtype and loaded.config.dtype == dtype
    for (name, param), (_, other) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(param, other), name
