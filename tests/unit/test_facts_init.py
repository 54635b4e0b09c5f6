import shutil
import subprocess

from facts.init import InitInfo, InitSystem, parse_init_output


def test_systemd_running():
    info = parse_init_output(["@@ft:pid1", "systemd", "@@ft:state", "running"])
    assert info == InitInfo("systemd", "running") and info.systemd_up


def test_systemd_degraded_counts_as_up():
    info = parse_init_output(["@@ft:pid1", "systemd", "@@ft:state", "degraded"])
    assert info.systemd_pid1 and info.systemd_up


def test_systemd_starting_is_not_up():
    assert not parse_init_output(["@@ft:pid1", "systemd", "@@ft:state", "starting"]).systemd_up


def test_wsl_init_without_systemd():
    info = parse_init_output(["@@ft:pid1", "init", "@@ft:state", "offline"])
    assert info.pid1 == "init" and info.system_state == "offline"
    assert not info.systemd_pid1 and not info.systemd_up


def test_no_systemctl():
    info = parse_init_output(["@@ft:pid1", "init"])
    assert info.system_state is None and not info.systemd_up


def test_empty_output():
    assert InitSystem.default() == InitInfo("", None)
    assert parse_init_output([]) == InitInfo("", None)


def test_command_on_this_machine():
    proc = subprocess.run(["sh", "-c", InitSystem().command()], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    info = InitSystem().process(proc.stdout.splitlines())
    # Holds on any machine: PID 1 as /proc says, and "up" only for systemd running or degraded.
    pid1 = open("/proc/1/comm").read().strip()
    assert info.pid1 == pid1
    state = None
    if shutil.which("systemctl"):
        state = (
            subprocess.run(
                ["systemctl", "is-system-running"], capture_output=True, text=True, timeout=30
            ).stdout.strip()
            or None
        )
    assert info.system_state == state
    assert info.systemd_up == (pid1 == "systemd" and state in ("running", "degraded"))
