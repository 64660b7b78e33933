"""Programs that run in a process of their own, by path, and the one way hf_tfm starts a process (`run_program`).

Each module here but this one is such a program: the runtime's side of an export's verification (`*_side.py`, some
also copied beside an export as its runner) or the check that a saved folder loads where hf_tfm cannot be imported
(`standalone_generate.py`). A program imports nothing of hf_tfm, and some run where torch or transformers must not be
imported, or in another Python (llama.cpp's). Each defines `run(args) -> result`; `launch.py` is the entry of its
process: it hides the modules the caller blocks, reads `args` as JSON on stdin and writes the result, pickled, to the
file the caller reads. `run_program` also runs the same kind of program from elsewhere: a file by its path (the
benchmark's worker) or an installed module by its name (`hf_tfm.calibration`, in llm-compressor's environment).
"""

import importlib
import json
import os
import pickle
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "launch.py"


def program_path(name: str) -> Path:
    """The file of the program `name` (`"onnxruntime_side"` -> `.../programs/onnxruntime_side.py`)."""
    path = HERE / f"{name}.py"
    if not path.is_file() or path == LAUNCHER or name.startswith("_"):
        raise ValueError(f"{name!r} is not one of hf_tfm's programs ({HERE}).")
    return path


def _program(program: str | os.PathLike) -> str:
    """What `launch.py` runs: a file's absolute path, or a module's dotted name."""
    if isinstance(program, os.PathLike):
        path = Path(program).resolve()
        if not path.is_file():
            raise ValueError(f"{program}: no such program file.")
        return str(path)
    return program if "." in program else str(program_path(program))


def run_program(
    program: str | os.PathLike,
    args: dict[str, Any],
    runtime: str,
    *,
    fresh_process: bool = True,
    python: str | None = None,
    blocked: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> Any:
    """`run(args)` of `program`, in a process of its own by default: run by `python` (default: this interpreter),
    where each module in `blocked` cannot be imported (what runs is what a deployment without it runs), with `env`
    added to this environment. `args` go in as JSON, the result comes back pickled (lists, arrays, or tensors where
    the program has torch). `fresh_process=False` runs it here, for tests (nothing blocked).

    `program` is one of this folder's programs by name (`"onnxruntime_side"`), a program file elsewhere by its path
    (an `os.PathLike`), or an installed module by its dotted name (`"hf_tfm.calibration"`), imported as usual in the
    process, its package first. A failing program raises `RuntimeError` naming `runtime`, `args["path"]` and its
    error; one that runs past `timeout` seconds, `subprocess.TimeoutExpired`.
    """
    target = _program(program)
    if not fresh_process:
        if target.endswith(".py"):
            return runpy.run_path(target)["run"](args)
        return importlib.import_module(target).run(args)
    with tempfile.TemporaryDirectory(prefix="hf_tfm_program_") as tmp:
        result_file = Path(tmp) / "result.pkl"
        done = subprocess.run(
            [python or sys.executable, str(LAUNCHER), target, str(result_file), *blocked],
            input=json.dumps(args),
            capture_output=True,
            text=True,
            env=None if env is None else {**os.environ, **env},
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0 or not result_file.is_file():
            raise RuntimeError(f"{runtime} failed on {args['path']}: {done.stderr.strip()[-2000:]}")
        with result_file.open("rb") as file:
            return pickle.load(file)  # written just now by our own child process


__all__ = ["program_path", "run_program"]
