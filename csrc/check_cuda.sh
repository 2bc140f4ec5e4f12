#!/usr/bin/env bash
# Compile-check the CUDA side of the extension on a machine with nvcc, GPU or not (`make check-cuda`):
#  1. csrc/projected_norm_kernel.cu with nvcc alone (no torch headers) for each architecture in CUDA_ARCHS;
#  2. csrc/projected_norm_cuda.cpp (the torch binding) with the host compiler, syntax only, against the installed
#     torch headers. A CPU-only torch wheel lacks one generated header (c10/cuda/impl/cuda_cmake_macros.h); a stub
#     defining what it defines is provided in that case.
# Usage: csrc/check_cuda.sh [python]      env: NVCC (default nvcc), CUDA_ARCHS (default "80 90"), CXX (default c++)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
NVCC=${NVCC:-nvcc}
CUDA_ARCHS=${CUDA_ARCHS:-80 90}
CXX=${CXX:-c++}
OUT=build/check-cuda
mkdir -p "$OUT/stub/c10/cuda/impl"

command -v "$NVCC" >/dev/null || { echo "check-cuda: nvcc not found (set NVCC=/path/to/nvcc)"; exit 2; }
# the CUDA headers: $CUDA_HOME, the toolkit nvcc lives in, or /usr/local/cuda
for candidate in "${CUDA_HOME:-}" "$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")" /usr/local/cuda; do
  if [ -n "$candidate" ] && [ -e "$candidate/include/cuda_runtime.h" ]; then CUDA_HOME=$candidate; break; fi
done
[ -e "${CUDA_HOME:-}/include/cuda_runtime.h" ] || { echo "check-cuda: CUDA headers not found (set CUDA_HOME)"; exit 2; }

gencode=()
for arch in $CUDA_ARCHS; do gencode+=(-gencode "arch=compute_${arch},code=sm_${arch}"); done
# the same macros torch's CUDAExtension passes: the kernels must not rely on implicit half/bfloat16 conversions
"$NVCC" -std=c++17 -O3 -Xcompiler -fPIC -Werror all-warnings "${gencode[@]}" \
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
  -D__CUDA_NO_HALF2_OPERATORS__ -c csrc/projected_norm_kernel.cu -o "$OUT/projected_norm_kernel.o"
echo "check-cuda: csrc/projected_norm_kernel.cu compiles for sm_${CUDA_ARCHS// /, sm_}" >&2

TORCH_INCLUDES=$("$PY" -c "import torch.utils.cpp_extension as c; print(' '.join(c.include_paths()))")
includes=()
for dir in $TORCH_INCLUDES; do includes+=(-isystem "$dir"); done
if [ ! -e "${TORCH_INCLUDES%% *}/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$OUT/stub/c10/cuda/impl/cuda_cmake_macros.h"
  includes+=(-isystem "$OUT/stub")
fi
"$CXX" -std=c++20 -fsyntax-only -Wall -Wextra -Werror "${includes[@]}" -isystem "$CUDA_HOME/include" -Icsrc \
  csrc/projected_norm_cuda.cpp
echo "check-cuda: csrc/projected_norm_cuda.cpp (torch binding) compiles against torch $("$PY" -c 'import torch; print(torch.__version__)')" >&2
