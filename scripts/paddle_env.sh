#!/usr/bin/env bash
# Create .paddle-venv with PaddlePaddle 3.3.1 (CPU), kept apart from the project's .venv. Used by the Paddle
# interop tests and benchmarks as an independent reference; scripts/setup_tests.sh (`make test`) runs it, the
# tests only read the stamp it leaves. Idempotent: the stamp (a hash of this script, written once `import paddle`
# worked) makes a second run return at once and silently. Exit code 3 if the install fails.
set -uo pipefail
cd "$(dirname "$0")/.."
V=.paddle-venv
want="$(sha256sum scripts/paddle_env.sh | cut -c1-16)"
stamp="$V/.oarlock-paddle"  # tests/paddle_venv.py checks for this file
if [ -x $V/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi
PY="${PYTHON:-python3}"
echo "[paddle_env] installing paddlepaddle 3.3.1 into $V" >&2
[ -x $V/bin/python ] || "$PY" -m venv $V || exit 3
$V/bin/python -m pip install -q --disable-pip-version-check paddlepaddle==3.3.1 safetensors numpy || exit 3
$V/bin/python -c "import paddle" || exit 3
echo "$want" > "$stamp"
