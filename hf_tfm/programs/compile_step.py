"""Compile a model's decode step ahead of time and store it as an entry of hf_tfm's step store, in a process of its own
(`hf_tfm.inference.aot` starts it): the process that asked goes on decoding meanwhile, and the entry lands in the store
even when that process has ended by then.

args:
- `path`: the job, saved with `torch.save` by the caller in the `staging` folder: the step module with its tensors on
  the meta device, its sample inputs' shapes and dtypes, its dynamic dimensions, the Inductor options, and functions
  to call first;
- `staging`, `entry`: the entry is written into `staging`, which is then renamed to `entry`;
- `threads`: the thread count the library is compiled for;
- `sys_path`: the caller's (the job names its classes by module);
- `description`: what the entry records beside its checksum.

Returns the seconds the export and the compile took. The job's module names hf_tfm's classes, so this runs where
hf_tfm is importable; it imports nothing of hf_tfm itself.
"""

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path


def _dynamic_shapes(spec, dims):
    """The job's dynamic shapes with each dimension's name replaced by its `torch.export.Dim`."""
    if isinstance(spec, dict):
        return {int(axis): dims[name] for axis, name in spec.items()}
    if isinstance(spec, (list, tuple)):
        return tuple(_dynamic_shapes(item, dims) for item in spec)
    return spec


def _compile(job, package: Path) -> None:
    import torch

    for setup in job["setup"]:
        setup()
    # Uninitialised memory the size of the model's tensors, never read: export traces with fake tensors and the
    # library keeps no constants (the caller loads its own tensors into it)
    step = job["module"].to_empty(device="cpu")
    inputs = tuple(torch.zeros(shape, dtype=dtype) for shape, dtype in job["inputs"])
    dims = {name: torch.export.Dim(name, min=low, max=high) for name, (low, high) in job["dims"].items()}
    with torch.no_grad():
        exported = torch.export.export(
            step, inputs, dynamic_shapes=_dynamic_shapes(job["dynamic"], dims), strict=False
        )
    torch._inductor.aoti_compile_and_package(exported, package_path=str(package), inductor_configs=job["options"])


def run(args):
    sys.path[:0] = [entry for entry in args["sys_path"] if entry not in sys.path]
    import torch

    torch.set_num_threads(args["threads"])  # written into the library: it runs with the caller's thread count
    start = time.perf_counter()
    staging, entry = Path(args["staging"]), Path(args["entry"])
    try:
        _compile(torch.load(args["path"], weights_only=False), staging / "step.pt2")  # the caller's job, just written
        Path(args["path"]).unlink()
        seconds = time.perf_counter() - start
        digest = hashlib.sha256((staging / "step.pt2").read_bytes()).hexdigest()
        record = {"sha256": digest, "seconds": round(seconds, 1), **args["description"]}
        (staging / "entry.json").write_text(json.dumps(record, indent=1))
        try:
            os.rename(staging, entry)  # whole or not at all
        except OSError:  # another process stored the same entry first: keep its
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"seconds": seconds}
