"""From plain PyTorch to the Hugging Face stack: a tutorial-style TransformerClassifier, imported with `from_torch`.

1. Build and train the classifier the way the PyTorch tutorials do (embedding * sqrt(d_model), the fixed interleaved
   sinusoidal table, nn.TransformerEncoder, first-token pooling, an nn.Linear head), in a plain training loop.
2. Import it with `hf_tfm.from_torch`: same weights, same logits.
3. Fine-tune the import with `Trainer`, and save it as a folder `push_to_hub` can upload as is (weights, config,
   modelling code, model card).

    python examples/from_torch_classifier.py --output-dir runs/from-torch   # --tiny: seconds, for the tests

The task is synthetic so the script needs no download: does a sequence contain a token below 20?
"""

import argparse
import math
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

import hf_tfm
from hf_tfm.training import PadCollator

PAD, CLS, VOCAB = 0, 1, 100


class PositionalEncoding(nn.Module):
    """The PyTorch tutorials' fixed table: sin on even dimensions, cos on odd ones (batch-first here)."""

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 512) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.pe[: x.size(1)])


class TransformerClassifier(nn.Module):
    def __init__(self, d_model: int, nhead: int, num_layers: int, dim_feedforward: int, num_labels: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(VOCAB, d_model, padding_idx=PAD)
        self.pos_encoder = PositionalEncoding(d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.classifier = nn.Linear(d_model, num_labels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.pos_encoder(self.embedding(ids) * math.sqrt(self.d_model))
        x = self.encoder(x, src_key_padding_mask=ids == PAD)
        return self.classifier(x[:, 0])  # the first token (CLS) stands for the sequence


def make_data(n: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(n):
        length = int(torch.randint(4, 16, (1,), generator=generator))
        ids = [CLS, *torch.randint(3, VOCAB, (length,), generator=generator).tolist()]
        data.append({"input_ids": ids, "labels": int(min(ids[1:]) < 20)})
    return data


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/from-torch-classifier")
    parser.add_argument("--tiny", action="store_true", help="small model, a few steps (the tests run this)")
    args = parser.parse_args(argv)
    d_model, layers, steps = (32, 1, 5) if args.tiny else (128, 2, 300)
    torch.manual_seed(0)
    data = make_data(64 if args.tiny else 2048, seed=0)
    collate = PadCollator(pad_token_id=PAD)

    # 1. Plain PyTorch: the tutorial model and training loop.
    model = TransformerClassifier(d_model, nhead=4, num_layers=layers, dim_feedforward=4 * d_model, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(steps):
        batch = collate([data[(step * 32 + i) % len(data)] for i in range(32)])
        loss = nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    # 2. Import: the forward's `* sqrt(d_model)` is invisible to from_torch, so it is passed as `embedding_scale`.
    imported = hf_tfm.from_torch(
        model.encoder,
        embed_tokens=model.embedding,
        positions=model.pos_encoder.pe,  # detected: the interleaved sinusoidal layout
        head=model.classifier,
        task="sequence-classification",
        pooling="first",
        embedding_scale=math.sqrt(d_model),
        id2label={0: "no-small-token", 1: "small-token"},
        label2id={"no-small-token": 0, "small-token": 1},
    )
    batch = collate(data[:16])
    with torch.no_grad():
        expected = model(batch["input_ids"])
        logits = imported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    max_difference = (logits - expected).abs().max().item()

    # 3. Fine-tune with Trainer and save a push-ready folder.
    training_args = TrainingArguments(
        output_dir=str(Path(args.output_dir) / "checkpoints"),
        max_steps=3 if args.tiny else 100,
        per_device_train_batch_size=16,
        learning_rate=5e-4,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = Trainer(model=imported, args=training_args, train_dataset=data, data_collator=collate)
    trainer.train()
    imported.save_pretrained(args.output_dir)  # weights, config.json, configuration.py + modeling.py (remote code)
    (Path(args.output_dir) / "README.md").write_text(
        "---\nlibrary_name: transformers\npipeline_tag: text-classification\ntags:\n- hf_tfm\n- custom_code\n---\n\n"
        "# TransformerClassifier (imported from PyTorch)\n\nA tutorial-style `nn.TransformerEncoder` classifier, "
        "imported with `hf_tfm.from_torch` and fine-tuned with `Trainer`. Load it with\n"
        "`AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True)`; inputs are token ids "
        f"(vocabulary {VOCAB}, pad {PAD}, first token {CLS}).\n",
        encoding="utf-8",
    )
    reloaded = AutoModelForSequenceClassification.from_pretrained(args.output_dir, trust_remote_code=True)
    report = {"max_difference": max_difference, "trainer_steps": trainer.state.global_step, "folder": args.output_dir}
    print(f"imported logits differ by {max_difference:.2e}; {type(reloaded).__name__} saved to {args.output_dir}")
    return report


if __name__ == "__main__":
    main()
