#!/usr/bin/env bash
# Create .torch-checkpointing-venv with Meta's torch_checkpointing (pure Python; needs torch >= 2.11) on top of the
# project's .venv packages, for part 3 of benchmarks/megatron.py, which skips that part when this venv is missing.
# Idempotent (a stamp). Exit code 3 if the install or the import fails.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/side_venv.sh
V=.torch-checkpointing-venv
want="$(side_venv_stamp scripts/torch_checkpointing_env.sh)"
[ -x $V/bin/python ] && [ "$(cat $V/.oarlock-tc 2>/dev/null)" = "$want" ] && exit 0
side_venv_create $V || exit 3
echo "[torch_checkpointing_env] installing torch-checkpointing 0.1.1 into $V" >&2
quiet $V/bin/python -m pip install -q --disable-pip-version-check torch-checkpointing==0.1.1 >&2 || exit 3
$V/bin/python -c "import torch_checkpointing; print('torch_checkpointing', torch_checkpointing.__version__)" || exit 3
echo "$want" > $V/.oarlock-tc
