#!/usr/bin/env bash
# Prepare .whl/: the Python packages an offline GPU node may lack, as wheels for its Python (GPU_PYTHON, default 3.12,
# x86_64), so that benchmarks/gpu_check.sh can install them there with `pip install --no-index --no-deps --target`.
# Run it where there is network, then copy the repository with .whl/ to the node (`make install` prepares it too).
#
#   benchmarks/gpu_wheels.sh [dest]      dest defaults to .whl (ignored by git)
#
# A CUDA image with a recent torch usually has transformers but not kvpress, and kvpress 0.5.5 needs transformers
# < 5.3, and transformers 5.2 needs tokenizers <= 0.23.0: both are pinned here to the versions the test suite runs
# with, together with what `import kvpress` imports that such an image lacks (datasets, dill, multiprocess, fire,
# termcolor, cachetools). The op layer (kvpress_critical.ops: kernels, their tests and benchmarks) needs none of them:
# without the wheels, gpu_check.sh still runs every op step and skips the end-to-end ones.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
py=${PY:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
# name==version for binary wheels of Python 3.12 / manylinux x86_64 (pure-Python wheels match any platform)
BINARY=(
  kvpress==0.5.5
  transformers==5.2.0
  tokenizers==0.22.2
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  termcolor==3.3.0
  cachetools==5.5.2
)
SDIST_ONLY=(fire==0.6.0)  # kvpress pins fire<0.7, published as an sdist only: built here into a pure-Python wheel
MAX_MB=40                 # a small set: it is copied to the node with the repository

rm -rf "$dest"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
  "${platforms[@]}" \
  -d "$dest" "${BINARY[@]}"
"$py" -m pip wheel -q --no-deps -w "$dest" "${SDIST_ONLY[@]}"
count=$(ls "$dest"/*.whl | wc -l)
expected=$(( ${#BINARY[@]} + ${#SDIST_ONLY[@]} ))
if [ "$count" -ne "$expected" ]; then
  echo "gpu_wheels: expected $expected wheels in $dest, found $count" >&2
  exit 1
fi
size_kb=$(du -sk "$dest" | cut -f1)
if [ "$size_kb" -gt $(( MAX_MB * 1024 )) ]; then
  echo "gpu_wheels: $dest is $(( size_kb / 1024 )) MiB, over the $MAX_MB MiB allowed" >&2
  exit 1
fi
ls -l "$dest"
echo "gpu_wheels: $count wheels, $(( size_kb / 1024 )) MiB in $dest"
