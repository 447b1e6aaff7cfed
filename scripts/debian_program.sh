#!/usr/bin/env bash
# Print the path of a program that a Debian package of the same name installs, installing the
# package with apt-get first when the program is missing (needs root: CI images, or sudo).
#
#   BIN="$(bash scripts/debian_program.sh start_haproxy haproxy /usr/sbin/haproxy "HAProxy >= 2.6")"
#
# Arguments: the name to prefix messages with (the calling script's), the program and package,
# where the package puts the program when it is not on PATH, and what to install on a system
# without apt-get. Exits non-zero with a message on stderr when the program is missing and cannot
# be installed. Used by scripts/start_haproxy.sh and scripts/install_chromium.sh.
set -euo pipefail

CALLER="$1" NAME="$2" FALLBACK="$3" WHAT="$4"

log() { echo "$CALLER: $*" >&2; }

find_program() {
    command -v "$NAME" 2>/dev/null || { [[ -x "$FALLBACK" ]] && echo "$FALLBACK"; } || true
}

BIN="$(find_program)"
if [[ -z "$BIN" ]]; then
    if [[ "$(id -u)" -ne 0 ]]; then
        log "$NAME is not installed and this is not root: run 'sudo apt-get install -y $NAME'"
        exit 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        log "$NAME is not installed and there is no apt-get: install $WHAT with this system's packages"
        exit 1
    fi
    log "installing $NAME with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y "$NAME" >&2; then
        log "apt-get install failed; updating the package lists and trying again"
        apt-get update >&2 && apt-get install -y "$NAME" >&2 || {
            log "could not install $NAME with apt-get (see above)"; exit 1; }
    fi
    BIN="$(find_program)"
    if [[ -z "$BIN" ]]; then
        log "apt-get installed $NAME but no $NAME binary is on PATH or in $(dirname "$FALLBACK")"
        exit 1
    fi
fi
echo "$BIN"
