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

# installed with apt-get when missing: scripts/debian_program.sh
BIN="$(bash "$(dirname "$0")/debian_program.sh" start_haproxy haproxy /usr/sbin/haproxy "HAProxy >= 2.6")"
log "$("$BIN" -v | head -n 1)"
echo "$BIN"
