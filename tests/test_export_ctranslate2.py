"""CTranslate2 export (hf_tfm.export(..., format="ctranslate2")): model folders whose spec is built from TfmConfig +
state_dict, run by `ctranslate2.Generator` (causal LMs) and `ctranslate2.Translator` (encoder-decoders).

The oracle is hf_tfm itself: float32 folders give its greedy tokens and its logits within 5e-5 (measured 2.4e-6 to
6.4e-6 for causal LMs, 3.8e-6 to 1.7e-5 for encoder-decoders, logits up to ~13: CTranslate2's float32 kernels, not
bit-identical ones). The models are tiny but trained on a repeated token cycle, so each greedy step has a clear winner
(no near-ties that float noise could flip).
"""

import json

import numpy as np
import pytest
import torch
from conftest import tiny_seq2seq_config
from export_models import (
    GPT2_BLOCK,
    NEW_TOKENS,
    PROMPTS,
    VOCAB,
    config_of,
    saved,
    train_tokenizer,
    trained,
    trained_seq2seq,
)

from hf_tfm import TfmForCausalLM, TfmForConditionalGeneration, TfmForSequenceClassification, TfmModel
from hf_tfm.cli import main
from hf_tfm.exporters import blockers, export, format_of, quantize_types, verify
from hf_tfm.exporters import ctranslate2 as ct2_export
from hf_tfm.exporters.ctranslate2 import ctranslate2_blockers, export_ctranslate2, verify_ctranslate2
from hf_tfm.info import describe

ctranslate2 = pytest.importorskip("ctranslate2")

GQA_UNTIED = {"num_key_value_heads": 2, "tie_word_embeddings": False}
LEARNED_LN = GPT2_BLOCK  # GPT-2's block
SINUSOIDAL = {
    "position_embedding_type": "sinusoidal",
    "norm_type": "layernorm",
    "ffn_type": "mlp",
    "hidden_act": "relu",
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}
# Every knob the CTranslate2 decoder computes, in at least one config.
FAMILIES = {
    "llama-mha-tied": {},
    "llama-gqa-untied": GQA_UNTIED,
    "mqa-head_dim-all-biases": {
        "num_key_value_heads": 1,
        "head_dim": 32,
        "attention_bias": True,
        "attention_out_bias": True,
        "mlp_bias": True,
        "lm_head_bias": True,
        "tie_word_embeddings": False,
    },
    "qwen2": {"num_key_value_heads": 2, "attention_bias": True, "attention_out_bias": False},
    "rope-linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    "rope-llama3": {"num_key_value_heads": 2, "rope_parameters": LLAMA3_ROPE},
    "gpt2": LEARNED_LN,
    "post-norm-learned-offset": {**LEARNED_LN, "norm_position": "post", "hidden_act": "gelu", "position_offset": 2},
    "post-norm-final-norm": {**LEARNED_LN, "norm_position": "post", "final_norm": True, "norm_bias": False},
    "alibi-4-heads": {"position_embedding_type": "alibi"},
    "alibi-6-heads-gqa": {
        "position_embedding_type": "alibi",
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 16,
    },
    "sinusoidal-interleaved": SINUSOIDAL,  # embedding_scale sqrt(hidden), the default with sinusoidal positions
    "sinusoidal-halves-post": {**SINUSOIDAL, "sinusoidal_layout": "halves", "norm_position": "post"},
    "parallel-rmsnorm": {"parallel_residual": True},
    "parallel-layernorm": {**LEARNED_LN, "parallel_residual": True, "hidden_act": "gelu"},
    "qk-norm-gqa": {"qk_norm": True, "num_key_value_heads": 2},
    "qk-norm-layernorm-no-bias": {"qk_norm": True, "norm_type": "layernorm", "norm_bias": False},
    "embedding-norm-scale-3": {"embedding_norm": True, "embedding_scale": 3.0, "norm_type": "layernorm"},
    "quick-gelu-glu": {"hidden_act": "quick_gelu"},
    "token-types-learned": {**LEARNED_LN, "type_vocab_size": 2},
    "token-types-rope": {"type_vocab_size": 2},
}
FP32_TOLERANCE = 5e-5
# int8 (run as int8_float32 on CPU), on these 2 prompts x 32 tokens: the largest logit difference 0.05 to 0.26. Its
# greedy agreement depends on the CPU's int8 kernels (on a Xeon 1.0 for every family but gpt2 0.89 and
# token-types-rope 0.97; on an AMD EPYC token-types-rope 0.48: one flipped step changes the rest of its sequence),
# so the check is the teacher-forced top-1 agreement on hf_tfm's greedy sequences, which one flip cannot cascade.
INT8_AGREEMENT, INT8_TOLERANCE = 0.85, 0.5


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.mark.parametrize("overrides", list(FAMILIES.values()), ids=list(FAMILIES))
def test_float32_is_exact_and_int8_agrees(overrides, tmp_path, tokenizer):
    model = trained(overrides)
    assert ctranslate2_blockers(model.config) == []
    path = export_ctranslate2(model, tmp_path / "f32", tokenizer=tokenizer)
    report = verify_ctranslate2(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, fresh_process=False)
    print(f"float32 {overrides}: {report}")
    assert report["compute_type"] == "float32" and report["prompts"] == 2 and report["max_new_tokens"] == NEW_TOKENS
    assert report["tokens_equal"] and report["max_logit_diff"] < FP32_TOLERANCE
    path = export_ctranslate2(model, tmp_path / "int8", quantize="int8", tokenizer=tokenizer)
    report = verify_ctranslate2(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, fresh_process=False)
    print(f"int8: {report}")
    assert report["compute_type"].startswith("int8")
    assert report["forced_agreement"] >= INT8_AGREEMENT and report["max_logit_diff"] < INT8_TOLERANCE


# The other types on GQA untied, largest logit difference measured: int8_float32 0.18 (as int8), int16 0.078, float16
# 8.8e-3 and bfloat16 0.076 (rounded weights, run as float32 where the CPU has no such type). Tokens all equal.
OTHER_TYPES = {"int8_float32": 0.5, "int16": 0.2, "float16": 0.02, "bfloat16": 0.2}


@pytest.mark.parametrize("qtype", list(OTHER_TYPES))
def test_other_types_agree_within_tolerance(qtype, tmp_path, tokenizer):
    model = trained(GQA_UNTIED)
    path = export_ctranslate2(model, tmp_path / qtype, quantize=qtype, tokenizer=tokenizer)
    report = verify_ctranslate2(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, fresh_process=False)
    print(f"{qtype}: {report}")
    assert report["max_logit_diff"] < OTHER_TYPES[qtype] and report["forced_agreement"] >= 0.9


def test_quantized_export_leaves_the_model_alone(tmp_path, tokenizer):
    # CTranslate2 quantizes the spec's arrays in place: they must be copies, not views of the parameters.
    model = trained({"num_key_value_heads": 2})
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    export_ctranslate2(model, tmp_path / "int8", quantize="int8", tokenizer=tokenizer)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_eos_is_suppressed_on_both_sides(tmp_path, tokenizer):
    # Token 12 follows 5 in the cycle: as an end token it would stop the second prompt at step 17 on either side
    # without the suppression, and must be skipped the same way on both.
    model = trained({"eos_token_id": [2, 12]})
    path = export_ctranslate2(model, tmp_path / "eos", tokenizer=tokenizer)
    report = verify_ctranslate2(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, fresh_process=False)
    assert report["tokens_equal"] and report["max_logit_diff"] < FP32_TOLERANCE
    reference = model.generate(torch.tensor([PROMPTS[1]]), do_sample=False, max_new_tokens=NEW_TOKENS)
    assert 12 in reference[0, len(PROMPTS[1]) :].tolist()  # what the suppression changed
    assert json.loads((path / "config.json").read_text())["eos_token"] == "</s>"  # the first end token
    model = trained({"eos_token_id": None})  # nothing to suppress, on either side
    path = export_ctranslate2(model, tmp_path / "no-eos", tokenizer=tokenizer)
    report = verify_ctranslate2(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, fresh_process=False)
    assert report["tokens_equal"] and report["max_logit_diff"] < FP32_TOLERANCE


def test_folder_round_trip_in_a_fresh_process(tmp_path, tokenizer):
    folder = saved(GQA_UNTIED, tmp_path / "lm", tokenizer)
    path = export(folder, tmp_path / "ct2", format="ctranslate2")
    assert path == tmp_path / "ct2" and format_of(path) == "ctranslate2"
    files = {p.name for p in path.iterdir()}
    assert {"model.bin", "config.json", "vocabulary.json", "tokenizer.json", "tokenizer_config.json"} <= files
    report = verify(path, folder, prompts=["def f(x):\n    return", "import os\n"], max_new_tokens=16)
    print(report)
    assert report["tokens_equal"] and report["max_logit_diff"] < FP32_TOLERANCE
    assert report["prompts"] == 2 and report["compute_type"] == "float32"


def test_vocabulary_config_and_tokenizer_files(tmp_path, tokenizer):
    model = trained({})
    path = export_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    vocabulary = json.loads((path / "vocabulary.json").read_text())
    ids = tokenizer.get_vocab()
    assert len(vocabulary) == VOCAB and len(ids) < VOCAB
    assert {token: i for i, token in enumerate(vocabulary[: len(ids)])} == ids
    assert vocabulary[len(ids) :] == [f"[PAD{i}]" for i in range(len(ids), VOCAB)]
    config = json.loads((path / "config.json").read_text())
    expected = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "layer_norm_epsilon": 1e-6}
    assert {key: config[key] for key in expected} == expected
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(path).get_vocab() == ids  # the tokenizer's files came along
    # A tokenizer.json path works too; no tokenizer at all is refused, leaving nothing.
    tokenizer.save_pretrained(tmp_path / "tok")
    export_ctranslate2(model, tmp_path / "from-json", tokenizer=tmp_path / "tok" / "tokenizer.json")
    assert json.loads((tmp_path / "from-json" / "vocabulary.json").read_text()) == vocabulary
    with pytest.raises(ValueError, match="pass `tokenizer=`"):
        export_ctranslate2(TfmForCausalLM(config_of()), tmp_path / "none")
    assert not (tmp_path / "none").exists()


# Each refusal: the knobs (overrides of the default llama config) and the words the error must hold. The control is
# the same config without the knobs (with the named ones kept), which CTranslate2 takes.
REFUSALS = [
    ({"num_experts": 4}, {}, ["`num_experts`=4"]),
    ({"sliding_window": 16}, {}, ["`layer_types`", "sliding window"]),
    (
        {"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]},
        {},
        ["`layer_types`=['full_attention', 'sliding_attention']"],
    ),
    ({"first_layer_attn_norm": False}, {}, ["`first_layer_attn_norm`=False"]),
    ({"qk_norm_scope": "projection"}, {"qk_norm": True}, ["`qk_norm_scope`='projection'"]),
    ({"hidden_act": "tanh"}, {}, ["`hidden_act`='tanh'", "quick_gelu"]),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, {}, ["`rope_parameters`", "rope_type in"]),
    (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        {},
        ["RoPE on every dimension"],
    ),
    (
        {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
        {},
        ["one flat RoPE dict"],
    ),
    ({"embedding_scale": 2.0}, {"type_vocab_size": 2}, ["`embedding_scale`=2.0", "token-type"]),
    ({"num_experts": 4, "first_layer_attn_norm": False}, {}, ["`num_experts`=4", "`first_layer_attn_norm`=False"]),
]


@pytest.mark.parametrize(("knobs", "kept", "words"), REFUSALS, ids=[",".join(k) for k, _, _ in REFUSALS])
def test_refusals_name_every_knob(knobs, kept, words, tmp_path, tokenizer):
    assert ctranslate2_blockers(config_of(**kept)) == []  # the control
    config = config_of(**kept, **knobs)
    found = ctranslate2_blockers(config)
    message = " ".join(found)
    for word in words:
        assert word in message, message
    assert all("CTranslate2" in blocker for blocker in found) and blockers(config, "ctranslate2") == found
    with pytest.raises(ValueError, match="CTranslate2 does not compute") as err:
        export_ctranslate2(TfmForCausalLM(config), tmp_path / "out", tokenizer=tokenizer)
    assert all(word in str(err.value) for word in words)
    assert not (tmp_path / "out").exists()


def test_embedding_scale_with_token_types_needs_a_position_table():
    # The control of the token-type refusal the other way round: a learned table holds the row at any scale.
    assert ctranslate2_blockers(config_of(**LEARNED_LN, type_vocab_size=2, embedding_scale=2.0)) == []


def test_a_seq2seq_decoder_alone_or_a_stack_of_the_wrong_kind_is_refused(tmp_path, tokenizer):
    assert "`add_cross_attention`=True" in " ".join(ctranslate2_blockers(config_of(add_cross_attention=True)))
    assert ctranslate2_blockers(config_of(is_causal=False)) == []  # the control: an encoder, as TfmModel
    with pytest.raises(ValueError, match=r"exports a TfmForCausalLM as a decoder \(is_causal=True\)"):
        export_ctranslate2(TfmForCausalLM(config_of(is_causal=False)), tmp_path / "lm", tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"exports a TfmModel as an encoder \(is_causal=False\)"):
        export_ctranslate2(TfmModel(config_of()), tmp_path / "backbone", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="not TfmForSequenceClassification"):
        model = TfmForSequenceClassification(config_of(is_causal=False, num_labels=2))
        export_ctranslate2(model, tmp_path / "cls", tokenizer=tokenizer)
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------------------
# Encoders: TransformerEncoderModelSpec, run by ctranslate2.Encoder

BERT = {**LEARNED_LN, "is_causal": False, "norm_position": "post", "hidden_act": "gelu", "embedding_norm": True}
ENCODERS = {
    # BERT's block: post-norm, learned positions, embedding norm, token types, the pooler (dense + tanh)
    "bert-types-pooler": {**BERT, "type_vocab_size": 2, "add_pooling_layer": True},
    "bert-no-pooler": BERT,
    # a modern encoder: pre-norm, RoPE, RMSNorm, SwiGLU, GQA, qk-norm
    "rope-gqa-qk-norm": {"is_causal": False, "num_key_value_heads": 2, "qk_norm": True},
    "sinusoidal-gelu-pooler": {**SINUSOIDAL, "is_causal": False, "add_pooling_layer": True},
}


def encoder_model(overrides: dict) -> TfmModel:
    torch.manual_seed(0)
    model = TfmModel(config_of(**overrides)).eval()
    with torch.no_grad():  # weights of a trained model's scale, not initializer_range (whose outputs are ~0)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return model


@pytest.mark.parametrize("case", list(ENCODERS))
def test_encoder_float32_matches_on_a_padded_batch(case, tmp_path, tokenizer):
    model = encoder_model(ENCODERS[case])
    path = export(model, tmp_path / "enc", format="ctranslate2", tokenizer=tokenizer)
    report = verify(path, model, prompts=PROMPTS, fresh_process=False)
    print(f"{case}: {report}")
    pooled = model.pooler is not None
    assert report["outputs"] == ["last_hidden_state", *(["pooler_output"] if pooled else [])]
    assert report["compute_type"] == "float32" and report["prompts"] == len(PROMPTS)
    assert report["max_diff"] < 5e-5
    assert format_of(path) == "ctranslate2"


def test_encoder_token_types_reach_the_second_table(tmp_path, tokenizer):
    """Segment ids as BERT's pairs give them: CTranslate2 adds the type table's rows, as hf_tfm does."""
    model = encoder_model(ENCODERS["bert-types-pooler"])
    path = export(model, tmp_path / "enc", format="ctranslate2", tokenizer=tokenizer)
    ids = [PROMPTS[1]]
    types = [[0] * (len(ids[0]) // 2) + [1] * (len(ids[0]) - len(ids[0]) // 2)]
    out = ctranslate2.Encoder(str(path), device="cpu").forward_batch(ids, token_type_ids=types)
    with torch.no_grad():
        ours = model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types))
    theirs = torch.tensor(np.asarray(out.last_hidden_state))
    assert (theirs - ours.last_hidden_state).abs().max() < 5e-5
    assert (torch.tensor(np.asarray(out.pooler_output)) - ours.pooler_output).abs().max() < 5e-5
    with torch.no_grad():  # the control: all-zero types give other features
        zeros = model(input_ids=torch.tensor(ids)).last_hidden_state
    assert (zeros - ours.last_hidden_state).abs().max() > 1e-2


def test_encoder_int8_is_close_and_refusals_name_the_knob(tmp_path, tokenizer):
    model = encoder_model(ENCODERS["bert-types-pooler"])
    path = export(model, tmp_path / "int8", format="ctranslate2", quantize="int8", tokenizer=tokenizer)
    report = verify(path, model, prompts=PROMPTS, fresh_process=False)
    assert report["compute_type"].startswith("int8") and 5e-5 < report["max_diff"] < 0.5, report
    for knobs, word in (
        ({"position_embedding_type": "alibi"}, "`position_embedding_type`='alibi'"),
        ({"add_pooling_layer": True, "classifier_pooling": "mean"}, "`classifier_pooling`='mean'"),
        ({"add_pooling_layer": True, "classifier_activation": "sigmoid"}, "`classifier_activation`='sigmoid'"),
        ({"sliding_window": 4}, "`layer_types`"),
    ):
        assert ctranslate2_blockers(config_of(**BERT)) == []  # the control
        found = " ".join(ctranslate2_blockers(config_of(**{**BERT, **knobs})))
        assert word in found and "CTranslate2's encoder" in found, found


def test_cli_exports_and_verifies_an_encoder_folder(tmp_path, tokenizer, capsys):
    folder = tmp_path / "enc"
    encoder_model(ENCODERS["rope-gqa-qk-norm"]).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert main(["export", str(folder), str(tmp_path / "ct2"), "--format", "ctranslate2", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verified in CTranslate2: outputs last_hidden_state" in out and "largest difference" in out
    ok, why = describe(str(folder))["integrations"]["export to runtimes"]["CTranslate2"]
    assert ok and "an Encoder" in why
    TfmModel(config_of()).save_pretrained(tmp_path / "decoder-backbone")  # the control: a decoder's backbone
    ok, why = describe(str(tmp_path / "decoder-backbone"))["integrations"]["export to runtimes"]["CTranslate2"]
    assert not ok and "is_causal=False" in why


# ---------------------------------------------------------------------------------------------------------------------
# Encoder-decoders: TransformerSpec, run by ctranslate2.Translator

PAPER = {**SINUSOIDAL, "norm_position": "post"}  # "Attention Is All You Need"
BART = {**LEARNED_LN, "norm_position": "post", "hidden_act": "gelu", "position_offset": 2, "embedding_norm": True}
SEQ2SEQ_FAMILIES = {
    "paper-3-2-layers": ({**PAPER, "num_hidden_layers": 3}, PAPER, {}),
    "bart": (BART, BART, {}),
    "llama-gqa-untied": ({"num_key_value_heads": 2}, {"num_key_value_heads": 2}, {"tie_word_embeddings": False}),
    "alibi-decoder": ({"position_embedding_type": "learned"}, {"position_embedding_type": "alibi"}, {}),
    "unshared-tables": ({"vocab_size": VOCAB - 10}, {}, {"share_encoder_decoder_embeddings": False}),
    "encoder-qk-norm-llama3-token-types": (
        {"qk_norm": True, "rope_parameters": LLAMA3_ROPE, "type_vocab_size": 2},
        {},
        {},
    ),
}


# int8 measured: largest logit difference 0.11 to 0.24; greedy agreement 1.0 for every family on a Xeon, 0.5 for two
# on an AMD EPYC (one early flip), so the check is the teacher-forced agreement, as for causal LMs.
@pytest.mark.parametrize(("encoder", "decoder", "top"), list(SEQ2SEQ_FAMILIES.values()), ids=list(SEQ2SEQ_FAMILIES))
def test_seq2seq_float32_is_exact_and_int8_agrees(encoder, decoder, top, tmp_path, tokenizer):
    model = trained_seq2seq(encoder, decoder, **top)
    assert ctranslate2_blockers(model.config) == []
    path = export_ctranslate2(model, tmp_path / "f32", tokenizer=tokenizer)
    separate = "vocab_size" in encoder  # a source and a target vocabulary of different sizes
    vocabularies = ["source_vocabulary.json", "target_vocabulary.json"] if separate else ["shared_vocabulary.json"]
    assert sorted(p.name for p in path.iterdir() if "vocabulary" in p.name) == vocabularies
    report = verify_ctranslate2(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, fresh_process=False)
    print(f"float32 {encoder} {decoder} {top}: {report}")
    assert report["tokens_equal"] and report["max_logit_diff"] < FP32_TOLERANCE
    path = export_ctranslate2(model, tmp_path / "int8", quantize="int8", tokenizer=tokenizer)
    report = verify_ctranslate2(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, fresh_process=False)
    print(f"int8: {report}")
    assert report["forced_agreement"] >= INT8_AGREEMENT and report["max_logit_diff"] < INT8_TOLERANCE


def test_seq2seq_folder_round_trip_in_a_fresh_process(tmp_path, tokenizer):
    encoder, decoder, top = SEQ2SEQ_FAMILIES["paper-3-2-layers"]
    model = trained_seq2seq(encoder, decoder, **top)
    model.save_pretrained(tmp_path / "s2s")
    tokenizer.save_pretrained(tmp_path / "s2s")
    path = export(tmp_path / "s2s", tmp_path / "ct2", format="ctranslate2")
    config = json.loads((path / "config.json").read_text())
    assert config["decoder_start_token"] == "<s>" and not config["add_source_bos"]
    report = verify(path, tmp_path / "s2s", prompts=["def f(x):\n    return", "import os\n"], max_new_tokens=16)
    print(report)
    assert report["tokens_equal"] and report["max_logit_diff"] < FP32_TOLERANCE


SEQ2SEQ_REFUSALS = [
    ({"position_embedding_type": "alibi"}, {}, ["`position_embedding_type`='alibi'", "encoder"]),
    ({"parallel_residual": True}, {}, ["`parallel_residual`=True", "encoder"]),
    ({}, {"qk_norm": True}, ["`qk_norm`=True", "cross-attention"]),
    ({}, {"norm_eps": 1e-5}, ["`norm_eps`=1e-05", "one layer_norm_epsilon"]),
    ({"num_experts": 4}, {"sliding_window": 8}, ["`num_experts`=4", "encoder", "`layer_types`", "decoder"]),
]


SEQ2SEQ_REFUSAL_IDS = ["encoder-alibi", "encoder-parallel", "decoder-qk-norm", "two-eps", "experts-and-window"]


@pytest.mark.parametrize(("encoder", "decoder", "words"), SEQ2SEQ_REFUSALS, ids=SEQ2SEQ_REFUSAL_IDS)
def test_seq2seq_refusals_name_every_knob(encoder, decoder, words, tmp_path, tokenizer):
    assert ctranslate2_blockers(tiny_seq2seq_config()) == []  # the control
    config = tiny_seq2seq_config(encoder=encoder, decoder=decoder)
    message = " ".join(ctranslate2_blockers(config))
    for word in words:
        assert word in message, message
    with pytest.raises(ValueError, match="CTranslate2 does not compute"):
        export_ctranslate2(TfmForConditionalGeneration(config), tmp_path / "out", tokenizer=tokenizer)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Failures and the API


def test_failed_export_leaves_nothing(tmp_path, tokenizer, monkeypatch):
    out = tmp_path / "exports"
    out.mkdir()
    folder = saved({"num_experts": 4}, tmp_path / "moe", tokenizer)
    with pytest.raises(ValueError, match="num_experts"):
        export(folder, out / "moe", format="ctranslate2")

    def broken(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ctranslate2.specs.LanguageModelSpec, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        export_ctranslate2(trained({}), out / "lm", tokenizer=tokenizer)
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    # An existing folder is replaced when it is empty or an earlier export (the CLI's --overwrite), else left alone.
    (out / "taken").mkdir()
    (out / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="taken"):
        export_ctranslate2(trained({}), out / "taken", tokenizer=tokenizer)
    assert [p.name for p in (out / "taken").iterdir()] == ["keep.txt"]
    (out / "empty").mkdir()
    path = export_ctranslate2(trained({}), out / "empty", tokenizer=tokenizer)
    (path / "stale.txt").write_text("from the earlier export")
    path = export_ctranslate2(trained({}), path, quantize="int8", tokenizer=tokenizer)
    assert "stale.txt" not in {p.name for p in path.iterdir()} and (path / "model.bin").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["empty", "taken"]  # no temporary folder left


def test_missing_ctranslate2_is_one_line(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "ctranslate2", None)
    with pytest.raises(ImportError, match=r'pip install ctranslate2 \(or pip install "hf-tfm\[export\]"\)'):
        export(trained({}), tmp_path / "ct2", format="ctranslate2", tokenizer=tokenizer)
    assert not (tmp_path / "ct2").exists()


def test_quantize_types_and_unknown_type(tmp_path, tokenizer):
    assert quantize_types("ctranslate2") == list(ct2_export.TYPES)
    assert {"float32", "int8", "int8_float32", "int16", "float16", "bfloat16"} <= set(ct2_export.TYPES)
    with pytest.raises(ValueError, match="quantize='q4_0'"):
        export_ctranslate2(trained({}), tmp_path / "ct2", quantize="q4_0", tokenizer=tokenizer)


def test_cli_export_ctranslate2_verify_and_info(tmp_path, tokenizer, capsys):
    encoder, decoder, top = SEQ2SEQ_FAMILIES["bart"]
    model = trained_seq2seq(encoder, decoder, **top)
    model.save_pretrained(tmp_path / "s2s")
    tokenizer.save_pretrained(tmp_path / "s2s")
    ok, why = describe(str(tmp_path / "s2s"))["integrations"]["export to runtimes"]["CTranslate2"]
    assert ok and "Translator" in why
    dst = tmp_path / "ct2"
    argv = ["export", str(tmp_path / "s2s"), str(dst), "--format", "ctranslate2", "--verify", "--max-new-tokens", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "CTranslate2" in out and "greedy tokens equal: yes" in out
    assert main(argv) == 1 and "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--quantize", "int8", "--overwrite"]) == 0 and (dst / "model.bin").is_file()
    config_of(num_experts=4).save_pretrained(tmp_path / "moe")
    ok, why = describe(str(tmp_path / "moe"))["integrations"]["export to runtimes"]["CTranslate2"]
    assert not ok and "num_experts" in why
