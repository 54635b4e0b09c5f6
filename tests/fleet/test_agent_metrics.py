"""The host agent's state in Prometheus: ws1 converged behind the gateway host (its engine on
every address, so its firewall is kept), Debian's Prometheus on the gateway as the gateway deploy
with `alerting_enabled` configures it (the shared gateway fleet, tests/fleet/conftest.py). Read from
Prometheus's HTTP API: ws1 serving, with its engine's counters, its card's memory and power and
its firewall's table; then the owner's game (the GPU stand-ins' /.sim/gpu-memory-used-mib, as
tests/fleet/test_owner.py sets it): ws1 yielded for `game`, its stopped engine's counters gone;
the game's end: ws1 serving again."""

from __future__ import annotations

import json
import shlex
import urllib.parse

import pytest

from tests.fleet.client import wait_until
from tests.fleet.gateway_load import OWNER_QUIET_S
from tests.fleet.profiles import GATEWAY_NAME, PROFILES

pytestmark = pytest.mark.fleet

GAME = "/.sim/gpu-memory-used-mib"
QUIET_S = OWNER_QUIET_S  # the game's end to the engine's start: short (the shared gateway fleet's)
API = "http://127.0.0.1:9090/api/v1/"
# From the gateway host, with its own python3 (the base image has no curl): the body of a GET.
FETCH = "python3 -c 'import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=10).read().decode())' "


@pytest.fixture(scope="module")
def prometheus(gateway_fleet):
    """The shared gateway fleet (tests/fleet/conftest.py): ws1 behind the gateway, and the
    gateway's Prometheus (its deploy's, `alerting_enabled`) scraping every 2 s."""
    fleet = gateway_fleet.up()["fleet"]
    try:
        yield fleet
    finally:
        fleet.run("ws1", f"rm -f {GAME}")


def query(fleet, promql: str) -> dict[str, float]:
    """An instant query's samples: each series' host and the agent's own labels -> value (the
    scrape config's other labels, job and instance left out)."""
    r = fleet.run(GATEWAY_NAME, FETCH + shlex.quote(API + "query?query=" + urllib.parse.quote(promql)), check=True)
    out = {}
    for m in json.loads(r.stdout)["data"]["result"]:
        labels = {k: v for k, v in m["metric"].items() if k in ("host", "mode", "reason", "signal")}
        out[",".join(f"{k}={v}" for k, v in sorted(labels.items()))] = float(m["value"][1])
    return out


def test_prometheus_reads_the_agents_mode_and_the_yield_with_its_reason(prometheus):
    fleet = prometheus

    def ws1(metric: str) -> dict[str, float]:
        return query(fleet, f'{metric}{{host="ws1"}}')

    # Serving: the mode, no reason, the engine's counters (it has answered /v1/stats), the card, the firewall.
    wait_until(
        "ws1 serving in Prometheus", lambda: ws1("freetoken_agent_mode").get("host=ws1,mode=serving") == 1, 90, poll=1.0
    )
    assert sum(ws1("freetoken_agent_mode").values()) == 1
    assert set(ws1("freetoken_agent_yield_reason").values()) == {0}
    wait_until(
        "ws1's engine counters in Prometheus", lambda: ws1("freetoken_engine_requests_total") != {}, 30, poll=1.0
    )
    assert ws1("freetoken_gpu_memory_total_bytes") == {"host=ws1": PROFILES["ws1"].gpu.memory_total_mib * 2**20}
    assert ws1("freetoken_firewall_table_loaded") == {"host=ws1": 1}
    assert ws1("freetoken_agent_signal_up").get("host=ws1,signal=gpu") == 1

    # The owner's game: ws1 yields (drain, then its engine stopped), and says why.
    fleet.run("ws1", f"echo {PROFILES['ws1'].gpu.memory_total_mib - 1024} > {GAME}", check=True)
    wait_until(
        "ws1 yielded in Prometheus", lambda: ws1("freetoken_agent_mode").get("host=ws1,mode=yielded") == 1, 60, poll=1.0
    )
    assert ws1("freetoken_agent_yield_reason") == {
        f"host=ws1,reason={r}": float(r == "game")
        for r in ("game", "app", "full_screen", "snoozed", "off_schedule", "reboot_pending")
    }
    # The stopped engine's counters are left out (stale at once in Prometheus), never 0.
    wait_until(
        "ws1's counters gone from Prometheus", lambda: ws1("freetoken_engine_requests_total") == {}, 30, poll=1.0
    )
    assert ws1("freetoken_gpu_power_watts") == {"host=ws1": 142.31}  # the NVML stand-in's busy card

    # The game ends: after the quiet time the agent starts the engine and ws1 serves again.
    fleet.run("ws1", f"rm -f {GAME}", check=True)
    wait_until(
        "ws1 serving again in Prometheus",
        lambda: ws1("freetoken_agent_mode").get("host=ws1,mode=serving") == 1,
        120,
        poll=1.0,
    )
    assert set(ws1("freetoken_agent_yield_reason").values()) == {0}
