"""The owner's claims from Windows and the clock: an app of
``owner_apps`` running, a full-screen app, a pending Windows reboot, ``serve_hours``; the status
words the agent gives the gateway and ``fleet status`` reads back; the parsers of Windows'
answers against real outputs (tests/fixtures/real/README.md) and against text crafted to look
like something else; and the agent-check port under attack."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from freetoken_infra import fleet
from freetoken_infra.core import owner
from freetoken_infra.core.owner import HELD, SERVING, START, STOP, YIELDED, YIELDING, AgentState, Observation, Policy
from freetoken_infra.core.settings import SettingsError, build_settings
from operations.scripts import owner_agent

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
ENGINE_MIB = 6042
IDLE = 853 + ENGINE_MIB
MON, TUE, WED, FRI, SAT, SUN = 0, 1, 2, 4, 5, 6
POLICY = Policy(vram_threshold_mib=4096, quiet_s=30, apps=("eldenring.exe", "Among Us.exe"), fullscreen=True)


def seen(now: float, active: bool = True, **kw) -> Observation:
    base: dict = dict(gpu_used_mib=IDLE, engine_vram_mib=ENGINE_MIB if active else None, health_ok=active)
    base.update(kw)
    return Observation(now=now, engine_active=active, **base)


def hm(text: str) -> int:
    h, m = text.split(":")
    return int(h) * 60 + int(m)


# --------------------------------------------------------------------------- claims
def test_each_claim_has_its_status_word_and_reason():
    def words(obs: Observation, policy: Policy = POLICY) -> list[str]:
        return [c.word for c in owner.claims(obs, policy)]

    assert words(seen(0)) == []
    assert words(seen(0, apps_running=("ELDENRING.EXE",))) == ["yielded (app eldenring.exe)"]  # as set
    assert words(seen(0, apps_running=("notepad.exe",))) == []  # not on the list
    assert words(seen(0, fullscreen=True)) == ["yielded (full-screen)"]
    assert words(seen(0, fullscreen=True), Policy(4096, 30)) == []  # owner_fullscreen off
    assert words(seen(0, gpu_used_mib=IDLE + 12 * 1024)) == ["yielded (game)"]
    assert words(seen(0, reboot_pending=True)) == ["reboot pending"]
    assert words(seen(0, reboot_pending=True), Policy(4096, 30, reboot=False)) == []
    assert words(seen(0, snooze_until=100)) == ["snoozed"]
    hours = owner.parse_hours("18:00-08:00")
    assert words(seen(0, local=(MON, hm("12:00"))), Policy(4096, 30, hours=hours)) == ["off schedule"]
    assert words(seen(0, local=(MON, hm("19:00"))), Policy(4096, 30, hours=hours)) == []
    assert words(seen(0, local=None), Policy(4096, 30, hours=hours)) == []  # no clock: no claim
    # all at once: the owner's own use first, the reboot last
    everything = seen(0, snooze_until=100, apps_running=("eldenring.exe",), fullscreen=True, reboot_pending=True)
    assert words(everything)[0] == "snoozed" and words(everything)[-1] == "reboot pending"
    found = owner.claims(seen(0, apps_running=("Among Us.exe",)), POLICY)
    assert "Among Us.exe runs on Windows (owner_apps)" in found[0].reason
    assert owner.claim(seen(0, reboot_pending=True), POLICY) is not None


def test_an_app_from_the_list_yields_like_a_game_and_the_word_names_it():
    state, action = owner.step(AgentState(), seen(1, apps_running=("eldenring.exe",)), POLICY)
    assert (state.mode, action, state.word) == (YIELDING, None, "yielded (app eldenring.exe)")
    assert owner.agent_word(state, 1) == b"drain 0% up #yielded (app eldenring.exe)\n"
    state, action = owner.step(state, seen(2, apps_running=("eldenring.exe",), drain_answered=True), POLICY)
    assert (state.mode, action) == (YIELDED, STOP)
    # the game ends; its VRAM is gone with it: back after the quiet time
    state, _ = owner.step(state, seen(3, active=False, gpu_used_mib=853), POLICY)
    state, action = owner.step(state, seen(33, active=False, gpu_used_mib=853), POLICY)
    assert (state.mode, action, state.word) == ("starting", START, "")
    # the app starts again while the engine loads: stopped at once (it does not hang on VRAM)
    state, action = owner.step(
        state, seen(34, active=True, engine_vram_mib=None, apps_running=("eldenring.exe",)), POLICY
    )
    assert (state.mode, action, state.word) == (YIELDED, STOP, "yielded (app eldenring.exe)")


def test_a_pending_reboot_drains_without_stopping_the_engine_and_clears_with_ready():
    state, action = owner.step(AgentState(), seen(1, reboot_pending=True), POLICY)
    assert (state.mode, action) == (HELD, None)
    assert owner.agent_word(state, 1) == b"drain 0% up #reboot pending\n"
    state, action = owner.step(state, seen(60, reboot_pending=True, drain_answered=True), POLICY)
    assert (state.mode, action) == (HELD, None)  # never stopped for a reboot alone
    # the owner starts a game meanwhile: that one frees the card
    state, action = owner.step(state, seen(61, reboot_pending=True, apps_running=("eldenring.exe",)), POLICY)
    assert (state.mode, state.word) == (YIELDING, "yielded (app eldenring.exe)")
    state, action = owner.step(state, seen(62, reboot_pending=True, drain_answered=True), POLICY)
    assert (state.mode, action, state.word) == (HELD, None, "reboot pending")  # the game ended first
    # the flags go (the update was undone, or WSL came back after the reboot)
    state, action = owner.step(state, seen(70), POLICY)
    assert (state.mode, action) == (SERVING, None)
    assert owner.agent_word(state, 70) == b"ready 100%\n"  # undoes its own drain
    assert owner.agent_word(state, 70 + owner.REJOIN_READY_S) == b"up\n"  # then leaves an operator's alone


def test_a_yielded_host_with_only_a_reboot_pending_stays_yielded():
    state = AgentState(mode=YIELDED, stopped=True, word="yielded (game)", since=1)
    state, action = owner.step(state, seen(100, active=False, gpu_used_mib=853, reboot_pending=True), POLICY)
    assert (state.mode, action, state.word) == (YIELDED, None, "reboot pending")
    state, action = owner.step(state, seen(200, active=False, gpu_used_mib=853, reboot_pending=True), POLICY)
    assert action is None  # no start into a reboot


def test_serve_hours_drain_ahead_stop_the_engine_and_start_it_when_they_begin():
    policy = Policy(4096, quiet_s=30, hours=owner.parse_hours("Mon-Fri 18:00-08:00"))
    state, action = owner.step(AgentState(), seen(0, local=(FRI, hm("23:00"))), policy)
    assert (state.mode, action) == (SERVING, None)
    # Saturday 07:59: one minute before the hours end, the drain begins (streams end in hours)
    state, action = owner.step(state, seen(1, local=(SAT, hm("07:59"))), policy)
    assert (state.mode, state.word) == (YIELDING, "off schedule")
    assert "outside serve_hours (Mon,Tue,Wed,Thu,Fri 18:00-08:00)" in state.reason
    state, action = owner.step(state, seen(2, local=(SAT, hm("07:59")), drain_answered=True), policy)
    assert (state.mode, action) == (YIELDED, STOP)
    # Saturday evening and Monday early are outside too (Sunday is not listed)
    for local in ((SAT, hm("19:00")), (MON, hm("07:00")), (MON, hm("17:58"))):
        state, action = owner.step(state, seen(3, active=False, gpu_used_mib=853, local=local), policy)
        assert (state.mode, action) == (YIELDED, None), local
    # Monday 18:00, the hours begin; after the quiet time the engine starts
    state, action = owner.step(state, seen(40, active=False, gpu_used_mib=853, local=(MON, hm("18:00"))), policy)
    assert (state.mode, action) == (YIELDED, None)
    state, action = owner.step(state, seen(70, active=False, gpu_used_mib=853, local=(MON, hm("18:00"))), policy)
    assert (state.mode, action) == ("starting", START)


# --------------------------------------------------------------------------- serve_hours
@pytest.mark.parametrize(
    ("spec", "inside", "outside"),
    [
        (
            "22:00-07:00",
            [(MON, "22:00"), (TUE, "03:00"), (SUN, "06:59"), (MON, "00:00")],
            [(MON, "07:00"), (MON, "21:59")],
        ),
        (
            "Mon-Fri 18:00-08:00",
            [(FRI, "18:00"), (SAT, "07:59"), (TUE, "00:30")],
            [(MON, "07:59"), (SAT, "18:00"), (SUN, "12:00"), (FRI, "08:00")],
        ),
        ("Sat-Sun 00:00-24:00", [(SAT, "00:00"), (SUN, "23:59")], [(MON, "00:00"), (FRI, "23:59")]),
        ("Fri-Mon 09:00-17:00", [(FRI, "09:00"), (SUN, "12:00"), (MON, "16:59")], [(TUE, "12:00"), (MON, "17:00")]),
        ("mon,wed 08:00-09:00; sat 10:00-11:00", [(WED, "08:30"), (SAT, "10:59")], [(TUE, "08:30"), (SAT, "11:00")]),
        ("Sun 22:00-06:00", [(SUN, "23:00"), (MON, "05:59")], [(SAT, "23:00"), (SUN, "05:00"), (MON, "06:00")]),
        ("18:00-00:00", [(MON, "23:59")], [(TUE, "00:00"), (MON, "17:59")]),
    ],
)
def test_serve_hours(spec, inside, outside):
    hours = owner.parse_hours(spec)
    for day, at in inside:
        assert owner.in_hours(hours, day, hm(at)), (spec, day, at)
    for day, at in outside:
        assert not owner.in_hours(hours, day, hm(at)), (spec, day, at)
    assert owner.parse_hours(owner.format_hours(hours)) == hours  # what status prints reads back the same


@pytest.mark.parametrize(
    "spec",
    [
        "",
        " ",
        "Mon-Fri",
        "18:00",
        "8:00-9:00",
        "18:00-08:00 Mon-Fri",
        "Funday 10:00-11:00",
        "Mon-Fri 18:00-18:00",
        "24:00-08:00",
        "23:60-08:00",
        "25:00-01:00",
        "24:01-01:00",
        "Mon-Fri 18:00-08:00;",
        "Mon - Fri 18:00-08:00",
        "Mon-Fri 18:00-08:00\nSat 10:00-11:00",
        "Mon-Fri 18:00-08:00 # evenings",
        "mon,,wed 08:00-09:00",
        "; ".join(["10:00-11:00"] * 15),
        "10:00-11:00\x00",
    ],
)
def test_bad_serve_hours_are_refused_naming_the_part(spec):
    with pytest.raises(ValueError, match="serve_hours"):
        owner.parse_hours(spec)


def test_the_settings_validate_apps_and_hours():
    s = build_settings("ws1", {"owner_apps": ["eldenring.exe", "Among Us.exe"], "serve_hours": "22:00-07:00"})
    assert s.owner_apps == ["eldenring.exe", "Among Us.exe"] and s.owner_reboot_drain and not s.owner_fullscreen
    for bad in (
        r"C:\Games\eldenring.exe",
        "eldenring",
        "a.exe#up",
        "a.exe,b.exe",
        "../x.exe",
        "a\nb.exe",
        "x" * 70 + ".exe",
    ):
        with pytest.raises(SettingsError, match="owner_apps"):
            build_settings("ws1", {"owner_apps": [bad]})
    with pytest.raises(SettingsError, match="serve_hours"):
        build_settings("ws1", {"serve_hours": "always"})


# --------------------------------------------------------------------------- Windows' answers
def test_tasklist_real_outputs():
    names = owner.parse_tasklist((REAL / "tasklist-csv-nh.crlf").read_bytes())
    assert names is not None and {"system idle process", "eldenring.exe", "among us.exe"} <= names
    assert owner.running_apps(names, POLICY.apps) == ("eldenring.exe", "Among Us.exe")
    german = owner.parse_tasklist((REAL / "tasklist-csv-nh-de.crlf").read_bytes())
    assert german == {"system idle process", "system", "ultrakill.exe"}
    # a filter that matched nothing: tasklist's INFO line only: no process, not an error
    assert owner.parse_tasklist(b"INFO: No tasks are running which match the specified criteria.\r\n") is None
    assert owner.parse_tasklist(b"") is None


@pytest.mark.parametrize(
    "data",
    [
        # an extra field after the five: another name smuggled into a row
        b'"x.exe","1","Console","1","8 K","eldenring.exe"\r\n',
        b'"eldenring.exe","1","Console","1"\r\n',  # four fields
        b"eldenring.exe,1,Console,1,8 K\r\n",  # not quoted
        b'"eldenring.exe","one","Console","1","8 K"\r\n',  # the PID not a number
        b'"elden\x1bring.exe","1","Console","1","8 K"\r\n',  # a control character
        b"<html>eldenring.exe</html>\r\n",
    ],
)
def test_tasklist_text_that_is_not_tasklists_is_not_read(data):
    assert owner.parse_tasklist(b'"System","4","Services","0","144 K"\r\n' + data) is None


def test_a_process_named_to_look_like_a_listed_app_does_not_count():
    rows = [
        '"eldenring.exe.bak","1","Console","1","8 K"',
        '"eldenring.exe ","2","Console","1","8 K"',
        '"xeldenring.exe","3","Console","1","8 K"',
        '"C:\\Games\\eldenring.exe","4","Console","1","8 K"',
    ]
    names = owner.parse_tasklist(("\r\n".join(rows) + "\r\n").encode())
    assert names is not None and owner.running_apps(names, POLICY.apps) == ()
    # bytes of another code page (GBK) that are not UTF-8 stay U+FFFD: never an ASCII name
    gbk = '"游戏eldenring.exe","5","Console","1","8 K"\r\n'.encode("gbk")
    names = owner.parse_tasklist(gbk)
    assert names is not None and owner.running_apps(names, POLICY.apps) == ()


def test_the_notification_state():
    assert owner.parse_notification_state(b"3\r\n") == 3
    assert owner.notification_fullscreen(3) and owner.notification_fullscreen(2) and owner.notification_fullscreen(4)
    assert not owner.notification_fullscreen(1) and not owner.notification_fullscreen(5)
    assert not owner.notification_fullscreen(None)
    for bad in (b"", b"03", b"3 4", b"8", b"error\r\n", b"3; Start-Process x", b"\xff3", b"-3"):
        assert owner.parse_notification_state(bad) is None, bad


def test_reboot_flags_from_real_reg_outputs():
    required = owner.REBOOT_KEYS[0]
    assert owner.reboot_flag(required, 0, (REAL / "reg-query-rebootrequired.crlf").read_bytes()) is True
    assert owner.reboot_flag(required, 1, b"") is False  # the message is on stderr, and localised
    assert owner.reboot_flag(required, 1, (REAL / "reg-query-missing.crlf").read_bytes()) is False
    # exit 0 but another key named first (a crafted or confused answer): unknown, not pending
    other = b"\r\nHKEY_LOCAL_MACHINE\\SOFTWARE\\Microsoft\\Windows\\CurrentVersion\\WindowsUpdate\\Auto Update\\RebootRequiredX\r\n"
    assert owner.reboot_flag(required, 0, other) is None
    assert owner.reboot_flag(required, 0, b"") is None
    assert owner.reboot_flag(required, 2, b"") is None  # reg.exe's own error


# --------------------------------------------------------------------------- what fleet status reads
# `show stat` captured from HAProxy 2.6.12 (Debian 12's haproxy 2.6.12-1+deb12u3) while a stand-in
# agent answered each word (columns trimmed to those parse_stat reads): `drain 0% up #WORD` ->
# status `DRAIN (agent)`, `last_agt` `via agent : up (WORD)`; `drain 0% #WORD` without a state word
# leaves `last_agt` empty; once the engine stops the health checks make it `DOWN`.
SHOW_STAT = """# pxname,svname,qcur,qmax,scur,smax,status,check_status,check_code,check_duration,last_chk,last_agt
freetoken,ws1,0,0,1,4,DRAIN (agent),L7OK,200,1,,via agent : up (yielded (app eldenring.exe))
freetoken,ws2,0,0,0,1,DOWN,L4CON,,0,Connection refused,via agent : up (yielded (game))
freetoken,ws3,0,0,0,0,DRAIN (agent),L7OK,200,1,,via agent : up (reboot pending)
freetoken,ws4,0,0,0,0,DOWN,L4CON,,0,Connection refused,via agent : up (off schedule)
freetoken,ws5,0,0,0,0,DOWN,L4CON,,0,Connection refused,via agent : up (snoozed)
freetoken,ws6,0,0,2,2,UP,L7OK,200,1,,via agent : up
freetoken,ws7,0,0,0,0,DRAIN,L7OK,200,1,,
freetoken,ws8,0,0,0,0,MAINT,L4TOUT,,2001,,via agent : up (yielded (game))
freetoken,ws9,0,0,0,0,DRAIN (agent),L7OK,200,1,,via agent : up (yielded (app x.exe) rm -rf)
freetoken,wsa,0,0,0,0,DOWN,L4CON,,0,Connection refused,via agent : up (yielded (app evil\x1b[2J.exe))
freetoken,wsb,0,0,0,0,DOWN,L4CON,,0,Connection refused,Connection refused
freetoken,BACKEND,0,0,3,9,UP,,,,,
"""


def test_fleet_status_says_why_a_host_is_its_owners():
    got = {s.host: s.state for s in fleet.parse_stat(SHOW_STAT)}
    assert got == {
        "ws1": "yielded (app eldenring.exe)",
        "ws2": "yielded (game)",
        "ws3": "reboot pending",
        "ws4": "off schedule",
        "ws5": "snoozed",
        "ws6": "in service",
        "ws7": "draining",  # an operator's drain: the agent says nothing after `#`
        "ws8": "maintenance",  # the operator's maintenance comes first
        "ws9": "draining",  # not one of the words: shown as HAProxy's state
        "wsa": "parked",  # a control sequence in a host's answer is never shown
        "wsb": "parked",
    }
    table = fleet.format_status(fleet.parse_stat(SHOW_STAT), {})
    assert "5 with their owner" in table and "\x1b" not in table


def test_the_words_read_back_are_only_ours():
    for word in ("yielded (game)", "yielded (full-screen)", "snoozed", "reboot pending", "off schedule"):
        assert owner.word_from_last_agt(f"via agent : up ({word})") == word
    assert owner.word_from_last_agt("via agent : up (yielded (app Among Us.exe))") == "yielded (app Among Us.exe)"
    for text in (
        "via agent : up",
        "via agent : up (serving)",
        "via agent : down (snoozed)",
        "up (snoozed)",
        "via agent : up (yielded (app ../x.exe))",
        "via agent : up (yielded (app " + "a" * 70 + ".exe))",
        "via agent : up (snoozed)\nvia agent : up (snoozed)",
    ):
        assert owner.word_from_last_agt(text) is None, text
    # the state file's word is checked the same way
    doc = json.loads(owner.dump_state(AgentState(mode=HELD, word="reboot pending"), 0))
    assert owner.load_state(json.dumps(doc)).word == "reboot pending"
    doc["word"] = "drain 0%\nready 100%"
    assert owner.load_state(json.dumps(doc)).word == ""
    assert owner.agent_word(owner.load_state(json.dumps(doc)), 0) == owner.WORD_DRAIN


def test_status_names_the_claim():
    state = AgentState(
        mode=YIELDED,
        reason="the owner's app eldenring.exe runs on Windows (owner_apps)",
        word="yielded (app eldenring.exe)",
        since=1,
    )
    text = owner.describe(state, None, 2)
    assert "state:   yielded\n" in text and "eldenring.exe runs on Windows" in text
    assert "fleet status shows: yielded (app eldenring.exe)" in text
    held = owner.describe(AgentState(mode=HELD, word="reboot pending"), None, 2)
    assert "state:   held\n" in held and "fleet status shows: reboot pending" in held
    assert "fleet status shows" not in owner.describe(AgentState(), None, 2)


# --------------------------------------------------------------------------- the agent as a process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(port: int, send: bytes = b"", timeout: float = 2) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
            if send:
                try:
                    c.sendall(send)
                except OSError:
                    pass
            data = b""
            while chunk := c.recv(100):
                data += chunk
            return data
    except OSError:
        return b""


def _mode_word(state_file: Path) -> tuple[str, str] | None:
    """The agent's recorded mode and status word, None before it wrote its first state."""
    try:
        state = owner.load_state(state_file.read_text())
    except FileNotFoundError:
        return None
    return state.mode, state.word


def _wait(check, timeout: float = 15) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def agent_host(tmp_path):
    """The agent as a process on a host of stand-ins (``agent_on_standins``)."""
    with agent_on_standins(tmp_path) as running:
        yield running


@contextlib.contextmanager
def agent_on_standins(tmp_path: Path):
    """The agent as a process on a host of stand-ins: nvidia-smi and systemctl on PATH (as in
    test_owner.py), no engine (its /health unanswered), and a Windows System32 under a fake C:
    drive: tasklist.exe (the processes in a file), reg.exe (one file per pending key) and
    powershell.exe (the notification state in a file), each call logged with its arguments and
    folder. Yields (process, agent-check port, state folder, state file, System32); also
    bench/agent_check.py's."""
    bin_dir, win = tmp_path / "bin", tmp_path / "c" / "Windows" / "System32"
    (win / "WindowsPowerShell" / "v1.0").mkdir(parents=True)
    bin_dir.mkdir()
    sim = tmp_path / "sim"
    sim.mkdir()
    (sim / "used").write_text("853\n")
    (sim / "active").write_text("inactive")
    (sim / "processes").write_text('"System Idle Process","0","Services","0","8 K"\r\n')
    (sim / "quns").write_text("1\r\n")
    log = sim / "calls"
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\ncat {sim}/used\n")
    (bin_dir / "systemctl").write_text(
        f'#!/bin/sh\necho "systemctl $*" >> {log}\ncase "$1" in\n'
        f'  is-active) test "$(cat {sim}/active)" = active ;;\n'
        f"  stop) echo inactive > {sim}/active ;;\n  start) echo active > {sim}/active ;;\nesac\n"
    )
    (win / "tasklist.exe").write_text(f'#!/bin/sh\necho "tasklist.exe $* @$PWD" >> {log}\ncat {sim}/processes\n')
    (win / "reg.exe").write_text(
        f'#!/bin/sh\necho "reg.exe $1 @$PWD" >> {log}\nname="${{2##*\\\\}}"\n'
        f'if [ -e "{sim}/$name" ]; then printf "\\r\\nHKEY_LOCAL_MACHINE%s\\r\\n\\r\\n" "${{2#HKLM}}"; exit 0; fi\n'
        'echo "ERROR: The system was unable to find the specified registry key or value." >&2; exit 1\n'
    )
    (win / "WindowsPowerShell" / "v1.0" / "powershell.exe").write_text(
        f'#!/bin/sh\necho "powershell.exe $1 $2 $3 @$PWD" >> {log}\ncat {sim}/quns\n'
    )
    for f in [*bin_dir.iterdir(), win / "tasklist.exe", win / "reg.exe", win / "WindowsPowerShell/v1.0/powershell.exe"]:
        f.chmod(0o755)
    port = _free_port()
    state_file = tmp_path / "state.json"
    script = os.path.join(os.path.dirname(owner_agent.__file__), "owner_agent.py")
    argv = [sys.executable, script, "serve", "--unit", "freetoken.service", "--engine-url", "http://127.0.0.1:9"]
    argv += ["--key-file", str(tmp_path / "none"), "--bind", "127.0.0.1", "--port", str(port)]
    argv += ["--vram-threshold-gb", "4", "--quiet-s", "1", "--drain-timeout-s", "0", "--interval-s", "0.1"]
    argv += ["--state-file", str(state_file), "--override-file", str(tmp_path / "override.json")]
    argv += ["--system32", str(win), "--windows-interval-s", "0.2", "--app", "eldenring.exe", "--fullscreen"]
    argv += ["--reboot-drain", "--reboot-interval-s", "0.2"]
    (sim / "active").write_text("active")
    proc = subprocess.Popen(
        argv,
        env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc, port, sim, state_file, win
    finally:
        proc.kill()
        out = proc.communicate()[0]
        print(out)


def test_the_agent_yields_to_a_listed_app_and_full_screen_on_windows(agent_host):
    proc, port, sim, state_file, win = agent_host
    # the engine stand-in: /health unanswered, so the agent waits in `up`
    assert _wait(lambda: _ask(port) == b"up\n")
    (sim / "processes").write_text(
        '"System Idle Process","0","Services","0","8 K"\r\n"eldenring.exe","10344","Console","1","1,204,316 K"\r\n'
    )
    assert _wait(lambda: _ask(port) == b"drain 0% up #yielded (app eldenring.exe)\n")
    assert _wait(lambda: "systemctl stop freetoken.service" in (sim / "calls").read_text())
    # The stop is called before the state that records it is written.
    assert _wait(lambda: _mode_word(state_file) == (YIELDED, "yielded (app eldenring.exe)"))
    # the app ends, a full-screen app is up: still the owner's, now for full screen
    (sim / "processes").write_text('"System Idle Process","0","Services","0","8 K"\r\n')
    (sim / "quns").write_text("3\r\n")
    assert _wait(lambda: _ask(port) == b"drain 0% up #yielded (full-screen)\n")
    (sim / "quns").write_text("1\r\n")
    assert _wait(lambda: "systemctl start freetoken.service" in (sim / "calls").read_text())
    calls = (sim / "calls").read_text()
    # fixed programs, fixed arguments, run from the C: drive
    drive = str(win.parent.parent)
    assert f"tasklist.exe /fo csv /nh @{drive}" in calls
    assert f"powershell.exe -NoProfile -NonInteractive -Command @{drive}" in calls
    assert f"reg.exe query @{drive}" in calls


def test_the_agent_drains_for_a_pending_reboot_and_keeps_the_engine(agent_host):
    proc, port, sim, state_file, win = agent_host
    assert _wait(lambda: _ask(port) == b"up\n")
    (sim / "RebootPending").write_text("")  # Component Based Servicing's flag
    assert _wait(lambda: _ask(port) == b"drain 0% up #reboot pending\n")
    # The word is answered as soon as it is decided; the state file follows it.
    assert _wait(
        lambda: (lambda s: (s.mode, s.word))(owner.load_state(state_file.read_text())) == (HELD, "reboot pending")
    )
    time.sleep(1)
    assert "systemctl stop" not in (sim / "calls").read_text()  # no new work, the engine left alone
    (sim / "RebootPending").unlink()
    assert _wait(lambda: _ask(port) == b"ready 100%\n")


def test_windows_text_shaped_as_an_answer_changes_nothing(agent_host):
    """A process name or a PowerShell answer written to look like an agent word or a command:
    the agent stays `up` and runs nothing but its fixed programs."""
    proc, port, sim, state_file, win = agent_host
    assert _wait(lambda: _ask(port) == b"up\n")
    (sim / "processes").write_text(
        '"drain 0%\r\n","1","Console","1","8 K"\r\n"eldenring.exe; systemctl stop freetoken","2","Console","1","8 K"\r\n'
    )
    (sim / "quns").write_text("3\r\nsystemctl stop freetoken.service\r\n")
    time.sleep(1.5)
    assert _ask(port) == b"up\n"
    calls = (sim / "calls").read_text()
    assert "systemctl stop" not in calls
    assert {line.split()[0] for line in calls.splitlines()} <= {
        "systemctl",
        "tasklist.exe",
        "powershell.exe",
        "reg.exe",
    }
    assert proc.poll() is None


def test_the_agent_check_port_under_attack_keeps_its_state_and_answers_only_its_words(agent_host):
    """Junk, a long line without an end, a flood of connections and half-open ones: every answer
    is one of the fixed words, the state is untouched, the agent stays up and still answers."""
    proc, port, sim, state_file, win = agent_host
    assert _wait(lambda: _ask(port) == b"up\n")
    assert _wait(lambda: _mode_word(state_file) is not None)  # its first state written
    before = owner.load_state(state_file.read_text())
    answers = set()
    answers.add(_ask(port, b"drain 0%\nmaint\nset weight 0%\n"))
    answers.add(_ask(port, b"\x00\xff" * 4096))
    answers.add(_ask(port, b"A" * (1 << 20)))  # a megabyte, no newline
    # half-open: connect and never read or close, many at once
    idle = [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(64)]
    results: list[bytes] = []

    def flood() -> None:
        for _ in range(25):
            results.append(_ask(port, b"ready 100%\n"))

    threads = [threading.Thread(target=flood) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in idle:
        c.close()
    answers.update(results)
    answers.discard(b"")  # a connection refused while the backlog was full
    assert answers == {b"up\n"}, answers
    assert sum(1 for r in results if r == b"up\n") >= 150
    # still answering once the flood is over (the long timeout bounds a hang only)
    assert _ask(port, timeout=60) == b"up\n"
    after = owner.load_state(state_file.read_text())
    assert (after.mode, after.word, after.reason) == (before.mode, before.word, before.reason)
    assert proc.poll() is None


# --------------------------------------------------------------------------- the fleet's stand-ins
STANDINS = Path(__file__).resolve().parents[1] / "fleet" / "standins" / "bin"


def test_the_windows_stand_ins_answer_in_the_real_formats(tmp_path):
    """tasklist.exe, reg.exe and powershell.exe stand-ins (tests/fleet/standins/bin) read by the
    agent's own parsers: a game started, a full-screen state and a pending reboot set through
    the simulated C: drive's state files."""
    env = {**os.environ, "FREETOKEN_SIM_DRIVE_C": str(tmp_path)}
    state = tmp_path / ".sim"
    state.mkdir()

    def run(tool: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(STANDINS / tool), *args], capture_output=True, env=env, timeout=30, check=False)

    listed = run("tasklist.exe", *owner.TASKLIST_ARGS)
    names = owner.parse_tasklist(listed.stdout)
    assert listed.returncode == 0 and names is not None and "system idle process" in names
    assert owner.running_apps(names, POLICY.apps) == ()
    (state / "windows-processes").write_text("eldenring.exe\n")
    names = owner.parse_tasklist(run("tasklist.exe", *owner.TASKLIST_ARGS).stdout)
    assert names is not None and owner.running_apps(names, POLICY.apps) == ("eldenring.exe",)
    assert run("tasklist.exe", "/v").returncode == 1

    for key in owner.REBOOT_KEYS:
        done = run("reg.exe", "query", key)
        assert owner.reboot_flag(key, done.returncode, done.stdout) is False
    (state / "reboot-pending").write_text("RebootRequired\n")
    done = run("reg.exe", "query", owner.REBOOT_KEYS[0])
    assert owner.reboot_flag(owner.REBOOT_KEYS[0], done.returncode, done.stdout) is True
    assert done.stdout == (REAL / "reg-query-rebootrequired.crlf").read_bytes()
    done = run("reg.exe", "query", owner.REBOOT_KEYS[1])
    assert owner.reboot_flag(owner.REBOOT_KEYS[1], done.returncode, done.stdout) is False

    argv = ["-NoProfile", "-NonInteractive", "-Command", owner.NOTIFICATION_SCRIPT]
    assert owner.parse_notification_state(run("powershell.exe", *argv).stdout) == 1
    (state / "notification-state").write_text("3\n")
    assert owner.parse_notification_state(run("powershell.exe", *argv).stdout) == 3
    assert not (state / "calls.jsonl").exists()  # reads, not recorded: a no-op deploy calls no Windows tool


def _powershell_standin():
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("powershell_standin", str(STANDINS / "powershell.exe"))
    spec = importlib.util.spec_from_loader("powershell_standin", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_powershell_stand_in_imitates_the_products_whole_commands_and_nothing_more(tmp_path):
    """The stand-in's command texts are the product's own (a command changed in the product and
    not in the stand-in would otherwise pass the fleet tests unseen); a command with anything
    added, cut or set before it fails as "not imitated", as does any other argument list."""
    from facts.wake_on_lan import ADAPTERS_COMMAND

    standin = _powershell_standin()
    assert standin.NOTIFICATION_SCRIPT == owner.NOTIFICATION_SCRIPT
    assert standin.ADAPTERS_COMMAND == ADAPTERS_COMMAND
    enrol_source = (Path(__file__).resolve().parents[2] / "operations" / "scripts" / "enrol.py").read_text()
    assert f'_powershell("{standin.POWER_MANAGEMENT_COMMAND}")' in enrol_source

    env = {**os.environ, "FREETOKEN_SIM_DRIVE_C": str(tmp_path), "FREETOKEN_SIM_DIR": str(tmp_path)}
    (tmp_path / "profile.json").write_text("{}")

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(STANDINS / "powershell.exe"), *argv], capture_output=True, env=env, timeout=30)

    args = ["-NoProfile", "-NonInteractive", "-Command"]
    assert run(*args, owner.NOTIFICATION_SCRIPT).stdout == b"1\r\n"
    assert run(*args, standin.POWER_MANAGEMENT_COMMAND).stdout == b"Ethernet|Disabled\r\n"
    adapters = run(*args, ADAPTERS_COMMAND)
    assert adapters.returncode == 0 and adapters.stdout.endswith(b"|Intel(R) Ethernet Controller I225-V|Disabled\r\n")
    for command in (owner.NOTIFICATION_SCRIPT, standin.POWER_MANAGEMENT_COMMAND, ADAPTERS_COMMAND):
        for other in (command + "; Stop-Computer", command[:-1], "Stop-Computer; " + command):
            done = run(*args, other)
            assert done.returncode == 1 and b"not imitated" in done.stderr and not done.stdout, other
        for argv in ([*args, command, "-Extra"], ["-Command", command], [*args[:2], "-EncodedCommand", command]):
            done = run(*argv)
            assert done.returncode == 1 and b"not imitated" in done.stderr and not done.stdout, argv


def test_the_powercfg_stand_in_lists_the_armed_devices_or_none(tmp_path):
    """One device a line, CRLF; NONE when nothing is armed, which the fact reads as no device."""
    from facts.wake_on_lan import parse_wake_armed

    env = {**os.environ, "FREETOKEN_SIM_DRIVE_C": str(tmp_path), "FREETOKEN_SIM_DIR": str(tmp_path)}
    (tmp_path / "profile.json").write_text("{}")
    state = tmp_path / ".sim"
    state.mkdir()

    def armed() -> bytes:
        done = subprocess.run(
            [str(STANDINS / "powercfg.exe"), "/devicequery", "wake_armed"], capture_output=True, env=env, timeout=30
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert armed() == b"HID Keyboard Device\r\n"
    (state / "wol-armed").touch()
    assert armed() == b"HID Keyboard Device\r\nIntel(R) Ethernet Controller I225-V\r\n"
    (state / "keyboard-wake-disabled").touch()
    (state / "wol-armed").unlink()
    assert armed() == b"NONE\r\n"
    assert parse_wake_armed(armed().decode("cp437").replace("\r", "")) == ()
    done = subprocess.run([str(STANDINS / "powercfg.exe"), "/requests"], capture_output=True, env=env, timeout=30)
    assert done.returncode == 1 and b"not imitated" in done.stderr


# --------------------------------------------------------------------------- the owner's shortcuts
def test_the_desktop_shortcuts_call_wsl_by_its_full_path_for_a_checked_distro():
    from operations import owner as owner_op

    texts = owner_op.shortcut_texts("Ubuntu-24.04")
    snooze, resume = texts[owner_op.SNOOZE_SHORTCUT], texts[owner_op.RESUME_SHORTCUT]
    assert snooze.endswith(
        b'"%SystemRoot%\\System32\\wsl.exe" -d Ubuntu-24.04 -u root freetoken-owner snooze 2h\r\npause\r\n'
    )
    assert b'wsl.exe" -d Ubuntu-24.04 -u root freetoken-owner resume\r\n' in resume
    assert snooze.startswith(b"@echo off\r\n") and b"\n" not in snooze.replace(b"\r\n", b"")  # CRLF only
    # the distro's name is read from the host: a batch metacharacter never reaches the file
    for bad in ("Ubuntu & calc.exe", "Ubuntu\r\ncalc", "x|y", "%PATH%", "", "a" * 65):
        with pytest.raises(ValueError):
            owner_op.shortcut_texts(bad)


def test_the_shortcuts_fact_reads_the_desktop_the_distro_and_the_files(tmp_path):
    from facts.batch import allowed
    from facts.windows import RESUME_SHORTCUT, OwnerShortcuts

    desktop = tmp_path / "dev user" / "Desktop"
    desktop.mkdir(parents=True)
    (desktop / RESUME_SHORTCUT).write_bytes(b"@\r\n")
    fact = OwnerShortcuts()
    command = fact.command(str(desktop))
    assert f"'{desktop}'" in command and "'FreeToken - serve again.cmd'" in command  # quoted for sh
    # its one argument has a shape the no-op run's batch may replay
    assert allowed("facts.windows:OwnerShortcuts", {"path": "/mnt/c/Users/dev/Desktop"}) is None
    env = {**os.environ, "WSL_DISTRO_NAME": "Ubuntu-24.04"}
    run = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60, env=env)
    seen = fact.process(run.stdout.splitlines())
    assert (seen.desktop_exists, seen.distro, seen.files) == (True, "Ubuntu-24.04", {RESUME_SHORTCUT: b"@\r\n"})
    run = subprocess.run(["sh", "-c", fact.command(str(tmp_path / "none"))], capture_output=True, text=True, env=env)
    assert fact.process(run.stdout.splitlines()).desktop_exists is False
