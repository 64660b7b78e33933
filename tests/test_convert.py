"""Exact-parity import from / export to transformers' in-tree families, with the in-tree model as the oracle.

Tiny random in-tree models (nothing downloaded): logits equal to 1e-5 in fp32 on a padded batch under eager and sdpa,
greedy generation equal for decoders, in-tree -> hf_tfm -> in-tree gives identical weights and config, folders convert
both ways with `convert_path`, and a config with no in-tree equivalent names its blocking knobs.
"""

import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForQuestionAnswering, AutoModelForSequenceClassification

import hf_tfm
from hf_tfm.convert import convert_path, from_hf, in_tree_blockers, to_hf

ATOL = 1e-5
VOCAB = 97
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
LLAMA_LIKE = {**SMALL, "intermediate_size": 48, "num_key_value_heads": 2, "pad_token_id": 0}
BERT = {**SMALL, "intermediate_size": 48, "type_vocab_size": 2, "max_position_embeddings": 64}
GPT2 = {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
GPT2 |= {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

# id -> (in-tree class name, config class name, config kwargs)
CASES = {
    "llama-base": ("LlamaModel", "LlamaConfig", LLAMA_LIKE),
    "llama-lm-untied-linear-rope": (
        "LlamaForCausalLM",
        "LlamaConfig",
        {**LLAMA_LIKE, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "llama-lm-tied-bias-llama3-rope": (
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            **LLAMA_LIKE,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama-seqcls": ("LlamaForSequenceClassification", "LlamaConfig", {**LLAMA_LIKE, "num_labels": 3}),
    "mistral-lm-sliding": ("MistralForCausalLM", "MistralConfig", {**LLAMA_LIKE, "sliding_window": 4}),
    "mistral-seqcls": ("MistralForSequenceClassification", "MistralConfig", {**LLAMA_LIKE, "sliding_window": 4}),
    "qwen2-lm-mixed-window": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {**LLAMA_LIKE, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    ),
    "qwen2-seqcls": ("Qwen2ForSequenceClassification", "Qwen2Config", LLAMA_LIKE),
    "gpt2-base": ("GPT2Model", "GPT2Config", GPT2),
    "gpt2-lm": ("GPT2LMHeadModel", "GPT2Config", GPT2),
    "gpt2-seqcls": ("GPT2ForSequenceClassification", "GPT2Config", {**GPT2, "num_labels": 3}),
    "gpt2-tokcls": ("GPT2ForTokenClassification", "GPT2Config", GPT2),
    "bert-base": ("BertModel", "BertConfig", BERT),
    "bert-seqcls": ("BertForSequenceClassification", "BertConfig", {**BERT, "num_labels": 3}),
    "bert-tokcls": ("BertForTokenClassification", "BertConfig", BERT),
    "bert-mlm": ("BertForMaskedLM", "BertConfig", BERT),
    # Question answering: Llama's and Qwen2's keep the backbone under `transformer.`, Mistral's under `model.`.
    "llama-qa": ("LlamaForQuestionAnswering", "LlamaConfig", LLAMA_LIKE),
    "mistral-qa": ("MistralForQuestionAnswering", "MistralConfig", {**LLAMA_LIKE, "sliding_window": 4}),
    "qwen2-qa": ("Qwen2ForQuestionAnswering", "Qwen2Config", LLAMA_LIKE),
    "gpt2-qa": ("GPT2ForQuestionAnswering", "GPT2Config", GPT2),
    "bert-qa": ("BertForQuestionAnswering", "BertConfig", BERT),
}
DECODER_LMS = [name for name, (cls, _, _) in CASES.items() if cls.endswith(("ForCausalLM", "LMHeadModel"))]


def build(case: str, attn: str = "sdpa"):
    cls_name, config_name, kwargs = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = attn
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # random non-trivial norms and biases, so a mis-mapped one cannot hide behind 1s and 0s
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                param.add_(torch.randn_like(param) * 0.1)
    return model


def padded_batch(model):
    """(inputs, real-token mask): left padding for decoders with generate's positions, right padding for encoders."""
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 12))
    mask = torch.ones_like(ids)
    encoder = model.config.model_type == "bert"
    for row, pad in ((1, 3), (2, 7)):
        if encoder:
            mask[row, -pad:] = 0
        else:
            mask[row, :pad] = 0
    ids = ids.masked_fill(mask == 0, 0)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if encoder:
        inputs["token_type_ids"] = torch.randint(0, 2, ids.shape) * mask
    else:  # as GenerationMixin does: count real tokens, give padding a dummy position
        inputs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return inputs, mask


def outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    if hasattr(out, "start_logits"):  # question answering: (B, T, 2) start / end logits
        return torch.stack((out.start_logits, out.end_logits), dim=-1)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_in_tree(case, attn):
    reference = build(case, attn)
    ours = from_hf(reference)
    assert ours.config._attn_implementation == attn
    inputs, mask = padded_batch(reference)
    expected, got = outputs(reference, inputs), outputs(ours, inputs)
    assert got.shape == expected.shape
    diff = (got - expected).abs()
    if diff.ndim == 3:  # per-token outputs: padded positions are don't-care in both models
        diff = diff[mask.bool()]
    assert diff.max().item() <= ATOL, f"{case}/{attn}: max |diff| = {diff.max().item():.2e}"


@pytest.mark.parametrize("case", DECODER_LMS)
def test_greedy_generation_matches_in_tree(case):
    reference = build(case)
    ours = from_hf(reference)
    inputs, _ = padded_batch(reference)
    inputs.pop("position_ids")
    kwargs = {"max_new_tokens": 20, "min_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    expected = reference.generate(**inputs, **kwargs)
    got = ours.generate(**inputs, **kwargs)
    assert expected.shape[1] == inputs["input_ids"].shape[1] + 20
    assert torch.equal(got, expected)


IGNORED_CONFIG_KEYS = {"architectures", "transformers_version", "_name_or_path", "dtype"}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_exact(case):
    reference = build(case, "eager")
    back = to_hf(from_hf(reference))
    assert type(back) is type(reference)
    assert back.config._attn_implementation == "eager"
    expected, got = reference.state_dict(), back.state_dict()
    assert got.keys() == expected.keys()  # nothing dropped: BertModel's pooler comes back too
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    want = {k: v for k, v in reference.config.to_dict().items() if k not in IGNORED_CONFIG_KEYS}
    have = {k: v for k, v in back.config.to_dict().items() if k not in IGNORED_CONFIG_KEYS}
    assert have == want


@pytest.mark.parametrize("add_pooling_layer", [True, False])
def test_bert_pooler_survives_round_trip(add_pooling_layer):
    """BertModel -> TfmModel -> BertModel keeps the pooler's weights and `pooler_output`, with BERT as the oracle."""
    torch.manual_seed(0)
    reference = transformers.BertModel(transformers.BertConfig(**BERT), add_pooling_layer=add_pooling_layer).eval()
    inputs, _ = padded_batch(reference)
    ours = from_hf(reference)
    assert ours.config.add_pooling_layer is add_pooling_layer
    back = to_hf(ours)
    assert (back.pooler is not None) is add_pooling_layer
    with torch.no_grad():
        expected = reference(**inputs).pooler_output
        got, again = ours(**inputs), back(**inputs).pooler_output
    if not add_pooling_layer:
        assert expected is None and again is None and not hasattr(got, "pooler_output")
        return
    assert (got.pooler_output - expected).abs().max().item() <= ATOL
    assert torch.equal(again, expected)
    for key, value in reference.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_imported_config_uses_general_knobs():
    config = from_hf(build("qwen2-lm-mixed-window")).config
    assert (config.attention_bias, config.attention_out_bias) == (True, False)
    assert config.layer_types == ["full_attention", "sliding_attention"] and config.sliding_window == 4
    config = from_hf(build("bert-seqcls")).config
    assert (config.norm_position, config.embedding_norm, config.type_vocab_size) == ("post", True, 2)
    assert (config.classifier_dense, config.classifier_activation, config.classifier_pooling) == (
        True,
        "tanh",
        "first",
    )
    config = from_hf(build("gpt2-seqcls")).config
    assert (config.position_embedding_type, config.hidden_act, config.classifier_bias) == (
        "learned",
        "gelu_new",
        False,
    )


def test_unexportable_config_names_every_blocking_knob():
    config = hf_tfm.TfmConfig(**SMALL, position_embedding_type="alibi", qk_norm=True, parallel_residual=True)
    with pytest.raises(ValueError) as err:
        to_hf(hf_tfm.TfmForCausalLM(config))
    message = str(err.value)
    for knob in ("position_embedding_type", "qk_norm", "parallel_residual"):
        assert f"`{knob}`" in message
    assert "llama" in message
    # A head the family lacks, and a classifier the family cannot express, are named too.
    blockers = in_tree_blockers(hf_tfm.TfmConfig(**SMALL, classifier_pooling="mean"), "sequence_classification")
    assert any("classifier_pooling" in b for b in blockers["llama"])
    assert any("classifier_bias" in b for b in blockers["llama"])
    with pytest.raises(ValueError, match="masked_lm"):
        to_hf(hf_tfm.TfmForMaskedLM(hf_tfm.TfmConfig(**SMALL)))


def test_question_answering_exports_and_blocks_by_head():
    config = from_hf(build("llama-qa")).config
    assert in_tree_blockers(config, "question_answering")["llama"] == []
    bert = from_hf(build("bert-qa")).config
    bert.num_labels = 3  # BertForQuestionAnswering sizes qa_outputs by num_labels; hf_tfm's is always 2
    assert any("num_labels" in b for b in in_tree_blockers(bert, "question_answering")["bert"])
    with pytest.raises(ValueError, match="num_labels"):
        from_hf(transformers.BertForQuestionAnswering(transformers.BertConfig(**BERT, num_labels=3)))


def test_info_reports_the_real_head():
    from hf_tfm.info import _export

    config = from_hf(build("llama-qa")).config
    assert _export(config, "TfmForQuestionAnswering")["llama"] == (True, "")
    assert _export(config, "TfmForSomethingNew") == {
        "in-tree families": (False, "no in-tree export for this head (TfmForSomethingNew)")
    }


def test_unsupported_in_tree_variant_is_refused():
    config = transformers.GPT2Config(**GPT2, scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        from_hf(transformers.GPT2LMHeadModel(config))


@pytest.mark.parametrize(
    ("case", "auto_class"),
    [
        ("llama-lm-tied-bias-llama3-rope", AutoModelForCausalLM),
        ("bert-seqcls", AutoModelForSequenceClassification),
        ("llama-qa", AutoModelForQuestionAnswering),
        ("bert-qa", AutoModelForQuestionAnswering),
    ],
)
def test_convert_path_both_directions(tmp_path, case, auto_class):
    reference = build(case)
    reference.save_pretrained(tmp_path / "in_tree")
    (tmp_path / "in_tree" / "tokenizer_config.json").write_text("{}")  # other files travel along unchanged

    convert_path(tmp_path / "in_tree", tmp_path / "tfm")
    assert json.loads((tmp_path / "tfm" / "config.json").read_text())["model_type"] == "hf_tfm"
    assert (tmp_path / "tfm" / "model.safetensors").is_file() and (
        tmp_path / "tfm" / "tokenizer_config.json"
    ).is_file()
    ours = auto_class.from_pretrained(tmp_path / "tfm")
    assert type(ours).__module__ == "hf_tfm.modeling"

    convert_path(tmp_path / "tfm", tmp_path / "back")
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["model_type"] == reference.config.model_type and "auto_map" not in saved
    assert not list((tmp_path / "back").glob("*.py"))
    back = auto_class.from_pretrained(tmp_path / "back")  # plain transformers: no remote code involved
    assert type(back) is type(reference)
    inputs, _ = padded_batch(reference)
    torch.testing.assert_close(outputs(back, inputs), outputs(reference, inputs), rtol=0, atol=0)


def test_imported_gpt2_trains_like_gpt2_when_pad_is_eos():
    """GPT-2 commonly pads with eos, a real token: its embedding row must keep its gradient after import."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=100,
        n_embd=32,
        n_layer=1,
        n_head=4,
        n_positions=16,
        pad_token_id=99,
        bos_token_id=99,
        eos_token_id=99,
    )
    theirs = transformers.GPT2LMHeadModel(config).eval()  # no dropout: both sides compute the same function
    ours = from_hf(theirs)
    ids = torch.tensor([[5, 99, 7, 99]])
    for model in (theirs, ours):
        model(input_ids=ids, labels=ids).loss.backward()
    grad_theirs = theirs.transformer.wte.weight.grad[99]
    grad_ours = ours.model.embed_tokens.weight.grad[99]
    assert grad_theirs.abs().sum() > 0
    torch.testing.assert_close(grad_ours, grad_theirs, atol=1e-6, rtol=1e-5)
