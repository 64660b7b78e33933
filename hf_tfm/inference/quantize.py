"""Every `quantize=` setting in one table (`SETTINGS`): hf_tfm's own q8 / q4, and the settings served by
transformers' quantization integrations. `load_for_inference`, `hf-tfm generate --quantize`, `hf-tfm info` and the
docs read this table; nothing else names a setting.

Batch-1 decoding streams every weight once per token, so on a CPU its speed is set by the bytes of the weights.

- hf_tfm's own settings quantize the loaded model in place (`quantize_q8`, `quantize_q4`): integer weights with a
  float scale per group of inputs, in `Int8StreamingLinear` layers that hf_tfm's native kernel multiplies
  (`hf_tfm.inference.kernels`). The fastest settings on a CPU; not saveable (quantized again at every load, in
  seconds).
- The others are transformers' quantization configs (bitsandbytes, torchao), passed to `from_pretrained`
  (`quantization_kwargs`): each setting names the backend that decoded fastest on this project's CPU
  (docs/fast-inference.md), and the dtype of what stays unquantized. Their layers keep their own kernels.

Every quantizer quantizes `nn.Linear` layers only: mixture-of-experts experts (3-D parameters) and the router stay as
they are. A compressed-tensors checkpoint's integer layers (GPTQ, AWQ: `hf_tfm.calibration`) become
`Int8StreamingLinear` layers too (`stream_compressed`).
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import kernels, layers
from .layers import Int8StreamingLinear, plain_linears

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.utils.quantization_config import QuantizationConfigMixin


class QuantizationUnavailableError(ImportError):
    """The package a quantization setting needs is not installed; the message names what to install."""


@dataclass(frozen=True)
class QuantizeSetting:
    """One `quantize=` setting: hf_tfm's own (`bits` set: int8 / int4 weights quantized after loading), or a
    transformers quantization config (`make_config` set) built for the model about to load."""

    setting: str
    summary: str
    bits: int | None = None  # hf_tfm's own: the weights' bits (lm_head stays int8)
    module: str | None = None  # a third-party backend: what must be importable
    pip_spec: str | None = None  # ... and what to install when it is not
    make_config: Callable[["PretrainedConfig"], "QuantizationConfigMixin"] | None = None
    dtype: str | None = None  # of what stays unquantized (embeddings, norms, `lm_head`) and of the activations

    @property
    def native(self) -> bool:
        return self.bits is not None

    @property
    def requirement(self) -> str:
        """What the setting needs to run at its speed, in words."""
        if self.native:
            return "hf_tfm's native kernel: a CPU with AVX-512 VNNI or AVX2, and a C++ compiler"
        return f"pip install '{self.pip_spec}'"

    def available(self) -> bool:
        """Whether the setting runs here at its speed: hf_tfm's kernel is built (native), or the package is there."""
        if self.native:
            return kernels.native_kernels_available()
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:  # a dotted module whose parent package is missing
            return False

    def loading_kwargs(self, config: "PretrainedConfig") -> dict[str, Any]:
        """`from_pretrained` keyword arguments for a model with this `config`: none for hf_tfm's own settings, else
        `quantization_config` and `dtype`; `QuantizationUnavailableError` when the backend is missing."""
        if self.native:
            return {}
        if not self.available():
            raise QuantizationUnavailableError(
                f"quantization setting {self.setting!r} ({self.summary}) needs {self.module}: {self.requirement}"
            )
        return {"quantization_config": self.make_config(config), "dtype": getattr(torch, self.dtype)}

    def apply(self, model: "PreTrainedModel") -> "PreTrainedModel":
        """The loaded `model` quantized in place by hf_tfm's own settings (the others quantized while loading)."""
        return _quantize_linears(model, bits=self.bits, head_bits=8) if self.native else model


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
    from transformers import BitsAndBytesConfig

    # Single quantization: double-quantized scales save 0.4 bits per weight but decoded 15% slower here. A model
    # quantized this way saves correctly only before its first forward (docs/fast-inference.md, bitsandbytes 0.50).
    # bitsandbytes' CPU 4-bit kernel computes in bf16 whatever the input's dtype, so bf16 around it loses nothing
    # the kernel has not lost already, and halves the bytes of `lm_head`.
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


# Every `quantize=` setting, hf_tfm's own first (the fastest here), then one backend per setting: the fastest of
# those that ran here (docs/fast-inference.md has the table).
SETTINGS: dict[str, QuantizeSetting] = {
    "q8": QuantizeSetting(
        "q8",
        "hf_tfm int8 weights with a scale per 128 inputs, lm_head too, on hf_tfm's integer kernel (quantized "
        "while loading, not saveable)",
        bits=8,
    ),
    "q4": QuantizeSetting(
        "q4",
        "hf_tfm int4 weights with a scale per 128 inputs and an int8 lm_head, on the same kernel, which rounds their "
        "inputs to 8 bits on AVX-512 VNNI as llama.cpp's Q4_0 does (the fastest setting; quantized while loading, "
        "not saveable)",
        bits=4,
    ),
    "int8": QuantizeSetting(
        "int8", "torchao int8 weight-only", module="torchao", pip_spec="torchao==0.18.0", make_config=_int8,
        dtype="float32",
    ),
    "int4": QuantizeSetting(
        "int4", "torchao int4 weight-only, CPU kernel (not saveable)", module="torchao", pip_spec="torchao==0.18.0",
        make_config=_int4, dtype="bfloat16",
    ),
    "nf4": QuantizeSetting(
        "nf4", "bitsandbytes NF4", module="bitsandbytes", pip_spec="bitsandbytes==0.50.2", make_config=_nf4,
        dtype="bfloat16",
    ),
}  # fmt: skip


def quantize_setting(setting: str) -> QuantizeSetting:
    """The entry of `SETTINGS` named `setting`; a `ValueError` listing them for another name."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown quantization setting {setting!r}: choose one of {', '.join(SETTINGS)}")
    return SETTINGS[setting]


def quantization_kwargs(setting: str, config: "PretrainedConfig") -> dict[str, Any]:
    """`from_pretrained` keyword arguments for a `quantize=` setting of a model with `config`: a transformers
    quantization config and dtype ("int8", "int4", "nf4"), none for hf_tfm's own settings ("q8", "q4"), which
    quantize the loaded model. Raises `QuantizationUnavailableError` naming the package to install when the
    setting's backend is missing."""
    return quantize_setting(setting).loading_kwargs(config)


def quantize_q8(model: "PreTrainedModel") -> "PreTrainedModel":
    """Replace every plain `nn.Linear` of `model` (the output embedding `lm_head` too, as llama.cpp's Q8_0 does) by an
    int8 `Int8StreamingLinear` in place; returns `model`. A tied `lm_head` gets an int8 copy, the input embedding
    table stays as it is (a step gathers one row of it), and so do a mixture of experts' experts and router (3-D and
    router parameters, not `nn.Linear` layers; a shared expert and its gate are linear layers and take int8 rows).
    Then each block's q/k/v and gate/up layers are fused (`fuse_projections`)."""
    return SETTINGS["q8"].apply(model)


def quantize_q4(model: "PreTrainedModel") -> "PreTrainedModel":
    """`quantize_q8`, but int4 (round to nearest, a scale per 128 inputs) for every linear layer but `lm_head`, which
    stays int8: llama.cpp's Q4_0 keeps its output layer at 6 bits for the same reason (its error reaches every logit
    directly). For calibrated int4 (GPTQ, AWQ), see `hf_tfm.calibration`."""
    return SETTINGS["q4"].apply(model)


def _quantize_linears(model: "PreTrainedModel", bits: int, head_bits: int) -> "PreTrainedModel":
    from transformers import PreTrainedModel

    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    for parent, name, linear in plain_linears(model):
        setattr(parent, name, Int8StreamingLinear.from_linear(linear, head_bits if linear is head else bits))
    model.config.tie_word_embeddings = False  # `lm_head` is no longer the embedding's weight: nothing may re-tie it
    return layers.fuse_projections(model)


def _compressed_int_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, module) of every compressed-tensors layer with symmetric integer weights of up to 8 bits, a
    scale per row or per contiguous group, and float activations: what GPTQ / AWQ / round-to-nearest W4A16 and W8A16
    checkpoints hold (`hf_tfm.calibration`). Asymmetric weights (a zero point) and activation-ordered groups
    (`weight_g_idx`) keep compressed-tensors' own layers."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            scheme = getattr(child, "quantization_scheme", None)
            weights = scheme.weights if scheme is not None else None
            if (
                isinstance(child, nn.Linear)
                and weights is not None
                and scheme.input_activations is None
                and (weights.type, weights.symmetric, weights.strategy)
                in {("int", True, "group"), ("int", True, "channel")}
                and weights.num_bits <= 8
                and not hasattr(child, "weight_g_idx")
            ):
                found.append((parent, name, child))
    return found


def stream_compressed(model: "PreTrainedModel") -> "PreTrainedModel":
    """Replace the compressed-tensors integer layers of `model` (`_compressed_int_linears`) by `Int8StreamingLinear`
    layers with the same integers and scales, fused per block (`fuse_projections`), in place; returns `model`.
    compressed-tensors decompresses its layers to float weights for its own forward, which reads 4 bytes a weight:
    this reads one."""
    found = _compressed_int_linears(model)
    if found and any(getattr(linear, "weight", None) is None for _, _, linear in found):
        # compressed-tensors unpacks the weights on the model's first forward: one token does it
        one = torch.tensor([[model.config.bos_token_id or 0]], device=model.device)
        extra = {"decoder_input_ids": one} if model.config.is_encoder_decoder else {}
        with torch.no_grad():
            model(input_ids=one, **extra)
    for parent, name, linear in found:
        setattr(parent, name, Int8StreamingLinear.from_compressed(linear))
    if found:
        from compressed_tensors.offload import remove_dispatch

        # Decompressing wrapped every module's forward in one that moves its inputs to its weights' device, a graph
        # break each (31 ms a step on the bench's base shape instead of 10): on one device there is nothing to move.
        remove_dispatch(model, onload_tensors=True)
    return layers.fuse_projections(model)


__all__ = [
    "SETTINGS",
    "QuantizationUnavailableError",
    "QuantizeSetting",
    "int4_group_size",
    "quantization_kwargs",
    "quantize_q4",
    "quantize_q8",
    "quantize_setting",
    "stream_compressed",
]
