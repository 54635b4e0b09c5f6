"""The owner comes first (issue 22 items 1, 2 and 7): the host agent on ws1 yields the GPU to its
owner under a steady load through the gateway, and ws1 rejoins once the owner is done.

ws1 and ws2 converge behind the gateway host (the fixture of tests/fleet/test_gateway.py, with a
short owner_quiet_s), a load of streamed chat completions runs through the gateway, and the
owner's game appears on ws1: the nvidia-smi stand-in's used memory (/.sim/gpu-memory-used-mib;
under WSL nvidia-smi names no Windows process, microsoft/WSL#7162). Measured: the game to ws1
drained at the gateway, and to its engine stopped (goal: at most 10 s); client errors (goal: none
for requests that had not started, none cut mid-stream); the game's end to ws1 back in service
(goal: at most 30 s after the quiet time). Then the owner's own override: `freetoken-owner snooze`
and `resume`. At the end the gateway host is removed and ws1/ws2 converge back to the defaults."""

from __future__ import annotations

import time

import pytest

from tests.fleet import client, harness
from tests.fleet.gateway_load import CLIENT_KEY, PORT, Load, Watcher, converge_behind_gateway, summary, write_keys
from tests.fleet.profiles import GATEWAY_ADDRESS, GATEWAY_NAME, PROFILES

pytestmark = pytest.mark.fleet

QUIET_S = 5
GAME = "/.sim/gpu-memory-used-mib"
ENGINE = "freetoken.service"


@pytest.fixture(scope="module")
def gateway(sim_fleet, tmp_path_factory):
    keys = write_keys(tmp_path_factory.mktemp("owner") / "keys")
    harness.start_gateway()
    try:
        hosts, first = converge_behind_gateway(keys, ["--data", f"owner_quiet_s={QUIET_S}"])
        assert hosts.returncode == 0, "the workstations did not converge behind the gateway"
        assert first.returncode == 0, "the gateway did not converge"
        yield sim_fleet
    finally:
        sim_fleet.run("ws1", f"rm -f {GAME}; freetoken-owner resume")
        harness.stop_gateway()
        # Back to the default settings (engines on loopback), as the other modules expect them.
        client.deploy("--limit", "ws1", "--limit", "ws2")


def engine_active(fleet, host: str) -> bool:
    return fleet.run(host, f"systemctl is-active --quiet {ENGINE}").returncode == 0


def wait_until(what: str, check, timeout: float, poll: float = 0.2) -> float:
    """The time `check()` first held; fails naming `what` after `timeout`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return time.time()
        time.sleep(poll)
    raise AssertionError(f"{what}: not within {timeout} s")


def in_service(watcher: Watcher, *hosts: str) -> bool:
    return all(watcher.status(h) == "UP" for h in hosts)


def test_ws1_yields_to_its_owners_game_under_load_and_rejoins_after_the_quiet_time(gateway):
    fleet = gateway
    total = PROFILES["ws1"].gpu.memory_total_mib
    watcher = Watcher(fleet.ssh_argv(GATEWAY_NAME))
    try:
        wait_until("ws1 and ws2 in service", lambda: in_service(watcher, "ws1", "ws2"), 60)
        with Load(GATEWAY_ADDRESS, PORT, CLIENT_KEY, clients=4, max_tokens=12, max_seconds=180) as load:
            time.sleep(3)
            game = time.time()
            fleet.run("ws1", f"echo {total - 1024} > {GAME}", check=True)  # all but 1 GiB of the card
            drained = watcher.wait_for("ws1", lambda s: s != "UP", game, 20)
            stopped = wait_until("ws1's engine stopped", lambda: not engine_active(fleet, "ws1"), 20)
            status = fleet.run("ws1", "freetoken-owner status", check=True).stdout
            time.sleep(3)  # the load goes on, on ws2 alone
            over = time.time()
            fleet.run("ws1", f"rm -f {GAME}", check=True)
            back = watcher.wait_for("ws1", lambda s: s == "UP", over, QUIET_S + 60)
            time.sleep(3)  # ws1 serves again under the load
        outcomes = load.stop()
    finally:
        journal = fleet.run("ws1", "journalctl -u freetoken-agent.service -o cat --no-pager | tail -20").stdout
        print(f"\nagent journal:\n{journal}")
        fleet.run("ws1", f"rm -f {GAME}")  # the next test starts without the game
        watcher.close()
    result = summary(outcomes)
    after = [o for o in outcomes if back and o.ok and o.t0 > back]
    print(f"\nstatus while yielded:\n{status}")

    def secs(t: float | None, since: float) -> str:
        return "never" if t is None else f"{t - since:.2f} s"

    print(
        f"yield: drained at the gateway {secs(drained, game)} and the engine stopped "
        f"{secs(stopped, game)} after the game started; back in service {secs(back, over)} "
        f"after it ended (owner_quiet_s {QUIET_S}); "
        f"{result['requests']} requests, {result['ok']} ok, by host {result['by_host']}, "
        f"failed before streaming {result['failed_before_streaming']}, "
        f"cut while streaming {result['failed_while_streaming']}"
    )
    assert drained is not None and drained - game <= 10, "ws1 was not drained within 10 s"
    assert stopped - game <= 10, "ws1's engine did not stop within 10 s"
    assert "state:   yielded" in status and "held by other processes" in status, status
    assert result["failed_before_streaming"] == []
    assert result["failed_while_streaming"] == []
    assert back is not None and back - over <= QUIET_S + 30, "ws1 not back in service within 30 s of the quiet time"
    assert any(o.host == "ws1" for o in after), "ws1 served nothing after it came back"


def test_the_owners_snooze_takes_ws1_out_and_resume_brings_it_back(gateway):
    fleet = gateway
    watcher = Watcher(fleet.ssh_argv(GATEWAY_NAME))
    try:
        wait_until("ws1 and ws2 in service", lambda: in_service(watcher, "ws1", "ws2"), 60)
        # Only root may snooze; the message says how (from Windows too).
        refused = fleet.run("ws1", "setpriv --reuid=65534 --regid=65534 --clear-groups freetoken-owner snooze 2h")
        assert refused.returncode == 2 and "wsl.exe -u root freetoken-owner snooze 2h" in refused.stderr
        assert fleet.run("ws1", "freetoken-owner snooze 1x").returncode == 2
        t0 = time.time()
        fleet.run("ws1", "freetoken-owner snooze 2h", check=True)
        wait_until("ws1's engine stopped by the snooze", lambda: not engine_active(fleet, "ws1"), 20)
        assert watcher.wait_for("ws1", lambda s: s != "UP", t0, 20) is not None
        status = fleet.run("ws1", "freetoken-owner status", check=True).stdout
        assert "state:   yielded" in status and "snoozed by the owner" in status and "h " in status, status
        t1 = time.time()
        fleet.run("ws1", "freetoken-owner resume", check=True)
        back = watcher.wait_for("ws1", lambda s: s == "UP", t1, QUIET_S + 60)
        print(f"\nsnooze status:\n{status}\nresume to back in service: {back - t1 if back else None} s")
        assert back is not None
        assert "state:   serving" in fleet.run("ws1", "freetoken-owner status", check=True).stdout
    finally:
        print(fleet.run("ws1", "journalctl -u freetoken-agent.service -o cat --no-pager | tail -12").stdout)
        fleet.run("ws1", "freetoken-owner resume")
        watcher.close()
