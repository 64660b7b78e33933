"""Programs that run in a process of their own, by path, and the one way hf_tfm starts a process (`run_program`,
`start_program`).

Each module here but this one is such a program: the runtime's side of an export's verification (`*_side.py`, some
also copied beside an export as its runner) or the check that a saved folder loads where hf_tfm cannot be imported
(`standalone_generate.py`). A program imports nothing of hf_tfm, and some run where torch or transformers must not be
imported, or in another Python (llama.cpp's). Each defines `run(args) -> result`; `launch.py` is the entry of its
process: it hides the modules the caller blocks, reads `args` as JSON on stdin and writes the result, pickled, to the
file the caller reads. `run_program` also runs the same kind of program from elsewhere: a file by its path (the
benchmark's worker) or an installed module by its name (`hf_tfm.calibration`, in llm-compressor's environment).
"""

import atexit
import importlib
import json
import os
import pickle
import runpy
import shutil
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


class ProgramRun:
    """A program started by `start_program`, running in a process of its own: `done()` says whether it has ended,
    `result()` waits for it and returns `run(args)`'s result, `cancel()` ends it. Its output goes to files, so a
    program that prints much never blocks on a pipe nobody reads."""

    def __init__(
        self, program: str, args: dict[str, Any], runtime: str, python: str, blocked: tuple[str, ...], env
    ) -> None:
        self.runtime, self.what = runtime, args.get("path", program)
        self._folder = Path(tempfile.mkdtemp(prefix="hf_tfm_program_"))
        self._result = self._folder / "result.pkl"
        command = [python, str(LAUNCHER), program, str(self._result), *blocked]
        with (self._folder / "stdout").open("w") as out, (self._folder / "stderr").open("w") as err:
            self._process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=out, stderr=err, text=True, env=env
            )
        self._process.stdin.write(json.dumps(args))
        self._process.stdin.close()
        # A program may outlive this process (a compile that stores its result for the next one): its output goes then
        atexit.register(shutil.rmtree, self._folder, True)

    def done(self) -> bool:
        return self._process.poll() is not None

    def result(self, timeout: float | None = None) -> Any:
        """The program's result, once it has ended. A failing program raises `RuntimeError` naming the runtime, what
        it ran on (`args["path"]`) and its error; one still running after `timeout` seconds is ended and raises
        `subprocess.TimeoutExpired`."""
        try:
            code = self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cancel()
            raise
        try:
            if code != 0 or not self._result.is_file():
                stderr = (self._folder / "stderr").read_text(errors="replace").strip()
                raise RuntimeError(f"{self.runtime} failed on {self.what}: {stderr[-2000:]}")
            with self._result.open("rb") as file:
                return pickle.load(file)  # written just now by our own child process
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)

    def cancel(self) -> None:
        """End the program (if it still runs) and forget its output."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)


def start_program(
    program: str | os.PathLike,
    args: dict[str, Any],
    runtime: str,
    *,
    python: str | None = None,
    blocked: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> ProgramRun:
    """Start `run(args)` of `program` (named as `run_program` names it) in a process of its own and return at once:
    run by `python` (default: this interpreter), where each module in `blocked` cannot be imported (what runs is what
    a deployment without it runs), with `env` added to this environment. `args` go in as JSON, the result comes back
    pickled (lists, arrays, or tensors where the program has torch)."""
    environment = None if env is None else {**os.environ, **env}
    return ProgramRun(_program(program), args, runtime, python or sys.executable, blocked, environment)


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
    """`run(args)` of `program`, waited for: `start_program(...).result(timeout)`. `fresh_process=False` runs it here
    instead, for tests (nothing blocked).

    `program` is one of this folder's programs by name (`"onnxruntime_side"`), a program file elsewhere by its path
    (an `os.PathLike`), or an installed module by its dotted name (`"hf_tfm.calibration"`), imported as usual in the
    process, its package first. A failing program raises `RuntimeError` naming `runtime`, `args["path"]` and its
    error; one that runs past `timeout` seconds, `subprocess.TimeoutExpired`.
    """
    if not fresh_process:
        target = _program(program)
        if target.endswith(".py"):
            return runpy.run_path(target)["run"](args)
        return importlib.import_module(target).run(args)
    return start_program(program, args, runtime, python=python, blocked=blocked, env=env).result(timeout)


__all__ = ["ProgramRun", "program_path", "run_program", "start_program"]
