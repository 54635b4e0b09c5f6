"""The workstation's firewall (operations/firewall.py): the nft rule set that admits the engine's
ports and node_exporter's from loopback, the gateway host(s) and the settings' lists only, the
addresses it is made of (validated over the whole string), and the operation's commands with
the host's facts stubbed. The fleet tests load it for real and attack it from another host."""

from __future__ import annotations

import ipaddress

import pytest

from facts.firewall import FirewallTableInfo
from freetoken_infra.core.layout import FIREWALL_LOADED, FIREWALL_RULES, FIREWALL_UNIT
from freetoken_infra.core.settings import Settings, SettingsError, build_settings
from freetoken_infra.plan import firewall_needed
from operations import firewall as fw
from tests.unit.fakehost import FakeHost

GW = [ipaddress.ip_address("192.0.2.5")]


def rules(text: str) -> list[str]:
    """The input chain's rules, one per line."""
    body = text.split("chain input {", 1)[1].split("\n\t}", 1)[0]
    return [line.strip() for line in body.splitlines() if line.strip() and not line.strip().startswith("type ")]


def test_engine_ports_and_node_exporter_from_loopback_and_the_gateway_only():
    text = fw.ruleset(Settings(listen_host="0.0.0.0"), GW)
    assert rules(text) == [
        "iif lo accept",
        "ct state established,related accept",
        # the host agent's port (8010) from the gateway only
        "tcp dport { 8000, 8001, 8010, 9100 } ip saddr { 192.0.2.5 } accept",
        "tcp dport { 8000, 8001, 8010, 9100 } reject with tcp reset",
    ]
    # Our one table, replaced atomically (define, delete, define in one `nft -f`); nothing else.
    assert text.count("table inet freetoken") == 3 and "flush ruleset" not in text
    assert "policy accept" in text  # every other port is left to the host's own rules


def test_the_settings_lists_open_their_own_ports_only():
    settings = Settings(
        listen_host="0.0.0.0",
        listen_port=8100,
        node_exporter_port=9200,
        firewall_engine_from=["10.0.0.0/24", "fd00::/64"],
        firewall_metrics_from=["192.0.2.9"],
    )
    got = rules(fw.ruleset(settings, GW + [ipaddress.ip_address("fd00::5")]))
    assert "tcp dport { 8010, 8100, 8101, 9200 } ip6 saddr { fd00::5 } accept" in got
    assert "tcp dport { 8100, 8101 } ip saddr { 10.0.0.0/24 } accept" in got
    assert "tcp dport { 8100, 8101 } ip6 saddr { fd00::/64 } accept" in got
    assert "tcp dport 9200 ip saddr { 192.0.2.9/32 } accept" in got
    assert got[-1] == "tcp dport { 8010, 8100, 8101, 9200 } reject with tcp reset"
    # node_exporter and the agent disabled: their ports are no business of ours.
    off = rules(fw.ruleset(Settings(listen_host="0.0.0.0", node_exporter_enabled=False, agent_enabled=False), GW))
    assert off[-1] == "tcp dport { 8000, 8001 } reject with tcp reset"


def test_the_agent_port_is_the_gateways_only_never_the_engine_clients():
    settings = Settings(listen_host="0.0.0.0", agent_port=8020, firewall_engine_from=["10.0.0.0/24"])
    got = rules(fw.ruleset(settings, GW))
    assert "tcp dport { 8000, 8001, 8020, 9100 } ip saddr { 192.0.2.5 } accept" in got
    assert "tcp dport { 8000, 8001 } ip saddr { 10.0.0.0/24 } accept" in got
    assert got[-1] == "tcp dport { 8000, 8001, 8020, 9100 } reject with tcp reset"


def test_settings_lists_are_addresses_or_networks():
    s = build_settings("ws1", {"firewall_engine_from": "192.0.2.9, 10.0.0.0/8"})
    assert [str(n) for n in s.firewall_engine_from] == ["192.0.2.9/32", "10.0.0.0/8"]
    for bad in ("10.0.0.1/8", "ws2.lan", "10.0.0.1\ntcp dport 22 accept"):
        with pytest.raises(SettingsError, match="host ws1: setting 'firewall_metrics_from'"):
            build_settings("ws1", {"firewall_metrics_from": [bad]})


def commands(host: FakeHost, settings: Settings, gateways=GW) -> list[str]:
    return host.commands(fw.firewall, settings, gateways, present=firewall_needed(settings))


ON_LAN = Settings(listen_host="0.0.0.0")


LISTED = "table inet freetoken {\n\tchain input {\n\t}\n}\n"  # what nft lists (shortened)


INTACT = FirewallTableInfo(LISTED, LISTED)


def converged(settings=ON_LAN, table=INTACT):
    return FakeHost(
        files={FIREWALL_RULES: fw.ruleset(settings, GW), fw.UNIT_PATH: fw.unit()},
        packages={"nftables"},
        running={FIREWALL_UNIT},
        enabled={FIREWALL_UNIT},
        facts={"FirewallTable": table},
    )


@pytest.mark.parametrize(
    "table",
    [
        FirewallTableInfo(None, LISTED),  # `nft flush ruleset` (Debian's nftables.service does one)
        FirewallTableInfo(LISTED.replace("chain input", "chain input2"), LISTED),  # changed by hand
        FirewallTableInfo(LISTED, None),  # never recorded as loaded this boot
    ],
)
def test_a_table_flushed_or_changed_since_it_was_loaded_is_loaded_again(table):
    """The unit is oneshot + RemainAfterExit: after a flush it still reads `active`. The live
    table against the listing recorded at load time is what notices."""
    assert commands(converged(table=table), ON_LAN) == [f"systemctl reload {FIREWALL_UNIT}"]
    assert FirewallTableInfo(LISTED, LISTED).intact and not table.intact


def test_the_unit_records_the_table_as_loaded():
    unit = fw.unit()
    record = f'/bin/sh -c "/usr/sbin/nft list table inet freetoken > {FIREWALL_LOADED}"'
    assert f"ExecStartPost={record}" in unit and f"ExecReload={record}" in unit.splitlines()


def test_bare_host_gets_the_package_the_rules_and_the_unit_started_at_boot():
    cmds = commands(FakeHost(facts={"FirewallTable": FirewallTableInfo(None, None)}), ON_LAN)
    install = next(i for i, c in enumerate(cmds) if "apt-get" in c and "install" in c and "nftables" in c)
    assert install < cmds.index(f"upload {FIREWALL_RULES}") < cmds.index(f"upload {fw.UNIT_PATH}")
    assert "systemctl daemon-reload" in cmds
    assert f"systemctl start {FIREWALL_UNIT}" in cmds and f"systemctl enable {FIREWALL_UNIT}" in cmds
    unit = fw.unit()
    assert "WantedBy=sysinit.target" in unit and "Before=network-pre.target" in unit
    assert "ExecStop=/usr/sbin/nft delete table inet freetoken" in unit


def test_converged_host_runs_nothing_and_a_new_gateway_reloads_the_rules():
    assert commands(converged(), ON_LAN) == []
    cmds = commands(converged(), ON_LAN, gateways=[ipaddress.ip_address("192.0.2.6")])
    assert cmds[0] == f"upload {FIREWALL_RULES}" and cmds[-1] == f"systemctl reload {FIREWALL_UNIT}"
    assert f"upload {fw.UNIT_PATH}" not in cmds and "systemctl daemon-reload" not in cmds


def test_back_on_loopback_the_unit_stops_and_its_table_goes():
    assert commands(converged(), Settings()) == [
        f"systemctl stop {FIREWALL_UNIT}",
        f"systemctl disable {FIREWALL_UNIT}",
    ]
    assert commands(FakeHost(), Settings()) == []
