"""`hf_tfm.from_torch`: plain-PyTorch `nn.TransformerEncoder` models and their imports give the same outputs.

The oracle is the torch model itself, run as its author would: padding as `src_key_padding_mask` (True = pad), a bool
causal mask for the language model, `embedding(ids) + positions`, its own pooling. torch's eval fast path zeroes the
padded rows, so only real tokens are compared.
"""

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import load_script, paper_table, random_ids
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

import hf_tfm
from hf_tfm import TfmForCausalLM, TfmForSequenceClassification
from hf_tfm.convert.from_torch import TASKS, sinusoidal_table
from hf_tfm.training import PadCollator

VOCAB, D, HEADS, FF, LAYERS, MAX_LEN = 99, 32, 4, 48, 2, 64
LENGTHS = [7, 4, 6]  # right-padded batch: each row's real tokens, then pad id 0


def tutorial_table(length: int, dim: int) -> torch.Tensor:
    """The PyTorch tutorials' `PositionalEncoding.pe` (fp32, shape (length, 1, dim), seq-first)."""
    position = torch.arange(length).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
    pe = torch.zeros(length, 1, dim)
    pe[:, 0, 0::2] = torch.sin(position * div_term)
    pe[:, 0, 1::2] = torch.cos(position * div_term)
    return pe


class TorchModel(nn.Module):
    """What a PyTorch user writes: embeddings + positions -> nn.TransformerEncoder -> (pooling) -> head."""

    def __init__(
        self,
        task: str,
        norm_first: bool = False,
        activation="relu",
        final_norm: bool = False,
        positions: str = "learned",
        batch_first: bool = True,
        pooling: str | None = None,
        bias: bool = True,
        d: int = D,
        heads: int = HEADS,
        eps: float = 1e-5,
        tied: bool = False,
    ) -> None:
        super().__init__()
        self.task, self.pooling, self.batch_first = task, pooling, batch_first
        self.embed = nn.Embedding(VOCAB, d, padding_idx=0)
        if positions == "learned":
            self.positions = nn.Embedding(MAX_LEN, d)
        elif positions == "interleaved":
            self.register_buffer("pe", tutorial_table(MAX_LEN, d) if d % 2 == 0 else paper_table(MAX_LEN, d).float())
        else:
            self.register_buffer("pe", sinusoidal_table(MAX_LEN, d, "halves").float())
        layer = nn.TransformerEncoderLayer(
            d, heads, FF, dropout=0.0, activation=activation, layer_norm_eps=eps, batch_first=batch_first,
            norm_first=norm_first, bias=bias,
        )  # fmt: skip
        norm = nn.LayerNorm(d, eps=eps, bias=bias) if final_norm else None
        self.body = nn.TransformerEncoder(layer, LAYERS, norm=norm, enable_nested_tensor=False)
        if task == "sequence-classification":
            self.head = nn.Linear(d, 3)
        elif task == "token-classification":
            self.head = nn.Linear(d, 5)
        elif task == "masked-lm":
            self.head = nn.Sequential(
                nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d, eps=eps, bias=bias), nn.Linear(d, VOCAB)
            )
        elif task == "causal-lm":
            self.head = nn.Linear(d, VOCAB, bias=bias)
        else:
            self.head = None
        torch.manual_seed(0)
        with torch.no_grad():  # random everything, norms included, so every weight has to land in the right place
            for p in self.parameters():
                p.normal_(0.0, 0.2)
        if tied:
            self.head.weight = self.embed.weight

    def positions_arg(self):
        return self.positions if hasattr(self, "positions") else self.pe

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == 0
        length = ids.shape[1]
        x = self.embed(ids)
        x = x + (
            self.positions.weight[:length] if hasattr(self, "positions") else self.pe.reshape(MAX_LEN, -1)[:length]
        )
        causal = self.task == "causal-lm"
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool), 1) if causal else None
        if not self.batch_first:
            x = x.transpose(0, 1)
        x = self.body(x, mask=mask, src_key_padding_mask=pad, is_causal=causal)
        if not self.batch_first:
            x = x.transpose(0, 1)
        if self.task == "sequence-classification":
            real = (~pad).float()
            if self.pooling == "first":
                x = x[:, 0]
            elif self.pooling == "mean":
                x = (x * real[..., None]).sum(1) / real.sum(1, keepdim=True)
            else:
                x = x[torch.arange(len(x)), real.sum(1).long() - 1]
        return x if self.head is None else self.head(x)

    def imported(self):
        return hf_tfm.from_torch(
            self.body, embed_tokens=self.embed, positions=self.positions_arg(), head=self.head, task=self.task,
            pooling=self.pooling,
        )  # fmt: skip


def padded_batch(lengths=LENGTHS, seed=0) -> torch.Tensor:
    ids = random_ids(len(lengths), max(lengths), VOCAB, seed=seed)
    for row, n in enumerate(lengths):
        ids[row, n:] = 0
    return ids


def compare(torch_model: TorchModel, model, ids: torch.Tensor) -> float:
    """Max |difference| of the two models' outputs on the real tokens (or the pooled vectors)."""
    with torch.no_grad():
        expected = torch_model.eval()(ids)
        out = model.eval()(input_ids=ids, attention_mask=(ids != 0).long())
    actual = out.last_hidden_state if torch_model.task == "feature-extraction" else out.logits
    if torch_model.task != "sequence-classification":
        real = ids != 0
        expected, actual = expected[real], actual[real]
    assert actual.shape == expected.shape
    return (actual - expected).abs().max().item()


# Every task with every combination of norm_first, final norm and position kind; the activation (string or function)
# and batch_first vary along with them, so each appears with every task and both layer layouts.
ACTIVATIONS = ["relu", F.gelu, "gelu", F.relu]
ENCODER_TASKS = [task for task in TASKS if task != "seq2seq-lm"]  # nn.Transformer bodies: see the end of the file
GRID = [
    (task, norm_first, final_norm, positions, ACTIVATIONS[i % 4], i % 3 != 0)
    for i, (task, norm_first, final_norm, positions) in enumerate(
        itertools.product(ENCODER_TASKS, [False, True], [False, True], ["learned", "interleaved", "halves"])
    )
]


def grid_id(task, norm_first, final_norm, positions, activation, batch_first) -> str:
    layout = ["post" if not norm_first else "pre", "norm" if final_norm else "no-norm", positions]
    return "-".join([task, *layout, getattr(activation, "__name__", activation), "bf" if batch_first else "sf"])


@pytest.mark.parametrize(
    ("task", "norm_first", "final_norm", "positions", "activation", "batch_first"),
    GRID,
    ids=[grid_id(*case) for case in GRID],
)
def test_import_matches_torch(task, norm_first, final_norm, positions, activation, batch_first):
    pooling = (
        ["first", "mean", "last"][(norm_first + 2 * final_norm) % 3] if task == "sequence-classification" else None
    )
    torch_model = TorchModel(task, norm_first, activation, final_norm, positions, batch_first, pooling)
    model = torch_model.imported()
    config = model.config
    assert type(model) is TASKS[task]
    assert config.norm_position == ("pre" if norm_first else "post") and config.final_norm == final_norm
    assert config.hidden_act == getattr(activation, "__name__", activation)
    assert config.pad_token_id == 0 and config.eos_token_id is None
    if positions != "learned":
        assert config.position_embedding_type == "sinusoidal" and config.sinusoidal_layout == positions
    assert compare(torch_model, model, padded_batch()) < 1e-5


@pytest.mark.parametrize("tied", [False, True])
def test_causal_lm_generates_like_a_torch_loop(tied):
    torch_model = TorchModel("causal-lm", norm_first=True, activation="gelu", positions="interleaved", tied=tied)
    model = torch_model.imported()
    assert model.config.tie_word_embeddings is tied and model.config.lm_head_bias
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = random_ids(2, 5, VOCAB, seed=3)
    ids = prompt
    with torch.no_grad():
        for _ in range(20):  # greedy decoding as a torch user writes it: the whole sequence again at every step
            ids = torch.cat([ids, torch_model.eval()(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        generated = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False
        )
    assert torch.equal(generated, ids)


def test_variants_bias_free_eps_odd_width_tied_mlm():
    """bias=False everywhere, a custom layer_norm_eps, an odd d_model with the paper's table, a head with no bias."""
    torch_model = TorchModel(
        "causal-lm", bias=False, eps=1e-6, d=33, heads=3, positions="interleaved", final_norm=True
    )
    model = torch_model.imported()
    config = model.config
    assert (config.attention_bias, config.mlp_bias, config.norm_bias, config.lm_head_bias) == (False,) * 4
    assert config.norm_eps == 1e-6 and config.hidden_size == 33
    assert compare(torch_model, model, padded_batch()) < 1e-5
    # activation modules instead of strings or functions
    torch_model = TorchModel("feature-extraction", activation=nn.GELU(), positions="interleaved")
    assert torch_model.imported().config.hidden_act == "gelu"
    assert compare(torch_model, torch_model.imported(), padded_batch()) < 1e-5
    # a masked LM whose decoder shares the embedding matrix
    torch_model = TorchModel("masked-lm", norm_first=True, positions="halves")
    torch_model.head[-1].weight = torch_model.embed.weight
    model = torch_model.imported()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert compare(torch_model, model, padded_batch()) < 1e-5


def test_tied_causal_lm_with_embedding_scale():
    """`embedding(ids) * scale` with the head sharing the embedding: the knob scales the lookup, not the head."""
    torch_model = TorchModel("causal-lm", tied=True)
    ids = padded_batch()
    with torch.no_grad():
        x = torch_model.eval().embed(ids) * 2.0 + torch_model.positions.weight[: ids.shape[1]]
        causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)
        expected = torch_model.head(torch_model.body(x, mask=causal, src_key_padding_mask=ids == 0, is_causal=True))
    model = hf_tfm.from_torch(
        torch_model.body, embed_tokens=torch_model.embed, positions=torch_model.positions, head=torch_model.head,
        task="causal-lm", embedding_scale=2.0,
    )  # fmt: skip
    assert model.config.embedding_scale == 2.0 and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, attention_mask=(ids != 0).long()).logits
    assert (logits - expected)[ids != 0].abs().max().item() < 1e-5


def test_classifier_with_pooler_head_and_embedding_scale():
    """BERT's pooler as an nn.Sequential head, and the tutorials' `embedding(src) * sqrt(d_model)`."""
    torch_model = TorchModel("sequence-classification", pooling="first")
    torch_model.head = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Dropout(0.1), nn.Linear(D, 3))
    ids = padded_batch()
    with torch.no_grad():
        for p in torch_model.head.parameters():
            p.normal_(0.0, 0.2)
        torch_model.eval()
        scaled = torch_model.embed.weight * math.sqrt(D)
        original = torch_model.embed.weight.detach().clone()
        torch_model.embed.weight.copy_(scaled)  # the oracle: the same model with the scale applied by hand
        expected = torch_model(ids)
        torch_model.embed.weight.copy_(original)
    model = hf_tfm.from_torch(
        torch_model.body, embed_tokens=torch_model.embed, positions=torch_model.positions, head=torch_model.head,
        task="sequence-classification", pooling="first", embedding_scale=math.sqrt(D),
    )  # fmt: skip
    assert model.config.classifier_dense and model.config.classifier_activation == "tanh"
    assert model.config.classifier_dropout == 0.1
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, attention_mask=(ids != 0).long()).logits
    assert (logits - expected).abs().max().item() < 1e-5


def refusal(match: str, **changes):
    torch_model = TorchModel("causal-lm")
    kwargs = {
        "body": torch_model.body, "embed_tokens": torch_model.embed, "positions": torch_model.positions,
        "head": torch_model.head, "task": "causal-lm",
    }  # fmt: skip
    with pytest.raises((ValueError, NotImplementedError), match=match):
        hf_tfm.from_torch(**{**kwargs, **changes})


class MyLayer(nn.TransformerEncoderLayer):
    pass


def test_refusals():
    """Everything hf_tfm cannot reproduce exactly is refused, saying what and why."""
    refusal("`task='seq2seq-lm'` goes with an nn.Transformer body", body=nn.Transformer(D, HEADS, 1, 1, FF))
    refusal(
        "custom activation",
        body=nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, FF, activation=torch.tanh), 1),
    )
    refusal("custom layer class", body=nn.TransformerEncoder(MyLayer(D, HEADS, FF), 1))
    refusal("kdim/vdim|mismatched|embedding_dim", embed_tokens=nn.Embedding(VOCAB, D + 4))
    refusal("no position-free mode", positions=None)
    refusal("not a sinusoidal one", positions=torch.randn(MAX_LEN, D))
    refusal("vocabulary", head=nn.Linear(D, VOCAB + 1))
    refusal("`pooling`", pooling="first")
    refusal("`task` must be one of", task="translation")
    refusal("goes with an nn.Transformer body", task="seq2seq-lm")
    refusal(
        "an nn.TransformerDecoder alone has no encoder",
        body=nn.TransformerDecoder(nn.TransformerDecoderLayer(D, HEADS, FF), 1),
    )
    refusal("`target_embed_tokens` is for task 'seq2seq-lm'", target_embed_tokens=nn.Embedding(VOCAB, D))
    refusal(
        "eps", body=nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, FF), 1, norm=nn.LayerNorm(D, eps=1e-6))
    )
    refusal("read from the torch modules", hidden_size=64)
    torch_model = TorchModel("masked-lm")
    with pytest.raises(ValueError, match="token classifier over the vocabulary"):
        hf_tfm.from_torch(
            torch_model.body, embed_tokens=torch_model.embed, positions=torch_model.positions,
            head=nn.Linear(D, VOCAB), task="masked-lm",
        )  # fmt: skip
    layers = TorchModel("feature-extraction").body
    layers.layers[1].self_attn = nn.MultiheadAttention(D, 2, batch_first=True)
    with pytest.raises(ValueError, match=r"Layer 1 differs from layer 0 in \['num_attention_heads'\]"):
        hf_tfm.from_torch(layers, embed_tokens=nn.Embedding(VOCAB, D), positions=nn.Embedding(MAX_LEN, D))


def test_imported_model_saves_loads_trains_and_is_described(tmp_path, capsys):
    """An import is an ordinary hf_tfm model: save_pretrained, Auto* loading, Trainer, `hf-tfm info`."""
    torch_model = TorchModel("sequence-classification", norm_first=False, final_norm=True, positions="interleaved")
    torch_model.pooling = "first"
    model = torch_model.imported()
    ids = padded_batch()
    mask = (ids != 0).long()
    folder = tmp_path / "imported"
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["sinusoidal_layout"] == "interleaved" and saved["final_norm"] is True
    assert {"configuration.py", "modeling.py", "model.safetensors"} <= {p.name for p in folder.iterdir()}
    loaded = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert type(loaded) is TfmForSequenceClassification
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=ids, attention_mask=mask).logits, model.eval()(input_ids=ids, attention_mask=mask).logits
        )

    generator = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(3, VOCAB, (n,), generator=generator).tolist(), "labels": n % 3}
        for n in range(3, 11)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no", max_steps=3,
        per_device_train_batch_size=4, logging_steps=1, disable_tqdm=True, learning_rate=1e-3,
    )  # fmt: skip
    before = loaded.score.weight.detach().clone()
    trainer = Trainer(model=loaded, args=args, train_dataset=data, data_collator=PadCollator())
    trainer.train()
    assert trainer.state.global_step == 3 and not torch.equal(before, loaded.score.weight)
    assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)

    from hf_tfm.cli import main

    capsys.readouterr()  # Trainer's log lines
    assert main(["info", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "encoder"


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "from_torch_classifier.py"


def test_readme_example_runs(tmp_path):
    """examples/from_torch_classifier.py (the README's worked example) runs end to end at tiny sizes."""
    example = load_script(EXAMPLE, "from_torch_classifier")
    report = example.main(["--output-dir", str(tmp_path / "clf"), "--tiny"])
    assert report["max_difference"] < 1e-5
    assert report["trainer_steps"] > 0
    folder = tmp_path / "clf"
    assert {"config.json", "model.safetensors", "configuration.py", "modeling.py", "README.md"} <= {
        p.name for p in folder.iterdir()
    }
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)
    assert loaded.config.sinusoidal_layout == "interleaved"


def test_causal_lm_import_is_exported_nowhere_with_a_head_bias():
    """`lm_head_bias` blocks export: no in-tree family has a biased causal LM head."""
    from hf_tfm.convert import in_tree_blockers

    model = TorchModel("causal-lm").imported()
    assert isinstance(model, TfmForCausalLM)
    assert all(
        any("lm_head_bias" in b for b in found) for found in in_tree_blockers(model.config, "causal_lm").values()
    )


# ---------------------------------------------------------------------------------------------------------------------
# nn.Transformer (task "seq2seq-lm")

TARGET_VOCAB = 77


class TorchSeq2Seq(nn.Module):
    """The tutorials' translation model: source and target embeddings * sqrt(d) + one sinusoidal table ->
    nn.Transformer (causal `tgt_mask`, padding masks) -> a generator Linear over the target vocabulary."""

    def __init__(
        self, norm_first=False, activation="relu", batch_first=True, shared=True, tied=False, layout="interleaved"
    ):
        super().__init__()
        self.batch_first = batch_first
        self.src_embed = nn.Embedding(VOCAB, D, padding_idx=0)
        self.tgt_embed = self.src_embed if shared else nn.Embedding(TARGET_VOCAB, D, padding_idx=0)
        table = tutorial_table(MAX_LEN, D) if layout == "interleaved" else sinusoidal_table(MAX_LEN, D, "halves")
        self.register_buffer("pe", table.float().reshape(MAX_LEN, -1))
        self.transformer = nn.Transformer(
            D, HEADS, num_encoder_layers=3, num_decoder_layers=2, dim_feedforward=FF, dropout=0.0,
            activation=activation, batch_first=batch_first, norm_first=norm_first,
        )  # fmt: skip
        self.generator = nn.Linear(D, self.tgt_embed.num_embeddings)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.2)
        if tied:
            self.generator.weight = self.tgt_embed.weight

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        scale = math.sqrt(D)
        s = self.src_embed(src) * scale + self.pe[: src.shape[1]]
        t = self.tgt_embed(tgt) * scale + self.pe[: tgt.shape[1]]
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        if not self.batch_first:
            s, t = s.transpose(0, 1), t.transpose(0, 1)
        out = self.transformer(
            s, t, tgt_mask=causal, src_key_padding_mask=src == 0, tgt_key_padding_mask=tgt == 0,
            memory_key_padding_mask=src == 0, tgt_is_causal=True,
        )  # fmt: skip
        return self.generator(out if self.batch_first else out.transpose(0, 1))

    def imported(self, **kwargs):
        target = None if self.tgt_embed is self.src_embed else self.tgt_embed
        return hf_tfm.from_torch(
            self.transformer, embed_tokens=self.src_embed, target_embed_tokens=target, positions=self.pe,
            head=self.generator, task="seq2seq-lm", embedding_scale=math.sqrt(D), **kwargs,
        )  # fmt: skip


SEQ2SEQ_CASES = {
    "post-relu-shared": {},
    "pre-gelu-seq-first-own-vocab": {"norm_first": True, "activation": "gelu", "batch_first": False, "shared": False},
    "post-gelu-own-vocab-tied-halves": {"activation": F.gelu, "shared": False, "tied": True, "layout": "halves"},
    "pre-relu-shared-tied": {"norm_first": True, "tied": True},
}


@pytest.mark.parametrize("case", list(SEQ2SEQ_CASES))
def test_nn_transformer_imports_with_the_same_logits(case):
    torch_model = TorchSeq2Seq(**SEQ2SEQ_CASES[case]).eval()
    model = torch_model.imported(decoder_start_token_id=1).eval()
    config = model.config
    assert type(model).__name__ == "TfmForConditionalGeneration"
    assert (config.encoder.num_hidden_layers, config.decoder.num_hidden_layers) == (3, 2)
    assert config.encoder.final_norm and config.decoder.final_norm  # nn.Transformer always has both
    assert config.share_encoder_decoder_embeddings is (torch_model.tgt_embed is torch_model.src_embed)
    assert config.tie_word_embeddings is (torch_model.generator.weight is torch_model.tgt_embed.weight)
    src, tgt = padded_batch(), padded_batch([5, 3, 6], seed=1) % torch_model.tgt_embed.num_embeddings
    tgt[tgt == 0] = 0
    with torch.no_grad():
        expected = torch_model(src, tgt)
        logits = model(
            input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt,
            decoder_attention_mask=(tgt != 0).long(),
        ).logits  # fmt: skip
    real = tgt != 0
    assert (logits - expected)[real].abs().max().item() < 1e-5


def test_nn_transformer_import_generates_like_a_torch_loop():
    torch_model = TorchSeq2Seq(norm_first=True, shared=False).eval()
    model = torch_model.imported(decoder_start_token_id=1).eval()
    src = padded_batch()
    tgt = torch.ones(len(src), 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(12):  # greedy decoding as a torch user writes it: the whole target again at every step
            tgt = torch.cat([tgt, torch_model(src, tgt)[:, -1].argmax(-1, keepdim=True)], dim=1)
        generated = model.generate(input_ids=src, attention_mask=(src != 0).long(), max_new_tokens=12, do_sample=False)
    assert torch.equal(generated, tgt)


def test_nn_transformer_refusals():
    torch_model = TorchSeq2Seq()
    kwargs = {
        "body": torch_model.transformer, "embed_tokens": torch_model.src_embed, "positions": torch_model.pe,
        "head": torch_model.generator, "task": "seq2seq-lm",
    }  # fmt: skip
    with pytest.raises(ValueError, match="learned `positions` shared by source and target"):
        hf_tfm.from_torch(**{**kwargs, "positions": nn.Embedding(MAX_LEN, D)})
    with pytest.raises(ValueError, match="needs `head`, the generator"):
        hf_tfm.from_torch(**{**kwargs, "head": None})
    with pytest.raises(ValueError, match="`pooling`"):
        hf_tfm.from_torch(**kwargs, pooling="first")
    layer = torch_model.transformer.decoder.layers[1]
    layer.multihead_attn = nn.MultiheadAttention(D, HEADS, bias=False, batch_first=True)
    with pytest.raises(ValueError, match=r"Layer 1: `multihead_attn` differs from `self_attn`"):
        hf_tfm.from_torch(**kwargs)
