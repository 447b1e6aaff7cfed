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

# installed with apt-get when missing: scripts/debian_program.sh
BIN="$(bash "$(dirname "$0")/debian_program.sh" install_chromium chromium /usr/bin/chromium "Chromium")"
log "$("$BIN" --version 2>/dev/null | head -n 1)"
echo "$BIN"
