#!/usr/bin/env bash
# GPU checks of kvpress-critical, in one go, on a machine with an NVIDIA GPU and a CUDA build of torch:
#   1. build the C++/CUDA extension with CUDA required (KVPRESS_CRITICAL_BUILD_CUDA=1), and compile-check csrc/*.cu;
#   2. run the backend tests (the GPU-only ones run here: CUDA kernels and compiled Triton over the full grid);
#   3. run both benchmarks on the GPU (bf16 and fp32 layer shapes up to 32K tokens; SmolLM2 prefill);
# and write logs and tables to a results folder.
#
# Usage: benchmarks/gpu_check.sh [results_dir]
#   results_dir defaults to $OUT/gpu_check when $OUT is set, else benchmarks/results/gpu.
#   PY=/path/to/python selects the interpreter (default: .venv/bin/python if present, else python).
#   QUICK=1 shortens the benchmarks (4K and 16K tokens, 3 repeats).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-${OUT:+$OUT/gpu_check}}
RESULTS=${RESULTS:-benchmarks/results/gpu}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/gpu_check.log") 2>&1
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() { echo; echo "=== $* ($(date +%H:%M:%S))"; }

step "environment"
nvidia-smi || true
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(), \
torch.cuda.get_device_capability())" || exit 1

step "build the extension with CUDA"
KVPRESS_CRITICAL_BUILD_CUDA=1 "$PY" kvpress_critical/ops/build_extension.py || exit 1
"$PY" -c "from kvpress_critical.ops import available_backends; print('available on cuda:', available_backends('cuda'))"

step "nvcc compile check (sm_80, sm_90)"
bash csrc/check_cuda.sh "$PY" || status=1

step "backend tests (GPU cases included)"
"$PY" -m pytest -q -rs tests/test_backends.py tests/test_triton.py tests/test_cpp_extension.py \
  --junitxml="$RESULTS/tests.xml" || status=1

if [ "${QUICK:-0}" = 1 ]; then tokens=4096,16384; repeats=3; else tokens=4096,16384,32768; repeats=5; fi
step "projected-norm benchmark"
"$PY" benchmarks/bench_projected_norm.py --device cuda --dtypes bfloat16,float32 --tokens "$tokens" \
  --repeats "$repeats" --memory-max-tokens 32768 --out-dir "$RESULTS" || status=1

step "prefill benchmark (SmolLM2)"
"$PY" benchmarks/bench_prefill.py --device cuda --repeats "$repeats" --out-dir "$RESULTS" || status=1

step "done: status $status, results in $RESULTS"
ls -l "$RESULTS"
exit $status
