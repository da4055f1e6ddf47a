#!/usr/bin/env bash
# Installs headless Chromium for the dashboard's browser test (tests/coordinator/test_dashboard.py).
# Idempotent: does nothing when /usr/bin/chromium already exists. Runs as root (CI) or through sudo.
set -euo pipefail

CHROMIUM=/usr/bin/chromium
if [[ -x "$CHROMIUM" ]]; then
    echo "chromium already installed: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
    exit 0
fi

SUDO=""
if [[ "$(id -u)" -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "need root or sudo to apt-get install chromium" >&2; exit 1; }
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
# Debian ships a real chromium package; Ubuntu's is a snap stub that does not work in containers.
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core

"$CHROMIUM" --version
