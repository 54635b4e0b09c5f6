"""Wake-on-LAN under a policy: the gateway host's waker wakes a
sleeping workstation when the gateway's queue builds, and only one its owner has not taken back.

ws1 and ws2 behind the gateway host (the shared gateway fleet), ws2 with `wake_on_lan_mac` (its
eth0's MAC, given to the inventory by the harness). ws2 is powered off (its container stopped: a sleeping PC), and the
harness's listener on the bridge (STAND-IN for its network card, tests/fleet/harness.py
WakeListener) boots it when a magic packet for its MAC arrives. A load through the gateway with
more clients than ws1's slots builds a queue; measured and printed: the time from the queue
building (the load's start) to the magic packet, to ws2 booted, to ws2 in service at the gateway
and to the first request ws2 served. Then ws2 snoozed by its owner (its agent says drain) and
asleep again: the same queue wakes nobody, and the waker says why."""

from __future__ import annotations

import time

import pytest

from tests.fleet import harness
from tests.fleet.client import wait_until
from tests.fleet.gateway_load import CLIENT_KEY, PORT, Load, Watcher, pyinfra, summary
from tests.fleet.profiles import GATEWAY_ADDRESS, GATEWAY_NAME

pytestmark = pytest.mark.fleet

COOLDOWN_S = 20  # short here, so the second test sees the drain, not the cooldown, keep ws2 asleep


@pytest.fixture(scope="module")
def fleet(gateway_fleet):
    """The shared gateway fleet (tests/fleet/conftest.py), ws2 with `wake_on_lan_mac` and the
    gateway converged again for it (its waker's targets, a short cooldown); afterwards ws2 is
    awake and resumed, and the gateway converged back without it."""
    sim_fleet = gateway_fleet.up()["fleet"]
    gateway = ["inventories/sim.py", "deploys/gateway.py", "--limit", "gateway"]
    mac = harness.set_wake_on_lan("ws2")
    try:
        gw = pyinfra(*gateway_fleet.args(), "--data", f"wake_on_lan_cooldown_s={COOLDOWN_S}", *gateway)
        assert gw.returncode == 0, "the gateway did not converge with ws2's waking"
        yield sim_fleet, mac
    finally:
        state = sim_fleet.state["hosts"]["ws2"]
        if not (state.get("pid") and harness._alive(state["pid"])):
            sim_fleet.power_on("ws2")
        sim_fleet.run("ws2", "freetoken-owner resume")
        harness.set_wake_on_lan("ws2", False)
        back = pyinfra(*gateway_fleet.args(), *gateway)
        assert back.returncode == 0, "the gateway did not converge back without ws2's waking"


def waker_journal(fleet) -> str:
    return fleet.run(GATEWAY_NAME, "journalctl -u freetoken-waker.service -o cat --no-pager | tail -30").stdout


def test_the_waker_runs_as_its_own_user_with_a_read_only_socket(fleet):
    fleet, mac = fleet
    gw = GATEWAY_NAME
    assert fleet.run(gw, "systemctl is-active freetoken-waker.service").stdout.strip() == "active"
    show = fleet.run(gw, "systemctl show -p User -p CapabilityBoundingSet freetoken-waker.service").stdout
    assert "User=freetoken-waker" in show and "CapabilityBoundingSet=\n" in show + "\n", show
    config = fleet.run(gw, "cat /etc/freetoken/waker.json", check=True).stdout
    assert f'"mac": "{mac}"' in config and '"name": "ws2"' in config and '"ws1"' not in config
    assert fleet.run(gw, "stat -c '%U %a' /run/haproxy/freetoken-waker.sock").stdout.split() == [
        "freetoken-waker",
        "600",
    ]
    # Its socket reads the stats, and changes nothing: the runtime API's admin commands are refused.
    as_waker = "setpriv --reuid=freetoken-waker --regid=freetoken-waker --clear-groups socat stdio "
    stat = fleet.run(gw, f"echo 'show stat' | {as_waker} /run/haproxy/freetoken-waker.sock").stdout
    assert stat.startswith("# pxname,svname,") and "freetoken,ws2," in stat, stat[:500]
    refused = fleet.run(gw, f"echo 'disable server freetoken/ws1' | {as_waker} /run/haproxy/freetoken-waker.sock")
    assert "Permission denied" in refused.stdout, refused.stdout
    admin = fleet.run(gw, f"echo 'show stat' | {as_waker} /run/haproxy/admin.sock")
    assert admin.returncode != 0 and "freetoken,ws1," not in admin.stdout


def test_the_doctor_says_what_the_owner_must_switch_on_for_wake_on_lan(fleet):
    """Through the Windows STAND-INs (PowerShell's Get-NetAdapter, powercfg.exe): first the
    adapter with ws2's MAC does not wake on a magic packet, then the owner switched it on."""
    fleet, mac = fleet

    def finding() -> str:
        run = pyinfra("--limit", "ws2", "inventories/sim.py", "deploys/doctor.py", quiet=True)
        text = " ".join((run.stdout + run.stderr).split())
        return text[text.index("wake_on_lan ") : text.index("== fleet preflight summary")]

    try:
        off = finding()
        fleet.run("ws2", "touch /mnt/c/.sim/wol-armed", check=True)
        on = finding()
    finally:
        fleet.run("ws2", "rm -f /mnt/c/.sim/wol-armed")
    print(f"\nbefore: {off}\nafter: {on}")
    assert off.startswith(
        f"wake_on_lan WARN Ethernet (Intel(R) Ethernet Controller I225-V, {mac}): its WakeOnMagicPacket"
    )
    assert "Wake on Magic Packet enabled" in off and "firmware" in off
    assert on.startswith(f"wake_on_lan pass Ethernet (Intel(R) Ethernet Controller I225-V, {mac}) wakes on a magic")


def test_a_queue_wakes_the_sleeping_host_and_it_serves(fleet):
    fleet, mac = fleet
    watcher = Watcher(fleet.ssh_argv(GATEWAY_NAME))
    try:
        wait_until("ws1 and ws2 in service", lambda: watcher.status("ws1") == "UP" == watcher.status("ws2"), 90)
        with harness.WakeListener(fleet) as listener:
            off = time.time()
            fleet.power_off("ws2")  # the PC sleeps
            assert watcher.wait_for("ws2", lambda s: s.startswith("DOWN"), off, 20) is not None
            time.sleep(2)  # no queue, no packet
            assert listener.packets == []
            with Load(GATEWAY_ADDRESS, PORT, CLIENT_KEY, clients=10, max_tokens=48, max_seconds=240) as load:
                queue = time.time()  # ten clients on ws1's slots: the queue builds at once
                wait_until("a magic packet for ws2", lambda: any(m == mac for _, m, _ in listener.packets), 30)
                wait_until("ws2 booted", lambda: bool(listener.boots), 120)
                up = watcher.wait_for("ws2", lambda s: s == "UP", queue, 180)
                assert up is not None, "ws2 did not come back in service"
                served = wait_until(
                    "a request served by ws2",
                    lambda: any(o.ok and o.host == "ws2" and o.t0 >= up - 1 for o in list(load.outcomes)),
                    60,
                )
            outcomes = load.stop()
    finally:
        print("\nwaker journal:\n" + waker_journal(fleet))
        watcher.close()
    packet_at = min(t for t, m, _ in listener.packets if m == mac)
    (name, _, booted) = listener.boots[0]
    result = summary(outcomes)
    print(
        f"wake: the queue built at 0.00 s; magic packet for {name} at {packet_at - queue:.2f} s, "
        f"booted at {booted - queue:.2f} s, in service at the gateway at {up - queue:.2f} s, "
        f"first request it served at {served - queue:.2f} s (queue to serving); "
        f"{result['requests']} requests, {result['ok']} ok, by host {result['by_host']}, "
        f"failed before streaming {len(result['failed_before_streaming'])}, "
        f"cut while streaming {len(result['failed_while_streaming'])}"
    )
    assert name == "ws2" and booted is not None
    assert [m for _, m, _ in listener.packets] == [mac], "one packet, for ws2 alone"
    assert result["failed_while_streaming"] == []
    assert "waking ws2" in waker_journal(fleet)


def test_a_host_its_owner_snoozed_is_not_woken(fleet):
    fleet, mac = fleet
    watcher = Watcher(fleet.ssh_argv(GATEWAY_NAME))
    try:
        wait_until("ws2 in service", lambda: watcher.status("ws2") == "UP", 120)
        t0 = time.time()
        fleet.run("ws2", "freetoken-owner snooze 2h", check=True)  # its agent says drain
        assert watcher.wait_for("ws2", lambda s: s != "UP", t0, 30) is not None
        time.sleep(3)
        rows = fleet.run(GATEWAY_NAME, "echo 'show stat' | socat stdio /run/haproxy/admin.sock").stdout.splitlines()
        print(
            "\nshow stat while ws2 is snoozed:\n" + "\n".join(r for r in rows if r.startswith(("# ", "freetoken,ws2,")))
        )
        time.sleep(COOLDOWN_S)  # the last wake's cooldown is over: only the drain keeps it asleep
        with harness.WakeListener(fleet) as listener:
            fleet.power_off("ws2")
            with Load(GATEWAY_ADDRESS, PORT, CLIENT_KEY, clients=10, max_tokens=48, max_seconds=60):
                time.sleep(15)  # the queue builds and stays
            assert listener.packets == [], "a snoozed host was woken"
    finally:
        journal = waker_journal(fleet)
        print("\nwaker journal:\n" + journal)
        watcher.close()
    assert "ws2 (its agent said 'drain" in journal, journal
