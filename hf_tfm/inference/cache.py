"""The static KV cache a fast model decodes with, made fit for speculative decoding: croppable, and grown when a call
needs more room than it was made with.

A compiled step needs a static cache (its tensors are the step's inputs). transformers' `generate()` makes one for
`prompt + max_new_tokens` tokens when the generation config says `cache_implementation="static"`, and speculative
decoding breaks on it three ways: the verify step writes the drafted tokens past that length (an `IndexError`), a
draft model's cache, which assisted generation passes from one of the draft's `generate()` calls to the next, is
refused beside `cache_implementation` (a `ValueError`), and before 5.25 a static layer cannot be cropped back to the
accepted tokens. `use_decode_cache(model)` makes the model's `generate()` build a `DecodeCache` instead (the same
`StaticCache`, its full-attention layers `DecodeLayer`s), with room for the drafted tokens, and take a `DecodeCache`
it is given, grown to the call's length.
"""

import types
from typing import Any

from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.generation.configuration_utils import GenerationMode

from ..modeling import CACHE_NAME


class DecodeLayer(StaticLayer):
    """A full-attention `StaticLayer` that can be cropped (as transformers 5.25's) and grown."""

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` tokens (a negative count, as transformers passes it): the slots stay,
        and the attention mask leaves them out until they are written again."""
        if tokens_to_remove > 0:  # transformers < 5.18 also passes the length to keep
            tokens_to_remove = int(self.cumulative_length) - tokens_to_remove
        self.cumulative_length.sub_(abs(tokens_to_remove))

    def grow(self, length: int) -> None:
        """Room for `length` tokens: the keys and values copied into longer tensors when they are shorter."""
        if length <= self.max_cache_len:
            return
        self.max_cache_len = length
        if self.is_initialized:
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:2], length, old.shape[3])  # (B, H_kv, L, D)
                new[:, :, : old.shape[2]] = old
                setattr(self, name, new)


class DecodeCache(StaticCache):
    """transformers' `StaticCache`, its full-attention layers `DecodeLayer`s (`adopt` converts one in place)."""

    @classmethod
    def adopt(cls, cache: StaticCache) -> StaticCache:
        """`cache` itself, its class and its full-attention layers' swapped (sliding-window layers stay as they are:
        their ring buffer neither crops nor grows)."""
        cache.__class__ = cls
        for layer in cache.layers:
            if type(layer) is StaticLayer:
                layer.__class__ = DecodeLayer
        return cache

    def reserve(self, length: int) -> None:
        """Room for `length` tokens in every growable layer (at least twice what it had: growing stays rare)."""
        for layer in self.layers:
            if isinstance(layer, DecodeLayer) and layer.max_cache_len < length:
                layer.grow(max(length, 2 * layer.max_cache_len))


def _drafted_tokens(generation_config: Any) -> int:
    """The most tokens a speculative round may draft: the verify step writes them, then the cache rolls back."""
    drafts = (generation_config.prompt_lookup_num_tokens, generation_config.num_assistant_tokens, 1)
    return 1 + max(int(n) for n in drafts if n)


def _prepare_static_cache(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    cache = type(self)._prepare_static_cache(self, *args, **kwargs)
    return DecodeCache.adopt(cache) if type(cache) is StaticCache else cache


def _prepare_cache_for_generation(
    self: PreTrainedModel,
    generation_config: Any,
    model_kwargs: dict,
    generation_mode: GenerationMode,
    batch_size: int,
    max_cache_length: int,
) -> Any:
    cache = model_kwargs.get(CACHE_NAME)
    if isinstance(cache, DecodeCache):
        # A draft model's own cache, passed from one of its generate() calls to the next: this call's config is a
        # copy, so naming no cache implementation here leaves the model's setting as it is
        generation_config.cache_implementation = None
        cache.reserve(max_cache_length + 1)
    elif generation_mode == GenerationMode.ASSISTED_GENERATION:
        made = type(self)._prepare_cache_for_generation(
            self,
            generation_config,
            model_kwargs,
            generation_mode,
            batch_size,
            max_cache_length + _drafted_tokens(generation_config),
        )
        # The cache is made: older transformers (5.16 to 5.20 at least) refuse assisted generation where the config
        # (this call's copy) still names a static cache, though the DecodeCache it made crops as a dynamic one does
        generation_config.cache_implementation = None
        return made
    return type(self)._prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    )


def use_decode_cache(model: PreTrainedModel) -> PreTrainedModel:
    """Make `model.generate()` decode with a `DecodeCache` where it would build a `StaticCache` (the two methods of
    `generate()` that build the cache, overridden on this instance); returns `model`."""
    model._prepare_static_cache = types.MethodType(_prepare_static_cache, model)
    model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
    return model


# The instance attributes `use_decode_cache` sets: a copy of the model made for another process leaves them out
INSTANCE_HOOKS = ("_prepare_static_cache", "_prepare_cache_for_generation")

__all__ = ["INSTANCE_HOOKS", "DecodeCache", "DecodeLayer", "use_decode_cache"]
