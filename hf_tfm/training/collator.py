"""`PadCollator`: a batch from examples of any length, for `Trainer` or a custom loop, without a tokenizer (a model
built from a config, or ids from elsewhere, have none to pad with).

Padding-free packing needs nothing from here: use `transformers.DataCollatorWithFlattening`, whose `position_ids`
restart at 0 in every packed sequence; hf_tfm keeps each packed sequence to itself (decoder and encoder).
"""

from collections.abc import Sequence

import torch


class PadCollator:
    """Pad a list of `{"input_ids": [...], "labels": ...}` examples into a batch, with no tokenizer.

    - `input_ids` are padded with `pad_token_id` (right padding by default) and an `attention_mask` is added.
    - List `labels` (causal LM, masked LM, token classification, seq2seq targets) are padded to their own longest
      row with `label_pad_token_id` (-100, which the losses ignore); scalar labels (sequence classification) are
      stacked. A seq2seq model builds its decoder inputs from them.
    - Without `labels`, a causal LM gets `labels = input_ids` with padding ignored (`labels_from_inputs=True`).
    - Any other list-valued key of the same length as `input_ids` (`token_type_ids`) is padded with 0.
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        label_pad_token_id: int = -100,
        padding_side: str = "right",
        labels_from_inputs: bool = True,
    ) -> None:
        if padding_side not in ("left", "right"):
            raise ValueError(f"`padding_side` must be 'left' or 'right', got {padding_side!r}.")
        self.pad_token_id = pad_token_id
        self.label_pad_token_id = label_pad_token_id
        self.padding_side = padding_side
        self.labels_from_inputs = labels_from_inputs

    def _pad(self, rows: Sequence[Sequence[int]], length: int, value: int) -> torch.Tensor:
        out = torch.full((len(rows), length), value, dtype=torch.long)
        for i, row in enumerate(rows):
            row = torch.as_tensor(row, dtype=torch.long)
            if self.padding_side == "right":
                out[i, : len(row)] = row
            else:
                out[i, length - len(row) :] = row
        return out

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        ids = [list(e["input_ids"]) for e in examples]
        length = max(len(row) for row in ids)
        batch = {
            "input_ids": self._pad(ids, length, self.pad_token_id),
            "attention_mask": self._pad([[1] * len(row) for row in ids], length, 0),
        }
        for key in examples[0]:
            if key in ("input_ids", "attention_mask", "labels"):
                continue
            batch[key] = self._pad([list(e[key]) for e in examples], length, 0)
        if "labels" in examples[0]:
            labels = [e["labels"] for e in examples]
            if isinstance(labels[0], (int, float)) or torch.as_tensor(labels[0]).ndim == 0:
                batch["labels"] = torch.as_tensor(labels)
            else:
                rows = [list(row) for row in labels]
                batch["labels"] = self._pad(rows, max(len(row) for row in rows), self.label_pad_token_id)
        elif self.labels_from_inputs:
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, self.label_pad_token_id)
        return batch


__all__ = ["PadCollator"]
