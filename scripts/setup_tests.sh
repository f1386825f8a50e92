#!/usr/bin/env bash
# Set up what the test suite uses on top of scripts/setup.sh's .venv (`make test` runs both):
#   venv     the test and GPU extras in .venv (pytest, SeaweedFS's weed, boto3, s3fs, triton, ...): fatal if it fails
#   apt      Debian's chromium (HTML screenshot tests) and graphviz (`dot`), as root only
#   foreign  .foreign-venv, DeepSpeed and Megatron-Core (scripts/foreign_env.sh)
#   vllm     .vllm-venv, vLLM for CPU (scripts/vllm_env.sh)
#   paddle   .paddle-venv, PaddlePaddle 3.3.1 (scripts/paddle_env.sh)
# Each prints one line: reused, built (seconds), skipped or failed, with its log under .cache/setup-logs/. A failed
# optional service is not fatal: its tests skip, naming it. OARLOCK_SKIP_SERVICES="vllm paddle" skips services.
# Idempotent: every step keeps a stamp, so a second run does no installing and returns in seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "[setup-tests] no .venv/bin/python: run scripts/setup.sh first" >&2; exit 1; }
LOGS=.cache/setup-logs
mkdir -p "$LOGS"

# service NAME WHAT COMMAND...: runs COMMAND with its output in $LOGS/NAME.log and prints one line. The commands
# print nothing when their stamp is current, so no output means reused; the log of the last build is then kept.
service() {
    local name=$1 what=$2 rc=0 t0=$SECONDS
    shift 2
    local log="$LOGS/$name.log" skip="${OARLOCK_SKIP_SERVICES:-}"
    case " ${skip//,/ } " in
        *" $name "*) echo "[setup-tests] $name: skipped (OARLOCK_SKIP_SERVICES): $what tests will skip" >&2; return 0;;
    esac
    printf '[setup-tests] %s: ' "$name" >&2
    "$@" >"$log.new" 2>&1 || rc=$?
    if [ "$rc" -eq 5 ]; then  # the command's own verdict: it cannot run here; its last line says why
        mv "$log.new" "$log"
        echo "skipped ($(tail -n 1 "$log")): $what tests will skip" >&2
    elif [ "$rc" -ne 0 ]; then
        mv "$log.new" "$log"
        echo "failed (exit $rc, see $log)${what:+: $what tests will skip}" >&2
    elif [ -s "$log.new" ]; then
        mv "$log.new" "$log"
        echo "built in $((SECONDS - t0)) s (log: $log)" >&2
    else
        rm -f "$log.new"
        echo "reused" >&2
    fi
    return "$rc"
}

test_extras() {  # .venv's test and GPU extras, reinstalled when pyproject.toml or this script changes
    local want stamp=.venv/.oarlock-setup-tests
    want="$(cat pyproject.toml scripts/setup_tests.sh | sha256sum | cut -c1-16)"
    [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return 0
    echo "installing oarlock[test,gpu] into .venv"
    # torch pinned in the same command, as in setup.sh: the extras must not pull another torch
    .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[test,gpu]" || return 3
    echo "$want" > "$stamp"
}

apt_packages() {  # chromium and graphviz when missing; exit 5 = cannot install here (not root, no apt-get)
    local missing=()
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    command -v dot >/dev/null 2>&1 || missing+=(graphviz)
    [ "${#missing[@]}" -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "not root or no apt-get: install ${missing[*]} by hand"
        return 5
    fi
    echo "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -q \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

if ! service venv "" test_extras; then  # the suite cannot run without them: show why here, not only in the log
    tail -n 20 "$LOGS/venv.log" >&2
    echo "[setup-tests] the test extras are required: the install into .venv failed" >&2
    exit 1
fi
service apt "the HTML screenshot and Graphviz" apt_packages
service foreign "the DeepSpeed/Megatron" bash scripts/foreign_env.sh
service vllm "the vLLM back end's end-to-end" bash scripts/vllm_env.sh
service paddle "the Paddle interop" bash scripts/paddle_env.sh
exit 0
