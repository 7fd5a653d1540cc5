#!/usr/bin/env bash
# Debian's chromium for the dashboard's browser tests (integration/test_web.py, driven by
# Playwright for Python pointed at /usr/bin/chromium: no browser download). Idempotent:
# dpkg is asked first; `apt-get update` only if an install from the current lists fails.
set -euo pipefail
if dpkg-query -W -f='${Status}\n' chromium 2>/dev/null | grep -q '^install ok installed$'; then
    echo "chromium: $(chromium --version 2>/dev/null | head -1)"
    exit 0
fi
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; }
echo "chromium: installing Debian's chromium for the browser tests"
if ! install; then
    apt-get update -q >/dev/null
    install
fi
echo "chromium: $(chromium --version 2>/dev/null | head -1)"
