"""sentence-transformers embedding with hf_tfm encoders (`is_causal=False`) saved as plain transformers folders.

`SentenceTransformer(folder, trust_remote_code=True)` loads a folder without `modules.json` through `AutoModel` and
adds mean pooling. Oracles: masked mean pooling computed by hand from `AutoModel`'s `last_hidden_state` over a padded
batch, and each sentence run alone (no padding at all); a BERT-shaped hf_tfm encoder against in-tree BERT with the
same weights, through the same library. The library truncates to `max_position_embeddings` (64 here): a text longer
than that is embedded from its first 64 tokens. The `slow` test loads the folder where hf_tfm cannot be imported (the
folder's own code) and saves and reloads the SentenceTransformer there.
"""

import inspect
import json

import pytest
import torch
from conftest import build, run_without_hf_tfm, tiny_config
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, BertConfig, BertModel

import hf_tfm
from hf_tfm import TfmModel
from hf_tfm.tokenization import train_bpe_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ATOL = 1e-5
LENGTH = 64  # max_position_embeddings of both encoders
BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48}
BERT |= {"max_position_embeddings": LENGTH, "type_vocab_size": 2, "hidden_act": "gelu", "initializer_range": 0.2}


def source_lines() -> list[str]:
    return [line for line in inspect.getsource(json).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """A tokenizer; a default hf_tfm encoder (RoPE, RMSNorm, SwiGLU); a BERT-shaped one beside in-tree BERT."""
    root = tmp_path_factory.mktemp("st")
    texts = source_lines()
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    vocab = len(tokenizer)
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=vocab, pad_token_id=0, **BERT), add_pooling_layer=False).eval()
    models = {
        "encoder": build(TfmModel, tiny_config(vocab_size=vocab, is_causal=False, max_position_embeddings=LENGTH)),
        "tfm_bert": hf_tfm.from_hf(bert).eval(),
        "bert": bert,
    }
    assert type(models["tfm_bert"]) is TfmModel
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    long_text = " ".join(texts[:30])
    assert len(tokenizer(long_text).input_ids) > 2 * LENGTH
    sentences = [texts[3], "import json", "x", texts[40], long_text, texts[7] + " " + texts[8]]
    return {"root": root, "tokenizer": tokenizer, "sentences": sentences}


def mean_pooled(folder, tokenizer, sentences: list[str], alone: bool) -> torch.Tensor:
    """Masked mean of AutoModel's last hidden states over the real tokens (the first 64), computed by hand: over one
    right-padded batch, or each sentence alone."""
    model = AutoModel.from_pretrained(folder).eval()
    batches = [[sentence] for sentence in sentences] if alone else [sentences]
    pooled = []
    with torch.no_grad():
        for batch in batches:
            encoded = tokenizer(batch, padding=True, truncation=True, max_length=LENGTH, return_tensors="pt")
            hidden = model(**encoded).last_hidden_state
            mask = encoded["attention_mask"][..., None].to(hidden.dtype)
            pooled.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(pooled)


def embed(folder, sentences) -> tuple[SentenceTransformer, torch.Tensor]:
    model = SentenceTransformer(str(folder), trust_remote_code=True, device="cpu")
    return model, model.encode(sentences, batch_size=4, convert_to_tensor=True)


@pytest.fixture(scope="module")
def hand(built) -> dict:
    """The hand-pooled embeddings of each folder (padded batch)."""
    return {
        name: mean_pooled(built["root"] / name, built["tokenizer"], built["sentences"], alone=False)
        for name in ("encoder", "tfm_bert", "bert")
    }


@pytest.mark.parametrize("name", ["encoder", "tfm_bert"])
def test_encode_equals_masked_mean_pooling(built, hand, name):
    model, embeddings = embed(built["root"] / name, built["sentences"])
    assert model.max_seq_length == LENGTH  # from the config: the long text is cut to its first 64 tokens
    assert [type(module).__name__ for module in model] == ["Transformer", "Pooling"]
    assert type(model[0].auto_model) is TfmModel  # the installed package's class, in this process
    assert embeddings.shape == (len(built["sentences"]), 32)
    torch.testing.assert_close(embeddings, hand[name], rtol=0, atol=ATOL)
    alone = mean_pooled(built["root"] / name, built["tokenizer"], built["sentences"], alone=True)
    torch.testing.assert_close(embeddings, alone, rtol=0, atol=ATOL)  # padding changes nothing
    assert (embeddings[:, None] - embeddings[None]).abs().amax(-1).triu(1).sum() > 0  # sentences embed differently


def test_bert_shaped_encoder_equals_in_tree_bert(built, hand):
    _, ours = embed(built["root"] / "tfm_bert", built["sentences"])
    _, theirs = embed(built["root"] / "bert", built["sentences"])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)
    torch.testing.assert_close(theirs, hand["bert"], rtol=0, atol=ATOL)


def test_saved_sentence_transformer_reloads(built, hand, tmp_path):
    """`SentenceTransformer.save` writes modules.json and the model; reloading needs trust_remote_code again."""
    model, embeddings = embed(built["root"] / "encoder", built["sentences"])
    model.save(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "modules.json").is_file() and (tmp_path / "saved" / "modeling.py").is_file()
    _, reloaded = embed(tmp_path / "saved", built["sentences"])
    torch.testing.assert_close(reloaded, embeddings, rtol=0, atol=0)


@pytest.mark.slow
def test_remote_code_encoder(built, hand, tmp_path):
    """The folder's own code (hf_tfm not importable) embeds the same; saved and reloaded there, still the same."""
    code = f"""
        import json
        from sentence_transformers import SentenceTransformer
        model = SentenceTransformer({str(built["root"] / "encoder")!r}, trust_remote_code=True, device="cpu")
        module = type(model[0].auto_model).__module__
        first = model.encode({built["sentences"]!r}, batch_size=4, convert_to_tensor=True)
        model.save("saved")
        again = SentenceTransformer("saved", trust_remote_code=True, device="cpu")
        second = again.encode({built["sentences"]!r}, batch_size=4, convert_to_tensor=True)
        print("RESULT", json.dumps({{"module": module, "first": first.tolist(), "second": second.tolist()}}))
    """
    out = run_without_hf_tfm(code, tmp_path, timeout=300)
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    assert result["module"].startswith("transformers_modules.") and result["module"].endswith(".modeling")
    for key in ("first", "second"):
        torch.testing.assert_close(torch.tensor(result[key]), hand["encoder"], rtol=0, atol=ATOL)
