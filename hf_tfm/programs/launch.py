"""The entry of every program's process (`hf_tfm.programs.run_program`), run by path:

    python launch.py PROGRAM RESULT [BLOCKED ...] < args.json

It makes each BLOCKED module unimportable, runs PROGRAM (a file's path, or an installed module's dotted name), calls
its `run(args)` and pickles the result to RESULT. Standard library only: it runs in Pythons without hf_tfm, torch or
transformers.
"""

import importlib
import json
import pickle
import runpy
import sys
from pathlib import Path

# Run by path, this folder comes first on sys.path: a program's `import x` must find the installed x, never a file here
HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]


def main() -> None:
    program, result, *blocked = sys.argv[1:]
    for name in blocked:
        sys.modules[name] = None  # `import name` now raises ImportError, as where it is not installed
    if program.endswith(".py"):
        run = runpy.run_path(program, run_name="hf_tfm_program")["run"]
    else:  # an installed module: imported as usual, its package's __init__ first
        run = importlib.import_module(program).run
    output = run(json.load(sys.stdin))
    with open(result, "wb") as file:
        pickle.dump(output, file)


if __name__ == "__main__":
    main()
