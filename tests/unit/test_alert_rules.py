"""The fleet's alert rules (operations/gateway.py ``alert_rules``, docs/alerts.md) checked by
Prometheus' own tools: ``promtool check rules`` on the generated file, and ``promtool test rules``
on series that play each failure (the alert fires, with its labels and annotations, after its
``for``) and each owner's choice (a yield, a snooze, off schedule, a pending reboot, a wakeable PC
asleep: no alert). The series use the metric names the rules are generated with, so a renamed
metric breaks a case here; every rule must have a case that fires it.

promtool comes with Debian's `prometheus` package (the test command's apt list installs it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from freetoken_infra.core import owner
from freetoken_infra.core.settings import Settings
from operations import gateway as gw

PROMTOOL = shutil.which("promtool")
GATEWAY = "gw"
GATEWAY_INSTANCE = "192.0.2.5:8404"
SETTINGS = Settings(
    alert_host_down_for_s=120,
    alert_out_of_service_for_s=300,
    alert_queue_for_s=180,
    alert_agent_silent_s=120,
    alert_yield_memory_s=3600,
)
# ws1, ws2: agent and firewall; ws3: wakeable (asleep is the owner's choice); ws4: no agent, no firewall.
TARGETS = [
    gw.AlertTarget("ws1", agent=True, firewall=True, wakeable=False),
    gw.AlertTarget("ws2", agent=True, firewall=True, wakeable=False),
    gw.AlertTarget("ws3", agent=True, firewall=False, wakeable=True),
    gw.AlertTarget("ws4", agent=False, firewall=False, wakeable=False),
]
NODE = {f"ws{i}": f"192.0.2.{10 + i}:9100" for i in range(1, 5)}


def promtool(*args: str) -> subprocess.CompletedProcess:
    assert PROMTOOL, "promtool is missing: install Debian's prometheus package (apt-get install prometheus)"
    run = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)
    print(run.stdout, run.stderr)
    return run


def rules_text() -> str:
    return gw.alert_rules(GATEWAY, SETTINGS, TARGETS)


def rules_by_name() -> dict[str, dict]:
    return {r["alert"]: r for r in yaml.safe_load(rules_text())["groups"][0]["rules"]}


# ------------------------------------------------------------------ series
def up(host: str, values: str) -> dict:
    return {"series": f'up{{job="freetoken-guard", instance="{NODE[host]}", host="{host}"}}', "values": values}


def node(metric: str, host: str, values: str, **labels: str) -> dict:
    extra = "".join(f', {k}="{v}"' for k, v in labels.items())
    return {
        "series": f'{metric}{{job="freetoken-guard", instance="{NODE[host]}", host="{host}"{extra}}}',
        "values": values,
    }


def modes(host: str, mode: str, minutes: int, then: str = "stale") -> list[dict]:
    """The agent's mode samples (1 for `mode`, 0 for the others) for `minutes`, then `then`."""
    return [
        node("freetoken_agent_mode", host, f"{1 if m == mode else 0}x{minutes} {then}", mode=m) for m in owner.MODES
    ]


def server_status(host: str, state: str, values: str) -> dict:
    return {
        "series": f'haproxy_server_status{{job="freetoken-gateway", instance="{GATEWAY_INSTANCE}", '
        f'proxy="freetoken", server="{host}", state="{state}"}}',
        "values": values,
    }


def node_labels(host: str) -> dict:
    return {"job": "freetoken-guard", "instance": NODE[host], "host": host}


def alert(name: str, **labels: str) -> dict:
    """An expected alert: its labels and its annotations rendered for its host."""
    rule = rules_by_name()[name]
    labels = {**labels, **rule["labels"]}
    host = labels["host"]
    return {
        "exp_labels": labels,
        "exp_annotations": {k: v.replace("{{ $labels.host }}", host) for k, v in rule["annotations"].items()},
    }


# Each case: (what it plays, input series, [(eval time, alert, expected alerts)]).
# A case whose expected list is empty is an owner's choice or a not-yet: the alert stays silent.
CASES: list[tuple[str, list[dict], list[tuple[str, str, list[dict]]]]] = [
    (
        "a serving host powered off: down after alert_host_down_for_s",
        [up("ws1", "1x5 0x20"), *modes("ws1", "serving", 5)],
        [
            ("6m", gw.HOST_DOWN, []),  # not before its `for`
            ("10m", gw.HOST_DOWN, [alert(gw.HOST_DOWN, **node_labels("ws1"))]),
        ],
    ),
    (
        "a host that yielded (a game, a snooze, off schedule), then was powered off: no alert",
        [up("ws2", "1x5 0x30"), *modes("ws2", "yielded", 5)],
        [("20m", gw.HOST_DOWN, [])],
    ),
    (
        "a host held for a pending reboot, then gone: no alert",
        [up("ws2", "1x5 0x30"), *modes("ws2", "held", 5)],
        [("20m", gw.HOST_DOWN, [])],
    ),
    (
        "a host yielded, then back serving, then gone: its last mode counts, the alert fires",
        [
            up("ws1", "1x10 0x20"),
            node("freetoken_agent_mode", "ws1", "0x4 1x5 stale", mode="serving"),
            node("freetoken_agent_mode", "ws1", "1x4 0x5 stale", mode="yielded"),
        ],
        [("20m", gw.HOST_DOWN, [alert(gw.HOST_DOWN, **node_labels("ws1"))])],
    ),
    (
        "a yielded host gone longer than alert_yield_memory_s: reported once its yield is forgotten",
        [up("ws2", "1x5 0x80"), *modes("ws2", "yielded", 5)],
        [("30m", gw.HOST_DOWN, []), ("75m", gw.HOST_DOWN, [alert(gw.HOST_DOWN, **node_labels("ws2"))])],
    ),
    (
        "a wakeable PC asleep within its hours (the waker wakes it): no alert",
        [up("ws3", "1x5 0x30"), *modes("ws3", "serving", 5)],
        [("20m", gw.HOST_DOWN, [])],
    ),
    (
        "a host without an agent powered off: down",
        [up("ws4", "1x5 0x20")],
        [("10m", gw.HOST_DOWN, [alert(gw.HOST_DOWN, **node_labels("ws4"))])],
    ),
    (
        "a powered, serving host that HAProxy keeps DOWN: out of service after its `for`",
        [
            up("ws1", "1x20"),
            *modes("ws1", "serving", 20, then="1"),
            server_status("ws1", "DOWN", "1x20"),
            server_status("ws1", "UP", "0x20"),
        ],
        [
            ("3m", gw.OUT_OF_SERVICE, []),
            (
                "8m",
                gw.OUT_OF_SERVICE,
                [
                    alert(
                        gw.OUT_OF_SERVICE,
                        host="ws1",
                        server="ws1",
                        proxy="freetoken",
                        state="DOWN",
                        job="freetoken-gateway",
                        instance=GATEWAY_INSTANCE,
                    )
                ],
            ),
        ],
    ),
    (
        "a yielded host whose engine is stopped (HAProxy DOWN): no out-of-service alert",
        [up("ws1", "1x20"), *modes("ws1", "yielded", 20, then="1"), server_status("ws1", "DOWN", "1x20")],
        [("15m", gw.OUT_OF_SERVICE, [])],
    ),
    (
        "a host drained by its operator (HAProxy MAINT) or its agent (DRAIN): no out-of-service alert",
        [
            up("ws1", "1x20"),
            up("ws2", "1x20"),
            *modes("ws1", "serving", 20, then="1"),
            *modes("ws2", "serving", 20, then="1"),
            server_status("ws1", "MAINT", "1x20"),
            server_status("ws1", "DOWN", "0x20"),
            server_status("ws2", "DRAIN", "1x20"),
            server_status("ws2", "DOWN", "0x20"),
        ],
        [("15m", gw.OUT_OF_SERVICE, [])],
    ),
    (
        "a powered-off host is down, not out of service (one alert, FreetokenHostDown)",
        [up("ws2", "1x2 0x20"), *modes("ws2", "yielded", 2), server_status("ws2", "DOWN", "1x20")],
        [("15m", gw.OUT_OF_SERVICE, [])],
    ),
    (
        "requests queued at the gateway without a break: the queue builds",
        [
            {
                "series": f'haproxy_backend_current_queue{{job="freetoken-gateway", instance="{GATEWAY_INSTANCE}", '
                'proxy="freetoken"}',
                "values": "0x2 3x10",
            }
        ],
        [
            ("4m", gw.QUEUE_BUILDING, []),
            (
                "8m",
                gw.QUEUE_BUILDING,
                [
                    alert(
                        gw.QUEUE_BUILDING,
                        host=GATEWAY,
                        proxy="freetoken",
                        job="freetoken-gateway",
                        instance=GATEWAY_INSTANCE,
                    )
                ],
            ),
        ],
    ),
    (
        "a queue that drains between bursts: no alert",
        [
            {
                "series": f'haproxy_backend_current_queue{{job="freetoken-gateway", instance="{GATEWAY_INSTANCE}", '
                'proxy="freetoken"}',
                "values": "2 2 0 2 2 0 2 2 0 2 2 0",
            }
        ],
        [("11m", gw.QUEUE_BUILDING, [])],
    ),
    (
        "the guard stopped an engine for memory",
        [node("freetoken_guard_tripped", "ws2", "0x3 1x10"), node("freetoken_guard_tripped", "ws1", "0x13")],
        [
            ("2m", gw.ENGINE_STOPPED_FOR_MEMORY, []),
            ("8m", gw.ENGINE_STOPPED_FOR_MEMORY, [alert(gw.ENGINE_STOPPED_FOR_MEMORY, **node_labels("ws2"))]),
        ],
    ),
    (
        "a firewall table gone on a host that needs one; none needed on ws4: no alert there",
        [
            node("freetoken_firewall_table_loaded", "ws1", "1x3 0x10"),
            node("freetoken_firewall_table_loaded", "ws2", "1x13"),
            node("freetoken_firewall_table_loaded", "ws4", "0x13"),
        ],
        [
            ("2m", gw.FIREWALL_TABLE_GONE, []),
            ("8m", gw.FIREWALL_TABLE_GONE, [alert(gw.FIREWALL_TABLE_GONE, **node_labels("ws1"))]),
        ],
    ),
    (
        "a host agent whose loop stopped (its last timestamp gets old): silent",
        # The value is the sample's own time in seconds until minute 5, then it stays.
        [up("ws1", "1x20"), node("freetoken_agent_last_loop_timestamp_seconds", "ws1", "0+60x5 300x15")],
        [
            ("6m", gw.AGENT_SILENT, []),
            ("10m", gw.AGENT_SILENT, [alert(gw.AGENT_SILENT, **node_labels("ws1"))]),
        ],
    ),
    (
        "a host agent that writes nothing while node_exporter answers: silent",
        [up("ws2", "1x20")],
        [("5m", gw.AGENT_SILENT, [alert(gw.AGENT_SILENT, **node_labels("ws2"))])],
    ),
    (
        "a yielded host's agent keeps looping; a powered-off host's agent and a host without one: no alert",
        [
            up("ws1", "1x20"),
            node("freetoken_agent_last_loop_timestamp_seconds", "ws1", "0+60x20"),
            *modes("ws1", "yielded", 20, then="1"),
            up("ws2", "1x3 0x17"),
            node("freetoken_agent_last_loop_timestamp_seconds", "ws2", "0+60x3 stale"),
            up("ws4", "1x20"),
        ],
        [("15m", gw.AGENT_SILENT, [])],
    ),
]


def promtool_tests() -> dict:
    return {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "name": what,
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": at, "alertname": name, "exp_alerts": expected} for at, name, expected in checks
                ],
            }
            for what, series, checks in CASES
        ],
    }


def write(tmp_path: Path) -> Path:
    (tmp_path / "rules.yml").write_text(rules_text())
    test = tmp_path / "rules_test.yml"
    test.write_text(yaml.safe_dump(promtool_tests(), sort_keys=False))
    return test


# ------------------------------------------------------------------ the tests
def test_promtool_checks_the_generated_rules(tmp_path):
    write(tmp_path)
    run = promtool("check", "rules", str(tmp_path / "rules.yml"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(rules_by_name())} rules found" in run.stdout


def test_every_failure_fires_and_every_owner_choice_stays_silent(tmp_path):
    test = write(tmp_path)
    run = promtool("test", "rules", str(test))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_a_wrong_expectation_fails_promtool(tmp_path):
    """The harness can fail: a yielded host powered off, expected to raise an alert, does not."""
    write(tmp_path)
    doc = promtool_tests()
    doc["tests"] = [
        {
            "interval": "1m",
            "input_series": [up("ws2", "1x5 0x30"), *modes("ws2", "yielded", 5)],
            "alert_rule_test": [
                {
                    "eval_time": "20m",
                    "alertname": gw.HOST_DOWN,
                    "exp_alerts": [alert(gw.HOST_DOWN, **node_labels("ws2"))],
                }
            ],
        }
    ]
    (tmp_path / "wrong_test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    run = promtool("test", "rules", str(tmp_path / "wrong_test.yml"))
    assert run.returncode != 0 and "FAILED" in run.stdout + run.stderr


def test_every_rule_has_a_case_that_fires_it_and_one_that_keeps_it_silent():
    fired = {name for _, _, checks in CASES for _, name, expected in checks if expected}
    silent = {name for _, _, checks in CASES for _, name, expected in checks if not expected}
    rules = set(rules_by_name())
    assert rules == fired, f"rules without a promtool case that fires them: {sorted(rules - fired)}"
    assert rules <= silent, f"rules without a case where they stay silent: {sorted(rules - silent)}"
    assert rules == {
        gw.HOST_DOWN,
        gw.OUT_OF_SERVICE,
        gw.QUEUE_BUILDING,
        gw.ENGINE_STOPPED_FOR_MEMORY,
        gw.FIREWALL_TABLE_GONE,
        gw.AGENT_SILENT,
    }


def test_each_rule_has_a_for_a_severity_and_names_its_host():
    for name, rule in rules_by_name().items():
        assert "for" in rule and rule["labels"]["severity"] in ("warning", "critical"), name
        host = rule["labels"].get("host", "{{ $labels.host }}")
        assert host in rule["annotations"]["summary"] and host in rule["annotations"]["description"], name


def test_the_for_durations_come_from_the_settings():
    rules = rules_by_name()
    assert rules[gw.HOST_DOWN]["for"] == "120s" and "[3600s]" in rules[gw.HOST_DOWN]["expr"]
    assert rules[gw.OUT_OF_SERVICE]["for"] == "300s"
    assert rules[gw.QUEUE_BUILDING]["for"] == "180s"
    assert "> 120" in rules[gw.AGENT_SILENT]["expr"]
    other = yaml.safe_load(gw.alert_rules(GATEWAY, Settings(alert_host_down_for_s=30), TARGETS))
    assert {r["alert"]: r["for"] for r in other["groups"][0]["rules"]}[gw.HOST_DOWN] == "30s"


def test_rules_that_concern_no_host_are_left_out_and_host_names_are_escaped():
    plain = [gw.AlertTarget("ws.1", agent=False, firewall=False, wakeable=True)]
    names = {r["alert"]: r for r in yaml.safe_load(gw.alert_rules(GATEWAY, SETTINGS, plain))["groups"][0]["rules"]}
    assert gw.FIREWALL_TABLE_GONE not in names and gw.AGENT_SILENT not in names
    # The '.' of a host name matches itself only (ws.1 must not exclude ws11).
    assert 'host!~"ws\\\\.1"' in names[gw.HOST_DOWN]["expr"]


def test_alert_targets_follow_the_settings():
    hosts = {
        "ws2": Settings(wake_on_lan_mac="aa:bb:cc:dd:ee:ff"),
        "ws10": Settings(agent_enabled=False),
        "ws1": Settings(),
        "ws3": Settings(node_exporter_enabled=False),
    }
    assert gw.alert_targets(hosts, firewall={"ws1"}) == [
        gw.AlertTarget("ws1", agent=True, firewall=True, wakeable=False),
        gw.AlertTarget("ws2", agent=True, firewall=False, wakeable=True),
        gw.AlertTarget("ws10", agent=False, firewall=False, wakeable=False),
    ]


def test_the_owner_modes_are_the_agents_and_the_guard_writes_the_sample_the_rule_reads():
    from operations.scripts import guard

    assert set(gw.OWNER_MODES) == {owner.YIELDING, owner.YIELDED, owner.HELD} < set(owner.MODES)
    assert "freetoken_guard_tripped 1" in guard.render_metrics({}, True, 0.0).splitlines()
    assert "freetoken_guard_tripped == 1" in rules_by_name()[gw.ENGINE_STOPPED_FOR_MEMORY]["expr"]


@pytest.mark.parametrize("metric", ["freetoken_agent_mode", "freetoken_guard_tripped", "haproxy_server_status"])
def test_the_rules_read_the_metrics_the_agent_guard_and_haproxy_write(metric):
    assert metric in rules_text()
