"""transformers pipelines on saved hf_tfm folders with a locally trained tokenizer, as with an in-tree model.

One tokenizer (hf_tfm.tokenization, byte-level BPE) and one tiny model per head are built and saved once per module;
each pipeline loads its folder by path. The last test loads two of them where hf_tfm is not importable.
"""

import json

import pytest
import torch
from conftest import build, run_without_hf_tfm, tiny_config
from transformers import AutoConfig, AutoModelForQuestionAnswering, AutoTokenizer, pipeline

from hf_tfm import (
    TfmForCausalLM,
    TfmForMaskedLM,
    TfmForQuestionAnswering,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmModel,
)
from hf_tfm.tokenization import train_bpe_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Pipelines load a model and its tokenizer from one folder.",
    "A tiny model answers tiny questions about tiny things.",
]
PROMPTS = ["Paris is", "The quick brown fox jumps", "A"]  # different lengths: the batch needs padding
TEXT = "Paris is the capital of France."
CLF_LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TAG_LABELS = {0: "O", 1: "CITY"}
GREEDY = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False}  # min: a random model may emit eos


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: folder} with a saved model and the tokenizer; the model config takes its vocab and ids from it."""
    tokenizer = train_bpe_tokenizer(CORPUS * 4, vocab_size=300, model_max_length=64)
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    encoder = {**ids, "is_causal": False}
    specs = {
        "lm": (TfmForCausalLM, ids),
        "mlm": (TfmForMaskedLM, encoder),
        "clf": (TfmForSequenceClassification, {**encoder, "num_labels": 3, "id2label": CLF_LABELS}),
        "tag": (TfmForTokenClassification, {**encoder, "num_labels": 2, "id2label": TAG_LABELS}),
        "qa": (TfmForQuestionAnswering, encoder),
        "enc": (TfmModel, encoder),
    }
    root = tmp_path_factory.mktemp("pipelines")
    result = {}
    for name, (model_class, overrides) in specs.items():
        build(model_class, tiny_config(**overrides)).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        result[name] = root / name
    return result


def strip_left(ids: list[int], pad: int) -> list[int]:
    """Token ids without their left padding (a batched text-generation pipeline returns it)."""
    return ids[next(i for i, t in enumerate(ids) if t != pad) :]


@pytest.fixture(scope="module")
def generator(folders):
    return pipeline("text-generation", model=str(folders["lm"]))


def test_text_generation_single_and_batched(generator):
    assert type(generator.model).__name__ == "TfmForCausalLM"
    assert generator.tokenizer.padding_side == "left"  # set by the pipeline for a decoder
    single = [generator(p, return_tensors=True, **GREEDY)[0]["generated_token_ids"] for p in PROMPTS]
    batched = [
        out[0]["generated_token_ids"] for out in generator(PROMPTS, batch_size=3, return_tensors=True, **GREEDY)
    ]
    pad = generator.tokenizer.pad_token_id
    assert all(ids[0] == pad for ids in batched[:1] + batched[2:]) and batched[1][0] != pad  # left-padded batch
    assert [strip_left(ids, pad) for ids in batched] == single  # and the padding changes nothing
    # The pipeline's ids are model.generate's on the prompt alone; the text is the prompt plus their decoding.
    tokenizer, model = generator.tokenizer, generator.model
    for prompt, ids in zip(PROMPTS, single, strict=True):
        enc = tokenizer(prompt, return_tensors="pt")
        assert ids == model.generate(**enc, **GREEDY)[0].tolist()
        assert len(ids) == enc.input_ids.shape[1] + GREEDY["max_new_tokens"]
    text = generator(PROMPTS[0], **GREEDY)[0]["generated_text"]
    assert text.startswith(PROMPTS[0]) and len(text) > len(PROMPTS[0])


def test_fill_mask(folders):
    fill = pipeline("fill-mask", model=str(folders["mlm"]))
    mask = fill.tokenizer.mask_token
    assert mask == "<mask>" and fill.tokenizer.mask_token_id is not None
    text = f"Paris is the {mask} of France."
    results = fill(text, top_k=3)
    scores = [r["score"] for r in results]
    assert len(results) == 3 and scores == sorted(scores, reverse=True) and 0 < scores[-1] <= scores[0] <= 1
    assert all(r["sequence"].startswith("Paris is the") and mask not in r["sequence"] for r in results)
    enc = fill.tokenizer(text, return_tensors="pt")
    position = enc.input_ids[0].tolist().index(fill.tokenizer.mask_token_id)
    with torch.no_grad():
        probs = fill.model(**enc).logits[0, position].softmax(-1)
    assert results[0]["token"] == int(probs.argmax())
    torch.testing.assert_close(torch.tensor(scores), probs.topk(3).values)


def test_text_classification(folders):
    classify = pipeline("text-classification", model=str(folders["clf"]))
    texts = [TEXT, "fox", "Berlin is the capital of Germany."]
    results = classify(texts, top_k=None, batch_size=len(texts))  # right-padded batch
    for text, result in zip(texts, results, strict=True):
        assert {r["label"] for r in result} == set(CLF_LABELS.values())  # names from the config's id2label
        with torch.no_grad():
            probs = classify.model(**classify.tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        expected = {CLF_LABELS[i]: p for i, p in enumerate(probs.tolist())}
        assert {r["label"]: r["score"] for r in result} == pytest.approx(expected, abs=1e-5)
    assert classify(TEXT)[0]["label"] == max(results[0], key=lambda r: r["score"])["label"]


def test_token_classification(folders):
    tag = pipeline("token-classification", model=str(folders["tag"]))
    entities = tag(TEXT, ignore_labels=[])  # every token, "O" included
    n_tokens = len(tag.tokenizer(TEXT).input_ids) - 1  # all but the leading <s>
    assert [e["index"] for e in entities] == list(range(1, n_tokens + 1))
    assert {e["entity"] for e in entities} <= set(TAG_LABELS.values())
    for e in entities:  # offsets point at the token's own characters
        assert TEXT[e["start"] : e["end"]] == tag.tokenizer.convert_tokens_to_string([e["word"]])
        assert 0.5 <= e["score"] <= 1


def test_question_answering(folders):
    """transformers 5.x has no "question-answering" pipeline; the head does what it did: the best-scoring span
    inside the context, from AutoModelForQuestionAnswering + AutoTokenizer on the folder."""
    with pytest.raises(KeyError, match="question-answering"):  # "removed" (newer) or "Unknown task" (older)
        pipeline("question-answering", model=str(folders["qa"]))
    tokenizer = AutoTokenizer.from_pretrained(folders["qa"])
    model = AutoModelForQuestionAnswering.from_pretrained(folders["qa"]).eval()
    assert type(model).__name__ == "TfmForQuestionAnswering"
    question = "What is the capital of France?"
    enc = tokenizer(question, TEXT, return_offsets_mapping=True, return_tensors="pt")
    offsets = enc.pop("offset_mapping")[0].tolist()
    context = [i for i, s in enumerate(enc.sequence_ids(0)) if s == 1]
    with torch.no_grad():
        out = model(**enc)
    assert out.start_logits.shape == out.end_logits.shape == enc.input_ids.shape
    start, end = max(
        ((i, j) for i in context for j in context if i <= j <= i + 10),
        key=lambda ij: float(out.start_logits[0, ij[0]] + out.end_logits[0, ij[1]]),
    )
    char_start, char_end = offsets[start][0], offsets[end][1]
    assert 0 <= char_start < char_end <= len(TEXT)
    assert TEXT[char_start:char_end] == tokenizer.decode(enc.input_ids[0, start : end + 1])


def test_feature_extraction(folders):
    extract = pipeline("feature-extraction", model=str(folders["enc"]))
    assert type(extract.model).__name__ == "TfmModel"
    features = extract(TEXT, return_tensors=True)
    enc = extract.tokenizer(TEXT, return_tensors="pt")
    assert features.shape == (1, enc.input_ids.shape[1], 32)
    reference = build(TfmModel, AutoConfig.from_pretrained(folders["enc"]))  # the same seed: the saved weights
    with torch.no_grad():
        torch.testing.assert_close(features, reference(**enc).last_hidden_state)


def test_pipelines_with_remote_code_only(tmp_path, folders, generator):
    """Where hf_tfm cannot be imported, text-generation and text-classification load from the folders' own code
    with trust_remote_code=True and give the in-process results; without the flag the folder is refused."""
    classify = pipeline("text-classification", model=str(folders["clf"]))
    code = f"""
    import json
    from transformers import pipeline
    lm, clf = {str(folders["lm"])!r}, {str(folders["clf"])!r}
    generator = pipeline("text-generation", model=lm, trust_remote_code=True)
    classify = pipeline("text-classification", model=clf, trust_remote_code=True)
    generated = generator({PROMPTS!r}, batch_size=3, return_tensors=True, **{GREEDY!r})
    try:
        pipeline("text-generation", model=lm)
        refused = False
    except ValueError as err:
        refused = "trust_remote_code" in str(err)
    print("RESULT:" + json.dumps({{
        "modules": [type(generator.model).__module__, type(classify.model).__module__],
        "generated": [g[0]["generated_token_ids"] for g in generated],
        "classified": classify({[TEXT, "fox"]!r}, top_k=None),
        "refused": refused,
    }}))
    """
    result = json.loads(run_without_hf_tfm(code, tmp_path).split("RESULT:")[-1])
    assert all(m.startswith("transformers_modules.") for m in result["modules"]), result["modules"]
    assert result["refused"]
    expected = generator(PROMPTS, batch_size=3, return_tensors=True, **GREEDY)
    assert result["generated"] == [g[0]["generated_token_ids"] for g in expected]
    for remote, local in zip(result["classified"], classify([TEXT, "fox"], top_k=None), strict=True):
        assert [r["label"] for r in remote] == [r["label"] for r in local]
        assert [r["score"] for r in remote] == pytest.approx([r["score"] for r in local], abs=1e-6)
