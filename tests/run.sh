#!/usr/bin/env bash
# Installs what the test suite needs and runs all of it: lint, formatting, types and the
# import contract, then the unit tests and the fleet tests on simulated workstations
# (systemd-nspawn hosts over real SSH, which need root). Usage: bash tests/run.sh [pytest args]
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

echo "--> lint (ruff), formatting (ruff format), types (mypy), layers (lint-imports)"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy --no-error-summary
.venv/bin/lint-imports --no-cache | tail -n 3

exec .venv/bin/pytest "$@"
