"""Alerts that fire (docs/alerts.md): the gateway deploy with `alerting_enabled` runs Debian's
Prometheus and Alertmanager on the simulated gateway host with the generated rules, its `for`s
short through the settings. A serving host powered off raises FreetokenHostDown in
Alertmanager's API (`/api/v2/alerts`) once its `for` has passed, and the alert resolves when the
host is back; a host its owner snoozed (the agent yields it), then powered off, raises nothing.

On the shared gateway fleet (tests/fleet/conftest.py): the gateway's deploy again (nothing
changes), then the breaks; each host powered off is powered on again before the test ends. ws3 is
refused at preflight and never serves: its own FreetokenHostDown is expected and left out of the
assertions (they name ws1 and ws2 only)."""

from __future__ import annotations

import json
import shlex
import time
import urllib.parse

import pytest

from operations import gateway as gw
from tests.fleet import client
from tests.fleet.client import wait_until as _wait_until
from tests.fleet.gateway_load import ALERT_HOST_DOWN_FOR_S, pyinfra
from tests.fleet.profiles import GATEWAY_NAME

pytestmark = pytest.mark.fleet

DOWN_FOR_S = ALERT_HOST_DOWN_FOR_S  # the shared gateway fleet's (tests/fleet/gateway_load.py)
FETCH = (
    "python3 -c 'import sys, urllib.request as u; "
    "sys.stdout.write(u.urlopen(sys.argv[1], timeout=10).read().decode())' "
)
PROMETHEUS = "http://127.0.0.1:9090/api/v1/"
ALERTMANAGER = "http://127.0.0.1:9093/api/v2/"


@pytest.fixture(scope="module")
def alerting(gateway_fleet):
    """The shared gateway fleet (tests/fleet/conftest.py): its gateway converged with alerting
    (scrapes and evaluations every 2 s, a host down's `for` DOWN_FOR_S); a second run of the
    gateway's deploy changes nothing."""
    shared = gateway_fleet.up()
    again = pyinfra(*gateway_fleet.args(), "inventories/sim.py", "deploys/gateway.py", "--limit", "gateway")
    assert again.returncode == 0 and client.grand_total(again)[1] in ("-", "0"), "a second run changed something"
    return {"fleet": shared["fleet"], "keys": shared["keys"]}


def fetch(fleet, url: str):
    r = fleet.run(GATEWAY_NAME, FETCH + shlex.quote(url))
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def query(fleet, promql: str) -> list[dict]:
    doc = fetch(fleet, PROMETHEUS + "query?query=" + urllib.parse.quote(promql))
    return doc["data"]["result"] if doc else []


def wait_until(what: str, check, timeout: float) -> float:
    """client.wait_until, polling Prometheus and Alertmanager once a second."""
    return _wait_until(what, check, timeout, poll=1.0)


def firing(fleet, host: str, alertname: str = gw.HOST_DOWN) -> list[dict]:
    """Alertmanager's active alerts named `alertname` for `host`."""
    alerts = fetch(fleet, ALERTMANAGER + "alerts") or []
    return [
        a
        for a in alerts
        if a["labels"].get("alertname") == alertname
        and a["labels"].get("host") == host
        and a["status"]["state"] == "active"
    ]


def test_prometheus_and_alertmanager_run_on_loopback_with_the_rules(alerting):
    fleet = alerting["fleet"]
    wait_until("Prometheus answers", lambda: fetch(fleet, PROMETHEUS + "rules") is not None, 120)
    rules = fetch(fleet, PROMETHEUS + "rules")["data"]["groups"][0]["rules"]
    assert {r["name"] for r in rules} >= {gw.HOST_DOWN, gw.OUT_OF_SERVICE, gw.QUEUE_BUILDING}
    assert fetch(fleet, ALERTMANAGER + "status") is not None
    listening = fleet.run(GATEWAY_NAME, "ss -Htln", check=True).stdout
    for port in ("9090", "9093"):
        assert f"127.0.0.1:{port}" in listening and f"0.0.0.0:{port}" not in listening and f"*:{port}" not in listening
    assert ":9094" not in listening  # Alertmanager's cluster port is off
    # Prometheus scrapes HAProxy with the metrics key the deploy wrote, and every serving host.
    wait_until(
        "the gateway's exporter and ws1, ws2 scraped",
        lambda: (
            {r["metric"].get("host") or r["metric"]["job"] for r in query(fleet, "up == 1")}
            >= {"freetoken-gateway", "ws1", "ws2"}
        ),
        120,
    )


def test_a_serving_host_powered_off_raises_host_down_after_its_for_and_resolves_when_back(alerting):
    fleet = alerting["fleet"]
    wait_until(
        "ws1 serving, as Prometheus sees it",
        lambda: query(fleet, 'freetoken_agent_mode{host="ws1", mode="serving"} == 1'),
        180,
    )
    assert firing(fleet, "ws1") == []
    t0 = time.time()
    fleet.power_off("ws1")
    try:
        raised = wait_until("ws1's FreetokenHostDown in Alertmanager", lambda: firing(fleet, "ws1"), DOWN_FOR_S + 120)
        (alert,) = firing(fleet, "ws1")
        print(f"\nFreetokenHostDown for ws1 after {raised - t0:.1f} s (for: {DOWN_FOR_S} s):")
        print(json.dumps(alert, indent=2))
        # Not before its `for` (the scrape that saw it down came after the power-off).
        assert raised - t0 >= DOWN_FOR_S
        assert alert["labels"]["severity"] == "critical" and alert["labels"]["job"] == "freetoken-guard"
        assert "ws1" in alert["annotations"]["summary"] and "ws1" in alert["annotations"]["description"]
    finally:
        t1 = time.time()
        fleet.power_on("ws1")
    resolved = wait_until("ws1's alert resolved", lambda: not firing(fleet, "ws1"), 300)
    print(f"resolved {resolved - t1:.1f} s after power-on")


def test_a_host_its_owner_snoozed_then_powered_off_raises_nothing(alerting):
    fleet = alerting["fleet"]
    fleet.run("ws2", "freetoken-owner snooze 2h", check=True)
    try:
        wait_until(
            "ws2 yielded, as Prometheus sees it",
            lambda: query(fleet, 'freetoken_agent_mode{host="ws2", mode="yielded"} == 1'),
            120,
        )
        fleet.power_off("ws2")
        t0 = time.time()
        try:
            # Prometheus sees it down (the rule's condition but for the yield)...
            wait_until("ws2 down in Prometheus", lambda: query(fleet, 'up{host="ws2"} == 0'), 60)
            # ...and nothing fires for it for the whole `for` and well beyond.
            while time.time() < t0 + DOWN_FOR_S + 20:
                assert firing(fleet, "ws2") == [], "a host its owner snoozed raised FreetokenHostDown"
                pending = fetch(fleet, PROMETHEUS + "alerts")["data"]["alerts"]
                assert not [a for a in pending if a["labels"].get("host") == "ws2"], pending
                time.sleep(2)
        finally:
            fleet.power_on("ws2")
    finally:
        fleet.run("ws2", "freetoken-owner resume")
