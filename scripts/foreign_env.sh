#!/usr/bin/env bash
# Create .foreign-venv with DeepSpeed and Megatron-Core (both run on CPU) on top of the project's .venv packages
# (same torch), kept apart from .venv. Tests run it to write real ZeRO 1/2/3 and Megatron torch_dist checkpoints
# as fixtures; they skip when it is missing. Idempotent. Exit code 3 if the install fails, 4 if DeepSpeed's C++
# op cannot be prebuilt (DeepSpeed tests then skip; Megatron tests still run).
#
# DeepSpeed JIT-builds a C++ op (deepspeed_shm_comm) on its first distributed init, with torch.utils.cpp_extension,
# guarded by a lock file in the extensions directory. It is prebuilt here, at set-up time, into the venv's own
# directory $V/torch_extensions (tests set TORCH_EXTENSIONS_DIR to it), so tests never build it and never share
# ~/.cache/torch_extensions, where a run killed mid-build leaves a lock every later init waits on forever.
set -uo pipefail
cd "$(dirname "$0")/.."
V=.foreign-venv
EXT="$V/torch_extensions"
SHM_SO="$EXT/deepspeed_shm_comm/deepspeed_shm_comm.so"
want="$(sha256sum scripts/foreign_env.sh | cut -c1-16)"

prebuild_shm_op() {
    [ -f "$SHM_SO" ] && return 0
    local lock="$EXT/deepspeed_shm_comm/lock"
    # a lock left by a set-up build killed over 15 minutes ago (a build takes about 1 minute) is stale: without
    # removing it this build would wait on it forever; it is this script's own file, inside the venv
    if [ -e "$lock" ] && [ -n "$(find "$lock" -mmin +15 2>/dev/null)" ]; then
        echo "[foreign_env] removing stale build lock $lock" >&2
        rm -f "$lock"
    fi
    mkdir -p "$EXT"
    echo "[foreign_env] prebuilding DeepSpeed's deepspeed_shm_comm op into $EXT (about a minute)" >&2
    # through the venv's real path, as the tests run it: the build commands (source paths under site-packages)
    # are then the same at test time, so torch finds the op up to date and does not rebuild it
    local real
    real="$(cd $V && pwd -P)"
    TORCH_EXTENSIONS_DIR="$real/torch_extensions" DS_ACCELERATOR=cpu timeout 1800 "$real/bin/python" -c "
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False)" >/dev/null && [ -f "$SHM_SO" ]
}

# a stamp written after the import check passed: later runs skip importing DeepSpeed and Megatron (~15 s)
if [ -x $V/bin/python ] && [ "$(cat $V/.oarlock-foreign 2>/dev/null)" = "$want" ]; then
    prebuild_shm_op || exit 4
    exit 0
fi
if [ -x $V/bin/python ] && DS_ACCELERATOR=cpu $V/bin/python -c "import deepspeed, megatron.core" 2>/dev/null; then
    echo "$want" > $V/.oarlock-foreign
    prebuild_shm_op || exit 4
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
prebuild_shm_op || exit 4
