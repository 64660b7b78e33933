"""What code around `Trainer` does differently when it runs as one of several processes (torchrun, `accelerate
launch`, DeepSpeed, Ray Train): which rank writes, CPU-only launches, and parameters that DeepSpeed ZeRO-3 partitioned.

Under ZeRO-3 every parameter is an empty placeholder outside `forward` (its real shape is `ds_shape`): reading one
(a conversion, a merge, a save) goes through `full_parameters`, and after training `release_zero3` gives each rank's
model its whole parameters back, as after a one-process run.
"""

import os
from contextlib import AbstractContextManager, nullcontext

import torch


def is_main_process() -> bool:
    """Whether this process is rank 0 of its launch (or not launched by one): the one that writes shared files."""
    return int(os.environ.get("RANK", "0")) == 0


def cpu_only_launch() -> bool:
    """A multi-process launch on a machine without an accelerator: `Trainer` needs `use_cpu=True` there to run data
    parallel over gloo (without it, each rank trains alone on its own copy)."""
    accelerator = getattr(torch, "accelerator", None)  # torch 2.6 and newer
    available = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not available


def partitioned(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of `module` that DeepSpeed ZeRO-3 partitioned (none outside ZeRO-3)."""
    return [p for p in module.parameters() if hasattr(p, "ds_id")]


def full_parameters(module: torch.nn.Module) -> AbstractContextManager:
    """A context in which every parameter of `module` holds its full values on every rank, to read them outside
    `forward`: DeepSpeed's `GatheredParameters` where ZeRO-3 partitioned them (changes are not kept), else nothing.
    Every rank must enter it (it gathers)."""
    params = partitioned(module)
    if not params:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def release_zero3(trainer) -> None:
    """After `trainer.train()` under ZeRO-3, make the model an ordinary one again on every rank: whole parameters
    (ties kept) and no DeepSpeed hooks, so it merges adapters, generates and saves as after a one-process run. Every
    rank must call it (it gathers); it does nothing where no parameter is partitioned. `trainer` trains no further."""
    model = trainer.model
    params = partitioned(model)
    if not params:
        return
    whole: dict[int, torch.nn.Parameter] = {}
    with full_parameters(model):
        for param in params:
            whole[id(param)] = torch.nn.Parameter(param.data.clone(), requires_grad=param.requires_grad)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in whole:
                module._parameters[name] = whole[id(param)]  # one new parameter per old one: tied stay tied
    trainer.model_wrapped.destroy()  # the engine's hooks would gather the old placeholders at every forward


__all__ = ["cpu_only_launch", "full_parameters", "is_main_process", "partitioned", "release_zero3"]
