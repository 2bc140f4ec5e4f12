#!/usr/bin/env bash
# Installs kvpress-critical as a user would, from its built wheel, and runs its C++ kernels there.
#   1. builds the sdist, then the wheel from that sdist (what `pip install kvpress-critical` gets from PyPI);
#   2. installs the wheel with its dependencies into a fresh virtual environment outside the checkout;
#   3. from another directory, with an empty cache folder (so the extension compiles on first use, timed), runs
#      projected_value_norm and ragged_attention with backend="cpp" against their torch references.
# Usage: PY=.venv/bin/python TORCH_SPEC=torch==2.13.0 bash .ci/check_wheel.sh      (make check-wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
work=$(mktemp -d /tmp/kvpress-critical-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT

"$PY" -m build --sdist --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/kvpress_critical-*.tar.gz)
"$PY" -m build --wheel --outdir "$work/dist" "$sdist" >>"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/kvpress_critical-*.whl)
echo "sdist: $(basename "$sdist") ($(tar tzf "$sdist" | grep -c '/csrc/') files of csrc/)"
echo "wheel: $(basename "$wheel"), $(unzip -Z1 "$wheel" | wc -l) files, kernel sources:" \
     "$(unzip -Z1 "$wheel" | grep '^kvpress_critical/_csrc/' | xargs -n1 basename | tr '\n' ' ')"
if unzip -Z1 "$wheel" | grep -q '\.so$'; then echo "the wheel must not carry a compiled library"; exit 1; fi

python_base=$("$PY" -c "import sys; print(sys._base_executable)")
"$python_base" -m venv "$work/venv"
venv_py=$work/venv/bin/python
"$venv_py" -m pip install -q --no-compile --upgrade pip
"$venv_py" -m pip install -q --no-compile "$TORCH_SPEC"
"$venv_py" -m pip install -q --no-compile "$wheel"
echo "installed into a fresh venv: $("$venv_py" -m pip list 2>/dev/null | grep -ci '^[a-z]') distributions," \
     "$(du -sh "$work/venv" | cut -f1)"

mkdir -p "$work/elsewhere" "$work/home"
cd "$work/elsewhere"
KVPRESS_CRITICAL_HOME="$work/home" "$venv_py" - <<'PY'
import time
from pathlib import Path

import torch

import kvpress_critical
from kvpress_critical.ops import extension
from kvpress_critical.ops.projected_value_norm import projected_value_norm, projected_value_norm_ref
from kvpress_critical.ops.ragged_attention import ragged_attention, ragged_attention_ref
from kvpress_critical.ops.ragged_attention import random_layout

site = Path(kvpress_critical.__file__).resolve().parent
assert "site-packages" in str(site), f"imported from {site}, not from the installed wheel"
assert extension.sources_dir() == site / "_csrc", extension.sources_dir()
print(f"kvpress_critical {kvpress_critical.__version__} from {site}")

start = time.perf_counter()
assert extension.cpp_availability() is None, extension.cpp_availability()
print(f"first use compiled the extension in {time.perf_counter() - start:.1f} s: {extension.extension_state().path}")

g = torch.Generator().manual_seed(0)
values = torch.randn(2, 3, 300, 64, generator=g)
weight = torch.randn(203, 9 * 64, generator=g) / 8
for norm in ("l1", "l2"):
    out = projected_value_norm(values, weight, 9, norm=norm, backend="cpp")
    ref = projected_value_norm(values, weight, 9, norm=norm, backend="torch")
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(out, projected_value_norm_ref(values, weight, 9, norm=norm), rtol=2e-5, atol=1e-5)
print("projected_value_norm: cpp == torch == float64 reference (l1, l2)")

for q_len in (1, 9):
    inputs = random_layout(2, 3, 3, q_len, 64, [50, 0, 7, 120, 1, 33], tail_len=q_len + 2, capacity=q_len + 6)
    out = ragged_attention(*inputs, tail_len=q_len + 2, scale=0.125, backend="cpp")
    ref = ragged_attention(*inputs, tail_len=q_len + 2, scale=0.125, backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    exact = ragged_attention_ref(*inputs, tail_len=q_len + 2, scale=0.125)
    torch.testing.assert_close(out.double(), exact.double(), rtol=1e-5, atol=1e-5)
print("ragged_attention: cpp == torch == float64 reference (1 and 9 queries)")
PY
echo "check-wheel: ok"
