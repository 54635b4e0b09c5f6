#!/usr/bin/env bash
# Installs what the test suite needs and runs all of it: lint, formatting, types and the
# import contract, then the unit tests and the fleet tests on simulated workstations
# (systemd-nspawn hosts over real SSH, which need root), the two side by side. Usage: bash tests/run.sh
# [pytest args] (with arguments: one pytest run with them)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ]; then
    need=()
    for pkg in python3-venv systemd-container debootstrap openssh-client iproute2 gcc \
               dpkg-dev apt-utils gnupg; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || need+=("$pkg")
    done
    # Prometheus' and Alertmanager's own checkers (promtool, amtool), a real Prometheus for the
    # ledger's and the dashboard's tests and a real headless browser for the dashboard page's:
    # without their recommends (node_exporter, fonts), and not started.
    lean=()
    for pkg in prometheus prometheus-alertmanager chromium; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || lean+=("$pkg")
    done
    if [ ${#need[@]} -gt 0 ] || [ ${#lean[@]} -gt 0 ]; then
        echo "--> installing Debian packages: ${need[*]} ${lean[*]}"
        apt-get update -qq
    fi
    if [ ${#need[@]} -gt 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
    if [ ${#lean[@]} -gt 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${lean[@]}" >/dev/null
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
echo "--> documentation site (mkdocs build --strict: every page in the nav, every link and anchor)"
docs_site=$(mktemp -d); .venv/bin/mkdocs build --strict -d "$docs_site"; rm -rf "$docs_site"

if [ $# -gt 0 ]; then
    exec .venv/bin/pytest "$@"
fi

# The whole suite, as two pytest runs side by side: what needs no fleet (tests/unit,
# tests/contract and the fleet folder's local tests) in the background, while the fleet tests,
# which mostly wait on their containers, run in the foreground. Each prints its 20 slowest tests;
# the background run's output follows the fleet's, and the last line counts both.
part=$(mktemp -d)
trap 'rm -rf "$part"' EXIT
# Its own XDG folders: nothing of the two runs meets on the controller.
XDG_STATE_HOME="$part/state" XDG_CACHE_HOME="$part/cache" \
    .venv/bin/pytest -m "not fleet" -p no:cacheprovider --durations=20 --junitxml="$part/nofleet.xml" \
    >"$part/nofleet.log" 2>&1 &
nofleet=$!
set +e
.venv/bin/pytest -m fleet -p no:cacheprovider --durations=20 --junitxml="$part/fleet.xml" 2>&1 | tee "$part/fleet.log"
fleet_rc=${PIPESTATUS[0]}
wait "$nofleet"
nofleet_rc=$?
set -e
echo
echo "--> the tests that need no fleet (run beside the fleet tests): exit $nofleet_rc"
cat "$part/nofleet.log"
# pytest's closing line of each run ("=== 3 failed, 1850 passed, 3 xfailed in 1800.00s ==="):
count() {
    local n
    n=$(grep -E '^=+ .* in [0-9.]+s' "$1" | tail -n 1 | grep -oE "[0-9]+ $2" | head -n 1 | grep -oE '^[0-9]+' || true)
    echo "${n:-0}"
}
passed=0
failed=0
for log in "$part/fleet.log" "$part/nofleet.log"; do
    passed=$((passed + $(count "$log" passed)))
    failed=$((failed + $(count "$log" failed) + $(count "$log" error)))
done
echo "--> time per part (bench/suite_times.py; the fleet's modules run one after another, the others beside them)"
.venv/bin/python bench/suite_times.py "$part"/*.xml || true
echo "--> fleet tests: exit $fleet_rc; the others: exit $nofleet_rc"
echo "$passed passed, $failed failed"
if [ "$fleet_rc" -ne 0 ] || [ "$nofleet_rc" -ne 0 ]; then
    exit 1
fi
