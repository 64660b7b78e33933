"""ExecuTorch's side of an encoder's ExecuTorch export (`hf_tfm.exporters.executorch`): its outputs on a padded batch,
with executorch's runtime and torch alone.

Written beside the program as `et_encode.py` (`ExecutorchEncoder(folder)(ids, mask)`), and run as verification's
program: `run(args)`.
"""

import json
from pathlib import Path

import torch
from executorch.runtime import Runtime


class ExecutorchEncoder:
    """An hf_tfm encoder's ExecuTorch export (model.pte) with executorch's runtime alone: `encoder(ids, mask)` on a
    padded batch (lists of equal length; token_type_ids too when the manifest lists them) returns the outputs by
    name."""

    def __init__(self, folder):
        folder = Path(folder)
        self.manifest = json.loads((folder / "executorch_export.json").read_text())
        program = Runtime.get().load_program(folder / self.manifest["program"])
        self.method = program.load_method(self.manifest["method"])

    def __call__(self, input_ids, attention_mask, token_type_ids=None):
        inputs = [torch.tensor(input_ids, dtype=torch.long), torch.tensor(attention_mask, dtype=torch.long)]
        if "token_type_ids" in self.manifest["inputs"]:
            types = token_type_ids if token_type_ids is not None else [[0] * len(row) for row in input_ids]
            inputs.append(torch.tensor(types, dtype=torch.long))
        outputs = self.method.execute(inputs)
        # copies: the outputs' memory is the program's, and the next call reuses it
        return {name: value.clone() for name, value in zip(self.manifest["outputs"], outputs, strict=False)}


def run(args: dict) -> dict:
    """The outputs on `prompts` as one right-padded batch: name -> one row per prompt."""
    prompts, pad = args["prompts"], args["pad"]
    width = max(map(len, prompts))
    ids = [p + [pad] * (width - len(p)) for p in prompts]
    mask = [[1] * len(p) + [0] * (width - len(p)) for p in prompts]
    return {name: list(value) for name, value in ExecutorchEncoder(args["path"])(ids, mask).items()}
