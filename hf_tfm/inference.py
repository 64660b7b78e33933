"""One call for the fastest decoding a saved model gets on this machine: quantized weights, a static KV cache and a
compiled decode step, behind the ordinary `generate()`.

    model = load_for_inference("my-model", quantize="int4")  # or None, "int8", "nf4"
    model.generate(**tokenizer("def ", return_tensors="pt"), max_new_tokens=64)

transformers' `generate()` compiles the model's forward for the decode steps when the cache is a static one and the
generation config holds a `CompileConfig`; on a CPU it does so only when that config's private `_compile_all_devices`
flag is set (it assumes compilation pays on accelerators only). Both are set here, in `model.generation_config`, so
every later `generate()` call takes that path; a call can still pass `disable_compile=True`. The first call compiles
(seconds to a minute on a CPU), each new cache length recompiles once before shapes turn dynamic, and tokens
unquantized are the eager ones (tests/test_generation.py).
"""

import os
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, CompileConfig, PreTrainedModel
from transformers.utils import logging

from .quantization import quantization_kwargs

logger = logging.get_logger(__name__)


def compile_generation(model: PreTrainedModel) -> PreTrainedModel:
    """Make `model.generate()` decode with a static cache and a compiled step, on any device; returns `model`.

    Weights of a quantizer that transformers marks as not compileable (bitsandbytes) keep eager decoding, with a
    warning: generate() would skip compiling them anyway."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        logger.warning(
            "%s weights cannot be compiled: generate() decodes them eagerly",
            type(quantizer).__name__.removesuffix("HfQuantizer"),
        )
        return model
    # fullgraph=False: a layer torch cannot trace (a quantizer's kernel, MoE's data-dependent routing) splits the
    # graph instead of failing; the dense models compile as one graph (tested).
    config = CompileConfig(fullgraph=False)
    config._compile_all_devices = True  # private: generate() compiles on CUDA/XPU/MPS only without it
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = config
    return model


def load_for_inference(
    path: str | os.PathLike,
    quantize: str | None = None,
    compile: bool = True,
    dtype: torch.dtype | str | None = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM or seq2seq LM folder (or Hub id) in eval mode for fast `generate()`.

    `quantize`: "int8", "int4" or "nf4" (`hf_tfm.quantization.BACKENDS`: transformers' torchao or bitsandbytes
    integration, which needs that package), or None for the checkpoint's weights. `compile`: decode with a static
    cache and a compiled step (`compile_generation`). `dtype`: of the weights (with `quantize`, of what stays
    unquantized; default: the setting's or the checkpoint's). Other keyword arguments go to `from_pretrained`.
    """
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    loading = quantization_kwargs(quantize, config) if quantize else {}
    if dtype is not None:
        loading["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    model = auto.from_pretrained(path, trust_remote_code=True, **loading, **kwargs).eval()
    return compile_generation(model) if compile else model


__all__ = ["compile_generation", "load_for_inference"]
