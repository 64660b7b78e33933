"""Exact-parity conversion between hf_tfm and transformers' in-tree model families.

`from_hf(model_or_path)` turns an in-tree model (object or saved folder) of a registered family into the hf_tfm model
with the same architecture and weights; `to_hf(model)` writes the in-tree class back whenever the config is
expressible by one, and otherwise raises a `ValueError` naming every knob that blocks it. `convert_path(src, dst)` does
either on saved folders, picking the direction from the source's `model_type`.

Each family lives in its own module as three small tables: how its config maps onto `TfmConfig` knobs, which knob
values it needs on the way back, and how its weight names map onto hf_tfm's (with any reshaping, such as GPT-2's
Conv1D transpose and fused q/k/v). `core` holds what they share and runs them; the weights are moved with a strict
`load_state_dict`, so a tensor nobody mapped is an error, not a silently random weight. A new family is a new module
imported below, in the order `to_hf` should try it.
"""

# Each module registers its families on import; this order is the order `to_hf` tries them in.
# isort: off
from . import llama_like, gpt2, bert, modernbert, mixtral, qwen2_moe, olmoe, bart, marian  # noqa: F401

# isort: on
from .core import FAMILIES, HEADS, TFM_CLASSES, convert_path, from_hf, in_tree_blockers, to_hf

__all__ = ["FAMILIES", "HEADS", "TFM_CLASSES", "convert_path", "from_hf", "in_tree_blockers", "to_hf"]
