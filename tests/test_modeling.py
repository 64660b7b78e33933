"""Model invariants over a grid of variants, plus outputs, heads and input validation.

The grid is a covering design, not the full product: the four position types x encoder/decoder are crossed in full
(positions interact with the cache offset, padding and masks), and every pair of values of the other axes (residual
layout pre/post/parallel, mlp/glu, layernorm/rmsnorm, MHA/GQA, qk_norm, sliding window) appears at least once with
every (position, encoder/decoder) cell. Each grid config is checked on eager and sdpa.
"""

import itertools

import pytest
import torch
from conftest import build, cache_of, enable_activation_checkpointing, random_ids, tiny_config

from hf_tfm import (
    TfmForCausalLM,
    TfmForMaskedLM,
    TfmForQuestionAnswering,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmModel,
)
from hf_tfm import modeling as M

ATOL = 1e-5
WINDOW = 3
SEQ = 10  # > 3 * WINDOW: cached decoding runs well past the sliding window

CELL_AXES = {"position_embedding_type": ["sinusoidal", "learned", "rope", "alibi"], "is_causal": [False, True]}
OTHER_AXES = {
    "layout": ["pre", "post", "parallel"],
    "ffn_type": ["mlp", "glu"],
    "norm_type": ["layernorm", "rmsnorm"],
    "num_key_value_heads": [4, 2],  # MHA, GQA
    "qk_norm": [False, True],
    "sliding_window": [None, WINDOW],
}


def all_pairs(axes: dict[str, list]) -> list[dict]:
    """A small deterministic covering array: every pair of values of every two axes appears in some row."""
    names = list(axes)
    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2) for va in axes[a] for vb in axes[b]}
    rows = []
    while uncovered:
        best, best_gain = None, -1
        for values in itertools.product(*axes.values()):  # tiny spaces: exhaustive greedy choice
            row = dict(zip(names, values, strict=True))
            gain = sum((a, row[a], b, row[b]) in uncovered for a, b in itertools.combinations(names, 2))
            if gain > best_gain:
                best, best_gain = row, gain
        rows.append(best)
        uncovered -= {(a, best[a], b, best[b]) for a, b in itertools.combinations(names, 2)}
    return rows


def grid() -> list[dict]:
    cells = list(itertools.product(*CELL_AXES.values()))  # crossed in full: one 8-valued axis
    configs = []
    for row in all_pairs({"cell": cells, **OTHER_AXES}):
        kwargs = {**dict(zip(CELL_AXES, row.pop("cell"), strict=True)), **row}
        layout = kwargs.pop("layout")
        kwargs["norm_position"] = "post" if layout == "post" else "pre"
        kwargs["parallel_residual"] = layout == "parallel"
        kwargs["hidden_act"] = "silu" if kwargs["ffn_type"] == "glu" else "gelu"
        configs.append(kwargs)
    return configs


GRID = grid()


def grid_id(kwargs: dict) -> str:
    layout = "par" if kwargs["parallel_residual"] else kwargs["norm_position"]
    parts = [
        kwargs["position_embedding_type"],
        "dec" if kwargs["is_causal"] else "enc",
        layout,
        kwargs["ffn_type"],
        kwargs["norm_type"],
        "gqa" if kwargs["num_key_value_heads"] < 4 else "mha",
    ]
    if kwargs["qk_norm"]:
        parts.append("qkn")
    if kwargs["sliding_window"]:
        parts.append("swa")
    return "-".join(parts)


def test_grid_covers_every_value_and_every_cell():
    for axis, values in {**CELL_AXES, **OTHER_AXES}.items():
        for value in values:
            if axis == "layout":
                assert any(grid_id(k).split("-")[2] == {"parallel": "par"}.get(value, value) for k in GRID)
            else:
                assert any(k[axis] == value for k in GRID), (axis, value)
    cells = {(k["position_embedding_type"], k["is_causal"]) for k in GRID}
    assert len(cells) == 8
    # every cell meets each of the other axes' values
    for pos, causal in cells:
        rows = [k for k in GRID if (k["position_embedding_type"], k["is_causal"]) == (pos, causal)]
        assert {k["sliding_window"] for k in rows} == {None, WINDOW}
        assert {k["norm_type"] for k in rows} == {"layernorm", "rmsnorm"}


def model_pair(kwargs: dict):
    """The grid model on eager and on sdpa, with identical weights (a decoder LM or an encoder MLM)."""
    model_class = TfmForCausalLM if kwargs["is_causal"] else TfmForMaskedLM
    eager = build(model_class, tiny_config(**kwargs), attn_implementation="eager")
    sdpa = build(model_class, tiny_config(**kwargs), attn_implementation="sdpa")
    sdpa.load_state_dict(eager.state_dict())
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    return eager, sdpa


def padded_batch(is_causal: bool):
    """Three rows: a full row, a row with 4 real tokens (left-padded for a decoder, right for an encoder), all pad."""
    ids = random_ids(3, SEQ, seed=1)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    if is_causal:
        mask[1, : SEQ - 4] = 0
    else:
        mask[1, 4:] = 0
    mask[2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def real_slice(is_causal: bool) -> slice:
    return slice(SEQ - 4, SEQ) if is_causal else slice(0, 4)


@pytest.mark.parametrize("kwargs", GRID, ids=grid_id)
def test_grid_finite_eager_sdpa_and_padding(kwargs):
    """Finite outputs; eager == sdpa; a padded batch equals each sample alone; padded rows finite, gradients too."""
    eager, sdpa = model_pair(kwargs)
    causal = kwargs["is_causal"]
    ids, mask = padded_batch(causal)
    real = real_slice(causal)
    with torch.no_grad():
        for model in (eager, sdpa):
            batch = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            assert torch.isfinite(batch).all()
            alone0 = model(input_ids=ids[:1], use_cache=False).logits
            alone1 = model(input_ids=ids[1:2, real], use_cache=False).logits
            torch.testing.assert_close(batch[:1], alone0, atol=ATOL, rtol=0)
            torch.testing.assert_close(batch[1:2, real], alone1, atol=ATOL, rtol=0)
            assert alone0.abs().max() > 0.1  # the comparison is between non-trivial numbers
        e = eager(input_ids=ids, attention_mask=mask, use_cache=False).logits
        s = sdpa(input_ids=ids, attention_mask=mask, use_cache=False).logits
        real_tokens = mask.bool()  # padded positions have no reference value (a fully masked query row)
        torch.testing.assert_close(e[real_tokens], s[real_tokens], atol=ATOL, rtol=0)
        torch.testing.assert_close(eager(input_ids=ids[:1]).logits, sdpa(input_ids=ids[:1]).logits, atol=ATOL, rtol=0)

    for model in (eager, sdpa):  # gradients through padded and fully padded rows stay finite
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kwargs", GRID, ids=grid_id)
def test_grid_causality(kwargs):
    """Changing token 4 never changes a decoder's outputs 0-3 and always changes an encoder's output 3.
    With a sliding window (3, two layers) the receptive field is bounded: a decoder's position 9 ignores token 4, an
    encoder's positions 0-2 ignore token 9."""
    eager, sdpa = model_pair(kwargs)
    ids = random_ids(1, SEQ, seed=2)

    def change(position):
        changed = ids.clone()
        changed[0, position] = 3 + (int(ids[0, position]) - 3 + 7) % 96  # another non-special id
        assert changed[0, position] != ids[0, position]
        return changed

    with torch.no_grad():
        for model in (eager, sdpa):
            a = model(input_ids=ids, use_cache=False).logits
            b = model(input_ids=change(4), use_cache=False).logits
            assert (a[0, 4:6] - b[0, 4:6]).abs().amax(-1).min() > 1e-4  # the changed token and its neighbour
            if kwargs["is_causal"]:
                torch.testing.assert_close(a[0, :4], b[0, :4], atol=1e-6, rtol=0)
            else:
                assert (a[0, 3] - b[0, 3]).abs().max() > 1e-4
            if kwargs["sliding_window"] is None:
                continue
            if kwargs["is_causal"]:
                torch.testing.assert_close(a[0, 9], b[0, 9], atol=1e-6, rtol=0)
            else:
                c = model(input_ids=change(9), use_cache=False).logits
                torch.testing.assert_close(a[0, :3], c[0, :3], atol=1e-6, rtol=0)
                assert (a[0, 6] - c[0, 6]).abs().max() > 1e-4


def cached_decode(model, ids, mask, prefill: int, cache=None):
    """Prefill `prefill` tokens, then feed one token at a time through the cache; the logits of every position."""
    out = model(input_ids=ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True, cache=cache)
    logits, cache = [out.logits], cache_of(out)
    for t in range(prefill, ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True)
        logits.append(out.logits)
        cache = cache_of(out)
    return torch.cat(logits, dim=1), cache


DECODER_GRID = [k for k in GRID if k["is_causal"]]


@pytest.mark.parametrize("kwargs", DECODER_GRID, ids=grid_id)
def test_grid_cached_decoding_equals_full_forward(kwargs):
    """Prefill + token-by-token decoding through the cache equals one full forward, past the sliding window too,
    for a plain batch and for a left-padded one, on eager and sdpa."""
    eager, sdpa = model_pair(kwargs)
    for ids, mask in [(random_ids(2, SEQ, seed=3), torch.ones(2, SEQ, dtype=torch.long)), padded_batch(True)]:
        with torch.no_grad():
            for model in (eager, sdpa):
                full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                for prefill in (1, 4):
                    stepped, cache = cached_decode(model, ids, mask, prefill)
                    assert cache.get_seq_length() == SEQ
                    real = mask.bool()
                    torch.testing.assert_close(stepped[real], full[real], atol=ATOL, rtol=0)
                    assert torch.isfinite(stepped).all()


# ---------------------------------------------------------------------------------------------------------------------
# Outputs


@pytest.fixture(scope="module")
def lm():
    return build(TfmForCausalLM, tiny_config(num_key_value_heads=2))


def test_hidden_states_attentions_and_tuples(lm):
    ids = random_ids(2, 6)
    out = lm(input_ids=ids, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == lm.config.num_hidden_layers + 1
    assert all(h.shape == (2, 6, 32) for h in out.hidden_states)
    torch.testing.assert_close(out.hidden_states[0], lm.model.embed_tokens(ids))  # rope: no absolute positions
    assert len(out.attentions) == lm.config.num_hidden_layers
    for weights in out.attentions:
        assert weights.shape == (2, 4, 6, 6)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 6))
        assert (weights.triu(1) == 0).all()  # causal
    # transformers' convention: hidden_states[-1] is the final (normed) hidden state, the one the head reads
    torch.testing.assert_close(out.logits, lm.lm_head(out.hidden_states[-1]))
    assert torch.equal(out.hidden_states[-1], lm.model(input_ids=ids).last_hidden_state)

    as_tuple = lm(input_ids=ids, return_dict=False, use_cache=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], out.logits)
    with_loss = lm(input_ids=ids, labels=ids, return_dict=False, use_cache=False)
    assert with_loss[0].ndim == 0 and torch.equal(with_loss[1], out.logits)


def test_logits_to_keep(lm):
    ids = random_ids(2, 7)
    full = lm(input_ids=ids).logits
    torch.testing.assert_close(lm(input_ids=ids, logits_to_keep=1).logits, full[:, -1:])
    torch.testing.assert_close(lm(input_ids=ids, logits_to_keep=3).logits, full[:, -3:])
    keep = torch.tensor([0, 5])
    torch.testing.assert_close(lm(input_ids=ids, logits_to_keep=keep).logits, full[:, keep])


def test_causal_lm_loss_matches_cross_entropy(lm):
    ids = random_ids(2, 7)
    out = lm(input_ids=ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 99), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("is_causal", [True, False])
def test_activation_checkpointing_matches_plain_backward(is_causal):
    config = tiny_config(is_causal=is_causal, hidden_dropout=0.0)
    model_class = TfmForCausalLM if is_causal else TfmForMaskedLM
    plain = build(model_class, config).train()
    checkpointed = build(model_class, tiny_config(is_causal=is_causal)).train()
    enable_activation_checkpointing(checkpointed)
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.layers)
    ids = random_ids(2, 8)
    for model in (plain, checkpointed):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------------------------------
# Heads


def test_sequence_classification_pooling():
    """Encoder: first token / mean of real tokens; decoder: last real token, left or right padded."""
    ids = random_ids(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    for pooling in ("first", "mean"):
        config = tiny_config(is_causal=False, num_labels=3, classifier_pooling=pooling)
        model = build(TfmForSequenceClassification, config)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = hidden[:, 0] if pooling == "first" else torch.stack([hidden[0, :4].mean(0), hidden[1].mean(0)])
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, model.score(pooled))

    model = build(TfmForSequenceClassification, tiny_config(num_labels=3))
    assert model.config.classifier_pooling == "last"
    hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    torch.testing.assert_close(
        model(input_ids=ids, attention_mask=mask).logits, model.score(torch.stack([hidden[0, 3], hidden[1, 5]]))
    )
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    hidden = model.model(input_ids=ids, attention_mask=left, use_cache=False).last_hidden_state
    torch.testing.assert_close(model(input_ids=ids, attention_mask=left).logits, model.score(hidden[:, 5]))
    # no attention_mask: the pad token id marks padding
    padded = ids.clone()
    padded[0, 4:] = 0
    torch.testing.assert_close(
        model(input_ids=padded).logits[0], model(input_ids=padded[:1, :4]).logits[0], atol=ATOL, rtol=0
    )


@pytest.mark.parametrize(
    ("num_labels", "problem_type", "labels", "loss_fn"),
    [
        (1, "regression", torch.tensor([0.5, -1.0]), lambda lg, y: torch.nn.functional.mse_loss(lg.squeeze(-1), y)),
        (3, "single_label_classification", torch.tensor([0, 2]), torch.nn.functional.cross_entropy),
        (
            3,
            "multi_label_classification",
            torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]),
            torch.nn.functional.binary_cross_entropy_with_logits,
        ),
    ],
)
def test_sequence_classification_losses(num_labels, problem_type, labels, loss_fn):
    config = tiny_config(is_causal=False, num_labels=num_labels, problem_type=problem_type)
    model = build(TfmForSequenceClassification, config)
    out = model(input_ids=random_ids(2, 5), labels=labels)
    assert out.logits.shape == (2, num_labels)
    torch.testing.assert_close(out.loss, loss_fn(out.logits, labels))


def test_sequence_classification_infers_problem_type():
    model = build(TfmForSequenceClassification, tiny_config(is_causal=False, num_labels=1))
    out = model(input_ids=random_ids(2, 5), labels=torch.tensor([0.5, 1.5]))
    torch.testing.assert_close(
        out.loss, torch.nn.functional.mse_loss(out.logits.squeeze(-1), torch.tensor([0.5, 1.5]))
    )
    assert model.config.problem_type == "regression"


def test_token_classification():
    model = build(TfmForTokenClassification, tiny_config(is_causal=False, num_labels=5))
    ids = random_ids(2, 6)
    labels = torch.tensor([[0, 1, 2, 3, 4, -100], [4, 3, 2, 1, 0, 0]])
    out = model(input_ids=ids, labels=labels)
    assert out.logits.shape == (2, 6, 5)
    hidden = model.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out.logits, model.score(hidden))
    torch.testing.assert_close(
        out.loss, torch.nn.functional.cross_entropy(out.logits.reshape(-1, 5), labels.reshape(-1))
    )


@pytest.mark.parametrize("is_causal", [False, True])
def test_question_answering(is_causal):
    """Start/end logits are the two columns of `qa_outputs`; the loss is the mean of the two cross-entropies, with
    out-of-range positions clamped to `seq_len` and ignored (transformers' ForQuestionAnsweringLoss)."""
    model = build(TfmForQuestionAnswering, tiny_config(is_causal=is_causal))
    ids = random_ids(2, 6)
    start, end = torch.tensor([1, 2]), torch.tensor([3, 99])  # 99: outside the input, ignored
    out = model(input_ids=ids, start_positions=start, end_positions=end)
    assert out.start_logits.shape == out.end_logits.shape == (2, 6)
    expected = model.qa_outputs(model.model(input_ids=ids).last_hidden_state)
    torch.testing.assert_close(torch.stack((out.start_logits, out.end_logits), dim=-1), expected)
    ce = torch.nn.functional.cross_entropy
    torch.testing.assert_close(out.loss, (ce(out.start_logits, start) + ce(out.end_logits[:1], end[:1])) / 2)
    assert model(input_ids=ids, start_positions=start).loss is None  # both positions or no loss


def test_masked_lm_tied_decoder_and_loss():
    model = build(TfmForMaskedLM, tiny_config(is_causal=False))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.bias is not None
    ids = random_ids(2, 6)
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    out = model(input_ids=ids, labels=labels)
    hidden = model.model(input_ids=ids).last_hidden_state
    expected = model.head(hidden) @ model.model.embed_tokens.weight.T + model.lm_head.bias
    torch.testing.assert_close(out.logits, expected)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits[:, 2], ids[:, 2]))


@pytest.mark.parametrize("is_causal", [True, False])
def test_backbone_outputs(is_causal):
    model = build(TfmModel, tiny_config(is_causal=is_causal))
    out = model(input_ids=random_ids(2, 5))
    assert out.last_hidden_state.shape == (2, 5, 32)
    assert (cache_of(out) is not None) == is_causal  # an encoder builds no cache


def test_causal_lm_is_not_tied_when_asked():
    model = build(TfmForCausalLM, tiny_config(tie_word_embeddings=False))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    tied = build(TfmForCausalLM, tiny_config())
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


# ---------------------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("bad", [99, 1000, -1])
def test_token_ids_out_of_range(lm, bad):
    ids = random_ids(1, 4)
    ids[0, 2] = bad
    with pytest.raises(ValueError, match=r"input_ids.*\[0, 99\)"):
        lm(input_ids=ids)


def test_token_type_ids_out_of_range():
    model = build(TfmForMaskedLM, tiny_config(is_causal=False, type_vocab_size=2))
    with pytest.raises(ValueError, match=r"token_type_ids.*\[0, 2\).*type_vocab_size"):
        model(input_ids=random_ids(1, 4), token_type_ids=torch.tensor([[0, 1, 2, 0]]))


def test_attention_mask_shape_mismatch(lm):
    with pytest.raises(ValueError, match=r"attention_mask.*\(2, 5\)"):
        lm(input_ids=random_ids(2, 5), attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        lm(input_ids=random_ids(2, 5), attention_mask=torch.ones(1, 5, dtype=torch.long))


def test_learned_positions_too_long():
    model = build(TfmForCausalLM, tiny_config(position_embedding_type="learned", max_position_embeddings=8))
    model(input_ids=random_ids(1, 8))  # exactly the limit is fine
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        model(input_ids=random_ids(1, 9))
    out = model(input_ids=random_ids(1, 8), use_cache=True)  # and through the cache
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(input_ids=random_ids(1, 1), cache=cache_of(out))


def test_inputs_embeds_or_ids(lm):
    ids = random_ids(1, 4)
    torch.testing.assert_close(lm(inputs_embeds=lm.model.embed_tokens(ids)).logits, lm(input_ids=ids).logits)
    with pytest.raises(ValueError, match="exactly one"):
        lm()


@pytest.mark.parametrize("position_embedding_type", ["rope", "alibi", "learned", "sinusoidal"])
def test_position_ids_are_used(position_embedding_type):
    """RoPE and ALiBi are relative (shifting every position by 5 changes nothing); absolute types are not.
    (Non-contiguous position_ids would mean packed sequences to transformers' masks, so only shifts are used.)"""
    model = build(TfmForCausalLM, tiny_config(position_embedding_type=position_embedding_type))
    ids = random_ids(1, 6)
    positions = torch.arange(6)[None]
    with torch.no_grad():
        base = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        shifted = model(input_ids=ids, position_ids=positions + 5, use_cache=False).logits
    torch.testing.assert_close(base, model(input_ids=ids, use_cache=False).logits)
    if position_embedding_type in ("rope", "alibi"):
        torch.testing.assert_close(shifted, base, atol=ATOL, rtol=0)
    else:
        assert (shifted - base).abs().max() > 1e-3


def test_rope_scores_depend_on_relative_position_only():
    """<rot(q, m), rot(k, n)> is a function of m - n (arXiv:2104.09864): equal for (7, 3) and (12, 8), not (7, 2)."""
    model = build(TfmModel, tiny_config())
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m: int, n: int) -> torch.Tensor:
        cos, sin = model.rotary_emb(q, torch.tensor([[m, n]]))
        rq, _ = M.apply_rotary_pos_emb(q, q, cos[:, :1], sin[:, :1])
        rk, _ = M.apply_rotary_pos_emb(k, k, cos[:, 1:], sin[:, 1:])
        return (rq * rk).sum()

    torch.testing.assert_close(score(7, 3), score(12, 8))
    assert (score(7, 3) - score(7, 2)).abs() > 1e-3
    torch.testing.assert_close(score(4, 4), (q * k).sum())  # no rotation at equal positions


@pytest.mark.parametrize("position_embedding_type", ["rope", "alibi", "learned", "sinusoidal"])
def test_packed_eval_forward_keeps_sequences_apart(position_embedding_type):
    """In eval mode the model makes a cache (use_cache=True); packed position_ids must still isolate sequences."""
    model = build(TfmForCausalLM, tiny_config(position_embedding_type=position_embedding_type))
    first, second = random_ids(1, 5, seed=1), random_ids(1, 4, seed=2)
    position_ids = torch.cat([torch.arange(5), torch.arange(4)])[None]
    with torch.no_grad():
        packed = model(torch.cat([first, second], 1), position_ids=position_ids).logits
        alone = model(second).logits
    torch.testing.assert_close(packed[:, 5:], alone, atol=1e-5, rtol=0)


@pytest.mark.slow  # flex_attention compiles a kernel per shape on CPU (~5 s each); forward only (no CPU backward)
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"position_embedding_type": "alibi"},
        {"position_embedding_type": "alibi", "is_causal": False},
        {"sliding_window": 3},
    ],
    ids=["rope", "alibi-decoder", "alibi-encoder", "sliding"],
)
def test_flex_attention_matches_eager(overrides):
    """A batch of 2 through flex_attention equals eager: masks, GQA, sliding windows and the per-row ALiBi bias."""
    config = tiny_config(num_key_value_heads=2, **overrides)
    model = build(TfmForCausalLM if config.is_causal else TfmForMaskedLM, config)
    ids = random_ids(2, 16)
    with torch.no_grad():
        eager = model(ids).logits
        model.set_attn_implementation("flex_attention")
        flex = model(ids).logits
    torch.testing.assert_close(flex, eager, atol=1e-5, rtol=0)
