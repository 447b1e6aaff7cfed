#!/usr/bin/env bash
# Make sure HAProxy is installed (Debian's package) and print the path of its binary.
#
#   HAPROXY="$(bash scripts/start_haproxy.sh)"    # e.g. /usr/sbin/haproxy
#
# Installs it with apt-get when missing (needs root: run it in CI images or with sudo). Exits
# non-zero with a message on stderr when HAProxy is missing and cannot be installed. It does not
# start a proxy: agentkv.testing.cluster.LocalCluster (the tests, benchmarks/scaleout.py) runs one
# from deploy/haproxy.cfg, and users run `haproxy -db -f deploy/haproxy.cfg` (see that file).
set -euo pipefail

log() { echo "start_haproxy: $*" >&2; }

find_haproxy() {
    command -v haproxy 2>/dev/null || { [[ -x /usr/sbin/haproxy ]] && echo /usr/sbin/haproxy; } || true
}

BIN="$(find_haproxy)"
if [[ -z "$BIN" ]]; then
    if [[ "$(id -u)" -ne 0 ]]; then
        log "haproxy is not installed and this is not root: run 'sudo apt-get install -y haproxy'"
        exit 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        log "haproxy is not installed and there is no apt-get: install HAProxy >= 2.6 with this system's packages"
        exit 1
    fi
    log "installing haproxy with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y haproxy >&2; then
        log "apt-get install failed; updating the package lists and trying again"
        apt-get update >&2 && apt-get install -y haproxy >&2 || {
            log "could not install haproxy with apt-get (see above)"; exit 1; }
    fi
    BIN="$(find_haproxy)"
    if [[ -z "$BIN" ]]; then
        log "apt-get installed haproxy but no haproxy binary is on PATH or in /usr/sbin"
        exit 1
    fi
fi
log "$("$BIN" -v | head -n 1)"
echo "$BIN"
