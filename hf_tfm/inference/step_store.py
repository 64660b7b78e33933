"""Compiled decode steps kept on disk, so that a step is compiled once per machine and model, not once per process.

An entry is a folder `<root>/steps/<key>/` holding an AOTInductor package, `step.pt2` (code only: the library reads
the model's tensors where they are, so one entry serves every checkpoint of the same layout), and `entry.json` (the
package's SHA-256 and what it was compiled for). The key hashes everything that makes a library valid for a model:
its module classes and their settings, every tensor's name, shape, dtype and stride, its config, the step's kind and
batch size, the thread count, the CPU's instruction set and the native kernels built for it, and the versions of torch,
transformers and hf_tfm's code. Anything else is a new key: a stale entry is never found, a damaged one is removed and
rebuilt.

The root is `$HF_TFM_CACHE`, else `$XDG_CACHE_HOME/hf_tfm`, else `~/.cache/hf_tfm`. Entries are written whole by the
compiling program (`hf_tfm/programs/compile_step.py`): a reader finds an entry complete or not at all.
"""

import functools
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.utils import logging

from . import kernels

logger = logging.get_logger(__name__)

PACKAGE = "step.pt2"
ENTRY = "entry.json"
FORMAT = 1  # of an entry: a change here makes every older entry a miss
FOLDED = "_FOLDED_CONST_"  # the names of what a library computes from the model's tensors when they load
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # hf_tfm/
# A staging folder older than this was left by a compile that died: removed when the store is next written
STALE_STAGING_SECONDS = 3600


def cache_root() -> Path:
    """Where hf_tfm keeps what it builds for this machine: `$HF_TFM_CACHE`, else `$XDG_CACHE_HOME/hf_tfm`, else
    `~/.cache/hf_tfm`."""
    if os.environ.get("HF_TFM_CACHE"):
        return Path(os.environ["HF_TFM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_tfm"


def steps_folder() -> Path:
    return cache_root() / "steps"


@functools.cache
def _package_digest() -> str:
    """SHA-256 of hf_tfm's own source (every .py and .cpp file of the package): its code is traced into the step."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_ROOT.rglob("*")):
        if path.suffix in (".py", ".cpp") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(PACKAGE_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _class_sources(model: nn.Module) -> list[str]:
    """SHA-256 of the source file of every module class in `model` that is not hf_tfm's (an in-tree model's, a
    folder's own code): the versions of transformers and torch name the rest."""
    files = set()
    for module in model.modules():
        path = getattr(sys.modules.get(type(module).__module__), "__file__", None)
        if path and PACKAGE_ROOT not in Path(path).resolve().parents:
            files.add(path)
    return sorted(hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in files)


def fingerprint(model: nn.Module, kind: str, batch: int, threads: int, options: dict[str, Any]) -> dict[str, Any]:
    """What makes a compiled step valid for `model`: equal fingerprints, interchangeable libraries."""
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "architectures"):
        config.pop(volatile, None)
    config["_attn_implementation"] = model.config._attn_implementation
    return {
        "format": FORMAT,
        "kind": kind,
        "batch": batch,
        "threads": threads,
        "options": options,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "code": [_package_digest(), *_class_sources(model)],
        "cpu": kernels.cpu_fingerprint(),
        "kernels": sorted(kernels.built_operators()),  # the step calls them (HF_TFM_NATIVE_KERNELS may change them)
        "config": config,
        "modules": [
            [name, f"{type(module).__module__}.{type(module).__qualname__}", module.extra_repr()]
            for name, module in model.named_modules()
        ],
        "tensors": [
            [name, list(tensor.shape), str(tensor.dtype), list(tensor.stride())]
            for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
            for name, tensor in named
        ],
    }


def key_of(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:32]


def entry_folder(key: str) -> Path:
    return steps_folder() / key


def staging_folder(key: str) -> Path:
    """A new folder beside the entry's, for the compiling program to fill and then rename into the entry's place;
    staging folders a dead compile left behind are removed first."""
    root = steps_folder()
    root.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in root.glob(".*.partial-*"):
        try:
            if now - old.stat().st_mtime > STALE_STAGING_SECONDS:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:  # another process removed it first
            pass
    return root / f".{key}.partial-{os.getpid()}-{time.monotonic_ns()}"


def _load_package(package: Path) -> Any:
    """`torch._inductor.aoti_load_package` without its comparison of this machine with the compiling one, which only
    warns and costs 0.8 s of a process's first step (Inductor's choice of vector instruction set spawns a Python per
    candidate to probe it): the entry's key already names this CPU's instruction-set flags. The same loader that
    `torch._inductor.package.load_package` falls back to."""
    from torch._inductor.package.package import AOTICompiledModel

    loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)  # one runner, on the CPU
    return AOTICompiledModel(loader)


def load(key: str, constants: dict[str, torch.Tensor]) -> Any | None:
    """The library of entry `key`, reading the tensors in `constants` (by the names the library asks for), or None
    when there is no such entry. An entry that fails its checksum or does not load is removed, with a warning."""
    folder = entry_folder(key)
    if not (folder / ENTRY).is_file():
        return None
    try:
        entry = json.loads((folder / ENTRY).read_text())
        package = folder / PACKAGE
        if hashlib.sha256(package.read_bytes()).hexdigest() != entry["sha256"]:
            raise ValueError("its package does not match its checksum")
        library = _load_package(package)
        # Every tensor of the model the library reads, user-managed: it keeps pointers to the model's own tensors
        # instead of copies. What it computes from them alone (ALiBi's negated slopes) it computes when they load.
        names = [name for name in library.get_constant_fqns() if not name.startswith(FOLDED)]
        missing = sorted(set(names) - set(constants))
        if missing:
            raise ValueError(f"it reads tensors the model does not have: {missing[:3]}")
        library.load_constants({name: constants[name] for name in names}, check_full_update=False, user_managed=True)
        return library
    except Exception as error:  # a damaged entry of any kind is rebuilt, never used
        logger.warning(
            "hf_tfm: the compiled step at %s is damaged (%s): removed, it will be compiled again", folder, error
        )
        shutil.rmtree(folder, ignore_errors=True)
        return None


__all__ = ["cache_root", "entry_folder", "fingerprint", "key_of", "load", "staging_folder", "steps_folder"]
