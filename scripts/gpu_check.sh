#!/usr/bin/env bash
# One GPU check of every CUDA path of oarlock (issue 40; docs/gpu.md): <= 8 minutes on one GPU.
#
#   bash scripts/gpu_check.sh OUTDIR                 # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run OUTDIR       # on CPU: the GPU sections skip, the plumbing runs
#   bash scripts/gpu_check.sh OUTDIR --only flashmask --budget flashmask=400   # a re-run of one section
#
# Runs the code from src/ (PYTHONPATH=src) on the machine's own torch: $PYTHON if set, else .venv/bin/python
# when this checkout has one, else python3. OARLOCK_COMMIT names the commit when the tree has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3
fi
if [ $# -eq 0 ]; then
    echo "usage: bash scripts/gpu_check.sh [--dry-run] OUTDIR [--only a,b] [--budget name=seconds]" >&2
    exit 2
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
# the driver keeps its own 470 s budget; this is the last guard (8 minutes less the start)
exec timeout -k 5 478 "$PY" scripts/gpu_check.py "$@"
