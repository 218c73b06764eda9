#!/usr/bin/env bash
# Smoke test of the GPU path on one machine with at least one CUDA GPU:
#   1. the cuda-marked tests (pytest -m cuda),
#   2. one training step of one rank through NCCL (BAGUAHVD_NCCL_SINGLE_RANK=1), checked
#      against the same step on the CPU (benchmarks/gpu_smoke_step.py),
#   3. the kernels benchmark, whose "vs copy" column is each kernel's throughput over a
#      device-to-device copy of the same bytes.
# Exits non-zero at the first failing step; without a GPU it says so in one line.
# Usage: benchmarks/gpu_smoke.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_smoke.sh: no CUDA GPU is visible to torch; nothing to check" >&2
    exit 2
fi

echo "== cuda-marked tests"
"$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests/unit "$@"

echo "== one training step through a one-rank NCCL communicator"
"$PYTHON" benchmarks/gpu_smoke_step.py

echo "== kernels vs a device-to-device copy"
"$PYTHON" benchmarks/kernels.py --quick
