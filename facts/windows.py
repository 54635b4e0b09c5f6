"""Facts about the Windows side, as seen from inside WSL: the user profile and the two WSL
configuration files (``%UserProfile%\\.wslconfig`` read by Windows at VM start, and the distro's
``/etc/wsl.conf``)."""

from __future__ import annotations

import configparser
from dataclasses import dataclass, field

from pyinfra.api import FactBase

from ._output import b64decode_lines, parse_int, quote, section_map

WINDOWS_SYSTEM32 = "/mnt/c/Windows/System32"


def windows_exe(var: str, exe: str, system32: str = WINDOWS_SYSTEM32) -> str:
    """Shell that sets ``$var`` to the path of the Windows program ``exe``, or to nothing.

    PATH first (WSL interop appends Windows' PATH to a session started from Windows), then
    System32: a distro reached over SSH (sshd under systemd) has no Windows folder on its PATH,
    yet interop still runs the program by its full path.
    """
    fallback = f"{system32}/{exe}"
    return (f'{var}=$(command -v {exe} 2>/dev/null); '
            f'if [ -z "${var}" ] && [ -f {quote(fallback)} ]; then {var}={quote(fallback)}; fi')

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
    if "no-mnt-c" in secs:
        return WindowsProfileInfo(None, None, "/mnt/c is not mounted")
    if "cmd" not in secs:
        return WindowsProfileInfo(None, None, "no output")
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
    path (``/mnt/c/Users/dev``), where ``.wslconfig`` lives.

    Runs ``cmd.exe`` from ``/mnt/c``: from a Linux cwd cmd.exe warns about UNC paths.
    """

    def command(self) -> str:
        return (
            f"{windows_exe('C', 'cmd.exe')}; "
            "if [ -z \"$C\" ]; then echo '@@ft:no-cmd'; "
            "elif ! [ -d /mnt/c ]; then echo '@@ft:no-mnt-c'; "
            "else "
            "P=$(cd /mnt/c && \"$C\" /c echo %UserProfile% 2>/dev/null </dev/null); "
            "echo '@@ft:cmd'; printf '%s\\n' \"$P\" | base64; "
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


# --------------------------------------------------------------------------- INI files


@dataclass(frozen=True)
class IniFileInfo:
    path: str
    exists: bool
    sections: dict[str, dict[str, str]] = field(default_factory=dict)
    error: str | None = None


def decode_ini_bytes(data: bytes) -> str:
    """Decode an INI file: UTF-8 (BOM tolerated) or UTF-16 with BOM (Notepad's "Unicode")."""
    if data.startswith(b"\xff\xfe") or data.startswith(b"\xfe\xff"):
        return data.decode("utf-16")
    return data.decode("utf-8-sig")


def parse_ini(path: str, data: bytes) -> IniFileInfo:
    """Parse WSL-style INI bytes; section names and keys are lower-cased (WSL ignores case)."""
    try:
        text = decode_ini_bytes(data)
    except UnicodeDecodeError as exc:
        return IniFileInfo(path, True, {}, f"not valid UTF-8/UTF-16: {exc}")
    parser = configparser.ConfigParser(
        interpolation=None,
        strict=False,
        comment_prefixes=("#", ";"),
        inline_comment_prefixes=None,
        delimiters=("=",),
        default_section="\x00no-default",
    )
    try:
        parser.read_string(text.replace("\r\n", "\n").replace("\r", "\n"), source=path)
    except configparser.Error as exc:
        return IniFileInfo(path, True, {}, f"{type(exc).__name__}: {exc}".strip())
    sections: dict[str, dict[str, str]] = {}
    for name in parser.sections():
        target = sections.setdefault(name.strip().lower(), {})
        for key, value in parser.items(name, raw=True):
            target[key.strip().lower()] = (value or "").strip()
    return IniFileInfo(path, True, sections, None)


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
    ``/mnt/c/Users/dev/.wslconfig``, from ``WindowsUserProfile``).
    """

    def command(self, path: str) -> str:
        self._path = path
        return _ini_command(path)

    @staticmethod
    def default() -> IniFileInfo:
        return IniFileInfo("", False, {}, "no output")

    def process(self, output: list[str]) -> IniFileInfo:
        return parse_ini_output(getattr(self, "_path", ""), output)


class WslConfFile(FactBase[IniFileInfo]):
    """
    Returns ``IniFileInfo`` for the distro's ``/etc/wsl.conf``.
    """

    path = "/etc/wsl.conf"

    def command(self) -> str:
        return _ini_command(self.path)

    @staticmethod
    def default() -> IniFileInfo:
        return IniFileInfo("/etc/wsl.conf", False, {}, "no output")

    def process(self, output: list[str]) -> IniFileInfo:
        return parse_ini_output(self.path, output)
