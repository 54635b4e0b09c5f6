"""Facts about the Windows Subsystem for Linux the target runs in.

``WslKernel`` tells WSL2 from WSL1 from "not WSL" by the kernel string; ``WslVersion`` reads the
WSL package version, which decides the field report's pitfall 4 (idle reaping and the WDDM
allocation lock-up are fixed from WSL 2.7.13 on).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pyinfra.api import FactBase

from freetoken_infra.core import owner
from freetoken_infra.core.layout import BINFMT_DIR, DEFAULT_DRIVE_ROOT, INTEROP_BINFMT_NAMES, drive_path

from ._declare import BOOT_ONLY, PATH, Inputs
from ._output import b64decode_lines, parse_int, quote, section_map, sections
from .windows import INTEROP_TIMEOUT_S, interop, interop_timed_out, system32, windows_exe

# --------------------------------------------------------------------------- kernel


@dataclass(frozen=True)
class WslKernelInfo:
    kind: Literal["wsl2", "wsl1", "none"]
    release: str
    raw: str


def parse_proc_version(text: str | None) -> WslKernelInfo:
    """Classify the contents of ``/proc/version`` (None: the file could not be read)."""
    raw = (text or "").strip()
    match = re.match(r"Linux version (\S+)", raw)
    release = match.group(1) if match else ""
    # WSL2's real kernels say "microsoft" in lower case: "6.6.87.2-microsoft-standard-WSL2", and
    # before 5.10 without the suffix: "4.19.128-microsoft-standard". WSL1's fake kernel says it
    # with a capital M: "4.4.0-19041-Microsoft (Microsoft@Microsoft.com)" (fixtures in
    # tests/fixtures/real/proc-version-*.txt; their README says which are published captures).
    if "wsl2" in raw.lower() or "microsoft" in release or "microsoft-standard" in raw:
        kind: Literal["wsl2", "wsl1", "none"] = "wsl2"
    elif "microsoft" in raw.lower():
        kind = "wsl1"
    else:
        kind = "none"
    return WslKernelInfo(kind=kind, release=release, raw=raw)


class WslKernel(FactBase[WslKernelInfo]):
    """
    Returns ``WslKernelInfo``: whether the kernel is WSL2's, WSL1's or not WSL at all.

    Reads ``/proc/version`` rather than ``uname -r``: it is what a test container can fake.
    """

    # The kernel's answer: changes only with a restart of the WSL VM.
    fast_check_inputs = BOOT_ONLY

    def command(self) -> str:
        return "cat /proc/version 2>/dev/null || echo '@@ft:missing'"

    @staticmethod
    def default() -> WslKernelInfo:
        return WslKernelInfo(kind="none", release="", raw="")

    def process(self, output: list[str]) -> WslKernelInfo:
        if any(line.startswith("@@ft:missing") for line in output):
            return self.default()
        return parse_proc_version("\n".join(output))


# --------------------------------------------------------------------------- version

_VERSION_RE = re.compile(r"(?<![\d.])(\d+(?:\.\d+)+)(?![\d.])")


@dataclass(frozen=True)
class WslVersionInfo:
    status: Literal["ok", "no_version_flag", "unavailable"]
    version: tuple[int, ...] | None
    source: Literal["wslinfo", "wsl.exe", "none"]
    detail: str


def decode_wsl_exe_output(data: bytes) -> str:
    """Decode ``wsl.exe`` output: UTF-16LE (with or without BOM), or UTF-8 when ``WSL_UTF8=1``."""
    if data.startswith(b"\xff\xfe"):
        return data[2:].decode("utf-16-le", errors="replace")
    if data.startswith(b"\xef\xbb\xbf"):
        return data[3:].decode("utf-8", errors="replace")
    # UTF-16LE of mostly-ASCII text has a NUL in (nearly) every odd byte.
    odd = data[1::2]
    if odd and odd.count(0) >= len(odd) // 2:
        return data.decode("utf-16-le", errors="replace")
    return data.decode("utf-8", errors="replace")


# `wsl.exe --version` prints its package version on its first line, labelled in the Windows
# display language, with an ASCII or a full-width colon: "WSL version: 2.7.13.0", "WSL-Version:",
# "Version WSL :", "Versión de WSL:", "Wersja podsystemu WSL:", "WSL 版本: ", "WSL 版本： "
# (every localisation in microsoft/WSL localization/strings/*/Resources.resw,
# MessagePackageVersions, has "WSL" in the label).
_LABELLED_VERSION_RE = re.compile(r"(?P<label>[^:：]*WSL[^:：]*?)\s*[:：]\s*(?P<version>\d+(?:\.\d+)+)\s*")


def first_version(text: str) -> tuple[int, ...] | None:
    """The first dotted number in ``text``; only for ``wslinfo``-like bare answers."""
    match = _VERSION_RE.search(text)
    if not match:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def labelled_version(text: str) -> tuple[tuple[int, ...] | None, str]:
    """``(version, line)`` from the first line of ``wsl.exe --version`` that is not a warning.

    Warnings WSL prints before it (``wsl: ...``, e.g. about a .wslconfig key) are skipped; the
    line after them must be the labelled WSL version, else None: a dotted number anywhere else
    (the kernel, Windows, a banner) is never taken for the WSL version.
    """
    for line in text.splitlines():
        stripped = line.strip().lstrip("\ufeff")
        if not stripped or stripped.lower().startswith("wsl:"):
            continue
        match = _LABELLED_VERSION_RE.fullmatch(stripped)
        if match is None:
            return None, stripped
        return tuple(int(part) for part in match.group("version").split(".")), stripped
    return None, ""


def parse_wslinfo(text: str, rc: int | None) -> tuple[int, ...] | None:
    """``wslinfo --wsl-version`` prints just the version; anything else means "not supported"."""
    stripped = text.strip()
    if rc != 0 or not re.fullmatch(r"\d+(?:\.\d+)+", stripped):
        return None
    return tuple(int(part) for part in stripped.split("."))


def parse_wsl_exe_version(data: bytes, rc: int | None) -> WslVersionInfo:
    """Classify the raw bytes and exit status of ``wsl.exe --version``."""
    text = decode_wsl_exe_output(data).replace("\r\n", "\n").replace("\x00", "").strip()
    detail = text[:400]
    timed_out = interop_timed_out("wsl.exe", rc)
    if timed_out:
        return WslVersionInfo("unavailable", None, "wsl.exe", timed_out)
    if rc in (126, 127):
        # The shell could not execute it (interop disabled: "Exec format error").
        return WslVersionInfo("unavailable", None, "wsl.exe", detail or f"wsl.exe exit {rc}")
    if rc == 0:
        version, line = labelled_version(text)
        if version is not None:
            return WslVersionInfo("ok", version, "wsl.exe", detail)
        if line:
            return WslVersionInfo(
                "unavailable", None, "wsl.exe", f"first line is not a labelled WSL version: {line[:200]}"
            )
        return WslVersionInfo("unavailable", None, "wsl.exe", detail or "empty output")
    if text:
        # The inbox WSL of older Windows builds: usage text, non-zero exit.
        return WslVersionInfo("no_version_flag", None, "wsl.exe", detail)
    return WslVersionInfo("unavailable", None, "wsl.exe", f"wsl.exe exit {rc}, no output")


def split_exit_status(raw: bytes) -> tuple[bytes, int | None]:
    """Split ``<tool bytes>\\n@@rc:<status>`` (appended by the shell after the tool exits)."""
    data, sep, tail = raw.rpartition(b"\n@@rc:")
    if not sep:
        return raw, None
    return data, parse_int(tail.decode("ascii", errors="replace"))


def parse_wsl_version_output(lines: list[str]) -> WslVersionInfo:
    """Combine the ``wslinfo`` and ``wsl.exe`` sections of the ``WslVersion`` command."""
    secs = section_map(lines)
    wslinfo_detail = ""
    if "wslinfo" in secs:
        body = secs["wslinfo"][1]
        rc = parse_int(secs.get("wslinfo-rc", ("", []))[0])
        text = "\n".join(body)
        version = parse_wslinfo(text, rc)
        if version is not None:
            return WslVersionInfo("ok", version, "wslinfo", text.strip())
        wslinfo_detail = f"wslinfo --wsl-version unsupported (exit {rc}): {text.strip()[:200]}"
    if "wsl.exe" in secs:
        raw = b64decode_lines(secs["wsl.exe"][1])
        if raw is None:
            return WslVersionInfo("unavailable", None, "wsl.exe", "undecodable wsl.exe output")
        data, rc = split_exit_status(raw)
        return parse_wsl_exe_version(data, rc)
    detail = wslinfo_detail or "neither wslinfo nor wsl.exe found"
    return WslVersionInfo("unavailable", None, "none", detail)


class WslVersion(FactBase[WslVersionInfo]):
    """
    Returns ``WslVersionInfo``: the WSL package version (e.g. ``(2, 7, 13)``).

    Tries ``wslinfo --wsl-version`` (inside the distro, WSL >= 2.2.3), then ``wsl.exe
    --version`` through interop (UTF-16LE output, localised labels). ``no_version_flag`` means
    an inbox WSL too old to know ``--version``; ``unavailable`` means neither tool answered.
    """

    argument_shapes = {"drive_root": PATH}
    # A new WSL version needs a restart of the WSL VM.
    fast_check_inputs = BOOT_ONLY

    def command(self, drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
        """+ drive_root: wsl.conf's ``[automount] root`` (where System32's wsl.exe is)."""
        return (
            "if command -v wslinfo >/dev/null 2>&1; then "
            "V=$(wslinfo --wsl-version 2>&1); R=$?; "
            "echo '@@ft:wslinfo'; printf '%s\\n' \"$V\"; echo \"@@ft:wslinfo-rc $R\"; "
            'case "$R:$V" in 0:[0-9]*.[0-9]*) exit 0;; esac; fi; '
            f"{windows_exe('W', 'wsl.exe', system32(drive_root))}; "
            'if [ -n "$W" ]; then '
            "echo '@@ft:wsl.exe'; "
            # The exit status rides behind the raw bytes (see split_exit_status).
            f"{{ {interop('W')} --version 2>&1 </dev/null; printf '\\n@@rc:%s' \"$?\"; }} | base64; "
            "fi; true"
        )

    @staticmethod
    def default() -> WslVersionInfo:
        return WslVersionInfo("unavailable", None, "none", "no output")

    def process(self, output: list[str]) -> WslVersionInfo:
        return parse_wsl_version_output(output)


# --------------------------------------------------------------------------- interop's binfmt entry


@dataclass(frozen=True)
class InteropBinfmt:
    """WSL's interop handler in the kernel's binfmt_misc table (``BINFMT_DIR``)."""

    table: bool  # the table is there (a WSL2 VM with binfmt_misc mounted)
    registered: bool  # an enabled WSLInterop (or WSLInterop-late): `MZ` at offset 0 -> /init
    others: tuple[str, ...] = ()  # other enabled entries claiming `MZ` (mono, wine): they may take it


def parse_binfmt_entry(text: str) -> dict[str, str]:
    """One entry of the table (``enabled``, ``interpreter /init``, ``flags: PF``, ``offset 0``,
    ``magic 4d5a``; systemd/systemd#28126) as a dict; ``enabled`` is ``yes`` or ``no``."""
    lines = text.splitlines()
    entry = {"enabled": "yes" if lines[:1] == ["enabled"] else "no"}
    for line in lines[1:]:
        key, _, value = line.replace("flags:", "flags", 1).partition(" ")
        entry[key] = value.strip()
    return entry


def parse_binfmt_output(output: list[str]) -> InteropBinfmt:
    found = sections(output)
    if not any(name == "table" for name, _, _ in found):
        return InteropBinfmt(False, False)
    registered, others = False, []
    for key, name, lines in found:
        if key != "entry":
            continue
        entry = parse_binfmt_entry("\n".join(lines))
        if entry["enabled"] != "yes" or entry.get("magic") != "4d5a" or entry.get("offset", "0") != "0":
            continue
        if entry.get("interpreter") == "/init" and name in INTEROP_BINFMT_NAMES:
            registered = True
        elif entry.get("interpreter") != "/init":
            others.append(name)
    return InteropBinfmt(True, registered, tuple(sorted(others)))


class InteropRegistration(FactBase[InteropBinfmt]):
    """
    Returns ``InteropBinfmt``: whether WSL's interop handler (the ``WSLInterop`` entry, or
    ``WSLInterop-late``) is registered in ``/proc/sys/fs/binfmt_misc``, and which other entries
    claim Windows programs (``MZ``). Read only; the entries are the kernel's, a few lines each.
    """

    # The binfmt_misc table's entries: one gone, re-registered or added (another `MZ` handler).
    fast_check_inputs = Inputs(
        paths={f"{BINFMT_DIR}/{name}" for name in INTEROP_BINFMT_NAMES}, globs={f"{BINFMT_DIR}/*"}
    )

    def command(self) -> str:
        d = BINFMT_DIR
        return (
            f"if [ -d {d} ] && [ -e {d}/status ]; then echo '@@ft:table'; "
            f"for f in {d}/*; do n=${{f##*/}}; case $n in status|register) continue;; esac; "
            '[ -f "$f" ] || continue; '
            "case $n in *[!A-Za-z0-9._-]*) continue;; esac; "
            'echo "@@ft:entry $n"; head -c 512 "$f"; echo; done; fi; true'
        )

    @staticmethod
    def default() -> InteropBinfmt:
        return InteropBinfmt(False, False)

    def process(self, output: list[str]) -> InteropBinfmt:
        return parse_binfmt_output(output)


# --------------------------------------------------------------------------- interop as a service sees it

PROBE_WORD = "freetoken-interop-ok"


@dataclass(frozen=True)
class InteropProbe:
    """A Windows program started from a systemd service, as the host agent starts them."""

    reason: str  # core.owner.interop_reason: INTEROP_OK ("") when it ran and answered
    detail: str = ""  # what the caller saw, shortened (for the finding's evidence)


def parse_service_probe(output: list[str]) -> InteropProbe:
    secs = section_map(output)
    if "no-cmd" in secs:
        return InteropProbe(owner.PROGRAM_MISSING, "no cmd.exe in System32")
    if "no-systemd-run" in secs:
        return InteropProbe(owner.INTEROP_ERROR, "no systemd-run (systemd is not PID 1)")
    raw = b64decode_lines(secs["svc"][1]) if "svc" in secs else None
    if raw is None:
        return InteropProbe(owner.INTEROP_ERROR, "no output")
    data, rc = split_exit_status(raw)
    timed_out = rc in owner.TIMEOUT_EXITS
    reason = owner.interop_reason(None, rc, data, b"", timed_out=timed_out, timeout_s=INTEROP_TIMEOUT_S)
    if reason == owner.INTEROP_OK and PROBE_WORD.encode() not in data:
        reason = owner.INTEROP_ERROR  # it ran but did not answer as cmd.exe answers
    detail = data.decode("utf-8", "replace").replace("\r", "").strip().splitlines()
    return InteropProbe(reason, (detail[-1] if detail else f"exit {rc}")[:200])


class InteropAsService(FactBase[InteropProbe]):
    """
    Returns ``InteropProbe``: whether a Windows program starts from a systemd service (a
    transient unit, root, no login session: as the host agent runs ``tasklist.exe``), which is
    where interop breaks under systemd (the binfmt entry flushed, another ``MZ`` handler, a
    dead interop server, a Windows side that hangs), while a login shell may still work. Runs
    ``cmd.exe /c echo`` once under one deadline; the doctor reads it, the deploy does not.
    """

    argument_shapes = {"drive_root": PATH}
    # Interop as a service sees it: read by the doctor only, never by a converge.
    fast_check_inputs = BOOT_ONLY

    def command(self, drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
        cmd = f"{system32(drive_root)}/cmd.exe"
        limit = INTEROP_TIMEOUT_S - 5
        return (
            f"if [ ! -f {quote(cmd)} ]; then echo '@@ft:no-cmd'; "
            "elif ! command -v systemd-run >/dev/null 2>&1; then echo '@@ft:no-systemd-run'; "
            "else echo '@@ft:svc'; "
            f"{{ cd {quote(drive_path(drive_root))} 2>/dev/null; timeout -k 2 {INTEROP_TIMEOUT_S} systemd-run --quiet "
            f"--wait --pipe --collect --service-type=exec -p RuntimeMaxSec={limit} "
            # Through bash: an exec that fails says why (systemd's own exec would only exit 203).
            f"/bin/bash -c 'exec \"$0\" /c echo {PROBE_WORD}' {quote(cmd)} 2>&1 </dev/null; "
            "printf '\\n@@rc:%s' \"$?\"; } | base64; "
            "fi; true"
        )

    @staticmethod
    def default() -> InteropProbe:
        return InteropProbe(owner.INTEROP_ERROR, "no output")

    def process(self, output: list[str]) -> InteropProbe:
        return parse_service_probe(output)
