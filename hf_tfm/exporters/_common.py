"""What the runtime exporters share: a folder written beside its destination, the tokenizer's files, the verifying
prompts and the greedy-token comparison."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
# Two texts of different lengths: `verify`'s prompts when none are given
DEFAULT_PROMPTS = ("def main():\n    ", 'import os\nimport sys\n\n\nclass Config:\n    """Return the')


@contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out` to write an export into. When the block ends it replaces `out` (an earlier
    export is moved out of the way first and deleted once the new one is in); when it raises, it is deleted and `out`
    is untouched: a failed export leaves nothing."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_tokenizer(source: str | None, tokenizer: Any, folder: Path) -> None:
    """Put the tokenizer's files in `folder`: `tokenizer` (a tokenizer, its folder or its tokenizer.json), else the
    model folder `source`'s; nothing when there is neither."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        tokenizer.save_pretrained(folder)
        return
    where = Path(tokenizer) if tokenizer is not None else (Path(source) if source else None)
    if where is None:
        return
    if where.is_file():  # a tokenizer.json
        shutil.copy(where, folder / "tokenizer.json")
        return
    for name in TOKENIZER_FILES:
        if (where / name).is_file():
            shutil.copy(where / name, folder / name)


def prompt_ids(prompts: list[list[int]] | list[str] | None, tokenizer_folder: str | os.PathLike | None) -> list:
    """`prompts` as token ids: ids as given, texts (None: `DEFAULT_PROMPTS`) through the folder's tokenizer."""
    if prompts and not isinstance(prompts[0], str):
        return [list(map(int, prompt)) for prompt in prompts]
    if tokenizer_folder is None:
        raise ValueError("text prompts need the model's folder (its tokenizer): pass token ids.")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    return [tokenizer(text)["input_ids"] for text in prompts or DEFAULT_PROMPTS]


def token_agreement(reference: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """`tokens_equal` (every sequence) and `agreement` (the share of the reference's positions with equal tokens; a
    runtime's sequence that stopped early counts its missing tokens as unequal)."""
    total = sum(len(r) for r in reference)
    equal = sum(a == b for r, t in zip(reference, theirs, strict=True) for a, b in zip(r, t, strict=False))
    return {"tokens_equal": reference == theirs, "agreement": equal / total if total else 1.0}
