#!/usr/bin/env bash
# Installs Debian's chromium for the dashboard's browser test (plugins/dashboard/tests/test_dashboard.py), which
# drives it with the Python package playwright. Idempotent: does nothing if chromium is there.
# Never use `playwright install`: it downloads its own browser build.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    echo "chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "error: installing chromium needs root (apt-get install chromium); run this script as root." >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium >/dev/null
echo "installed: $(/usr/bin/chromium --version 2>/dev/null)"
