"""Quantized weights for CPU inference: which of transformers' quantization configs serves each setting.

Batch-1 decoding streams every weight once per token, so on a CPU its speed is set by the bytes of the weights.
transformers' quantization integrations (bitsandbytes, torchao, optimum-quanto) cut those bytes and load hf_tfm
models as they load the in-tree ones: `from_pretrained(path, quantization_config=...)`. This module names, for each
setting of `hf-tfm generate --quantize`, the backend that decoded fastest on this project's CPU
(`scripts/bench.py --decode-settings`, README "Fast inference"), and the dtype of what stays unquantized.

Every quantizer leaves the output embedding (`lm_head`), tied weights and the last module unquantized, and
quantizes `nn.Linear` layers only: mixture-of-experts experts (3-D parameters) and the router stay as they are.
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    make_config: Callable[[], "QuantizationConfigMixin"]
    dtype: str  # of what stays unquantized (embeddings, norms, `lm_head`) and of the activations

    def available(self) -> bool:
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:  # a dotted module whose parent package is missing
            return False

    def loading_kwargs(self) -> dict[str, Any]:
        """`from_pretrained` keyword arguments: `quantization_config` and `dtype`."""
        if not self.available():
            raise QuantizationUnavailableError(
                f"quantization setting {self.setting!r} ({self.summary}) needs {self.module}: "
                f"pip install '{self.pip_spec}'"
            )
        import torch

        return {"quantization_config": self.make_config(), "dtype": getattr(torch, self.dtype)}


def _int8() -> "QuantizationConfigMixin":
    from torchao.quantization import Int8WeightOnlyConfig  # TorchAoConfig takes torchao's own config object
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _int4() -> "QuantizationConfigMixin":
    from transformers import QuantoConfig

    return QuantoConfig(weights="int4")


def _nf4() -> "QuantizationConfigMixin":
    import torch
    from transformers import BitsAndBytesConfig

    # Single quantization: double-quantized scales save 0.4 bits per weight but decoded 15% slower here. A model
    # quantized this way saves correctly only before its first forward (README "Fast inference", bitsandbytes 0.50).
    # bitsandbytes' CPU 4-bit kernel computes in bf16 whatever the input's dtype, so bf16 around it loses nothing
    # the kernel has not lost already, and halves the bytes of `lm_head`.
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


# One backend per setting: the fastest of those that ran here (README "Fast inference" has the table).
BACKENDS: dict[str, QuantizationBackend] = {
    "int8": QuantizationBackend("int8", "torchao", "torchao==0.18.0", "torchao int8 weight-only", _int8, "float32"),
    # optimum-quanto's int4 kernel takes bf16/fp16 activations only (fp32 inputs fail under inference mode).
    "int4": QuantizationBackend(
        "int4", "optimum.quanto", "optimum-quanto==0.2.7", "optimum-quanto int4 weights", _int4, "bfloat16"
    ),
    "nf4": QuantizationBackend("nf4", "bitsandbytes", "bitsandbytes==0.50.2", "bitsandbytes NF4", _nf4, "bfloat16"),
}


def quantization_kwargs(setting: str) -> dict[str, Any]:
    """`from_pretrained` keyword arguments for a `--quantize` setting ("int8", "int4" or "nf4").

    Raises `QuantizationUnavailableError` naming the package to install when the setting's backend is missing.
    """
    if setting not in BACKENDS:
        raise ValueError(f"unknown quantization setting {setting!r}: choose one of {', '.join(BACKENDS)}")
    return BACKENDS[setting].loading_kwargs()


__all__ = ["BACKENDS", "QuantizationBackend", "QuantizationUnavailableError", "quantization_kwargs"]
