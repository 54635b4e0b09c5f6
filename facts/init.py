"""Fact about the init system: the engine runs as a systemd unit, which needs systemd as PID 1
(``[boot] systemd=true`` in ``/etc/wsl.conf``)."""

from __future__ import annotations

from dataclasses import dataclass

from pyinfra.api import FactBase

from ._declare import BOOT_ONLY
from ._output import section_map

# ``degraded`` is normal on healthy WSL systems (microsoft/WSL#9012).
SYSTEMD_UP_STATES = frozenset({"running", "degraded"})


@dataclass(frozen=True)
class InitInfo:
    pid1: str
    system_state: str | None

    @property
    def systemd_pid1(self) -> bool:
        return self.pid1 == "systemd"

    @property
    def systemd_up(self) -> bool:
        return self.systemd_pid1 and self.system_state in SYSTEMD_UP_STATES


def parse_init_output(lines: list[str]) -> InitInfo:
    secs = section_map(lines)
    pid1_lines = [line.strip() for line in secs.get("pid1", ("", []))[1] if line.strip()]
    state_lines = [line.strip() for line in secs.get("state", ("", []))[1] if line.strip()]
    pid1 = pid1_lines[0] if pid1_lines else ""
    # `systemctl is-system-running` prints one word (and exits non-zero unless "running").
    state = state_lines[0] if state_lines and " " not in state_lines[0] else None
    return InitInfo(pid1=pid1, system_state=state)


class InitSystem(FactBase[InitInfo]):
    """
    Returns ``InitInfo``: PID 1's name and ``systemctl is-system-running``'s state (None when
    systemctl is missing).
    """

    # The kernel's init: changes only with a restart of the WSL VM.
    fast_check_inputs = BOOT_ONLY

    def command(self) -> str:
        return (
            "echo '@@ft:pid1'; cat /proc/1/comm 2>/dev/null; "
            "if command -v systemctl >/dev/null 2>&1; then "
            "echo '@@ft:state'; systemctl is-system-running 2>/dev/null; fi; true"
        )

    @staticmethod
    def default() -> InitInfo:
        return InitInfo(pid1="", system_state=None)

    def process(self, output: list[str]) -> InitInfo:
        return parse_init_output(output)
