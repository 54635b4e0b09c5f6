"""Facts about the Windows side, as seen from inside WSL: the user profile and the two WSL
configuration files (``%UserProfile%\\.wslconfig`` read by Windows at VM start, and the distro's
``/etc/wsl.conf``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import FactBase

from freetoken_infra.core import owner, wsl_ini
from freetoken_infra.core.layout import DEFAULT_DRIVE_ROOT, WSL_CONF, drive_path
from freetoken_infra.core.wsl_ini import WslIniFile

from ._declare import BOOT_ONLY, PATH, Inputs, fixed_paths, one_path, path_arg
from ._hostread import ReadFile, parse_read_output, read_command
from ._output import b64decode_lines, parse_int, quote, section_map

WINDOWS_SYSTEM32 = f"{drive_path(DEFAULT_DRIVE_ROOT)}/Windows/System32"


def system32(drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
    """``C:\\Windows\\System32`` under the automount root (wsl.conf ``[automount] root``)."""
    return f"{drive_path(drive_root)}/Windows/System32"


# One bound, in seconds, for every Windows program a fact or an operation runs through interop:
# a call that hangs (Windows locked, microsoft/WSL#7001; the Windows side never
# connecting back, #8677) is ended there by coreutils `timeout` (TERM, then KILL 2 s later, to
# the program's whole process group), and the parser says it timed out (exit 124 or 137).
INTEROP_TIMEOUT_S = 30


def interop(var: str) -> str:
    """Shell words that run the Windows program in ``$var`` under ``timeout -k 2 N``; its
    arguments follow."""
    return f'timeout -k 2 {INTEROP_TIMEOUT_S} "${var}"'


def interop_timed_out(exe: str, rc: int | None) -> str | None:
    """``EXE timed out after N s (WSL interop)`` when ``rc`` is ``timeout``'s, else None."""
    if rc not in owner.TIMEOUT_EXITS:
        return None
    return f"{exe} {owner.timed_out_reason(INTEROP_TIMEOUT_S)} (WSL interop)"


def windows_exe(var: str, exe: str, system32: str = WINDOWS_SYSTEM32) -> str:
    """Shell that sets ``$var`` to the path of the Windows program ``exe``, or to nothing.

    PATH first (WSL interop appends Windows' PATH to a session started from Windows), then
    System32: a distro reached over SSH (sshd under systemd) has no Windows folder on its PATH,
    yet interop still runs the program by its full path.
    """
    fallback = f"{system32}/{exe}"
    return (
        f"{var}=$(command -v {exe} 2>/dev/null); "
        f'if [ -z "${var}" ] && [ -f {quote(fallback)} ]; then {var}={quote(fallback)}; fi'
    )


# --------------------------------------------------------------------------- user profile


@dataclass(frozen=True)
class WindowsProfileInfo:
    path: str | None
    windows_path: str | None
    error: str | None


def parse_cmd_echo(data: bytes) -> tuple[str | None, str | None]:
    """Parse the raw bytes of ``cmd.exe /c echo %UserProfile%``: ``(windows_path, error)``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        # cmd.exe writes to a pipe in the console's OEM code page (e.g. 936 on Chinese Windows).
        return None, "cmd.exe output is not UTF-8 (non-ASCII profile path in an OEM code page)"
    lines = [line.strip() for line in text.replace("\r", "\n").split("\n") if line.strip()]
    if not lines:
        return None, "cmd.exe printed nothing"
    value = lines[-1]
    if "%" in value:
        return None, f"cmd.exe did not expand %UserProfile%: {value!r}"
    if not (len(value) >= 3 and value[1] == ":" and value[2] == "\\") and not value.startswith("\\\\"):
        return None, f"not a Windows path: {value!r}"
    return value, None


def parse_user_profile_output(lines: list[str]) -> WindowsProfileInfo:
    secs = section_map(lines)
    if "no-cmd" in secs:
        return WindowsProfileInfo(None, None, "cmd.exe not found (no Windows interop)")
    if "no-drive-c" in secs:
        where = secs["no-drive-c"][0] or "the C: drive"
        return WindowsProfileInfo(None, None, f"{where} is not mounted (wsl.conf [automount])")
    if "cmd" not in secs:
        return WindowsProfileInfo(None, None, "no output")
    timed_out = interop_timed_out("cmd.exe", parse_int(secs.get("cmd-rc", ("", []))[0]))
    if timed_out:
        return WindowsProfileInfo(None, None, timed_out)
    raw = b64decode_lines(secs["cmd"][1])
    if raw is None:
        return WindowsProfileInfo(None, None, "undecodable cmd.exe output")
    windows_path, error = parse_cmd_echo(raw)
    if error:
        return WindowsProfileInfo(None, None, error)
    wslpath = secs.get("wslpath")
    if wslpath is None:
        return WindowsProfileInfo(None, windows_path, "wslpath not found")
    rc = parse_int(secs.get("wslpath-rc", ("", []))[0])
    out = b64decode_lines(wslpath[1]) or b""
    text = out.decode("utf-8", errors="replace").strip()
    if rc != 0 or not text.startswith("/"):
        return WindowsProfileInfo(None, windows_path, f"wslpath -u failed (exit {rc}): {text[:200]}")
    return WindowsProfileInfo(text.splitlines()[0], windows_path, None)


class WindowsUserProfile(FactBase[WindowsProfileInfo]):
    """
    Returns ``WindowsProfileInfo``: the Windows user profile (``C:\\Users\\dev``) and its WSL
    path (``/mnt/c/Users/dev``, or ``/c/Users/dev`` under ``[automount] root = /``), where
    ``.wslconfig`` lives.

    + drive_root: wsl.conf's ``[automount] root`` (``wsl_ini.drive_root``; default ``/mnt/``)

    ``cmd.exe`` is found on PATH or in System32 under the drive root, and runs from the C: drive
    (from a Linux cwd cmd.exe warns about UNC paths); ``wslpath -u`` turns its answer into the
    distro's path, so no ``/mnt/c`` is assumed.
    """

    argument_shapes = {"drive_root": PATH}
    # Windows' answer: changes only with a restart of the WSL VM.
    fast_check_inputs = BOOT_ONLY

    def command(self, drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
        drive_c = quote(drive_path(drive_root))
        return (
            f"{windows_exe('C', 'cmd.exe', system32(drive_root))}; "
            "if [ -z \"$C\" ]; then echo '@@ft:no-cmd'; "
            f"elif ! [ -d {drive_c} ]; then echo '@@ft:no-drive-c' {drive_c}; "
            "else "
            f"P=$(cd {drive_c} && {interop('C')} /c echo %UserProfile% 2>/dev/null </dev/null); R=$?; "
            "echo '@@ft:cmd'; printf '%s\\n' \"$P\" | base64; echo \"@@ft:cmd-rc $R\"; "
            "if command -v wslpath >/dev/null 2>&1; then "
            "Q=$(wslpath -u \"$(printf '%s' \"$P\" | tr -d '\\r\\n')\" 2>&1); R=$?; "
            "echo '@@ft:wslpath'; printf '%s\\n' \"$Q\" | base64; echo \"@@ft:wslpath-rc $R\"; "
            "fi; fi; true"
        )

    @staticmethod
    def default() -> WindowsProfileInfo:
        return WindowsProfileInfo(None, None, "no output")

    def process(self, output: list[str]) -> WindowsProfileInfo:
        return parse_user_profile_output(output)


# --------------------------------------------------------------------------- files below the drive root

# The file bytes of a read below the drive root (``_hostread``: no link followed, a cap).
WindowsFileBytes = ReadFile


def parse_windows_file_output(lines: list[str], name: str | None = None) -> WindowsFileBytes:
    """The one file of a ``read_command`` (``name``: the one asked for, when known)."""
    seen = parse_read_output(lines)
    if seen.folder == "missing":
        return WindowsFileBytes(None)
    if seen.folder == "refused":
        return WindowsFileBytes(None, seen.refused or "not read", seen.kind)
    if name is None and len(seen.files) == 1:
        return next(iter(seen.files.values()))
    return seen.files.get(name or "", WindowsFileBytes(None, f"{name}: not in the answer", "error"))


class WindowsFile(FactBase[WindowsFileBytes]):
    """
    Returns ``WindowsFileBytes``: the exact bytes of a file below the drive root (the owner's
    ``.wslconfig``), or why root refused it: a link at any component of ``path``, a FIFO, socket,
    device or folder at it, or more than 64 KiB (``hostio.read_folder``). Nothing is followed.

    + path: the file's WSL path (``/mnt/c/Users/dev/.wslconfig``)
    """

    argument_shapes = {"path": PATH}
    # The same file as WslConfigFile, as bytes for the merge. A folder on the way swapped for a
    # link shows in the file's lstat (another inode); and a run the fast check skips reads and
    # writes nothing there at all.
    fast_check_inputs = one_path("path")

    def command(self, path: str) -> str:
        self._name = os.path.basename(path)
        return read_command(os.path.dirname(path) or "/", [self._name]) + "; true"

    @staticmethod
    def default() -> WindowsFileBytes:
        return WindowsFileBytes(None, "no output", "error")

    def process(self, output: list[str]) -> WindowsFileBytes:
        return parse_windows_file_output(output, getattr(self, "_name", None))


# --------------------------------------------------------------------------- INI files


@dataclass(frozen=True)
class IniFileInfo:
    """A ``.wslconfig`` or ``/etc/wsl.conf`` as WSL reads it (``freetoken_infra.core.wsl_ini``).

    ``sections``: ``{section: {key: value}}`` in lower case, first occurrence winning, keys
    before the first header left out; ``problems``: the lines WSL warns about or skips;
    ``error``: the file could not be read or decoded (WSL reads no key from it); ``refused``:
    root did not read it (``hostio.read_folder``: a link on the way, a FIFO, a folder, over the
    cap), the reason, also in ``error``.
    """

    path: str
    exists: bool
    sections: dict[str, dict[str, str]] = field(default_factory=dict)
    error: str | None = None
    ini: WslIniFile | None = None
    problems: tuple[str, ...] = ()
    refused: str | None = None

    def __post_init__(self) -> None:
        # Built from plain sections (tests, callers without the bytes): the file WSL would read
        # them from, so that every reader goes through one parser.
        if self.ini is None and self.exists and self.error is None:
            text = "".join(
                f"[{name}]\n" + "".join(f"{k}={wsl_ini.format_value(v)}\n" for k, v in keys.items())
                for name, keys in self.sections.items()
            )
            object.__setattr__(self, "ini", wsl_ini.parse(text.encode("utf-8"), dialect_of(self.path)))


def dialect_of(path: str) -> wsl_ini.Dialect:
    return wsl_ini.WSLCONF if path == WSL_CONF else wsl_ini.WSLCONFIG


def parse_ini(path: str, data: bytes, dialect: wsl_ini.Dialect | None = None) -> IniFileInfo:
    """Parse the bytes of ``path`` the way WSL does (``/etc/wsl.conf``: the Linux side's rules)."""
    ini = wsl_ini.parse(data, dialect or dialect_of(path))
    return IniFileInfo(path, True, ini.sections(), ini.error, ini, tuple(str(p) for p in ini.problems))


def parse_ini_output(path: str, lines: list[str]) -> IniFileInfo:
    secs = section_map(lines)
    if not path:
        path = next((arg for arg, _ in secs.values() if arg), "")
    if "absent" in secs:
        return IniFileInfo(path, False, {}, None)
    if "unreadable" in secs:
        return IniFileInfo(path, True, {}, "file exists but is not readable")
    if "file" not in secs:
        return IniFileInfo(path, False, {}, "no output")
    data = b64decode_lines(secs["file"][1])
    if data is None:
        return IniFileInfo(path, True, {}, "undecodable file transport")
    return parse_ini(path, data)


def _ini_command(path: str) -> str:
    p = quote(path)
    return (
        f"if [ ! -e {p} ]; then echo '@@ft:absent' {p}; "
        f"elif [ ! -r {p} ]; then echo '@@ft:unreadable' {p}; "
        f"else echo '@@ft:file' {p}; base64 < {p}; fi; true"
    )


class WslConfigFile(FactBase[IniFileInfo]):
    """
    Returns ``IniFileInfo`` for the Windows-side ``.wslconfig`` at ``path`` (a WSL path such as
    ``/mnt/c/Users/dev/.wslconfig``, from ``WindowsUserProfile``), read as ``WindowsFile`` reads
    it: no link followed, only a regular file under the cap (else ``refused``).
    """

    argument_shapes = {"path": PATH}
    fast_check_inputs = one_path("path")

    def command(self, path: str) -> str:
        self._path = path
        return WindowsFile().command(path)

    @staticmethod
    def default() -> IniFileInfo:
        return IniFileInfo("", False, {}, "no output")

    def process(self, output: list[str]) -> IniFileInfo:
        path = getattr(self, "_path", "")
        seen = parse_windows_file_output(output, os.path.basename(path) if path else None)
        if seen.refused is not None:
            return IniFileInfo(path, True, {}, seen.refused, refused=seen.refused)
        if seen.data is None:
            return IniFileInfo(path, False, {}, None)
        return parse_ini(path, seen.data)


class WslConfFile(FactBase[IniFileInfo]):
    """
    Returns ``IniFileInfo`` for the distro's ``/etc/wsl.conf``.
    """

    path = WSL_CONF

    fast_check_inputs = fixed_paths("/etc/wsl.conf")

    def command(self) -> str:
        return _ini_command(self.path)

    @staticmethod
    def default() -> IniFileInfo:
        return IniFileInfo("/etc/wsl.conf", False, {}, "no output")

    def process(self, output: list[str]) -> IniFileInfo:
        return parse_ini_output(self.path, output)


# --------------------------------------------------------------------------- the owner's shortcuts


@dataclass(frozen=True)
class DesktopShortcuts:
    """The owner's Desktop folder (a WSL path) and what its FreeToken shortcuts hold now."""

    desktop_exists: bool
    distro: str  # the distro's name as Windows knows it ("" when unknown); untrusted until checked
    files: dict[str, bytes]  # file name -> bytes, for the names asked about that exist
    # file name -> (why, kind) for a name root did not read (a link, FIFO, folder there)
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)
    desktop_refused: str | None = None  # why the Desktop was not read (a link on the way)


# The owner's Desktop shortcuts (operations/owner.py writes them).
SNOOZE_SHORTCUT = "FreeToken - leave the GPU to me for 2 h.cmd"
RESUME_SHORTCUT = "FreeToken - serve again.cmd"
OWNER_SHORTCUTS = (SNOOZE_SHORTCUT, RESUME_SHORTCUT)


def _shortcuts_inputs(kwargs: dict[str, Any]) -> Inputs | None:
    desktop = path_arg(kwargs, "path")
    if desktop is None:
        return None
    # The Desktop's own times move with every file the owner saves there: its owner and mode only.
    return Inputs(dirs={desktop}, paths={f"{desktop}/{name}" for name in OWNER_SHORTCUTS})


class OwnerShortcuts(FactBase[DesktopShortcuts]):
    """
    Returns ``DesktopShortcuts``: whether ``path`` is a folder, the distro's Windows name
    (``$WSL_DISTRO_NAME``, else from ``wslpath -w /``, as ``WslDistroName``) and the bytes of
    each of ``OWNER_SHORTCUTS`` there, read as ``WindowsFile`` reads (no link followed; a link,
    FIFO or folder at a name is in ``refused``). One command, read only.

    + path: the owner's Desktop as a WSL path (``/mnt/c/Users/dev/Desktop``)
    """

    argument_shapes = {"path": PATH}
    # The Desktop and its two shortcuts; the distro's name changes only with a boot.
    fast_check_inputs = _shortcuts_inputs

    def command(self, path: str) -> str:
        return (
            'N="$WSL_DISTRO_NAME"; if [ -z "$N" ]; then '
            "N=$(wslpath -w / 2>/dev/null | sed -e 's#^\\\\\\\\[^\\\\]*\\\\##' -e 's#\\\\.*##'); fi; "
            "printf '@@ft:distro %s\\n' \"$N\"; " + read_command(path, OWNER_SHORTCUTS) + "; true"
        )

    @staticmethod
    def default() -> DesktopShortcuts:
        return DesktopShortcuts(False, "", {})

    def process(self, output: list[str]) -> DesktopShortcuts:
        return parse_shortcuts_output(output)


def parse_shortcuts_output(lines: list[str], names: tuple[str, ...] = OWNER_SHORTCUTS) -> DesktopShortcuts:
    secs = section_map(lines)
    seen = parse_read_output(lines)
    files = {name: f.data for name, f in seen.files.items() if name in names and f.data is not None}
    refused = {name: (f.refused or "", f.kind or "") for name, f in seen.files.items() if name in names and f.refused}
    distro = secs.get("distro", ("", []))[0].strip()
    return DesktopShortcuts(
        seen.folder == "ok", distro, files, refused, seen.refused if seen.folder == "refused" else None
    )
