#!/usr/bin/env bash
# The GPU check: one command for a machine with one CUDA GPU and no network, done within
# its time budget (7.5 minutes unless --budget says otherwise). It runs this tree from
# PYTHONPATH (nothing is installed or changed), needs no MPI (torchrun, gloo control plane),
# and writes one summary, gpu_check.json and gpu_check.md, with a log per part, into $OUT
# when it is set, else benchmarks/results/gpu_check/. The parts: benchmarks/gpu_check.py.
#
# Exit status: 0 every required part passed, 1 one failed, 2 no GPU (one line says so).
# Usage: benchmarks/gpu_check.sh [--only PART,...] [--budget SECONDS] [--skip-optional]
#        PYTHON=/path/to/python3 benchmarks/gpu_check.sh      (default: python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Why there is nothing to check, if there is nothing; empty when there is a GPU.
reason=$("$PYTHON" -W ignore - 2>/dev/null <<'PY'
try:
    import torch
except Exception as exc:  # a broken install is as good as no GPU here
    print(f"torch cannot be imported ({type(exc).__name__}: {exc})")
else:
    if not torch.cuda.is_available():
        print("no GPU (torch.cuda.is_available() is False)")
PY
) || reason=${reason:-"$PYTHON cannot run"}
if [[ -n "$reason" ]]; then
    echo "gpu_check: ${reason}; nothing to check"
    exit 2
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
