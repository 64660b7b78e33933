"""Checkpoint folders on disk: written all at once, diagnosed when damaged, and carrying hf_tfm's own code.

`staged_folder` and `staged_file` are the one way hf_tfm writes a folder or a file: into a hidden sibling that takes
the target's place only when complete. Model saves (`TfmPreTrainedModel.save_pretrained`, through `staged_save`), the
`hf-tfm` commands' output folders and the runtime exports all go through them. `weights_damage` names a truncated
safetensors file, which transformers reports only as a header error, and `repair_remote_code` puts hf_tfm's code back
into a folder saved from a class that torch generated. This file imports only the standard library and transformers:
saved folders carry it as remote code, beside `modeling.py`, which imports it.
"""

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files
from transformers.modeling_utils import _add_variant
from transformers.utils import ADAPTER_SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, logging

logger = logging.get_logger(__name__)

# ---------------------------------------------------------------------------------------------------------------------
# Folders written all at once


@contextmanager
def staged_folder(
    target: str | os.PathLike, keep: Callable[[str], bool] | None = None, in_place_fallback: bool = False
) -> Iterator[Path]:
    """Write the folder `target` all at once: yield a new empty hidden folder beside it, `.NAME.partial-XXXXXXXX`,
    which takes `target`'s place when the block ends and is deleted when it raises, leaving `target` as it was.

    A reader, or a run that fails or is killed midway, finds the old folder or the new one, never a mix. `keep` picks,
    by name, the old folder's entries to carry into the new one where it has none of that name (hard-linked); without
    it nothing of the old folder is kept. Whether an existing `target` may be replaced at all is the caller's decision
    (the CLI's: `hf_tfm.training.check_output_dir`). Where no folder can be renamed into `target`'s place (a mount
    point, a parent folder that is not writable) this raises `OSError`, or with `in_place_fallback` warns and yields
    `target` itself.
    """
    target = Path(target).resolve()
    try:
        staging = _new_staging_folder(target)
    except OSError as err:
        if not in_place_fallback:
            raise
        logger.warning(f"Saving into {target} in place, not all at once: {err}")
        yield target
        return
    try:
        yield staging
        if keep is not None:
            _carry_over(target, staging, keep)
        _replace_folder(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def staged_save(save_directory: str | os.PathLike, variant: str | None, adapter: bool) -> AbstractContextManager[Path]:
    """The `staged_folder` a model's `save_pretrained(save_directory)` writes into.

    What else the folder holds (a tokenizer, a README, a Trainer's files) is kept, as transformers' in-place save
    keeps it, except weights of the kind this save writes (`model.safetensors`, its shards and index, or the
    adapter's), which would mix with the new ones: transformers would even load a stale unsharded file in preference
    to new shards. Where no hidden folder can take the target's place, the model is saved in place, as transformers
    saves it, with a warning.
    """
    weights = ADAPTER_SAFE_WEIGHTS_NAME if adapter else _add_variant(SAFE_WEIGHTS_NAME, variant)
    stale = rf"{re.escape(weights.removesuffix('.safetensors'))}(-\d{{5}}-of-\d{{5}})?\.safetensors"
    if not adapter:
        stale += "|" + re.escape(_add_variant(SAFE_WEIGHTS_INDEX_NAME, variant))
    return staged_folder(save_directory, keep=lambda name: re.fullmatch(stale, name) is None, in_place_fallback=True)


@contextmanager
def staged_file(target: str | os.PathLike) -> Iterator[Path]:
    """Write the file `target` all at once, as `staged_folder` writes a folder: yield a new empty hidden file beside
    it, `.NAME.partial-XXXXXXXX`, which replaces `target` in one rename when the block ends (a reader finds the old
    file or the new one) and is deleted when it raises, leaving `target` as it was. The new file has the target's
    permissions, or a new file's (the umask's)."""
    target = Path(target).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging_path(target)
    staging.touch(mode=0o666, exist_ok=False)  # the umask applies, as to any new file (mkstemp's would be private)
    if target.is_file():
        shutil.copymode(target, staging)
    try:
        yield staging
        os.replace(staging, target)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def _staging_path(target: Path) -> Path:
    """A new hidden name beside `target`, on its file system, where one rename puts it in the target's place."""
    return target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")


def _new_staging_folder(target: Path) -> Path:
    """A new empty folder `.NAME.partial-XXXXXXXX` next to `target`, so on its file system, where a rename can put it.

    It has the target's permissions, or a new folder's (the umask's) if there is no target yet. Raises `OSError` where
    no folder can be renamed into the target's place: the target is a mount point, or its parent is not writable.
    """
    if os.path.ismount(target):
        raise OSError(f"{target} is a mount point: no folder can be renamed into its place")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging_path(target)
    staging.mkdir(mode=0o777)  # the umask applies, as to any new folder (tempfile.mkdtemp's would be private)
    if target.is_dir():
        shutil.copymode(target, staging)
    return staging


def _replace_folder(staging: Path, target: Path) -> None:
    """Put the complete folder `staging` in `target`'s place, and delete the old `target`.

    A reader sees the old folder or the new one, never a mix, and never no folder: on Linux the two swap in one step
    (renameat2 with RENAME_EXCHANGE), after which `staging` holds the old folder and is deleted. Where the system or
    the file system cannot swap, it takes two renames, the old folder to a hidden `.NAME.old-XXXXXXXX` and then
    `staging` to `target` (a rename cannot replace a folder that is not empty); for the instant between them there is
    no `target`, and a process killed in that instant leaves the old folder whole under the hidden name.
    """
    if not target.exists():
        staging.rename(target)
        return
    try:
        cwd = Path.cwd()
    except FileNotFoundError:  # the process's folder was deleted: it is not in `target`
        cwd = None
    if _exchange(staging, target):
        old = staging
    else:
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        target.rename(old)
        try:
            staging.rename(target)
        except BaseException:
            old.rename(target)
            raise
    if cwd is not None and (cwd == target or target in cwd.parents):
        os.chdir(cwd if cwd.is_dir() else target)  # the process stood in the old folder, which goes now: step across
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:  # an export replaces whatever stood at its path, a file too
        old.unlink()


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # from Linux's <fcntl.h> and <linux/fs.h>


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step where the system can: Linux's renameat2(RENAME_EXCHANGE), on a file system that
    takes it. False, with nothing changed, where it cannot (another system, a C library without renameat2, a file
    system without the flag)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28 and newer
    except AttributeError:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def _carry_over(old: Path, new: Path, keep: Callable[[str], bool]) -> None:
    """Give `new` every entry of `old` that `keep` accepts by name and `new` does not have."""
    if not old.is_dir():
        return
    for entry in old.iterdir():
        destination = new / entry.name
        if destination.exists() or destination.is_symlink() or not keep(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, destination, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, destination)


def _link_or_copy(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """A hard link (no data copied, and a file a process keeps open, a Trainer's log, stays the file it writes), or a
    copy on a file system without them. Symbolic links are copied as links."""
    if not os.path.islink(source):
        try:
            os.link(source, destination)
            return
        except OSError:
            pass
    shutil.copy2(source, destination, follow_symlinks=False)


# ---------------------------------------------------------------------------------------------------------------------
# Damaged checkpoints


def weights_damage(folder: str | os.PathLike) -> str | None:
    """What is wrong with the safetensors files of the local folder `folder`, as an error message naming each damaged
    file and its problem; None where every file is whole, or `folder` is not a local folder."""
    folder = Path(str(folder))
    if not folder.is_dir():
        return None
    damaged = [
        f"{file.name} ({problem})"
        for file in sorted(folder.glob("*.safetensors"))
        if (problem := _safetensors_problem(file))
    ]
    if not damaged:
        return None
    return f"{folder}: damaged weights file {'; '.join(damaged)}. Save or download it again."


def _safetensors_problem(file: Path) -> str | None:
    """Why a safetensors file cannot be whole (None if its header and size agree): an 8-byte header length, a JSON
    header, then exactly the bytes its offsets cover. A save or download cut short leaves fewer."""
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"{size} bytes, no header: truncated"
        header_length = int.from_bytes(prefix, "little")
        if 8 + header_length > size:
            return f"{size} bytes, shorter than its {header_length}-byte header: truncated"
        try:
            header = json.loads(f.read(header_length))
        except ValueError:
            return "unreadable header: not a safetensors file"
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + header_length + end != size:
        return f"{size} bytes where its header describes {8 + header_length + end}: truncated"
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Remote code


def repair_remote_code(folder: Path, generated_class: type, code_file: str, auto_map: dict[str, str]) -> None:
    """Give a folder saved from `generated_class`, a subclass of an hf_tfm model that torch generated, hf_tfm's code.

    Native FSDP2 (`DistributedConfig(fsdp_size=...)`) swaps a model's class for one generated in torch
    (`FSDPTfmForCausalLM`); transformers then points `auto_map` at torch's `_fsdp_*.py` files, copies those and leaves
    ours out. Here torch's files go, `code_file` (the model's `modeling.py`) and every file it imports relatively
    come in, and `config.json`'s `auto_map` takes `auto_map`'s entries.
    """
    own_files = [code_file, *get_relative_import_files(code_file)]
    own_names = {Path(own).name for own in own_files}
    foreign = sys.modules[generated_class.__module__].__file__
    for file in [foreign, *get_relative_import_files(foreign)]:
        if Path(file).name not in own_names:
            (folder / Path(file).name).unlink(missing_ok=True)
    for file in own_files:
        shutil.copyfile(file, folder / Path(file).name)
    config_file = folder / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        config["auto_map"] = {**config.get("auto_map", {}), **auto_map}
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
