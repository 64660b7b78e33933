#!/usr/bin/env python
"""Benchmark hf_tfm against transformers' in-tree models, under each weight setting, and in other runtimes.

The entry point of the `bench` package beside it (scripts/bench/: what each run measures, and how), which this
file's folder puts first on the import path: ``python scripts/bench.py --help``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: the package, and the runtimes' worker

from bench import main  # the package, scripts/bench/, not this file: a package wins over a module of its name

if __name__ == "__main__":
    main()
