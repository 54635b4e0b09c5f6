import base64
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from facts.windows import (
    IniFileInfo,
    WindowsUserProfile,
    WslConfFile,
    WslConfigFile,
    parse_cmd_echo,
    parse_ini,
    parse_ini_output,
    parse_user_profile_output,
)

CMD_EXE = "/mnt/c/Windows/System32/cmd.exe"
FIX = Path(__file__).parent.parent / "fixtures" / "real"

REPORT_WSLCONFIG = (
    b"[wsl2]\r\nmemory=24GB\r\nprocessors=8\r\nswap=4GB\r\nlocalhostForwarding=true\r\nvmIdleTimeout=0\r\n"
)


def run_sh(command, env=None):
    proc = subprocess.run(["sh", "-c", command], capture_output=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.decode("utf-8").splitlines()


def b64(data: bytes) -> list[str]:
    return base64.encodebytes(data).decode().splitlines()


def test_cmd_echo_crlf():
    assert parse_cmd_echo((FIX / "cmd-echo-userprofile.crlf").read_bytes()) == ("C:\\Users\\dev", None)


def test_cmd_echo_unexpanded():
    path, error = parse_cmd_echo((FIX / "cmd-echo-userprofile-unexpanded.crlf").read_bytes())
    assert path is None and "did not expand" in error


def test_cmd_echo_oem_codepage():
    path, error = parse_cmd_echo("C:\\Users\\张三\r\n".encode("gbk"))
    assert path is None and "code page" in error


def test_profile_full_output():
    lines = [
        "@@ft:cmd",
        *b64((FIX / "cmd-echo-userprofile.crlf").read_bytes()),
        "@@ft:wslpath",
        *b64(b"/mnt/c/Users/dev\n"),
        "@@ft:wslpath-rc 0",
    ]
    info = parse_user_profile_output(lines)
    assert (info.path, info.windows_path, info.error) == ("/mnt/c/Users/dev", "C:\\Users\\dev", None)


def test_profile_no_cmd_exe():
    info = parse_user_profile_output(["@@ft:no-cmd"])
    assert info.path is None and "cmd.exe not found" in info.error


def test_profile_wslpath_failure():
    lines = [
        "@@ft:cmd",
        *b64(b"C:\\Users\\dev\r\n"),
        "@@ft:wslpath",
        *b64(b"wslpath: C:\\Users\\dev: Invalid argument\n"),
        "@@ft:wslpath-rc 1",
    ]
    info = parse_user_profile_output(lines)
    assert info.path is None and info.windows_path == "C:\\Users\\dev" and "wslpath" in info.error


def test_profile_command_on_this_machine():
    """Holds on any machine: without cmd.exe or /mnt/c (not WSL) no profile and an error saying
    so; on WSL either the profile, a directory under /mnt/c, or the error that kept it away."""
    fact = WindowsUserProfile()
    info = fact.process(run_sh(fact.command()))
    cmd = shutil.which("cmd.exe") or (CMD_EXE if os.path.isfile(CMD_EXE) else None)
    if cmd is None or not os.path.isdir("/mnt/c"):
        assert info.path is None and info.error
    elif info.path is not None:
        assert info.path.startswith("/mnt/") and os.path.isdir(info.path) and info.error is None
    else:
        assert info.error  # e.g. interop disabled: cmd.exe present but not runnable


def test_profile_command_with_fake_tools(tmp_path):
    # Stand-ins only to prove the shell plumbing (CRLF stripped before wslpath).
    (tmp_path / "cmd.exe").write_text(f"#!/bin/sh\ncat '{FIX / 'cmd-echo-userprofile.crlf'}'\n")
    (tmp_path / "wslpath").write_text(
        '#!/bin/sh\n[ "$2" = "C:\\\\Users\\\\dev" ] && echo /mnt/c/Users/dev || { echo "bad: $2"; exit 1; }\n'
    )
    for tool in ("cmd.exe", "wslpath"):
        (tmp_path / tool).chmod(0o755)
    command = (
        WindowsUserProfile()
        .command()
        .replace("cd /mnt/c", f"cd {tmp_path}")
        .replace("[ -d /mnt/c ]", f"[ -d {tmp_path} ]")
    )
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin")
    info = WindowsUserProfile().process(run_sh(command, env=env))
    assert info.path == "/mnt/c/Users/dev", info


# ---- INI files


def test_report_wslconfig():
    info = parse_ini("/mnt/c/Users/dev/.wslconfig", REPORT_WSLCONFIG)
    assert info.error is None and info.exists
    assert info.sections["wsl2"]["localhostforwarding"] == "true"
    assert info.sections["wsl2"]["vmidletimeout"] == "0"
    assert info.sections["wsl2"]["memory"] == "24GB"


def test_bom_comments_case_and_duplicates():
    """WSL's reading: the first of two keys wins (a later one is only warned about), `;` is no
    comment (that line is skipped in .wslconfig), names match whatever their case."""
    data = b"\xef\xbb\xbf# user comment\r\n[WSL2]\r\nMemory = 16GB\r\n; old\r\nmemory=24GB\r\n[Experimental]\r\nautoMemoryReclaim=gradual\r\n"
    info = parse_ini("x", data)
    assert info.error is None
    assert info.sections == {"wsl2": {"memory": "16GB"}, "experimental": {"automemoryreclaim": "gradual"}}
    assert info.problems == ("line 4: invalid key: a key starts with a letter a-z",)


def test_utf16_notepad_file():
    info = parse_ini("x", b"\xff\xfe" + "[boot]\r\nsystemd=true\r\n".encode("utf-16-le"))
    assert info.sections == {"boot": {"systemd": "true"}}


def test_broken_wsl_conf_is_read_up_to_its_first_bad_line():
    info = parse_ini("/etc/wsl.conf", b"systemd=true\n[boot\nsystemd=true\n")
    assert info.exists and info.sections == {} and info.error is None
    assert info.ini is not None and info.ini.stopped_at == 2
    assert info.problems[0].startswith("line 2: expected ']'")


def test_ini_output_absent_and_present():
    assert parse_ini_output("/etc/wsl.conf", ["@@ft:absent /etc/wsl.conf"]) == IniFileInfo(
        "/etc/wsl.conf", False, {}, None
    )
    info = parse_ini_output("", ["@@ft:file /etc/wsl.conf", *b64(b"[boot]\nsystemd=true\n")])
    assert info.path == "/etc/wsl.conf" and info.sections["boot"]["systemd"] == "true"


def test_wslconfig_command_reads_real_file(tmp_path):
    path = tmp_path / "dir with space" / ".wslconfig"
    path.parent.mkdir()
    path.write_bytes(REPORT_WSLCONFIG)
    fact = WslConfigFile()
    info = fact.process(run_sh(fact.command(str(path))))
    assert info.path == str(path) and info.sections["wsl2"]["processors"] == "8"


def test_wslconfig_command_missing_file(tmp_path):
    fact = WslConfigFile()
    info = fact.process(run_sh(fact.command(str(tmp_path / ".wslconfig"))))
    assert info.exists is False and info.error is None


def test_wsl_conf_command_on_this_machine():
    fact = WslConfFile()
    info = fact.process(run_sh(fact.command()))
    assert info.path == "/etc/wsl.conf"
    assert info.exists == os.path.exists("/etc/wsl.conf")


# --------------------------------------------------------------------------- Windows programs
# Over SSH (sshd under systemd) a real distro has no Windows folder on PATH: every .exe is found
# on PATH first, else in C:\Windows\System32 (here a stand-in folder), by facts.windows.windows_exe.


def _system32(tmp_path, exe: str, script: str) -> Path:
    folder = tmp_path / "System32"
    folder.mkdir(exist_ok=True)
    (folder / exe).write_text("#!/bin/sh\n" + script)
    (folder / exe).chmod(0o755)
    return folder


LINUX_PATH = {"PATH": "/usr/bin:/bin"}


def test_windows_exe_prefers_path_then_system32(tmp_path):
    from facts.windows import windows_exe

    system32 = _system32(tmp_path, "schtasks.exe", "")
    lookup = f'{windows_exe("S", "schtasks.exe", str(system32))}; echo "$S"'
    assert run_sh(lookup, env=LINUX_PATH) == [f"{system32}/schtasks.exe"]
    on_path = tmp_path / "interop"
    on_path.mkdir()
    (on_path / "schtasks.exe").write_text("#!/bin/sh\n")
    (on_path / "schtasks.exe").chmod(0o755)
    assert run_sh(lookup, env={"PATH": f"{on_path}:/usr/bin:/bin"}) == [f"{on_path}/schtasks.exe"]
    missing = f'{windows_exe("S", "schtasks.exe", str(tmp_path / "none"))}; echo "[$S]"'
    assert run_sh(missing, env=LINUX_PATH) == ["[]"]


def test_scheduled_task_fact_finds_schtasks_in_system32(tmp_path):
    from facts.windows import WINDOWS_SYSTEM32
    from facts.windows_tasks import ScheduledTaskExists

    fact = ScheduledTaskExists()
    for status, exists in (("0", True), ("1", False)):
        system32 = _system32(tmp_path, "schtasks.exe", f'[ "$1" = /Query ] && exit {status}\nexit 2\n')
        command = fact.command("FreeToken-WSL").replace(WINDOWS_SYSTEM32, str(system32))
        assert fact.process(run_sh(command, env=LINUX_PATH)) is exists


def test_autostart_runs_schtasks_from_system32_and_names_the_host_without_it(tmp_path):
    from facts.windows import WINDOWS_SYSTEM32
    from operations.windows import autostart_command

    calls = tmp_path / "calls"
    system32 = _system32(tmp_path, "schtasks.exe", f'printf "%s\\n" "$@" > {calls}\n')

    def on_this_machine(command: str, folder: Path) -> str:
        return command.replace(WINDOWS_SYSTEM32, str(folder)).replace("cd /mnt/c", f"cd {tmp_path}")

    command = autostart_command("ws1", "FreeToken-WSL", "Ubuntu-24.04")
    run_sh(on_this_machine(command, system32), env=LINUX_PATH)
    assert calls.read_text().splitlines() == [
        "/Create",
        "/F",
        "/SC",
        "ONLOGON",
        "/TN",
        "FreeToken-WSL",
        "/TR",
        "wsl.exe -d Ubuntu-24.04 --exec /bin/true",
    ]
    proc = subprocess.run(
        ["sh", "-c", on_this_machine(command, tmp_path / "none")], capture_output=True, text=True, env=LINUX_PATH
    )
    assert proc.returncode == 1 and "host ws1" in proc.stderr and "schtasks.exe" in proc.stderr


def test_profile_found_under_a_moved_automount_root(tmp_path):
    """`[automount] root = /` (or any root): cmd.exe is looked for in System32 under that root
    and run from the C: drive there; no /mnt/c is assumed."""
    from facts.windows import system32

    root = f"{tmp_path}/"
    folder = Path(system32(root))
    folder.mkdir(parents=True)
    (folder / "cmd.exe").write_text(
        f"#!/bin/sh\n[ \"$(pwd)\" = '{tmp_path}/c' ] || exit 3\ncat '{FIX / 'cmd-echo-userprofile.crlf'}'\n"
    )
    (folder / "cmd.exe").chmod(0o755)
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "wslpath").write_text(f'#!/bin/sh\n[ "$2" = "C:\\\\Users\\\\dev" ] && echo {tmp_path}/c/Users/dev\n')
    (tools / "wslpath").chmod(0o755)
    fact = WindowsUserProfile()
    info = fact.process(run_sh(fact.command(drive_root=root), env={"PATH": f"{tools}:/usr/bin:/bin"}))
    assert (info.path, info.error) == (f"{tmp_path}/c/Users/dev", None), info
    env = {"PATH": f"{tools}:/usr/bin:/bin"}
    missing = fact.process(run_sh(fact.command(drive_root=f"{tmp_path}/none/"), env=env))
    assert missing.path is None and "cmd.exe not found" in missing.error


def test_preflight_asks_for_windows_programs_under_wsl_confs_automount_root():
    from facts.wsl import WslVersion
    from freetoken_infra.preflight import on_windows_drive

    class Host:
        def get_fact(self, fact, **kwargs):
            return fact, kwargs

    moved = parse_ini("/etc/wsl.conf", b"[automount]\nroot = / # drives at /c\n")
    for fact in (WindowsUserProfile, WslVersion):
        assert on_windows_drive(Host(), fact, moved) == (fact, {"drive_root": "/"})
        # The default root keeps the batched (prefetched) form of the fact.
        default = parse_ini("/etc/wsl.conf", b"[boot]\nsystemd=true\n")
        assert on_windows_drive(Host(), fact, default) == (fact, {})


def test_the_scheduled_task_is_looked_for_under_a_moved_automount_root():
    from facts.windows_tasks import ScheduledTaskExists
    from operations.windows import autostart_command

    for command in (
        ScheduledTaskExists().command("FreeToken-WSL", drive_root="/"),
        autostart_command("ws1", "FreeToken-WSL", "Ubuntu-24.04", drive_root="/"),
    ):
        assert "cd /c " in command and "/c/Windows/System32/schtasks.exe" in command and "/mnt/" not in command


@pytest.mark.parametrize(
    "distro", ["Ubuntu'; touch /tmp/pwned; '", "Ubuntu $(id)", "Ubuntu\nx", "a" * 65, "Ubuntu 24.04"]
)
def test_a_distro_name_shaped_by_the_host_never_reaches_the_command(distro):
    from pyinfra.api.exceptions import OperationError

    from operations.windows import autostart_command

    with pytest.raises(OperationError, match="ws1: windows_autostart: the distro's name read from the host"):
        autostart_command("ws1", "FreeToken-WSL", distro)


# ---- every Windows program a fact or an operation runs has one bound (coreutils
# `timeout -k 2 N`, N = INTEROP_TIMEOUT_S), and a timeout is reported as one, not as garbage.
HANGS = "exec sleep 600\n"
HANGS_PAST_TERM = "trap '' TERM\nsleep 600 &\nwait\nwait\n"  # ignores TERM: KILL after 2 s (exit 137)


@pytest.fixture
def short_bound(monkeypatch):
    import facts.windows

    monkeypatch.setattr(facts.windows, "INTEROP_TIMEOUT_S", 1)


def test_every_interop_call_is_bounded_by_the_one_constant():
    from facts.wake_on_lan import WakeOnLanReadiness
    from facts.windows import INTEROP_TIMEOUT_S
    from facts.windows_tasks import ScheduledTaskExists
    from facts.wsl import WslVersion
    from operations.windows import autostart_command

    bound = f'timeout -k 2 {INTEROP_TIMEOUT_S} "$'
    assert WindowsUserProfile().command().count(bound) == 1
    assert WslVersion().command().count(bound) == 1
    assert ScheduledTaskExists().command("FreeToken-WSL").count(bound) == 1
    assert WakeOnLanReadiness().command().count(bound) == 2
    assert autostart_command("ws1", "FreeToken-WSL", "Ubuntu-24.04").count(bound) == 1


@pytest.mark.parametrize("script", [HANGS, HANGS_PAST_TERM])
def test_a_hung_cmd_exe_is_reported_as_timed_out(tmp_path, short_bound, script):
    from facts.windows import system32

    root = f"{tmp_path}/"
    folder = Path(system32(root))
    folder.mkdir(parents=True)
    (folder / "cmd.exe").write_text("#!/bin/sh\n" + script)
    (folder / "cmd.exe").chmod(0o755)
    fact = WindowsUserProfile()
    info = fact.process(run_sh(fact.command(drive_root=root), env=LINUX_PATH))
    assert (info.path, info.error) == (None, "cmd.exe timed out after 1 s (WSL interop)")


def test_a_timed_out_exit_status_is_read_as_a_timeout():
    from facts.wake_on_lan import parse_output
    from facts.windows import parse_user_profile_output
    from facts.wsl import parse_wsl_exe_version

    for rc in (124, 137):
        info = parse_user_profile_output(["@@ft:cmd", "", f"@@ft:cmd-rc {rc}"])
        assert info.error == "cmd.exe timed out after 30 s (WSL interop)"
        assert parse_wsl_exe_version(b"", rc).detail == "wsl.exe timed out after 30 s (WSL interop)"
        wol = parse_output(["@@ft:adapters64", "", f"@@ft:adapters-rc {rc}"])
        assert (wol.adapters, wol.error) == (None, "powershell.exe timed out after 30 s (WSL interop)")
    # the output of a run without the rc line (an older fact) still reads as before
    cmd = base64.b64encode((FIX / "cmd-echo-userprofile.crlf").read_bytes()).decode()
    assert parse_user_profile_output(["@@ft:cmd", cmd]).windows_path == "C:\\Users\\dev"


def test_a_hung_wsl_exe_is_reported_as_timed_out(tmp_path, short_bound):
    from facts.wsl import WslVersion

    (tmp_path / "wsl.exe").write_text("#!/bin/sh\n" + HANGS)
    (tmp_path / "wsl.exe").chmod(0o755)
    fact = WslVersion()
    info = fact.process(run_sh(fact.command(), env={"PATH": f"{tmp_path}:/usr/bin:/bin"}))
    assert (info.status, info.source, info.detail) == (
        "unavailable",
        "wsl.exe",
        "wsl.exe timed out after 1 s (WSL interop)",
    )


def test_a_hung_schtasks_is_bounded_and_autostart_says_it_timed_out(tmp_path, short_bound):
    from facts.windows import WINDOWS_SYSTEM32
    from facts.windows_tasks import ScheduledTaskExists
    from operations.windows import autostart_command

    system32 = _system32(tmp_path, "schtasks.exe", HANGS_PAST_TERM)
    fact = ScheduledTaskExists()
    command = fact.command("FreeToken-WSL").replace(WINDOWS_SYSTEM32, str(system32))
    assert fact.process(run_sh(command, env=LINUX_PATH)) is False  # unanswered: created, bounded the same way
    create = autostart_command("ws1", "FreeToken-WSL", "Ubuntu-24.04").replace(WINDOWS_SYSTEM32, str(system32))
    proc = subprocess.run(
        ["sh", "-c", create.replace("cd /mnt/c", f"cd {tmp_path}")], capture_output=True, text=True, env=LINUX_PATH
    )
    assert proc.returncode == 137
    assert "host ws1: windows_autostart: schtasks.exe timed out after 1 s (WSL interop)" in proc.stderr


def test_a_hung_powershell_is_reported_as_timed_out(tmp_path, short_bound):
    from facts.wake_on_lan import WakeOnLanReadiness
    from facts.windows import system32

    root = f"{tmp_path}/"
    folder = Path(system32(root)) / "WindowsPowerShell" / "v1.0"
    folder.mkdir(parents=True)
    (folder / "powershell.exe").write_text("#!/bin/sh\n" + HANGS)
    (folder / "powershell.exe").chmod(0o755)
    info = WakeOnLanReadiness().process(run_sh(WakeOnLanReadiness().command(drive_root=root), env=LINUX_PATH))
    assert (info.adapters, info.error) == (None, "powershell.exe timed out after 1 s (WSL interop)")
