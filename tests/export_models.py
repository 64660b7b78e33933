"""Tiny trained models shared by the export tests (GGUF, llama.cpp, ONNX, CTranslate2).

Random weights give near-ties in greedy decoding that float noise flips, so each model is trained 60 steps on a fixed
token cycle (token t is always followed by the same token): every greedy step then has a clear winner, and an export
that computes the config exactly gives the same tokens.
"""

import json

import torch
from conftest import tiny_config

from hf_tfm import TfmForCausalLM, TfmForConditionalGeneration, TfmSeq2SeqConfig
from hf_tfm.tokenization import train_bpe_tokenizer

VOCAB = 320  # more rows than the trained tokenizer has tokens: exports pad the vocabulary with unused tokens
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 64,  # multiples of 32: every 2-D weight splits into Q8_0 / Q4_0 blocks
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "initializer_range": 0.02,
}
CYCLE = [5 + (7 * i) % 60 for i in range(60)]  # a fixed 60-token cycle: token t is always followed by the same one
PROMPTS = [[1, *CYCLE[3:9]], [1, *CYCLE[20:45]]]  # <s> + 6 tokens, <s> + 25 tokens
NEW_TOKENS = 32
# The blocks the export tests share: GPT-2's (learned positions, LayerNorm, tanh-GELU MLP, biases), and a post-norm one
GPT2_BLOCK = {
    "position_embedding_type": "learned",
    "norm_type": "layernorm",
    "norm_eps": 1e-5,
    "ffn_type": "mlp",
    "hidden_act": "gelu_new",
    "attention_bias": True,
    "mlp_bias": True,
}
POST_NORM_LEARNED = {
    "position_embedding_type": "learned",
    "norm_position": "post",
    "norm_type": "layernorm",
    "ffn_type": "mlp",
    "hidden_act": "gelu",
}


def config_of(**overrides):
    """The export tests' tiny config with `overrides`."""
    return tiny_config(**{**SIZES, **overrides})


def train_tokenizer():
    """A byte-level BPE tokenizer trained on a few lines of code (the models ignore its merges: ids are the cycle)."""
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    return train_bpe_tokenizer(texts, vocab_size=300)


_TRAINED: dict = {}


def trained(overrides: dict) -> TfmForCausalLM:
    """A tiny causal LM with `overrides`, trained 60 steps on the token cycle (cached per config)."""
    key = json.dumps(overrides, sort_keys=True)
    if key not in _TRAINED:
        torch.manual_seed(0)
        model = TfmForCausalLM(config_of(**overrides))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        starts = torch.randint(0, len(CYCLE), (60, 16))
        stream = torch.tensor(CYCLE * 3)
        for step_starts in starts:
            batch = torch.stack([stream[s : s + 64] for s in step_starts.tolist()])
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        _TRAINED[key] = model.eval()
    return _TRAINED[key]


def saved(overrides: dict, folder, tokenizer):
    """`trained(overrides)` and `tokenizer` saved in `folder`; returns the folder."""
    model = trained(overrides)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


_SEQ2SEQ: dict = {}


def trained_seq2seq(encoder: dict, decoder: dict, **overrides) -> TfmForConditionalGeneration:
    """A tiny encoder-decoder trained 60 steps to continue the token cycle (source: 12 tokens, target: the next 24);
    cached per config."""
    key = json.dumps([encoder, decoder, overrides], sort_keys=True)
    if key not in _SEQ2SEQ:
        torch.manual_seed(0)
        config = TfmSeq2SeqConfig(encoder={**SIZES, **encoder}, decoder={**SIZES, **decoder}, **overrides)
        model = TfmForConditionalGeneration(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stream = torch.tensor(CYCLE * 3)
        for starts in torch.randint(0, len(CYCLE), (60, 16)).tolist():
            source = torch.stack([stream[s : s + 12] for s in starts])
            labels = torch.stack([stream[s + 12 : s + 36] for s in starts])
            model(input_ids=source, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        _SEQ2SEQ[key] = model.eval()
    return _SEQ2SEQ[key]
