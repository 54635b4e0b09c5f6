"""The waker's policy: when the gateway's queue has built, wake one parked host
that its owner has not taken back, one at a time, each with a cooldown. Pure functions."""

from __future__ import annotations

import socket

import pytest

from freetoken_infra.core import wol as waker
from freetoken_infra.core.wol import Memory, Policy, Reading, Server, Target, step

HEADER = "# pxname,svname,qcur,qmax,scur,status,weight,check_status,last_chk,last_agt,agent_status,agent_code\n"


def stat(*rows: str) -> str:
    return HEADER + "".join(r + "\n" for r in rows)


def up(name, queue=0, word="up"):
    return Server(name, "UP", queue, True, word)


def asleep(name):  # the agent's port does not answer: its last word is the waker's memory
    return Server(name, "DOWN", 0, False, "")


WS2 = Target("ws2", "52:54:00:12:34:56")
WS3 = Target("ws3", "52:54:00:12:34:57")


def built(memory: Memory, reading: Reading, targets, start=100.0, policy=None):
    """Readings once a second from ``start`` until the queue has built (or a host is chosen)."""
    policy = policy or Policy()
    now = start
    for _ in range(10):
        memory, chosen, why = step(memory, reading, targets, now, policy)
        if chosen or now - start >= policy.queue_built_s:
            return memory, chosen, why, now
        now += 1.0
    raise AssertionError(why)


def test_a_queue_that_lasts_wakes_one_sleeping_host():
    reading = Reading(4, (up("ws1"), asleep("ws2"), asleep("ws3")))
    memory, chosen, why = step(Memory(), reading, (WS2, WS3), 100.0)
    assert chosen is None and why == "queue 4 for 0.0 s"
    memory, chosen, _ = step(memory, reading, (WS2, WS3), 102.9)
    assert chosen is None
    memory, chosen, why = step(memory, reading, (WS2, WS3), 103.0)
    assert chosen == WS2 and why == "queue 4 for 3.0 s: waking ws2 (52:54:00:12:34:56)"
    assert memory.woken_at == {"ws2": 103.0} and memory.queued_since is None and memory.booting == {"ws2": 103.0}


def test_a_queue_that_empties_starts_the_count_again():
    reading = Reading(2, (up("ws1"), asleep("ws2")))
    memory, _, _ = step(Memory(), reading, (WS2,), 100.0)
    memory, _, why = step(memory, Reading(0, reading.servers), (WS2,), 102.0)
    assert why == "no queue" and memory.queued_since is None
    memory, chosen, _ = step(memory, reading, (WS2,), 103.5)
    assert chosen is None and memory.queued_since == 103.5


def test_a_host_whose_agent_last_said_drain_is_not_woken():
    # ws2 yielded to its owner's game (the agent answered `drain 0%`), then its PC slept
    memory, _, _ = step(Memory(), Reading(0, (up("ws1"), Server("ws2", "DRAIN", 0, True, "drain 0%"))), (WS2,), 90.0)
    assert memory.last_word["ws2"] == "drain 0%"
    memory, chosen, why, _ = built(memory, Reading(3, (up("ws1"), asleep("ws2"))), (WS2,))
    assert chosen is None and "ws2 (its agent said 'drain 0%')" in why
    # ...a host that last said `ready`/`up` is
    memory, _, _ = step(memory, Reading(0, (up("ws1"), up("ws2", word="ready 100%"))), (WS2,), 200.0)
    memory, chosen, _, _ = built(memory, Reading(3, (up("ws1"), asleep("ws2"))), (WS2,), start=201.0)
    assert chosen == WS2


def test_weight_zero_is_a_drain_that_outlives_the_agents_silence():
    # HAProxy's agent check in the fleet: after `drain 0%` the weight is 0, whatever last_agt
    # says, and it stays 0 once the PC sleeps and its agent answers nothing
    drained = Server("ws2", "DRAIN", 0, True, "", 0)
    memory, _, _ = step(Memory(), Reading(0, (up("ws1"), drained)), (WS2,), 90.0)
    _, chosen, why, _ = built(memory, Reading(3, (up("ws1"), Server("ws2", "DOWN", 0, False, "", 0))), (WS2,))
    assert chosen is None and "ws2 (its agent said 'drain (weight 0)')" in why
    # back in service (weight restored): the drain is forgotten
    memory, _, _ = step(memory, Reading(0, (up("ws1"), Server("ws2", "UP", 0, True, "", 24))), (WS2,), 95.0)
    assert memory.last_word["ws2"] == "up"
    _, chosen, _, _ = built(memory, Reading(3, (up("ws1"), Server("ws2", "DOWN", 0, False, "", 24))), (WS2,))
    assert chosen == WS2


def test_a_drained_row_without_an_agent_counts_as_a_drain():
    memory, _, _ = step(Memory(), Reading(0, (Server("ws2", "DRAIN", 0, False, ""),)), (WS2,), 1.0)
    _, chosen, _, _ = built(memory, Reading(3, (up("ws1"), asleep("ws2"))), (WS2,))
    assert chosen is None


@pytest.mark.parametrize("status", ["MAINT", "DRAIN", "UP", "MAINT (via ws1)", "no check"])
def test_only_a_down_host_is_parked(status):
    reading = Reading(3, (up("ws1"), Server("ws2", status, 0, False, "")))
    _, chosen, _, _ = built(Memory(), reading, (WS2,))
    assert chosen is None


def test_off_schedule_and_no_mac_hosts_are_not_woken():
    reading = Reading(3, (up("ws1"), asleep("ws2"), asleep("ws3")))
    off = Target("ws2", WS2.mac, within_serve_hours=False)
    _, chosen, why, _ = built(Memory(), reading, (off,))  # ws3 has no MAC: not a target
    assert chosen is None and "ws2 (off schedule)" in why


def test_one_host_at_a_time_then_the_next_after_it_came_up_each_with_a_cooldown():
    targets = (WS2, WS3)
    sleeping = Reading(5, (up("ws1"), asleep("ws2"), asleep("ws3")))
    memory, chosen, _, now = built(Memory(), sleeping, targets)
    assert chosen == WS2
    # ws2 boots: no second host while it does, however long the queue stays
    memory, chosen, why, now = built(memory, sleeping, targets, start=now + 1)
    assert chosen is None and why == "queue 5: waiting for ws2 to boot"
    # ws2 up and serving, the queue still builds: ws3 next (ws2 is not parked)
    serving = Reading(5, (up("ws1"), up("ws2"), asleep("ws3")))
    memory, chosen, _, now = built(memory, serving, targets, start=now + 1)
    assert chosen == WS3
    # both asleep again soon after: within the cooldown neither is woken
    memory, _, _ = step(memory, Reading(0, (up("ws1"), up("ws2"), up("ws3"))), targets, now + 400)
    memory, chosen, why, _ = built(memory, sleeping, targets, start=now + 401)
    assert chosen is None and "ws2 (woken" in why and "ws3 (woken" in why
    # after it, the one woken longest ago first
    memory, chosen, _, _ = built(memory, sleeping, targets, start=now + 1000)
    assert chosen == WS2


def test_a_woken_host_seen_up_is_not_waited_for_when_it_sleeps_again():
    # ws2 woken, came up, then its owner snoozed it (drain) and it slept: no "waiting to boot"
    sleeping = Reading(5, (up("ws1"), asleep("ws2")))
    policy = Policy(queue_built_s=3, cooldown_s=10, boot_s=300)
    memory, chosen, _, now = built(Memory(), sleeping, (WS2,), policy=policy)
    assert chosen == WS2 and memory.booting == {"ws2": now}
    memory, _, _ = step(memory, Reading(0, (up("ws1"), up("ws2"))), (WS2,), now + 5, policy)
    assert memory.booting == {}
    memory, _, _ = step(memory, Reading(0, (up("ws1"), Server("ws2", "DRAIN", 0, True, "drain 0%"))), (WS2,), now + 6)
    memory, chosen, why, _ = built(memory, sleeping, (WS2,), start=now + 20, policy=policy)
    assert chosen is None and why.endswith("no host to wake: ws2 (its agent said 'drain 0%')")


def test_a_booting_host_that_never_comes_up_frees_the_turn_after_boot_s():
    sleeping = Reading(5, (up("ws1"), asleep("ws2"), asleep("ws3")))
    policy = Policy(queue_built_s=3, cooldown_s=600, boot_s=60)
    memory, chosen, _, now = built(Memory(), sleeping, (WS2, WS3), policy=policy)
    assert chosen == WS2
    memory, chosen, _, _ = built(memory, sleeping, (WS2, WS3), start=now + 61, policy=policy)
    assert chosen == WS3


def test_show_stat_is_read_by_column_name():
    text = stat(
        "freetoken_engines,ws1,0,0,2,UP,24,L7OK,1,up,L7OK,0",
        "freetoken_engines,ws2,1,1,0,DOWN,24,L4TOUT,1,,L4TOUT,",
        "freetoken_engines,ws3,0,0,0,DRAIN,0,L7OK,1,drain 0%,L7OK,0",
        "freetoken_engines,BACKEND,3,5,2,UP,48,,,,,",
        "freetoken_stats,FRONTEND,,,0,OPEN,,,,,,",
        "other,ws9,7,0,0,UP,1,,,,,",
    )
    reading = waker.read_stat(text, "freetoken_engines")
    assert reading.queue == 4
    assert reading.servers == (
        Server("ws1", "UP", 0, True, "up", 24),
        Server("ws2", "DOWN", 1, False, "", 24),
        Server("ws3", "DRAIN", 0, True, "drain 0%", 0),
    )
    assert waker.read_stat("", "x") == Reading(0, ())
    assert waker.read_stat("Permission denied.\n", "x") == Reading(0, ())


def test_a_host_cannot_make_its_word_long_or_the_queue_huge():
    text = stat(
        "freetoken_engines,ws1,99999999999,0,0,UP,1,L7OK,1," + "x" * 500 + ",L7OK,0",
        "freetoken_engines,BACKEND,-3,0,0,UP,1,,,,,",
    )
    reading = waker.read_stat(text, "freetoken_engines")
    assert reading.queue == 0 and len(reading.servers[0].agent_word) == 160


@pytest.mark.parametrize(
    "text,mac",
    [("52:54:00:AB:cd:EF", "52:54:00:ab:cd:ef"), ("52-54-00-ab-cd-ef", "52:54:00:ab:cd:ef")],
)
def test_mac_addresses_are_validated_and_normalised(text, mac):
    assert waker.parse_mac(text) == mac


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "52:54:00:ab:cd",
        "52:54:00:ab:cd:ef:00",
        "52:54-00:ab:cd:ef",
        "ff:ff:ff:ff:ff:ff",
        "01:00:5e:00:00:01",
        "00:00:00:00:00:00",
        "52:54:00:ab:cd:eg",
        "5254.00ab.cdef",
        "52:54:00:ab:cd:ef\n",
        " 52:54:00:ab:cd:ef",
        "52:54:00:ab:cd:ef; rm -rf /",
    ],
)
def test_what_is_not_a_unicast_mac_is_refused(bad):
    with pytest.raises(waker.MacError):
        waker.parse_mac(bad)


def test_the_magic_packet_and_its_reader():
    packet = waker.magic_packet("52:54:00:12:34:56")
    assert len(packet) == 102 and packet[:6] == b"\xff" * 6
    assert packet[6:12] == bytes.fromhex("525400123456") and packet[-6:] == bytes.fromhex("525400123456")
    assert waker.packet_mac(packet) == "52:54:00:12:34:56"
    assert waker.packet_mac(packet[:101]) is None
    assert waker.packet_mac(packet[:51] + b"\xaa" + packet[52:]) is None


def test_the_magic_packet_goes_out_as_a_udp_datagram_without_root():
    # what the waker's send does, to a listener on this machine (broadcast needs SO_BROADCAST)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.settimeout(5)
        from operations.scripts import waker as script

        script.send_magic_packet("52:54:00:12:34:56", "127.0.0.1", listener.getsockname()[1])
        data, _ = listener.recvfrom(2048)
    assert waker.packet_mac(data) == "52:54:00:12:34:56"


# ---- the gateway's side: which hosts, the config, the unit, HAProxy's socket for the waker


def test_targets_are_serving_hosts_with_a_mac_and_one_mac_is_one_host():
    from freetoken_infra.core.settings import Settings
    from operations import waker as op

    every = {
        "ws2": Settings(wake_on_lan_mac="52:54:00:12:34:56"),
        "ws1": Settings(),
        "gw": Settings(runs_engine=False, wake_on_lan_mac="52:54:00:12:34:99"),
    }
    assert op.targets(every) == [{"name": "ws2", "mac": "52:54:00:12:34:56", "serve_hours": None}]
    every["ws3"] = Settings(wake_on_lan_mac="52-54-00-12-34-56")
    with pytest.raises(ValueError, match="hosts ws2 and ws3: the same wake_on_lan_mac 52:54:00:12:34:56"):
        op.targets(every)


def test_the_waker_reads_each_hosts_serve_hours_against_the_clock(tmp_path):
    """A host off its owner's schedule is not woken; one without serve_hours is
    woken at any hour. Read in the gateway's local time, each time the waker decides."""
    import time

    from freetoken_infra.core.settings import Settings
    from operations import waker as op
    from operations.scripts import waker as script

    every = {
        "ws2": Settings(wake_on_lan_mac="52:54:00:12:34:56", serve_hours="Mon-Fri 18:00-08:00"),
        "ws4": Settings(wake_on_lan_mac="52:54:00:12:34:58"),
    }
    path = tmp_path / "waker.json"
    path.write_text(op.waker_config(Settings(), op.targets(every)))
    config = script.load_config(str(path))

    def at(wday: int, hour: int, minute: int = 0) -> dict[str, bool]:
        now = time.struct_time((2026, 12, 7, hour, minute, 0, wday, 341, 0))
        return {t.name: t.within_serve_hours for t in script.in_their_hours(config["targets"], config["hours"], now)}

    assert at(0, 12) == {"ws2": False, "ws4": True}  # Monday noon: ws2's owner uses it
    assert at(0, 19) == {"ws2": True, "ws4": True}
    assert at(1, 7, 59) == {"ws2": True, "ws4": True}  # Monday's night, into Tuesday
    assert at(5, 20) == {"ws2": False, "ws4": True}  # Saturday: not in its days
    # off schedule, the policy passes it over (ws2 down, a queue built)
    assert [
        t.within_serve_hours
        for t in script.in_their_hours(
            config["targets"], config["hours"], time.struct_time((2026, 12, 7, 12, 0, 0, 0, 341, 0))
        )
    ] == [False, True]
    # a schedule edited into the file is parsed again by the script
    import json

    data = json.loads(path.read_text())
    data["targets"][0]["serve_hours"] = "25:00-26:00"
    path.write_text(json.dumps(data))
    assert script.main(["--config", str(path)]) == 2


def test_a_bad_mac_in_the_settings_names_the_field():
    from pydantic import ValidationError

    from freetoken_infra.core.settings import Settings

    with pytest.raises(ValidationError, match="wake_on_lan_mac"):
        Settings(wake_on_lan_mac="ff:ff:ff:ff:ff:ff")


def test_the_config_round_trips_through_the_script_and_the_unit_has_no_privilege(tmp_path):
    import json

    from freetoken_infra.core.settings import Settings
    from operations import waker as op
    from operations.scripts import waker as script

    gw = Settings(wake_on_lan_broadcast="10.213.0.255", wake_on_lan_queue_s=2, wake_on_lan_cooldown_s=30)
    path = tmp_path / "waker.json"
    path.write_text(op.waker_config(gw, op.targets({"ws2": Settings(wake_on_lan_mac="52:54:00:12:34:56")})))
    config = script.load_config(str(path))
    assert config["broadcast"] == "10.213.0.255" and config["port"] == 9
    assert config["targets"] == (Target("ws2", "52:54:00:12:34:56"),)
    assert config["policy"] == Policy(2.0, 30.0, waker.BOOT_S)
    assert config["socket"] == "/run/haproxy/freetoken-waker.sock" and config["backend"] == "freetoken"
    # a MAC edited into the file is validated again by the script
    data = json.loads(path.read_text())
    data["targets"][0]["mac"] = "ff:ff:ff:ff:ff:ff"
    path.write_text(json.dumps(data))
    assert script.main(["--config", str(path)]) == 2
    unit = op.waker_unit()
    for line in ("User=freetoken-waker", "CapabilityBoundingSet=\n", "NoNewPrivileges=yes", "ProtectSystem=strict"):
        assert line in unit, line
    assert "RestrictAddressFamilies=AF_UNIX AF_INET" in unit


def test_haproxy_gives_the_waker_a_read_only_socket_only_when_there_is_a_host_to_wake():
    from freetoken_infra.core.settings import Settings
    from operations import gateway as gw

    backends = [gw.GatewayBackend("ws1", "10.0.0.11", 8000)]
    line = "stats socket /run/haproxy/freetoken-waker.sock mode 600 user freetoken-waker level user"
    assert line in gw.haproxy_config(Settings(), backends, engine_key=True, waker=True)
    assert "freetoken-waker" not in gw.haproxy_config(Settings(), backends, engine_key=True)


def test_the_script_reads_a_stats_socket_and_sends_one_packet(tmp_path):
    """The waker's loop against a stand-in of HAProxy's stats socket (a queue of 3, ws2 down)."""
    import threading

    from operations.scripts import waker as script

    path = str(tmp_path / "stats.sock")
    text = stat("freetoken,ws1,0,0,2,UP,24,L7OK,1,up,L7OK,0", "freetoken,ws2,0,0,0,DOWN,24,L4TOUT,1,,L4TOUT,")
    text += "freetoken,BACKEND,3,3,2,UP,48,,,,,\n"
    asked: list[bytes] = []

    def haproxy():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(path)
            server.listen()
            while True:
                conn, _ = server.accept()
                with conn:
                    asked.append(conn.recv(100))
                    conn.sendall(text.encode())

    threading.Thread(target=haproxy, daemon=True).start()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.settimeout(5)
        config = {
            "socket": path,
            "backend": "freetoken",
            "broadcast": "127.0.0.1",
            "port": listener.getsockname()[1],
            "targets": (Target("ws2", "52:54:00:12:34:56"),),
            "policy": Policy(queue_built_s=0.2, cooldown_s=600, boot_s=600),
        }
        threading.Thread(target=script.serve, args=(config, 0.05), daemon=True).start()
        data, _ = listener.recvfrom(2048)
        assert waker.packet_mac(data) == "52:54:00:12:34:56"
        listener.settimeout(0.5)
        with pytest.raises(TimeoutError):  # ws2 boots (or not): no second packet
            listener.recvfrom(2048)
    assert asked[0] == b"show stat -1 6 -1\n"


# ---- the doctor's Wake-on-LAN readiness, through interop (stand-ins of PowerShell and powercfg)

MAC = "52:54:00:12:34:56"


def wol_obs(adapters_text: str | None, armed_text: str | None = "HID Keyboard Device\nIntel(R) I225-V\n"):
    from facts.wake_on_lan import WakeOnLanInfo, parse_adapters, parse_wake_armed
    from tests.unit.test_rules import healthy

    info = WakeOnLanInfo(
        parse_adapters(adapters_text) if adapters_text is not None else None,
        parse_wake_armed(armed_text) if armed_text is not None else None,
        None if adapters_text is not None else "powershell.exe not found (no Windows interop)",
    )
    return healthy(wake_on_lan=info)


def wol_finding(obs, mac=MAC):
    from freetoken_infra import rules
    from freetoken_infra.core.settings import Settings

    return rules.check_wake_on_lan(Settings(wake_on_lan_mac=mac), obs)


def test_a_host_without_a_mac_gets_no_wake_on_lan_finding():
    from freetoken_infra import rules
    from freetoken_infra.core.settings import Settings

    assert rules.check_wake_on_lan(Settings(), wol_obs(None)) is None


def test_an_armed_adapter_with_the_mac_passes_and_says_what_wsl_cannot_see():
    f = wol_finding(
        wol_obs("Ethernet|52-54-00-12-34-56|Intel(R) I225-V|Enabled\nWi-Fi|AA-BB-CC-DD-EE-01|AX201|Disabled\n")
    )
    assert f.status == "pass"
    assert f.evidence.startswith("Ethernet (Intel(R) I225-V, 52:54:00:12:34:56) wakes on a magic packet and is armed")
    assert "firmware" in f.evidence and "Fast Startup" in f.evidence


def test_magic_packet_off_or_not_armed_says_what_the_owner_must_switch_on():
    f = wol_finding(wol_obs("Ethernet|52-54-00-12-34-56|Intel(R) I225-V|Disabled\n", "NONE\n"))
    assert f.status == "warn"
    assert "its WakeOnMagicPacket is Disabled; powercfg /devicequery wake_armed does not list it" in f.evidence
    assert "Wake on Magic Packet enabled" in f.remedy and 'powercfg /deviceenablewake "Intel(R) I225-V"' in f.remedy
    assert "firmware" in f.remedy


def test_no_adapter_with_the_mac_or_no_interop_is_a_warning_naming_the_mac():
    f = wol_finding(wol_obs("Wi-Fi|AA-BB-CC-DD-EE-01|AX201|Enabled\n"))
    assert f.status == "warn" and f"no network adapter on Windows has wake_on_lan_mac {MAC}" in f.evidence
    assert "Wi-Fi (aa:bb:cc:dd:ee:01)" in f.evidence
    f = wol_finding(wol_obs(None))
    assert f.status == "warn" and "no Windows interop" in f.evidence


def test_windows_text_is_bounded_and_printable():
    from facts.wake_on_lan import parse_adapters, parse_wake_armed

    (a,) = parse_adapters("Eth\x1b[2Jernet|52-54-00-12-34-56|" + "d" * 200 + "|Enabled\nbad|row\n")
    assert a.name == "Eth?[2Jernet" and len(a.description) == 80 and a.mac == MAC
    assert parse_adapters("x|not-a-mac|y|Enabled\n")[0].mac is None
    assert parse_wake_armed("NONE\n") == () and parse_wake_armed("A\n\nB\n") == ("A", "B")


def test_the_fact_runs_the_stand_ins_through_a_drive_root(tmp_path):
    """The fact's command against the fleet's STAND-INs of powershell.exe and powercfg.exe,
    placed where Windows has them under the automount root."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    from facts.wake_on_lan import WakeOnLanReadiness

    bin_dir = Path(__file__).resolve().parents[1] / "fleet" / "standins" / "bin"
    s32 = tmp_path / "c" / "Windows" / "System32"
    (s32 / "WindowsPowerShell" / "v1.0").mkdir(parents=True)
    for tool in ("_simwin.py", "powershell.exe", "powercfg.exe"):
        shutil.copy(bin_dir / tool, tmp_path / tool)
    os.symlink(tmp_path / "powershell.exe", s32 / "WindowsPowerShell" / "v1.0" / "powershell.exe")
    os.symlink(tmp_path / "powercfg.exe", s32 / "powercfg.exe")
    sim = tmp_path / "sim"
    sim.mkdir()
    (sim / "profile.json").write_text("{}")
    env = dict(os.environ, PATH="/usr/bin:/bin", FREETOKEN_SIM_DIR=str(sim), FREETOKEN_SIM_DRIVE_C=str(tmp_path / "c"))
    command = WakeOnLanReadiness().command(drive_root=str(tmp_path) + "/")

    def run():
        out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env, timeout=60)
        return WakeOnLanReadiness().process(out.stdout.splitlines())

    info = run()
    assert info.error is None and len(info.adapters) == 1 and info.adapters[0].wake_on_magic_packet == "Disabled"
    assert info.wake_armed == ("HID Keyboard Device",)
    (tmp_path / "c" / ".sim" / "wol-armed").touch()
    info = run()
    assert info.adapters[0].wake_on_magic_packet == "Enabled"
    assert info.wake_armed == ("HID Keyboard Device", "Intel(R) Ethernet Controller I225-V")
    assert WakeOnLanReadiness().process(["@@ft:no-interop"]).error.endswith("(no Windows interop)")


def test_the_journal_says_the_same_reason_once():
    from operations.scripts import waker as script

    assert script._gist("queue 7 for 5.0 s, no host to wake") == script._gist("queue 1 for 10.0 s, no host to wake")
    assert script._gist("queue 9: waiting for ws2 to boot") == script._gist("queue 3: waiting for ws2 to boot")
    assert script._gist("queue 9: waiting for ws2 to boot") != script._gist("queue 9: waiting for ws3 to boot")


@pytest.mark.parametrize(
    "last_agt,word",
    [
        ("via agent : up (snoozed)", "drain (snoozed)"),  # seen in the fleet test (HAProxy 2.6)
        ("via agent : up (yielded (app eldenring.exe))", "drain (yielded (app eldenring.exe))"),
        ("via agent : drain", "drain"),
        ("via agent : ready", "ready"),
        ("drain 0%", "drain 0%"),
        ("up", "up"),
        ("", ""),
    ],
)
def test_what_haproxy_shows_of_the_agent_is_read_as_its_word(last_agt, word):
    assert waker.agent_said(last_agt) == word


def test_a_snoozed_host_whose_engine_stopped_is_remembered_as_drained():
    # the fleet run: ws2 DOWN (its engine stopped by the snooze), the agent answering, weight 0
    snoozed = Server("ws2", "DOWN", 0, True, "via agent : up (snoozed)", 0)
    memory, _, _ = step(Memory(), Reading(0, (up("ws1"), snoozed)), (WS2,), 90.0)
    memory, chosen, why, _ = built(memory, Reading(3, (up("ws1"), asleep("ws2"))), (WS2,))
    assert chosen is None and "ws2 (its agent said 'drain (snoozed)')" in why
    # resumed: the agent's `ready 100%`, in service again, then asleep: woken
    memory, _, _ = step(
        memory, Reading(0, (up("ws1"), Server("ws2", "UP", 0, True, "via agent : ready", 24))), (WS2,), 200
    )
    _, chosen, _, _ = built(memory, Reading(3, (up("ws1"), asleep("ws2"))), (WS2,), start=201.0)
    assert chosen == WS2
