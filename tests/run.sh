#!/usr/bin/env bash
# Installs what the test suite needs and runs all of it: unit tests, then the
# fleet tests on simulated workstations (systemd-nspawn hosts over real SSH,
# which need root). Usage: bash tests/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ]; then
    need=()
    for pkg in python3-venv systemd-container debootstrap openssh-client iproute2 gcc \
               dpkg-dev apt-utils gnupg; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || need+=("$pkg")
    done
    if [ ${#need[@]} -gt 0 ]; then
        echo "--> installing Debian packages: ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
else
    echo "--> not root: the fleet tests need root (systemd-nspawn, network namespaces) and will fail" >&2
fi

if [ ! -x .venv/bin/python ]; then
    echo "--> creating .venv"
    python3 -m venv .venv
fi
echo "--> installing the project and its test extras into .venv"
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'

exec .venv/bin/pytest "$@"
