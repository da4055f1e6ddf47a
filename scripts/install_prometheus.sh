#!/usr/bin/env bash
# Installs Prometheus and promtool (Debian's prometheus package) for the observability tests:
# tests/deploy/test_alert_rules.py (promtool check/test rules) and tests/deploy/test_prometheus_e2e.py (a real
# Prometheus scraping a run). Idempotent: does nothing when both binaries exist. Runs as root (CI) or through sudo.
set -euo pipefail

if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    echo "prometheus already installed: $(prometheus --version 2>&1 | head -1)"
    exit 0
fi

SUDO=""
if [[ "$(id -u)" -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "need root or sudo to apt-get install prometheus" >&2; exit 1; }
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# --no-install-recommends: the node exporter and the web console libraries are not needed; the package's service is
# not started in containers (no systemd), and the tests start their own Prometheus on a free port.
$SUDO apt-get install -y -q --no-install-recommends prometheus

prometheus --version 2>&1 | head -1
promtool --version 2>&1 | head -1
