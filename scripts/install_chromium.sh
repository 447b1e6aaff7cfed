#!/usr/bin/env bash
# Make sure Chromium is installed (Debian's package) and print the path of its binary.
#
#   CHROMIUM="$(bash scripts/install_chromium.sh)"    # e.g. /usr/bin/chromium
#
# The docs' browser test (tests/docs/test_site_in_browser.py, `make docs-test`) opens the built site
# in it headless. Installs it with apt-get when missing (needs root: run it in CI images or with
# sudo). Exits non-zero with a message on stderr when Chromium is missing and cannot be installed.
set -euo pipefail

log() { echo "install_chromium: $*" >&2; }

find_chromium() {
    command -v chromium 2>/dev/null || { [[ -x /usr/bin/chromium ]] && echo /usr/bin/chromium; } || true
}

BIN="$(find_chromium)"
if [[ -z "$BIN" ]]; then
    if [[ "$(id -u)" -ne 0 ]]; then
        log "chromium is not installed and this is not root: run 'sudo apt-get install -y chromium'"
        exit 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        log "chromium is not installed and there is no apt-get: install Chromium with this system's packages"
        exit 1
    fi
    log "installing chromium with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y chromium >&2; then
        log "apt-get install failed; updating the package lists and trying again"
        apt-get update >&2 && apt-get install -y chromium >&2 || {
            log "could not install chromium with apt-get (see above)"; exit 1; }
    fi
    BIN="$(find_chromium)"
    if [[ -z "$BIN" ]]; then
        log "apt-get installed chromium but no chromium binary is on PATH or in /usr/bin"
        exit 1
    fi
fi
log "$("$BIN" --version 2>/dev/null | head -n 1)"
echo "$BIN"
