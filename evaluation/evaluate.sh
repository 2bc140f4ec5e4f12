#!/usr/bin/env bash
# Sweep driver: runs a preset through kvpress's own evaluation runner with kvpress-critical's presses.
#   bash evaluation/evaluate.sh --help
#   bash evaluation/evaluate.sh --dry-run                 # job list of the default preset
#   bash evaluation/evaluate.sh --preset smoke            # CPU, embedded SmolLM2, local RULER-style data
#   bash evaluation/evaluate.sh --preset paper            # the paper's sweep (GPUs, Hugging Face Hub)
#   bash evaluation/evaluate.sh --preset leaderboard      # kvpress's leaderboard protocol (Qwen3-8B)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export TRANSFORMERS_VERBOSITY="${TRANSFORMERS_VERBOSITY:-error}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
exec "$python" -m evaluation.run "$@"
