"""
The memory guard: a systemd timer that runs ``scripts/guard.py`` every
``guard_interval_s`` seconds and stops the engine when swap passes ``guard_swap_limit_gb`` or
the engine records a CUDA out-of-memory failure of its own (its ERROR record of a backend death
by OOM, not OOM text in a prompt or reply it logged) (field report, operations advice).
"""

from __future__ import annotations

import os

from pyinfra.api import operation
from pyinfra.operations import files, systemd

from freetoken_infra.core import hostio
from freetoken_infra.core.layout import (
    DEFAULT_DRIVE_ROOT,
    DEPLOY_STATE_DIR,
    ENGINE_UNIT,
    GUARD_SCRIPT,
    GUARD_SERVICE,
    GUARD_TIMER,
    HOSTIO_MODULE,
    UNIT_DIR,
    HostLayout,
)
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.units import Section, UnitFile, managed_by, no_windows, render, unit_command, unit_word
from operations import managed
from operations.managed import ManagedFile


def guard_state_file(settings: Settings) -> str:
    """Written by the guard when it stops the engine; read by the ``GuardState`` fact. In root's
    own directory: the guard runs as root and must never write where the engine can plant a link."""
    return HostLayout.of(settings).guard_state_file


def guard_textfile(settings: Settings) -> str:
    """Samples for node_exporter's textfile collector (``--collector.textfile.directory``)."""
    return HostLayout.of(settings).guard_textfile


def guard_service_unit(settings: Settings, drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
    args = [
        "/usr/bin/python3",
        GUARD_SCRIPT,
        "--unit",
        ENGINE_UNIT,
        "--swap-limit-gb",
        f"{settings.guard_swap_limit_gb:g}",
        "--state-file",
        guard_state_file(settings),
        "--textfile",
        guard_textfile(settings),
    ]
    about = Section(
        "Unit",
        (
            ("Description", "FreeToken memory guard: stop the engine when swap or GPU memory runs out"),
            ("After", ENGINE_UNIT),
        ),
    )
    service = Section(
        "Service",
        (
            ("Type", "oneshot"),
            # Root, not the engine's user: it must be able to stop the engine.
            ("ExecStart", unit_command(args)),
            ("SyslogIdentifier", "freetoken-guard"),
            # `systemctl stop` waits for the engine to exit; a hung nvidia-smi must not pile up runs.
            ("TimeoutStartSec", "600"),
            ("NoNewPrivileges", "yes"),
            ("PrivateTmp", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "read-only"),
            # '-': no failure when the folder is not there yet. Root's own folder only, never the
            # engine's state_dir (the guard is root: a link planted there would aim its writes).
            ("ReadWritePaths", f"-{unit_word(DEPLOY_STATE_DIR, variables=False)}"),
            *no_windows(drive_root),
        ),
    )
    return render(UnitFile(header=managed_by("operations/guard.py"), sections=(about, service)))


def guard_timer_unit(settings: Settings) -> str:
    timer = Section(
        "Timer",
        (
            ("OnBootSec", "60"),
            ("OnUnitActiveSec", f"{settings.guard_interval_s}s"),
            ("AccuracySec", "1s"),
            ("Unit", GUARD_SERVICE),
        ),
    )
    about = Section("Unit", (("Description", f"Run the FreeToken memory guard every {settings.guard_interval_s} s"),))
    install = Section("Install", (("WantedBy", "timers.target"),))
    return render(UnitFile(header=managed_by("operations/guard.py"), sections=(about, timer, install)))


@operation()
def guard(settings: Settings, drive_root: str = DEFAULT_DRIVE_ROOT):
    """
    Install the memory guard: the script, ``freetoken-guard.service`` (oneshot, as root) and
    ``freetoken-guard.timer`` (every ``settings.guard_interval_s`` seconds), timer enabled and
    started. With ``settings.guard_enabled`` False the timer is stopped and disabled.

    + settings: the host's ``Settings`` (``guard_enabled``, ``guard_interval_s``,
      ``guard_swap_limit_gb``, ``state_dir``)

    **Example:**

    .. code:: python

        from freetoken_infra.core.settings import settings_for
        from operations.guard import guard
        guard(name="Memory guard", settings=settings_for(host), _sudo=True)
    """

    if not settings.guard_enabled:
        yield from systemd.service._inner(service=GUARD_TIMER, running=False, enabled=False)
        return

    # node_exporter (not root) reads the metrics; the guard creates the folder too, but a
    # collector pointed at it before the first run must find it.
    yield from files.directory._inner(
        path=os.path.dirname(guard_textfile(settings)),
        user="root",
        group="root",
        mode="755",
    )
    timer = f"{UNIT_DIR}/{GUARD_TIMER}"
    changed = yield from managed.put(
        # the module first: the timer may run the new script between two uploads
        ManagedFile(HOSTIO_MODULE, local=hostio.__file__),
        ManagedFile(GUARD_SCRIPT, local=managed.script_source("guard.py"), mode="755"),
        ManagedFile(f"{UNIT_DIR}/{GUARD_SERVICE}", text=guard_service_unit(settings, drive_root), unit=True),
        ManagedFile(timer, text=guard_timer_unit(settings), unit=True),
    )
    # A running timer keeps its old interval until restarted; the service is read at its next run.
    yield from managed.running(GUARD_TIMER, changed=timer in changed)


@operation()
def clear_guard_state(settings: Settings):
    """
    Remove the guard's tripped state, so that the doctor stops reporting it: run when the
    deploy (re)starts the engine. Yields nothing when there is no state file.

    + settings: the host's ``Settings`` (``state_dir``)

    **Example:**

    .. code:: python

        from operations.guard import clear_guard_state
        clear_guard_state(name="Forget the guard's last stop", settings=settings, _sudo=True)
    """

    yield from files.file._inner(path=guard_state_file(settings), present=False)
