"""The host agent: its decisions as pure functions of what it observes
(freetoken_infra/core/owner.py), its unit and command, and its agent-check port, which answers a
fixed word and reads nothing."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from freetoken_infra.core import owner
from freetoken_infra.core.layout import AGENT_SCRIPT, AGENT_STATE_FILE, OWNER_OVERRIDE_FILE
from freetoken_infra.core.owner import (
    START,
    STOP,
    AgentState,
    Observation,
    Policy,
    agent_word,
    claim,
    others_mib,
    step,
)
from freetoken_infra.core.settings import Settings, SettingsError, build_settings
from operations import owner as owner_op
from operations.scripts import owner_agent

POLICY = Policy(vram_threshold_mib=4 * 1024, quiet_s=30)
ENGINE_MIB = 6042
CARD_IDLE_MIB = 853 + ENGINE_MIB  # the desktop and the engine
GAME_MIB = 12 * 1024


def seen(now: float, used: int | None = CARD_IDLE_MIB, active: bool = True, **kw) -> Observation:
    defaults: dict = dict(engine_vram_mib=ENGINE_MIB if active else None, health_ok=active)
    defaults.update(kw)
    return Observation(now=now, gpu_used_mib=used, engine_active=active, **defaults)


def test_others_vram_is_the_cards_used_memory_less_the_engines_own():
    assert others_mib(seen(0)) == 853
    assert others_mib(seen(0, used=CARD_IDLE_MIB + GAME_MIB)) == 853 + GAME_MIB
    assert others_mib(seen(0, used=1000, active=False)) == 1000  # no engine: all of it is others'
    assert others_mib(seen(0, used=None)) is None  # nvidia-smi unread
    # the engine runs but has not said what it holds (loading): unknown, never a claim
    assert others_mib(seen(0, engine_vram_mib=None)) is None
    assert claim(seen(0, used=30000, engine_vram_mib=None), POLICY) is None
    # the engine's figure above the card's (a different accounting): nobody else holds anything
    assert others_mib(seen(0, used=100)) == 0


def test_a_game_drains_first_then_stops_the_engine_once_the_gateway_read_it():
    state = AgentState(since=0.0)
    state, action = step(state, seen(10), POLICY)
    assert (state.mode, action) == ("serving", None)
    assert agent_word(state, 10) == b"up\n"
    state, action = step(state, seen(11, used=CARD_IDLE_MIB + GAME_MIB), POLICY)
    assert (state.mode, action) == ("yielding", None)
    assert "12.8 GiB held by other processes" in state.reason and "owner_vram_threshold_gb" in state.reason
    assert agent_word(state, 11) == b"drain 0% up #yielded (game)\n"
    # not stopped before the gateway read `drain`
    state, action = step(state, seen(12, used=CARD_IDLE_MIB + GAME_MIB), POLICY)
    assert (state.mode, action) == ("yielding", None)
    state, action = step(state, seen(13, used=CARD_IDLE_MIB + GAME_MIB, drain_answered=True), POLICY)
    assert (state.mode, action) == ("yielded", STOP)
    assert agent_word(state, 13) == b"drain 0% up #yielded (game)\n"


def test_without_a_gateway_reading_it_the_engine_stops_after_the_notice_time():
    state, _ = step(AgentState(), seen(0, used=CARD_IDLE_MIB + GAME_MIB), POLICY)
    state, action = step(state, seen(owner.GATEWAY_NOTICE_S - 0.1, used=CARD_IDLE_MIB + GAME_MIB), POLICY)
    assert action is None
    state, action = step(state, seen(owner.GATEWAY_NOTICE_S, used=CARD_IDLE_MIB + GAME_MIB), POLICY)
    assert (state.mode, action) == ("yielded", STOP)


def test_a_claim_gone_before_the_stop_undoes_the_drain():
    state, _ = step(AgentState(), seen(0, used=CARD_IDLE_MIB + GAME_MIB), POLICY)
    state, action = step(state, seen(1), POLICY)
    assert (state.mode, action) == ("serving", None)
    assert agent_word(state, 1) == b"ready 100%\n"
    assert agent_word(state, 1 + owner.REJOIN_READY_S) == b"up\n"  # then an operator's drain stays


def test_the_engine_starts_after_the_quiet_time_and_rejoins_when_healthy():
    state = AgentState(mode="yielded", reason="game", since=0.0, stopped=True)
    game_on = seen(1, used=853 + GAME_MIB, active=False)
    state, action = step(state, game_on, POLICY)
    assert (state.mode, action, state.clear_since) == ("yielded", None, None)
    state, action = step(state, seen(2, used=853, active=False), POLICY)
    assert (state.mode, action, state.clear_since) == ("yielded", None, 2)
    # the game comes back for a moment: the quiet time starts again
    state, _ = step(state, seen(20, used=853 + GAME_MIB, active=False), POLICY)
    state, _ = step(state, seen(21, used=853, active=False), POLICY)
    state, action = step(state, seen(50, used=853, active=False), POLICY)
    assert (state.mode, action) == ("yielded", None)
    state, action = step(state, seen(51, used=853, active=False), POLICY)
    assert (state.mode, action) == ("starting", START)
    assert agent_word(state, 51) == b"drain 0%\n"  # not before /health is ok
    state, action = step(state, seen(52, engine_vram_mib=None, health_ok=False), POLICY)
    assert (state.mode, action) == ("starting", None)
    state, action = step(state, seen(55), POLICY)
    assert (state.mode, action) == ("serving", None)
    assert agent_word(state, 55) == b"ready 100%\n"


def test_an_unreadable_gpu_while_yielded_waits_and_never_starts():
    state = AgentState(mode="yielded", reason="game", since=0.0)
    for t in range(1, 100):
        state, action = step(state, seen(t, used=None, active=False), POLICY)
        assert (state.mode, action) == ("yielded", None)


def test_an_engine_that_never_gets_healthy_is_left_to_the_gateways_checks():
    state = AgentState(mode="starting", since=0.0)
    state, action = step(state, seen(owner.START_TIMEOUT_S, health_ok=False, engine_vram_mib=None), POLICY)
    assert state.mode == "serving" and action is None and "not healthy" in state.reason


def test_an_engine_someone_else_stopped_is_never_started_by_the_agent():
    """The guard stopped it (swap, OOM) or the operator did: serving with no claim does nothing;
    a claim while it is down records the yield without a stop."""
    state, action = step(AgentState(), seen(0, used=853, active=False), POLICY)
    assert (state.mode, action) == ("serving", None)
    state, action = step(state, seen(1, used=853 + GAME_MIB, active=False), POLICY)
    assert (state.mode, action, state.stopped) == ("yielded", None, False)
    state, _ = step(state, seen(2, used=853, active=False), POLICY)
    state, action = step(state, seen(40, used=853, active=False), POLICY)
    assert (state.mode, action) == ("serving", None)  # the claim is gone; the engine stays as it was


def test_a_threshold_of_zero_never_yields_for_vram_and_the_snooze_always_does():
    off = Policy(vram_threshold_mib=0, quiet_s=30)
    assert claim(seen(0, used=30000), off) is None
    snoozed = seen(0, snooze_until=3600)
    assert claim(snoozed, off) is not None and claim(snoozed, off).startswith("snoozed by the owner until")
    assert claim(seen(3600, snooze_until=3600), off) is None  # over
    # a snooze while the engine starts stops it again
    state, action = step(AgentState(mode="starting", since=0), seen(1, snooze_until=100), POLICY)
    assert (state.mode, action) == ("yielded", STOP)


def test_the_state_file_is_checked_field_by_field():
    state = AgentState(mode="yielded", reason="game", since=5.0, clear_since=7.0, others_mib=100, stopped=True)
    assert owner.load_state(owner.dump_state(state, 9.0).decode()) == state
    for forged in (
        "",
        "not json",
        "[]",
        json.dumps({"mode": "rm -rf /"}),
        json.dumps({"mode": "yielded", "since": "NaN", "reason": 5, "others_mib": True, "clear_since": 1e999}),
    ):
        got = owner.load_state(forged)
        assert got.mode in owner.MODES and isinstance(got.reason, str)
        assert isinstance(got.since, float) and got.others_mib is None
    assert owner.load_snooze(json.dumps({"snooze_until": 12.5})) == 12.5
    assert owner.load_snooze(json.dumps({"snooze_until": "soon"})) is None
    assert owner.load_snooze("{") is None


@pytest.mark.parametrize(
    ("text", "seconds"), [("2h", 7200), ("90m", 5400), ("1h30m", 5400), ("45s", 45), ("1d", 86400), (" 2H ", 7200)]
)
def test_snooze_durations(text, seconds):
    assert owner.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "2", "h", "1x", "-2h", "8d", "0s", "2h;reboot", "1h 30m"])
def test_bad_snooze_durations_are_refused(text):
    with pytest.raises(ValueError):
        owner.parse_duration(text)


def test_status_says_state_reason_and_the_snooze():
    state = AgentState(mode="yielded", reason="the owner's GPU use: 12.8 GiB", since=100.0, others_mib=13000)
    text = owner.describe(state, snooze_until=100 + 7200, now=100)
    assert "state:   yielded" in text and "reason:  the owner's GPU use: 12.8 GiB" in text
    assert "others' GPU memory: 12.7 GiB" in text and "snoozed: 2 h 0 min left" in text


def test_the_agent_port_must_not_collide_with_the_engines_or_node_exporters():
    for port, taken in ((8000, "listen_port"), (8001, "gloo"), (9100, "node_exporter_port")):
        with pytest.raises(SettingsError, match=f"'agent_port' = {port} is invalid: {port} is taken by .*{taken}"):
            build_settings("ws1", {"agent_port": port})
    assert build_settings("ws1", {"agent_port": 8001, "agent_enabled": False}).agent_port == 8001


def test_the_agent_unit_runs_the_uploaded_script_as_root_confined():
    text = owner_op.agent_unit(Settings(listen_host="0.0.0.0", agent_port=8020, owner_quiet_s=5))
    assert (
        f"ExecStart=/usr/bin/python3 {AGENT_SCRIPT} serve --unit freetoken.service --engine-url "
        "http://127.0.0.1:8000 --key-file /etc/freetoken/api-key.env --bind 0.0.0.0 --port 8020 "
        "--vram-threshold-gb 4 --quiet-s 5 --drain-timeout-s 10 "
        f"--state-file {AGENT_STATE_FILE} --override-file {OWNER_OVERRIDE_FILE} "
        "--system32 /mnt/c/Windows/System32 --windows-interval-s 5 --reboot-interval-s 60 --reboot-drain "
        "--textfile /var/lib/freetoken-deploy/metrics/freetoken_agent.prom\n"
    ) in text
    # its samples beside the guard's, in node_exporter's textfile folder: its one other writable one
    assert "ReadWritePaths=-/var/lib/freetoken-deploy/metrics\n" in text
    assert text.count("ReadWritePaths") == 1
    # The owner's apps, full screen and hours, each one argument (systemd's quoting), moved drives.
    text = owner_op.agent_unit(
        Settings(
            owner_apps=["eldenring.exe", "Among Us.exe"],
            owner_fullscreen=True,
            owner_reboot_drain=False,
            serve_hours="Mon-Fri 18:00-08:00",
        ),
        "/c/Windows/System32",
    )
    assert (
        '--system32 /c/Windows/System32 --windows-interval-s 5 --reboot-interval-s 60 --app eldenring.exe --app "Among Us.exe" '
        '--fullscreen --serve-hours "Mon-Fri 18:00-08:00" --textfile '
    ) in text
    for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "RuntimeDirectory=freetoken-agent"):
        assert line + "\n" in text
    # without node_exporter it writes its runtime folder only; with the deploy's firewall it
    # reports whether the table is live as its unit recorded it
    text = owner_op.agent_unit(Settings(node_exporter_enabled=False), firewall=True)
    assert "ReadWritePaths" not in text and "--textfile" not in text
    assert "--reboot-drain --firewall-record /run/freetoken-firewall.loaded\n" in text
    assert "User=" not in text  # root: it stops and starts the engine and reads its key
    assert "Environment" not in text and "FREETOKEN_API_KEY" not in text  # the key's file, never the key
    assert owner_op.engine_url(Settings(listen_host="::")) == "http://[::1]:8000"
    assert owner_op.engine_url(Settings(listen_host="192.0.2.7", listen_port=8100)) == "http://192.0.2.7:8100"
    command = owner_op.owner_command()
    assert command.startswith("#!/bin/sh\n") and command.endswith('"$@"\n')
    assert f"exec /usr/bin/python3 {AGENT_SCRIPT} owner --state-file {AGENT_STATE_FILE}" in command


def test_the_agent_check_port_answers_its_word_and_reads_nothing():
    port = owner_agent.AgentPort("127.0.0.1", 0)
    number = port.sock.getsockname()[1]
    threading.Thread(target=port.serve, daemon=True).start()

    def ask(send: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", number), timeout=5) as c:
            if send:
                c.sendall(send)
            data = b""
            while chunk := c.recv(100):
                data += chunk
            return data

    assert ask(b"") == b"up\n"
    assert ask(b"drain\nset weight 0%\n" * 100) == b"up\n"  # input is never read
    assert not port.drained()
    port.set(owner.WORD_DRAIN)
    assert ask(b"") == b"drain 0%\n" and port.drained()
    port.set(owner.WORD_READY)
    assert ask(b"") == b"ready 100%\n"
    port.set(owner.WORD_DRAIN)
    assert not port.drained()  # a new drain counts its own reads


def test_the_owners_command_refuses_snooze_to_non_root(tmp_path, monkeypatch, capsys):
    files = ["--state-file", str(tmp_path / "s.json"), "--override-file", str(tmp_path / "o.json")]
    monkeypatch.setattr(owner_agent.os, "geteuid", lambda: 1000)
    assert owner_agent.main(["owner", *files, "snooze", "2h"]) == 2
    assert "wsl.exe -u root freetoken-owner snooze 2h" in capsys.readouterr().err
    monkeypatch.setattr(owner_agent.os, "geteuid", lambda: 0)
    assert owner_agent.main(["owner", *files, "snooze", "2h;reboot"]) == 2
    assert owner_agent.main(["owner", *files, "snooze", "2h"]) == 0
    assert owner.load_snooze((tmp_path / "o.json").read_text()) is not None
    assert owner_agent.main(["owner", *files, "status"]) == 0
    assert "snoozed: 1 h 59 min left" in capsys.readouterr().out
    assert owner_agent.main(["owner", *files, "resume"]) == 0 and not (tmp_path / "o.json").exists()


def test_the_agent_yields_and_rejoins_on_a_host_of_stand_ins(tmp_path):
    """The agent's loop as a process: a stand-in nvidia-smi (used memory from a file), a stand-in
    systemctl (the engine's state in a file, each call logged) and a stand-in engine on loopback
    (/health, /v1/stats, prepare-stop, each request's key logged). A game appears: `drain 0%`,
    prepare-stop with the key in a header, `systemctl stop`, the reason in the state file; the
    game ends: `systemctl start` after the quiet time, `ready 100%` once /health is ok. Its samples
    for node_exporter follow: the mode and the reason, the engine's counters while it serves (left
    out once it is stopped), the card's memory, the firewall's table (a stand-in nft)."""
    import http.server
    import os
    import subprocess
    import sys
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    used, active, calls = tmp_path / "used", tmp_path / "active", tmp_path / "calls"
    used.write_text("6895\n")
    active.write_text("active")
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\ncat {used}\n")
    (bin_dir / "systemctl").write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\ncase "$1" in\n'
        f'  is-active) test "$(cat {active})" = active ;;\n'
        f"  stop) echo inactive > {active} ;;\n"
        f"  start) echo active > {active} ;;\n"
        "esac\n"
    )
    listing = "table inet freetoken {\n}\n"
    (bin_dir / "nft").write_text(f'#!/bin/sh\n[ "$*" = "list table inet freetoken" ] && printf "{listing}"\n')
    record = tmp_path / "freetoken-firewall.loaded"
    record.write_text(listing)  # what the firewall's unit recorded when it loaded the table
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    key_file = tmp_path / "api-key.env"
    key_file.write_text("FREETOKEN_API_KEY=sekret-key-1234\n")
    seen_keys: list[str] = []
    prepared: list[dict] = []

    class Engine(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _json(self, doc):
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            seen_keys.append(self.headers.get("authorization") or "")
            if self.path == "/health":
                return self._json({"status": "ok"})
            return self._json(
                {"vram_bytes": 6042 * 2**20, "requests": {"completed": 5, "completion_tokens_total": 640}}
            )

        def do_POST(self):
            seen_keys.append(self.headers.get("authorization") or "")
            prepared.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self._json({"drain_complete": True})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        agent_port = s.getsockname()[1]
    state_file, override = tmp_path / "state.json", tmp_path / "override.json"
    script = os.path.join(os.path.dirname(owner_agent.__file__), "owner_agent.py")
    argv = [sys.executable, script, "serve", "--unit", "freetoken.service"]
    argv += ["--engine-url", f"http://127.0.0.1:{server.server_address[1]}", "--key-file", str(key_file)]
    argv += ["--bind", "127.0.0.1", "--port", str(agent_port), "--vram-threshold-gb", "4", "--quiet-s", "1"]
    argv += ["--drain-timeout-s", "2", "--interval-s", "0.1"]
    argv += ["--state-file", str(state_file), "--override-file", str(override), "--nvml-lib", ""]
    textfile = tmp_path / "metrics" / "freetoken_agent.prom"
    textfile.parent.mkdir()
    argv += ["--textfile", str(textfile), "--firewall-record", str(record)]
    proc = subprocess.Popen(
        argv,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def word() -> bytes:
        try:
            with socket.create_connection(("127.0.0.1", agent_port), timeout=2) as c:
                return c.recv(100)
        except OSError:
            return b""

    def metrics() -> dict[str, float]:
        lines = textfile.read_text().splitlines()
        return {k: float(v) for k, _, v in (x.rpartition(" ") for x in lines if not x.startswith("#"))}

    def wait(check, timeout: float = 20):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if check():
                    return True
            except OSError:  # a file the agent has not written yet
                pass
            time.sleep(0.05)
        return False

    try:
        assert wait(lambda: word() == b"up\n")
        assert wait(lambda: metrics().get("freetoken_engine_requests_total") == 5)
        serving = metrics()
        assert serving['freetoken_agent_mode{mode="serving"}'] == 1 and serving["freetoken_firewall_table_loaded"] == 1
        assert serving['freetoken_agent_yield_reason{reason="game"}'] == 0
        assert serving["freetoken_engine_generated_tokens_total"] == 640
        assert serving["freetoken_gpu_memory_used_bytes"] == 6895 * 2**20  # nvidia-smi: no total, no power
        assert serving['freetoken_agent_signal_up{signal="gpu"}'] == 1
        used.write_text(str(6895 + 12 * 1024) + "\n")  # the game
        assert wait(lambda: word() == b"drain 0% up #yielded (game)\n")  # read by "the gateway": the stop may go on
        assert wait(lambda: "stop freetoken.service" in calls.read_text())
        assert prepared == [{"drain_timeout_s": 2.0, "abort_timeout_s": 3.0}]
        # the state is written just after the stop returns: wait for it (a busy machine lags)
        assert wait(lambda: owner.load_state(state_file.read_text()).mode == "yielded")
        state = owner.load_state(state_file.read_text())
        assert state.mode == "yielded" and "held by other processes" in state.reason
        assert oct(state_file.stat().st_mode & 0o777) == "0o644"
        # the stopped engine's counters are left out, never 0 (the stand-in still answers)
        assert wait(lambda: "freetoken_engine_requests_total" not in metrics())
        yielded = metrics()
        assert (
            yielded['freetoken_agent_mode{mode="yielded"}'] == 1
            and yielded['freetoken_agent_mode{mode="serving"}'] == 0
        )
        assert yielded['freetoken_agent_yield_reason{reason="game"}'] == 1
        assert yielded["freetoken_gpu_memory_used_bytes"] == (6895 + 12 * 1024) * 2**20
        assert sorted(os.listdir(textfile.parent)) == [textfile.name]  # no temporary file left
        used.write_text("853\n")  # the game ends
        assert wait(lambda: "start freetoken.service" in calls.read_text())
        assert wait(lambda: word() == b"ready 100%\n")
        assert wait(lambda: owner.load_state(state_file.read_text()).mode == "serving")  # written after
        assert wait(lambda: metrics().get('freetoken_agent_mode{mode="serving"}') == 1)
        assert metrics()['freetoken_agent_yield_reason{reason="game"}'] == 0
        # every request that needed it carried the key in a header; /health none needed
        assert "Bearer sekret-key-1234" in seen_keys
    finally:
        proc.terminate()
        out = proc.communicate(timeout=10)[0]
        server.shutdown()
    assert "serving -> yielding" in out and "engine stopped" in out and "engine started" in out, out
    # the key it read from its file went only into those headers: not into a command it ran
    # (each logged with its arguments), its log, or its state file
    assert "sekret" not in calls.read_text() and "sekret" not in out
    assert "sekret" not in state_file.read_text()


def test_an_idle_engine_that_reports_no_vram_yet_is_weighed_by_what_it_took_at_its_start():
    """FreeToken 0.2.1 reports vram_bytes only once it served a request: before that the agent
    takes what the card's used memory grew by when the engine came up."""
    state = AgentState()
    state, _ = step(state, seen(0, used=853, active=False), POLICY)  # stopped: the card holds 853
    state, _ = step(state, seen(1, used=853, engine_vram_mib=None, health_ok=False), POLICY)  # loading
    assert state.engine_mib is None
    state, _ = step(state, seen(2, used=CARD_IDLE_MIB, engine_vram_mib=None), POLICY)  # healthy: learnt
    assert state.engine_mib == ENGINE_MIB and state.others_mib == 853
    state, _ = step(state, seen(3, used=CARD_IDLE_MIB + 5000, engine_vram_mib=None), POLICY)
    assert state.engine_mib == ENGINE_MIB  # learnt once: the game is not the engine's
    state, action = step(state, seen(4, used=CARD_IDLE_MIB + GAME_MIB, engine_vram_mib=None), POLICY)
    assert state.mode == "yielding" and action is None
    # never seen stopped (the agent came after the engine) and no figure from it: unknown, no claim
    fresh, _ = step(AgentState(), seen(0, used=30000, engine_vram_mib=None), POLICY)
    assert fresh.mode == "serving"


def test_the_agent_takes_the_port_systemd_holds_for_it():
    """freetoken-agent.socket: systemd binds the agent-check port at boot and hands the agent the
    listening socket (fd 3, LISTEN_FDS=1 for its own pid); the agent binds nothing itself then."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "operations" / "scripts" / "owner_agent.py"
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(4)
    code = (
        "import importlib.util, sys;"
        f"spec = importlib.util.spec_from_file_location('agent', {str(script)!r});"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
        "p = m.AgentPort('127.0.0.1', 1);"  # port 1 would need root: only the held socket works
        "print(p.sock.getsockname()[1])"
    )
    # As systemd starts it: the socket at fd 3, LISTEN_PID its own pid (exec keeps the pid).
    launcher = (
        f"import os, sys; os.dup2({held.fileno()}, 3); os.environ['LISTEN_PID'] = str(os.getpid()); "
        "os.environ['LISTEN_FDS'] = '1'; os.execv(sys.executable, [sys.executable, '-c', sys.argv[1]])"
    )
    run = subprocess.run(
        [sys.executable, "-c", launcher, code],
        pass_fds=(held.fileno(),),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.strip()) == held.getsockname()[1]
    held.close()


@pytest.mark.parametrize("said", [2**30 * 1024, 10**30, -5, "6042", 6042.5, True, None])
def test_an_engine_lying_about_its_vram_hides_no_game(said):
    """The engine is untrusted (it parses LAN requests): what it says it holds counts only up to
    what the card's used memory grew by when it came up. Claiming 1 PiB (or anything else) while
    the owner's game holds 12 GiB still yields the GPU."""
    state = AgentState()
    state, _ = step(state, seen(0, used=853, active=False), POLICY)  # stopped: the idle baseline
    state, _ = step(state, seen(1, used=CARD_IDLE_MIB, engine_vram_mib=said), POLICY)  # up and healthy
    assert state.engine_mib == ENGINE_MIB and state.mode == "serving"
    state, action = step(state, seen(2, used=CARD_IDLE_MIB + GAME_MIB, engine_vram_mib=said), POLICY)
    assert state.mode == "yielding" and state.others_mib == 853 + GAME_MIB
    state, action = step(state, seen(9, used=CARD_IDLE_MIB + GAME_MIB, engine_vram_mib=said), POLICY)
    assert action == STOP


def test_the_engines_share_is_bounded_by_the_card_before_its_growth_is_learnt():
    # not learnt yet (loading), the idle baseline known: at most used less the baseline
    obs = seen(0, used=853 + 3000, engine_vram_mib=2**30, health_ok=False)
    assert owner.engine_share_mib(obs, None, 853) == 3000
    # no baseline either (the agent came after the engine): never more than the card's used memory
    assert owner.engine_share_mib(obs, None, None) == 853 + 3000
    # an honest figure below the card's growth is taken as it is
    assert owner.engine_share_mib(seen(0, engine_vram_mib=5000), ENGINE_MIB, 853) == 5000
    assert others_mib(seen(0, used=CARD_IDLE_MIB + GAME_MIB, engine_vram_mib=2**30), ENGINE_MIB, 853) == 853 + GAME_MIB


def test_the_agent_operation_makes_the_textfile_folder_and_uploads_the_metrics_module():
    """With node_exporter the metrics folder exists before the unit (its ReadWritePaths=) starts,
    and ``agent_metrics.py`` lies beside the script; a converged host gets nothing."""
    from facts.windows import WslConfFile
    from freetoken_infra.core import agent_metrics, hostio
    from freetoken_infra.core.layout import AGENT_METRICS_MODULE, AGENT_SOCKET, AGENT_UNIT, HOSTIO_MODULE, OWNER_MODULE
    from tests.unit.fakehost import FakeHost

    settings = Settings(owner_shortcuts=False)
    facts = {"WslConfFile": WslConfFile.default()}
    cmds = FakeHost(facts=facts).commands(owner_op.agent, settings, firewall=True)
    folder = "/var/lib/freetoken-deploy/metrics"
    assert f"mkdir -p {folder}" in cmds and f"upload {AGENT_METRICS_MODULE}" in cmds
    assert cmds.index(f"mkdir -p {folder}") < cmds.index(f"upload {owner_op.UNIT_PATH}")
    assert cmds.index(f"upload {AGENT_METRICS_MODULE}") < cmds.index(f"systemctl start {AGENT_UNIT}")
    unit = owner_op.agent_unit(settings, firewall=True)
    converged = FakeHost(
        files={
            HOSTIO_MODULE: open(hostio.__file__).read(),
            OWNER_MODULE: open(owner.__file__).read(),
            AGENT_METRICS_MODULE: open(agent_metrics.__file__).read(),
            AGENT_SCRIPT: (open(owner_agent.__file__).read(), 755),
            owner_op.OWNER_COMMAND: (owner_op.owner_command(), 755),
            owner_op.UNIT_PATH: unit,
            owner_op.SOCKET_PATH: owner_op.agent_socket_unit(settings),
        },
        dirs={folder},
        running={AGENT_UNIT, AGENT_SOCKET},
        enabled={AGENT_UNIT, AGENT_SOCKET},
        facts=facts,
    )
    assert converged.commands(owner_op.agent, settings, firewall=True) == []
    # without node_exporter: no folder made, none written
    cmds = FakeHost(facts=facts).commands(owner_op.agent, Settings(owner_shortcuts=False, node_exporter_enabled=False))
    assert not any(folder in c for c in cmds)
