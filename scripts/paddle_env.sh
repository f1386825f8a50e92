#!/usr/bin/env bash
# Create .paddle-venv with PaddlePaddle 3.3.1 (CPU), kept apart from the project's .venv. Used by the Paddle
# interop tests and benchmarks as an independent reference. Idempotent. Exit code 3 if the install fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .paddle-venv/bin/python ] && .paddle-venv/bin/python -c "import paddle" 2>/dev/null; then exit 0; fi
"$PY" -m venv .paddle-venv || exit 3
.paddle-venv/bin/python -m pip install -q --disable-pip-version-check paddlepaddle==3.3.1 safetensors numpy || exit 3
.paddle-venv/bin/python -c "import paddle" || exit 3
