"""Windows scheduled tasks, seen through `schtasks.exe` (WSL interop)."""

from __future__ import annotations

from pyinfra.api import FactBase

from freetoken_infra.core.layout import DEFAULT_DRIVE_ROOT, drive_path

from ._declare import NAME, PATH, Unknown
from ._output import MARKER, quote
from .windows import interop, system32, windows_exe


class ScheduledTaskExists(FactBase[bool]):
    """
    Returns True when `schtasks.exe /Query /TN <name>` finds the task (False when there is no
    schtasks.exe to ask, or it did not answer within ``INTEROP_TIMEOUT_S``: the task is then
    created, and that call, bounded the same way, says it timed out).
    """

    argument_shapes = {"task_name": NAME, "drive_root": PATH}
    fast_check_inputs = Unknown("Windows' Task Scheduler: not visible from WSL")

    def command(self, task_name: str, drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
        """+ drive_root: wsl.conf's ``[automount] root`` (where C: and System32 are)."""
        return (
            f"cd {quote(drive_path(drive_root))} 2>/dev/null; {windows_exe('S', 'schtasks.exe', system32(drive_root))}; "
            f'if [ -n "$S" ] && {interop("S")} /Query /TN {quote(task_name)} >/dev/null 2>&1 </dev/null; '
            f"then echo '{MARKER}yes'; else echo '{MARKER}no'; fi"
        )

    def process(self, output: list[str]) -> bool:
        return any(line.strip() == f"{MARKER}yes" for line in output)


class WslDistroName(FactBase[str]):
    """
    Returns the distro's name as Windows knows it (`$WSL_DISTRO_NAME`, else from `wslpath -w /`).
    """

    # Read with the Task Scheduler's fact, for the logon task: not known either.
    fast_check_inputs = Unknown("read with ScheduledTaskExists, whose Windows' Task Scheduler WSL cannot see")

    def command(self) -> str:
        return (
            'if [ -n "$WSL_DISTRO_NAME" ]; then echo "$WSL_DISTRO_NAME"; '
            "else wslpath -w / 2>/dev/null | sed -e 's#^\\\\\\\\[^\\\\]*\\\\##' -e 's#\\\\.*##'; fi; true"
        )

    def process(self, output: list[str]) -> str:
        return output[0].strip() if output else ""
