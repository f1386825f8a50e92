#!/usr/bin/env bash
# Create .foreign-venv with DeepSpeed and Megatron-Core (both run on CPU) on top of the project's .venv packages
# (same torch), kept apart from .venv. Tests run it to write real ZeRO 1/2/3 and Megatron torch_dist checkpoints
# as fixtures; they skip when it is missing. Idempotent. Exit code 3 if the install fails.
set -uo pipefail
cd "$(dirname "$0")/.."
V=.foreign-venv
want="$(sha256sum scripts/foreign_env.sh | cut -c1-16)"
# a stamp written after the import check passed: later runs skip importing DeepSpeed and Megatron (~15 s)
if [ -x $V/bin/python ] && [ "$(cat $V/.oarlock-foreign 2>/dev/null)" = "$want" ]; then
    exit 0
fi
if [ -x $V/bin/python ] && DS_ACCELERATOR=cpu $V/bin/python -c "import deepspeed, megatron.core" 2>/dev/null; then
    echo "$want" > $V/.oarlock-foreign
    exit 0
fi
[ -x .venv/bin/python ] || exit 3
BASE="$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')"
SITE="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$BASE/bin/python3" -m venv $V || exit 3
PURE="$($V/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$SITE" > "$PURE/oarlock-project-venv.pth"  # torch, numpy, safetensors come from .venv
$V/bin/python -m pip install -q --disable-pip-version-check deepspeed==0.19.8 megatron-core==0.16.1 || exit 3
DS_ACCELERATOR=cpu $V/bin/python -c "import deepspeed, megatron.core" || exit 3
echo "$want" > $V/.oarlock-foreign
