"""The workstation's firewall: nftables from the distribution admits the engine's ports and
node_exporter's only from loopback, the inventory's gateway host(s) and the addresses the
settings name (``firewall_engine_from``, ``firewall_metrics_from``). Behind a
gateway the engines listen on every address, and the fleet's engine key (in every
engine's environment) or node_exporter's unauthenticated ``/metrics`` must not be one LAN hop
away from anyone.

Why a firewall and not one engine key per host held by the gateway: HAProxy 2.6 (Debian 12)
sets request headers before it picks the server, so a per-host key needs a second proxy hop per
host; and a per-host key still lets anyone on the LAN who learns it talk to that engine
directly. With the engine port closed to all but the gateway, a key taken from one workstation
opens no engine from anywhere else on the LAN, and node_exporter needs no web config of its own.

One table of ours (``table inet freetoken``), loaded at boot before the network is up by a unit
of ours (``freetoken-firewall.service``): other tables and Debian's ``/etc/nftables.conf`` are
left alone. The rule set replaces itself atomically (``nft -f``: define, delete, define in one
transaction). ``firewall_enabled`` False, or nothing listening beyond loopback, stops the unit,
which deletes the table (the package stays).

The pure parts (``ruleset``, ``unit``) are unit-tested; whether the firewall is needed and the
gateways' addresses are the deploy's plan's (freetoken_infra/plan.py).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import File
from pyinfra.operations import apt, systemd

from facts.firewall import FirewallTable
from freetoken_infra.core.addresses import Address
from freetoken_infra.core.layout import (
    FIREWALL_LOADED,
    FIREWALL_NFT,
    FIREWALL_PACKAGE,
    FIREWALL_RULES,
    FIREWALL_TABLE,
    FIREWALL_UNIT,
    UNIT_DIR,
)
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.units import Section, UnitFile, managed_by, render
from operations import managed
from operations.managed import ManagedFile

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _ports(ports: Iterable[int]) -> str:
    unique = sorted(set(ports))
    return str(unique[0]) if len(unique) == 1 else "{ " + ", ".join(map(str, unique)) + " }"


def _accept(ports: str, sources: Sequence[Address | Network]) -> list[str]:
    """`accept` rules for `sources` (one per address family) on `ports`."""
    lines = []
    for family, version in (("ip", 4), ("ip6", 6)):
        mine = sorted({str(s) for s in sources if s.version == version})
        if mine:
            lines.append(f"tcp dport {ports} {family} saddr {{ {', '.join(mine)} }} accept")
    return lines


def ruleset(settings: Settings, gateways: Sequence[Address]) -> str:
    """The nft rule set: the engine's port and port+1 (its gloo group) and node_exporter's port
    from loopback, the gateways and the settings' lists, the host agent's port from loopback and
    the gateways only; every other source is reset."""
    engine = [settings.listen_port, settings.listen_port + 1]
    metrics = [settings.node_exporter_port] if settings.node_exporter_enabled else []
    # The host agent's agent-check answers: the gateway's business only.
    agent = [settings.agent_port] if settings.agent_enabled else []
    rules = [
        "iif lo accept",
        # Replies of the host's own outgoing connections, whatever their local port.
        "ct state established,related accept",
        *_accept(_ports(engine + metrics + agent), gateways),
        *_accept(_ports(engine), settings.firewall_engine_from),
        *(_accept(_ports(metrics), settings.firewall_metrics_from) if metrics else []),
        f"tcp dport {_ports(engine + metrics + agent)} reject with tcp reset",
    ]
    body = "\n".join(f"\t\t{r}" for r in rules)
    return f"""# {managed_by("operations/firewall.py")}
# The engine's and node_exporter's ports: loopback, the gateway host(s) and the firewall_*_from
# settings only. Loaded by {FIREWALL_UNIT}; other tables are left alone.
add table inet {FIREWALL_TABLE}
delete table inet {FIREWALL_TABLE}
table inet {FIREWALL_TABLE} {{
\tchain input {{
\t\ttype filter hook input priority filter; policy accept;
{body}
\t}}
}}
"""


def unit() -> str:
    """The unit that loads the rule set at boot, before the network (as Debian's nftables.service
    does, and after it: its `flush ruleset` would remove ours)."""
    load = f"{FIREWALL_NFT} -f {FIREWALL_RULES}"
    # The table as loaded, for the deploy's FirewallTable fact: a flush since lists otherwise.
    record = f'/bin/sh -c "{FIREWALL_NFT} list table inet {FIREWALL_TABLE} > {FIREWALL_LOADED}"'
    return render(
        UnitFile(
            header=managed_by("operations/firewall.py"),
            sections=(
                Section(
                    "Unit",
                    (
                        (
                            "Description",
                            "freetoken-infra: the engine's and node_exporter's ports from the gateway only",
                        ),
                        ("DefaultDependencies", "no"),
                        ("Wants", "network-pre.target"),
                        ("After", "nftables.service"),
                        ("Before", "network-pre.target shutdown.target"),
                        ("Conflicts", "shutdown.target"),
                    ),
                ),
                Section(
                    "Service",
                    (
                        ("Type", "oneshot"),
                        ("RemainAfterExit", "yes"),
                        ("ExecStart", load),
                        ("ExecStartPost", record),
                        ("ExecReload", load),
                        ("ExecReload", record),
                        ("ExecStop", f"{FIREWALL_NFT} delete table inet {FIREWALL_TABLE}"),
                    ),
                ),
                Section("Install", (("WantedBy", "sysinit.target"),)),
            ),
        )
    )


UNIT_PATH = f"{UNIT_DIR}/{FIREWALL_UNIT}"


@operation()
def firewall(settings: Settings, gateways: Sequence[Address], present: bool = True):
    """
    nftables from the distribution: the engine's and node_exporter's ports only from loopback,
    `gateways` and the ``firewall_*_from`` settings, while anything of ours listens beyond
    loopback; otherwise our unit is stopped (its table deleted).

    + settings: the host's ``Settings``
    + gateways: the inventory's gateway addresses (``freetoken_infra.plan.gateway_addresses``)
    + present: ``False`` (nothing listens beyond loopback, or ``firewall_enabled`` is off; the
      plan's ``firewall_needed``) stops our unit, which deletes the table

    **Example:**

    .. code:: python

        firewall(name="Firewall: engine ports from the gateway only", settings=settings,
                 gateways=[ipaddress.ip_address("192.168.1.5")], _sudo=True)
    """
    if not present:
        if host.get_fact(File, path=UNIT_PATH):
            yield from systemd.service._inner(service=FIREWALL_UNIT, running=False, enabled=False)
        return
    if FIREWALL_PACKAGE not in (host.get_fact(DebPackages) or {}):
        yield from apt.update._inner()
        yield from apt.packages._inner(packages=[FIREWALL_PACKAGE], no_recommends=True)
    changed = yield from managed.put(
        ManagedFile(FIREWALL_RULES, text=ruleset(settings, gateways)),
        ManagedFile(UNIT_PATH, text=unit(), unit=True),
    )
    # A table flushed or changed by hand since its unit loaded it (the unit still reads `active`)
    # is loaded again, as a changed rule set is: in one nft transaction (reload).
    table = host.get_fact(FirewallTable)
    yield from managed.running(FIREWALL_UNIT, changed=bool(changed) or not table.intact, reload=True)
