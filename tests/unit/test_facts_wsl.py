import base64
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from facts.windows import WINDOWS_SYSTEM32
from facts.wsl import (
    WslKernel,
    WslVersion,
    decode_wsl_exe_output,
    parse_proc_version,
    parse_wsl_exe_version,
    parse_wsl_version_output,
)

FIX = Path(__file__).parent.parent / "fixtures" / "real"


def run_sh(command, env=None):
    proc = subprocess.run(["sh", "-c", command], capture_output=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.decode("utf-8").splitlines()


def wsl_exe_lines(data: bytes, rc: int) -> list[str]:
    encoded = base64.encodebytes(data + b"\n@@rc:%d" % rc).decode().splitlines()
    return ["@@ft:wsl.exe", *encoded]


# ---- kernel


def test_wsl2_kernel():
    info = parse_proc_version((FIX / "proc-version-wsl2.txt").read_text())
    assert info.kind == "wsl2"
    assert info.release == "6.6.87.2-microsoft-standard-WSL2"


def test_wsl1_kernel():
    info = parse_proc_version((FIX / "proc-version-wsl1.txt").read_text())
    assert (info.kind, info.release) == ("wsl1", "4.4.0-19041-Microsoft")


@pytest.mark.parametrize(
    "text,kind,release",
    [
        # WSL2 kernels before 5.10 had no "-WSL2" suffix (the 2020 kernel of Windows 10 2004).
        (
            "Linux version 4.19.128-microsoft-standard (oe-user@oe-host) (gcc version 8.2.0 (GCC)) "
            "#1 SMP Tue Jun 23 12:58:10 UTC 2020",
            "wsl2",
            "4.19.128-microsoft-standard",
        ),
        (
            "Linux version 5.4.72-microsoft-standard-WSL2 (oe-user@oe-host) (x86_64-msft-linux-gcc (GCC) 9.3.0) "
            "#1 SMP Wed Oct 28 23:40:43 UTC 2020",
            "wsl2",
            "5.4.72-microsoft-standard-WSL2",
        ),
        # WSL1's fake kernel says Microsoft with a capital M, release and build alike.
        (
            "Linux version 4.4.0-17763-Microsoft (Microsoft@Microsoft.com) (gcc version 5.4.0 (GCC) ) "
            "#2268-Microsoft Thu Oct 07 16:36:00 PST 2021",
            "wsl1",
            "4.4.0-17763-Microsoft",
        ),
        (
            "Linux version 6.1.0-28-amd64 (debian-kernel@lists.debian.org) (gcc-12 (Debian 12.2.0-14) 12.2.0) "
            "#1 SMP PREEMPT_DYNAMIC Debian 6.1.119-1 (2024-11-22)",
            "none",
            "6.1.0-28-amd64",
        ),
    ],
)
def test_kernel_kinds_old_and_new(text, kind, release):
    info = parse_proc_version(text)
    assert (info.kind, info.release) == (kind, release)


def test_plain_linux_kernel():
    assert parse_proc_version((FIX / "proc-version-debian.txt").read_text()).kind == "none"


def test_missing_proc_version():
    info = WslKernel().process(["@@ft:missing"])
    assert info.kind == "none" and info.raw == ""


def test_kernel_command_on_this_machine():
    """Holds on any machine: /proc/version's release is the running kernel's (uname), and it is
    WSL2 (lower-case "microsoft"), WSL1 (only "Microsoft") or not WSL by that release."""
    fact = WslKernel()
    info = fact.process(run_sh(fact.command()))
    assert info.raw.startswith("Linux version")
    release = os.uname().release
    assert info.release == release
    if "microsoft" in release:
        assert info.kind == "wsl2"
    elif "Microsoft" in release:
        assert info.kind == "wsl1"
    else:
        assert info.kind == "none"


# ---- version: wsl.exe bytes


@pytest.mark.parametrize("name", ["wsl-version-en.utf16le", "wsl-version-en-bom.utf16le", "wsl-version-zh.utf16le"])
def test_wsl_exe_version_localised(name):
    info = parse_wsl_exe_version((FIX / name).read_bytes(), 0)
    assert info.status == "ok"
    assert info.version == (2, 7, 13, 0)
    assert info.source == "wsl.exe"


def test_chinese_labels_decode():
    text = decode_wsl_exe_output((FIX / "wsl-version-zh.utf16le").read_bytes())
    assert text.startswith("WSL 版本: 2.7.13.0\r\n")


def test_wsl_utf8_env_output():
    data = (FIX / "wsl-version-en.utf16le").read_bytes().decode("utf-16-le").encode("utf-8")
    assert parse_wsl_exe_version(data, 0).version == (2, 7, 13, 0)


def test_older_wsl_version():
    info = parse_wsl_exe_version((FIX / "wsl-version-2.0.14-en.utf16le").read_bytes(), 0)
    assert info.version == (2, 0, 14, 0)


def test_old_inbox_wsl_has_no_version_flag():
    info = parse_wsl_exe_version((FIX / "wsl-version-old-inbox.utf16le").read_bytes(), 255)
    assert info.status == "no_version_flag"
    assert info.version is None
    assert "Invalid command line option: --version" in info.detail


def test_interop_disabled_is_unavailable():
    info = parse_wsl_exe_version(b"sh: 1: /mnt/c/Windows/System32/wsl.exe: Exec format error\n", 126)
    assert info.status == "unavailable"


def test_empty_wsl_exe_output():
    assert parse_wsl_exe_version(b"", 0).status == "unavailable"


# ---- version: combined output


def test_wslinfo_preferred():
    lines = ["@@ft:wslinfo", (FIX / "wslinfo-wsl-version.txt").read_text().strip(), "@@ft:wslinfo-rc 0"]
    info = parse_wsl_version_output(lines)
    assert (info.status, info.version, info.source) == ("ok", (2, 7, 13), "wslinfo")


def test_wslinfo_without_flag_falls_through_to_wsl_exe():
    lines = ["@@ft:wslinfo", *(FIX / "wslinfo-2.0-no-wsl-version.txt").read_text().splitlines(), "@@ft:wslinfo-rc 1"]
    lines += wsl_exe_lines((FIX / "wsl-version-2.0.14-en.utf16le").read_bytes(), 0)
    info = parse_wsl_version_output(lines)
    assert (info.status, info.version, info.source) == ("ok", (2, 0, 14, 0), "wsl.exe")


def test_wslinfo_without_flag_and_no_wsl_exe():
    lines = ["@@ft:wslinfo", *(FIX / "wslinfo-2.0-no-wsl-version.txt").read_text().splitlines(), "@@ft:wslinfo-rc 1"]
    info = parse_wsl_version_output(lines)
    assert info.status == "unavailable" and info.source == "none"
    assert "unsupported" in info.detail


def test_neither_tool():
    assert parse_wsl_version_output([]).status == "unavailable"
    assert WslVersion.default().source == "none"


def test_version_command_on_this_machine():
    """Holds on any machine: with neither wslinfo nor wsl.exe (not WSL) the version is
    unavailable; with either, it comes from one of them, parsed or 'too old to say'."""
    fact = WslVersion()
    info = fact.process(run_sh(fact.command()))
    wslinfo = shutil.which("wslinfo")
    fallback = f"{WINDOWS_SYSTEM32}/wsl.exe"
    wsl_exe = shutil.which("wsl.exe") or (fallback if os.path.isfile(fallback) else None)
    if not wslinfo and not wsl_exe:
        assert info.status == "unavailable" and info.source == "none"
    elif info.source == "none":  # an old wslinfo without --wsl-version, and no wsl.exe
        assert wslinfo and not wsl_exe and info.status == "unavailable" and "wslinfo" in info.detail
    else:
        assert info.source in (("wslinfo",) if wslinfo else ()) + (("wsl.exe",) if wsl_exe else ()), info
        if info.status == "ok":
            assert info.version and info.version[0] >= 1


def _fake_tool(directory: Path, name: str, fixture: str, rc: int) -> None:
    script = directory / name
    script.write_text(f"#!/bin/sh\ncat '{FIX / fixture}'\nexit {rc}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize(
    "fixture,rc,status,version",
    [
        ("wsl-version-zh.utf16le", 0, "ok", (2, 7, 13, 0)),
        ("wsl-version-old-inbox.utf16le", 255, "no_version_flag", None),
    ],
)
def test_version_command_transports_utf16_bytes(tmp_path, fixture, rc, status, version):
    _fake_tool(tmp_path, "wsl.exe", fixture, rc)
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin")
    fact = WslVersion()
    info = fact.process(run_sh(fact.command(), env=env))
    assert (info.status, info.version, info.source) == (status, version, "wsl.exe")


def test_version_command_wslinfo_then_fallback(tmp_path):
    _fake_tool(tmp_path, "wslinfo", "wslinfo-2.0-no-wsl-version.txt", 1)
    _fake_tool(tmp_path, "wsl.exe", "wsl-version-en.utf16le", 0)
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin")
    fact = WslVersion()
    info = fact.process(run_sh(fact.command(), env=env))
    assert (info.version, info.source) == ((2, 7, 13, 0), "wsl.exe")


def test_version_command_wslinfo_ok_skips_wsl_exe(tmp_path):
    _fake_tool(tmp_path, "wslinfo", "wslinfo-wsl-version.txt", 0)
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin")
    lines = run_sh(WslVersion().command(), env=env)
    assert "@@ft:wsl.exe" not in lines
    assert WslVersion().process(lines).version == (2, 7, 13)


# ---- `wsl.exe --version` is read from its labelled first line, never from the first dotted number.
# Every localisation of MessagePackageVersions in microsoft/WSL localization/strings/*/Resources.resw
# (the first line's label; zh-TW with a full-width colon).
LOCALISED_LABELS = [
    "Verze WSL: ",
    "WSL-version: ",
    "WSL-Version: ",
    "WSL version: ",
    "Versión de WSL: ",
    "WSL-versio: ",
    "Version WSL : ",
    "WSL-verzió: ",
    "Versione WSL: ",
    "WSL バージョン: ",
    "WSL 버전: ",
    "WSL-versjon: ",
    "WSL-versie: ",
    "Wersja podsystemu WSL: ",
    "Versão do WSL: ",
    "Versão WSL: ",
    "Версия WSL: ",
    "WSL sürümü: ",
    "WSL 版本: ",
    "WSL 版本： ",
]


@pytest.mark.parametrize("label", LOCALISED_LABELS)
def test_every_localised_first_line(label):
    text = f"{label}2.7.13.0\r\nKernel: 6.6.87.2-1\r\nWindows: 10.0.26100.6899\r\n"
    info = parse_wsl_exe_version(text.encode("utf-16-le"), 0)
    assert (info.status, info.version) == ("ok", (2, 7, 13, 0))


def test_a_banner_line_is_never_the_wsl_version():
    # A dotted number before the labelled line (here a Windows build in a banner) used to be
    # taken for the WSL version.
    text = "Microsoft Windows [Version 10.0.19045.3393]\r\nWSL version: 2.7.13.0\r\n"
    info = parse_wsl_exe_version(text.encode("utf-16-le"), 0)
    assert info.status == "unavailable" and info.version is None
    assert "not a labelled WSL version" in info.detail


def test_warnings_before_the_version_are_skipped():
    # WSL prints its .wslconfig warnings ("wsl: ...", stderr, merged by the fact) first.
    text = (
        "wsl: Unknown key 'wsl2.a' in C:\\Users\\u\\.wslconfig:21\r\n"
        "wsl: Duplicated config key 'experimental.networkingMode' in C:\\Users\\u\\.wslconfig:4 "
        "(Conflicting key: 'wsl2.networkingMode' in C:\\Users\\u\\.wslconfig:2)\r\n"
        "WSL version: 2.7.13.0\r\nKernel version: 6.6.87.2-1\r\n"
    )
    info = parse_wsl_exe_version(text.encode("utf-16-le"), 0)
    assert (info.status, info.version) == ("ok", (2, 7, 13, 0))


# WSL's interop entry as /proc/sys/fs/binfmt_misc/WSLInterop shows it on a real WSL 2 distro
# (systemd/systemd#28126, Debian 12 on WSL, 2023).
REAL_WSLINTEROP_ENTRY = ["enabled", "interpreter /init", "flags: PF", "offset 0", "magic 4d5a"]


def test_the_interop_binfmt_entry_is_read_as_wsl_shows_it():
    from facts.wsl import InteropRegistration

    fact = InteropRegistration()
    assert fact.process(["@@ft:table", "@@ft:entry WSLInterop", *REAL_WSLINTEROP_ENTRY]).registered
    late = fact.process(["@@ft:table", "@@ft:entry WSLInterop-late", *REAL_WSLINTEROP_ENTRY])
    assert late.registered and late.others == ()
    # systemd-binfmt flushed it: only python's entry is left (the report's own listing).
    flushed = fact.process(["@@ft:table", "@@ft:entry python3.11", "enabled", "interpreter /usr/bin/python3.11"])
    assert flushed.table and not flushed.registered
    disabled = fact.process(["@@ft:table", "@@ft:entry WSLInterop", "disabled", *REAL_WSLINTEROP_ENTRY[1:]])
    assert not disabled.registered
    # Another handler of `MZ` (mono's binfmt-support entry) is named; an entry of another
    # interpreter under WSL's name is not WSL's.
    taken = fact.process(
        [
            "@@ft:table",
            "@@ft:entry WSLInterop",
            *REAL_WSLINTEROP_ENTRY,
            "@@ft:entry cli",
            "enabled",
            "interpreter /usr/lib/binfmt-support/run-detectors",
            "flags: ",
            "offset 0",
            "magic 4d5a",
        ]
    )
    assert taken.registered and taken.others == ("cli",)
    forged = fact.process(["@@ft:table", "@@ft:entry WSLInterop", "enabled", "interpreter /tmp/x", "magic 4d5a"])
    assert not forged.registered
    assert not fact.process([]).table
