"""Whether a WSL restart is still owed: Windows reads ``%UserProfile%\\.wslconfig`` when the VM
starts and WSL reads ``/etc/wsl.conf`` when the distro starts, so a file changed after the
distro's init (PID 1) started has not taken effect yet (``wsl.exe --shutdown`` applies both).

A ``wsl.exe --terminate`` restarts the distro but not the VM; after one, a newer ``.wslconfig``
is not reported although the VM still runs with the old one (the fact cannot see the VM).
"""

from __future__ import annotations

from typing import Any

from pyinfra.api import FactBase

from ._declare import PATHS, Inputs
from ._output import MARKER, quote


def parse_restart_pending_output(lines: list[str]) -> list[str]:
    return [line[len(MARKER + "newer ") :] for line in lines if line.startswith(MARKER + "newer ")]


def _inputs(kwargs: dict[str, Any]) -> Inputs | None:
    paths = kwargs.get("paths")
    if not isinstance(paths, list) or not all(isinstance(p, str) and p.startswith("/") for p in paths):
        return None
    return Inputs(paths=set(paths))


class RestartPending(FactBase[list]):
    """
    Returns the files among ``paths`` modified after PID 1 started (empty when none, or when
    the start time cannot be read).

    + paths: files whose changes need a WSL restart, e.g. ``["/etc/wsl.conf",
      "/mnt/c/Users/dev/.wslconfig"]``
    """

    argument_shapes = {"paths": PATHS}
    fast_check_inputs = _inputs

    def command(self, paths: list) -> str:
        # /proc/1/stat: field 22 is the start time in clock ticks after boot (btime in
        # /proc/stat); the command name in field 2 may hold spaces, so cut after its ")".
        files = " ".join(quote(p) for p in paths)
        return (
            "boot=$(awk '/^btime/{print $2}' /proc/stat 2>/dev/null); "
            "ticks=$(sed 's/.*) //' /proc/1/stat 2>/dev/null | awk '{print $20}'); "
            "hz=$(getconf CLK_TCK 2>/dev/null); "
            '[ -n "$boot" ] && [ -n "$ticks" ] && [ -n "$hz" ] || exit 0; '
            "since=$((boot + ticks / hz)); "
            f'for p in {files}; do m=$(stat -c %Y "$p" 2>/dev/null) || continue; '
            f'[ "$m" -gt "$since" ] && echo "{MARKER}newer $p"; done; true'
        )

    @staticmethod
    def default() -> list:
        return []

    def process(self, output: list[str]) -> list:
        return parse_restart_pending_output(output)
