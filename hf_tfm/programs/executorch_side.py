"""ExecuTorch's side of a causal LM's ExecuTorch export (`hf_tfm.exporters.executorch`): greedy decoding with
executorch's runtime alone (it takes and returns torch tensors, so torch is needed; transformers and hf_tfm are not).

Written beside the program as `et_generate.py` (`ExecutorchGenerator(folder).generate(prompt, max_new_tokens)`), and
run as verification's program: `run(args)`.
"""

import json
from pathlib import Path

import torch
from executorch.runtime import Runtime


class ExecutorchGenerator:
    """Greedy decoding over an hf_tfm ExecuTorch export (model.pte), batch 1, with executorch's runtime alone.

    The program's one method takes ids (1, T) and their positions (T,) and returns logits (1, T, V); its KV cache
    lives inside it, filled up to the first position given, so each prompt starts again at position 0."""

    def __init__(self, folder):
        folder = Path(folder)
        self.manifest = json.loads((folder / "executorch_export.json").read_text())
        program = Runtime.get().load_program(folder / self.manifest["program"])
        self.method = program.load_method(self.manifest["method"])
        self.max_cache_len = self.manifest["max_cache_len"]

    def forward(self, ids, start):
        """Logits (T, V) of `ids` (a list) at positions start, start + 1, ..., the tokens before `start` cached."""
        if start + len(ids) > self.max_cache_len:
            raise ValueError(f"{start + len(ids)} positions: the export holds max_cache_len={self.max_cache_len}.")
        inputs = [torch.tensor([ids], dtype=torch.long), torch.arange(start, start + len(ids), dtype=torch.long)]
        # a copy: the output's memory is the program's, and the next call reuses it
        return self.method.execute(inputs)[0][0].clone()

    def generate(self, prompt, max_new_tokens, suppress=(), return_logits=False):
        """Greedy continuation of `prompt` (ids), `max_new_tokens` long (`suppress`: ids never chosen, e.g. EOS);
        with `return_logits`, also the logits (V,) each token was chosen from."""
        logits = self.forward(list(prompt), 0)[-1]
        tokens, steps = [], []
        for i in range(max_new_tokens):
            steps.append(logits)
            step = logits.clone()
            step[list(suppress)] = -float("inf")
            tokens.append(int(step.argmax()))
            if i + 1 < max_new_tokens:
                logits = self.forward(tokens[-1:], len(prompt) + i)[-1]
        return (tokens, steps) if return_logits else tokens


def run(args: dict) -> dict:
    """Each prompt's greedy tokens and the logits each was chosen from, and the logits of each reference sequence."""
    generator = ExecutorchGenerator(args["path"])
    tokens, steps = [], []
    for prompt in args["prompts"]:
        new, logits = generator.generate(prompt, args["max_new_tokens"], args["suppress"], return_logits=True)
        tokens.append(new)
        steps.append(torch.stack(logits))
    logits = [generator.forward(reference, 0) for reference in args["references"]]
    return {"tokens": tokens, "steps": steps, "logits": logits}
