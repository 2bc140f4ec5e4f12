#!/usr/bin/env bash
# A one-shot validation of kvpress-critical on a GPU node, offline: correctness against the references, the kernels'
# speed, the compact cache end to end. Where there is network, prepare the Python packages the node may lack with
# benchmarks/gpu_wheels.sh (into .whl/), copy the repository (with .whl/) to the node, then run there:
#
#   benchmarks/gpu_check.sh [results_dir]      results_dir: default outputs/gpu-check
#   DRY_RUN=1 benchmarks/gpu_check.sh DIR      walk every step on a CPU machine with tiny sizes (tests this script;
#                                              `make gpu-check-dry-run`, and tests/benchmarks/test_gpu_check.py)
#
# Requirements on the node: an NVIDIA GPU, Python with a CUDA build of torch (and Triton, which comes with it), nvcc
# for the CUDA kernels (without it the CPU kernels are compiled and the Triton and torch backends still run).
# Environment: PY (python; default .venv/bin/python if present, else python3), WHEELS (default .whl: installed with
# --no-index into a private target so that kvpress imports; without them the end-to-end steps are skipped, every op
# step still runs), BUDGET_S (default 470: the steps' limits are cut to fit a time budget).
#
# Steps, most informative first; each has its own time limit, one failing or timing out never stops the next, and
# its results are collected as soon as it ends (a run cut short keeps every step it finished). The results are six
# files, easy to copy back from the node: gpu_check.log (everything), steps.tsv (step, exit status, seconds),
# smoke.jsonl, tables.md (every benchmark table), tests.xml (junit), raw.tar (CSV / JSON of every step).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=${DRY_RUN:-0}
RESULTS=${1:-outputs/gpu-check}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
WHEELS=${WHEELS:-.whl}
BUDGET_S=${BUDGET_S:-470}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)  # per-step outputs, collected into the results folder
: > "$RESULTS/steps.tsv"
: > "$RESULTS/tables.md"
exec > >(tee "$RESULTS/gpu_check.log") 2>&1

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1 KVPRESS_CRITICAL_BUILD_CUDA=0
  DEVICE=cpu
else
  DEVICE=cuda
fi
status=0
START=$(date +%s)

collect() {  # collect STEP: its markdown tables into tables.md, everything it wrote into raw.tar
  local dir=$WORK/$1
  [ -d "$dir" ] || return 0
  for md in "$dir"/*.md; do
    [ -f "$md" ] && { printf '\n<!-- %s: %s -->\n' "$1" "$(basename "$md")"; cat "$md"; } >> "$RESULTS/tables.md"
  done
  if [ -n "$(ls -A "$dir")" ]; then tar -rf "$RESULTS/raw.tar" -C "$WORK" "$1"; fi
}

step() {  # step NAME LIMIT_S COMMAND... : run with a time limit (cut to what is left of BUDGET_S), record, collect
  local name=$1 limit=$2
  shift 2
  # a dry run checks the logic on a CPU that may be shared (CI runs test files side by side): limits x4
  [ "$DRY" = 1 ] && limit=$(( limit * 4 ))
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  [ "$limit" -gt "$left" ] && limit=$left
  echo
  echo "=== $name (limit ${limit} s, $(date +%H:%M:%S))"
  mkdir -p "$WORK/$name"
  local t0 rc
  t0=$(date +%s)
  if [ "$limit" -lt 5 ]; then
    echo "skipped: the time budget ($BUDGET_S s) is spent"
    rc=124
  else
    # a step is a shell function or a command: run it in a child bash (exported functions) under timeout
    STEP_DIR=$WORK/$name timeout --signal=INT --kill-after=10 "$limit" bash -c '"$@"' step "$@"
    rc=$?
  fi
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$RESULTS/steps.tsv"
  [ "$rc" -eq 0 ] || status=1
  collect "$name"
  return 0
}

preflight() {
  nvidia-smi || echo "(no nvidia-smi)"
  "$PY" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "triton", "transformers", "tokenizers", "kvpress", "flash_attn", "bitsandbytes"):
    try:
        module = importlib.import_module(name)
        print(f"{name:14s}", getattr(module, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(f"{name:14s} not importable ({type(e).__name__}: {str(e)[:80]})")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF
  command -v nvcc >/dev/null && nvcc --version | tail -1
}

install_wheels() {  # the carried wheels into a private target, first on PYTHONPATH (dry run: a throwaway target)
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "no wheels in $WHEELS (benchmarks/gpu_wheels.sh makes them): end-to-end steps need kvpress"
    return 0
  fi
  local target=/tmp/gpu_check_site
  rm -rf "$target"
  local extra=()
  # here (dry run) the interpreter is not the GPU node's Python: check that the set installs for it
  [ "$DRY" = 1 ] && extra=(--python-version "${GPU_PYTHON:-3.12}" --only-binary=:all: --implementation cp)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
    "${extra[@]}" "$WHEELS"/*.whl || return 1
  ls "$target" | grep -c dist-info | xargs echo "installed distributions:"
  if [ "$DRY" != 1 ]; then
    echo "export PYTHONPATH=$target:\$PYTHONPATH" > "$WORK/env.sh"  # read by the main shell after this step
    PYTHONPATH="$target:$PYTHONPATH" "$PY" -c \
      "import kvpress, transformers; print('kvpress imports; transformers', transformers.__version__)"
  fi
}

build() {
  if [ "$DRY" = 1 ]; then
    "$PY" kvpress_critical/ops/extension.py && return 0
  fi
  # CUDA first; a CUDA build failure falls back to the CPU-only extension (Triton and torch backends still run)
  KVPRESS_CRITICAL_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} "$PY" kvpress_critical/ops/extension.py \
    || { echo "CUDA build failed: building the CPU extension only"; KVPRESS_CRITICAL_BUILD_CUDA=0 "$PY" kvpress_critical/ops/extension.py; }
  "$PY" -c "from kvpress_critical import available_backends; print('available on cuda:', available_backends('cuda'))"
}

kvpress_importable() { "$PY" -c "import kvpress" >/dev/null 2>&1; }

bench() {  # bench SCRIPT ARGS...: a benchmark writing its tables into the step folder
  local script=$1
  shift
  if [ ! -f "benchmarks/$script" ]; then echo "benchmarks/$script does not exist in this version"; return 0; fi
  "$PY" "benchmarks/$script" --device "$DEVICE" --out-dir "$STEP_DIR" "$@"
}

tests() {
  local files=(tests/ops tests/presses/test_quantized_o_proj.py)
  if kvpress_importable; then
    files+=(tests/presses/test_backends_in_presses.py tests/cache/test_compact_cache.py)
  else
    echo "kvpress not importable: press-level tests are not run"
  fi
  local select=()
  # dry run: the GPU-marked tests of one file (they skip on CPU); the main suite runs every file on CPU anyway
  [ "$DRY" = 1 ] && { select=(-m gpu); files=(tests/ops/test_projected_value_norm.py); }
  "$PY" -m pytest -q -rs -p no:cacheprovider "${select[@]}" "${files[@]}" --junitxml="$RESULTS/tests.xml"
}

spills() {  # registers and spills of the compiled Triton kernels, as ptxas reports them (ahead of time)
  local archs=90
  [ "$DRY" = 1 ] || archs=80,90
  env -u TRITON_INTERPRET "$PY" -m kvpress_critical.ops.triton_aot --arch "$archs" | tee "$STEP_DIR/spills.jsonl"
  [ "$DRY" = 1 ] ||  # the ragged attention's cases (each on its own architectures; the test suite runs them too)
    env -u TRITON_INTERPRET "$PY" -m kvpress_critical.ops.triton_aot --op ragged_attention | tee -a "$STEP_DIR/spills.jsonl"
}

if [ "$DRY" = 1 ]; then  # the same steps at sizes a CPU does in seconds (the logic is what is checked)
  LLAMA=smollm; T16=64; T32=128; REP=1; SMOKE_T=16; REST="--models smollm --tokens 64"; QUICK=--quick
  COMPACT_MODEL=config:tiny  # Llama-shaped, 2 layers: an 8B-shaped model's 4 GB of random embeddings take minutes
else
  LLAMA=llama; T16=4096; T32=32768; REP=5; SMOKE_T=1000; REST="--models qwen,smollm --tokens 4096,32768"; QUICK=
  COMPACT_MODEL=config:llama-3.1-8b
fi
export ROOT DRY RESULTS PY WHEELS DEVICE WORK
export -f preflight install_wheels build kvpress_importable bench tests spills

step preflight 30 preflight
step wheels 30 install_wheels
if [ -f "$WORK/env.sh" ]; then source "$WORK/env.sh"; fi
[ -n "${GPU_CHECK_WHEELS_ONLY:-}" ] && { echo "wheels checked"; exit $status; }
step build 150 build
step smoke 45 "$PY" benchmarks/gpu_smoke.py --device "$DEVICE" --tokens "$SMOKE_T" --out "$RESULTS/smoke.jsonl"
step bench_llama_16bit 90 bench bench_projected_norm.py --no-cpu-peak --models $LLAMA --dtypes bfloat16,float16 \
  --tokens "$T16,$T32" --repeats "$REP" --memory-max-tokens "$T32"
step spills 30 spills
step tests 100 tests
step bench_llama_fp32 45 bench bench_projected_norm.py --no-cpu-peak --models $LLAMA --dtypes float32 --tokens "$T16,$T32" \
  --repeats "$REP" --memory-max-tokens 0
step bench_other_shapes 40 bench bench_projected_norm.py --no-cpu-peak $REST --dtypes bfloat16 --repeats "$REP" --memory-max-tokens 0
step bench_ragged_attention 40 bench bench_ragged_attention.py --repeats "$REP" $QUICK
if kvpress_importable; then
  step bench_compact_cache 45 bench bench_compact_cache.py --model "$COMPACT_MODEL" --repeats "$REP" $QUICK \
  --layouts pruning,masking,compact,compact-int8,compact-int4,compact-kivi4
else
  echo "kvpress not importable: the end-to-end compact-cache benchmark is skipped"
fi

echo
echo "=== done: status $status after $(( $(date +%s) - START )) s, results in $RESULTS"
cat "$RESULTS/steps.tsv"
rm -rf "$WORK"
exit $status
