"""The Windows side of a workstation: `%UserProfile%\\.wslconfig`, `/etc/wsl.conf`,
and the optional scheduled task that starts the distro after a Windows reboot.

Neither file applies until `wsl.exe --shutdown` (Microsoft's WSL configuration docs: the
8-second rule), so the deploy reports "restart required" whenever `ini_values` changes one of
them.
"""

from __future__ import annotations

import base64
import io
import re
import shlex
from collections.abc import Generator, Mapping
from typing import Any

from pyinfra import host
from pyinfra.api import operation
from pyinfra.api.exceptions import OperationError
from pyinfra.operations import python, server

from facts.files import FileBytes
from facts.windows import WindowsFile, dialect_of, interop, interop_timed_out, system32, windows_exe
from facts.windows_tasks import ScheduledTaskExists
from facts.wsl import InteropRegistration
from freetoken_infra.core import hostio, wsl_ini
from freetoken_infra.core.layout import (
    DEFAULT_DRIVE_ROOT,
    HOSTIO_MODULE,
    INTEROP_BINFMT_CONF,
    INTEROP_BINFMT_LINE,
    SYSTEMD_BINFMT,
    WINDOWS_FILE_SCRIPT,
    WSL_CONF,
    drive_path,
)
from freetoken_infra.core.units import managed_by
from operations import managed, preview
from operations.managed import ManagedFile

_WRITER = managed.script_source("windows_file.py")


def upload_writer() -> Generator[Any, None, None]:
    """``windows_file.py`` and ``hostio.py`` under ``/usr/local/lib/freetoken`` (root's): what
    writes a Windows-side file without following a link. Uploaded by the steps that write one,
    only when they do; ``--diff`` shows the file written (``ini_values``' own diff), not these."""
    for local, dest, mode in ((hostio.__file__, HOSTIO_MODULE, "644"), (_WRITER, WINDOWS_FILE_SCRIPT, "755")):
        yield from preview.put_without_pyinfra_diff(
            src=local, dest=dest, user="root", group="root", mode=mode, add_deploy_dir=False
        )


def write_command(path: str, data: bytes) -> str:
    """Root's command that replaces ``path`` (below the drive root, where every Linux account
    can plant a link) by ``data``: the bytes cross on the script's stdin, base64, from the
    controller; the script renames a new file over the name (``hostio.write_below``)."""
    encoded = base64.b64encode(data).decode("ascii")
    return f"printf %s {encoded} | /usr/bin/python3 {WINDOWS_FILE_SCRIPT} write {shlex.quote(path)}"


def merge_ini(
    original: bytes | None, section: str, values: Mapping[str, str], dialect: wsl_ini.Dialect = wsl_ini.WSLCONFIG
) -> bytes:
    """The bytes after setting `values` in `[section]` as WSL reads them (wsl_ini.merge):
    the original bytes when WSL already reads them, or when the file cannot be merged safely."""
    return wsl_ini.merge(original, dialect, section, values).data


@operation()
def ini_values(path: str, section: str, values: Mapping[str, str]):
    """
    Make WSL read `values` in one section of `.wslconfig` or `/etc/wsl.conf`, keeping the rest
    of the file byte for byte (freetoken_infra.core.wsl_ini: WSL's own parsing rules).

    + path: the file (created when missing); ``/etc/wsl.conf`` is read with the Linux side's
      rules, any other path as Windows reads ``.wslconfig``
    + section: the section name, e.g. ``wsl2``
    + values: key -> value; a key WSL already reads as wanted (``memory=24GB # mine``) is left
      as it is; other keys, comments and sections are kept

    A file that cannot be merged safely (e.g. a wsl.conf line that makes WSL stop reading before
    the place the key would go) is left unchanged, with the line in the message; the preflight
    reports it as a finding. So is a ``.wslconfig`` root refuses to read (``WindowsFile``: a link
    on the way, a FIFO, a folder, over 64 KiB); one it merges is written by ``windows_file.py``,
    renamed over the name, never through a link.

    **Example:**

    .. code:: python

        ini_values(
            name="WSL: systemd as PID 1",
            path="/etc/wsl.conf",
            section="boot",
            values={"systemd": "true"},
        )
    """
    if path == WSL_CONF:  # root's own folder
        current = host.get_fact(FileBytes, path=path)
    else:  # below the drive root: any Linux account may have planted a link, a FIFO, a huge file
        seen = host.get_fact(WindowsFile, path=path)
        if seen.refused is not None:
            host.noop(f"{path} left unchanged: {seen.refused}; root does not follow or replace it")
            return
        current = seen.data
    dialect = dialect_of(path)
    plan = wsl_ini.merge(current, dialect, section, values)
    if plan.problem is not None:
        host.noop(f"{path} left unchanged, it cannot be merged safely: {plan.problem}")
        return
    if not plan.changed:
        host.noop(f"{path} [{section}] already holds {', '.join(values)} as WSL reads it")
        return
    # --diff: the decoded text (pyinfra's own diff takes the bytes for UTF-8; .wslconfig may be UTF-16)
    before = None if current is None else wsl_ini.decode(current, dialect)[0]
    preview.log_diff(
        path,
        None if before is None else preview.text_lines(before),
        preview.text_lines(wsl_ini.decode(plan.data, dialect)[0]),
    )
    if path == WSL_CONF:
        yield from preview.put_without_pyinfra_diff(src=io.BytesIO(plan.data), dest=path)
    else:
        yield from upload_writer()
        yield write_command(path, plan.data)


# What WSL accepts as a distribution name (`wsl --import`); the name is read from the host, so
# nothing else reaches the command line that creates the task.
DISTRO_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def wait_for_restart(message: str) -> None:
    """Every later step of this host waits for WSL's restart: the run stops it here, with
    ``message`` (the restart the Windows side needs; nothing after it can work before)."""

    def stop():
        raise OperationError(message)

    python.call(name="Wait for the WSL restart", function=stop)


@operation()
def windows_autostart(task_name: str, distro: str, drive_root: str = DEFAULT_DRIVE_ROOT):
    """
    Create a Windows scheduled task (through `schtasks.exe`) that starts the WSL
    distro at logon, so that systemd, and with it the engine, come back after a
    Windows reboot.

    + task_name: the task's name in the Windows Task Scheduler
    + distro: the WSL distro to start (``$WSL_DISTRO_NAME``)
    + drive_root: wsl.conf's ``[automount] root`` (``/mnt/`` unless the drives were moved)
    """
    moved = {} if drive_root == DEFAULT_DRIVE_ROOT else {"drive_root": drive_root}
    if host.get_fact(ScheduledTaskExists, task_name=task_name, **moved):
        host.noop(f"scheduled task {task_name} exists")
        return
    if not distro:
        raise OperationError(
            f"{host.name}: windows_autostart: the distro's name is unknown ($WSL_DISTRO_NAME is "
            "empty and `wslpath -w /` gave none); run the deploy inside the WSL distro"
        )
    yield from server.shell._inner(commands=[autostart_command(host.name, task_name, distro, drive_root)])


def autostart_command(host_name: str, task_name: str, distro: str, drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
    """``schtasks.exe /Create`` for the logon task, found on PATH or in System32.

    The distro's name is read from the host: anything but a WSL distribution name is refused
    (it would otherwise be part of a command root runs)."""
    for what, value in (("task_name", task_name), ("the distro's name read from the host", distro)):
        if not DISTRO_NAME.fullmatch(value):
            raise OperationError(
                f"{host_name}: windows_autostart: {what}, {value!r}, is not a WSL distribution name "
                f"({DISTRO_NAME.pattern}); no task was created"
            )
    drive_c = drive_path(drive_root)
    return (
        f"cd {shlex.quote(drive_c)} && {windows_exe('S', 'schtasks.exe', system32(drive_root))}; "
        f'if [ -z "$S" ]; then echo \'host {host_name}: windows_autostart: schtasks.exe is neither '
        "on PATH nor in C:\\Windows\\System32 (is WSL interop enabled?)' >&2; exit 1; fi; "
        f"{interop('S')} /Create /F /SC ONLOGON /TN '{task_name}' /TR 'wsl.exe -d {distro} --exec /bin/true' "
        "</dev/null; R=$?; "
        f"case $R in 124|137) echo 'host {host_name}: windows_autostart: {interop_timed_out('schtasks.exe', 124)}; "
        "the task may not be there: run the deploy again' >&2;; esac; exit $R"
    )


def binfmt_conf() -> str:
    """``/etc/binfmt.d/WSLInterop.conf``: WSL's own registration of its interop handler."""
    return (
        f"# {managed_by('operations/windows.py')}\n"
        "# WSL's interop handler, registered again whenever systemd-binfmt empties the table\n"
        "# (microsoft/WSL#8843, systemd/systemd#28126): Windows programs run through /init.\n"
        f"{INTEROP_BINFMT_LINE}\n"
    )


@operation()
def interop_registration():
    """
    Keep WSL interop working under systemd: ``systemd-binfmt`` empties the kernel's binfmt_misc
    table when it starts (on a WSL that does not keep the table's ``status`` read-only) and
    WSL's ``WSLInterop`` entry goes with it, after which every ``.exe`` fails with "Exec format
    error" (the host agent's Windows signals, the doctor's Windows checks). A ``binfmt.d``
    entry puts it back each time systemd-binfmt runs; when the entry is missing now it is
    registered at once. Another entry claiming Windows programs (mono's or wine's ``MZ``) is
    not removed: the doctor names it.
    """
    seen = host.get_fact(InteropRegistration)
    if not seen.table:
        host.noop("no binfmt_misc table (not a WSL2 VM): no interop entry to keep")
        return
    yield from managed.put(ManagedFile(INTEROP_BINFMT_CONF, text=binfmt_conf()))
    if not seen.registered:
        yield f"{SYSTEMD_BINFMT} {INTEROP_BINFMT_CONF}"
