"""Greedy decoding through a decode step compiled ahead of time (AOTInductor): one C++ call per token.

    model = load_for_inference("my-model", quantize="q4")
    decoder = AotDecoder(model, max_length=128)  # compiles once: seconds to a minute
    decoder.generate(tokenizer("def ", return_tensors="pt").input_ids, max_new_tokens=64)

`generate()`'s compiled step pays, per token, dynamo's guards on every module it traced (about 2,500 checks on the
bench's base shape), the Python of Inductor's wrapper and `generate()`'s own loop (logits processors, stopping
criteria, input preparation): on a q4 step of 5 ms, about 2 ms beside the kernels. `AotDecoder` exports the same
step (the model, a static KV cache, one token) with `torch.export` and compiles it with AOTInductor into a shared
library that takes the token and its position and returns the logits, updating the cache in place; the Python
between two tokens is an argmax. The library reads the model's own weights and cache tensors (AOTInductor's
user-managed constants), so nothing is copied; the prompt runs through the eager model, which fills the same cache.

What it gives up for that: greedy decoding only (sampling, beams and logits processors stay with `generate()`), a
fixed batch of equal-length prompts (no padding mask) and a fixed `max_length`, each chosen at construction, and the
thread count of the process at construction (Inductor writes it into the library). The library holds pointers to the
model's tensors: after replacing them (new parameters, `.to()` another device or dtype), build a new decoder. A
mixture-of-experts step runs every expert, weighted by its routing weight (zero where not chosen), because routing's
data-dependent shapes do not export; it gives the routed tokens, at the cost of the unchosen experts' reads.
"""

import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from .exporters.executorch import StaticCacheLM, exportable


class AotDecoder:
    """Greedy decoding of a causal LM with a decode step compiled by AOTInductor (see the module's docstring).

    `model`: a decoder-only causal LM (hf_tfm's `TfmForCausalLM`, as `load_for_inference` returns it, quantized or
    not). `max_length`: the longest prompt plus new tokens it will decode (the static cache's length: attention reads
    all of it at each step, so keep it near what you need). `batch_size`: the number of prompts decoded together."""

    def __init__(self, model: PreTrainedModel, max_length: int, batch_size: int = 1) -> None:
        if getattr(model.config, "is_encoder_decoder", False) or not getattr(model.config, "is_causal", True):
            raise ValueError(f"AotDecoder decodes a decoder-only causal LM; got a {type(model).__name__}")
        limit = getattr(model.config, "max_position_embeddings", None)
        if max_length < 2 or (limit is not None and max_length > limit):
            raise ValueError(f"max_length={max_length} must be in [2, {limit}] (the model's max_position_embeddings)")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.model, self.max_length, self.batch_size = model.eval(), max_length, batch_size
        # eager attention: Inductor fuses its one-query products and softmax into one loop per layer, where SDPA stays
        # a library call per layer (about 50 us each, a fifth of a q4 step on the bench's base shape)
        with exportable(model, attention="eager"), torch.no_grad():
            self.step = StaticCacheLM(model, max_length, batch_size).eval()
            token = torch.zeros((batch_size, 1), dtype=torch.long, device=model.device)
            position = torch.zeros(1, dtype=torch.long, device=model.device)
            exported = torch.export.export(self.step, (token, position), strict=False)
        with tempfile.TemporaryDirectory() as tmp:
            package = torch._inductor.aoti_compile_and_package(
                exported,
                package_path=str(Path(tmp) / "step.pt2"),
                # realize_reads_threshold: as `compile_generation` sets it (RoPE's cos/sin computed once a step);
                # constants outside the library: it reads the weights and the cache where they already are
                inductor_configs={"realize_reads_threshold": 0, "aot_inductor.package_constants_in_so": False},
            )
            self.compiled = torch._inductor.aoti_load_package(package)
        # every name of a tied weight (lm_head's and embed_tokens'): the library asks for each
        tensors = dict(self.step.named_parameters(remove_duplicate=False))
        tensors.update(self.step.named_buffers(remove_duplicate=False))
        # user-managed: the library keeps pointers to these tensors, which `self.step` keeps alive
        self.compiled.load_constants(
            {name: tensors[name] for name in self.compiled.get_constant_fqns()},
            check_full_update=True,
            user_managed=True,
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None = None,
        streamer: Any = None,
    ) -> torch.Tensor:
        """The prompts `input_ids` (batch_size, T) followed by up to `max_new_tokens` greedy tokens, as
        `model.generate(input_ids, max_new_tokens=..., do_sample=False)` returns them: decoding stops when every
        sequence has made an end token (`eos_token_id`, by default the generation config's), and a finished sequence
        is filled with the pad token. `streamer`: as `generate()`'s (its `put` gets the prompt, then each step's
        tokens; then `end`)."""
        batch, length = input_ids.shape
        if batch != self.batch_size:
            raise ValueError(
                f"input_ids has {batch} prompts; this decoder was compiled for batch_size={self.batch_size}"
            )
        if max_new_tokens < 1 or length + max_new_tokens > self.max_length:
            raise ValueError(
                f"a prompt of {length} tokens plus max_new_tokens={max_new_tokens} does not fit max_length="
                f"{self.max_length} (or max_new_tokens < 1): build the decoder with a larger max_length"
            )
        config = self.model.generation_config
        eos = config.eos_token_id if eos_token_id is None else eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
        device = self.model.device
        ends = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
        input_ids = input_ids.to(device)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        # the prompt through the eager model, which fills the cache the compiled step reads
        logits = self.step(input_ids, torch.arange(length, device=device))[:, -1]
        position = torch.tensor([length], device=device)
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        tokens = []
        for step in range(max_new_tokens):
            token = logits.argmax(-1)  # (B,)
            if ends is not None:  # a finished sequence gets the pad token
                token = torch.where(unfinished, token, pad)
                unfinished &= ~torch.isin(token, ends)
            tokens.append(token)
            if streamer is not None:
                streamer.put(token.cpu())
            if step == max_new_tokens - 1 or (ends is not None and not unfinished.any()):
                break
            logits = self.compiled.loader.boxed_run([token[:, None], position])[0][:, -1]  # (B, vocab)
            position += 1
        if streamer is not None:
            streamer.end()
        return torch.cat([input_ids, torch.stack(tokens, 1)], 1)


__all__ = ["AotDecoder"]
