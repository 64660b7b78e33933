"""generate()'s decode steps through a library compiled ahead of time (AOTInductor): one C++ call per token.

    model = load_for_inference("my-model", quantize="q4")  # installs the step on a CPU causal LM
    model.generate(**tokenizer("def ", return_tensors="pt"), max_new_tokens=64, do_sample=True, top_p=0.9)

A decode step compiled by `torch.compile` pays, per token, dynamo's guards on every module it traced (about 2,500
checks on the bench's base shape) and the Python of Inductor's wrapper: on a q4 step of 3 ms, over 1 ms beside the
kernels. `CompiledDecodeStep` exports the step instead (the model on one token per sequence, reading and writing
transformers' static KV cache) with `torch.export` and compiles it with AOTInductor into a shared library, one per
batch size, the cache length dynamic. `install(model)` routes every call of `model.forward` that `generate()` makes
for one new token with a static cache to that library, so sampling, beams, logits processors, stop strings,
streamers and left-padded batches all keep `generate()`'s own code, and only the model's arithmetic moves; any other
call (a prompt, training, a dynamic cache) runs the model as before. A library is compiled at the first step of its
batch size (seconds to a minute on a CPU), reads the model's weights where they are (AOTInductor's user-managed
constants: nothing is copied) and the cache tensors as inputs, and writes the new token's keys and values into them
as transformers' `StaticLayer.update` does.

What it does not take, and leaves to the model's own forward: sliding-window layers (their static cache is a ring
buffer), mixture-of-experts layers (routing's data-dependent shapes do not export), encoder-decoders. The thread
count of the process at compile time is written into the library, and the library holds pointers to the model's
tensors: after replacing them (new parameters, `.to()` another device or dtype), call `install` again.
"""

import functools
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..modeling import CACHE_NAME
from .attention import use_decode_attention

# What a step call may carry besides the inputs the library takes: generate()'s bookkeeping, which changes nothing in
# the logits of one token (`logits_to_keep` keeps the last one, the only one there is).
IGNORED = {"use_cache", "cache_position", "logits_to_keep", "return_dict", "output_attentions", "output_hidden_states"}


def _slots(mask: torch.Tensor | dict | None, layer: StaticLayer, batch: int) -> torch.Tensor | None:
    """(B, L) bool: the cache slots the new token may see, from the attention mask of the call in whichever form it
    comes (2-D over the filled slots, as a caller passes it; 4-D over the cache, bool or additive, or None for "no
    masking needed", as generate() builds it per layer type); None for a form the step does not take."""
    length, filled = layer.keys.shape[2], layer.cumulative_length
    if isinstance(mask, dict):
        mask = mask.get("full_attention")
        if mask is None:  # every filled slot, and the new token's own
            return (torch.arange(length, device=filled.device) <= filled).expand(batch, length)
    if mask is None:
        return (torch.arange(length, device=filled.device) <= filled).expand(batch, length)
    if not isinstance(mask, torch.Tensor):
        return None
    if mask.ndim == 4 and mask.shape[-1] == length and mask.shape[2] == 1:
        row = mask[:, 0, -1, :]  # (B, L)
        return row if row.dtype == torch.bool else row == 0  # an additive mask is 0 where the token may attend
    if mask.ndim == 2 and mask.shape[1] <= length:
        return torch.nn.functional.pad(mask.bool(), (0, length - mask.shape[1]))  # the slots to come: off
    return None


class _StepCache:
    """The static cache as the exported step sees it: per layer, keys and values (B, H_kv, L, D) and the fill level
    `cumulative_length` (a 0-dim tensor), all inputs of the step. `update` writes one token where transformers'
    `StaticLayer.update` writes it (at the fill level, which it then raises) and returns the whole cache."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self.layers = layers

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple:
        keys, values, length = self.layers[layer_idx]
        position = length.view(1)
        keys.index_copy_(2, position, key)
        values.index_copy_(2, position, value)
        length.add_(1)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:  # the fill level before this token
        return self.layers[layer_idx][2]

    def get_query_offset(self, layer_idx: int) -> torch.Tensor:  # ALiBi: the new token's slot, the fill level
        return self.layers[layer_idx][2]

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx][0].shape[2], 0


class _Step(torch.nn.Module):
    """forward(input_ids (B, 1), position_ids (B, 1), attention_mask (B, L) bool, then per layer keys, values and
    fill level) -> logits (B, 1, V): the model on one new token, the cache updated in place."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.layer_types = sorted(set(model.config.layer_types))

    def forward(self, input_ids, position_ids, attention_mask, *cache) -> torch.Tensor:
        layers = [tuple(cache[i : i + 3]) for i in range(0, len(cache), 3)]
        # (B, 1, 1, L): the step's one query may see every filled, unpadded slot; True where it may (the decode
        # attention's and sdpa's mask), or eager attention's additive form
        mask = attention_mask[:, None, None, :]
        if self.model.config._attn_implementation == "eager":
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self.model.dtype).min
            )
        options = {CACHE_NAME: _StepCache(layers), "use_cache": True}
        # The class's forward, not the instance's: `install` puts this step in front of the instance's
        return (
            type(self.model)
            .forward(
                self.model,
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=dict.fromkeys(self.layer_types, mask),
                **options,
            )
            .logits
        )


def step_blockers(model: PreTrainedModel) -> list[str]:
    """Why `model`'s decode steps cannot take the compiled step (empty when they can)."""
    config = model.config
    blockers = []
    if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_causal", False):
        blockers.append("not a decoder-only causal LM")
    if getattr(config, "num_experts", None) is not None:
        blockers.append("mixture-of-experts layers (routing's data-dependent shapes do not export)")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        blockers.append("sliding-window layers (their static cache is a ring buffer)")
    if model.device.type != "cpu":
        blockers.append(f"on {model.device.type}: AOTInductor's CPU step (torch.compile's CUDA graphs serve GPUs)")
    return blockers


class CompiledDecodeStep:
    """The one-token decode step of `model`, compiled ahead of time at its first call (see the module's docstring).

    `__call__(**forward_kwargs)` returns the model's output for a call `generate()` makes to decode one token with a
    transformers `StaticCache`, or None for any other call (the caller then runs the model itself)."""

    def __init__(self, model: PreTrainedModel) -> None:
        blockers = step_blockers(model)
        if blockers:
            raise ValueError(f"the compiled decode step cannot take this model: {'; '.join(blockers)}")
        self.model = model
        self.enabled = True  # False: every call runs the model's own forward
        # one library per batch size (a layer's product for one token and for a few is not the same code: a dynamic
        # batch would take one of them for all), each with a dynamic cache length
        self.libraries: dict[int, Any] = {}
        self.calls = 0  # the steps the library has run

    def __call__(self, **kwargs: Any) -> CausalLMOutputWithPast | None:
        inputs = self._inputs(kwargs)
        if inputs is None:
            return None
        batch = inputs[0].shape[0]
        if batch not in self.libraries:
            self.libraries[batch] = self._compile(inputs)
        logits = self.libraries[batch].loader.boxed_run(inputs)[0]
        self.calls += 1
        return CausalLMOutputWithPast(logits=logits, **{CACHE_NAME: self._cache(kwargs)})

    @staticmethod
    def _cache(kwargs: dict) -> Any:
        return kwargs.get(CACHE_NAME, kwargs.get("past_key_values"))

    def _inputs(self, kwargs: dict) -> list[torch.Tensor] | None:
        """The library's inputs for a one-token step with a filled static cache; None for any other call."""
        input_ids, cache = kwargs.get("input_ids"), self._cache(kwargs)
        known = {"input_ids", "position_ids", "attention_mask", CACHE_NAME, "past_key_values"}
        if (
            not self.enabled
            or set(kwargs) - IGNORED - known
            or kwargs.get("output_attentions")
            or kwargs.get("output_hidden_states")
            or kwargs.get("return_dict") is False
            or input_ids is None
            or input_ids.ndim != 2
            or input_ids.shape[1] != 1
            or self.model.training
            or torch.is_grad_enabled()
            or not isinstance(cache, StaticCache)
            or not all(type(layer) is StaticLayer and layer.is_initialized for layer in cache.layers)
        ):
            return None
        layers = cache.layers
        mask = _slots(kwargs.get("attention_mask"), layers[0], input_ids.shape[0])
        if mask is None:
            return None
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # count real tokens only, as the model does: left padding does not shift positions
            position_ids = (mask.long().cumsum(-1) - 1).gather(1, layers[0].cumulative_length.view(1, 1))
        tensors = [t for layer in layers for t in (layer.keys, layer.values, layer.cumulative_length)]
        return [input_ids, position_ids, mask, *tensors]

    def _compile(self, inputs: list[torch.Tensor]) -> Any:
        """Export the step on these inputs (the cache length dynamic) and compile it with AOTInductor."""
        model = self.model
        length = torch.export.Dim("cache_length", min=2, max=max(model.config.max_position_embeddings, 3))
        per_layer = [{2: length}, {2: length}, None]
        shapes = (None, None, {1: length}, tuple(per_layer * ((len(inputs) - 3) // 3)))
        with torch.no_grad():
            step = _Step(model).eval()
            # the cache copied: exporting runs the step, which would write a token into the real cache
            sample = [t.clone() for t in inputs]
            exported = torch.export.export(step, tuple(sample), dynamic_shapes=shapes, strict=False)
        with tempfile.TemporaryDirectory() as tmp:
            package = torch._inductor.aoti_compile_and_package(
                exported,
                package_path=str(Path(tmp) / "step.pt2"),
                # realize_reads_threshold: as `compile_generation` sets it (RoPE's cos/sin computed once a step);
                # constants outside the library: it reads the weights where they already are
                inductor_configs={"realize_reads_threshold": 0, "aot_inductor.package_constants_in_so": False},
            )
            library = torch._inductor.aoti_load_package(package)
        # every name of a tied weight (lm_head's and embed_tokens'): the library asks for each
        tensors = dict(step.named_parameters(remove_duplicate=False))
        tensors.update(step.named_buffers(remove_duplicate=False))
        # user-managed: the library keeps pointers to the model's own tensors
        library.load_constants(
            {name: tensors[name] for name in library.get_constant_fqns()}, check_full_update=True, user_managed=True
        )
        return library


def install(model: PreTrainedModel) -> PreTrainedModel:
    """Route `model`'s one-token decode steps with a static cache to a `CompiledDecodeStep`; returns `model`.

    The instance's `forward` becomes a function that asks the step first and calls the class's `forward` for every
    call the step does not take. Raises `ValueError` naming why for a model the step cannot take (`step_blockers`)."""
    step = CompiledDecodeStep(use_decode_attention(model))
    forward = type(model).forward

    @functools.wraps(forward)
    def stepping_forward(*args: Any, **kwargs: Any) -> Any:
        output = None if args else step(**kwargs)
        return output if output is not None else forward(model, *args, **kwargs)

    model.forward = stepping_forward
    model.compiled_decode_step = step
    return model


__all__ = ["CompiledDecodeStep", "install", "step_blockers"]
