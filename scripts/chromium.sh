#!/usr/bin/env bash
# Make Debian's `chromium` available for headless rendering tests; print its path on stdout.
# Exits non-zero with the reason on stderr when it cannot be installed (tests then skip with that reason).
set -uo pipefail
for c in chromium chromium-browser; do
    if p="$(command -v "$c")"; then echo "$p"; exit 0; fi
done
if ! command -v apt-get >/dev/null; then echo "no apt-get on this system to install chromium" >&2; exit 1; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
        echo "installing chromium needs root (or passwordless sudo)" >&2; exit 1; fi
fi
log="$(mktemp)"
if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium; } >"$log" 2>&1; then
    echo "apt-get install chromium failed: $(tail -n 1 "$log")" >&2; rm -f "$log"; exit 1
fi
rm -f "$log"
command -v chromium || { echo "chromium still not on PATH after install" >&2; exit 1; }
