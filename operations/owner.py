"""
The host agent: ``freetoken-agent.service`` runs
``scripts/owner_agent.py`` as root. It answers HAProxy's ``agent-check`` on ``agent_port`` with
``up``, ``drain 0%`` or ``ready 100%``, and yields the GPU to the workstation's owner: other
processes' VRAM above ``owner_vram_threshold_gb`` (or the owner's ``freetoken-owner snooze``)
drains the host at the gateway, lets running streams finish, stops the engine and records why;
``owner_quiet_s`` after the claim is gone it starts the engine and reports ready once ``/health``
is ok. The decisions are ``freetoken_infra/core/owner.py`` (pure, uploaded beside the script).

Why root and not a user with a sudo rule: the agent stops and starts the engine, which a narrow
rule would also allow, but it must read the engine's key (root's 0600 file) for
``prepare-stop`` and ``/v1/stats``, and keep its state where the engine's user cannot write;
the guard, which stops the engine too, runs as root for the same reasons. Its unit confines it:
read-only system, its one writable folder root's state folder, no new privileges.
"""

from __future__ import annotations

import ipaddress
import re

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.files import File
from pyinfra.operations import files, systemd

from facts.windows import (
    RESUME_SHORTCUT,
    SNOOZE_SHORTCUT,
    WINDOWS_SYSTEM32,
    OwnerShortcuts,
    WindowsUserProfile,
    WslConfFile,
    system32,
)
from freetoken_infra.core import agent_metrics, hostio, owner, wsl_ini
from freetoken_infra.core.layout import (
    AGENT_METRICS_MODULE,
    AGENT_RUN_DIR_NAME,
    AGENT_SCRIPT,
    AGENT_SOCKET,
    AGENT_STATE_FILE,
    AGENT_UNIT,
    DEFAULT_DRIVE_ROOT,
    ENGINE_UNIT,
    FIREWALL_LOADED,
    HOSTIO_MODULE,
    OWNER_COMMAND,
    OWNER_MODULE,
    OWNER_OVERRIDE_FILE,
    UNIT_DIR,
    HostLayout,
)
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.units import Section, UnitFile, managed_by, render, unit_command
from operations import managed, windows
from operations.managed import ManagedFile

UNIT_PATH = f"{UNIT_DIR}/{AGENT_UNIT}"
SOCKET_PATH = f"{UNIT_DIR}/{AGENT_SOCKET}"
REBOOT_LOOKS = 12


def engine_url(settings: Settings) -> str:
    """The engine as the agent reaches it on the host: loopback when it listens everywhere."""
    address = ipaddress.ip_address(str(settings.listen_host))
    if address.is_unspecified:
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"http://{host}:{settings.listen_port}"


def agent_unit(settings: Settings, system32: str = WINDOWS_SYSTEM32, firewall: bool = False) -> str:
    """The unit; ``system32``: ``C:\\Windows\\System32`` under the drive root the distro mounts
    (the agent runs Windows' tasklist.exe, reg.exe and PowerShell from there, never from PATH).
    With node_exporter the agent writes its samples into the textfile collector's folder (its
    one other writable folder); ``firewall``: the deploy keeps the firewall, whose table the
    agent reports live or not."""
    args = [
        "/usr/bin/python3",
        AGENT_SCRIPT,
        "serve",
        "--unit",
        ENGINE_UNIT,
        "--engine-url",
        engine_url(settings),
        "--key-file",
        HostLayout.of(settings).api_key_file,
        # where the engine listens: the gateway reaches the agent there (the firewall admits
        # the gateway host(s) only)
        "--bind",
        str(settings.listen_host),
        "--port",
        str(settings.agent_port),
        "--vram-threshold-gb",
        f"{settings.owner_vram_threshold_gb:g}",
        "--quiet-s",
        str(settings.owner_quiet_s),
        "--drain-timeout-s",
        f"{settings.owner_drain_timeout_s:g}",
        "--state-file",
        AGENT_STATE_FILE,
        "--override-file",
        OWNER_OVERRIDE_FILE,
        "--system32",
        system32,
        "--windows-interval-s",
        str(settings.owner_windows_interval_s),
        # Windows Update's flags change rarely: read every 12th look (every minute by default).
        "--reboot-interval-s",
        str(REBOOT_LOOKS * settings.owner_windows_interval_s),
    ]
    for app in settings.owner_apps:
        args += ["--app", app]
    if settings.owner_fullscreen:
        args.append("--fullscreen")
    if settings.owner_reboot_drain:
        args.append("--reboot-drain")
    if settings.serve_hours:
        args += ["--serve-hours", settings.serve_hours]
    layout = HostLayout.of(settings)
    if settings.node_exporter_enabled:
        args += ["--textfile", layout.agent_textfile]
    if firewall:
        args += ["--firewall-record", FIREWALL_LOADED]
    about = Section(
        "Unit",
        (
            ("Description", "FreeToken host agent: the gateway's agent-check, the GPU yielded to its owner"),
            # Its port comes from its socket unit, which systemd holds from boot.
            ("Requires", AGENT_SOCKET),
            ("After", f"network-online.target {ENGINE_UNIT} {AGENT_SOCKET}"),
        ),
    )
    service = Section(
        "Service",
        (
            ("Type", "simple"),
            # Root, not the engine's user: it stops and starts the engine and reads its key.
            ("ExecStart", unit_command(args)),
            ("SyslogIdentifier", "freetoken-agent"),
            ("Restart", "always"),
            ("RestartSec", "2"),
            ("NoNewPrivileges", "yes"),
            ("PrivateTmp", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            # It writes only its state, in its own runtime folder (root's 0755, kept across its
            # restarts); the owner's snooze it only reads. Never the engine's state_dir.
            ("RuntimeDirectory", AGENT_RUN_DIR_NAME),
            ("RuntimeDirectoryMode", "0755"),
            ("RuntimeDirectoryPreserve", "yes"),
            # node_exporter's textfile folder (root's 0755, made before the unit starts; "-": a folder
            # removed since is no failed start): its samples.
            *((("ReadWritePaths", f"-{layout.guard_textfile_dir}"),) if settings.node_exporter_enabled else ()),
        ),
    )
    install = Section("Install", (("WantedBy", "multi-user.target"),))
    return render(UnitFile(header=managed_by("operations/owner.py"), sections=(about, service, install)))


def agent_socket_unit(settings: Settings) -> str:
    """``freetoken-agent.socket``: the agent-check port on the engine's address, bound by systemd
    (root) at boot, before any service, so the engine's user can never take it first and answer
    the gateway in the agent's place; the agent is handed the listening socket."""
    address = ipaddress.ip_address(str(settings.listen_host))
    where = f"[{address}]" if address.version == 6 else str(address)
    about = Section(
        "Unit",
        (
            ("Description", "FreeToken host agent's agent-check port (held from boot, before the engine)"),
            ("Before", f"{ENGINE_UNIT} {AGENT_UNIT}"),
        ),
    )
    sock = Section(
        "Socket",
        (
            ("ListenStream", f"{where}:{settings.agent_port}"),
            # The engine's address may come up after the socket (a LAN address at boot).
            ("FreeBind", "yes"),
            ("Backlog", "16"),
        ),
    )
    install = Section("Install", (("WantedBy", "sockets.target"),))
    return render(UnitFile(header=managed_by("operations/owner.py"), sections=(about, sock, install)))


def owner_command() -> str:
    """``/usr/local/bin/freetoken-owner``: the agent's script in its ``owner`` mode."""
    return (
        "#!/bin/sh\n"
        f"# {managed_by('operations/owner.py')}\n"
        "# freetoken-owner snooze 2h | resume | status (snooze and resume as root)\n"
        f"exec /usr/bin/python3 {AGENT_SCRIPT} owner --state-file {AGENT_STATE_FILE} "
        f'--override-file {OWNER_OVERRIDE_FILE} "$@"\n'
    )


# The owner's Desktop shortcuts (Windows batch files, CRLF): snooze and resume through wsl.exe
# by its full path (a double-clicked .cmd runs in the Desktop folder, where cmd.exe would find a
# planted wsl.exe first).
# What WSL accepts as a distribution name (`wsl --import`): anything else never reaches a file
# the owner runs.
_DISTRO = re.compile(r"[A-Za-z0-9._-]{1,64}")


def shortcut_texts(distro: str) -> dict[str, bytes]:
    """The two shortcuts for ``distro`` (a checked WSL distribution name)."""
    if not _DISTRO.fullmatch(distro):
        raise ValueError(f"not a WSL distribution name: {distro!r}")
    wsl = f'"%SystemRoot%\\System32\\wsl.exe" -d {distro} -u root freetoken-owner'

    def cmd(what: str, verb: str) -> bytes:
        lines = [
            "@echo off",
            f"rem {managed_by('operations/owner.py')}",
            f"rem FreeToken: {what}",
            f"{wsl} {verb}",
            "pause",
        ]
        return ("\r\n".join(lines) + "\r\n").encode("ascii")

    return {
        SNOOZE_SHORTCUT: cmd("the engine leaves the GPU for 2 hours (freetoken-owner snooze 2h)", "snooze 2h"),
        RESUME_SHORTCUT: cmd("end the snooze, serve again once the GPU is free (freetoken-owner resume)", "resume"),
    }


def desktop_shortcuts(settings: Settings, root: str):
    """Write the owner's two shortcuts on their Windows Desktop (``owner_shortcuts``): only when
    the profile, the Desktop folder and a valid distro name are known, and only what differs."""
    moved = {} if root == DEFAULT_DRIVE_ROOT else {"drive_root": root}
    profile = host.get_fact(WindowsUserProfile, **moved)
    if profile.path is None:
        host.noop(f"no Windows user profile ({profile.error}): no Desktop shortcuts for the owner")
        return
    desktop = f"{profile.path}/Desktop"
    seen = host.get_fact(OwnerShortcuts, path=desktop)
    if seen.desktop_refused is not None:
        host.noop(f"{seen.desktop_refused}; root does not follow it: no shortcuts written")
        return
    if not seen.desktop_exists:
        host.noop(f"{desktop} is not a folder (a Desktop moved to OneDrive?): no shortcuts written")
        return
    if not _DISTRO.fullmatch(seen.distro):
        host.noop(f"the distro's Windows name is unknown or not a name ({seen.distro[:64]!r}): no shortcuts written")
        return
    writes = []
    for name, data in shortcut_texts(seen.distro).items():
        refused = seen.refused.get(name)
        if refused is not None and refused[1] in ("folder", "path", "error"):
            host.noop(f"{refused[0]}: that shortcut is not written")
            continue
        # A link, FIFO or oversize file at the name is not ours: replaced, by rename, never followed.
        if seen.files.get(name) != data:
            writes.append((f"{desktop}/{name}", data))
    if writes:
        yield from windows.upload_writer()
        for path, data in writes:
            yield windows.write_command(path, data)


@operation()
def agent(settings: Settings, firewall: bool = False):
    """
    Install the host agent: its script and modules, ``freetoken-agent.service`` (as root, enabled
    and running, restarted when they change) and ``freetoken-owner``. With
    ``settings.agent_enabled`` False the service is stopped and disabled. With node_exporter
    (``node_exporter_enabled``) it writes its samples (``core.agent_metrics``) for the textfile
    collector, whose folder is made here first.

    + settings: the host's ``Settings`` (``agent_*``, ``owner_*``, ``listen_host``, ``listen_port``)
    + firewall: the deploy keeps the host's firewall (the plan's ``firewall_present``): the agent
      reports whether its table is live

    **Example:**

    .. code:: python

        from operations.owner import agent
        agent(name="Host agent", settings=settings, _sudo=True)
    """
    if not settings.agent_enabled:
        if host.get_fact(File, path=UNIT_PATH):
            yield from systemd.service._inner(service=AGENT_UNIT, running=False, enabled=False)
        if host.get_fact(File, path=SOCKET_PATH):
            yield from systemd.service._inner(service=AGENT_SOCKET, running=False, enabled=False)
        return
    wslconf = host.get_fact(WslConfFile)
    root = wsl_ini.drive_root(wslconf.ini) if wslconf.ini is not None else DEFAULT_DRIVE_ROOT
    if settings.node_exporter_enabled:
        # The unit's ReadWritePaths= must exist before it starts (the guard and node_exporter
        # make it too, with the same owner and mode).
        yield from files.directory._inner(
            path=HostLayout.of(settings).guard_textfile_dir, user="root", group="root", mode="755"
        )
    changed = yield from managed.put(
        ManagedFile(HOSTIO_MODULE, local=hostio.__file__),
        ManagedFile(OWNER_MODULE, local=owner.__file__),
        ManagedFile(AGENT_METRICS_MODULE, local=agent_metrics.__file__),
        ManagedFile(AGENT_SCRIPT, local=managed.script_source("owner_agent.py"), mode="755"),
        ManagedFile(OWNER_COMMAND, text=owner_command(), mode="755"),
        ManagedFile(UNIT_PATH, text=agent_unit(settings, system32(root), firewall), unit=True),
    )
    socket_changed = yield from managed.put(ManagedFile(SOCKET_PATH, text=agent_socket_unit(settings), unit=True))
    if socket_changed:
        # The agent lets go of the port (an agent that bound it itself), the socket takes it.
        yield from systemd.service._inner(service=AGENT_UNIT, running=False)
    yield from managed.running(AGENT_SOCKET, changed=bool(socket_changed))
    yield from managed.running(AGENT_UNIT, changed=bool(changed - {OWNER_COMMAND} or socket_changed))
    if settings.owner_shortcuts:
        yield from desktop_shortcuts(settings, root)
