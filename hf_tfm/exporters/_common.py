"""What the runtime exporters share: a folder written beside its destination, the tokenizer's files, the verifying
prompts, hf_tfm's greedy references, the runtime's side of a verification (in a fresh process) and the greedy-token
comparison."""

import json
import os
import pickle
import shutil
import subprocess
import sys
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
# The encoder classes an export runs as one forward of a padded batch (features or a task head's outputs)
ENCODER_CLASSES = (
    "TfmModel",
    "TfmMoeModel",  # the backbone with experts (`TfmModel(config)` builds one)
    "TfmForSequenceClassification",
    "TfmForTokenClassification",
    "TfmForQuestionAnswering",
    "TfmForMaskedLM",
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

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, trust_remote_code=False)  # runs no folder code
    return [tokenizer(text)["input_ids"] for text in prompts or DEFAULT_PROMPTS]


def token_agreement(reference: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """`tokens_equal` (every sequence) and `agreement` (the share of the reference's positions with equal tokens; a
    runtime's sequence that stopped early counts its missing tokens as unequal)."""
    total = sum(len(r) for r in reference)
    equal = sum(a == b for r, t in zip(reference, theirs, strict=True) for a, b in zip(r, t, strict=False))
    return {"tokens_equal": reference == theirs, "agreement": equal / total if total else 1.0}


def eos_ids(config: Any) -> list[int]:
    """The config's end-of-sequence ids as a list (empty when it has none): what verification suppresses."""
    eos = config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def greedy_references(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_tfm's greedy `generate()` on each prompt alone, exactly `max_new_tokens` new tokens (EOS suppressed until
    then): the sequences a runtime's tokens and logits are checked against. A causal LM's start with the prompt, an
    encoder-decoder's with the decoder's start token."""
    import torch

    references = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=model.config.pad_token_id,
            )
            references.append(out[0].tolist())
    return references


def new_tokens(references: list[list[int]], prompts: list[list[int]], seq2seq: bool) -> list[list[int]]:
    """The generated part of each reference: after the prompt, or (encoder-decoder) after the decoder's start."""
    return [ref[1 if seq2seq else len(prompt) :] for ref, prompt in zip(references, prompts, strict=True)]


def run_side(
    source: str,
    args: dict[str, Any],
    fresh_process: bool,
    runtime: str,
    blocked: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    python: str | None = None,
) -> Any:
    """`run(args)` of the program `source`: the runtime's side of a verification.

    In a fresh interpreter by default, where each module in `blocked` cannot be imported (what runs is what a
    deployment without it runs) and no OpenMP runtime but the runtime's own is loaded (two in one process slow each
    other down); `args` go in as JSON on stdin, the result comes back pickled (lists, or tensors where the side has
    torch). `python` is that interpreter (default: this one's). `fresh_process=False` runs it here. A failing side
    raises `RuntimeError` naming `runtime` and its error.
    """
    if not fresh_process:
        namespace: dict = {}
        exec(source, namespace)
        return namespace["run"](args)
    with tempfile.TemporaryDirectory(prefix="hf_tfm_verify_") as tmp:
        result_file = Path(tmp) / "result.pkl"
        block = "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
        code = (
            f"import sys\n{block}{source}\nimport json as _json, pickle as _pickle\n"
            f"with open({str(result_file)!r}, 'wb') as _file:\n"
            "    _pickle.dump(run(_json.loads(sys.stdin.read())), _file)\n"
        )
        done = subprocess.run(
            [python or sys.executable, "-c", code],
            input=json.dumps(args),
            capture_output=True,
            text=True,
            env=None if env is None else {**os.environ, **env},
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{runtime} failed on {args['path']}: {done.stderr.strip()[-2000:]}")
        with result_file.open("rb") as file:
            return pickle.load(file)  # written just now by our own child process


def run_program(program: Path, args: dict[str, Any], runtime: str, python: str | None = None) -> Any:
    """Run a runtime-side program file by path in a process of its own (`python`: default this one's interpreter):
    `args` go in as JSON on stdin, the program writes its JSON result to the file named by its one argument. A failing
    program raises `RuntimeError` naming `runtime` and its error."""
    with tempfile.TemporaryDirectory(prefix="hf_tfm_verify_") as tmp:
        result_file = Path(tmp) / "result.json"
        done = subprocess.run(
            [python or sys.executable, str(program), str(result_file)],
            input=json.dumps(args),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0 or not result_file.is_file():
            raise RuntimeError(f"{runtime} failed on {args['path']}: {done.stderr.strip()[-2000:]}")
        return json.loads(result_file.read_text(encoding="utf-8"))


def forced_agreement(ours: list, theirs: list, prompts: list[list[int]], seq2seq: bool, max_new_tokens: int) -> float:
    """The share of the generated positions where the runtime's most likely token is hf_tfm's, both reading hf_tfm's
    greedy sequence (teacher-forced): unlike the greedy `agreement`, one flipped near-tie does not also count every
    later token of its sequence as unequal. `ours` / `theirs`: each reference's logits (T, V), from its first row
    (a causal LM's start with the prompt's, an encoder-decoder's with the decoder start token's)."""
    import torch

    equal = total = 0
    for mine, other, prompt in zip(ours, theirs, prompts, strict=True):
        start = 0 if seq2seq else len(prompt) - 1  # the row that chose the first new token
        rows = slice(start, start + max_new_tokens)
        equal += int((mine[rows].argmax(-1) == torch.as_tensor(other)[rows].argmax(-1)).sum())
        total += max_new_tokens
    return equal / total if total else 1.0


def agreement_report(
    ours: list, theirs: dict, references: list[list[int]], prompts: list[list[int]], seq2seq: bool, max_new_tokens: int
) -> dict[str, Any]:
    """What every `verify_*` reports of the runtime's side `theirs` (its "tokens" and "logits") against hf_tfm's
    greedy `references` and their logits `ours`: greedy and teacher-forced agreement and the largest logit
    difference."""
    import torch

    logits = theirs["logits"]
    return {
        **token_agreement(new_tokens(references, prompts, seq2seq), theirs["tokens"]),
        "forced_agreement": forced_agreement(ours, logits, prompts, seq2seq, max_new_tokens),
        "max_logit_diff": max(float((a - torch.as_tensor(b)).abs().max()) for a, b in zip(ours, logits, strict=True)),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
    }


def encoder_max_diff(model: Any, prompts: list[list[int]], theirs: dict[str, list], where: Any) -> float:
    """The largest difference between a runtime's encoder outputs (`theirs`: name -> one row per prompt, run as one
    padded batch) and the model's on each prompt alone; per-token outputs compared on the prompt's own positions."""
    import torch

    diff = 0.0
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            ours = model(input_ids=ids, attention_mask=torch.ones_like(ids))
            for name, values in theirs.items():
                if name not in ours:
                    raise RuntimeError(f"{where}: the export returns {name!r}, the model does not.")
                mine, other = ours[name][0].float(), torch.tensor(values[row])
                if mine.dim() and mine.shape[0] == len(prompt):  # per token: the prompt's own positions
                    other = other[: len(prompt)]
                diff = max(diff, float((mine - other).abs().max()))
    return diff
