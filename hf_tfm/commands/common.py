"""What several `hf-tfm` commands share: the one-line error, `--trust-remote-code`, the checks on a model folder."""

import json
from pathlib import Path
from typing import Any


class CliError(Exception):
    """A problem with the user's request, reported as one line and exit status 1."""


TRUST_REMOTE_CODE_HELP = (
    "run the Python code a model folder or Hub repository ships (its auto_map), as transformers' "
    "trust_remote_code=True: only for code you trust. Not needed for hf_tfm's own folders (hf_tfm's installed classes "
    "load them)"
)


def add_trust_remote_code(p: Any, help: str = TRUST_REMOTE_CODE_HELP) -> None:
    """`--trust-remote-code` (default off) on a parser or argument group of a command that loads a model folder or Hub
    id: transformers' `trust_remote_code`, which the command passes to every `AutoConfig` / `AutoTokenizer` /
    `AutoModel*` load."""
    p.add_argument("--trust-remote-code", action="store_true", help=help)


def is_consent_error(err: BaseException) -> bool:
    """transformers' refusal to run a folder's code without `trust_remote_code` (a ValueError that asks for it)."""
    return isinstance(err, ValueError) and "trust_remote_code=True" in str(err)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model folder or Hub id; a folder without one is a `CliError`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        if is_consent_error(err):
            raise  # the folder has a tokenizer, whose code needs consent: transformers' own words say so
        raise CliError(f"{path}: no usable tokenizer in this model folder ({err})") from err


def require_model_dir(path: str) -> Path:
    """`path` as a folder holding a `config.json`; anything else is a `CliError`."""
    folder = Path(path)
    if not folder.is_dir():
        raise CliError(f"{path}: no such model folder")
    if not (folder / "config.json").is_file():
        raise CliError(f"{path}: not a model folder (no config.json)")
    return folder


def refuse_folder_code(path: str | Path) -> None:
    """Refuse, with transformers' ValueError, a folder that only the code it ships can load (an `auto_map` and a model
    type no installed class knows). `convert` and `export` use hf_tfm's and transformers' installed classes only; left
    to their loads (`trust_remote_code` unset), transformers would ask on the terminal whether to run that code."""
    try:
        ships_code = "auto_map" in json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return  # a Hub id, or no readable config: the command's own loading reports what it finds
    if ships_code:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path, trust_remote_code=False)  # hf_tfm's own folders: its registered classes
