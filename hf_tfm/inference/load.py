"""One call for the fastest decoding a saved model gets on this machine: quantized weights, a static KV cache and a
compiled decode step, behind the ordinary `generate()`.

    model = load_for_inference("my-model", quantize="q4")  # or None, "q8", "int8", "int4", "nf4"
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

from . import kernels
from .aot import install, step_blockers
from .attention import use_decode_attention
from .cache import use_decode_cache
from .layers import StreamingLinear, plain_linears
from .quantize import quantize_setting, stream_compressed

logger = logging.get_logger(__name__)


def compile_generation(model: PreTrainedModel) -> PreTrainedModel:
    """Make `model.generate()` decode with a static cache and a compiled step, on any device; returns `model`.

    A decoder-only causal LM on a CPU gets the step compiled ahead of time (`hf_tfm.inference.aot.install`: one C++
    call per token); a model it cannot take (`step_blockers`: experts, sliding windows, an encoder-decoder, a GPU)
    gets transformers' `torch.compile` of the forward, through the generation config. Every plain `nn.Linear` becomes
    a `StreamingLinear` (same parameters; a faster product for a few tokens), and a CPU model on sdpa takes
    `decode_attention` (sdpa, but the plain formula for a step). Weights of a quantizer that transformers marks as
    not compileable (bitsandbytes) keep eager decoding, with a warning: generate() would skip compiling them anyway."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        logger.warning(
            "%s weights cannot be compiled: generate() decodes them eagerly",
            type(quantizer).__name__.removesuffix("HfQuantizer"),
        )
        return model
    for _, _, linear in plain_linears(model):
        StreamingLinear.from_linear(linear)
    use_decode_attention(model)
    model.generation_config.cache_implementation = "static"
    use_decode_cache(model)  # speculative decoding: a cache that crops, grows and passes between a draft's calls
    if quantizer is None and not step_blockers(model):  # a quantizer's tensor subclasses do not export
        return install(model)
    # fullgraph=False: a layer torch cannot trace (a quantizer's kernel, MoE's data-dependent routing) splits the
    # graph instead of failing; the dense models compile as one graph (tested).
    config = CompileConfig(fullgraph=False)
    if model.device.type == "cpu":
        # Inductor inlines a value read by several kernels unless it reads many inputs, so RoPE's cos and sin were
        # recomputed inside the attention's loop over every cached position; storing such values computes them once
        # (batch 8 on the bench's base shape: 41 -> 37 ms a step, batch 1 unchanged). Options replace the mode, whose
        # "reduce-overhead" means CUDA graphs: nothing on a CPU.
        config.mode, config.options = None, {"realize_reads_threshold": 0}
    config._compile_all_devices = True  # private: generate() compiles on CUDA/XPU/MPS only without it
    model.generation_config.compile_config = config
    return model


def load_for_inference(
    path: str | os.PathLike,
    quantize: str | None = None,
    compile: bool = True,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM or seq2seq LM folder (or Hub id) in eval mode for fast `generate()`.

    `quantize`: "q8" / "q4" (hf_tfm's own int8 / int4 on its native kernel, `quantize_q8` / `quantize_q4`; the
    fastest settings here), "int8", "int4" or "nf4" (transformers' torchao or bitsandbytes integration, which needs
    that package), or None for the checkpoint's weights; `hf_tfm.inference.quantize.SETTINGS` lists them. `compile`:
    decode with a static cache and a compiled step (`compile_generation`); a compressed-tensors checkpoint's int4 /
    int8 weights (GPTQ, AWQ: `hf_tfm.calibration`) then become `Int8StreamingLinear` layers (`stream_compressed`).
    `dtype`: of the weights (with `quantize`, of what stays unquantized; default: the setting's or the checkpoint's).
    `trust_remote_code`: run Python code the folder or repository ships (its `auto_map`), as transformers' flag;
    without it such a folder is refused with transformers' `ValueError`. hf_tfm's own folders need no consent here:
    importing hf_tfm registered its classes, which transformers then uses instead of the folder's copy.
    Other keyword arguments go to `from_pretrained`.
    """
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    setting = quantize_setting(quantize) if quantize else None
    loading = setting.loading_kwargs(config) if setting else {}
    if dtype is not None:
        loading["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    model = auto.from_pretrained(path, trust_remote_code=trust_remote_code, **loading, **kwargs).eval()
    if setting is not None and setting.native:
        setting.apply(model)
        if not compile and not kernels.native_kernels_available():
            logger.warning(
                "quantize=%r without hf_tfm's native kernel (hf_tfm.inference.kernels) is made for the compiled step: "
                "eagerly, each layer's integer weights are converted at every step, slower than float32 (pass "
                "compile=True)",
                quantize,
            )
    if not compile:
        return model
    return compile_generation(stream_compressed(model))


__all__ = ["compile_generation", "load_for_inference"]
