"""node_exporter on the serving hosts (operations/node_exporter.py) and the fleet's scrape config
pointing where it listens (operations/gateway.py): the bind address, the drop-in, the operation's
commands with the host's facts stubbed. The fleet tests run it for real over SSH."""

from __future__ import annotations

import pytest
import yaml

from freetoken_infra.core.layout import NODE_EXPORTER_DROPIN, NODE_EXPORTER_UNIT
from freetoken_infra.core.settings import Settings, SettingsError, build_settings
from freetoken_infra.plan import node_exporter_bind
from operations import gateway as gw
from operations import node_exporter as ne
from tests.unit.fakehost import FakeHost

TEXTFILE_DIR = "/var/lib/freetoken-deploy/metrics"


def test_settings_validate_port_and_bind():
    assert build_settings("ws1", {"node_exporter_port": 9200}).node_exporter_port == 9200
    with pytest.raises(SettingsError, match="node_exporter_port"):
        build_settings("ws1", {"node_exporter_port": 0})
    with pytest.raises(SettingsError, match="node_exporter_bind"):
        build_settings("ws1", {"node_exporter_bind": "not-an-address"})


def test_dropin_sets_listen_address_and_the_guards_textfile_folder_only():
    text = ne.dropin(Settings(node_exporter_port=9200), "192.0.2.11")
    assert text.splitlines()[1:] == [
        "[Service]",
        "ExecStart=",
        "ExecStart=/usr/bin/prometheus-node-exporter --web.listen-address=192.0.2.11:9200 "
        f"--collector.textfile.directory={TEXTFILE_DIR}",
    ]
    assert "--web.listen-address=[fd00::5]:9100" in ne.dropin(Settings(), "fd00::5")


def scrape_targets(workstations):
    text = gw.scrape_config("192.0.2.5", Settings(), workstations)
    jobs = {job["job_name"]: job for job in yaml.safe_load(text)["scrape_configs"]}
    return [t for c in jobs["freetoken-guard"]["static_configs"] for t in c["targets"]]


def test_scrape_config_names_where_each_host_listens():
    on_all = Settings(listen_host="0.0.0.0")
    hosts = {"ws1": ("192.0.2.11", on_all), "ws2": ("192.0.2.12", Settings(listen_host="192.0.2.12"))}
    targets = scrape_targets(hosts)
    assert targets == ["192.0.2.11:9100", "192.0.2.12:9100"]
    # ... the same address and port each host's node_exporter binds to.
    binds = [
        ne.listen_address(node_exporter_bind(s, n, a), s.node_exporter_port) for n, (a, s) in sorted(hosts.items())
    ]
    assert targets == binds
    pinned = Settings(listen_host="0.0.0.0", node_exporter_bind="10.0.0.7", node_exporter_port=9200)
    assert scrape_targets({"ws1": ("192.0.2.11", pinned)}) == ["10.0.0.7:9200"]
    assert scrape_targets({"ws1": ("192.0.2.11", Settings(node_exporter_enabled=False))}) == []


def commands(host: FakeHost, settings: Settings, bind: str = "127.0.0.1") -> list[str]:
    return host.commands(ne.node_exporter, settings, bind)


def converged(settings, bind="127.0.0.1"):
    return FakeHost(
        files={NODE_EXPORTER_DROPIN: ne.dropin(settings, bind)},
        dirs={TEXTFILE_DIR},
        packages={"prometheus-node-exporter"},
        running={NODE_EXPORTER_UNIT},
        enabled={NODE_EXPORTER_UNIT},
    )


def test_bare_host_gets_the_dropin_before_the_package():
    cmds = commands(FakeHost(), Settings())
    assert f"upload {NODE_EXPORTER_DROPIN}" in cmds
    install = next(
        i for i, c in enumerate(cmds) if "apt-get" in c and "install" in c and "prometheus-node-exporter" in c
    )
    assert cmds.index(f"upload {NODE_EXPORTER_DROPIN}") < cmds.index("systemctl daemon-reload") < install
    assert "--no-install-recommends" in cmds[install]


def test_converged_host_runs_nothing():
    assert commands(converged(Settings()), Settings()) == []


def test_a_changed_bind_rewrites_the_dropin_and_restarts_only_then():
    cmds = commands(converged(Settings()), Settings(), bind="192.0.2.11")
    assert cmds[0] == f"upload {NODE_EXPORTER_DROPIN}"
    assert "systemctl daemon-reload" in cmds and cmds[-1] == f"systemctl restart {NODE_EXPORTER_UNIT}"
    assert not any("apt-get" in c for c in cmds)


def test_disabled_stops_an_installed_exporter_and_installs_nothing():
    off = Settings(node_exporter_enabled=False)
    assert commands(converged(Settings()), off) == [
        f"systemctl stop {NODE_EXPORTER_UNIT}",
        f"systemctl disable {NODE_EXPORTER_UNIT}",
    ]
    assert commands(FakeHost(), off) == []
