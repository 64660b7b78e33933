"""Sharded parameters: workarounds for transformers' native FSDP2 (`from_pretrained(distributed_config=...)`), 5.16
and newer, and reading parameters that DeepSpeed ZeRO-3 has partitioned.

`TfmPreTrainedModel.maybe_distribute_model` calls `prepare_fsdp` before transformers shards a model, and
`gather_sharded_state_dict_for_save` calls `share_tied_tensors` on what a save gathers back. Under ZeRO-3 each
parameter is an empty placeholder outside `forward`: a module's repr reads its shape with `full_shape` (its values:
`hf_tfm.scale_out`). This file imports only torch and transformers: saved folders carry it as remote code, beside
`modeling.py`, which imports it.
"""

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Trainer takes a model sharded by `from_pretrained(distributed_config=...)` as is from the release that marks such
# models (`is_distributed_loading_by_transformers`); older ones wrap it in DDP, which fails on sharded parameters.
TRAINER_TAKES_SHARDED_MODELS = hasattr(PreTrainedModel, "is_distributed_loading_by_transformers")


def _fsdp_requested(distributed_config) -> bool:
    """Whether a `DistributedConfig` shards with FSDP2 (`dp_size` counts HSDP replicas on newer releases)."""
    if distributed_config is None:
        return False
    size = getattr(distributed_config, "dp_size", None) or getattr(distributed_config, "fsdp_size", None) or 1
    return size > 1


def prepare_fsdp(model: PreTrainedModel, distributed_config) -> None:
    """Tie `model`'s weights before FSDP2 shards it, so that each tied pair is one FSDP2 parameter, and warn where this
    release's Trainer cannot train the sharded model.

    Upstream root cause (transformers 5.16-5.24): `from_pretrained` builds the model untied (`no_tie_weights`),
    shards it with `fully_shard`, and ties only after loading. The root FSDP unit then owns `lm_head.weight` as a
    parameter of its own, and its forward hook swaps that stale copy back into `lm_head` at every step, so from
    the second step on the head trains apart from `embed_tokens`. Tying first and leaving both modules out of the
    plan puts the one shared parameter in the root unit, which FSDP2 gathers into both modules.
    """
    if not _fsdp_requested(distributed_config):
        return
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    # With tensor parallelism too, the tie must wait: TP shards each module's own parameter (a tied head's would be
    # missing, a KeyError), and transformers ties the sharded pair before FSDP2 wraps it.
    if tied and (getattr(distributed_config, "tp_size", None) or 1) == 1:
        for target, source in tied.items():
            module_name, _, param_name = target.rpartition(".")
            setattr(model.get_submodule(module_name), param_name, model.get_parameter(source))
        sharing = {name.rpartition(".")[0] for pair in tied.items() for name in pair}
        model._fsdp_plan = {k: v for k, v in (model._fsdp_plan or {}).items() if k not in sharing}
    if not TRAINER_TAKES_SHARDED_MODELS:
        logger.warning_once(
            "This transformers release's Trainer wraps a natively sharded model in DDP and fails; train it with "
            "your own loop, or use transformers 5.19 or newer, whose Trainer takes it as is."
        )


def share_tied_tensors(model: PreTrainedModel, state_dict: dict) -> dict:
    """`state_dict` gathered from a sharded `model`, with each tied weight pointing at its source's tensor again.

    Gathering gives every key its own full tensor, so transformers' save (which drops tied copies by storage) would
    write the tied head twice; pointing the copy at its source lets it be dropped as usual.
    """
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in state_dict and source in state_dict:
            state_dict[target] = state_dict[source]
    return state_dict


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape, also when DeepSpeed ZeRO-3 has partitioned it: the tensor is then an empty placeholder and
    `ds_shape` the real shape. DeepSpeed and `Trainer` print the model (its modules' `extra_repr`) before training."""
    return getattr(param, "ds_shape", param.shape)
