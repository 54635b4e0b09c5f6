"""Prometheus and Alertmanager on the gateway host (alerting_enabled, operations/gateway.py
``prometheus_config``, ``alertmanager_config``, ``alerting``): the receivers come from the
settings, the configs pass Prometheus' own checks (``amtool check-config``, ``promtool check
config``), no secret is in a world-readable file, a command or a diff, and a converged host
changes nothing.

amtool and promtool come with Debian's `prometheus-alertmanager` and `prometheus` packages."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from freetoken_infra.core.layout import (
    ALERTMANAGER_CONFIG,
    ALERTMANAGER_DEFAULTS,
    ALERTMANAGER_SMTP_PASSWORD,
    GATEWAY_ALERT_RULES,
    PROMETHEUS_CONFIG,
    PROMETHEUS_DEFAULTS,
    PROMETHEUS_SCRAPE_KEY,
)
from freetoken_infra.core.settings import Settings, SettingsError, build_settings
from operations import gateway as gw
from tests.unit.fakehost import FakeHost

WEBHOOK = "https://hooks.example.org/services/T000/B000/webhook-token-0123456789"
PASSWORD = "smtp-password-0123456789"
SCRAPE_KEY = "scrape-key-0123456789"
MAIL = {
    "alert_email_to": ["ops@example.org", "owner@example.org"],
    "alert_email_from": "alerts@example.org",
    "alert_email_smarthost": "smtp.example.org:587",
    "alert_email_password_source": "env:FT_SMTP_PASSWORD",
}


def tool(name: str, *args: str) -> subprocess.CompletedProcess:
    path = shutil.which(name)
    assert path, f"{name} is missing: install Debian's prometheus and prometheus-alertmanager packages"
    run = subprocess.run([path, *args], capture_output=True, text=True, timeout=120)
    print(run.stdout, run.stderr)
    return run


def settings(**data) -> Settings:
    return build_settings("gw", {"alerting_enabled": True, **data})


# ------------------------------------------------------------------ Alertmanager's config
def test_receivers_come_from_the_settings_and_amtool_accepts_the_config(tmp_path):
    s = settings(alert_webhook_url=WEBHOOK, **MAIL)
    text = gw.alertmanager_config(s, smtp_password=True)
    (tmp_path / "alertmanager.yml").write_text(text)
    run = tool("amtool", "check-config", str(tmp_path / "alertmanager.yml"))
    assert run.returncode == 0, run.stdout + run.stderr
    doc = yaml.safe_load(text)
    assert doc["route"]["receiver"] == gw.ALERTMANAGER_RECEIVER
    assert doc["route"]["group_by"] == ["alertname", "host"]
    (receiver,) = doc["receivers"]
    assert receiver["webhook_configs"] == [{"url": WEBHOOK, "send_resolved": True}]
    assert receiver["email_configs"] == [{"to": "ops@example.org, owner@example.org", "send_resolved": True}]
    assert doc["global"] == {
        "smtp_smarthost": "smtp.example.org:587",
        "smtp_from": "alerts@example.org",
        "smtp_require_tls": True,
        "smtp_auth_username": "alerts@example.org",
        "smtp_auth_password_file": ALERTMANAGER_SMTP_PASSWORD,
    }


def test_the_password_is_never_in_the_config_only_its_root_only_file():
    s = settings(alert_email_username="relay-login", **MAIL)
    text = gw.alertmanager_config(s, smtp_password=True)
    assert PASSWORD not in text and "smtp_auth_password:" not in text
    assert yaml.safe_load(text)["global"]["smtp_auth_username"] == "relay-login"


def test_mail_without_a_password_logs_in_to_nobody(tmp_path):
    s = settings(**{k: v for k, v in MAIL.items() if k != "alert_email_password_source"})
    doc = yaml.safe_load(gw.alertmanager_config(s, smtp_password=False))
    assert "smtp_auth_password_file" not in doc["global"] and "smtp_auth_username" not in doc["global"]


def test_no_receiver_set_keeps_the_alerts_in_alertmanager_s_api(tmp_path):
    text = gw.alertmanager_config(settings(), smtp_password=False)
    (tmp_path / "alertmanager.yml").write_text(text)
    assert tool("amtool", "check-config", str(tmp_path / "alertmanager.yml")).returncode == 0
    assert yaml.safe_load(text)["receivers"] == [{"name": gw.ALERTMANAGER_RECEIVER}]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"alert_email_to": ["ops@example.org"]}, "alert_email_from"),
        ({"alert_email_to": ["ops@example.org"], "alert_email_from": "a@example.org"}, "alert_email_smarthost"),
        ({"alert_email_password_source": "env:PW"}, "alert_email_to"),
        ({**MAIL, "alert_email_to": ["not an address"]}, "alert_email_to"),
        ({**MAIL, "alert_email_from": "alerts"}, "alert_email_from"),
        ({**MAIL, "alert_email_username": "relay login"}, "alert_email_username"),
        ({**MAIL, "alert_email_to": ["ops@example.org\nbcc: x@example.org"]}, "alert_email_to"),
        ({**MAIL, "alert_email_smarthost": "smtp.example.org"}, "alert_email_smarthost"),
        ({**MAIL, "alert_email_smarthost": "smtp.example.org:70000"}, "alert_email_smarthost"),
        ({**MAIL, "alert_email_password_source": "hunter2"}, "alert_email_password_source"),
        ({"alert_webhook_url": "ftp://example.org/hook"}, "alert_webhook_url"),
        ({"alert_host_down_for_s": -1}, "alert_host_down_for_s"),
        ({"alert_agent_silent_s": 1}, "alert_agent_silent_s"),
    ],
)
def test_bad_alert_settings_name_host_and_field(data, field):
    with pytest.raises(SettingsError, match=f"host gw: setting '{field}'"):
        build_settings("gw", data)


def test_the_password_setting_names_a_source_never_the_password():
    with pytest.raises(SettingsError) as err:
        build_settings("gw", {**MAIL, "alert_email_password_source": "file:relative/" + PASSWORD})
    assert "alert_email_password_source" in str(err.value)


# ------------------------------------------------------------------ Prometheus' config
def test_prometheus_config_loads_the_rules_and_the_local_alertmanager_and_promtool_accepts_it(tmp_path):
    scrape = gw.scrape_config("192.0.2.5", Settings(), {"ws1": ("192.0.2.11", Settings())})
    s = settings(alert_evaluation_interval_s=2)
    text = gw.prometheus_config(scrape, s)
    doc = yaml.safe_load(text)
    assert doc["rule_files"] == [GATEWAY_ALERT_RULES]
    assert doc["alerting"]["alertmanagers"] == [{"static_configs": [{"targets": ["127.0.0.1:9093"]}]}]
    assert doc["global"]["scrape_interval"] == "2s" and doc["global"]["evaluation_interval"] == "2s"
    assert doc["scrape_configs"] == yaml.safe_load(scrape)["scrape_configs"]
    # promtool checks the files the config names: here, copies in tmp_path.
    rules = tmp_path / "rules.yml"
    rules.write_text(gw.alert_rules("gw", s, [gw.AlertTarget("ws1", True, True, False)]))
    (tmp_path / "key").write_text(SCRAPE_KEY + "\n")
    local = text.replace(GATEWAY_ALERT_RULES, str(rules)).replace(PROMETHEUS_SCRAPE_KEY, str(tmp_path / "key"))
    (tmp_path / "prometheus.yml").write_text(local)
    run = tool("promtool", "check", "config", str(tmp_path / "prometheus.yml"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS: 6 rules found" in run.stdout


def test_both_listen_on_loopback_only_and_alertmanager_has_no_cluster_port():
    assert gw.service_defaults(gw.PROMETHEUS_ARGS) == (
        '# Managed by freetoken-infra (deploys/gateway.py).\nARGS="--web.listen-address=127.0.0.1:9090"\n'
    )
    am = gw.service_defaults(gw.ALERTMANAGER_ARGS)
    assert '--web.listen-address=127.0.0.1:9093 --cluster.listen-address="' in am


def test_the_scrape_key_is_the_metrics_map_s_first():
    metrics = gw.keys_map(f"{SCRAPE_KEY} prometheus\nsecond-key-0123456789 grafana\n")
    assert gw.scrape_key(metrics) == SCRAPE_KEY
    assert gw.scrape_key(gw.METRICS_CLOSED) is None


# ------------------------------------------------------------------ the operation
RULES = "groups: []\n"


def op_args(**over) -> dict:
    s = settings(alert_webhook_url=WEBHOOK, **MAIL)
    scrape = gw.scrape_config("192.0.2.5", s, {"ws1": ("192.0.2.11", Settings())})
    args = {
        "prometheus": gw.prometheus_config(scrape, s),
        "alertmanager": gw.alertmanager_config(s, smtp_password=True),
        "rules": RULES,
        "scrape_key": SCRAPE_KEY,
        "smtp_password": PASSWORD,
        "webhook_url": WEBHOOK,
    }
    return {**args, **over}


SECRET_GROUP = {PROMETHEUS_SCRAPE_KEY, ALERTMANAGER_SMTP_PASSWORD, ALERTMANAGER_CONFIG}


def converged(args: dict, **over) -> FakeHost:
    files = {
        PROMETHEUS_SCRAPE_KEY: (SCRAPE_KEY + "\n", 640),
        ALERTMANAGER_SMTP_PASSWORD: (PASSWORD + "\n", 640),
        PROMETHEUS_DEFAULTS: gw.service_defaults(gw.PROMETHEUS_ARGS),
        ALERTMANAGER_DEFAULTS: gw.service_defaults(gw.ALERTMANAGER_ARGS),
        PROMETHEUS_CONFIG: args["prometheus"],
        ALERTMANAGER_CONFIG: (args["alertmanager"], 640),
        GATEWAY_ALERT_RULES: args["rules"],
        **over,
    }
    host = FakeHost(
        files=files,
        running={"prometheus.service", "prometheus-alertmanager.service"},
        enabled={"prometheus.service", "prometheus-alertmanager.service"},
    )

    def file_fact(path: str):
        if path not in host.files:
            return None
        data, mode = host.files[path]
        group = "prometheus" if path in SECRET_GROUP else "root"
        return {"user": "root", "group": group, "mode": mode, "size": len(data)}

    host.facts["File"] = file_fact
    return host


def test_a_converged_gateway_changes_nothing():
    args = op_args()
    assert converged(args).commands(gw.alerting, **args) == []


def test_a_bare_gateway_gets_secrets_created_0640_first_and_configs_checked_before_they_replace_any():
    args = op_args()
    host = FakeHost(running=set(), enabled=set())
    commands = host.commands(gw.alerting, **args)
    text = "\n".join(commands)
    for secret in (PASSWORD, SCRAPE_KEY, WEBHOOK):
        assert secret not in text
    for path in (PROMETHEUS_SCRAPE_KEY, ALERTMANAGER_SMTP_PASSWORD):
        create = commands.index(f"install -m 640 -o root -g prometheus /dev/null {path}")
        assert create < commands.index(f"upload {path}")
    assert commands.index(f"install -m 640 -o root -g prometheus /dev/null {ALERTMANAGER_CONFIG}.new") < commands.index(
        f"upload {ALERTMANAGER_CONFIG}.new"
    )
    check_am = f"amtool check-config {ALERTMANAGER_CONFIG}.new && mv -f {ALERTMANAGER_CONFIG}.new {ALERTMANAGER_CONFIG}"
    check_prom = f"promtool check config {PROMETHEUS_CONFIG}.new && mv -f {PROMETHEUS_CONFIG}.new {PROMETHEUS_CONFIG}"
    assert check_am in commands and check_prom in commands
    # The scrape key is written before promtool checks the config that names it.
    assert commands.index(f"upload {PROMETHEUS_SCRAPE_KEY}") < commands.index(check_prom)
    assert "systemctl restart prometheus" in commands and "systemctl restart prometheus-alertmanager" in commands
    assert any("enable" in c and "prometheus-alertmanager" in c for c in commands)


def test_changed_rules_alone_are_checked_and_prometheus_reloads():
    args = op_args()
    host = converged(args, **{GATEWAY_ALERT_RULES: "groups: [old]\n"})
    assert host.commands(gw.alerting, **args) == [
        f"promtool check rules {GATEWAY_ALERT_RULES}",
        "if systemctl is-active -q prometheus; then systemctl reload prometheus; else systemctl restart prometheus; fi",
    ]


def test_a_changed_receiver_reloads_alertmanager_only():
    args = op_args()
    old = gw.alertmanager_config(settings(), smtp_password=False)
    commands = converged(args, **{ALERTMANAGER_CONFIG: (old, 640)}).commands(gw.alerting, **args)
    assert f"upload {ALERTMANAGER_CONFIG}.new" in commands
    assert not any("reload prometheus;" in c or "restart prometheus" == c for c in commands)
    assert any("systemctl reload prometheus-alertmanager" in c for c in commands)


def test_no_password_removes_the_password_file():
    args = op_args(smtp_password=None)
    commands = converged(args).commands(gw.alerting, **args)
    assert f"rm -f {ALERTMANAGER_SMTP_PASSWORD}" in commands


def test_dry_diff_shows_the_password_key_and_webhook_masked(caplog):
    args = op_args()
    host = converged(
        args,
        **{
            ALERTMANAGER_SMTP_PASSWORD: ("old-smtp-password-0123\n", 640),
            PROMETHEUS_SCRAPE_KEY: ("old-scrape-key-0123456789\n", 640),
            ALERTMANAGER_CONFIG: (gw.alertmanager_config(settings(), smtp_password=False), 640),
        },
    )
    host.diff = True
    caplog.set_level("INFO")
    host.commands(gw.alerting, **args)
    out = caplog.text
    assert f"Will modify {ALERTMANAGER_SMTP_PASSWORD}" in out and f"Will modify {PROMETHEUS_SCRAPE_KEY}" in out
    assert "******** (changed)" in out
    for secret in (PASSWORD, "old-smtp-password-0123", SCRAPE_KEY, "old-scrape-key-0123456789", WEBHOOK):
        assert secret not in out


def test_the_world_readable_files_hold_no_secret():
    """prometheus.yml and the rules are 0644: they name the key's file, never a key, a password
    or the webhook; alertmanager.yml (the webhook URL) is 0640 root:prometheus."""
    args = op_args()
    for text in (args["prometheus"], args["rules"], gw.service_defaults(gw.ALERTMANAGER_ARGS)):
        for secret in (PASSWORD, SCRAPE_KEY, WEBHOOK):
            assert secret not in text
    assert PROMETHEUS_SCRAPE_KEY in args["prometheus"]
