"""The inference wing: everything between a saved folder and a fast `generate()` on it.

- `load.py`: the one entry, `load_for_inference(folder, quantize=...)`, and `compile_generation(model)`
- `quantize.py`: every `quantize=` setting in one table (`SETTINGS`): hf_tfm's own q8 / q4 and the third-party ones
- `layers.py`: the linear layers a step multiplies with (`StreamingLinear`, `Int8StreamingLinear`)
- `kernels.py` (with `csrc/`): hf_tfm's native CPU kernels behind those layers
- `attention.py`: the one decode attention, installed by the loader
- `aot.py`: generate()'s decode step, compiled ahead of time; `step_store.py` keeps it on disk
- `cache.py`: the static KV cache the step decodes with, croppable and growable for speculative decoding
"""

from .aot import CompiledDecodeStep, install, precompile, step_blockers
from .attention import decode_attention
from .layers import Int8StreamingLinear, StreamingLinear, fuse_projections
from .load import compile_generation, load_for_inference
from .quantize import SETTINGS, quantization_kwargs, quantize_q4, quantize_q8, stream_compressed

__all__ = [
    "SETTINGS",
    "CompiledDecodeStep",
    "Int8StreamingLinear",
    "StreamingLinear",
    "compile_generation",
    "decode_attention",
    "fuse_projections",
    "install",
    "load_for_inference",
    "precompile",
    "quantization_kwargs",
    "quantize_q4",
    "quantize_q8",
    "step_blockers",
    "stream_compressed",
]
