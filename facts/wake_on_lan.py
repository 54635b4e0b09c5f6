"""What WSL can see of a workstation's Wake-on-LAN readiness, through interop:
each physical network adapter's name, MAC, description and ``WakeOnMagicPacket`` setting
(PowerShell's ``Get-NetAdapter`` and ``Get-NetAdapterPowerManagement``) and the devices armed to
wake the PC (``powercfg.exe /devicequery wake_armed``: one device name a line, ``NONE`` when
none). The firmware's Wake-on-LAN and Windows' Fast Startup cannot be seen from here.

Adapter names and descriptions are Windows' text (an owner may rename an adapter): both outputs
travel base64-encoded and are only compared and shown, printable and bounded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyinfra.api import FactBase

from freetoken_infra.core.layout import DEFAULT_DRIVE_ROOT, drive_path

from ._declare import BOOT_ONLY, PATH
from ._output import b64decode_lines, parse_int, quote, section_map
from .windows import interop, interop_timed_out, system32, windows_exe

# One line an adapter: Name|MacAddress|InterfaceDescription|WakeOnMagicPacket.
ADAPTERS_COMMAND = (
    "Get-NetAdapter -Physical | ForEach-Object { $_.Name + '|' + $_.MacAddress + '|' + "
    "$_.InterfaceDescription + '|' + ($_ | Get-NetAdapterPowerManagement).WakeOnMagicPacket }"
)
_MAX_TEXT = 80
_MAX_ROWS = 32
_MAC = re.compile(r"[0-9A-Fa-f]{2}([-:])[0-9A-Fa-f]{2}(\1[0-9A-Fa-f]{2}){4}")


@dataclass(frozen=True)
class Adapter:
    name: str
    mac: str | None  # aa:bb:cc:dd:ee:ff, None when Windows' text is not a MAC
    description: str
    wake_on_magic_packet: str  # "Enabled", "Disabled", "Unsupported", "" (Windows' word)


@dataclass(frozen=True)
class WakeOnLanInfo:
    adapters: tuple[Adapter, ...] | None  # None: PowerShell could not be asked or failed
    wake_armed: tuple[str, ...] | None  # None: powercfg.exe could not be asked or failed
    error: str | None = None


def _text(value: str) -> str:
    shown = re.sub(r"[^\x20-\x7e]", "?", value.strip())
    return shown[: _MAX_TEXT - 3] + "..." if len(shown) > _MAX_TEXT else shown


def parse_adapters(text: str) -> tuple[Adapter, ...]:
    rows = []
    for line in text.splitlines():
        cells = line.strip().split("|")
        if len(cells) != 4:
            continue
        name, mac, description, wake = cells
        mac = mac.strip()
        rows.append(
            Adapter(
                _text(name),
                mac.lower().replace("-", ":") if _MAC.fullmatch(mac) else None,
                _text(description),
                _text(wake),
            )
        )
    return tuple(rows[:_MAX_ROWS])


def parse_wake_armed(text: str) -> tuple[str, ...]:
    names = [_text(line) for line in text.splitlines() if line.strip()]
    return () if names == ["NONE"] else tuple(names[:_MAX_ROWS])


def _decoded(lines: list[str]) -> str | None:
    data = b64decode_lines(lines)
    # PowerShell and powercfg write the console's code page; names are compared as ASCII
    return None if data is None else data.decode("utf-8", "replace").replace("\r", "")


def parse_output(lines: list[str]) -> WakeOnLanInfo:
    secs = section_map(lines)
    if "no-interop" in secs:
        return WakeOnLanInfo(None, None, "powershell.exe not found (no Windows interop)")
    adapters = armed = None
    timed_out = interop_timed_out("powershell.exe", parse_int(secs.get("adapters-rc", ("", []))[0]))
    timed_out = timed_out or interop_timed_out("powercfg.exe", parse_int(secs.get("armed-rc", ("", []))[0]))
    if parse_int(secs.get("adapters-rc", ("", []))[0]) == 0:
        text = _decoded(secs.get("adapters64", ("", []))[1])
        adapters = parse_adapters(text) if text is not None else None
    if parse_int(secs.get("armed-rc", ("", []))[0]) == 0:
        text = _decoded(secs.get("armed64", ("", []))[1])
        armed = parse_wake_armed(text) if text is not None else None
    return WakeOnLanInfo(adapters, armed, timed_out)


class WakeOnLanReadiness(FactBase[WakeOnLanInfo]):
    """
    Returns ``WakeOnLanInfo``: Windows' physical network adapters with their MAC and
    ``WakeOnMagicPacket``, and the devices armed to wake the PC; asked only of hosts with
    ``wake_on_lan_mac`` (PowerShell starts in about a second).
    """

    argument_shapes = {"drive_root": PATH}
    # Windows' adapters, powercfg: a warning of the preflight only, which the no-op run does not
    # repeat (the doctor does).
    fast_check_inputs = BOOT_ONLY

    def command(self, drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
        """+ drive_root: wsl.conf's ``[automount] root`` (where C: and System32 are)."""
        s32 = system32(drive_root)
        powershell = f"{s32}/WindowsPowerShell/v1.0/powershell.exe"
        return (
            f"cd {quote(drive_path(drive_root))} 2>/dev/null; "
            "P=$(command -v powershell.exe 2>/dev/null); "
            f'if [ -z "$P" ] && [ -f {quote(powershell)} ]; then P={quote(powershell)}; fi; '
            f"{windows_exe('C', 'powercfg.exe', s32)}; "
            "if [ -z \"$P\" ]; then echo '@@ft:no-interop'; else "
            f"A=$({interop('P')} -NoProfile -NonInteractive -Command {quote(ADAPTERS_COMMAND)} 2>/dev/null </dev/null); R=$?; "
            "echo '@@ft:adapters64'; printf '%s\\n' \"$A\" | base64; echo \"@@ft:adapters-rc $R\"; "
            f'if [ -n "$C" ]; then W=$({interop("C")} /devicequery wake_armed 2>/dev/null </dev/null); R=$?; '
            "echo '@@ft:armed64'; printf '%s\\n' \"$W\" | base64; echo \"@@ft:armed-rc $R\"; fi; fi; true"
        )

    @staticmethod
    def default() -> WakeOnLanInfo:
        return WakeOnLanInfo(None, None, "no output")

    def process(self, output: list[str]) -> WakeOnLanInfo:
        return parse_output(output)
