"""
Debian's ``prometheus-node-exporter`` on a serving host, its textfile collector reading the
guard's samples (``HostLayout.guard_textfile_dir``), listening where the fleet's scrape config
(operations/gateway.py ``scrape_config``) points: ``node_exporter_bind``, else the engine's
``listen_host``, else (an engine on every address) the address the fleet reaches the host by.
Never every interface unless a setting says so. Our flags live in a drop-in of the package's
unit, written before the package is installed, so its first start already listens there; the
exporter restarts only when that drop-in changes. ``node_exporter_enabled`` False stops and
disables it (the package stays).
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt, files, systemd

from freetoken_infra.core.layout import (
    NODE_EXPORTER_BINARY,
    NODE_EXPORTER_DROPIN,
    NODE_EXPORTER_PACKAGE,
    NODE_EXPORTER_UNIT,
    HostLayout,
)
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.units import Section, UnitFile, managed_by, render, unit_command
from operations import managed
from operations.managed import ManagedFile


def scrape_address(settings: Settings, reached_at: str) -> str:
    """Where the fleet's scrape config finds a host's node_exporter, `reached_at` being where
    the gateway reaches its engine: ``node_exporter_bind`` when it names one address."""
    bind = settings.node_exporter_bind
    if bind is not None and not bind.is_unspecified:
        return str(bind)
    return reached_at


def listen_address(bind: str, port: int) -> str:
    """``--web.listen-address``: ``ADDR:PORT``, an IPv6 address in brackets."""
    return f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"


def dropin(settings: Settings, bind: str) -> str:
    """The drop-in of Debian's unit: our listen address and textfile folder, nothing else."""
    argv = [
        NODE_EXPORTER_BINARY,
        f"--web.listen-address={listen_address(bind, settings.node_exporter_port)}",
        f"--collector.textfile.directory={HostLayout.of(settings).guard_textfile_dir}",
    ]
    # The package's ExecStart= emptied first: a service has one command, ours.
    section = Section("Service", (("ExecStart", ""), ("ExecStart", unit_command(argv))))
    return render(UnitFile(header=managed_by("operations/node_exporter.py"), sections=(section,)))


@operation()
def node_exporter(settings: Settings, bind: str):
    """
    Install and run Debian's node_exporter on ``bind``, reading the guard's textfile folder.

    + settings: the host's ``Settings`` (``node_exporter_enabled``, ``node_exporter_port``)
    + bind: the address to listen on (the deploy's plan: ``freetoken_infra.plan.node_exporter_bind``)

    **Example:**

    .. code:: python

        node_exporter(name="Metrics: node_exporter", settings=settings, bind="192.168.1.20", _sudo=True)
    """

    installed = NODE_EXPORTER_PACKAGE in (host.get_fact(DebPackages) or {})
    if not settings.node_exporter_enabled:
        if installed:
            yield from systemd.service._inner(service=NODE_EXPORTER_UNIT, running=False, enabled=False)
        return

    # The folder the collector reads exists before the guard's first run (the guard's operation
    # makes it too, with the same owner and mode).
    yield from files.directory._inner(
        path=HostLayout.of(settings).guard_textfile_dir, user="root", group="root", mode="755"
    )
    changed = yield from managed.put(ManagedFile(NODE_EXPORTER_DROPIN, text=dropin(settings, bind), unit=True))
    if not installed:
        # Started by the package with the drop-in already in place: never on every interface.
        yield from apt.update._inner()
        yield from apt.packages._inner(packages=[NODE_EXPORTER_PACKAGE], no_recommends=True)
    yield from managed.running(NODE_EXPORTER_UNIT, changed=bool(changed))
