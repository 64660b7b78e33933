#!/usr/bin/env python
"""Benchmark hf_tfm against transformers' in-tree models, under each weight setting, and in other runtimes.

The entry point of the `benchmark` package beside it (scripts/benchmark/: what each run measures, and how), which
this file's folder puts first on the import path: ``python scripts/bench.py --help``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: the package

from benchmark import main

if __name__ == "__main__":
    main()
