# Two entry points that work from a clean clone: `make demo` (the main job) and `make test`.
# Each creates the virtual environment in .venv when it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0

.PHONY: demo test lint env

env: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hf-tfm demo $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
