#!/usr/bin/env bash
# Try to create .megatron-bridge-venv with NVIDIA's Megatron-Bridge (HF <-> Megatron-Core conversion), for the
# conversion rows of benchmarks/megatron.py; kept apart from .venv and .foreign-venv. Idempotent (a stamp).
#
# Megatron-Bridge 0.3.1 is the newest release that installs on Python 3.11 (later ones need 3.12). Its declared
# dependencies include transformer-engine[core_cu13,pytorch], mamba-ssm, causal-conv1d and nvidia-resiliency-ext:
# CUDA builds. So the script tries, and records what happens in $V/install-report.txt:
#   1. the full install (`pip install megatron-bridge==0.3.1`), with the project's torch visible (a .pth file, as
#      scripts/foreign_env.sh does) so pip does not fetch another torch;
#   2. when that fails: the package without its dependencies plus the pure-Python ones its HF -> Megatron path
#      imports, and then whether `from megatron.bridge import AutoBridge` works on CPU.
# Exit codes: 0 full install imports, 5 only the partial install (2.) imports, 3 neither (the report says why).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/side_venv.sh
V=.megatron-bridge-venv
BRIDGE=megatron-bridge==0.3.1
want="$(side_venv_stamp scripts/megatron_bridge_env.sh)"
stamp="$V/.oarlock-bridge"
if [ -x $V/bin/python ] && [ "$(cut -d' ' -f1 "$stamp" 2>/dev/null)" = "$want" ]; then
    exit "$(cut -d' ' -f2 "$stamp")"
fi
rm -rf $V  # every try starts from an empty venv
side_venv_create $V || exit 3
REPORT="$V/install-report.txt"
pip=($V/bin/python -m pip install --disable-pip-version-check)
finish() {  # $1: exit code; the stamp keeps it so a second run answers the same without reinstalling
    echo "$want $1" > "$stamp"
    echo "[megatron_bridge_env] exit $1; report: $REPORT" >&2
    exit "$1"
}
probe() {  # does the HF -> Megatron entry point import on this CPU-only machine?
    $V/bin/python -c "from megatron.bridge import AutoBridge; print('AutoBridge imported')" >>"$REPORT" 2>&1
}

echo "[megatron_bridge_env] 1. full install of $BRIDGE (may take minutes; log in $REPORT)" >&2
{ echo "== 1. pip install $BRIDGE (full dependencies)"; date -u; } >"$REPORT"
if quiet timeout 1200 "${pip[@]}" "$BRIDGE" >>"$REPORT" 2>&1; then
    echo "== full install succeeded" >>"$REPORT"
    probe && finish 0
    finish 3
fi
echo "== full install FAILED (exit above)" >>"$REPORT"
# the CUDA-only dependency pip stopped at builds in an isolated environment without torch; the same build with the
# project's torch visible shows whether it can build at all here (no CUDA toolkit: it cannot)
echo "== 1b. pip install --no-build-isolation mamba-ssm (its build with the project's torch visible)" >>"$REPORT"
quiet timeout 600 "${pip[@]}" wheel setuptools packaging ninja >>"$REPORT" 2>&1
quiet timeout 600 "${pip[@]}" --no-build-isolation mamba-ssm >>"$REPORT" 2>&1 \
    || echo "== mamba-ssm build FAILED (exit above)" >>"$REPORT"

echo "[megatron_bridge_env] 2. $BRIDGE without dependencies + the pure-Python ones" >&2
echo "== 2. pip install --no-deps $BRIDGE + megatron-core 0.16.1 and pure-Python dependencies" >>"$REPORT"
quiet timeout 900 "${pip[@]}" --no-deps "$BRIDGE" megatron-core==0.16.1 >>"$REPORT" 2>&1 || finish 3
quiet timeout 900 "${pip[@]}" "transformers<5" accelerate omegaconf "hydra-core>1.3,<=1.3.2" rich pyyaml tqdm regex six \
    typing-extensions einops >>"$REPORT" 2>&1 || finish 3
probe && finish 5
finish 3
