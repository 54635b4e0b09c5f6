"""The Windows side of a workstation: `%UserProfile%\\.wslconfig`, `/etc/wsl.conf`,
and the optional scheduled task that starts the distro after a Windows reboot.

Neither file applies until `wsl.exe --shutdown` (wsl2-gpu.md), so the deploy
reports "restart required" whenever `ini_values` changes one of them.
"""

from __future__ import annotations

import io
from typing import Mapping

from configupdater import ConfigUpdater
from pyinfra import host
from pyinfra.api import operation
from pyinfra.api.exceptions import OperationError
from pyinfra.operations import files, server

from facts.files import FileBytes
from facts.windows_tasks import ScheduledTaskExists
from facts.windows import decode_ini_bytes, windows_exe
from operations import preview


def merge_ini(original: bytes | None, section: str, values: Mapping[str, str]) -> bytes:
    """Set `values` in `[section]`, keeping every comment, key and blank line of the
    user's file, its encoding (UTF-8 or UTF-16 with BOM) and its line endings.

    Keys match case-insensitively (WSL ignores case) and keep the user's spelling.
    """
    raw = original or b""
    text = decode_ini_bytes(raw)
    crlf = "\r\n" in text
    updater = ConfigUpdater(space_around_delimiters=False)
    updater.read_string(text.replace("\r\n", "\n"))
    if not updater.has_section(section):
        if updater.sections() or text.strip():
            # Keep a blank line between the user's last section and ours.
            if not text.endswith("\n\n"):
                updater.read_string(str(updater).rstrip("\n") + "\n\n")
        updater.add_section(section)
    sect = updater[section]
    for key, value in values.items():
        sect[key] = value
    out = str(updater)
    if not out.endswith("\n"):
        out += "\n"
    if crlf:
        out = out.replace("\n", "\r\n")
    if raw.startswith(b"\xff\xfe"):
        return b"\xff\xfe" + out.encode("utf-16-le")
    if raw.startswith(b"\xef\xbb\xbf"):
        return b"\xef\xbb\xbf" + out.encode("utf-8")
    return out.encode("utf-8")


def ini_needs_change(path: str, section: str, values: Mapping[str, str]) -> bool:
    current = host.get_fact(FileBytes, path=path)
    return current is None or merge_ini(current, section, values) != current


@operation()
def ini_values(path: str, section: str, values: Mapping[str, str]):
    """
    Set keys of one section of an INI file, keeping the rest of the file as it is.

    + path: the file (created when missing)
    + section: the section name, e.g. ``wsl2``
    + values: key -> value; other keys, comments and sections are kept

    **Example:**

    .. code:: python

        ini_values(
            name="WSL: systemd as PID 1",
            path="/etc/wsl.conf",
            section="boot",
            values={"systemd": "true"},
        )
    """
    current = host.get_fact(FileBytes, path=path)
    merged = merge_ini(current, section, values)
    if current is not None and merged == current:
        host.noop(f"{path} [{section}] already holds {', '.join(values)}")
        return
    # --diff: the decoded text (pyinfra's own diff takes the bytes for UTF-8; .wslconfig may be UTF-16)
    preview.log_diff(path, None if current is None else preview.text_lines(decode_ini_bytes(current)),
                     preview.text_lines(decode_ini_bytes(merged)))
    yield from preview.put_without_pyinfra_diff(src=io.BytesIO(merged), dest=path)


@operation()
def windows_autostart(task_name: str, distro: str):
    """
    Create a Windows scheduled task (through `schtasks.exe`) that starts the WSL
    distro at logon, so that systemd, and with it the engine, come back after a
    Windows reboot.

    + task_name: the task's name in the Windows Task Scheduler
    + distro: the WSL distro to start (``$WSL_DISTRO_NAME``)
    """
    if host.get_fact(ScheduledTaskExists, task_name=task_name):
        host.noop(f"scheduled task {task_name} exists")
        return
    if not distro:
        raise OperationError(
            f"{host.name}: windows_autostart: the distro's name is unknown ($WSL_DISTRO_NAME is "
            "empty and `wslpath -w /` gave none); run the deploy inside the WSL distro"
        )
    yield from server.shell._inner(commands=[autostart_command(host.name, task_name, distro)])


def autostart_command(host_name: str, task_name: str, distro: str) -> str:
    """``schtasks.exe /Create`` for the logon task, found on PATH or in System32."""
    return (
        f"cd /mnt/c && {windows_exe('S', 'schtasks.exe')}; "
        f"if [ -z \"$S\" ]; then echo 'host {host_name}: windows_autostart: schtasks.exe is neither "
        "on PATH nor in C:\\Windows\\System32 (is WSL interop enabled?)' >&2; exit 1; fi; "
        f"\"$S\" /Create /F /SC ONLOGON /TN '{task_name}' /TR 'wsl.exe -d {distro} --exec /bin/true'"
    )
