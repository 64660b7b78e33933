"""generate()'s decode steps through a library compiled ahead of time (AOTInductor): one C++ call per token.

    model = load_for_inference("my-model", quantize="q4")  # installs the step on a CPU causal LM
    model.generate(**tokenizer("def ", return_tensors="pt"), max_new_tokens=64, do_sample=True, top_p=0.9)

A decode step compiled by `torch.compile` pays, per token, dynamo's guards on every module it traced (about 2,500
checks on the bench's base shape) and the Python of Inductor's wrapper: on a q4 step of 3 ms, over 1 ms beside the
kernels. The step is exported instead (the model on the new tokens, reading and writing transformers' static KV cache)
with `torch.export` and compiled with AOTInductor into a shared library, the cache length dynamic. `install(model)`
routes every call of `model.forward` that `generate()` makes with a static cache to a library, so sampling, beams,
logits processors, stop strings, streamers and left-padded batches all keep `generate()`'s own code, and only the
model's arithmetic moves; any other call (a prompt, training, a dynamic cache) runs the model as before. Two kinds of
library: `"step"` (one token per sequence, one library per batch size) and `"verify"` (2 to `VERIFY_TOKENS` tokens of
one sequence: the step that checks a speculative draft, `hf_tfm.inference.cache`).

A library is compiled once per machine and model, in a process of its own (`hf_tfm/programs/compile_step.py`), and
kept in hf_tfm's step store (`hf_tfm.inference.step_store`): a later process loads it in a fraction of a second. The
first time, `generate()` does not wait: it decodes with the model's own forward (the same fast layers, uncompiled)
while the library compiles beside it, on one core of the process's threads, and switches to the library when it is
ready. `precompile(model)` compiles and waits instead (`hf-tfm compile`), for a server that must never compile on a
request; `HF_TFM_COMPILE_IN_BACKGROUND=0` makes every first call wait too.

A library reads the model's tensors where they are (nothing is copied) and holds the thread count it was compiled
for: after replacing them (new parameters, `.to()` another device or dtype), call `install` again. What it does not
take, and leaves to the model's own forward: sliding-window layers (their static cache is a ring buffer),
mixture-of-experts layers (routing's data-dependent shapes do not export), encoder-decoders.
"""

import copy
import functools
import inspect
import os
import sys
from collections import Counter
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from ..modeling import CACHE_NAME
from ..programs import ProgramRun, start_program
from . import kernels, step_store
from .attention import register_decode_attention, use_decode_attention
from .cache import INSTANCE_HOOKS, DecodeLayer

logger = logging.get_logger(__name__)

# What a step call may carry besides the inputs the library takes: generate()'s bookkeeping, which changes nothing in
# the logits of the new tokens (`logits_to_keep` is applied to the library's output).
IGNORED = {"use_cache", "cache_position", "logits_to_keep", "return_dict", "output_attentions", "output_hidden_states"}
VERIFY_TOKENS = 32  # the most tokens a verify library takes: a draft of up to 31 tokens and the bonus token
# Inductor's options: RoPE's cos/sin computed once a step; the library keeps no weights (it reads the model's), and
# folds what it computes from them alone when they are loaded, not when it is compiled (the compiling process has
# no weights: a library is one per layout, not per checkpoint); the wrapper around the kernels compiled at -O0 (it
# only calls them: -O1 took 10 of the 1.1B step's 23 s of g++)
OPTIONS = {
    "realize_reads_threshold": 0,
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.use_runtime_constant_folding": True,
    "aot_inductor.compile_wrapper_opt_level": "O0",
}
# Attributes a model gets on the instance when it is installed: a copy made for the compiling process leaves them out
INSTALLED = ("forward", "compiled_decode_step", "create_masks_for_generate", *INSTANCE_HOOKS)
SAMPLE_LENGTH, SAMPLE_TOKENS = 16, 4  # the shapes the step is traced with (both dimensions are dynamic)


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


class _ExportedCache:
    """The static cache as the exported step sees it: per layer, keys and values (B, H_kv, L, D) and the fill level
    `cumulative_length` (a 0-dim tensor), all inputs of the step. `update` writes the new tokens where transformers'
    `StaticLayer.update` writes them (from the fill level, which it then raises) and returns the whole cache."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self.layers = layers

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple:
        keys, values, length = self.layers[layer_idx]
        positions = length + torch.arange(key.shape[2], device=length.device)  # (T,)
        keys.index_copy_(2, positions, key)
        values.index_copy_(2, positions, value)
        length.add_(key.shape[2])
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:  # the fill level before these tokens
        return self.layers[layer_idx][2]

    def get_query_offset(self, layer_idx: int) -> torch.Tensor:  # ALiBi: the first new token's slot, the fill level
        return self.layers[layer_idx][2]

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx][0].shape[2], 0


class _Step(nn.Module):
    """forward(input_ids (B, T), position_ids (B, T), attention_mask (B, T, L) bool, then per layer keys, values and
    fill level) -> logits (B, T, V): the model on T new tokens per sequence, the cache updated in place."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.layer_types = sorted(set(model.config.layer_types))

    def forward(self, input_ids, position_ids, attention_mask, *cache) -> torch.Tensor:
        layers = [tuple(cache[i : i + 3]) for i in range(0, len(cache), 3)]
        # (B, 1, T, L): True where a new token may attend (the decode attention's and sdpa's form), or eager
        # attention's additive form
        mask = attention_mask[:, None]
        if self.model.config._attn_implementation == "eager":
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self.model.dtype).min
            )
        options = {CACHE_NAME: _ExportedCache(layers), "use_cache": True}
        # The class's forward, not the instance's: `install` puts the step in front of the instance's
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


def _step_mask(mask: torch.Tensor | dict | None, fill: torch.Tensor, length: int, shape: tuple) -> torch.Tensor | None:
    """(B, T, L) bool: the cache slots each new token may see, from the call's attention mask in whichever form it
    comes (2-D over the filled slots and the new tokens, as a caller passes it; 4-D over the cache, bool or additive,
    or None for "no masking needed", as generate() builds it per layer type); None for a form the step does not take.
    """
    batch, tokens = shape
    slots = torch.arange(length, device=fill.device)
    # each new token sees the filled slots and the new tokens up to itself: (T, L)
    causal = (slots < fill) | ((slots >= fill) & (slots <= fill + torch.arange(tokens, device=fill.device)[:, None]))
    if isinstance(mask, dict):
        mask = mask.get("full_attention")
    if mask is None:
        return causal.expand(batch, tokens, length)
    if not isinstance(mask, torch.Tensor):
        return None
    if mask.ndim == 4 and mask.shape[-1] == length and mask.shape[2] == tokens:
        rows = mask[:, 0]  # (B, T, L)
        return rows if rows.dtype == torch.bool else rows == 0  # an additive mask is 0 where a token may attend
    if mask.ndim == 2 and mask.shape[1] <= length:
        seen = torch.nn.functional.pad(mask.bool(), (0, length - mask.shape[1]))  # the slots to come: off
        return seen[:, None, :] & causal  # (B, T, L)
    return None


def _meta_copy(step: _Step) -> _Step:
    """`step` with its model deep-copied onto the meta device (no tensor data): what the compiling process needs."""
    model = step.model
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    installed = {name: model.__dict__.pop(name) for name in INSTALLED if name in model.__dict__}
    try:
        return copy.deepcopy(step, memo)
    finally:
        model.__dict__.update(installed)


# The compiles running beside this process, whichever model started them, and the thread count it had before the
# first: while any runs, this process keeps one core fewer (two busy processes on every core would each spin-wait for
# the other), and a model installed meanwhile still keys its libraries by the full count.
_COMPILES = {"running": 0, "threads": 0}


def _process_threads() -> int:
    """This process's thread count, as it is when no compile runs beside it."""
    return _COMPILES["threads"] if _COMPILES["running"] else torch.get_num_threads()


def _compile_started() -> None:
    if _COMPILES["running"] == 0:
        _COMPILES["threads"] = torch.get_num_threads()
        torch.set_num_threads(max(1, _COMPILES["threads"] - 1))
    _COMPILES["running"] += 1


def _compile_ended() -> None:
    _COMPILES["running"] -= 1
    if _COMPILES["running"] == 0:
        torch.set_num_threads(_COMPILES["threads"])


class CompiledDecodeStep:
    """The decode steps of `model` through compiled libraries (see the module's docstring).

    `__call__(**forward_kwargs)` returns the model's output for a call `generate()` makes with a transformers
    `StaticCache` (one token per sequence, or a verify step's few tokens of one sequence) when its library is ready,
    or None for any other call (the caller then runs the model itself)."""

    def __init__(self, model: PreTrainedModel, background: bool | None = None) -> None:
        blockers = step_blockers(model)
        if blockers:
            raise ValueError(f"the compiled decode step cannot take this model: {'; '.join(blockers)}")
        self.model = model
        self.enabled = True  # False: every call runs the model's own forward
        if background is None:
            background = os.environ.get("HF_TFM_COMPILE_IN_BACKGROUND", "1") != "0"
        self.background = background  # False: a first call waits for its library instead of decoding without it
        self.threads = _process_threads()  # what the libraries are compiled for
        self.libraries: dict[tuple[str, int], Any] = {}  # (kind, batch size) -> library
        self.compiling: dict[tuple[str, int], ProgramRun] = {}
        self.failed: set[tuple[str, int]] = set()
        self.compiled: dict[tuple[str, int], float] = {}  # seconds each compile this process ran took
        self.keys: dict[tuple[str, int], str] = {}  # the store's key of each library
        self.calls = 0  # the calls the libraries have run
        self.calls_by_kind: Counter[str] = Counter()  # ... of each kind

    def __call__(self, **kwargs: Any) -> CausalLMOutputWithPast | None:
        found = self._inputs(kwargs)
        if found is None:
            return None
        which, inputs = found
        library = self.libraries.get(which) or self._library(which, wait=not self.background)
        if library is None:
            return None
        logits = library.loader.boxed_run(inputs)[0]
        self.calls += 1
        self.calls_by_kind[which[0]] += 1
        keep = kwargs.get("logits_to_keep")
        if isinstance(keep, int) and 0 < keep < logits.shape[1]:
            logits = logits[:, -keep:]
        return CausalLMOutputWithPast(logits=logits, **{CACHE_NAME: self._cache(kwargs)})

    @staticmethod
    def _cache(kwargs: dict) -> Any:
        return kwargs.get(CACHE_NAME, kwargs.get("past_key_values"))

    def _inputs(self, kwargs: dict) -> tuple[tuple[str, int], list[torch.Tensor]] | None:
        """The library (kind, batch size) and its inputs for a call with a filled static cache; None for any other."""
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
            or self.model.training
            or torch.is_grad_enabled()
            or not isinstance(cache, StaticCache)
            or not all(type(layer) in (StaticLayer, DecodeLayer) and layer.is_initialized for layer in cache.layers)
        ):
            return None
        batch, tokens = input_ids.shape
        kind = "step" if tokens == 1 else "verify"
        if kind == "verify" and (batch != 1 or tokens > VERIFY_TOKENS):
            return None
        first = cache.layers[0]
        fill, length = first.cumulative_length, first.keys.shape[2]
        if int(fill) + tokens > length or length > self._max_length():  # the model's forward says why
            return None
        mask = _step_mask(kwargs.get("attention_mask"), fill, length, (batch, tokens))
        if mask is None:
            return None
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # count real tokens only, as the model does: left padding does not shift positions
            new = fill + torch.arange(tokens, device=fill.device)
            position_ids = (mask[:, -1].long().cumsum(-1) - 1).gather(1, new.expand(batch, tokens))
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]
        return (kind, batch), [input_ids, position_ids, mask, *tensors]

    def _max_length(self) -> int:
        return max(self.model.config.max_position_embeddings, 3)

    def _library(self, which: tuple[str, int], wait: bool) -> Any | None:
        """The library `which` (kind, batch size): from the store, or compiled (started here, then awaited when
        `wait`); None while it compiles in the background, or when compiling it failed (the model's forward runs)."""
        if which in self.failed:
            return None
        key = self._key(which)  # computed once
        if which not in self.compiling:
            library = step_store.load(key, self._constants())
            if library is not None:
                self.libraries[which] = library
                return library
            self._start(which, key, wait)
        run = self.compiling[which]
        if not (wait or run.done()):
            return None
        del self.compiling[which]
        _compile_ended()
        try:
            self.compiled[which] = run.result()["seconds"]
        except RuntimeError as error:
            logger.warning(
                "hf_tfm: compiling the decode step (%s, batch %d) failed, decoding without it: %s", *which, error
            )
            self.failed.add(which)
            return None
        library = step_store.load(key, self._constants())
        if library is None:
            self.failed.add(which)
            return None
        logger.warning(
            "hf_tfm: the decode step (%s, batch %d) compiled in %.1f s and is stored in %s: later processes load it "
            "at once",
            *which,
            self.compiled[which],
            step_store.entry_folder(key),
        )
        self.libraries[which] = library
        return library

    def _key(self, which: tuple[str, int]) -> str:
        if which not in self.keys:
            self.keys[which] = step_store.key_of(step_store.fingerprint(self.model, *which, self.threads, OPTIONS))
        return self.keys[which]

    def _constants(self) -> dict[str, torch.Tensor]:
        # every name of a tied weight (lm_head's and embed_tokens'): the library asks for each
        step = _Step(self.model)
        return {
            **dict(step.named_parameters(remove_duplicate=False)),
            **dict(step.named_buffers(remove_duplicate=False)),
        }

    def _start(self, which: tuple[str, int], key: str, wait: bool) -> None:
        """Start compiling the library `which` in a process of its own, this process keeping one core fewer."""
        kind, batch = which
        staging = step_store.staging_folder(key)
        staging.mkdir()
        torch.save(self._job(kind, batch), staging / "job.pt")
        args = {
            "path": str(staging / "job.pt"),
            "staging": str(staging),
            "entry": str(step_store.entry_folder(key)),
            "threads": self.threads,
            "sys_path": sys.path,
            "description": {"kind": kind, "batch": batch, "model": type(self.model).__name__},
        }
        self.compiling[which] = start_program("compile_step", args, "the decode step's compiler")
        _compile_started()
        logger.warning(
            "hf_tfm: compiling the decode step (%s, batch %d) for this machine, once (the next processes load it)%s",
            kind,
            batch,
            "" if wait else "; generate() decodes without it meanwhile",
        )

    def _job(self, kind: str, batch: int) -> dict[str, Any]:
        """What the compiling process exports: the step on the meta device, its sample inputs and dynamic shapes."""
        config = self.model.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        tokens = 1 if kind == "step" else SAMPLE_TOKENS
        new = {1: "tokens"} if kind == "verify" else {}
        layer = [((batch, heads, SAMPLE_LENGTH, head_dim), self.model.dtype)] * 2 + [((), torch.int64)]
        dims = {"cache_length": (2, self._max_length())} | ({"tokens": (2, VERIFY_TOKENS)} if new else {})
        return {
            "module": _meta_copy(_Step(self.model).eval()),
            "setup": [register_decode_attention, kernels.built_operators],  # what the step calls
            "inputs": [((batch, tokens), torch.int64)] * 2 + [((batch, tokens, SAMPLE_LENGTH), torch.bool)]
            + layer * config.num_hidden_layers,
            "dims": dims,
            "dynamic": (new, new, {**new, 2: "cache_length"}, ({2: "cache_length"}, {2: "cache_length"}, None)
                        * config.num_hidden_layers),
            "options": OPTIONS,
        }  # fmt: skip

    def prepare(self, batch_sizes: tuple[int, ...] = (1,), verify: bool = True) -> dict[str, float]:
        """Compile (or load from the store) the step library of each batch size, and the verify library when
        `verify`, waiting for them; returns the seconds each compile took (none for a library the store had)."""
        wanted = [("step", batch) for batch in batch_sizes] + ([("verify", 1)] if verify else [])
        for which in wanted:
            if which not in self.libraries and which not in self.compiling and which not in self.failed:
                key = self._key(which)
                library = step_store.load(key, self._constants())
                if library is None:
                    self._start(which, key, wait=True)
                else:
                    self.libraries[which] = library
        for which in wanted:
            self._library(which, wait=True)
        missing = [which for which in wanted if which not in self.libraries]
        if missing:
            raise RuntimeError(f"compiling the decode step failed for {missing} (the warnings above say why)")
        return {f"{kind}, batch {batch}": seconds for (kind, batch), seconds in self.compiled.items()}

    def cancel(self) -> None:
        """Stop the compiles still running (their libraries are not stored) and give the threads back."""
        for run in self.compiling.values():
            run.cancel()
            _compile_ended()
        self.compiling.clear()


def install(model: PreTrainedModel, background: bool | None = None) -> PreTrainedModel:
    """Route `model`'s decode steps with a static cache to a `CompiledDecodeStep`; returns `model`.

    The instance's `forward` becomes a function that asks the step first and calls the class's `forward` for every
    call the step does not take. `background`: whether a first call decodes without its library while it compiles
    (default: yes, unless `HF_TFM_COMPILE_IN_BACKGROUND=0`). Raises `ValueError` naming why for a model the step
    cannot take (`step_blockers`)."""
    previous = getattr(model, "compiled_decode_step", None)
    if previous is not None:
        previous.cancel()
    step = CompiledDecodeStep(use_decode_attention(model), background=background)
    forward = type(model).forward

    @functools.wraps(forward)
    def stepping_forward(*args: Any, **kwargs: Any) -> Any:
        output = None if args else step(**kwargs)
        return output if output is not None else forward(model, *args, **kwargs)

    # The bound method's signature, given once: generate() reads it on every call (`inspect` would follow
    # `__wrapped__` to the class's function each time, and show its `self`)
    stepping_forward.__signature__ = inspect.signature(forward.__get__(model))
    model.forward = stepping_forward
    model.compiled_decode_step = step
    model.create_masks_for_generate = _two_dimensional_mask
    return model


def _two_dimensional_mask(*, attention_mask: torch.Tensor | None = None, **_: Any) -> torch.Tensor | None:
    """generate()'s mask for a model with a static cache, as the installed model takes it: the 2-D one it starts
    from. transformers' default builds a 4-D mask over the whole cache on every call (0.09 of the base shape's 2.2 ms
    `q4` step here), which the step would only read back into rows; the model's own forward builds its masks from
    the 2-D one, as it does for any cache."""
    return attention_mask


def precompile(model: PreTrainedModel, batch_sizes: tuple[int, ...] = (1,), verify: bool = True) -> dict[str, float]:
    """Compile the decode step libraries of an installed `model` now (or load them from the store) and wait: one
    per batch size in `batch_sizes`, and the speculative verify step when `verify`. Returns the seconds each compile
    took. For a server, before its first request; `hf-tfm compile FOLDER` does it from a shell."""
    step = getattr(model, "compiled_decode_step", None)
    if step is None:
        raise ValueError("precompile takes a model from load_for_inference (or hf_tfm.inference.install(model))")
    return step.prepare(tuple(batch_sizes), verify)


__all__ = ["VERIFY_TOKENS", "CompiledDecodeStep", "install", "precompile", "step_blockers"]
