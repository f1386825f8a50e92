#!/usr/bin/env bash
# Print the path of a headless-capable Chromium, installing the Debian package `chromium` if it is missing.
# Shared by the tests that render HTML (debug graphs, memory viewer). Usage:
#     CHROME="$(scripts/chromium.sh)" || skip "$CHROME"
# stdout: the binary's path (one line) on success. On failure: exit code 3 and the reason on stdout's one line
# (also on stderr), so a caller can skip with it. Idempotent and quick once installed; concurrent callers are
# serialised with a lock file so only one apt-get runs.
# Recommended flags for a sandbox-free, offline run:
#     --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update
#     --disable-sync --no-first-run --user-data-dir=<fresh temp dir>
set -uo pipefail

find_chromium() {
    local c
    for c in "${CHROMIUM:-}" chromium chromium-browser google-chrome; do
        [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && { command -v "$c"; return 0; }
    done
    return 1
}

fail() { echo "chromium unavailable: $*"; echo "chromium unavailable: $*" >&2; exit 3; }

if path="$(find_chromium)"; then echo "$path"; exit 0; fi
command -v apt-get >/dev/null 2>&1 || fail "no apt-get on this system"
[ "$(id -u)" = 0 ] || fail "apt-get needs root (uid $(id -u))"
lock="${TMPDIR:-/tmp}/oarlock-chromium-install.lock"
exec 9>"$lock"
command -v flock >/dev/null 2>&1 && flock 9
if path="$(find_chromium)"; then echo "$path"; exit 0; fi   # another caller installed it meanwhile
log="${TMPDIR:-/tmp}/oarlock-chromium-install.log"
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends chromium >"$log" 2>&1; then
    apt-get update -q >>"$log" 2>&1 || fail "apt-get update failed (see $log)"
    apt-get install -y -q --no-install-recommends chromium >>"$log" 2>&1 \
        || fail "apt-get install chromium failed (see $log): $(tail -n 1 "$log")"
fi
path="$(find_chromium)" || fail "chromium installed but no binary found on PATH"
echo "$path"
