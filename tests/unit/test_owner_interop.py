"""When WSL interop fails: each failure classified into one short reason from the real
outputs (tests/fixtures/real/README.md), the agent's Windows reader run against fake System32
programs that fail that way (a file exec cannot run, the real stderr and exit status, a program
that never exits and one that prints forever), the owner signals it then reports (state file,
``freetoken-owner status``, the agent-check note, ``fleet status``), and the VRAM claim that
still yields."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from freetoken_infra import fleet
from freetoken_infra.core import owner
from freetoken_infra.core.owner import SERVING, YIELDED, YIELDING, AgentState, Observation, Policy
from operations.scripts import owner_agent
from tests.unit import test_owner_windows

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
ENGINE_MIB = 6042
POLICY = Policy(vram_threshold_mib=4096, quiet_s=30, apps=("eldenring.exe",), fullscreen=True)
ALL = "VRAM, apps, full screen, reboot"
MISSING_KEY = "ERROR: The system was unable to find the specified registry key or value."


def real(name: str) -> bytes:
    return (REAL / name).read_bytes()


# --------------------------------------------------------------------------- the classifier
@pytest.mark.parametrize(
    ("returncode", "stderr", "reason"),
    [
        (126, "interop-exec-format-bash.txt", "Exec format error"),
        (2, "interop-run-detectors.txt", "run-detectors: no interpreter"),
        (1, "interop-connect-failed-111.txt", "interop socket: connect failed 111"),
        (1, "interop-connect-failed-2.txt", "interop socket: connect failed 2"),
        (1, "interop-connect-failed-2-old-init.txt", "interop socket: connect failed 2"),
        (1, "interop-vsock-socket-failed-97.txt", "vsock refused"),
        (1, "interop-accept4-failed-110.txt", "Windows never connected back"),
    ],
)
def test_each_real_failure_has_its_reason(returncode, stderr, reason):
    assert owner.interop_reason(None, returncode, b"", real(stderr)) == reason
    # the facts merge stderr into stdout (2>&1): the same reason
    assert owner.interop_reason(None, returncode, real(stderr), b"") == reason
    assert owner.reason_ok(reason)


def test_the_other_outcomes_of_an_interop_call():
    enoexec = OSError(8, "Exec format error")
    assert owner.interop_reason(enoexec, None) == "Exec format error"
    assert owner.interop_reason(FileNotFoundError(2, "No such file"), None) == "cannot start (ENOENT)"
    assert owner.interop_reason(None, None, timed_out=True, timeout_s=20) == "timed out after 20 s"
    assert owner.interop_reason(None, None, timed_out=True, timeout_s=0.2) == "timed out after 1 s"
    assert owner.interop_reason(None, 1, b"", b"") == "no answer (exit 1, nothing printed)"
    assert owner.interop_reason(None, 1, b"\r\n", b" \n") == "no answer (exit 1, nothing printed)"
    # an unknown line of WSL's init: an interop error, never its text
    assert owner.interop_reason(None, 1, b"", b"<3>WSL (12 - ) ERROR: Foo:1: bar 3\n") == "interop error"
    # answers: what a program says itself is its parser's business
    assert owner.interop_reason(None, 0, real("tasklist-csv-nh.crlf"), b"") == owner.INTEROP_OK
    missing_key = b"ERROR: The system was unable to find the specified registry key or value.\r\n"
    assert owner.interop_reason(None, 1, b"", missing_key) == owner.INTEROP_OK  # reg.exe: no such key
    assert owner.interop_reason(None, 0, b"", b"") == owner.INTEROP_OK
    # "Exec format error" from a program that did run (exit 0, 1) is its own text, not binfmt's
    assert owner.interop_reason(None, 0, b"Exec format error\r\n", b"") == owner.INTEROP_OK


def test_reasons_and_signals_are_a_fixed_vocabulary():
    for bad in ("", "connect failed 111", "timed out after x s", "Exec format error\n", "cannot start (rm -rf)"):
        assert not owner.reason_ok(bad), bad
    for good in (ALL, "VRAM", "VRAM, reboot", "VRAM only (interop: Exec format error)"):
        assert owner.signals_ok(good), good
    for bad in (
        "VRAM only",  # only with a reason
        "VRAM (interop: Exec format error)",
        "VRAM only (interop: something Windows printed)",
        "apps, VRAM",
        "VRAM, reboot, apps",
        "VRAM only (interop: Exec format error)\nready 100%",
        "VRAM only (interop: Exec format error) #",
    ):
        assert not owner.signals_ok(bad), bad


def test_the_signals_line_names_what_is_on_and_why_the_rest_is_off():
    wanted = owner.WINDOWS_SIGNALS
    assert owner.signals_line(wanted, {}) == ALL
    assert owner.signals_line((owner.SIG_REBOOT,), {}) == "VRAM, reboot"  # what is not configured is not named
    assert owner.signals_line((), {}) == "VRAM"
    broken = dict.fromkeys(wanted, "Exec format error")
    assert owner.signals_line(wanted, broken) == "VRAM only (interop: Exec format error)"
    assert (
        owner.signals_line(wanted, {owner.SIG_APPS: "timed out after 20 s"})
        == "VRAM, full screen, reboot (interop: timed out after 20 s)"
    )
    # a broken signal that is not configured is not reported
    assert owner.signals_line((owner.SIG_REBOOT,), {owner.SIG_APPS: "vsock refused"}) == "VRAM, reboot"
    longest = max(
        (owner.signals_line(wanted[:1] + wanted[2:], {owner.SIG_REBOOT: r}) for r in _ALL_REASONS),
        key=len,
    )
    assert len(longest) <= owner.NOTE_MAX and owner.signals_ok(longest)


_ALL_REASONS = (
    "Exec format error",
    "run-detectors: no interpreter",
    "interop socket: connect failed 111",
    "vsock refused",
    "Windows never connected back",
    "interop error",
    "no answer (exit 1, nothing printed)",
    "program missing",
    "no Windows drive",
    "timed out after 20 s",
    "cannot start (ENAMETOOLONG)",
)


# --------------------------------------------------------------------------- what others see
BROKEN = "VRAM only (interop: Exec format error)"


def test_the_agent_check_note_carries_the_signals_only_when_one_is_off():
    serving = AgentState(signals=ALL)
    assert owner.agent_word(serving, 0) == b"up\n"  # all work: the answers as before
    assert owner.agent_word(AgentState(signals=BROKEN), 0) == f"up #{BROKEN}\n".encode()
    assert owner.agent_word(AgentState(signals=BROKEN, ready_until=10), 0) == f"ready 100% up #{BROKEN}\n".encode()
    game = AgentState(mode=YIELDED, word="yielded (game)", signals=BROKEN)
    assert owner.agent_word(game, 0) == f"drain 0% up #yielded (game); {BROKEN}\n".encode()
    assert owner.agent_word(AgentState(mode=YIELDED, word="yielded (game)", signals=ALL), 0) == (
        b"drain 0% up #yielded (game)\n"
    )
    # a long app name and a long reason: the signals are left out, the status word kept whole
    app = "yielded (app " + "a" * 59 + ".exe)"
    long_signals = "VRAM, reboot (interop: no answer (exit 1, nothing printed))"
    answer = owner.agent_word(AgentState(mode=YIELDED, word=app, signals=long_signals), 0)
    assert answer == f"drain 0% up #{app}\n".encode()
    # text that is not of the vocabulary never reaches the answer
    assert owner.agent_word(AgentState(signals="VRAM only (interop: x)\nready 100%"), 0) == b"up\n"
    for state in (AgentState(signals=BROKEN), game, AgentState(mode=YIELDED, word=app, signals=long_signals)):
        line = owner.agent_word(state, 0)
        assert line.count(b"\n") == 1 and line.endswith(b"\n") and line.isascii()
        note = line.partition(b"#")[2].strip().decode()
        assert len(f"via agent : up ({note})") < 128  # HAProxy 2.6's HCHK_DESC_LEN


def test_status_and_the_state_file_say_which_signals_are_off():
    state = AgentState(signals=BROKEN, since=1)
    text = owner.describe(owner.load_state(owner.dump_state(state, 2).decode()), None, 2)
    assert f"owner signals: {BROKEN}" in text
    assert f"owner signals: {ALL}" in owner.describe(AgentState(signals=ALL), None, 2)
    assert "owner signals" not in owner.describe(AgentState(), None, 2)  # not known yet
    doc = owner.dump_state(AgentState(signals="VRAM only (interop: <3>WSL junk)"), 2).decode()
    assert owner.load_state(doc).signals == ""


# `show stat` rows as HAProxy 2.6 keeps the agent's notes: `via agent : up (NOTE)` (see
# test_owner_windows.SHOW_STAT for the capture the layout comes from).
SHOW_STAT = f"""# pxname,svname,qcur,qmax,scur,smax,status,check_status,check_code,check_duration,last_chk,last_agt
freetoken,ws1,0,0,1,4,UP,L7OK,200,1,,via agent : up ({BROKEN})
freetoken,ws2,0,0,0,0,DRAIN (agent),L7OK,200,1,,via agent : up (yielded (game); {BROKEN})
freetoken,ws3,0,0,0,0,UP,L7OK,200,1,,via agent : up
freetoken,ws4,0,0,0,0,UP,L7OK,200,1,,via agent : up (VRAM only (interop: \x1b[2J))
freetoken,ws5,0,0,0,0,DRAIN (agent),L7OK,200,1,,via agent : up (snoozed; rm -rf)
freetoken,BACKEND,0,0,3,9,UP,,,,,
"""


def test_fleet_status_shows_the_signals_per_host():
    got = {s.host: (s.state, s.signals) for s in fleet.parse_stat(SHOW_STAT)}
    assert got == {
        "ws1": ("in service", BROKEN),
        "ws2": ("yielded (game)", BROKEN),
        "ws3": ("in service", ""),
        "ws4": ("in service", ""),  # not of the vocabulary: never shown
        "ws5": ("draining", ""),
    }
    table = fleet.format_status(fleet.parse_stat(SHOW_STAT), {})
    assert f"ws1: owner signals: {BROKEN}" in table and f"ws2: owner signals: {BROKEN}" in table
    assert "ws3: owner signals" not in table and "\x1b" not in table
    assert owner.word_from_last_agt(f"via agent : up (yielded (game); {BROKEN})") == "yielded (game)"


# --------------------------------------------------------------------------- the agent's reader
def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


TOOLS = ("tasklist.exe", "reg.exe", "WindowsPowerShell/v1.0/powershell.exe")


def _system32(tmp_path: Path, make) -> Path:
    """A fake System32 under a fake C: drive, each of the agent's programs made by ``make``."""
    win = tmp_path / "c" / "Windows" / "System32"
    for tool in TOOLS:
        make(win / tool)
    return win


def _fails_with(fixture: str | None, code: int):
    def make(path: Path) -> None:
        shown = f"cat '{REAL / fixture}' >&2\n" if fixture else ""
        _script(path, f"{shown}exit {code}\n")

    return make


def _no_format(path: Path) -> None:
    """A file exec cannot run (no ELF, no #!): what a .exe is once WSLInterop is gone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x00\x01\x02 not a program\n")
    path.chmod(0o755)


def _watch(win: Path, deadline_s: float = 10.0) -> owner_agent.WindowsWatch:
    watch = owner_agent.WindowsWatch(str(win), POLICY.apps, True, True, 5.0, deadline_s=deadline_s)
    assert watch.wanted
    return watch


def _yields_on_vram(watch: owner_agent.WindowsWatch, signals: str) -> None:
    """With those Windows signals, a game's VRAM still yields, and the note says what is off."""
    apps, fullscreen, reboot = watch.seen()
    assert (apps, fullscreen, reboot) == ((), False, False)
    state = AgentState(signals=signals)
    obs = Observation(
        now=1,
        gpu_used_mib=853 + ENGINE_MIB + 20 * 1024,
        engine_active=True,
        engine_vram_mib=ENGINE_MIB,
        health_ok=True,
        apps_running=apps,
        fullscreen=fullscreen,
        reboot_pending=reboot,
    )
    state, action = owner.step(state, obs, POLICY)
    assert (state.mode, state.word, action) == (YIELDING, "yielded (game)", None)
    assert state.signals == signals
    assert owner.agent_word(state, 1) == f"drain 0% up #yielded (game); {signals}\n".encode()


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_no_format, "Exec format error"),
        (_fails_with("interop-exec-format-bash.txt", 126), "Exec format error"),
        (_fails_with("interop-run-detectors.txt", 2), "run-detectors: no interpreter"),
        (_fails_with("interop-connect-failed-111.txt", 1), "interop socket: connect failed 111"),
        (_fails_with("interop-connect-failed-2-old-init.txt", 1), "interop socket: connect failed 2"),
        (_fails_with("interop-vsock-socket-failed-97.txt", 1), "vsock refused"),
        (_fails_with("interop-accept4-failed-110.txt", 1), "Windows never connected back"),
        (_fails_with(None, 1), "no answer (exit 1, nothing printed)"),
    ],
)
def test_the_reader_reports_each_failure_and_vram_still_yields(tmp_path, make, reason, capsys):
    watch = _watch(_system32(tmp_path, make))
    assert watch.signals() == ""  # not read yet: not known
    watch.read_once(1000.0)
    assert watch.broken == dict.fromkeys(owner.WINDOWS_SIGNALS, reason)
    line = f"VRAM only (interop: {reason})"
    assert watch.signals() == line
    state = AgentState(signals=line)
    assert f"owner signals: {line}" in owner.describe(state, None, 0)
    assert owner.agent_word(state, 0) == f"up #{line}\n".encode()
    _yields_on_vram(watch, line)
    # each program's failure is logged with its reason, once
    out = capsys.readouterr().out
    assert f"freetoken-agent: Windows: tasklist.exe: {reason}\n" in out
    assert f"freetoken-agent: Windows: reg.exe: {reason}\n" in out
    watch.read_once(2000.0)  # every program again, the reboot flags too: nothing new to say
    assert capsys.readouterr().out == ""


def test_a_program_that_never_exits_is_killed_with_its_group_at_the_deadline(tmp_path):
    pids = tmp_path / "pids"

    def hang(path: Path) -> None:
        # a child that sleeps too, holding stdout open: subprocess.run(timeout=) would wait on it
        _script(path, f"sleep 600 &\necho $! >> '{pids}'\nexec sleep 600\n")

    watch = _watch(_system32(tmp_path, hang), deadline_s=0.5)
    watch.read_once(1000.0)
    assert watch.broken == dict.fromkeys(owner.WINDOWS_SIGNALS, "timed out after 1 s")
    assert watch.signals() == "VRAM only (interop: timed out after 1 s)"
    children = [int(p) for p in pids.read_text().split()]
    assert len(children) == 4  # tasklist.exe, powershell.exe and reg.exe twice
    for pid in children:
        assert _gone(pid), pid
    _yields_on_vram(watch, "VRAM only (interop: timed out after 1 s)")


def test_a_program_that_prints_forever_is_cut_at_the_deadline(tmp_path):
    def chatter(path: Path) -> None:
        _script(path, "exec yes 'eldenring.exe'\n")

    ran = owner_agent.run_bounded([str(_system32(tmp_path, chatter) / "tasklist.exe")], 0.5, "/", cap=4096)
    assert ran.timed_out and ran.returncode is None and len(ran.stdout) == 4096
    watch = _watch(tmp_path / "c" / "Windows" / "System32", deadline_s=0.5)
    watch.read_once(1000.0)
    assert watch.signals() == "VRAM only (interop: timed out after 1 s)"


def test_one_signal_off_names_the_others_that_work(tmp_path):
    """tasklist.exe hangs, PowerShell and reg.exe answer: apps off, the others on."""

    def mixed(path: Path) -> None:
        if path.name == "tasklist.exe":
            _script(path, "exec sleep 600\n")
        elif path.name == "reg.exe":
            _script(path, f"echo '{MISSING_KEY}' >&2\nexit 1\n")
        else:
            _script(path, "printf '1\\r\\n'\n")

    watch = _watch(_system32(tmp_path, mixed), deadline_s=0.3)
    watch.read_once(1000.0)
    assert watch.signals() == "VRAM, full screen, reboot (interop: timed out after 1 s)"
    # the reboot flags are read once a minute: their last state is kept between reads
    watch.read_once(1001.0)
    assert watch.signals() == "VRAM, full screen, reboot (interop: timed out after 1 s)"


def test_signals_that_work_or_are_not_configured_are_not_reported_as_off(tmp_path):
    def working(path: Path) -> None:
        if path.name == "tasklist.exe":
            _script(path, f"cat '{REAL / 'tasklist-csv-nh.crlf'}'\n")
        elif path.name == "reg.exe":
            _script(path, f"echo '{MISSING_KEY}' >&2\nexit 1\n")
        else:
            _script(path, "printf '1\\r\\n'\n")

    watch = _watch(_system32(tmp_path, working))
    watch.read_once(1000.0)
    assert watch.signals() == ALL and watch.broken == {}
    assert watch.seen() == (("eldenring.exe",), False, False)
    assert owner.agent_word(AgentState(signals=watch.signals()), 0) == b"up\n"
    # nothing configured but the reboot flag, and System32 not there: only that one is off
    gone = owner_agent.WindowsWatch(str(tmp_path / "nowhere"), (), False, True, 5.0)
    assert not gone.wanted
    assert gone.signals() == "VRAM only (interop: no Windows drive)"
    nothing = owner_agent.WindowsWatch(str(tmp_path / "nowhere"), (), False, False, 5.0)
    assert not nothing.wanted and nothing.signals() == "VRAM"


def _gone(pid: int, wait_s: float = 30.0) -> bool:
    """The process has exited (gone, or a zombie waiting for its reaper)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return True
        if stat.rpartition(")")[2].split()[0] in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


# --------------------------------------------------------------------------- the agent as a process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
            data = b""
            while chunk := c.recv(200):
                data += chunk
            return data
    except OSError:
        return b""


# The owner tests' poll, with room for the agent's first look at Windows.
_wait = functools.partial(test_owner_windows._wait, timeout=20)


def test_the_agent_without_interop_keeps_deciding_on_vram_and_says_so_once(tmp_path):
    """The agent as a process with System32's programs unrunnable (binfmt's WSLInterop gone):
    it answers the gateway its signals, records them for status, logs them once, still yields
    to a game's VRAM; once interop works again it says so, once."""
    bin_dir, sim = tmp_path / "bin", tmp_path / "sim"
    bin_dir.mkdir()
    sim.mkdir()
    (sim / "used").write_text("853\n")
    (sim / "active").write_text("inactive")
    _script(bin_dir / "nvidia-smi", f"cat {sim}/used\n")
    _script(
        bin_dir / "systemctl",
        f'case "$1" in\n  is-active) test "$(cat {sim}/active)" = active ;;\n'
        f"  stop) echo inactive > {sim}/active ;;\n  start) echo active > {sim}/active ;;\nesac\n",
    )
    # System32 is a link, switched at once when interop works again: the agent never sees half
    # of its programs restored (a line of its own that the test would count).
    broken = _system32(tmp_path / "broken", _no_format)
    win = tmp_path / "System32"
    win.symlink_to(broken)
    port, state_file = _free_port(), tmp_path / "state.json"
    script = os.path.join(os.path.dirname(owner_agent.__file__), "owner_agent.py")
    argv = [sys.executable, script, "serve", "--unit", "freetoken.service", "--engine-url", "http://127.0.0.1:9"]
    argv += ["--key-file", str(tmp_path / "none"), "--bind", "127.0.0.1", "--port", str(port)]
    argv += ["--vram-threshold-gb", "4", "--quiet-s", "600", "--drain-timeout-s", "0", "--interval-s", "0.1"]
    argv += ["--state-file", str(state_file), "--override-file", str(tmp_path / "override.json")]
    argv += ["--system32", str(win), "--windows-interval-s", "0.2", "--app", "eldenring.exe", "--fullscreen"]
    argv += ["--reboot-drain", "--reboot-interval-s", "0.2"]
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait(lambda: _ask(port) == f"up #{BROKEN}\n".encode())
        assert _wait(lambda: state_file.exists() and owner.load_state(state_file.read_text()).signals == BROKEN)
        status = subprocess.run(
            [sys.executable, script, "owner", "--state-file", str(state_file), "--override-file", str(tmp_path / "o")]
            + ["status"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"owner signals: {BROKEN}" in status.stdout
        time.sleep(1)  # several polls: still one line
        (sim / "used").write_text(f"{853 + 20 * 1024}\n")  # a game takes the card
        assert _wait(lambda: _ask(port) == f"drain 0% up #yielded (game); {BROKEN}\n".encode())
        assert owner.load_state(state_file.read_text()).mode in (YIELDED, YIELDING)
        # interop works again (tasklist finds nothing of the list, no reboot, no full screen)
        fixed = tmp_path / "fixed" / "c" / "Windows" / "System32"
        _script(fixed / "tasklist.exe", f"cat '{REAL / 'tasklist-csv-nh-de.crlf'}'\n")
        _script(fixed / "reg.exe", "echo 'ERROR: no such key' >&2\nexit 1\n")
        _script(fixed / "WindowsPowerShell/v1.0/powershell.exe", "printf '1\\r\\n'\n")
        (tmp_path / "System32.new").symlink_to(fixed)
        os.replace(tmp_path / "System32.new", win)
        assert _wait(lambda: _ask(port) == b"drain 0% up #yielded (game)\n")
        assert _wait(lambda: owner.load_state(state_file.read_text()).signals == ALL)
    finally:
        proc.kill()
        out = proc.communicate()[0]
    lines = [line for line in out.splitlines() if "owner signals:" in line]
    assert lines == [f"freetoken-agent: owner signals: {BROKEN}", f"freetoken-agent: owner signals: {ALL}"], out
    assert owner.load_state(state_file.read_text()).mode != SERVING
