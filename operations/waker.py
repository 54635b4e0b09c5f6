"""
The gateway's waker: ``freetoken-waker.service`` runs ``scripts/waker.py`` on
the gateway host as its own system user. Once a second it reads HAProxy's ``show stat`` through
a stats socket of its own (``level user``: read-only) and, when requests have queued for
``wake_on_lan_queue_s``, sends a magic packet to one parked host with ``wake_on_lan_mac`` within
its ``serve_hours`` (read in the gateway's local time) whose agent did not last say drain (``freetoken_infra/core/wol.py``: the policy, pure, uploaded beside
the script).

Least privilege: a UDP broadcast needs no capability, so the unit runs as ``freetoken-waker``
with an empty capability set, a read-only system, no home, only AF_UNIX and AF_INET sockets; it
reads its config (root's 0644, no secret) and the socket HAProxy makes for its user, and writes
nothing. Without any host with ``wake_on_lan_mac`` the service is stopped and disabled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.files import File
from pyinfra.operations import server, systemd

from freetoken_infra.core import owner, wol
from freetoken_infra.core.layout import (
    GATEWAY_BACKEND,
    OWNER_MODULE,
    UNIT_DIR,
    WAKER_CONFIG,
    WAKER_SCRIPT,
    WAKER_SOCKET,
    WAKER_UNIT,
    WAKER_USER,
    WOL_MODULE,
)
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.units import Section, UnitFile, managed_by, render, unit_command
from operations import managed
from operations.managed import ManagedFile

UNIT_PATH = f"{UNIT_DIR}/{WAKER_UNIT}"


def targets(every: Mapping[str, Settings]) -> list[dict]:
    """The hosts the waker may wake: serving hosts with ``wake_on_lan_mac``, by name. One MAC
    for two hosts is refused (a packet would wake both, or the wrong one)."""
    seen: dict[str, str] = {}
    out = []
    for name in sorted(every):
        s = every[name]
        if not s.runs_engine or s.wake_on_lan_mac is None:
            continue
        if s.wake_on_lan_mac in seen:
            raise ValueError(
                f"hosts {seen[s.wake_on_lan_mac]} and {name}: the same wake_on_lan_mac {s.wake_on_lan_mac}"
            )
        seen[s.wake_on_lan_mac] = name
        # serve_hours (validated by the settings): the waker reads it against the clock each time
        out.append({"name": name, "mac": s.wake_on_lan_mac, "serve_hours": s.serve_hours})
    return out


def waker_config(gw: Settings, hosts: list[dict]) -> str:
    return (
        json.dumps(
            {
                "socket": WAKER_SOCKET,
                "backend": GATEWAY_BACKEND,
                "broadcast": str(gw.wake_on_lan_broadcast),
                "port": wol.WOL_PORT,
                "queue_built_s": gw.wake_on_lan_queue_s,
                "cooldown_s": gw.wake_on_lan_cooldown_s,
                "boot_s": wol.BOOT_S,
                "targets": hosts,
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )


def waker_unit() -> str:
    about = Section(
        "Unit",
        (
            ("Description", "FreeToken waker: Wake-on-LAN for sleeping hosts when the gateway's queue builds"),
            ("After", "network-online.target haproxy.service"),
            ("Wants", "network-online.target"),
        ),
    )
    service = Section(
        "Service",
        (
            ("Type", "simple"),
            ("ExecStart", unit_command(["/usr/bin/python3", WAKER_SCRIPT, "--config", WAKER_CONFIG])),
            ("User", WAKER_USER),
            ("Group", WAKER_USER),
            ("SyslogIdentifier", "freetoken-waker"),
            ("Restart", "always"),
            ("RestartSec", "2"),
            # A UDP broadcast needs no capability: none at all.
            ("CapabilityBoundingSet", ""),
            ("AmbientCapabilities", ""),
            ("NoNewPrivileges", "yes"),
            ("PrivateTmp", "yes"),
            ("PrivateDevices", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            ("ProtectKernelTunables", "yes"),
            ("ProtectKernelModules", "yes"),
            ("ProtectControlGroups", "yes"),
            ("RestrictAddressFamilies", "AF_UNIX AF_INET"),
            ("RestrictNamespaces", "yes"),
            ("LockPersonality", "yes"),
            ("MemoryDenyWriteExecute", "yes"),
            ("SystemCallArchitectures", "native"),
        ),
    )
    install = Section("Install", (("WantedBy", "multi-user.target"),))
    return render(UnitFile(header=managed_by("operations/waker.py"), sections=(about, service, install)))


@operation()
def user():
    """
    The waker's system user (no login, no home): it must exist before HAProxy's config names it
    for the waker's stats socket.
    """
    # ensure_home=False: pyinfra would otherwise make /nonexistent, the home that must not exist.
    yield from server.user._inner(
        user=WAKER_USER,
        system=True,
        shell="/usr/sbin/nologin",
        home="/nonexistent",
        create_home=False,
        ensure_home=False,
    )


@operation()
def waker(gw: Settings, hosts: list[dict]):
    """
    Install the waker on the gateway host: its script and module, its config and
    ``freetoken-waker.service`` (as ``freetoken-waker``, enabled and running, restarted when they
    change). With no host to wake the service is stopped and disabled.

    + gw: the gateway host's ``Settings`` (``wake_on_lan_*``)
    + hosts: ``targets(...)`` of every host's settings
    """
    if not hosts:
        if host.get_fact(File, path=UNIT_PATH):
            yield from systemd.service._inner(service=WAKER_UNIT, running=False, enabled=False)
        return
    changed = yield from managed.put(
        ManagedFile(WOL_MODULE, local=wol.__file__),
        ManagedFile(OWNER_MODULE, local=owner.__file__),  # serve_hours: parsed and read as the agent does
        ManagedFile(WAKER_SCRIPT, local=managed.script_source("waker.py"), mode="755"),
        ManagedFile(WAKER_CONFIG, text=waker_config(gw, hosts)),
        ManagedFile(UNIT_PATH, text=waker_unit(), unit=True),
    )
    yield from managed.running(WAKER_UNIT, changed=bool(changed))
