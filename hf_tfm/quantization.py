"""Quantized weights for CPU inference: which of transformers' quantization configs serves each setting.

Batch-1 decoding streams every weight once per token, so on a CPU its speed is set by the bytes of the weights.
transformers' quantization integrations (bitsandbytes, torchao, optimum-quanto) cut those bytes and load hf_tfm
models as they load the in-tree ones: `from_pretrained(path, quantization_config=...)`. This module names, for each
setting of `hf-tfm generate --quantize`, the backend that decoded fastest on this project's CPU
(`scripts/bench.py --decode-settings`, docs/fast-inference.md), and the dtype of what stays unquantized.

Every quantizer leaves the output embedding (`lm_head`), tied weights and the last module unquantized, and
quantizes `nn.Linear` layers only: mixture-of-experts experts (3-D parameters) and the router stay as they are.
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from transformers.utils.quantization_config import QuantizationConfigMixin

# torch and transformers are imported where a config is built: `hf-tfm --help` lists the settings without them.


class QuantizationUnavailableError(ImportError):
    """The package a quantization setting needs is not installed; the message names what to install."""


@dataclass(frozen=True)
class QuantizationBackend:
    """One setting's backend: the package it needs, its transformers config and the dtype of unquantized weights."""

    setting: str
    module: str  # what must be importable
    pip_spec: str  # what to install when it is not
    summary: str
    make_config: Callable[["PretrainedConfig"], "QuantizationConfigMixin"]  # of the model about to load
    dtype: str  # of what stays unquantized (embeddings, norms, `lm_head`) and of the activations

    def available(self) -> bool:
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:  # a dotted module whose parent package is missing
            return False

    def loading_kwargs(self, config: "PretrainedConfig") -> dict[str, Any]:
        """`from_pretrained` keyword arguments for a model with this `config`: `quantization_config` and `dtype`."""
        if not self.available():
            raise QuantizationUnavailableError(
                f"quantization setting {self.setting!r} ({self.summary}) needs {self.module}: "
                f"pip install '{self.pip_spec}'"
            )
        import torch

        return {"quantization_config": self.make_config(config), "dtype": getattr(torch, self.dtype)}


def _int8(config: "PretrainedConfig") -> "QuantizationConfigMixin":
    from torchao.quantization import Int8WeightOnlyConfig  # TorchAoConfig takes torchao's own config object
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _linear_input_sizes(config: "PretrainedConfig") -> set[int]:
    """The input features of every `nn.Linear` a quantizer replaces: the hidden, FFN and attention-output widths, on
    each side of an encoder-decoder (experts are 3-D parameters, which no quantizer touches)."""
    sizes = set()
    for side in [config.encoder, config.decoder] if config.is_encoder_decoder else [config]:
        ffn = (side.intermediate_size, getattr(side, "shared_expert_intermediate_size", None))  # experts' knob
        sizes |= {side.hidden_size, side.num_attention_heads * side.head_dim, *(size for size in ffn if size)}
    return sizes


def int4_group_size(
    config: "PretrainedConfig", what: str = "--quantize int4", instead: str = "use nf4 or int8"
) -> int:
    """The input features that share an int4 scale in `config`'s linear layers: 128, or 64 or 32 where a layer's
    width needs them (a quantizer would leave such a layer unquantized, or fail). The ValueError of a model whose
    widths none of them divides names the caller (`what`) and what to do `instead`."""
    sizes = _linear_input_sizes(config)
    group_size = next((g for g in (128, 64, 32) if all(size % g == 0 for size in sizes)), None)
    if group_size is None:
        raise ValueError(
            f"{what} groups input features by 32, 64 or 128, but this model's linear layers take "
            f"{sorted(sizes)} (hidden_size, intermediate_size, heads x head_dim): {instead}"
        )
    return group_size


def _int4(config: "PretrainedConfig") -> "QuantizationConfigMixin":
    # torchao's CPU int4 layout (a prototype in 0.18): its `_weight_int4pack_mm_for_cpu` GEMV read 4.3x fewer bytes
    # and ran 4x faster than fp32 here with bf16 activations (50x slower with fp32 ones, hence bf16 around it).
    # Groups of 128 input features share a scale and zero point (smaller where a layer's width needs them).
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=int4_group_size(config)))


def _nf4(config: "PretrainedConfig") -> "QuantizationConfigMixin":
    import torch
    from transformers import BitsAndBytesConfig

    # Single quantization: double-quantized scales save 0.4 bits per weight but decoded 15% slower here. A model
    # quantized this way saves correctly only before its first forward (docs/fast-inference.md, bitsandbytes 0.50).
    # bitsandbytes' CPU 4-bit kernel computes in bf16 whatever the input's dtype, so bf16 around it loses nothing
    # the kernel has not lost already, and halves the bytes of `lm_head`.
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


# One backend per setting: the fastest of those that ran here (docs/fast-inference.md has the table).
BACKENDS: dict[str, QuantizationBackend] = {
    "int8": QuantizationBackend("int8", "torchao", "torchao==0.18.0", "torchao int8 weight-only", _int8, "float32"),
    "int4": QuantizationBackend(
        "int4", "torchao", "torchao==0.18.0", "torchao int4 weight-only, CPU kernel (not saveable)", _int4, "bfloat16"
    ),
    "nf4": QuantizationBackend("nf4", "bitsandbytes", "bitsandbytes==0.50.2", "bitsandbytes NF4", _nf4, "bfloat16"),
}


# Settings hf_tfm quantizes itself, with no quantization package (`hf_tfm.inference.quantize_q8` / `quantize_q4`):
# setting -> summary
NATIVE_SETTINGS = {
    "q8": "hf_tfm int8 weights with a scale per 128 inputs, lm_head too, on hf_tfm's AVX-512 VNNI kernel (quantized "
    "while loading, not saveable)",
    "q4": "hf_tfm int4 weights with a scale per 128 inputs and an int8 lm_head, on the same kernel (the fastest "
    "setting; quantized while loading, not saveable)",
}


def quantization_kwargs(setting: str, config: "PretrainedConfig") -> dict[str, Any]:
    """`from_pretrained` keyword arguments for a `--quantize` setting ("int8", "int4" or "nf4") of a model with
    `config`; none for hf_tfm's own settings (`NATIVE_SETTINGS`), which quantize the loaded model.

    Raises `QuantizationUnavailableError` naming the package to install when the setting's backend is missing.
    """
    if setting in NATIVE_SETTINGS:
        return {}
    if setting not in BACKENDS:
        raise ValueError(
            f"unknown quantization setting {setting!r}: choose one of {', '.join([*NATIVE_SETTINGS, *BACKENDS])}"
        )
    return BACKENDS[setting].loading_kwargs(config)


__all__ = [
    "BACKENDS",
    "NATIVE_SETTINGS",
    "QuantizationBackend",
    "QuantizationUnavailableError",
    "int4_group_size",
    "quantization_kwargs",
]
